import { Counter, collectDefaultMetrics, Gauge, Histogram, Registry } from "prom-client";

export interface MetricsRegistryOptions {
  /** Value of the `app` label on every series (e.g. `dispatcher`, `agent-worker`). */
  app: string;
  /** Collect Node.js process metrics (CPU, memory, event loop, GC). @defaultValue `true` */
  defaultMetrics?: boolean;
}

/**
 * A fresh prom-client `Registry` for one process, never the global one: every series carries
 * `app`, and two registries never share a metric (tests may create many).
 */
export function createMetricsRegistry(options: MetricsRegistryOptions): Registry {
  const registry = new Registry();
  registry.setDefaultLabels({ app: options.app });
  if (options.defaultMetrics ?? true) {
    collectDefaultMetrics({ register: registry });
    // Gauges named like counters (`promtool check metrics` flags them), and redundant: each is the
    // sum of its by-type twin (`nodejs_active_handles{type}`, ...), which stays.
    for (const name of LINT_FAILING_DEFAULT_METRICS) registry.removeSingleMetric(name);
  }
  return registry;
}

/** prom-client default metrics left out of every registry (see `createMetricsRegistry`). */
export const LINT_FAILING_DEFAULT_METRICS = [
  "nodejs_active_handles_total",
  "nodejs_active_requests_total",
  "nodejs_active_resources_total",
] as const;

/** Stage names used as the `stage` label. */
export const STAGE_LABELS = ["seed", "run", "verify", "close"] as const;
/**
 * `outcome` of one stage job: `ok` finished and stored its receipt; `replayed` found a stored
 * receipt and did nothing again; `retry` threw a retryable error (BullMQ retries it); `failed`
 * ended the rollout's pipeline (final error, mask, cancel or deadline: the rollout goes to close);
 * `superseded` a seed, run or verify delivery whose stage a later delivery took over (its lock
 * lapsed): it stored no receipt, failure or verdict of its own; `requeued`
 * a job handed back without work (a seed past its wait for the seed-ahead bound, a verify handed
 * back until an earlier attempt's tests are over), no attempt spent; `stray` a job whose id is not
 * the fleet's own `<rolloutId>.<stage>` (added by hand: Bull Board's "duplicate", a script), dropped.
 */
export const STAGE_OUTCOMES = [
  "ok",
  "replayed",
  "skipped",
  "unknown",
  "superseded",
  "retry",
  "failed",
  "held",
  "redis_held",
  "requeued",
  "stray",
] as const;
export type StageOutcome = (typeof STAGE_OUTCOMES)[number];
/** `result` of one teardown attempt (close stage or janitor retry). */
export const TEARDOWN_RESULTS = ["confirmed", "already_gone", "failed"] as const;
/** The janitor's steps in pass order (`fleet_janitor_step_failures_total{step}`); a per-rollout step counts under its kind. */
export const JANITOR_STEPS = [
  "watchdog",
  "admissions",
  "cancels",
  "lost",
  "trim",
  "registry",
  "ledger",
  "orphans",
  "volumes",
  "networks",
  "helpers",
  "metrics",
] as const;
export type JanitorStep = (typeof JANITOR_STEPS)[number];
export type TeardownResult = (typeof TEARDOWN_RESULTS)[number];
/** `owner` of a sandbox (the `fleet.owner` label): the resources worker's task sandbox or an agent-owned one. */
export const SANDBOX_OWNERS = ["resources", "agent"] as const;
export type SandboxOwner = (typeof SANDBOX_OWNERS)[number];
/** Seconds from `since` (epoch ms) to `now`, for an age gauge; 0 when there is nothing (`null`) or clocks disagree. */
export function ageSeconds(since: number | null, now: number = Date.now()): number {
  return since === null ? 0 : Math.max(0, (now - since) / 1000);
}
/** `kind` of model tokens. */
export const TOKEN_KINDS = ["prompt", "completion", "cached"] as const;
export type TokenKind = (typeof TOKEN_KINDS)[number];

/**
 * Buckets, in seconds, for one stage job (sub-second seeds to agent runs as long as a rollout's
 * deadline, which may be a week: past the last bucket, every one is in +Inf alike).
 */
export const STAGE_DURATION_BUCKETS = [
  0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400, 259200,
  604800,
];
/** Buckets, in seconds, for a whole rollout from acceptance to terminal (a deadline may be a week). */
export const ROLLOUT_DURATION_BUCKETS = [
  1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200, 86400, 259200, 604800,
];
/** Buckets, in seconds, for creating one sandbox. */
export const SANDBOX_CREATE_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60];
/** Buckets for rewards in [0, 1]. */
export const REWARD_BUCKETS = [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1];

