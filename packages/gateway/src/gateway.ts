import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { capText, readBodyCapped, type Usage } from "@fleet/contracts";
import { redactSecrets } from "@fleet/telemetry";
import { CAP_CODES, type CapLimits, capRefusal } from "./caps.ts";
import { bearerToken, mintToken, parseToken, secretMatches } from "./gateway-token.ts";
import { linkLocalRefusal, type ModelDispatcher, modelFetch } from "./model-fetch.ts";
import { type KeyProbe, probeKey } from "./probe-key.ts";
import {
  CONTEXT_LENGTH_WORDING,
  isGatewayTimeoutStatus,
  isInfraStatus,
  isRefusalStatus,
  isSlowGatewayTimeout,
} from "./status.ts";
import { readCallUsage, UsageMeter } from "./usage-meter.ts";

/** A rollout's usage as the gateway reports it: the contracts `Usage` shape. */
export type UsageSummary = Usage;

export interface GatewayOptions {
  /** The real OpenAI-compatible endpoint, e.g. `http://127.0.0.1:8000/v1` (vLLM). */
  upstreamBaseUrl: string;
  /**
   * Resolves the real credential, called per forwarded call (so a rotated secret is picked up).
   * The value is sent upstream only, as `Authorization: Bearer`; `null`/absent sends none.
   */
  resolveCredential?: () => Promise<string | null | undefined>;
  /** Address to listen on (e.g. the gateway network's host-side IP). */
  host: string;
  /** @defaultValue 0 (an ephemeral port; read it back from `port`) */
  port?: number;
  /**
   * Budget of one upstream call. A call past it is no upstream failure (a long generation looks
   * the same): the upstream's health stays as it was. @defaultValue 600_000
   */
  upstreamTimeoutMs?: number;
  /**
   * Calls one token may forward in any 60 s; more get 429 `rate_limited` from the gateway itself
   * (the upstream's health left as it was). One rollout hammering the upstream with requests it
   * refuses must not make the operator's key rate-limited (and every rollout on it masked).
   * @defaultValue 120
   */
  maxCallsPerMinute?: number;
  /** Largest request body accepted from a client. @defaultValue 4 MiB */
  maxRequestBytes?: number;
  /**
   * How long a proxy's gateway timeout (504, 524, 408) must have taken to leave the upstream's
   * health as it was; sooner, it is an infrastructure failure. @defaultValue `GATEWAY_TIMEOUT_MIN_MS`
   */
  gatewayTimeoutMinMs?: number;
  /** Calls one token may have open at once (reading, forwarding or answering); more get 429. @defaultValue 4 */
  maxConcurrentCalls?: number;
  /** Connections the server holds at once, whoever opened them. @defaultValue 32 */
  maxConnections?: number;
  /** Largest upstream response passed back. @defaultValue 32 MiB */
  maxResponseBytes?: number;
  /** The upstream connections' dispatcher. @defaultValue `modelFetch`'s, which never connects to a link-local address */
  dispatcher?: ModelDispatcher;
}

/** What a rollout may use through the gateway. */
export interface GatewayRegistration extends CapLimits {
  /** The model every call of this rollout is sent with (a client's `model` is overridden). */
  model: string;
}

/** What the rollout's client gets: its bearer token and the OpenAI base URL (`…/v1`). */
export interface GatewayGrant {
  token: string;
  baseUrl: string;
}

export interface ModelGateway {
  /** `http://<host>:<port>` */
  readonly url: string;
  readonly port: number;
  /** Mint a per-rollout token (256-bit secret) with its caps. */
  register(rolloutId: string, registration: GatewayRegistration): GatewayGrant;
  /**
   * Revoke a token: later calls get 401, calls in flight are aborted (and noted as a gap).
   * Returns the usage at revocation; a second revoke returns the same summary.
   * @throws Error for a token this gateway never issued.
   */
  revoke(token: string): UsageSummary;
  /** Usage so far, or `null` for a token this gateway never issued. */
  usage(token: string): UsageSummary | null;
  /** How the upstream fared for this token's calls, or `null` for a token never issued. */
  health(token: string): UpstreamHealth | null;
  /** Stop listening and abort every call in flight. */
  close(): Promise<void>;
}

/**
 * How the upstream fared for one token's calls. An infrastructure failure is the upstream being
 * unreachable, a 5xx, a 429, or a 401/403 (the operator's credential refused); any other answer,
 * a 4xx about the request included, is the upstream answering. A call with no answer within the
 * gateway's budget is neither (a long generation looks the same).
 */
