import { StageJob, type StageName } from "@fleet/contracts";
import type { JobsOptions } from "bullmq";

/** One entry per stage queue: its payload schema and its job options. */
export interface StageCatalogEntry {
  stage: StageName;
  schema: typeof StageJob;
  options: JobsOptions;
}

/**
 * Finished jobs trimmed (the rollout record is the durable result). A job keeps the stack of its
 * last failed attempt only: BullMQ would keep one per attempt, each with its message (up to 4,000
 * characters), so that a seed failing all its 8 attempts in a Docker incident weighed up to 70 KB
 * in the failed set, 50,000 of them enough to fill a Redis under noeviction. The rollout's own
 * failure log keeps every attempt's reason.
 */
const trim = {
  removeOnComplete: { age: 3600, count: 10_000 },
  removeOnFail: { age: 24 * 3600, count: 50_000 },
  stackTraceLimit: 1,
} satisfies JobsOptions;

/**
 * How long a finished stage job is kept (`trim`'s ages, in ms). BullMQ trims by age only when
 * another job of its queue finishes the same way, so on a quiet queue a finished job stays for
 * good; the janitor trims them by these ages too (`StageQueues.trimFinished`).
 */
export const FINISHED_JOB_AGE_MS = {
  completed: trim.removeOnComplete.age * 1000,
  failed: trim.removeOnFail.age * 1000,
} as const;

/**
 * The job catalog. Attempts are an upper bound: retries also stop when the next one could not
 * start before the rollout's deadline (retries share one deadline, DESIGN §2 rule 5). They are
 * sized so that the backoff alone rides out a Docker daemon or Redis outage of half a minute
 * or more (seed ≤ 127 s, run ≤ 62 s, verify ≤ 63 s of backoff; jitter shortens each delay by up
 * to half): a short outage should delay rollouts, not mask them.
 */
export const STAGE_CATALOG: Record<StageName, StageCatalogEntry> = {
  seed: {
    stage: "seed",
    schema: StageJob,
    options: { attempts: 8, backoff: { type: "exponential", delay: 1000, jitter: 0.5 }, ...trim },
  },
  run: {
    stage: "run",
    schema: StageJob,
    options: { attempts: 6, backoff: { type: "exponential", delay: 2000, jitter: 0.5 }, ...trim },
  },
  verify: {
    stage: "verify",
    schema: StageJob,
    options: { attempts: 7, backoff: { type: "exponential", delay: 1000, jitter: 0.5 }, ...trim },
  },
  close: {
    // Close must eventually run whatever happened: it retries for about half an hour (the last
    // delay ≤ 17 min, ≤ 34 min in all), not for days; a close that exhausts its attempts is
    // enqueued again by the janitor's watchdog once the rollout is past its deadline.
    stage: "close",
    schema: StageJob,
    options: { attempts: 12, backoff: { type: "exponential", delay: 1000, jitter: 0.5 }, ...trim },
  },
};

export const STAGES: readonly StageName[] = ["seed", "run", "verify", "close"];

/** Deterministic stage job id: a re-enqueued stage is deduplicated by BullMQ. */
export function stageJobId(rolloutId: string, stage: StageName): string {
  return `${rolloutId}.${stage}`;
}

/** Upper bound of the delay before retry number `attemptsMade + 1` (jitter only shortens it). */
export function maxBackoffMs(stage: StageName, attemptsMade: number): number {
  const backoff = STAGE_CATALOG[stage].options.backoff;
  const base = typeof backoff === "object" && backoff ? (backoff.delay ?? 1000) : 1000;
  return base * 2 ** Math.max(0, attemptsMade - 1);
}

export const JANITOR_QUEUE = "janitor";
