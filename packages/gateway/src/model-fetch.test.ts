import { createServer, type Server } from "node:http";
import type { AddressInfo, LookupFunction } from "node:net";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { guardedDispatcher, guardedLookup, linkLocalRefusal, modelFetch } from "./model-fetch.ts";

/** A lookup answering each call with the next of `answers` (the last one repeated): a name's DNS over time. */
function resolvesInTurn(...answers: string[]): LookupFunction & { calls: number } {
  const fn = ((_host, options, callback) => {
    const address = answers[Math.min(fn.calls, answers.length - 1)] as string;
    fn.calls += 1;
    const family = address.includes(":") ? 6 : 4;
    if (options.all) callback(null, [{ address, family }]);
    else callback(null, address, family);
  }) as LookupFunction & { calls: number };
  fn.calls = 0;
  return fn;
}

let server: Server;
let port: number;
let requests = 0;

beforeAll(async () => {
  server = createServer((req, res) => {
    requests += 1;
    req.resume();

    // A new connection (and so a new lookup) for every request.
    res.writeHead(200, { "content-type": "application/json", connection: "close" });
    res.end('{"ok":true}');
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  port = (server.address() as AddressInfo).port;
});
afterAll(() => new Promise<void>((resolve) => server.close(() => resolve())));

const post = (signal = AbortSignal.timeout(5_000)) => ({
  method: "POST",
  headers: { "content-type": "application/json" },
  body: "{}",
  signal,
  redirect: "manual" as const,
});

describe("modelFetch", () => {
  it("connects to where a model endpoint's name resolves", async () => {
    const before = requests;
    const dispatcher = guardedDispatcher(guardedLookup(resolvesInTurn("127.0.0.1")));
    const res = await modelFetch(`http://model.test:${port}/v1/chat/completions`, post(), dispatcher);
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({ ok: true });
    expect(requests).toBe(before + 1);
    await dispatcher.close();
  });

  it.each(["169.254.169.254", "::ffff:169.254.169.254", "fd00:ec2::254"])(
    "never connects to a name that resolves to %s when it is called (DNS rebinding after the episode's first check)",
    async (metadata) => {
      const lookup = resolvesInTurn("127.0.0.1", metadata);
      const dispatcher = guardedDispatcher(guardedLookup(lookup));
      const url = `http://model.test:${port}/v1/chat/completions`;
      const before = requests;
      expect((await modelFetch(url, post(), dispatcher)).status).toBe(200);
      // The name now points at the metadata service: refused at the connection, not timed out.
      const err = await modelFetch(url, post(AbortSignal.timeout(3_000)), dispatcher).then(
        () => null,
        (e: unknown) => e,
      );
      expect(lookup.calls).toBe(2);
      expect(requests).toBe(before + 1);
      expect(linkLocalRefusal(err)?.message).toBe(
        `the model endpoint's host model.test resolves to a link-local address (${metadata}); refused`,
      );
      await dispatcher.close();
    },
  );

  it("refuses a name with a link-local address among others, and passes lookup errors on", async () => {
    const both: LookupFunction = (_host, options, callback) => {
      const all = [
        { address: "127.0.0.1", family: 4 },
        { address: "169.254.170.2", family: 4 },
      ];
      if (options.all) callback(null, all);
      else callback(null, "169.254.170.2", 4);
    };
    const results = await Promise.all(
      [true, false].map(
        (all) =>
          new Promise<NodeJS.ErrnoException | null>((resolve) =>
            guardedLookup(both)("model.test", { all }, (err) => resolve(err)),
          ),
      ),
    );
    expect(results.map((e) => linkLocalRefusal(e)?.message)).toEqual([
      expect.stringContaining("(169.254.170.2)"),
      expect.stringContaining("(169.254.170.2)"),
    ]);
    const notFound = Object.assign(new Error("getaddrinfo ENOTFOUND model.test"), { code: "ENOTFOUND" });
    const failing: LookupFunction = (_host, _options, callback) => callback(notFound, "", 4);
    const passed = await new Promise<NodeJS.ErrnoException | null>((resolve) =>
      guardedLookup(failing)("model.test", {}, (err) => resolve(err)),
    );
    expect(passed).toBe(notFound);
    expect(linkLocalRefusal(passed)).toBeNull();
  });
});