export interface UpstreamHealth {
  answered: number;
  infraFailures: number;
  /** The last call's infrastructure failure, or null when the last call was answered (or none was made). */
  lastInfraFailure: string | null;
  /**
   * Why a call was never sent: the upstream's name resolved to a link-local or metadata address
   * (`modelFetch`). The agent spec's endpoint, neither the upstream failing nor the agent's work:
   * the run fails `agent_error`, as the tool-loop's does.
   */
  refusedEndpoint?: string | null;
}

/**
 * The gateway's refusals of a request for the agent's own doing: they clear the upstream's last
 * failure. Not the call cap nor the rate limit: the calls they count include the ones the
 * upstream failed, so an agent retrying a failing upstream reaches them (and stays masked).
 */
const AGENTS_OWN_REFUSALS = new Set([
  "malformed",
  "stream_unsupported",
  "payload_too_large",
  "token_cap_exceeded",
  "token_cap_too_small",
]);

/** An upstream header passed on to the agent only in a form that cannot carry anything else. */
function safeRetryAfter(value: string | null): string | null {
  const v = value?.trim() ?? "";
  // Delay-seconds (fractions too, as some upstreams send and the fleet's own clients read), or an
  // HTTP date (IMF-fixdate, the one form senders must use).
  return /^\d{1,9}(\.\d{1,3})?$/.test(v) ||
    /^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$/.test(v)
    ? v
    : null;
}

/** Media types an upstream's answer is passed on as; any other is named JSON's, as none is. */
const PASSED_MEDIA_TYPES = new Set([
  "application/json",
  "application/problem+json",
  "text/plain",
  "text/html",
  "text/event-stream",
]);

/** The upstream's media type alone (no parameter, nothing but a known type), else JSON's. */
function safeContentType(value: string | null): string {
  const media = (value ?? "").split(";")[0]!.trim().toLowerCase();
  return PASSED_MEDIA_TYPES.has(media) ? media : "application/json";
}

/** The abort reason of a call whose client closed its connection (the agent abandoned it). */
const CLIENT_GONE = new Error("client disconnected");

/** One HTTP error type, rendered in one place as an OpenAI-style error body. */
export class GatewayHttpError extends Error {
  override readonly name = "GatewayHttpError";
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    /** Seconds for a `Retry-After` header (a refusal that passes). */
    readonly retryAfterS: number | null = null,
  ) {
    super(message);
  }
}

interface Entry {
  rolloutId: string;
  keyId: string;
  secretHash: Buffer;
  registration: GatewayRegistration;
  meter: UsageMeter;
  /** Calls admitted and not yet answered (they count against the call cap). */
  pending: number;
  /** When this token's recent calls were forwarded (the last 60 s: `maxCallsPerMinute`). */
  recent: number[];
  /** Completion tokens the calls in flight may still use (their clamped limits: `clampCompletion`). */
  reservedTokens: number;
  /** Probe requests sent after a 403 (`probeKey`). */
  probes: number;
  /** Calls open right now, from authentication to the answer (bounded by `maxConcurrentCalls`). */
  open: number;
  inFlight: Set<AbortController>;
  revoked: UsageSummary | null;
  health: UpstreamHealth;
}

/** The longest delay a Node timer keeps (2^31 - 1 ms, about 24.8 days); longer fires at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

const DEFAULTS = {
  port: 0,
  upstreamTimeoutMs: 600_000,
  maxRequestBytes: 4 * 1024 * 1024,
  maxResponseBytes: 32 * 1024 * 1024,
  maxConcurrentCalls: 4,
  maxConnections: 32,
  maxCallsPerMinute: 120,
};

/**
 * Start a per-rollout model gateway: an OpenAI-compatible HTTP server that authenticates
 * per-rollout tokens, forwards `POST /v1/chat/completions` to the upstream with the real
 * credential, records usage per call and enforces each rollout's call and token caps.
 */
