import { createServer, type Server } from "node:http";
import type { AddressInfo, LookupFunction } from "node:net";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { guardedDispatcher, guardedLookup, modelFetch } from "./model-fetch.ts";

// A file of its own: undici's timers start on the first request a process makes, and must start
// under the fake timers below (a file that made requests before would have started them on real ones).

const toLocalhost: LookupFunction = (_host, options, callback) =>
  options.all ? callback(null, [{ address: "127.0.0.1", family: 4 }]) : callback(null, "127.0.0.1", 4);

let server: Server;
let port: number;
/** Requests wait here for their answer until the test sends it. */
const held: Array<() => void> = [];

beforeAll(async () => {
  server = createServer((req, res) => {
    req.resume();
    held.push(() => {
      res.writeHead(200, { "content-type": "application/json", connection: "close" });
      res.end('{"late":true}');
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  port = (server.address() as AddressInfo).port;
});
afterAll(() => new Promise<void>((resolve) => server.close(() => resolve())));

describe("modelFetch's timeouts", () => {
  it("sets no timeout of its own (the caller's signal bounds the call): an answer that starts after 10 minutes, a long generation, is read", async () => {
    // undici's own default would fail it after 300 s without headers (and count the upstream
    // unreachable). Its timers run on setTimeout: faked here, and 10 minutes pass at once.
    vi.useFakeTimers({ toFake: ["setTimeout", "clearTimeout", "setInterval", "clearInterval"] });
    const dispatcher = guardedDispatcher(guardedLookup(toLocalhost));
    try {
      const call = modelFetch(
        `http://model.test:${port}/held`,
        {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: "{}",
          signal: new AbortController().signal,
          redirect: "manual",
        },
        dispatcher,
      );
      const failed = call.then(
        () => null,
        (e: unknown) => e,
      );
      while (held.length === 0) await new Promise((r) => setImmediate(r));
      await vi.advanceTimersByTimeAsync(600_000);
      held.shift()?.();
      expect(await failed).toBeNull();
      expect(await (await call).json()).toEqual({ late: true });
    } finally {
      vi.useRealTimers();
      await dispatcher.close();
    }
  });
});
