import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { RolloutResult, TaskContent } from "@fleet/contracts";
import { connectRedis, createKeys } from "@fleet/queue";
import { type LoopbackRedisCluster, startLoopbackRedisCluster } from "@fleet/queue/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import type { Cluster } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FleetProcesses } from "../scripts/lib/fleet-processes.ts";
import { callApi } from "./helpers/api.ts";
import { containersOf, IMAGE, testPrefix, waitFor } from "./helpers/env.ts";

/**
 * DESIGN §8 scale-out, simulated: two dispatcher replicas, the workers (two agent-worker replicas)
 * and the janitor as separate processes against a 3-master Redis Cluster on loopback.
 */
describe("the fleet as separate processes on a Redis Cluster", () => {
  const prefix = testPrefix("cluster");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-cluster-e2e-"));
  let cluster: LoopbackRedisCluster;
  let fleet: FleetProcesses | undefined;
  let suite: TaskContent[];
  const ids: string[] = [];

  const api = (method: string, path: string, body?: unknown, headers?: Record<string, string>) =>
    callApi(fleet!, method, path, body, headers);

  beforeAll(async () => {
    suite = await loadSuite(EXAMPLE_SUITE_DIR);
    cluster = await startLoopbackRedisCluster();
    fleet = await FleetProcesses.start({
      redisUrl: cluster.url,
      prefix,
      logDir,
      replicas: { agent: 2, dispatcher: 2 },
      // Two runs at a time per agent worker: six rollouts need both replicas.
      env: { FLEET_CONCURRENCY: "2", FLEET_JANITOR_INTERVAL_MS: "2000", FLEET_METRICS_PORT: "0" },
    });
  });

  afterAll(async () => {
    await fleet?.stop();
    await cluster?.stop();
    if (process.env.FLEET_KEEP_LOGS !== "1") rmSync(logDir, { recursive: true, force: true });
    expect(await containersOf(ids)).toBe(0);
  });

  it("runs a batch of 6 oracle rollouts exactly once, every key in the prefix's slot; both dispatchers admit it once and answer alike", async () => {
    const task = { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE };
    const rows = Array.from({ length: 6 }, () => ({ task, agent: { harness: "oracle" } }));
    // The same keyed batch to both dispatchers at once (a client's retry that a load balancer
    // sent to the other replica): one admits it, the other replays it.
    const key = { "idempotency-key": `k-${prefix}` };
    const second = { url: fleet!.urls[1]!, token: fleet!.token };
    expect(fleet!.urls).toHaveLength(2);
    const [b, replay] = await Promise.all([
      api("POST", "/v1/batches", { rollouts: rows }, key),
      callApi(second, "POST", "/v1/batches", { rollouts: rows }, key),
    ]);
    expect([b.status, replay.status].sort()).toEqual([200, 202]);
    expect([b.body?.created, replay.body?.created].sort()).toEqual([false, true]);
    expect(replay.body?.batchId).toBe(b.body?.batchId);
    expect(replay.body?.rolloutIds).toEqual(b.body?.rolloutIds);
    const other = await callApi(second, "POST", "/v1/batches", { rollouts: rows.slice(1) }, key);
    expect(other.status).toBe(409);
    const batchId = String(b.body?.batchId);
    ids.push(...((b.body?.rolloutIds ?? []) as string[]));
    expect(ids).toHaveLength(6);
    const t0 = Date.now();
    const batch = await waitFor(
      "the batch to finish",
      async () => {
        const s = await api("GET", `/v1/batches/${batchId}`);
        return Number(s.body?.done) === rows.length ? s.body : null;
      },
      240_000,
    );
    console.log(`cluster e2e: 6 oracle rollouts in ${Date.now() - t0} ms`);
    expect(batch).toMatchObject({ total: 6, done: 6, counts: { completed: 6 } });
    for (const id of ids) {
      const r = (await api("GET", `/v1/rollouts/${id}`)).body as unknown as RolloutResult;
      expect(r).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
      expect((await callApi(second, "GET", `/v1/rollouts/${id}`)).body).toEqual(r);
    }

    // Each run ran once across the two agent replicas (their fleet_stage_jobs_total).
    const runs = await Promise.all(
      fleet!.of("agent").map(async (p) => {
        const text = await fetch(`http://127.0.0.1:${p.metricsPort}/metrics`).then((r) => r.text());
        const line = text
          .split("\n")
          .find(
            (l) =>
              l.startsWith("fleet_stage_jobs_total{") &&
              l.includes('stage="run"') &&
              l.includes('outcome="ok"'),
          );
        return Number(line?.split(" ").at(-1) ?? Number.NaN);
      }),
    );
    console.log(`cluster e2e: run jobs per agent replica ${JSON.stringify(runs)}`);
    expect(runs).toHaveLength(2);
    expect(runs.reduce((a, n) => a + n, 0)).toBe(6);

    const redis = connectRedis(cluster.url) as Cluster;
    try {
      const keys = createKeys(prefix);
      for (const id of ids) {
        // Launched once, finished once.
        expect(await redis.hget(keys.rollout(id), "launches"), `launches of ${id}`).toBe("1");
      }
      expect(await redis.zcard(keys.inflight())).toBe(0);
      // Every key (BullMQ's included) is in the prefix's one slot, each key checked on its own:
      // the fleet's processes still run (the janitor's ticks make and drop keys), so a count of
      // the slot's keys and one of all keys, read at two moments, can differ by a key.
      const slot = (await redis.cluster("KEYSLOT", prefix)) as number;
      const perMaster = await Promise.all(redis.nodes("master").map((m) => m.keys("*")));
      const all = perMaster.flat();
      expect(all.length).toBeGreaterThan(6);
      const slots = await Promise.all(all.map(async (k) => (await redis.cluster("KEYSLOT", k)) as number));
      expect(all.filter((_, i) => slots[i] !== slot)).toEqual([]);
      // Only the master that owns the slot holds anything.
      expect(perMaster.filter((k) => k.length > 0)).toHaveLength(1);
    } finally {
      redis.disconnect();
    }
  });
});