export async function startGateway(options: GatewayOptions): Promise<ModelGateway> {
  const o = { ...DEFAULTS, ...options };
  // As a cap at registration: a NaN compares false, so a bound given as one bounded nothing, and
  // a timeout of a fraction of a millisecond (or none) made AbortSignal.timeout throw at every
  // call, each answered 500 with the upstream's health untouched (the agent's failure graded).
  for (const key of [
    "upstreamTimeoutMs",
    "maxRequestBytes",
    "maxResponseBytes",
    "maxConcurrentCalls",
    "maxConnections",
    "maxCallsPerMinute",
  ] as const) {
    const value = o[key];
    if (!(Number.isSafeInteger(value) && value > 0)) {
      throw new Error(`gateway option ${key} must be a positive integer, got ${value}`);
    }
  }
  // A timer's range: AbortSignal.timeout refuses a timeout over 2^32 - 1 ms (every call a 500)
  // and fires one over 2^31 - 1 after 1 ms (every call an upstream_timeout, the agent's failure
  // graded), as it did a fraction.
  if (o.upstreamTimeoutMs > MAX_TIMER_MS) {
    throw new Error(
      `gateway option upstreamTimeoutMs must be at most ${MAX_TIMER_MS} (a timer's range), got ${o.upstreamTimeoutMs}`,
    );
  }
  const upstreamUrl = `${o.upstreamBaseUrl.replace(/\/+$/, "")}/chat/completions`;
  const entries = new Map<string, Entry>();

  const server: Server = createServer((req, res) => {
    handle(req, res).catch((err: unknown) => sendError(res, err));
  });
  // One sandbox's client talks to this server: a flood of connections is refused, not served
  // until the worker runs out of sockets or memory.
  server.maxConnections = o.maxConnections;

  async function handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    let path: string;
    try {
      path = new URL(req.url ?? "/", "http://gateway").pathname.replace(/\/+$/, "");
    } catch {
      // A request target no URL parser reads (`//[`): the client's, a 400, not a gateway error.
      throw new GatewayHttpError(400, "malformed", "the request target is not a valid path");
    }
    if (path === "/v1/chat/completions") {
      if (req.method !== "POST") throw methodNotAllowed(res, "POST");
      const entry = authenticate(req);
      await chatCompletion(entry, req, res);
      return;
    }
    if (path === "/v1/models") {
      if (req.method !== "GET") throw methodNotAllowed(res, "GET");
      const entry = authenticate(req);
      sendJson(res, 200, {
        object: "list",
        data: [{ id: entry.registration.model, object: "model", created: 0, owned_by: "fleet-gateway" }],
      });
      return;
    }
    // The root's path is empty once its trailing `/` is dropped: named as `/`.
    throw new GatewayHttpError(404, "not_found", `no route ${req.method} ${path || "/"}`);
  }

  function authenticate(req: IncomingMessage): Entry {
    const presented = bearerToken(req.headers.authorization);
    const parsed = presented === null ? null : parseToken(presented);
    const entry = parsed === null ? undefined : entries.get(parsed.keyId);
    if (parsed === null || entry === undefined || !secretMatches(parsed.secret, entry.secretHash)) {
      throw new GatewayHttpError(401, "invalid_api_key", "missing or unknown gateway token");
    }
    if (entry.revoked !== null) throw new GatewayHttpError(401, "invalid_api_key", "gateway token revoked");
    return entry;
  }

  async function chatCompletion(entry: Entry, req: IncomingMessage, res: ServerResponse): Promise<void> {
    try {
      await admitAndForward(entry, req, res);
    } catch (err) {
      // Refused for the agent's own request (malformed, too large, over a cap, asking for an
      // answer over the size bound: `n`, logprobs): the last call failed on the agent, whatever
      // the upstream did before. A concurrency refusal, the call cap, the rate limit (both count
      // calls the upstream failed) and a token total an abandoned call left unknown leave the
      // health as it was; a credential the worker could not resolve and a token cap the
      // upstream's missing usage cannot enforce are upstream failures.
      if (err instanceof GatewayHttpError && AGENTS_OWN_REFUSALS.has(err.code)) {
        entry.health.lastInfraFailure = null;
      }
      throw err;
    }
  }

  async function admitAndForward(entry: Entry, req: IncomingMessage, res: ServerResponse): Promise<void> {
    // Each open call holds its body several times over: the agent gets a few at once, not hundreds.
    if (entry.open >= o.maxConcurrentCalls) {
      throw new GatewayHttpError(
        429,
        "too_many_concurrent_calls",
        `at most ${o.maxConcurrentCalls} calls at once per rollout`,
      );
    }
    entry.open += 1;
    try {
      await forwardCall(entry, req, res);
    } finally {
      entry.open -= 1;
    }
  }

  async function forwardCall(entry: Entry, req: IncomingMessage, res: ServerResponse): Promise<void> {
    const raw = await readBody(req, o.maxRequestBytes);
    let body: unknown;
    try {
      body = JSON.parse(raw.toString("utf8"));
    } catch {
      throw new GatewayHttpError(400, "malformed", "request body is not JSON");
    }
    if (typeof body !== "object" || body === null || Array.isArray(body)) {
      throw new GatewayHttpError(400, "malformed", "request body must be a JSON object");
    }
    const request = body as Record<string, unknown>;
    if (!Array.isArray(request.messages)) {
      throw new GatewayHttpError(400, "malformed", "`messages` must be an array");
    }
    // Anything but an absent or `false` stream is refused: an upstream that coerces `"true"` or
    // `1` would stream, and a streamed answer carries no usage the gateway can count.
    if (request.stream !== undefined && request.stream !== false) {
      throw new GatewayHttpError(400, "stream_unsupported", "streaming is not supported; send stream: false");
    }
    const refusal = capRefusal(
      {
        calls: entry.meter.cappedCalls + entry.pending,
        tokens: entry.meter.totalTokens,
        abandoned: entry.meter.abandonedAny,
      },
      entry.registration,
    );
    if (refusal) {
      if (refusal.code === "usage_unreported") noteInfraFailure(entry, "the upstream reports no usage");
      throw new GatewayHttpError(429, refusal.code, refusal.message);
    }
    const now = performance.now();
    while (entry.recent.length > 0 && entry.recent[0]! <= now - 60_000) entry.recent.shift();
    if (entry.recent.length >= o.maxCallsPerMinute) {
      throw new GatewayHttpError(
        429,
        "rate_limited",
        `at most ${o.maxCallsPerMinute} calls per minute per rollout; retry later`,
        Math.max(1, Math.ceil((entry.recent[0]! + 60_000 - now) / 1000)),
      );
    }
    // The completion limit the agent asked for, never more than the token cap has left after the
    // calls in flight took theirs (the call that crosses the cap crosses it by its prompt at most,
    // not by whatever it asked for). A request that asks for none is sent as it came: a limit
    // added to it could make a long prompt overflow the model's context.
    const reserve = clampCompletion(request, entry);
    if (reserve === null && entry.reservedTokens === 0) {
      // Nothing in flight holds the cap: the call asks for more choices (`n`) than the tokens the
      // cap has left, one each. No retry passes; the request's own, as a too large answer is.
      throw new GatewayHttpError(
        400,
        "token_cap_too_small",
        `this call asks for more choices (n) than the ${capLeft(entry)} tokens this rollout's token cap (${entry.registration.maxTokens}) has left; lower n`,
      );
    }
    if (reserve === null) {
      // Passes once the calls in flight are answered: not the agent's failure (the upstream's
      // health stays as it was), and no call of its own that it should stop on.
      throw new GatewayHttpError(
        429,
        "token_cap_reserved",
        `this rollout's token cap (${entry.registration.maxTokens}) is held by its calls in flight; retry when they are answered`,
        1,
      );
    }
    // Serialised once, before anything is held for it: a body JSON.parse takes may be too deep
    // for JSON.stringify to send on (a RangeError), the request's own doing, said as such, not
    // blamed on the upstream it never reached (an agent could buy a mask with one such call).
    let outgoing: string;
    try {
      outgoing = JSON.stringify({ ...request, model: entry.registration.model, stream: false });
    } catch {
      throw new GatewayHttpError(400, "malformed", "request body is nested too deep to forward");
    }
    entry.reservedTokens += reserve;
    entry.recent.push(now);

    entry.pending += 1;
    const controller = new AbortController();
    entry.inFlight.add(controller);
    const onClientGone = (): void => {
      if (!res.writableFinished) controller.abort(CLIENT_GONE);
    };
    res.on("close", onClientGone);
    const timeout = AbortSignal.timeout(o.upstreamTimeoutMs);
    const signal = AbortSignal.any([controller.signal, timeout]);
    let status: number;
    let contentType: string;
    let retryAfter: string | null;
    let text: string;
    let credential: string | null | undefined;
    // When the call went upstream (a gateway timeout that came at once timed nothing out).
    let sentAt = Date.now();
    try {
      credential = await resolveCredentialSafely(o.resolveCredential);
      const headers: Record<string, string> = {
        "content-type": "application/json",
        accept: "application/json",
      };
      if (credential) headers.authorization = `Bearer ${credential}`;
      sentAt = Date.now();
      const upstream = await modelFetch(
        upstreamUrl,
        {
          method: "POST",
          headers,
          body: outgoing,
          signal,
          // The credential goes to the configured upstream only, never where a redirect points: a
          // 3xx is answered as it is.
          redirect: "manual",
        },
        o.dispatcher,
      );
      status = upstream.status;
      // Only the forms of these that carry nothing else (the credential, echoed by a proxy).
      contentType = safeContentType(upstream.headers.get("content-type"));
      retryAfter = safeRetryAfter(upstream.headers.get("retry-after"));
      text = await readResponse(upstream, o.maxResponseBytes);
      // An upstream (or a proxy before it) that echoes request headers in an error would hand
      // the real credential to the sandbox: it never leaves this process.
      text = redactCredential(text, credential);
    } catch (err) {
      // A call the upstream billed without the gateway reading its usage makes the total unknown:
      // abandoned by the agent, or answered (2xx) over the size bound (the request's doing). Not
      // one given up on at the gateway's timeout: a hung upstream looks the same, and a total
      // made unknown by it would refuse the agent's every later call (graded: no sure failure).
      const abandoned = controller.signal.aborted && controller.signal.reason === CLIENT_GONE;
      if (abandoned) entry.meter.recordAbandoned("agent");
      else if (
        err instanceof GatewayHttpError &&
        err.code === "upstream_response_too_large" &&
        status! >= 200 &&
        status! < 300
      ) {
        entry.meter.recordAbandoned("unread");
      } else entry.meter.recordFailure();
      if (err instanceof GatewayHttpError) {
        // The operator's credential not resolvable: the infrastructure's. An answer over the size
        // bound: by its status. An answer (2xx) or a refusal of the request (4xx) that large is
        // the request's doing (several choices, logprobs, prompt_logprobs, an error quoting the
        // request back): the agent sets how much comes back, and must not buy a mask with it. A
        // failure's status (5xx, 429) the upstream's, whatever its size.
        if (err.code === "credential_unavailable") noteInfraFailure(entry, err.message);
        if (err.code === "upstream_response_too_large") {
          if (isInfraStatus(status!, Date.now() - sentAt, o.gatewayTimeoutMinMs)) {
            noteInfraFailure(entry, `HTTP ${status!} with a body over ${o.maxResponseBytes} bytes`);
          } else entry.health.lastInfraFailure = null;
        }
        throw err;
      }
      if (timeout.aborted) {
        // Not counted against the upstream: a hung upstream and a long generation the agent
        // asked for look alike, and a policy must not buy a mask with answers that take long.
        throw new GatewayHttpError(
          504,
          "upstream_timeout",
          `upstream did not answer in ${o.upstreamTimeoutMs} ms`,
        );
      }
      if (controller.signal.aborted) {
        throw new GatewayHttpError(
          503,
          "call_aborted",
          "the call was aborted (token revoked or gateway closing)",
        );
      }
      const linkLocal = linkLocalRefusal(err);
      if (linkLocal) {
        entry.health.refusedEndpoint = linkLocal.message;
        throw new GatewayHttpError(502, "upstream_unavailable", linkLocal.message);
      }
      // fetch's own errors can quote the request (a header value it refused): redacted as well.
      const why = redactCredential(describe(err), credential);
      noteInfraFailure(entry, `unreachable: ${why}`);
      throw new GatewayHttpError(502, "upstream_unavailable", `upstream unreachable: ${why}`);
    } finally {
      entry.pending -= 1;
      entry.reservedTokens -= reserve;
      entry.inFlight.delete(controller);
      res.off("close", onClientGone);
    }

    const ok = status >= 200 && status < 300;
    let parsed: unknown = null;
    if (ok) {
      try {
        parsed = JSON.parse(text);
      } catch {
        // Recorded as a call without usage below: an answer we could not read is a gap, not a zero.
      }
    }
    if (ok) entry.meter.record(readCallUsage(parsed));
    else entry.meter.recordFailure();
    // A 403 from a firewall in front of the model (a rule matched what the agent sent) looks like
    // the operator's key refused: a plain request with that key tells them apart (refused too:
    // the key; any other answer: the key works, and the 403 was the agent's own request's).
    // A 402 likewise: an account out of credit, or (OpenRouter's) one that cannot cover the
    // `max_tokens` this request asked for, which a one-token request then can.
    const refusedRequest =
      (status === 403 || status === 402) && (await probeRolloutKey(entry, credential)) === "works";
    // A proxy's gateway timeout (after a proxy's time) is neither a failure nor an answer: health as it was.
    const elapsedMs = Date.now() - sentAt;
    if (isSlowGatewayTimeout(status, elapsedMs, o.gatewayTimeoutMinMs)) {
      // (as the gateway's own timeout)
    } else if (isInfraStatus(status, elapsedMs, o.gatewayTimeoutMinMs) && !refusedRequest) {
      noteInfraFailure(
        entry,
        `HTTP ${status}${isGatewayTimeoutStatus(status) ? ` after ${elapsedMs} ms` : ""}`,
      );
    } else if (ok && !isChatCompletion(parsed)) {
      // A 2xx that is no chat completion (truncated JSON, a proxy's HTML page): the upstream
      // did not answer, whatever its status says. Passed on as it came.
      noteInfraFailure(entry, `HTTP ${status} with no readable chat completion`);
    } else {
      entry.health.answered += 1;
      entry.health.lastInfraFailure = null;
    }
    if (isRefusalStatus(status) && credential) {
      // A refusal (the operator's credential, most likely) or a redirect: its body may quote part
      // of the credential, which exact redaction does not catch and the agent must not see. The
      // gateway's own words instead, chosen by the status alone (so nothing in them depends on
      // the key), claiming no more than the status says.
      const code = status < 400 ? "upstream_redirected" : "upstream_refused";
      text = JSON.stringify({
        error: {
          message:
            status < 400
              ? `the upstream answered HTTP ${status} (a redirect, not followed); its body is not passed on`
              : `the upstream refused the request (HTTP ${status}: the fleet's credential, or the request); its own message is not passed on (it may quote the credential)`,
          type: errorType(status, code),
          code,
        },
      });
      contentType = "application/json";
    } else if (credential && (!ok || !isChatCompletion(parsed))) {
      // Any other error (a 2xx that is no chat completion too: an error object under a 200): its
      // own words are not passed on either. Its body may quote part of the credential (a 400 or
      // 422 that explains itself with the key's first characters), which exact redaction does
      // not catch; and any choice made by looking for the key in it (cut out, or the body
      // withheld when found) is an oracle: an upstream that echoes the agent's own text, changed
      // (lowercased, two fields joined), answers differently for a right guess at the key, one
      // character at a time. So, by the status and the body's shape alone: the gateway's words,
      // the upstream's identifiers in forms no key takes (`code`, `type`, `param`), and a context
      // length exceeded said as such (an agent's SDK stops on it). A chat completion is the
      // model's answer, passed on as it is (above).
      const own = upstreamError(text);
      const contextLength = status >= 400 && status < 500 && status !== 429 && own.contextLength;
      const code = contextLength ? "context_length_exceeded" : (own.code ?? "upstream_error");
      text = JSON.stringify({
        error: {
          message: contextLength
            ? `the upstream answered HTTP ${status}: the request exceeds the model's maximum context length (its own message is not passed on: it may quote the fleet's credential)`
            : `the upstream answered HTTP ${status}${own.code ? ` (${own.code})` : ""}; its own message is not passed on (it may quote the fleet's credential)`,
          type: own.type ?? errorType(status, code),
          code,
          param: own.param ?? null,
        },
      });
      contentType = "application/json";
    }
    const headers: Record<string, string> = { "content-type": contentType };
    if (retryAfter !== null) headers["retry-after"] = retryAfter;
    res.writeHead(status, headers);
    res.end(text);
  }

  /** `probeKey` with this rollout's model and the operator's key, aborted with its calls in flight. */
  async function probeRolloutKey(entry: Entry, credential: string | null | undefined): Promise<KeyProbe> {
    entry.probes += 1;
    const controller = new AbortController();
    entry.inFlight.add(controller);
    try {
      return await probeKey({
        url: upstreamUrl,
        apiKey: credential,
        model: entry.registration.model,
        timeoutMs: Math.min(30_000, o.upstreamTimeoutMs),
        signal: controller.signal,
      });
    } finally {
      entry.inFlight.delete(controller);
    }
  }

  function summaryOf(entry: Entry): UsageSummary {
    if (entry.revoked) return entry.revoked;
    const summary = entry.meter.summary();
    if (entry.probes > 0) {
      summary.gaps.push(
        `${entry.probes} one-token probe request(s) the gateway sent after a 403 or a 402, to tell a refused key from a refused request (not counted)`,
      );
    }
    return summary;
  }

  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen({ host: o.host, port: o.port }, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const port = (server.address() as AddressInfo).port;
  const url = `http://${o.host.includes(":") ? `[${o.host}]` : o.host}:${port}`;

  return {
    url,
    port,
    register(rolloutId, registration) {
      for (const [key, cap] of [
        ["maxCalls", registration.maxCalls],
        ["maxTokens", registration.maxTokens],
      ] as const) {
        if (cap !== undefined && !(Number.isInteger(cap) && cap > 0)) {
          throw new Error(`gateway registration ${key} must be a positive integer, got ${cap}`);
        }
      }
      const minted = mintToken();
      entries.set(minted.keyId, {
        rolloutId,
        keyId: minted.keyId,
        secretHash: minted.secretHash,
        registration: { ...registration },
        meter: new UsageMeter(),
        pending: 0,
        recent: [],
        reservedTokens: 0,
        probes: 0,
        open: 0,
        inFlight: new Set(),
        revoked: null,
        health: { answered: 0, infraFailures: 0, lastInfraFailure: null },
      });
      return { token: minted.token, baseUrl: `${url}/v1` };
    },
    revoke(token) {
      const entry = entryOf(entries, token);
      if (entry === null) throw new Error("revoke: not a token this gateway issued");
      if (entry.revoked === null) {
        const aborted = entry.inFlight.size;
        if (aborted > 0) {
          entry.meter.note(
            `${aborted} call${aborted === 1 ? "" : "s"} in flight at revocation aborted (usage unknown)`,
          );
        }
        // With the probes' gap, as `usage` reports it: the run keeps this summary.
        entry.revoked = summaryOf(entry);
        for (const c of entry.inFlight) c.abort(new Error("gateway token revoked"));
      }
      return entry.revoked;
    },
    usage(token) {
      const entry = entryOf(entries, token);
      return entry === null ? null : summaryOf(entry);
    },
    health(token) {
      const entry = entryOf(entries, token);
      return entry === null ? null : { ...entry.health };
    },
    async close() {
      for (const entry of entries.values())
        for (const c of entry.inFlight) c.abort(new Error("gateway closing"));
      await new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      });
    },
  };
}

