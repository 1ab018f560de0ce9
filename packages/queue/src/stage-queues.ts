import type { StageName } from "@fleet/contracts";
import { Queue, type QueueOptions } from "bullmq";
import { STAGE_CATALOG, STAGES, stageJobId } from "./catalog.ts";
import type { RedisConnection } from "./connection.ts";

/** The four stage queues, sharing one connection and prefix. */
export class StageQueues {
  readonly queues: Record<StageName, Queue>;

  constructor(connection: RedisConnection, prefix: string, extra: Partial<QueueOptions> = {}) {
    const make = (stage: StageName) =>
      new Queue(stage, { connection, prefix, defaultJobOptions: STAGE_CATALOG[stage].options, ...extra });
    this.queues = { seed: make("seed"), run: make("run"), verify: make("verify"), close: make("close") };
  }

  /** Enqueue a stage for a rollout; a second enqueue of the same stage is a no-op while the job exists. */
  async enqueue(stage: StageName, rolloutId: string, options: { delayMs?: number } = {}): Promise<void> {
    const data = STAGE_CATALOG[stage].schema.parse({ rolloutId });
    await this.queues[stage].add(stage, data, {
      jobId: stageJobId(rolloutId, stage),
      ...(options.delayMs ? { delay: options.delayMs } : {}),
    });
  }

  /** Bulk-enqueue seeds for many rollouts in one round trip. */
  async enqueueSeeds(rolloutIds: readonly string[]): Promise<void> {
    if (rolloutIds.length === 0) return;
    await this.queues.seed.addBulk(
      rolloutIds.map((rolloutId) => ({
        name: "seed",
        data: { rolloutId },
        opts: { ...STAGE_CATALOG.seed.options, jobId: stageJobId(rolloutId, "seed") },
      })),
    );
  }

  /** Jobs not yet finished across all stage queues (for backpressure and metrics). */
  async counts(): Promise<Record<StageName, Record<string, number>>> {
    const entries = await Promise.all(
      STAGES.map(
        async (s) =>
          [
            s,
            await this.queues[s].getJobCounts(
              "waiting",
              "active",
              "delayed",
              "prioritized",
              "failed",
              "completed",
            ),
          ] as const,
      ),
    );
    return Object.fromEntries(entries) as Record<StageName, Record<string, number>>;
  }

  async close(): Promise<void> {
    await Promise.all(STAGES.map((s) => this.queues[s].close()));
  }

  /** Test helper: remove every job and key of the four queues. */
  async obliterate(): Promise<void> {
    await Promise.all(STAGES.map((s) => this.queues[s].obliterate({ force: true })));
  }
}
