import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Redis } from "ioredis";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { assertRedisDurable, createRedis, RedisDurabilityError } from "./connection.ts";
import { FailoverPair, LocalSentinel } from "./testing/index.ts";

// A master and its replica of the test's own, watched by a Redis Sentinel of its own: the fleet
// given `redis-sentinel://…/name` connects to whichever the sentinel names master.
describe("REDIS_URL=redis-sentinel://host:port/name", () => {
  let pair: FailoverPair | null = null;
  let sentinel: LocalSentinel | null = null;
  let conn: Redis | null = null;
  let dir = "";
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), "fleet-sentinel-"));
  });
  afterEach(async () => {
    conn?.disconnect();
    await sentinel?.stop();
    await pair?.stop();
    [conn, sentinel, pair] = [null, null, null];
    rmSync(dir, { recursive: true, force: true });
  });

  it("connects to the master the sentinel names and checks its durability; after the sentinel's failover its writes reach the new master", async () => {
    pair = await FailoverPair.start();
    sentinel = await LocalSentinel.start(dir, pair.a.port);
    const redis = createRedis(sentinel.url);
    conn = redis;
    redis.on("error", () => undefined);
    await assertRedisDurable(redis);
    await redis.set("k", "before");
    expect(await pair.adminA.get("k")).toBe("before");

    expect(await sentinel.failOver()).toBe(pair.b.port);
    // The connection, made to A, moves to B: at the sentinel's failover notice (ioredis's
    // failoverDetector), else at A's first READONLY once the sentinel demotes it (within its 10 s
    // check). Until A is demoted it still takes writes, and loses them when it resyncs from B
    // (Redis's replication is asynchronous): a window no client closes.
    const port = pair.b.port;
    await expect
      .poll(async () => /^tcp_port:(\d+)/m.exec(await redis.info("server"))?.[1], { timeout: 30_000 })
      .toBe(String(port));
    await redis.set("k", "after");
    expect(await pair.adminB.get("k")).toBe("after");
    expect(/^role:master/m.test(await pair.adminB.info("replication"))).toBe(true);
  });

  it("asks sentinels that want a password with the URL's sentinelPassword (the master's own credentials are apart)", async () => {
    pair = await FailoverPair.start();
    sentinel = await LocalSentinel.start(dir, pair.a.port, "fleetmaster", { password: "s&nt+nel pw" });
    // The sentinel does refuse a client without it.
    const anonymous = new Redis({
      port: sentinel.port,
      host: "127.0.0.1",
      lazyConnect: true,
      maxRetriesPerRequest: 0,
    });
    anonymous.on("error", () => undefined);
    await expect(anonymous.call("SENTINEL", "MASTERS")).rejects.toThrow(/NOAUTH|Authentication required/);
    anonymous.disconnect();
    expect(sentinel.url).toContain("?sentinelPassword=s%26nt%2Bnel%20pw");
    const redis = createRedis(sentinel.url);
    conn = redis;
    redis.on("error", () => undefined);
    await assertRedisDurable(redis);
    await redis.set("k", "through an authenticated sentinel");
    expect(await pair.adminA.get("k")).toBe("through an authenticated sentinel");
  });

  it("refuses a master the sentinel names that could evict, as it refuses a plain URL's", async () => {
    pair = await FailoverPair.start();
    sentinel = await LocalSentinel.start(dir, pair.a.port);
    await pair.adminA.config("SET", "maxmemory-policy", "allkeys-lru");
    const redis = createRedis(sentinel.url);
    conn = redis;
    const err = await assertRedisDurable(redis).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RedisDurabilityError);
    expect(String((err as Error).message)).toContain("noeviction");
  });
});
