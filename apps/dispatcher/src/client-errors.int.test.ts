import { once } from "node:events";
import { connect } from "node:net";
import { RolloutRequest } from "@fleet/contracts";
import { admit, createRedis } from "@fleet/queue";
import { createLogger } from "@fleet/telemetry";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { completedResult, startTestServer, TEST_TASK, type TestServer } from "./test-server.ts";

/**
 * What Node's HTTP parser refuses before Fastify sees a request gets the API's one error body
 * too, on a real listening socket (inject never reaches the parser).
 */
const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";

/**
 * Send raw bytes; the whole answer, once the server closes the connection. With `whole`, as
 * Python's http.client does: `body` is written after `request` (a failed write rejects: the
 * broken pipe a client sees when the server closes under it), then `next` (if any) and the end of
 * our side; the answer is read only after.
 */
function raw(port: number, request: string, whole?: { body: Buffer; next?: string }): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, "127.0.0.1");
    let answer = "";
    socket.on("data", (c: Buffer) => (answer += c.toString("utf8")));
    socket.on("close", () => resolve(answer));
    socket.on("error", reject);
    socket.write(request);
    if (whole) socket.write(whole.body, (err) => (err ? reject(err) : socket.end(whole.next ?? "")));
  });
}

/** A dispatcher listening on a free loopback port, for the `describe` block this is called in. */
function listening(
  name: string,
  env: Record<string, string> = {},
  knobs: Parameters<typeof startTestServer>[3] = {},
): { port: number; server: () => TestServer } {
  const at = { port: 0, server: () => server };
  let redis: Redis;
  let server: TestServer;
  beforeAll(async () => {
    redis = createRedis(REDIS_URL);
    server = await startTestServer(redis, name, env, knobs);
    await server.app.listen({ host: "127.0.0.1", port: 0 });
    at.port = (server.app.server.address() as { port: number }).port;
  });
  afterAll(async () => {
    await server?.close();
    await redis?.quit();
  });
  return at;
}

function parse(answer: string): { status: number; body: unknown } {
  const [head = "", body = ""] = answer.split("\r\n\r\n");
  return { status: Number(head.split(" ")[1]), body: JSON.parse(body) };
}

describe("HTTP the parser refuses", () => {
  const dispatcher = listening("client-errors");

  it("answers headers too large (431) and a request that is not HTTP (400) with the API's error body", async () => {
    const big = await raw(
      dispatcher.port,
      `GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ${"a".repeat(64 * 1024)}\r\n\r\n`,
    );
    expect(parse(big)).toEqual({
      status: 431,
      body: { error: { code: "malformed", message: "the request's headers are too large", details: null } },
    });
    const junk = await raw(dispatcher.port, "NOT HTTP AT ALL\r\n\r\n");
    expect(parse(junk)).toEqual({
      status: 400,
      body: { error: { code: "malformed", message: "the request is not valid HTTP", details: null } },
    });
  });
});