/** The entry a full token names, checked in constant time; `null` otherwise. */
function entryOf(entries: Map<string, Entry>, token: string): Entry | null {
  const parsed = parseToken(token);
  const entry = parsed === null ? undefined : entries.get(parsed.keyId);
  return parsed !== null && entry !== undefined && secretMatches(parsed.secret, entry.secretHash)
    ? entry
    : null;
}

async function resolveCredentialSafely(
  resolve: GatewayOptions["resolveCredential"],
): Promise<string | null | undefined> {
  if (resolve === undefined) return null;
  try {
    return await resolve();
  } catch (err) {
    // The resolver's message names the credential, never its value; keep only that.
    throw new GatewayHttpError(
      502,
      "credential_unavailable",
      `the upstream credential could not be resolved: ${describe(err)}`,
    );
  }
}

async function readBody(req: IncomingMessage, max: number): Promise<Buffer> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req) {
    const buf = chunk as Buffer;
    size += buf.length;
    if (size > max) throw new GatewayHttpError(413, "payload_too_large", `request body over ${max} bytes`);
    chunks.push(buf);
  }
  return Buffer.concat(chunks);
}

async function readResponse(response: Response, max: number): Promise<string> {
  const text = await readBodyCapped(response, max);
  if (text === null) {
    throw new GatewayHttpError(502, "upstream_response_too_large", `upstream response over ${max} bytes`);
  }
  return text;
}