/** The fleet's own metrics (see the package README for each one's meaning). */
export interface FleetMetrics {
  rolloutsFinished: Counter<"status" | "failure_kind">;
  stageDuration: Histogram<"stage" | "outcome">;
  rolloutDuration: Histogram<"status">;
  queueJobs: Gauge<"queue" | "state">;
  queueOldestWaitingAge: Gauge<"queue">;
  sandboxesActive: Gauge<"provider" | "owner">;
  sandboxCreateDuration: Histogram<"provider">;
  teardownLedgerEntries: Gauge;
  teardownLedgerOldestAge: Gauge;
  teardownAttempts: Counter<"result">;
  reward: Histogram;
  modelTokens: Counter<"kind">;
  workerHeartbeat: Gauge<"worker">;
  stageJobs: Counter<"stage" | "outcome">;
  rolloutsInflight: Gauge;
  redisUp: Gauge;
  redisWritable: Gauge;
  redisDurable: Gauge;
  redisTlsCertExpiry: Gauge;
  sandboxProviderUp: Gauge;
  seedingHeld: Gauge;
  queueWorkers: Gauge<"queue">;
  queueStalledJobs: Counter<"queue">;
  janitorStepFailures: Counter<"step">;
  janitorLastPass: Gauge;
  closesGivenUp: Counter;
}

/**
 * Register the fleet's metrics in `registry` (and nowhere else). Call once per registry; a
 * second call on the same registry throws (prom-client refuses duplicate names). Counters whose
 * label values are known up front are initialised to 0, so `rate()` sees their first increment.
 */