describe("a client that hangs up while its body is being read", () => {
  const lines: string[] = [];
  const dispatcher = listening(
    "client-abort",
    {},
    {
      logger: createLogger({
        name: "dispatcher-abort",
        level: "debug",
        destination: { write: (l) => lines.push(l) },
      }),
    },
  );

  it("is refused as the client's doing (debug), never logged as a failed request (a 500, at error level)", async () => {
    // An NDJSON batch that promises 100 bytes, sends 8 and is gone once the server took it up.
    const taken = once(dispatcher.server().app.server, "request");
    const socket = connect(dispatcher.port, "127.0.0.1");
    socket.on("error", () => undefined);
    socket.write(
      'POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\nContent-Length: 100\r\n\r\n{"task":',
    );
    await taken;
    socket.destroy();
    await vi.waitFor(
      () => expect(lines.join("")).toContain("closed the connection before its request body arrived"),
      {
        timeout: 5_000,
      },
    );
    const levels = lines.map((l) => JSON.parse(l) as { level: number; msg: string });
    expect(levels.filter((l) => l.level >= 50)).toEqual([]);
  });

  it("leaves its request line (aborted), whether it hung up mid-body or once its body was sent, its rollout admitted after", async () => {
    const requestLines = () =>
      lines
        .map((l) => JSON.parse(l) as { msg: string; route?: string; aborted?: boolean; level: number })
        .filter((l) => l.msg === "request");
    // Mid-body, as above.
    const midBody = once(dispatcher.server().app.server, "request");
    const first = connect(dispatcher.port, "127.0.0.1");
    first.on("error", () => undefined);
    first.write(
      'POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\nContent-Length: 100\r\n\r\n{"task":',
    );
    await midBody;
    first.destroy();
    await vi.waitFor(() => expect(requestLines().map((l) => l.route)).toContain("/v1/batches"), {
      timeout: 5_000,
    });
    // A whole body, then gone before the answer: the rollout is admitted all the same, and the
    // request is in the log beside it.
    const body = JSON.stringify({ task: TEST_TASK, agent: { harness: "oracle" } });
    const whole = once(dispatcher.server().app.server, "request");
    const second = connect(dispatcher.port, "127.0.0.1");
    second.on("error", () => undefined);
    second.write(
      `POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
    );
    await whole;
    second.destroy();
    await vi.waitFor(() => expect(lines.join("")).toContain("rollout accepted"), { timeout: 5_000 });
    await vi.waitFor(() => expect(requestLines().map((l) => l.route)).toContain("/v1/rollouts"), {
      timeout: 5_000,
    });
    for (const line of requestLines()) expect(line).toMatchObject({ aborted: true, level: 30 });
    // One answered in whole has its one line, as before, not another for its connection's close.
    const answered = await raw(
      dispatcher.port,
      "GET /v1/batches/b0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    expect(parse(answered).status).toBe(404);
    await vi.waitFor(() => expect(requestLines().map((l) => l.route)).toContain("/v1/batches/:id"));
    expect(requestLines().filter((l) => l.route === "/v1/batches/:id")).toEqual([
      expect.not.objectContaining({ aborted: true }),
    ]);
  });

  it("leaves the request line of each request pipelined on a connection that closed before their answers, the ones queued behind the first too", async () => {
    const rolloutLines = () =>
      lines
        .map((l) => JSON.parse(l) as { msg: string; route?: string; aborted?: boolean })
        .filter((l) => l.msg === "request" && l.route === "/v1/rollouts");
    const accepted = () => lines.filter((l) => l.includes("rollout accepted")).length;
    const before = { lines: rolloutLines().length, accepted: accepted() };
    // Two submissions in one write (HTTP/1.1 pipelining): the second's answer waits behind the
    // first's, and the client is gone before either is sent. Both are admitted.
    const body = JSON.stringify({ task: TEST_TASK, agent: { harness: "oracle" } });
    const request = `POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`;
    let taken = 0;
    const both = new Promise<void>((resolve) => {
      const count = () => {
        if (++taken < 2) return;
        dispatcher.server().app.server.off("request", count);
        resolve();
      };
      dispatcher.server().app.server.on("request", count);
    });
    const socket = connect(dispatcher.port, "127.0.0.1");
    socket.on("error", () => undefined);
    socket.write(request + request);
    await both;
    socket.destroy();
    await vi.waitFor(() => expect(accepted() - before.accepted).toBe(2), { timeout: 5_000 });
    await vi.waitFor(
      () =>
        expect(rolloutLines().slice(before.lines)).toEqual([
          expect.objectContaining({ aborted: true }),
          expect.objectContaining({ aborted: true }),
        ]),
      { timeout: 5_000 },
    );
  });
});

describe("a request whose body stops arriving", () => {
  const dispatcher = listening("client-stall", { FLEET_HTTP_REQUEST_TIMEOUT_MS: "1000" });

  it("is answered 408 in the API's error body once FLEET_HTTP_REQUEST_TIMEOUT_MS has passed, and its connection closed (not held for good)", async () => {
    const started = Date.now();
    // Headers that promise 1000 bytes, 8 of them, then nothing (the socket left open).
    const socket = connect(dispatcher.port, "127.0.0.1");
    let answer = "";
    socket.on("data", (c: Buffer) => (answer += c.toString("utf8")));
    const closed = new Promise<void>((resolve, reject) => {
      socket.on("close", () => resolve());
      socket.on("error", reject);
    });
    socket.write(
      'POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"task":',
    );
    await closed;
    expect(parse(answer)).toEqual({
      status: 408,
      body: { error: { code: "malformed", message: "the request did not arrive in time", details: null } },
    });
    // Not before the limit (Node checks every quarter of it, here).
    expect(Date.now() - started).toBeGreaterThanOrEqual(1000);
  });

  it("answered already (a 415 before its body all arrived), gets no second answer when its time runs out: its connection is closed", async () => {
    const answer = await raw(
      dispatcher.port,
      "POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\nabc",
    );
    const responses = answer.split(/(?=HTTP\/1\.1 )/);
    expect(responses).toHaveLength(1);
    expect(responses[0]).toMatch(/^HTTP\/1\.1 415 /);
  });
});

describe("a request without a body", () => {
  const dispatcher = listening("client-nobody");

  it("naming JSON or NDJSON, with neither Content-Length nor Transfer-Encoding (curl -X POST -H 'content-type: …'): a cancel goes through", async () => {
    for (const type of ["application/x-ndjson", "application/json"]) {
      for (const path of ["/v1/rollouts/r-nope/cancel", "/v1/batches/b-nope/cancel"]) {
        const answer = await raw(
          dispatcher.port,
          `POST ${path} HTTP/1.1\r\nHost: x\r\nContent-Type: ${type}\r\nConnection: close\r\n\r\n`,
        );
        // Unknown ids: the route answered, not a 415 for the type.
        expect(parse(answer).status, `${type} ${path}`).toBe(404);
      }
    }
  });
});

describe("a request that arrives while the dispatcher shuts down", () => {
  let redis: Redis;
  let server: TestServer;
  beforeAll(async () => {
    redis = createRedis(REDIS_URL);
    server = await startTestServer(redis, "closing");
  });
  afterAll(async () => {
    await server?.close();
    await redis?.quit();
  });

  it("gets a 503 in the API's error body, with retry-after, and its connection closed", async () => {
    await server.app.listen({ host: "127.0.0.1", port: 0 });
    const port = (server.app.server.address() as { port: number }).port;
    const socket = connect(port, "127.0.0.1");
    let answer = "";
    socket.on("data", (c: Buffer) => (answer += c.toString("utf8")));
    const ended = new Promise<void>((resolve, reject) => {
      socket.on("close", () => resolve());
      socket.on("error", reject);
    });
    // A first request whose body is still arriving keeps the connection busy while close starts.
    const first = new Promise((resolve) => server.app.server.once("request", resolve));
    socket.write(
      "POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{",
    );
    await first;
    const closed = server.app.close();
    while (server.app.server.listening) await new Promise((r) => setImmediate(r));
    // The rest of its body, and a second request on the same connection.
    socket.write("}GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    await ended;
    await closed;
    const responses = answer.split(/(?=HTTP\/1\.1 )/);
    expect(responses).toHaveLength(2);
    expect(responses[0]).toMatch(/^HTTP\/1\.1 422 /); // `{}` is no rollout request
    const [head = "", body = ""] = responses[1]!.split("\r\n\r\n");
    expect(head).toMatch(/^HTTP\/1\.1 503 /);
    expect(head.toLowerCase()).toContain("retry-after: 5");
    expect(head.toLowerCase()).toContain("connection: close");
    expect(JSON.parse(body)).toEqual({
      error: { code: "unavailable", message: "the dispatcher is shutting down; try again", details: null },
    });
  });
});

describe("a body over the limit, sent whole before the answer is read", () => {
  const LIMIT = 2 * 1024 * 1024;
  const dispatcher = listening("linger", { FLEET_MAX_BODY_BYTES: String(LIMIT), FLEET_API_TOKENS: "tok" });

  /** The request written whole, then a second request, then the answers read. */
  function sendWhole(bodyBytes: number): Promise<string> {
    return raw(
      dispatcher.port,
      "POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\nContent-Type: application/json\r\n" +
        `Content-Length: ${bodyBytes}\r\n\r\n`,
      {
        body: Buffer.alloc(bodyBytes, 0x20),
        next: "GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\nConnection: close\r\n\r\n",
      },
    );
  }

  it("is read to its end and answered 413 in the API's error body; the connection serves the next request", async () => {
    const answer = await sendWhole(3 * LIMIT);
    const responses = answer.split(/(?=HTTP\/1\.1 )/);
    expect(responses).toHaveLength(2);
    const [head = "", body = ""] = responses[0]!.split("\r\n\r\n");
    expect(head).toMatch(/^HTTP\/1\.1 413 /);
    expect(head.toLowerCase()).not.toContain("connection: close");
    expect(JSON.parse(body)).toEqual({
      error: {
        code: "payload_too_large",
        message: `the request body (${3 * LIMIT} bytes) is over the limit of ${LIMIT} bytes`,
        details: { limit: LIMIT },
      },
    });
    expect(responses[1]).toMatch(/^HTTP\/1\.1 200 /);
  });

  it("closes the connection of a request refused before its body was read when that body is past the drain's bound", async () => {
    // No token, and a body announced at ten times the limit: the 401 comes at once, and the
    // connection is closed rather than kept for Node to read and discard 20 MiB.
    const answer = await raw(
      dispatcher.port,
      "POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
        `Content-Length: ${10 * LIMIT}\r\n\r\n${" ".repeat(1024)}`,
    );
    const [head = "", body = ""] = answer.split("\r\n\r\n");
    expect(head).toMatch(/^HTTP\/1\.1 401 /);
    expect(head.toLowerCase()).toContain("connection: close");
    expect(JSON.parse(body)).toMatchObject({ error: { code: "unauthorized" } });
  }, 10_000);
});

describe("a body far over a low limit, sent whole before the answer is read", () => {
  const LIMIT = 64 * 1024;
  const dispatcher = listening("linger-low", {
    FLEET_MAX_BODY_BYTES: String(LIMIT),
    FLEET_API_TOKENS: "tok",
  });

  it("gets its 413 in the API's error body, not a connection closed under it (EPIPE, taken for an outage)", async () => {
    // 8 MiB, the fleet CLI's default chunk: 128 times this limit, far past LINGER_FACTOR times it.
    // Node's fetch, as the CLI sends it, failed with EPIPE here (the 413 unread) and the CLI said
    // it could not reach the dispatcher; written whole and then read, as here, the write failed.
    const bytes = 8 * 1024 * 1024;
    const answer = await raw(
      dispatcher.port,
      "POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n" +
        `Content-Type: application/x-ndjson\r\nContent-Length: ${bytes}\r\nConnection: close\r\n\r\n`,
      { body: Buffer.alloc(bytes, 0x20) },
    );
    const { status, body } = parse(answer);
    expect(status).toBe(413);
    expect(body).toEqual({
      error: {
        code: "payload_too_large",
        message: `the request body (${bytes} bytes) is over the limit of ${LIMIT} bytes`,
        details: { limit: LIMIT },
      },
    });
  }, 60_000);
});

describe("a results stream whose client stopped reading", () => {
  const dispatcher = listening("results-stall", { FLEET_API_TOKENS: "tok" }, { resultsStallMs: 1000 });

  it("read to its end on a kept-alive connection: the connection is closed once idle for the keep-alive timeout, as after any route", async () => {
    const { app, store, queues } = dispatcher.server();
    const requests = [RolloutRequest.parse({ task: TEST_TASK, agent: { harness: "oracle" } })];
    const { batchId, ids } = await admit(store, queues, { requests, batch: true }, { maxTaskBytes: 1e6 });
    await store.finalize({ id: ids[0]!, batchId }, completedResult(ids[0]!, batchId, 1), Date.now());
    const keepAlive = app.server.keepAliveTimeout;
    app.server.keepAliveTimeout = 1500;
    const socket = connect(dispatcher.port, "127.0.0.1");
    socket.on("error", () => undefined);
    try {
      let text = "";
      socket.setEncoding("utf8").on("data", (s: string) => {
        text += s;
      });
      const head = (path: string) => `GET ${path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n\r\n`;
      socket.write(head(`/v1/batches/${batchId}`));
      await vi.waitFor(() => expect(text).toContain('"done":1'), { timeout: 10_000, interval: 20 });
      expect(text.startsWith("HTTP/1.1 200")).toBe(true);
      text = "";
      socket.write(head(`/v1/batches/${batchId}/results`));
      // Chunked, its end the last chunk.
      await vi.waitFor(() => expect(text).toMatch(/\r\n0\r\n\r\n$/), { timeout: 10_000, interval: 20 });
      expect(text).toContain(ids[0]!);
      let closed = false;
      socket.once("close", () => {
        closed = true;
      });
      // Closed by the server once idle (its keep-alive timeout), not left open for good.
      await vi.waitFor(() => expect(closed).toBe(true), { timeout: 10_000, interval: 50 });
    } finally {
      socket.destroy();
      app.server.keepAliveTimeout = keepAlive;
    }
  });

  it("is closed once nothing went through its socket for the stall limit, rather than held (and its buffered results) for good; one read to its end is untouched", async () => {
    const { store, queues } = dispatcher.server();
    // 2,000 finished rollouts of about 15 KiB of result each: 30 MiB, more than the loopback
    // socket buffers take (about 10 MiB).
    const requests = Array.from({ length: 2000 }, () =>
      RolloutRequest.parse({ task: TEST_TASK, agent: { harness: "oracle" } }),
    );
    const { batchId, ids } = await admit(store, queues, { requests, batch: true }, { maxTaskBytes: 1e6 });
    const note = "n".repeat(15 * 1024);
    for (const id of ids) {
      await store.finalize(
        { id, batchId },
        { ...completedResult(id, batchId, 1), metadata: { note } },
        Date.now(),
      );
    }
    const request = `GET /v1/batches/${batchId}/results HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n\r\n`;
    // A client that reads its first bytes, then stops reading (paused, it would not even see the
    // close): the server closes its side of the connection, and lets go of what it buffered.
    const connections = () =>
      new Promise<number>((resolve, reject) =>
        dispatcher.server().app.server.getConnections((err, n) => (err ? reject(err) : resolve(n))),
      );
    const started = Date.now();
    const stalled = connect(dispatcher.port, "127.0.0.1");
    stalled.on("error", () => undefined);
    const reading = new Promise<void>((resolve) =>
      stalled.once("data", () => {
        stalled.pause();
        resolve();
      }),
    );
    stalled.write(request);
    await reading;
    try {
      expect(await connections()).toBe(1);
      await vi.waitFor(async () => expect(await connections()).toBe(0), { timeout: 20_000, interval: 100 });
      expect(Date.now() - started).toBeGreaterThanOrEqual(1000);
    } finally {
      stalled.destroy();
    }
    // A stream pipelined behind another (its response has no socket until the first is done): a
    // client that reads the first to its end, then stops, has its connection closed all the same.
    const pipelined = connect(dispatcher.port, "127.0.0.1");
    pipelined.on("error", () => undefined);
    const secondStarted = new Promise<void>((resolve) => {
      let tail = "";
      pipelined.setEncoding("latin1").on("data", (chunk: string) => {
        tail = (tail + chunk).slice(-chunk.length - 64);
        // The first's last chunk, then the second's status line.
        if (tail.includes("\r\n0\r\n\r\nHTTP/1.1 200")) {
          pipelined.pause();
          resolve();
        }
      });
    });
    pipelined.write(request + request);
    await secondStarted;
    try {
      await vi.waitFor(async () => expect(await connections()).toBe(0), { timeout: 20_000, interval: 100 });
    } finally {
      pipelined.destroy();
    }
    // One that reads it all gets every result.
    const all = await fetch(`http://127.0.0.1:${dispatcher.port}/v1/batches/${batchId}/results`, {
      headers: { authorization: "Bearer tok" },
    });
    const lines = (await all.text()).split("\n").filter((l) => l !== "");
    expect(lines.map((l) => (JSON.parse(l) as { id: string }).id)).toEqual(ids);
  });
});