/**
 * An upstream error's `code` or `type` as the gateway passes it on: lowercase words joined by
 * `_` (`context_length_exceeded`, `invalid_request_error`), a form no API key takes (digits,
 * capitals or `-` in every one of them).
 */
const ERROR_WORDS = /^[a-z]+(?:_[a-z]+)*$/;
/** An error's `param` as the gateway passes it on: a request path (`messages[0].content`). */
const ERROR_PARAM = /^[a-z_]+(?:\[\d{1,6}\])?(?:\.[a-z_]+(?:\[\d{1,6}\])?)*$/;

/**
 * What the gateway passes on of an upstream's error body (`{"error": {…}}`, `{"error": "…"}`,
 * or vLLM's `{"object": "error", "message"}`): its identifiers, each only in a form no key takes
 * (`ERROR_WORDS`, `ERROR_PARAM`, at most 64 characters), and whether it says the context
 * length was exceeded (by its code or its wording, never by anything of the key's).
 */
function upstreamError(text: string): {
  code?: string;
  type?: string;
  param?: string;
  contextLength: boolean;
} {
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    return { contextLength: false };
  }
  if (typeof body !== "object" || body === null) return { contextLength: false };
  const error = (body as { error?: unknown }).error;
  const fields: Record<string, unknown> =
    typeof error === "object" && error !== null
      ? (error as Record<string, unknown>)
      : typeof error === "string"
        ? { message: error }
        : (body as Record<string, unknown>);
  const out: { code?: string; type?: string; param?: string; contextLength: boolean } = {
    contextLength: false,
  };
  const id = (value: unknown, form: RegExp) =>
    typeof value === "string" && value.length <= 64 && form.test(value) ? value : undefined;
  const code = id(fields.code, ERROR_WORDS);
  const type = id(fields.type, ERROR_WORDS);
  const param = id(fields.param, ERROR_PARAM);
  if (code !== undefined) out.code = code;
  if (type !== undefined) out.type = type;
  if (param !== undefined) out.param = param;
  out.contextLength =
    fields.code === "context_length_exceeded" ||
    (typeof fields.message === "string" && CONTEXT_LENGTH_WORDING.test(fields.message));
  return out;
}