export function createFleetMetrics(registry: Registry): FleetMetrics {
  const registers = [registry];
  const metrics: FleetMetrics = {
    rolloutsFinished: new Counter({
      name: "fleet_rollouts_finished_total",
      help: "Rollouts that reached a terminal status, by status and failure kind (none when clean).",
      labelNames: ["status", "failure_kind"],
      registers,
    }),
    stageDuration: new Histogram({
      name: "fleet_stage_duration_seconds",
      help: "Wall time of one stage job, by stage and outcome.",
      labelNames: ["stage", "outcome"],
      buckets: STAGE_DURATION_BUCKETS,
      registers,
    }),
    rolloutDuration: new Histogram({
      name: "fleet_rollout_duration_seconds",
      help: "Time from acceptance to terminal status, by status.",
      labelNames: ["status"],
      buckets: ROLLOUT_DURATION_BUCKETS,
      registers,
    }),
    queueJobs: new Gauge({
      name: "fleet_queue_jobs",
      help: "Jobs in each BullMQ queue, by state (waiting, active, delayed, failed, ...).",
      labelNames: ["queue", "state"],
      registers,
    }),
    queueOldestWaitingAge: new Gauge({
      name: "fleet_queue_oldest_waiting_age_seconds",
      help: "How long the job in each queue that has waited longest for a worker has waited: since it became ready to run (added, back on the wait list after a retry's backoff, a hold or a hand-back, or a delay past its due time), not counting its earlier attempts nor its backoff (0 when none waits).",
      labelNames: ["queue"],
      registers,
    }),
    sandboxesActive: new Gauge({
      name: "fleet_sandboxes_active",
      help: "Fleet-labelled sandboxes the provider reports (sampled by the janitor each pass), by provider and owner.",
      labelNames: ["provider", "owner"],
      registers,
    }),
    sandboxCreateDuration: new Histogram({
      name: "fleet_sandbox_create_duration_seconds",
      help: "Time to create one sandbox (before probe and staging), by provider.",
      labelNames: ["provider"],
      buckets: SANDBOX_CREATE_BUCKETS,
      registers,
    }),
    teardownLedgerEntries: new Gauge({
      name: "fleet_teardown_ledger_entries",
      help: "Sandboxes in the teardown ledger awaiting a confirmed destroy.",
      registers,
    }),
    teardownLedgerOldestAge: new Gauge({
      name: "fleet_teardown_ledger_oldest_age_seconds",
      help: "How long the teardown ledger's oldest sandbox has awaited a confirmed destroy (0 when the ledger is empty).",
      registers,
    }),
    teardownAttempts: new Counter({
      name: "fleet_teardown_attempts_total",
      help: "Sandbox destroy attempts (close stage and janitor), by result.",
      labelNames: ["result"],
      registers,
    }),
    reward: new Histogram({
      name: "fleet_reward",
      help: "Rewards of graded (unmasked) rollouts.",
      buckets: REWARD_BUCKETS,
      registers,
    }),
    modelTokens: new Counter({
      name: "fleet_model_tokens_total",
      help: "Model tokens reported by harnesses, by kind (prompt, completion, cached).",
      labelNames: ["kind"],
      registers,
    }),
    workerHeartbeat: new Gauge({
      name: "fleet_worker_heartbeat_timestamp_seconds",
      help: "Unix time of each worker's last heartbeat.",
      labelNames: ["worker"],
      registers,
    }),
    stageJobs: new Counter({
      name: "fleet_stage_jobs_total",
      help: "Stage jobs processed, by stage and outcome (ok, replayed, skipped, unknown, superseded, retry, failed, held: put back while the sandbox provider did not answer, redis_held: put back while the fleet's Redis refused writes or could not be reached, requeued, stray: a job whose id is not the fleet's own, dropped untouched).",
      labelNames: ["stage", "outcome"],
      registers,
    }),
    rolloutsInflight: new Gauge({
      name: "fleet_rollouts_inflight",
      help: "Rollouts admitted and not yet terminal (sampled by the dispatcher at scrape time).",
      registers,
    }),
    redisUp: new Gauge({
      name: "fleet_redis_up",
      help: "1 when Redis answered a PING at scrape time, 0 when it did not.",
      registers,
    }),
    redisWritable: new Gauge({
      name: "fleet_redis_writable",
      help: "1 when Redis took a write (a probe key with a minute's TTL) at scrape time, 0 when it refused it (full under noeviction, a read-only replica); absent when it did not answer PING.",
      registers,
    }),
    redisDurable: new Gauge({
      name: "fleet_redis_durable",
      help: "1 when the Redis this process is connected to passed the start's durability check (AOF on, fsynced as required, maxmemory-policy noeviction) at its last connection; 0 when a reconnect (a failover's promoted replica) found it not safe for the fleet's state. Set by every app.",
      registers,
    }),
    redisTlsCertExpiry: new Gauge({
      name: "fleet_redis_tls_cert_expiry_timestamp_seconds",
      help: "When the client certificate this process presents to Redis (FLEET_REDIS_TLS_CERT_FILE) expires, in Unix seconds: set at the start and whenever a rotated one is taken (the files are read again every FLEET_REDIS_TLS_RELOAD_MS). Absent without a client certificate. Set by every app.",
      registers,
    }),
    sandboxProviderUp: new Gauge({
      name: "fleet_sandbox_provider_up",
      help: "0 while this worker's provider breaker is open (a seed, run or verify failed and the provider did not answer: those jobs are held, none taken), or while it waits at start for its provider; 1 otherwise. Set by stage workers, and by the janitor (0 while its provider does not answer: its sandbox steps wait). An idle worker does not probe: 1 says no failure found it down.",
      registers,
    }),
    seedingHeld: new Gauge({
      name: "fleet_seeding_held",
      help: "1 while this worker's seeding is paused by the seed-ahead bound (enough rollouts are seeded and wait for an agent or a verifier: no more sandboxes are made ahead), 0 otherwise; set by workers that run seed.",
      registers,
    }),
    queueWorkers: new Gauge({
      name: "fleet_queue_workers",
      help: "BullMQ workers connected to each queue (sampled by the dispatcher at scrape time).",
      labelNames: ["queue"],
      registers,
    }),
    janitorStepFailures: new Counter({
      name: "fleet_janitor_step_failures_total",
      help: "Janitor steps that failed, by step (each pass runs every step; one failing leaves the others running, and its gauges, e.g. fleet_sandboxes_active for orphans, keep their last value).",
      labelNames: ["step"],
      registers,
    }),
    janitorLastPass: new Gauge({
      name: "fleet_janitor_last_pass_timestamp_seconds",
      help: "Unix time this janitor last finished a pass; until its first, the newest pass any janitor finished (kept in Redis), or the first janitor's start before any (never this one's own start: a janitor restarted after each pass it dies in would look like one that passes). Replicas share one schedule: the newest over them says whether passes run at all (a paused janitor queue, a removed schedule, a pass that never ends), which the heartbeat does not.",
      registers,
    }),
    closesGivenUp: new Counter({
      name: "fleet_closes_given_up_total",
      help: "Rollouts closed without destroys, their sandboxes handed to the teardown ledger, once close had been enqueued again for each CLOSE_AGAIN_LIMIT times (by the deadline watchdog, or by the stage workers after BullMQ failed it as stalled) and none finalized (a close failing every attempt, or killing every worker that took it); counted by the process that closed it (a stage worker, or the janitor past the deadline).",
      registers,
    }),
    queueStalledJobs: new Counter({
      name: "fleet_queue_stalled_jobs_total",
      help: "Jobs this worker found stalled (lock lost: a worker died or blocked) and moved back to wait, by queue.",
      labelNames: ["queue"],
      registers,
    }),
  };
  for (const stage of STAGE_LABELS) {
    for (const outcome of STAGE_OUTCOMES) metrics.stageJobs.inc({ stage, outcome }, 0);
  }
  for (const result of TEARDOWN_RESULTS) metrics.teardownAttempts.inc({ result }, 0);
  for (const kind of TOKEN_KINDS) metrics.modelTokens.inc({ kind }, 0);
  for (const step of JANITOR_STEPS) metrics.janitorStepFailures.inc({ step }, 0);
  metrics.closesGivenUp.inc(0);
  // Gauges without labels start at 0, a made-up sample: sampled ones (Redis up, in flight,
  // ledger entries) appear only once the process that samples them (the dispatcher, the janitor)
  // set them, so a worker's scrape never reports "Redis down" or "nothing in flight".
  for (const gauge of [
    metrics.redisUp,
    metrics.redisWritable,
    metrics.redisDurable,
    metrics.redisTlsCertExpiry,
    metrics.rolloutsInflight,
    metrics.teardownLedgerEntries,
    metrics.teardownLedgerOldestAge,
    metrics.sandboxProviderUp,
    metrics.seedingHeld,
    metrics.janitorLastPass,
  ]) {
    gauge.remove({});
  }
  return metrics;
}
