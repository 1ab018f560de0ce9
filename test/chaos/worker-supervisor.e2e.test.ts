import { createStageWorkers, type PipelineDeps } from "@fleet/pipeline";
import { createRedis, RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
import type { SandboxProvider } from "@fleet/sandbox";
import { createLogger } from "@fleet/telemetry";
import { afterAll, describe, expect, it } from "vitest";
import { dropPrefix, REDIS_URL, testPrefix, waitFor } from "../helpers/env.ts";

/**
 * The stage workers heal themselves: a BullMQ worker that stopped taking jobs on its own (its
 * loop ended, or it sits idle while jobs wait, as after a reconnect that never became ready)
 * is replaced by a new one on a new connection, without restarting the process.
 */
describe("stage worker supervisor", () => {
  const prefix = testPrefix("supervisor");
  const redis = createRedis(REDIS_URL);
  const queues = new StageQueues(redis, prefix);
  const deps: PipelineDeps = {
    store: new RolloutStore(redis, prefix),
    ledger: new TeardownLedger(redis, prefix),
    queues,
    // Jobs here name unknown rollouts, which are dropped before any sandbox call.
    provider: { name: "docker", endpoint: "unused" } as unknown as SandboxProvider,
    logger: createLogger({ name: "supervisor-test", level: "silent" }),
    workerId: "supervisor-test",
  };

  afterAll(async () => {
    await queues.obliterate();
    await queues.close();
    redis.disconnect();
    await dropPrefix(REDIS_URL, prefix);
  });

  it("replaces a worker that stopped running, and the new one takes the waiting jobs", async () => {
    const workers = createStageWorkers(["verify"], deps, {
      connection: redis,
      prefix,
      concurrency: 1,
      supervise: { intervalMs: 200, stuckAfterMs: 1_000 },
    });
    const state = (id: string) => queues.queues.verify.getJobState(`${id}.verify`);
    try {
      await queues.enqueue("verify", "r1");
      await waitFor("r1 processed", async () => (await state("r1")) === "completed", 20_000);
      const first = workers.workers[0]!;
      // The worker's loop ends (as a dead connection or a crashed loop would leave it).
      await first.pause(true);
      await waitFor("the supervisor to replace it", async () => workers.recreated >= 1, 20_000);
      expect(first.isRunning()).toBe(false);
      await queues.enqueue("verify", "r2");
      await waitFor("r2 processed by a replacement", async () => (await state("r2")) === "completed", 20_000);
      expect(workers.recreated).toBeGreaterThanOrEqual(1);
      expect(workers.workers[0]).not.toBe(first);
    } finally {
      await workers.close(5_000);
    }
  });
});