/** `text` without the upstream credential: nothing the gateway sends back may quote it. */
function redactCredential(text: string, credential: string | null | undefined): string {
  if (!credential) return text;
  // As sent, and as an upstream or proxy echoing the header may have written it: escaped inside
  // a JSON string (`redactSecrets` covers that; `/` as `\/` too, by some encoders) or URL-encoded.
  const json = JSON.stringify(credential).slice(1, -1);
  const forms = [
    credential,
    json.replaceAll("/", "\\/"),
    encodeURIComponent(credential),
    encodeURI(credential),
  ];
  return redactSecrets(text, forms, "[redacted]");
}

/** A chat-completions answer as far as the gateway reads one: a JSON object with a `choices` array. */
/**
 * Whether a 2xx body is a chat completion an agent can use: a first choice that carries a message
 * object. No choices, a null message, or an error object under a 200 is the upstream not
 * answering, whatever its status says.
 */
export function isChatCompletion(body: unknown): boolean {
  const choices =
    typeof body === "object" && body !== null ? (body as { choices?: unknown }).choices : undefined;
  if (!Array.isArray(choices) || choices.length === 0) return false;
  const first = choices[0] as { message?: unknown } | null;
  return (
    typeof first === "object" && first !== null && typeof first.message === "object" && first.message !== null
  );
}

