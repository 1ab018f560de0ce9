import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, afterEach, describe, expect, it } from "vitest";
import { createRedis, RedisDurabilityError } from "./connection.ts";
import { freeLoopbackPort, LocalRedisServer } from "./local-redis.ts";
import { RedisCredentialsError, waitForRedis } from "./redis-wait.ts";
import { FailoverPair } from "./testing/index.ts";

/** A logger that says nothing (each test keeps the lines it looks at). */
const SILENT = { warn: () => undefined, error: () => undefined, info: () => undefined };

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
      ...SILENT,
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
      const err = await waitForRedis(redis, {
        logger: { ...SILENT, warn: (_o, msg) => warnings.push(msg) },
      }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(RedisDurabilityError);
      expect((err as Error).message).toMatch(/appendonly is "no".*maxmemory-policy is "allkeys-lru"/);
      expect(warnings).toEqual([]);
    } finally {
      redis.disconnect();
    }
  });

  it.each([
    ["a wrong password", ":wrong@"],
    ["no password", ""],
  ])(
    "refuses at once a Redis that refuses REDIS_URL's credentials (%s), never waiting as for one that is down",
    async (_case, auth) => {
      server = await LocalRedisServer.start({ dir });
      const admin = createRedis(server.url);
      await admin.config("SET", "requirepass", "right");
      admin.disconnect();
      const redis = createRedis(server.url.replace("redis://", `redis://${auth}`), {
        retryStrategy: () => 20,
      });
      const warnings: string[] = [];
      try {
        const err = await waitForRedis(redis, {
          logger: { ...SILENT, warn: (_o, msg) => warnings.push(msg) },
          firstDelayMs: 60_000,
        }).catch((e: unknown) => e);
        expect(err).toBeInstanceOf(RedisCredentialsError);
        expect((err as Error).message).toMatch(/^Redis refuses REDIS_URL's credentials .*(WRONGPASS|NOAUTH)/);
        expect(warnings).toEqual([]);
      } finally {
        redis.disconnect();
      }
    },
  );

  it("ends the wait with an error when the connection is closed meanwhile", async () => {
    const port = await freeLoopbackPort();
    const redis = createRedis(`redis://127.0.0.1:${port}`, { retryStrategy: () => 20 });
    redis.on("error", () => undefined);
    const waiting = waitForRedis(redis, { logger: SILENT, firstDelayMs: 20 });
    redis.disconnect();
    await expect(waiting).rejects.toThrow("closed before Redis was reached");
  });
});

describe("waitForRedis's durability watch (`durable`)", () => {
  let pair: FailoverPair | null = null;
  afterEach(async () => {
    await pair?.stop();
    pair = null;
  });

  it("checks the Redis reached at every reconnect: a failover to a replica that evicts is said once and told false; true again once it is fixed", async () => {
    pair = await FailoverPair.start();
    const { adminB } = pair;
    // The replica runs with an evicting policy, as replicas kept for reads sometimes do.
    await adminB.config("SET", "maxmemory-policy", "allkeys-lru");
    const conn = pair.connect();
    const lines: string[] = [];
    const told: boolean[] = [];
    const logger = {
      warn: (_o: object, msg: string) => lines.push(`warn ${msg}`),
      error: (o: object, msg: string) => lines.push(`error ${msg} ${JSON.stringify(o)}`),
      info: (_o: object, msg: string) => lines.push(`info ${msg}`),
    };
    await waitForRedis(conn, { logger, durable: (ok) => told.push(ok), recheckMs: 100 });
    expect(told).toEqual([true]);

    await pair.failOver();
    // The next write meets the demoted master, and the connection reconnects, to B.
    await expect
      .poll(
        () =>
          conn.set("k", "v").then(
            () => true,
            () => false,
          ),
        { timeout: 10_000 },
      )
      .toBe(true);
    await expect.poll(() => told.at(-1), { timeout: 10_000 }).toBe(false);
    expect(lines.filter((l) => l.startsWith("error"))).toHaveLength(1);
    expect(lines.find((l) => l.startsWith("error"))).toMatch(
      /not safe for its state.*maxmemory-policy is \\"allkeys-lru\\"/,
    );

    // Checked again while it fails, said once: fixed, it is seen without a reconnect.
    await expect.poll(() => told.length, { timeout: 10_000 }).toBeGreaterThanOrEqual(4);
    expect(lines.filter((l) => l.startsWith("error"))).toHaveLength(1);
    await adminB.config("SET", "maxmemory-policy", "noeviction");
    await expect.poll(() => told.at(-1), { timeout: 10_000 }).toBe(true);
    expect(lines.at(-1)).toBe("info the fleet's Redis is safe for its state again");
    // And checked again at the next reconnect (a restart, another failover), not meanwhile.
    const checks = told.length;
    conn.disconnect(true);
    await expect.poll(() => told.length, { timeout: 10_000 }).toBe(checks + 1);
    expect(told.at(-1)).toBe(true);
  });
});
