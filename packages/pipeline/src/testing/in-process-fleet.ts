import { randomUUID } from "node:crypto";
import type { RolloutRequestInput, RolloutResult } from "@fleet/contracts";
import { RolloutRequest } from "@fleet/contracts";
import {
  admit,
  connectRedis,
  type RedisConnection,
  RolloutStore,
  StageQueues,
  TeardownLedger,
} from "@fleet/queue";
import type { SandboxProvider } from "@fleet/sandbox";
import { createLogger } from "@fleet/telemetry";
import { Cluster } from "ioredis";
import type { PipelineDeps } from "../deps.ts";
import { runStageJob } from "../stage-runner.ts";
import { createStageWorkers, type StageWorkerOptions, type StageWorkers } from "../worker.ts";

/**
 * Test/bench helper: the four stage workers in one process against a real Redis, under a
 * private prefix, with a given provider. `close()` stops everything and deletes the prefix's keys.
 */
export interface InProcessFleet {
  prefix: string;
  redis: RedisConnection;
  deps: PipelineDeps;
  workers: StageWorkers | null;
  submit(requests: RolloutRequestInput[], idempotencyKey?: string): Promise<string[]>;
  waitForResults(ids: string[], timeoutMs?: number): Promise<RolloutResult[]>;
  close(): Promise<void>;
}

export async function startInProcessFleet(options: {
  provider: SandboxProvider;
  redisUrl?: string;
  concurrency?: number;
  startWorkers?: boolean;
  deps?: Partial<PipelineDeps>;
  /** Stage worker options beyond the fleet's (e.g. `providerBreaker`). */
  workerOptions?: Partial<StageWorkerOptions>;
}): Promise<InProcessFleet> {
  const prefix = `{t-${randomUUID().slice(0, 8)}}`;
  const redis = connectRedis(options.redisUrl ?? process.env.REDIS_URL ?? "redis://127.0.0.1:6379");
  const store = new RolloutStore(redis, prefix);
  const queues = new StageQueues(redis, prefix);
  const deps: PipelineDeps = {
    store,
    ledger: new TeardownLedger(redis, prefix),
    queues,
    provider: options.provider,
    logger: createLogger({
      name: "test-fleet",
      level: (process.env.FLEET_TEST_LOG_LEVEL as "info") ?? "silent",
    }),
    workerId: `test-${prefix}`,
    stopPollMs: 200,
    ...options.deps,
  };
  const workers =
    options.startWorkers === false
      ? null
      : createStageWorkers(["seed", "run", "verify", "close"], deps, {
          connection: redis,
          prefix,
          concurrency: options.concurrency ?? 4,
          lockDurationMs: 10_000,
          stalledIntervalMs: 5_000,
          ...options.workerOptions,
        });
  return {
    prefix,
    redis,
    deps,
    workers,
    async submit(requests, idempotencyKey) {
      const parsed = requests.map((r) => RolloutRequest.parse(r));
      const r = await admit(
        store,
        queues,
        { requests: parsed, batch: parsed.length > 1, idempotencyKey: idempotencyKey ?? null },
        { maxTaskBytes: 10 * 1024 * 1024 },
      );
      return r.ids;
    },
    async waitForResults(ids, timeoutMs = 120_000) {
      const end = Date.now() + timeoutMs;
      for (;;) {
        const results = await store.getResults(ids);
        if (results.every((r) => r !== null)) return results as RolloutResult[];
        if (Date.now() > end) {
          const missing = ids.filter((_, i) => results[i] === null);
          const states = await Promise.all(
            missing.slice(0, 5).map(async (id) => (await store.get(id))?.status),
          );
          throw new Error(
            `timed out waiting for ${missing.length} results (e.g. ${missing[0]}: ${states[0]})`,
          );
        }
        await new Promise((r) => setTimeout(r, 100));
      }
    },
    async close() {
      await workers?.close(10_000);
      await queues.obliterate().catch(() => undefined);
      await queues.close();
      // On a cluster, SCAN answers for one node only: scan every master (the prefix's slot is on one).
      for (const node of redis instanceof Cluster ? redis.nodes("master") : [redis]) {
        let cursor = "0";
        do {
          const [next, keys] = await node.scan(cursor, "MATCH", `${prefix}*`, "COUNT", 1000);
          cursor = next;
          if (keys.length > 0) await redis.del(...keys);
        } while (cursor !== "0");
      }
      redis.disconnect();
    },
  };
}

/**
 * What the dispatcher's cancel does to a rollout whose run is under way (the stop, and the run's
 * `cancelled` failure), then the close it enqueues, run here: the close's outcome.
 */
export async function cancelAndClose(fleet: InProcessFleet, id: string): Promise<string> {
  await fleet.deps.store.requestCancel(id);
  await fleet.deps.store.recordFailure(
    id,
    {
      stage: "run",
      terminal: true,
      failureKind: "cancelled",
      mask: false,
      reason: "cancelled",
      at: Date.now(),
    },
    { beforeDecided: true },
  );
  return runStageJob(
    "close",
    { data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } },
    fleet.deps,
  );
}