/**
 * What the rollout's token cap has left after its answered calls and its calls in flight; null
 * without a cap (or with usage no longer counted).
 */
function capLeft(entry: Entry): number | null {
  const cap = entry.registration.maxTokens;
  const used = entry.meter.totalTokens;
  if (cap === undefined || used === null) return null;
  return Math.max(0, cap - used - entry.reservedTokens);
}

/**
 * With a token cap, lower the request's completion limit to what the cap has left after the
 * answered calls and the calls in flight, and return what this call reserves of it (its limit
 * times `n`, the choices it asks for); `null` when nothing is left now (calls in flight hold
 * it). A limit in either field (`max_completion_tokens`, `max_tokens`; a number, or a numeric
 * string an upstream would coerce) is lowered in both; a call that asks for none reserves all
 * that is left (no limit written into it: one added could make a long prompt overflow the
 * model's context), so no other call runs beside it. Without a cap: 0, nothing changed.
 */
function clampCompletion(request: Record<string, unknown>, entry: Entry): number | null {
  const left = capLeft(entry);
  if (left === null) return 0;
  if (left < 1) return null;
  // `n` as an upstream would coerce it (a numeric string too, as for the limits): an `n` the clamp
  // did not read would let one call take `n` times what the cap has left.
  const asN = Number(request.n);
  const n = Number.isFinite(asN) && asN > 1 ? Math.ceil(asN) : 1;
  const asked = ["max_completion_tokens", "max_tokens"]
    .map((f) => Number(request[f]))
    .filter((v) => Number.isFinite(v) && v > 0);
  if (asked.length === 0) return left;
  const limit = Math.min(Math.max(1, Math.floor(Math.min(...asked))), Math.floor(left / n));
  if (limit < 1) return null;
  for (const f of ["max_completion_tokens", "max_tokens"]) if (f in request) request[f] = limit;
  return limit * n;
}

