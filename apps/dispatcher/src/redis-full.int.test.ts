import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createRedis, LocalRedisServer } from "@fleet/queue";
import type { FastifyInstance } from "fastify";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { startTestServer, type TestServer } from "./test-server.ts";

const task = {
  id: "t-full",
  instruction: "Print hello.",
  image: "fleet-base:test",
  solution: { "solve.sh": "#!/bin/sh\necho hello\n" },
  tests: { "test.sh": "#!/bin/sh\nexit 0\n" },
};
const row = { task, agent: { harness: "oracle" } };

/**
 * A real Redis that fills up (`maxmemory` under the `noeviction` the fleet requires): the API
 * answers 503 with Retry-After, which clients retry, never a 500 they give up on. Its own
 * private redis-server: filling the shared one would fail every other test.
 */
describe("the dispatcher on a full Redis", () => {
  const dir = mkdtempSync(join(tmpdir(), "fleet-redis-full-"));
  let server: LocalRedisServer;
  let redis: Redis;
  let testServer: TestServer;
  let app: FastifyInstance;

  beforeAll(async () => {
    server = await LocalRedisServer.start({ dir, args: ["--maxmemory", "8mb"] });
    redis = createRedis(server.url);
    testServer = await startTestServer(redis, "full");
    app = testServer.app;
  });

  afterAll(async () => {
    await testServer?.close();
    redis?.disconnect();
    await server?.kill();
    rmSync(dir, { recursive: true, force: true });
  });

  it("answers 503 with Retry-After to a submission, and to the replay of one admitted before", async () => {
    const post = (key: string) =>
      app.inject({
        method: "POST",
        url: "/v1/batches",
        payload: { rollouts: [row, row] },
        headers: { "idempotency-key": key },
      });
    const admitted = await post("before-full");
    expect(admitted.statusCode, admitted.body).toBe(202);

    // Fill it until Redis refuses a write, then hold it there: its limit set below what it uses.
    // A Redis that has just filled up may free a few buffers (its clients' query buffers, AOF's)
    // and let a small write through again; the test must not depend on when it does.
    let n = 0;
    for (;;) {
      const refused = await redis.set(`filler:${n++}`, "x".repeat(256 * 1024)).then(
        () => false,
        (err: Error) => /^OOM /.test(err.message),
      );
      if (refused) break;
      if (n > 1000) throw new Error("Redis never filled up");
    }
    await redis.config("SET", "maxmemory", "1mb");

    // A new submission (its backlog reservation is refused by a script) and the replay of the
    // one above (its task write is a MULTI that Redis aborts: EXECABORT): both 503, retryable.
    for (const key of ["after-full", "before-full"]) {
      const res = await post(key);
      expect(res.statusCode, `${key}: ${res.body}`).toBe(503);
      expect(res.headers["retry-after"]).toBe("5");
      expect(res.json()).toMatchObject({ error: { code: "unavailable" } });
    }
  });
});
