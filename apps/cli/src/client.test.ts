import { setFlagsFromString } from "node:v8";
import { runInNewContext } from "node:vm";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { ApiError, FleetClient, isApiError } from "./client.ts";
import { LineTooLongError, splitLines } from "./lines.ts";
import { UsageError } from "./requests.ts";
import { apiError, json, startTestServer, type TestServer } from "./testing/http-server.ts";

let server: TestServer;
beforeEach(async () => {
  server = await startTestServer();
});
afterEach(async () => {
  await server.close();
});

const oracleRow = { task: { digest: "a".repeat(64) }, agent: { harness: "oracle" as const } };

function client(extra: Partial<ConstructorParameters<typeof FleetClient>[0]> = {}): FleetClient {
  return new FleetClient({ url: server.url, token: "tok-1", retryBaseMs: 1, ...extra });
}

async function caught(p: Promise<unknown>): Promise<ApiError> {
  try {
    await p;
  } catch (err) {
    expect(isApiError(err)).toBe(true);
    return err as ApiError;
  }
  throw new Error("expected an ApiError");
}

describe("FleetClient", () => {
  it("posts a batch as JSON with auth and an idempotency key", async () => {
    server.on("POST", "/v1/batches", (_req, res) =>
      json(res, 202, { batchId: "b1", rolloutIds: ["r1", "r2"], count: 2, created: true }),
    );
    const accepted = await client().submitBatch([oracleRow, oracleRow]);
    expect(accepted).toEqual({ batchId: "b1", rolloutIds: ["r1", "r2"], count: 2, created: true });
    const [req] = server.requests;
    expect(req?.headers.authorization).toBe("Bearer tok-1");
    expect(req?.headers["content-type"]).toBe("application/json");
    expect(req?.headers["idempotency-key"]).toMatch(/^[0-9a-f-]{36}$/);
    expect(JSON.parse(req?.body ?? "")).toEqual({ rollouts: [oracleRow, oracleRow] });
  });

  it("posts NDJSON when asked, one request per line", async () => {
    server.on("POST", "/v1/batches", (_req, res) =>
      json(res, 202, { batchId: "b1", rolloutIds: ["r1"], count: 1 }),
    );
    await client().submitBatch([oracleRow, oracleRow], { format: "ndjson" });
    const [req] = server.requests;
    expect(req?.headers["content-type"]).toBe("application/x-ndjson");
    expect(
      req?.body
        .trim()
        .split("\n")
        .map((l) => JSON.parse(l)),
    ).toEqual([oracleRow, oracleRow]);
  });

  it("switches to NDJSON on its own for a body over 1 MiB", async () => {
    server.on("POST", "/v1/batches", (_req, res) =>
      json(res, 202, { batchId: "b1", rolloutIds: [], count: 600 }),
    );
    const big = { ...oracleRow, metadata: { pad: "x".repeat(2000) } };
    await client().submitBatch(Array.from({ length: 600 }, () => big));
    expect(server.requests[0]?.headers["content-type"]).toBe("application/x-ndjson");
  });

  it("omits the Authorization header without a token", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) =>
      json(res, 200, { id: "b1", total: 0, counts: {}, done: 0 }),
    );
    await client({ token: null }).getBatch("b1");
    expect(server.requests[0]?.headers.authorization).toBeUndefined();
  });

  it("turns the API's error body into an ApiError with status, code, message and details", async () => {
    server.on("POST", "/v1/rollouts", (_req, res) =>
      apiError(res, 422, "invalid", "agent.harness: invalid option", { path: ["agent", "harness"] }),
    );
    const err = await caught(client().submitRollout(oracleRow));
    expect(err).toBeInstanceOf(ApiError);
    expect(err).toMatchObject({
      name: "ApiError",
      status: 422,
      code: "invalid",
      message: "agent.harness: invalid option",
      details: { path: ["agent", "harness"] },
    });
    expect(server.requests).toHaveLength(1); // 422 is final: no retry
  });

  it("keeps a non-JSON error body readable", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) => {
      res.writeHead(500, { "content-type": "text/plain" }).end("upstream exploded\n");
    });
    const err = await caught(client({ retries: 0 }).getBatch("b1"));
    expect(err).toMatchObject({ status: 500, code: "http_500" });
    expect(err.message).toContain("upstream exploded");
  });

  it("reports 401 as unauthorized", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) =>
      apiError(res, 401, "unauthorized", "missing or bad token"),
    );
    expect(await caught(client().getBatch("b1"))).toMatchObject({ status: 401, code: "unauthorized" });
  });

  it("retries 503 and 429 with the same idempotency key, honouring Retry-After", async () => {
    let calls = 0;
    server.on("POST", "/v1/batches", (_req, res) => {
      calls++;
      if (calls === 1) apiError(res, 503, "unavailable", "redis blip");
      else if (calls === 2) {
        json(res, 429, { error: { code: "backpressure", message: "backlog full" } }, { "retry-after": "0" });
      } else json(res, 202, { batchId: "b9", rolloutIds: ["r1"], count: 1 });
    });
    const retries: number[] = [];
    const accepted = await client({ onRetry: (r) => retries.push(r.attempt) }).submitBatch([oracleRow]);
    expect(accepted.batchId).toBe("b9");
    expect(retries).toEqual([2, 3]);
    const keys = server.requests.map((r) => r.headers["idempotency-key"]);
    expect(keys).toHaveLength(3);
    expect(new Set(keys).size).toBe(1);
  });

  it("gives up after its retries with the last error", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) => apiError(res, 503, "unavailable", "still down"));
    const err = await caught(client({ retries: 2 }).getBatch("b1"));
    expect(err).toMatchObject({ status: 503, code: "unavailable", message: "still down" });
    expect(server.requests).toHaveLength(3);
  });

  it("says when the dispatcher cannot be reached", async () => {
    const url = server.url;
    await server.close();
    const err = await caught(new FleetClient({ url, retries: 1, retryBaseMs: 1 }).getBatch("b1"));
    expect(err).toMatchObject({ status: 0, code: "unreachable" });
    expect(err.message).toContain(`cannot reach the dispatcher at ${url}`);
    server = await startTestServer(); // for afterEach
  });

  it("times out a silent server", async () => {
    server.on("GET", "/v1/batches/slow", () => {
      // never answers
    });
    const err = await caught(client({ timeoutMs: 200, retries: 0 }).getBatch("slow"));
    expect(err).toMatchObject({ status: 0, code: "timeout" });
  });

  it("rejects a response of the wrong shape", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) => json(res, 200, { id: "b1", counts: {} }));
    const err = await caught(client().getBatch("b1"));
    expect(err).toMatchObject({ status: 200, code: "bad_response" });
    expect(err.message).toContain("total");
  });

  it("parses batch status", async () => {
    const body = {
      id: "b1",
      total: 3,
      counts: { accepted: 1, completed: 2 },
      done: 2,
      createdAt: 1700000000000,
    };
    server.on("GET", "/v1/batches/b1", (_req, res) => json(res, 200, body));
    expect(await client().getBatch("b1")).toEqual(body);
  });

  it("streams result lines split across chunks, with CRLF and blank lines", async () => {
    server.on("GET", "/v1/batches/b1/results", async (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write('{"id":"r1","status":"comp');
      await new Promise((r) => setImmediate(r));
      res.write('leted"}\r\n\n{"id":"r2","reward":0.5,"note":"é');
      await new Promise((r) => setImmediate(r));
      // Every line the dispatcher sends ends in \n (a body ending inside a line is cut short).
      res.end('"}\n');
    });
    const lines: string[] = [];
    for await (const line of client().batchResultLines("b1")) lines.push(line);
    expect(lines.map((l) => JSON.parse(l))).toEqual([
      { id: "r1", status: "completed" },
      { id: "r2", reward: 0.5, note: "é" },
    ]);
  });

  it("refuses a line that runs past its cap without ending (a server sending one endless line), not holding all of it", async () => {
    let sent = 0;
    async function* endless(): AsyncGenerator<Uint8Array> {
      yield new TextEncoder().encode('{"id":"r1"}\n{"id":"r2","pad":"');
      // 64 KiB chunks of one line, up to 16 MiB (then it ends, so that a splitter with no cap
      // yields it rather than reading for good).
      const chunk = new Uint8Array(64 * 1024).fill(0x78);
      for (; sent < 256; sent++) yield chunk;
      yield new TextEncoder().encode('"}\n');
    }
    const lines: string[] = [];
    const read = async () => {
      for await (const line of splitLines(endless(), 1024 * 1024)) lines.push(line);
    };
    await expect(read()).rejects.toThrow(LineTooLongError);
    expect(lines).toEqual(['{"id":"r1"}']);
    expect(sent).toBeLessThanOrEqual(17); // it stopped reading at the cap

    // Through the client: an error that says what came, not a crash.
    server.on("GET", "/v1/batches/b1/results", async (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write('{"id":"r1","pad":"');
      const chunk = "x".repeat(1024 * 1024);
      for (let i = 0; i < 80 && !res.destroyed; i++) {
        if (!res.write(chunk)) await new Promise((r) => res.once("drain", r));
      }
      res.end('"}\n');
    });
    const all = async () => {
      for await (const _ of client().batchResultLines("b1")) {
        // the one line never ends within the cap
      }
    };
    const err = await caught(all());
    expect(err).toMatchObject({ code: "bad_response" });
    expect(err.message).toContain(`a line runs past ${64 * 2 ** 20} characters`);
  });

  it("keeps no result it has yielded: its memory stays flat over 64 MiB of results with real-length rollout ids", async () => {
    setFlagsFromString("--expose-gc");
    const gc = runInNewContext("gc") as () => void;
    const n = 4000;
    const detail = "d".repeat(16 * 1024);
    server.on("GET", "/v1/batches/b1/results", async (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      for (let i = 0; i < n; i += 100) {
        let chunk = "";
        for (let j = i; j < i + 100; j++)
          chunk += `{"id":"dabaa2e4dfa84c538117-${j}","detail":"${detail}"}\n`;
        if (!res.write(chunk)) await new Promise((r) => res.once("drain", r));
      }
      res.end();
    });
    const heap = () => {
      gc();
      return process.memoryUsage().heapUsed;
    };
    let read = 0;
    let early = 0;
    let late = 0;
    for await (const line of client().batchResultLines("b1")) {
      expect(line.length).toBeGreaterThan(detail.length);
      read++;
      if (read === 200) early = heap();
      if (read === n - 100) late = heap();
    }
    expect(read).toBe(n);
    // Holding what it read would be 60 MiB more (3,700 results of 16 KiB).
    expect((late - early) / 2 ** 20).toBeLessThan(16);
  });

  it("fetches a results stream that breaks off mid-body again, yielding each result once", async () => {
    let calls = 0;
    server.on("GET", "/v1/batches/b1/results", (_req, res) => {
      calls++;
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      const all = '{"id":"r1"}\n{"id":"r2"}\n{"id":"r3"}\n';
      if (calls === 1) res.write('{"id":"r1"}\n{"id":"r2"}\n{"id":"r3', () => res.destroy());
      else res.end(all);
    });
    const retries: string[] = [];
    const lines: string[] = [];
    for await (const line of client({ onRetry: (r) => retries.push(r.reason) }).batchResultLines("b1")) {
      lines.push(line);
    }
    expect(lines).toEqual(['{"id":"r1"}', '{"id":"r2"}', '{"id":"r3"}']);
    expect(calls).toBe(2);
    expect(retries).toHaveLength(1);
    expect(retries[0]).toContain("the results stream of batch b1");
    expect(retries[0]).toContain("broke off");
  });

  it("reads a results stream again when the dispatcher stops sending mid-body without closing it", async () => {
    let calls = 0;
    server.on("GET", "/v1/batches/b1/results", (_req, res) => {
      calls++;
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      // The first answer stalls after a line (stopped, not closed); the second is whole.
      if (calls === 1) res.write('{"id":"r1"}\n{"id":"r2');
      else res.end('{"id":"r1"}\n{"id":"r2"}\n');
    });
    const retries: string[] = [];
    const lines: string[] = [];
    // The idle bound also covers the second answer: long enough that a loaded host's pause
    // (unit files run in parallel) does not cut that one too.
    for await (const line of client({
      timeoutMs: 1_000,
      onRetry: (r) => retries.push(r.reason),
    }).batchResultLines("b1")) {
      lines.push(line);
    }
    expect(lines).toEqual(['{"id":"r1"}', '{"id":"r2"}']);
    expect(calls).toBe(2);
    expect(retries).toHaveLength(1);
    expect(retries[0]).toContain("no data for 1000 ms");
  });

  it("gives up on a results stream that keeps breaking with an ApiError, not undici's TypeError", async () => {
    server.on("GET", "/v1/batches/b1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write('{"id":"r1', () => res.destroy());
    });
    const read = async () => {
      for await (const _ of client({ retries: 2 }).batchResultLines("b1")) {
        // nothing complete ever arrives
      }
    };
    const err = await caught(read());
    expect(err).toMatchObject({ status: 0, code: "stream_broken" });
    expect(server.requests).toHaveLength(3);
  });

  it("with patience, rides out failures far past its retries, saying once when they start and once when they end", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) => {
      if (server.requests.length <= 6) return apiError(res, 503, "unavailable", "restarting");
      json(res, 200, { id: "b1", total: 1, counts: { completed: 1 }, done: 1 });
    });
    const outages: string[] = [];
    const recoveries: number[] = [];
    const retried: number[] = [];
    const patient = client({
      retries: 1,
      retryMaxMs: 5,
      onRetry: (r) => retried.push(r.attempt),
    }).with({
      patience: {
        maxOutageMs: 60_000,
        onOutage: ({ reason }) => outages.push(reason),
        onRecovered: ({ downMs }) => recoveries.push(downMs),
      },
    });
    expect((await patient.getBatch("b1")).done).toBe(1);
    expect(server.requests).toHaveLength(7);
    expect(outages).toEqual(["GET /v1/batches/b1: HTTP 503 Service Unavailable"]);
    expect(recoveries).toHaveLength(1);
    expect(retried).toEqual([]); // one note per outage, not one per attempt
  });

  it("a batch status that hangs times out after statusTimeoutMs (not timeoutMs), and a patient client rides it out as an outage", async () => {
    // A dispatcher that accepts the connection and never answers (frozen): the first two polls.
    server.on("GET", "/v1/batches/b1", (_req, res) => {
      if (server.requests.length <= 2) return;
      json(res, 200, { id: "b1", total: 1, counts: { completed: 1 }, done: 1 });
    });
    const outages: string[] = [];
    // (500 ms: the poll that answers must fit in it beside the other unit files on a loaded host.)
    const patient = client({ retries: 1, retryMaxMs: 5, timeoutMs: 60_000, statusTimeoutMs: 500 }).with({
      patience: { maxOutageMs: 60_000, onOutage: ({ reason }) => outages.push(reason) },
    });
    expect((await patient.getBatch("b1")).done).toBe(1);
    expect(server.requests).toHaveLength(3);
    expect(outages).toHaveLength(1);
    expect(outages[0]).toMatch(/GET .*\/v1\/batches\/b1: no response within 500 ms/);
    // Never more than the client's own timeout.
    const short = client({ retries: 0, timeoutMs: 30 });
    server.on("GET", "/v1/batches/b2", () => {});
    expect((await caught(short.getBatch("b2"))).message).toContain("no response within 30 ms");
  });

  it("with patience, gives up once failures have lasted maxOutageMs", async () => {
    server.down = true;
    const patient = client({ retries: 1, retryMaxMs: 5, patience: { maxOutageMs: 1_000 } });
    const err = await caught(patient.getBatch("b1"));
    expect(err).toMatchObject({ status: 0, code: "unreachable" });
    expect(err.message).toContain("gave up");
    expect(server.dropped).toBeGreaterThan(2); // past `retries`
  });

  it("with patience, backs off on a Retry-After: 0 (a proxy's) as on none, instead of retrying at once for all of maxOutageMs", async () => {
    server.on("GET", "/v1/batches/b1", (_req, res) =>
      json(res, 503, { error: { code: "unavailable", message: "proxy" } }, { "retry-after": "0" }),
    );
    const patient = client({ retryBaseMs: 100, retryMaxMs: 100, patience: { maxOutageMs: 1_000 } });
    const err = await caught(patient.getBatch("b1"));
    expect(err.message).toContain("gave up");
    // Delays of 0 to 100 ms (50 on average) over one second: about 20 requests, not one a millisecond.
    expect(server.requests.length).toBeLessThan(100);
  });

  it("honours a Retry-After given as an HTTP date (RFC 9110 §10.2.3, a proxy's), not the client's own backoff at once", async () => {
    // Three seconds on: at least two once truncated to the date's whole second.
    const at = new Date(Date.now() + 3_000).toUTCString();
    server.on("GET", "/v1/batches/b1", (_req, res) =>
      json(res, 503, { error: { code: "unavailable", message: "proxy" } }, { "retry-after": at }),
    );
    const stop = new AbortController();
    const delays: number[] = [];
    const onRetry = (r: { delayMs: number }) => {
      delays.push(r.delayMs);
      stop.abort(); // the delay is what is asserted: no need to wait it out
    };
    const err = await caught(client({ retries: 1, signal: stop.signal, onRetry }).getBatch("b1"));
    expect(err.code).toBe("aborted");
    expect(delays).toHaveLength(1);
    expect(delays[0]).toBeGreaterThan(1_000);
    expect(delays[0]).toBeLessThanOrEqual(3_000);
  });

  it("encodes ids in paths and posts cancels", async () => {
    server.on("POST", "/v1/rollouts/a%2Fb/cancel", (_req, res) =>
      json(res, 202, { id: "a/b", status: "cancelling" }),
    );
    await client().cancelRollout("a/b");
    expect(server.requests[0]?.path).toBe("/v1/rollouts/a%2Fb/cancel");
  });

  it("refuses an id that is a dot segment (the URL would resolve it away: `..` posts to /v1/cancel) as bad usage, asking nothing", async () => {
    for (const id of ["..", ".", ""]) {
      await expect(client().cancelRollout(id)).rejects.toBeInstanceOf(UsageError);
      await expect(client().getBatch(id)).rejects.toThrow(`"${id}" is not a rollout or batch id`);
    }
    expect(server.requests).toHaveLength(0);
  });

  it("waits for a batch's cancel past timeoutMs (the dispatcher answers once every rollout was asked to stop), up to batchCancelTimeoutMs", async () => {
    const later = (body: object) => (_req: unknown, res: Parameters<typeof json>[0]) => {
      setTimeout(() => json(res, 202, body), 300);
    };
    server.on("POST", "/v1/batches/b1/cancel", later({ batchId: "b1", cancelled: 5000 }));
    server.on("POST", "/v1/rollouts/r1/cancel", later({ id: "r1", status: "cancelling" }));
    const patient = client({ timeoutMs: 100, retries: 0 });
    expect(await patient.cancelBatch("b1")).toMatchObject({ cancelled: 5000 });
    expect(await caught(patient.cancelRollout("r1"))).toMatchObject({ status: 0, code: "timeout" });
    const err = await caught(
      client({ timeoutMs: 50, batchCancelTimeoutMs: 100, retries: 0 }).cancelBatch("b1"),
    );
    expect(err).toMatchObject({ status: 0, code: "timeout" });
    expect(err.message).toContain("within 100 ms");
  });

  it("sends a batch's cancel that timed out once, not again: its wait is bounded by batchCancelTimeoutMs (10 minutes), and a second would stop every rollout again beside the first", async () => {
    // A dispatcher that never answers (half-open, or still asking a huge batch's rollouts to stop).
    server.on("POST", "/v1/batches/b1/cancel", () => new Promise(() => undefined));
    const err = await caught(
      client({ timeoutMs: 50, batchCancelTimeoutMs: 100, retries: 3 }).cancelBatch("b1"),
    );
    expect(err).toMatchObject({ status: 0, code: "timeout" });
    expect(server.requests.filter((r) => r.path === "/v1/batches/b1/cancel")).toHaveLength(1);
  });
});
