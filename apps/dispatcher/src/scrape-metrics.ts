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
  /** The queues' Redis: pinged, and read for the delayed jobs' due times and the queues' events. */
  redis: Pick<Redis, "ping" | "zrangebyscore" | "xrevrange">;
  /** The stage queues and the janitor's, by the name used as the `queue` label. */
  queues: readonly Queue[];
  /** Also read for the workers' presence (`workersPresent`) where Redis refuses `CLIENT LIST`. */
  store: Pick<RolloutStore, "inflightCount" | "probeWrite" | "workersPresent">;
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
 * `fleet_redis_writable` (a probe key written with a minute's TTL),
 * `fleet_queue_jobs{queue,state}`, `fleet_queue_oldest_waiting_age_seconds{queue}`,
 * `fleet_queue_workers{queue}` (from `CLIENT LIST`, or where Redis refuses it from the worker
 * processes' presence), `fleet_rollouts_inflight` and, given a ledger,
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
    metrics.redisWritable.remove({});
    clear();
    throw err;
  }
  // A full Redis (noeviction) or a read-only replica answers PING and reads, and refuses every
  // write: no rollout advances. Said by a write of its own, whether or not a stage job is there
  // to be refused (the workers' holds stop counting a job after 30).
  await withTimeout(
    src.store.probeWrite(),
    Math.max(1, src.timeoutMs - (Date.now() - started)),
    "redis write probe",
  ).then(
    () => metrics.redisWritable.set(1),
    () => metrics.redisWritable.set(0),
  );
  try {
    const [perQueue, inflight, ledgerSize, ledgerSince] = await withTimeout(
      Promise.all([
        Promise.all(src.queues.map((q) => sampleQueue(q, src.redis, src.store, src.now))),
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
      metrics.queueWorkers.set({ queue: name }, workers);
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

/**
 * How many jobs at the head of the wait list are looked at: a job handed back (a shutdown, a seed
 * waiting for room) or found stalled goes back in front of the jobs already waiting, so the head
 * alone may be the youngest of them.
 */
export const WAIT_HEAD_SAMPLE = 100;
/** How many of the queue's newest events are read to find when a job last came back to the wait list. */
export const WAITING_EVENTS_SCAN = 2_000;

/** The millisecond time of a stream entry id (`<ms>-<seq>`). */
const entryTime = (id: string) => Number(id.slice(0, id.indexOf("-")));

async function sampleQueue(
  queue: Queue,
  client: ScrapeSources["redis"],
  store: ScrapeSources["store"],
  now: number,
) {
  const [counts, head, prioritizedHead, [, dueScore], workers] = await Promise.all([
    queue.getJobCounts(...QUEUE_STATES),
    // Next to be taken first: the right end of the wait list.
    queue.getJobs(["waiting"], 0, WAIT_HEAD_SAMPLE - 1, true),
    // Jobs given a priority (Bull Board's edit, an add with one) wait apart, highest first: they
    // wait for a worker all the same.
    queue.getJobs(["prioritized"], 0, WAIT_HEAD_SAMPLE - 1, true),
    // A delayed job (a retry's backoff, a hold) whose time has come but that no worker has moved
    // to the wait list yet (BullMQ's workers move them when they look for a job): ready since
    // its due time, which its score holds (the time in ms, times 0x1000, plus a counter).
    client.zrangebyscore(queue.toKey("delayed"), 0, now * 0x1000 + 0xfff, "WITHSCORES", "LIMIT", 0, 1),
    // CLIENT LIST, exact: the BullMQ workers connected now. Some managed Redis services refuse
    // it (an ACL without it: an error; the command renamed away: BullMQ then answers with one
    // made-up entry, not an error): then the worker processes that said they consume the queue
    // and have not expired (`keepWorkerPresence` in the workers, the fleet's clock), so that
    // FleetQueueNoConsumer still sees a queue nobody consumes.
    queue.getWorkers().then(
      (workers) =>
        workers.some((w) => w.name === NO_CLIENT_LIST)
          ? store.workersPresent(queue.name, now)
          : workers.length,
      () => store.workersPresent(queue.name, now),
    ),
  ]);
  const readySince: number[] = [];
  if (dueScore !== undefined) readySince.push(Math.floor(Number(dueScore) / 0x1000));
  // Waiting since it came to the wait list: a job never taken and never delayed, since it was
  // added; any other (taken and retried after its backoff, handed back, held, stalled, added with
  // a delay), since its last `waiting` event: neither its attempts' run time nor its backoff is
  // time spent waiting for a worker.
  const jobs = [...head, ...prioritizedHead].filter((job) => job?.timestamp > 0);
  const returned = jobs.filter((job) => job.processedOn || job.opts.delay);
  const lastWaiting = new Map<string, number>();
  let scannedSince: number | null = null;
  if (returned.length > 0) {
    // Newest first: the first `waiting` event of a job is its last.
    const entries = await client.xrevrange(queue.toKey("events"), "+", "-", "COUNT", WAITING_EVENTS_SCAN);
    for (const [id, fields] of entries) {
      const event = new Map<string, string>();
      for (let i = 0; i + 1 < fields.length; i += 2) event.set(fields[i]!, fields[i + 1]!);
      const jobId = event.get("event") === "waiting" ? event.get("jobId") : undefined;
      if (jobId !== undefined && !lastWaiting.has(jobId)) lastWaiting.set(jobId, entryTime(id));
    }
    const oldest = entries.at(-1);
    if (oldest !== undefined) scannedSince = entryTime(oldest[0]);
  }
  for (const job of jobs) {
    if (!(job.processedOn || job.opts.delay)) {
      readySince.push(job.timestamp);
      continue;
    }
    // Its `waiting` event is older than the events read (or trimmed away): waiting since before
    // the oldest of them, and at least since a worker last took it.
    const since =
      lastWaiting.get(job.id ?? "") ??
      scannedSince ??
      job.processedOn ??
      job.timestamp + (job.opts.delay ?? 0);
    readySince.push(Math.max(since, job.processedOn ?? 0));
  }
  const oldestAgeS = readySince.length === 0 ? 0 : ageSeconds(Math.min(...readySince), now);
  return { name: queue.name, counts, oldestAgeS, workers };
}
