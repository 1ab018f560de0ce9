import type { StageName } from "@fleet/contracts";
import { Job, type JobsOptions, Queue } from "bullmq";
import { batcherFor, type ScriptBatcher } from "./batcher.ts";
import { FINISHED_JOB_AGE_MS, STAGE_CATALOG, STAGES, stageJobId } from "./catalog.ts";
import type { RedisConnection } from "./connection.ts";
import type { BatchedScript } from "./scripts.ts";

/** A stage's job for a rollout: name, payload and options, with its deterministic id. */
function stageJob(
  stage: StageName,
  rolloutId: string,
  delayMs?: number,
): { name: StageName; data: { rolloutId: string }; opts: JobsOptions & { jobId: string } } {
  // The catalog's options, then the job's own, in that order. Not `{ ...options, jobId }`: V8
  // (Node 20) adds a property to a spread clone on a slow path, several µs a job.
  const opts: JobsOptions & { jobId: string } = Object.assign({}, STAGE_CATALOG[stage].options, {
    jobId: stageJobId(rolloutId, stage),
  });
  if (delayMs) opts.delay = delayMs;
  return { name: stage, data: { rolloutId }, opts };
}

/**
 * Most seed jobs `enqueueSeeds` sends in one `addBulk` (one transaction): about 30 ms of the
 * event loop to build on a loaded host, and as many rollouts as `RolloutStore.admit` records a
 * round trip.
 */
export const SEED_CHUNK = 500;

/** The four stage queues, sharing one connection and prefix. */
export class StageQueues {
  readonly queues: Record<StageName, Queue>;
  private readonly batcher: ScriptBatcher;

  constructor(connection: RedisConnection, prefix: string) {
    // `enqueueAfter` sends the fleet's scripts on the queues' connection (BullMQ shares it).
    this.batcher = batcherFor(connection);
    const make = (stage: StageName) =>
      new Queue(stage, { connection, prefix, defaultJobOptions: STAGE_CATALOG[stage].options });
    this.queues = { seed: make("seed"), run: make("run"), verify: make("verify"), close: make("close") };
  }

  /** Enqueue a stage for a rollout; a second enqueue of the same stage is a no-op while the job exists. */
  async enqueue(stage: StageName, rolloutId: string, options: { delayMs?: number } = {}): Promise<void> {
    const job = stageJob(stage, rolloutId, options.delayMs);
    await this.queues[stage].add(job.name, job.data, job.opts);
  }

  /**
   * The fleet script `script` (e.g. a stage receipt), then the job of `stage` for the rollout,
   * sent together on the queues' connection (through its `ScriptBatcher`) without waiting for the
   * script's reply. Redis runs one connection's commands in order, so the job cannot be taken
   * before the script ran. Returns the script's reply; throws if either command failed (the
   * stage then retries, and a re-added job id is deduplicated). Not an ioredis pipeline:
   * building one copies every script defined on the connection (BullMQ's several dozen), which
   * costs more than the round trip it saves.
   */
  async enqueueAfter(
    stage: StageName,
    rolloutId: string,
    script: BatchedScript,
    keys: readonly string[],
    args: readonly string[],
  ): Promise<unknown> {
    const queue = this.queues[stage];
    const job = stageJob(stage, rolloutId);
    const client = await queue.getBackend().client;
    // BullMQ's `Queue.add` minus its telemetry span; `addJob` sends synchronously.
    const add = () => new Job(queue, job.name, job.data, job.opts, job.opts.jobId).addJob(client);
    return this.batcher.call(script, keys, args, add);
  }

  /**
   * Bulk-enqueue seeds for many rollouts, `SEED_CHUNK` jobs a round trip, in order. One `addBulk`
   * builds its whole transaction (a Job, a script call and its buffers per rollout) in one
   * stretch of the event loop before it first waits on Redis: 40,000 seeds of an NDJSON batch held
   * it for 2.4-2.5 s (a third of it GC), /healthz unanswered. Each job's id is deterministic, so a
   * run cut short between chunks is finished by enqueueing them all again (a replay, the janitor).
   */
  async enqueueSeeds(rolloutIds: readonly string[]): Promise<void> {
    for (let i = 0; i < rolloutIds.length; i += SEED_CHUNK) {
      const chunk = rolloutIds.slice(i, i + SEED_CHUNK);
      await this.queues.seed.addBulk(chunk.map((rolloutId) => stageJob("seed", rolloutId)));
    }
  }

  /**
   * When a delayed stage job of `rolloutId` is due (epoch ms, on the clock of whoever delayed it:
   * BullMQ scores its delayed set by ms × 4096 plus an order), or null when it is not delayed.
   */
  async delayedUntil(stage: StageName, rolloutId: string): Promise<number | null> {
    const queue = this.queues[stage];
    const client = await queue.getBackend().client;
    const score = await client.zscore(queue.keys.delayed!, stageJobId(rolloutId, stage));
    return score === null ? null : Math.floor(Number(score) / 0x1000);
  }

  /**
   * Remove finished stage jobs older than `FINISHED_JOB_AGE_MS` (at most `limit` per queue and
   * kind), as BullMQ's own trim would had another job of the queue finished since. Left, a
   * finished job outlived its rollout's record, and a rollout admitted again under its key after
   * the record expired found its old job id taken: its seed was never added. Returns how many.
   */
  async trimFinished(
    limit = 1000,
    ages: { completed: number; failed: number } = FINISHED_JOB_AGE_MS,
  ): Promise<number> {
    let removed = 0;
    for (const stage of STAGES) {
      for (const kind of ["completed", "failed"] as const) {
        removed += (await this.queues[stage].clean(ages[kind], limit, kind)).length;
      }
    }
    return removed;
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
