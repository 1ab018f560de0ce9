import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, afterEach, describe, expect, it } from "vitest";
import { createRedis, RedisDurabilityError } from "./connection.ts";
import { freeLoopbackPort, LocalRedisServer } from "./local-redis.ts";
import { waitForRedis } from "./redis-wait.ts";

describe("waitForRedis", () => {
  let server: LocalRedisServer | null = null;
  const dir = mkdtempSync(join(tmpdir(), "fleet-redis-wait-"));
  afterEach(async () => {
    await server?.kill();
    server = null;
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  const until = async (cond: () => boolean) => {
    for (let i = 0; !cond(); i++) {
      if (i > 1_000) throw new Error("timed out waiting for a condition");
      await new Promise((r) => setTimeout(r, 20));
    }
  };

  it("waits for a Redis that is not up yet, saying so with the connection's error, and returns once it answers", async () => {
    const port = await freeLoopbackPort();
    // As the dispatcher's connection: commands give up after two reconnects, so the old start
    // (one durability check) failed while Redis was still coming.
    const redis = createRedis(`redis://127.0.0.1:${port}`, {
      maxRetriesPerRequest: 2,
      retryStrategy: () => 20,
    });
    redis.on("error", () => undefined);
    const warnings: Array<{ obj: Record<string, unknown>; msg: string }> = [];
    const logger = {
      warn: (obj: object, msg: string) => warnings.push({ obj: obj as Record<string, unknown>, msg }),
    };
    let settled: "pending" | "resolved" | Error = "pending";
    const waiting = waitForRedis(redis, { logger, firstDelayMs: 20, maxDelayMs: 100 }).then(
      () => {
        settled = "resolved";
      },
      (err: Error) => {
        settled = err;
      },
    );
    try {
      // Several retries, with backoff, and still waiting.
      await until(() => warnings.length >= 3);
      expect(settled).toBe("pending");
      expect(warnings[0]!.msg).toContain("cannot reach Redis (REDIS_URL) yet");
      expect(String(warnings[0]!.obj.err)).toContain("ECONNREFUSED");
      // Redis comes up on the port: the wait ends, the check passed.
      server = await LocalRedisServer.start({ dir, port });
      await waiting;
      expect(settled).toBe("resolved");
      expect(await redis.ping()).toBe("PONG");
    } finally {
      redis.disconnect();
      await waiting;
    }
  });

  it("refuses at once a Redis that answers but is not safe for the fleet (AOF off, evicting)", async () => {
    server = await LocalRedisServer.start({
      dir,
      args: ["--appendonly", "no", "--maxmemory-policy", "allkeys-lru"],
    });
    const redis = createRedis(server.url, { maxRetriesPerRequest: 2 });
    const warnings: string[] = [];
    try {
      const err = await waitForRedis(redis, { logger: { warn: (_o, msg) => warnings.push(msg) } }).catch(
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(RedisDurabilityError);
      expect((err as Error).message).toMatch(/appendonly is "no".*maxmemory-policy is "allkeys-lru"/);
      expect(warnings).toEqual([]);
    } finally {
      redis.disconnect();
    }
  });

  it("ends the wait with an error when the connection is closed meanwhile", async () => {
    const port = await freeLoopbackPort();
    const redis = createRedis(`redis://127.0.0.1:${port}`, { retryStrategy: () => 20 });
    redis.on("error", () => undefined);
    const waiting = waitForRedis(redis, { logger: { warn: () => undefined }, firstDelayMs: 20 });
    redis.disconnect();
    await expect(waiting).rejects.toThrow("closed before Redis was reached");
  });
});