function noteInfraFailure(entry: Entry, what: string): void {
  entry.health.infraFailures += 1;
  entry.health.lastInfraFailure = what;
}

function describe(err: unknown): string {
  if (!(err instanceof Error)) return capText(String(err), 500);
  const cause = err.cause instanceof Error ? ` (${err.cause.message})` : "";
  return capText(`${err.message}${cause}`, 500);
}

function errorType(status: number, code: string): string {
  if (status === 401) return "authentication_error";
  if (CAP_CODES.has(code)) return "insufficient_quota";
  return status >= 500 ? "api_error" : "invalid_request_error";
}

function sendJson(res: ServerResponse, status: number, body: unknown): void {
  if (res.headersSent) {
    res.destroy();
    return;
  }
  res.writeHead(status, { "content-type": "application/json" });
  res.end(JSON.stringify(body));
}

/** A route asked with another method: 405, with the `Allow` header HTTP asks of one (RFC 9110 §15.5.6). */
function methodNotAllowed(res: ServerResponse, allow: string): GatewayHttpError {
  res.setHeader("allow", allow);
  return new GatewayHttpError(405, "method_not_allowed", `use ${allow}`);
}

function sendError(res: ServerResponse, err: unknown): void {
  const e =
    err instanceof GatewayHttpError
      ? err
      : new GatewayHttpError(500, "internal", `gateway error: ${describe(err)}`);
  if (e.status === 413) res.setHeader("connection", "close");
  if (e.retryAfterS !== null) res.setHeader("retry-after", String(e.retryAfterS));
  sendJson(res, e.status, {
    error: { message: e.message, type: errorType(e.status, e.code), code: e.code, param: null },
  });
}
