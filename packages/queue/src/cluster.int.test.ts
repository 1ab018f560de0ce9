import { redisUrlVar } from "@fleet/config";
import { RolloutRequest } from "@fleet/contracts";
import { type InProcessFleet, type PipelineDeps, startInProcessFleet } from "@fleet/pipeline";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { Cluster } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { admit } from "./admission.ts";
import {
  assertRedisDurable,
  connectRedis,
  createRedis,
  parseClusterUrl,
  type RedisConnection,
  RedisDurabilityError,
} from "./connection.ts";
import { createKeys } from "./keys.ts";
import { RedisCredentialsError, waitForRedis } from "./redis-wait.ts";
import { RolloutStore } from "./rollout-store.ts";
import { type LoopbackRedisCluster, startLoopbackRedisCluster } from "./testing/redis-cluster.ts";

describe("the fleet on a 3-master Redis Cluster (loopback)", () => {
  let cluster: LoopbackRedisCluster;
  let conn: RedisConnection;

  beforeAll(async () => {
    cluster = await startLoopbackRedisCluster();
    conn = connectRedis(cluster.url);
  });

  afterAll(async () => {
    conn?.disconnect();
    await cluster?.stop();
  });

  it("parses cluster URLs", () => {
    expect(parseClusterUrl("redis-cluster://a:1,b:2")).toEqual({
      nodes: [
        { host: "a", port: 1 },
        { host: "b", port: 2 },
      ],
      redisOptions: {},
    });
    expect(parseClusterUrl("rediss-cluster://u:p%40ss@[::1]:7000/")).toEqual({
      nodes: [{ host: "::1", port: 7000 }],
      redisOptions: { tls: {}, username: "u", password: "p@ss" },
    });
    expect(() => parseClusterUrl("redis-cluster://a:1/0")).toThrow(/no database/);
    // The standalone-only factory refuses a cluster URL rather than connecting to one node.
    expect(() => createRedis("redis-cluster://a:1,b:2")).toThrow(/connectRedis/);
    // REDIS_URL accepts it, so every app can be pointed at a cluster.
    expect(redisUrlVar().safeParse(cluster.url).success).toBe(true);
  });

  it("connects as a Cluster and checks every master for durability", async () => {
    expect(conn).toBeInstanceOf(Cluster);
    await assertRedisDurable(conn);
    const masters = (conn as Cluster).nodes("master");
    expect(masters).toHaveLength(3);
    // One master that could evict: the whole cluster is refused, naming that node.
    const bad = cluster.ports[1]!;
    await cluster.cli(bad, "config", "set", "maxmemory-policy", "allkeys-lru");
    try {
      const err = await assertRedisDurable(conn).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(RedisDurabilityError);
      expect(String((err as Error).message)).toContain(`127.0.0.1:${bad}`);
      expect(String((err as Error).message)).toContain("noeviction");
    } finally {
      await cluster.cli(bad, "config", "set", "maxmemory-policy", "noeviction");
    }
    // One master fsyncing once a second: refused, naming it, unless the operator accepts write loss.
    await cluster.cli(bad, "config", "set", "appendfsync", "everysec");
    try {
      const err = await assertRedisDurable(conn).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(RedisDurabilityError);
      expect(String((err as Error).message)).toContain(`127.0.0.1:${bad}: `);
      expect(String((err as Error).message)).toContain("appendfsync");
      await expect(assertRedisDurable(conn, { acceptWriteLoss: true })).resolves.toBeUndefined();
    } finally {
      await cluster.cli(bad, "config", "set", "appendfsync", "always");
    }
    await assertRedisDurable(conn);
  });

  it("an app's start (waitForRedis) on a fresh Cluster connection: ready, checked, no warning", async () => {
    const fresh = connectRedis(cluster.url, { maxRetriesPerRequest: 2 });
    const warnings: string[] = [];
    try {
      await waitForRedis(fresh, {
        logger: { warn: (_o, msg) => warnings.push(msg), error: () => undefined, info: () => undefined },
      });
      expect(fresh.status).toBe("ready");
      expect(warnings).toEqual([]);
    } finally {
      fresh.disconnect();
    }
  });

  it("an app's start on a Cluster that refuses REDIS_URL's credentials: a credentials error naming the refusal, not a wait for an outage", async () => {
    // Redis answers AUTH for a user it does not know with WRONGPASS; the Cluster client wraps it
    // in "Failed to refresh slots cache." on every try.
    const refused = connectRedis(cluster.url.replace("redis-cluster://", "redis-cluster://nobody:wrong@"));
    const warnings: string[] = [];
    let waited: () => void = () => undefined;
    const keptWaiting = new Promise<"kept waiting">((resolve) => {
      waited = () => resolve("kept waiting");
    });
    try {
      const outcome = await Promise.race([
        waitForRedis(refused, {
          logger: {
            warn: (o, msg) => {
              warnings.push(`${msg} ${JSON.stringify(o)}`);
              if (warnings.length >= 3) waited();
            },
            error: () => undefined,
            info: () => undefined,
          },
          firstDelayMs: 100,
          maxDelayMs: 100,
        }).catch((e: unknown) => e),
        keptWaiting,
      ]);
      expect(outcome).toBeInstanceOf(RedisCredentialsError);
      expect((outcome as Error).message).toMatch(/^Redis refuses REDIS_URL's credentials .*WRONGPASS/);
    } finally {
      refused.disconnect();
    }
  });

  it("refuses a prefix without a hash tag (its keys would spread over slots)", async () => {
    expect(() => createKeys("fleet")).toThrow(/hash tag/);
    expect(() => new RolloutStore(conn, "fleet:x")).toThrow(/hash tag/);
    // What the check prevents: a multi-key script across slots is refused by the cluster.
    await expect(conn.eval("return 1", 2, "fleet:a", "fleet:b")).rejects.toThrow(/CROSSSLOT/);
  });

  it("runs 20 rollouts to completion exactly once, all keys in one slot", async () => {
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === "hello-file");
    if (!task) throw new Error("no hello-file task");
    const runs = new Map<string, number>();
    const verifies = new Map<string, number>();
    const bump = (m: Map<string, number>, id: string) => m.set(id, (m.get(id) ?? 0) + 1);
    const createHarness: NonNullable<PipelineDeps["createHarness"]> = (agent) => ({
      name: agent.harness,
      async run(ctx) {
        bump(runs, ctx.handle.rolloutId);
        return { exec: execResult(), answer: null, transcript: null, usage: null };
      },
    });
    const provider = new InMemorySandboxProvider();
    let fleet: InProcessFleet | undefined;
    try {
      fleet = await startInProcessFleet({
        provider,
        redisUrl: cluster.url,
        concurrency: 4,
        deps: {
          createHarness,
          verify: async (ctx) => {
            bump(verifies, ctx.handle.rolloutId);
            return { reward: 1, details: { kind: "cluster-test" } };
          },
        },
      });
      expect(fleet.redis).toBeInstanceOf(Cluster);
      const n = 20;
      const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
      const { batchId, ids } = await admit(
        fleet.deps.store,
        fleet.deps.queues,
        { requests: Array.from({ length: n }, () => request), batch: true, idempotencyKey: null },
        { maxTaskBytes: 10 * 1024 * 1024 },
      );
      expect(ids).toHaveLength(n);
      expect(batchId).not.toBeNull();
      const t0 = performance.now();
      const results = await fleet.waitForResults(ids, 90_000);
      const ms = performance.now() - t0;
      console.log(`cluster: ${n} rollouts in ${Math.round(ms)} ms (${((n / ms) * 1000).toFixed(1)}/s)`);
      expect(results.map((r) => r.status)).toEqual(Array(n).fill("completed"));
      expect(results.map((r) => r.reward)).toEqual(Array(n).fill(1));
      for (const id of ids) {
        expect(runs.get(id), `harness runs of ${id}`).toBe(1);
        expect(verifies.get(id), `verifies of ${id}`).toBe(1);
        expect((await fleet.deps.store.get(id))?.status).toBe("completed");
      }
      const batch = await fleet.deps.store.getBatch(batchId!);
      expect(batch?.total).toBe(n);
      expect(batch?.done).toBe(n);
      expect(batch?.counts.completed).toBe(n);
      expect(Object.values(batch!.counts).reduce((a, b) => a + b, 0)).toBe(n);
      expect(await fleet.deps.store.inflightCount()).toBe(0);
      // Every key of the fleet (BullMQ's included) is in the prefix's one slot. Each key is
      // checked on its own (the workers still run: a count of the slot's keys and one of all keys,
      // read at two moments, can differ by a key made or expired between them).
      const slot = (await conn.cluster("KEYSLOT", fleet.prefix)) as number;
      const keys = (await Promise.all((conn as Cluster).nodes("master").map((m) => m.keys("*")))).flat();
      expect(keys.length).toBeGreaterThan(n);
      const slots = await Promise.all(keys.map(async (k) => (await conn.cluster("KEYSLOT", k)) as number));
      expect(keys.filter((_, i) => slots[i] !== slot)).toEqual([]);
      expect([...provider.sandboxes.values()].filter((s) => s.alive)).toEqual([]);
    } finally {
      await fleet?.close();
    }
    // close() found the keys on whichever master holds the slot and deleted them all.
    const left = await Promise.all((conn as Cluster).nodes("master").map((m) => m.dbsize()));
    expect(left.reduce((a, b) => a + b, 0)).toBe(0);
  });
});
