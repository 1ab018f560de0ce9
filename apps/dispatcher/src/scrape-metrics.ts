import { withTimeout as boundedBy } from "@fleet/contracts";
import type { RolloutStore, TeardownLedger } from "@fleet/queue";
import { ageSeconds, type FleetMetrics } from "@fleet/telemetry";
import type { Queue } from "bullmq";
import type { Redis } from "ioredis";

/** BullMQ job states exported as `fleet_queue_jobs{state}`. */
export const QUEUE_STATES = [
  "waiting",
  "active",
  "delayed",
  "prioritized",
  "waiting-children",
  "failed",
  "completed",
] as const;

export interface ScrapeSources {
  redis: Pick<Redis, "ping">;
  /** The stage queues and the janitor's, by the name used as the `queue` label. */
  queues: readonly Queue[];
  store: Pick<RolloutStore, "inflightCount">;
  ledger?: Pick<TeardownLedger, "size" | "oldestSince">;
  metrics: FleetMetrics;
  now: number;
  /** Bound on the whole refresh (Redis may hang rather than fail). */
  timeoutMs: number;
}

/** Reject with a readable error when `promise` has not settled within `ms`. */
export function withTimeout<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  return boundedBy(promise, ms, `${what}: no answer within ${ms} ms`);
}

/**
 * Set the gauges the dispatcher computes at scrape time: `fleet_redis_up` (a PING),
 * `fleet_queue_jobs{queue,state}`, `fleet_queue_oldest_waiting_age_seconds{queue}`,
 * `fleet_queue_workers{queue}`, `fleet_rollouts_inflight` and, given a ledger,
 * `fleet_teardown_ledger_entries` and `fleet_teardown_ledger_oldest_age_seconds`. When Redis
 * does not answer, `fleet_redis_up` is 0, the other gauges are left out of the scrape (a stale
 * depth would mislead an alert), and the error is rethrown for the caller to log.
 */
export async function refreshScrapeMetrics(src: ScrapeSources): Promise<void> {
  const { metrics } = src;
  // Every series disappears (a label-less gauge's `reset()` would leave a made-up 0 behind;
  // `remove({})` drops its one sample).
  const clear = () => {
    metrics.queueJobs.reset();
    metrics.queueOldestWaitingAge.reset();
    metrics.queueWorkers.reset();
    metrics.rolloutsInflight.remove({});
    if (src.ledger) {
      metrics.teardownLedgerEntries.remove({});
      metrics.teardownLedgerOldestAge.remove({});
    }
  };
  const started = Date.now();
  try {
    await withTimeout(src.redis.ping(), src.timeoutMs, "redis ping");
    metrics.redisUp.set(1);
  } catch (err) {
    metrics.redisUp.set(0);
    clear();
    throw err;
  }
  try {
    const [perQueue, inflight, ledgerSize, ledgerSince] = await withTimeout(
      Promise.all([
        Promise.all(src.queues.map((q) => sampleQueue(q, src.now))),
        src.store.inflightCount(),
        src.ledger ? src.ledger.size() : Promise.resolve(null),
        src.ledger ? src.ledger.oldestSince() : Promise.resolve(null),
      ]),
      Math.max(1, src.timeoutMs - (Date.now() - started)),
      "queue metrics",
    );
    clear();
    for (const { name, counts, oldestAgeS, workers } of perQueue) {
      for (const state of QUEUE_STATES) metrics.queueJobs.set({ queue: name, state }, counts[state] ?? 0);
      metrics.queueOldestWaitingAge.set({ queue: name }, oldestAgeS);
      if (workers !== null) metrics.queueWorkers.set({ queue: name }, workers);
    }
    metrics.rolloutsInflight.set(inflight);
    if (ledgerSize !== null) {
      metrics.teardownLedgerEntries.set(ledgerSize);
      metrics.teardownLedgerOldestAge.set(ageSeconds(ledgerSince, src.now));
    }
  } catch (err) {
    clear();
    throw err;
  }
}

/** The one entry BullMQ's `getWorkers` returns when Redis has no CLIENT command (renamed away). */
const NO_CLIENT_LIST = "GCP does not support client list";

async function sampleQueue(queue: Queue, now: number) {
  const [counts, [oldest], workers] = await Promise.all([
    queue.getJobCounts(...QUEUE_STATES),
    // Oldest first: the head of the wait list.
    queue.getJobs(["waiting"], 0, 0, true),
    // CLIENT LIST, which some managed Redis services refuse: then this one gauge is left out.
    // BullMQ answers a Redis without the CLIENT command with one made-up entry, not an error.
    queue.getWorkers().then(
      (workers) => (workers.some((w) => w.name === NO_CLIENT_LIST) ? null : workers.length),
      () => null,
    ),
  ]);
  // Waiting since it was added, or since a worker last took it: a job held, retried or handed
  // back (a provider outage, a seed waiting for room) was not waiting all its life.
  const since = oldest?.timestamp ? Math.max(oldest.timestamp, oldest.processedOn ?? 0) : null;
  const oldestAgeS = ageSeconds(since, now);
  return { name: queue.name, counts, oldestAgeS, workers };
}
