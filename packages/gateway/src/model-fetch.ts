import { lookup as dnsLookup, type LookupAddress } from "node:dns";
import type { LookupFunction } from "node:net";
import { isLinkLocalAddress } from "@fleet/contracts";
import { Agent, fetch as undiciFetch } from "undici";

/** The `code` of the error a model call's connection to a link-local address is refused with. */
export const LINK_LOCAL_REFUSED = "EFLEET_LINK_LOCAL";

/**
 * A DNS lookup for the worker's outgoing model calls that refuses a name resolving to a
 * link-local or metadata address (`isLinkLocalAddress`), at the moment the connection is made:
 * a base URL's name checked when the episode starts can resolve elsewhere by its next call
 * (DNS rebinding: a short TTL, then the metadata service). One such address among several
 * refuses the name, as the episode's first check does. An address written in the URL is not
 * looked up: the agent spec's schema refuses link-local ones.
 */
export function guardedLookup(base: LookupFunction = dnsLookup as LookupFunction): LookupFunction {
  return (hostname, options, callback) => {
    base(hostname, options, (err, address, family) => {
      if (err) {
        callback(err, address, family);
        return;
      }
      const addresses: string[] = Array.isArray(address)
        ? (address as LookupAddress[]).map((a) => a.address)
        : [address];
      const bad = addresses.find((a) => isLinkLocalAddress(a));
      if (bad !== undefined) {
        const refused: NodeJS.ErrnoException = new Error(
          `the model endpoint's host ${hostname} resolves to a link-local address (${bad}); refused`,
        );
        refused.code = LINK_LOCAL_REFUSED;
        callback(refused, options.all ? [] : "", family);
        return;
      }
      callback(null, address, family);
    });
  };
}

/** The error (or one of its causes) a refused link-local connection failed with, if it is one. */
export function linkLocalRefusal(err: unknown): Error | null {
  for (let e = err, depth = 0; e instanceof Error && depth < 5; e = e.cause, depth++) {
    if ((e as NodeJS.ErrnoException).code === LINK_LOCAL_REFUSED) return e;
  }
  return null;
}

/** The connection pool `modelFetch` sends through. */
export type ModelDispatcher = Agent;

/**
 * A dispatcher whose connections go through `guardedLookup` (one per lookup, for tests), with no
 * timeout of its own: each caller bounds its call with its signal (the tool-loop's attempt
 * timeout and deadline, the gateway's upstream timeout, the probe's). undici's default, 300 s
 * without response headers, would fail a long generation the caller still waits for, as a
 * connection error (an unreachable upstream: a mask the policy could buy with long answers).
 */
export function guardedDispatcher(lookup: LookupFunction = guardedLookup()): ModelDispatcher {
  return new Agent({ connect: { lookup }, headersTimeout: 0, bodyTimeout: 0 });
}

let shared: ModelDispatcher | undefined;

/**
 * `fetch` for model calls from the worker's host (the tool-loop's, the gateway's upstream calls,
 * the key probe): never connects to a link-local or metadata address, whatever a name resolves
 * to at that moment (see `guardedLookup`). A refused connection fails as any connection error
 * does, with `linkLocalRefusal(err)` finding why.
 */
export function modelFetch(
  url: string,
  init: {
    method: string;
    headers: Record<string, string>;
    body: string;
    signal: AbortSignal;
    redirect: "manual";
  },
  dispatcher?: ModelDispatcher,
): Promise<Response> {
  if (dispatcher === undefined) {
    shared ??= guardedDispatcher();
    dispatcher = shared;
  }
  return undiciFetch(url, { ...init, dispatcher }) as unknown as Promise<Response>;
}
