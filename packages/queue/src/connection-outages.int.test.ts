import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, describe, expect, it } from "vitest";
import { createRedis, failFastOnceReady, logConnectionOutages } from "./connection.ts";
import { freeLoopbackPort, LocalRedisServer } from "./local-redis.ts";
import { FailoverPair } from "./testing/index.ts";

describe("logConnectionOutages", () => {
  let server: LocalRedisServer | null = null;
  const dir = mkdtempSync(join(tmpdir(), "fleet-outages-"));
  afterEach(async () => {
    await server?.kill();
    rmSync(dir, { recursive: true, force: true });
  });

  it("logs an outage once however many reconnects fail, and its end once, through a real Redis going and coming (a first connection that never came: not an outage)", async () => {
    const port = await freeLoopbackPort();
    // Nothing listens yet: every reconnect attempt fails.
    const redis = createRedis(`redis://127.0.0.1:${port}`, { retryStrategy: () => 20 });
    const lines: string[] = [];
    logConnectionOutages(redis, {
      warn: (_obj, msg) => lines.push(msg),
      info: (msg) => lines.push(msg),
    });
    let errors = 0;
    redis.on("error", () => errors++);
    const until = async (cond: () => boolean) => {
      for (let i = 0; !cond(); i++) {
        if (i > 500) throw new Error("timed out waiting for a condition");
        await new Promise((r) => setTimeout(r, 20));
      }
    };
    try {
      await until(() => errors >= 5);
      // Never connected: nothing was lost, and the URL may be the mistake.
      expect(lines).toEqual(["redis not reachable yet (check REDIS_URL); still trying"]);

      // A real Redis comes up on the port: the client reconnects, and the end is logged once.
      server = await LocalRedisServer.start({ dir, port });
      await until(() => redis.status === "ready");
      expect(await redis.ping()).toBe("PONG");
      // A client that connects first time round logs nothing: there was no outage to end.
      const fresh = createRedis(`redis://127.0.0.1:${port}`);
      const freshLines: string[] = [];
      logConnectionOutages(fresh, {
        warn: (_o, msg) => freshLines.push(msg),
        info: (msg) => freshLines.push(msg),
      });
      await until(() => fresh.status === "ready");
      fresh.disconnect();
      expect(freshLines).toEqual([]);
      // It goes again (killed): one more outage line, however many reconnects fail.
      const before = errors;
      await server.kill();
      await until(() => errors >= before + 5);
      expect(lines).toEqual([
        "redis not reachable yet (check REDIS_URL); still trying",
        "redis reachable now",
        "redis connection lost; reconnecting",
      ]);
      // And back again: an outage's end.
      await server.relaunch();
      await until(() => redis.status === "ready");
      expect(lines.at(-1)).toBe("redis connection ready again");
    } finally {
      redis.disconnect();
    }
  });
});

describe("failFastOnceReady", () => {
  const dir = mkdtempSync(join(tmpdir(), "fleet-failfast-"));
  let server: LocalRedisServer | null = null;
  afterEach(async () => {
    await server?.kill();
    rmSync(dir, { recursive: true, force: true });
  });

  it("a command waits for a Redis not up yet, but once it has been up one sent while it is down fails at once", async () => {
    const port = await freeLoopbackPort();
    // Commands are kept until they can go (maxRetriesPerRequest null), through reconnect
    // attempts 200 ms apart until Redis has come up, and a minute apart after that.
    const redis = createRedis(`redis://127.0.0.1:${port}`, { retryStrategy: () => 200 });
    redis.on("error", () => undefined);
    failFastOnceReady(redis);
    try {
      // Sent before Redis is up: it waits, and is answered once Redis comes.
      const early = redis.ping();
      server = await LocalRedisServer.start({ dir, port });
      expect(await early).toBe("PONG");
      // Down now, the next attempt a minute away: a command left in the offline queue would
      // outlast this test by far. It fails at once, in ioredis' words.
      redis.options.retryStrategy = () => 60_000;
      const closed = new Promise((resolve) => redis.once("close", resolve));
      await server.kill();
      await closed;
      await expect(redis.get("x")).rejects.toThrow(/enableOfflineQueue options is false/);
    } finally {
      redis.disconnect();
    }
  });
});

describe("a failover behind the Redis URL's name", () => {
  let pair: FailoverPair | null = null;
  afterEach(async () => {
    await pair?.stop();
    pair = null;
  });

  it("a connection left on the demoted master reconnects at its first READONLY, and its next write reaches the new master", async () => {
    pair = await FailoverPair.start();
    const conn = pair.connect();
    await conn.set("k", "before");

    await pair.failOver();
    // Its TCP connection still goes to the old master, a replica now: the write is refused, as
    // a write Redis refuses is (the caller holds or retries it), not resent...
    await expect(conn.set("k", "after")).rejects.toThrow(/^READONLY /);
    // ...and the connection is made again, through the name: to the new master.
    let refusals = 0;
    for (;;) {
      try {
        await conn.set("k", "after");
        break;
      } catch (err) {
        if (!/^READONLY /.test((err as Error).message) || ++refusals > 100) throw err;
        await new Promise((r) => setTimeout(r, 20));
      }
    }
    expect(await pair.adminB.get("k")).toBe("after");
    // B is the master now: the write went there, not to a stale copy.
    expect(field(await pair.adminB.info("replication"), "role")).toBe("master");
  });
});

function field(info: string, name: string): string | undefined {
  return new RegExp(`^${name}:(\\S+)`, "m").exec(info)?.[1];
}
