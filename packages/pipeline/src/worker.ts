import { randomUUID } from "node:crypto";
import { setMaxListeners } from "node:events";
import { capText, isTerminal, type StageName, withTimeout } from "@fleet/contracts";
import { duplicateRedis, isRedisUnavailable, type RedisConnection } from "@fleet/queue";
import type { StageOutcome } from "@fleet/telemetry";
import { DelayedError, type Job, WaitingError, Worker } from "bullmq";
import { clock, localTime, type PipelineDeps } from "./deps.ts";
import { HandBackError, isDeferral, isHandBack, isProviderHold, isRedisHold } from "./hand-back.ts";
import { keepWorkerPresence, PRESENCE_INTERVAL_MS } from "./presence.ts";
import { providerGate, providerProblem } from "./provider-gate.ts";
import {
  isRedisRefusal,
  nextAfter,
  recordFinalFailure,
  runStageJob,
  UnrecordedFailureError,
} from "./stage-runner.ts";
import { CLOSE_AGAIN_LIMIT, closeWithoutDestroys } from "./stages.ts";

export interface StageWorkerOptions {
  connection: RedisConnection;
  prefix: string;
  concurrency: number;
  /** Job lock; a worker that dies loses its jobs to another after this (BullMQ stalled check). */
  lockDurationMs?: number;
  stalledIntervalMs?: number;
  maxStalledCount?: number;
  /**
   * Self-healing: every `intervalMs`, a BullMQ worker that stopped running, or that sits idle
   * while jobs of its stage have waited longer than `stuckAfterMs` (e.g. its connections never
   * became ready again after a Redis restart), is replaced by a new one on a new connection.
   * `false` turns it off. @defaultValue `{ intervalMs: 5_000, stuckAfterMs: 30_000 }`
   */
  supervise?: { intervalMs: number; stuckAfterMs: number } | false;
  /**
   * The provider breaker: a seed, run or verify that failed because the sandbox provider does
   * not answer at all (its listing fails or takes longer than `callTimeoutMs`) is put back in its
   * queue, delayed by `probeMs`, without spending an attempt, and this process stops taking seed,
   * run and verify jobs; every `probeMs` it asks the provider again and takes jobs again once it
   * answers. Close jobs keep running (a destroy that fails goes to the teardown ledger). Bounded
   * by each rollout's deadline: a stage that fails within `probeMs` of it is not held (the
   * failure stands), and a rollout held past it is closed as `deadline_exceeded` (masked) by its
   * next stage job or by the janitor's watchdog. `false` turns it off: every failure then
   * spends an attempt. @defaultValue `{ probeMs: 2_000, callTimeoutMs: 5_000 }`
   */
  providerBreaker?: { probeMs: number; callTimeoutMs: number } | false;
  /**
   * The seed-ahead bound (workers that run seed): a seed job waits before it begins while at
   * least `max(min, runs in progress, rollouts taken per interval)` rollouts are seeded and
   * wait for an agent or a verifier (their run or verify jobs waiting, prioritized or delayed),
   * counting this process's seeds in flight. Without it, resources workers make sandboxes as fast
   * as they go: a batch of thousands holds thousands of idle sandboxes that spend their deadlines
   * waiting for an agent (or, behind slower verifiers, for a verifier). The waiting rollouts are
   * counted (one round trip) every `intervalMs`, and while a seed waits every `recountMs` at
   * first, twice as late after each count that finds no room (up to `intervalMs`); between counts this process adds its own seeds, so one process alone keeps to the
   * bound; several count each other's seeds in flight as each last said (`shareSeeding`), and
   * pass it only by what they let in within one round trip of each other. `false` turns
   * it off. @defaultValue `{ min: 16, intervalMs: 500, recountMs: 5 }`
   */
  seedAhead?: SeedAheadOptions | false;
  /** Called for every BullMQ worker made, the supervisor's replacements included (listeners, metrics). */
  onWorker?: (worker: Worker, stage: StageName) => void;
  /**
   * Every `intervalMs`, this process says in Redis that it consumes its stages' queues
   * (`keepWorkerPresence`), until it closes: what `fleet_queue_workers` counts where Redis refuses
   * `CLIENT LIST`. `false` turns it off. @defaultValue `{ intervalMs: PRESENCE_INTERVAL_MS }` (10 s)
   */
  presence?: { intervalMs: number } | false;
}

export interface StageWorkers {
  /** The current BullMQ workers, one per stage (a replaced one is swapped in place). */
  readonly workers: Worker[];
  /** How many times the supervisor replaced a worker. */
  readonly recreated: number;
  /** Whether the provider breaker is open (seed, run and verify jobs are not taken). */
  readonly providerDown: boolean;
  /** The seed-ahead bound's state (null without a seed stage or with the bound off). */
  readonly seedAhead: SeedAheadState | null;
  /** Run the supervisor's check now (it also runs on its own timer). */
  check(): Promise<void>;
  /**
   * Bounded graceful stop, all within `timeoutMs` (default 30 s): stop taking jobs; let active
   * jobs finish for the first part of the budget; then hand the still-running ones back (a run
   * stage stops its harness, kills its processes (a stop it cannot confirm is logged; the next
   * delivery confirms it before it launches) and puts its job back in the queue without using
   * up an attempt); past the budget, the connections are closed whatever
   * still runs: `closed` says whether the workers closed within it (not: jobs not handed back,
   * or whose end Redis did not record, are delivered again once their locks lapse, a stall
   * counted), `abandoned` counts the jobs still running then; an app's exit status reports it.
   */
  close(timeoutMs?: number): Promise<{ closed: boolean; abandoned: number }>;
}

const DEFAULT_SUPERVISE = { intervalMs: 5_000, stuckAfterMs: 30_000 };
const DEFAULT_PROVIDER_BREAKER = { probeMs: 2_000, callTimeoutMs: 5_000 };
export const DEFAULT_SEED_AHEAD: SeedAheadOptions = { min: 16, intervalMs: 500, recountMs: 5 };

/** When, within a shutdown budget, still-running jobs are asked to hand themselves back. */
export function handBackAfterMs(timeoutMs: number): number {
  return Math.max(Math.floor(timeoutMs / 2), timeoutMs - 10_000);
}

interface Slot {
  stage: StageName;
  worker: Worker;
  active: number;
  /** Since when jobs wait while this worker is idle (null: not the case at the last check). */
  idleWithWorkSince: number | null;
  /** When Redis last refused this worker (0: never); its pause's length, doubling; its resume. */
  refusedAt: number;
  refusalPauseMs: number;
  refusalResume: NodeJS.Timeout | null;
}

/** One BullMQ worker per stage, each running `runStageJob` with the shared deps. */
export function createStageWorkers(
  stages: readonly StageName[],
  deps: PipelineDeps,
  options: StageWorkerOptions,
): StageWorkers {
  const handBack = new AbortController();
  // Every job in flight in this process listens for the shutdown (a run, a verifier's provider
  // calls) and stops listening when it ends: as many listeners as jobs, which Node would take
  // for a leak past ten and warn about (FLEET_CONCURRENCY can be higher).
  setMaxListeners(0, handBack.signal);
  let closing = false;
  let recreated = 0;
  const breakerOptions =
    options.providerBreaker === undefined ? DEFAULT_PROVIDER_BREAKER : options.providerBreaker;
  const breaker = breakerOptions
    ? providerBreaker(
        deps,
        breakerOptions,
        () => slots,
        () => closing,
      )
    : null;
  const seedAheadOptions = options.seedAhead === undefined ? DEFAULT_SEED_AHEAD : options.seedAhead;
  const seeds = stages.includes("seed");
  // 0 until the bound holds seeding (never, without it): a sample for those who watch the gauge.
  if (seeds) deps.metrics?.seedingHeld.set(0);
  const seedAhead = seeds && seedAheadOptions ? seedAheadBound(deps, seedAheadOptions) : null;

  // The same for every job: made once, not per job.
  const runOptions: Parameters<typeof runStageJob>[3] = {
    signal: handBack.signal,
    lockDurationMs: options.lockDurationMs ?? 30_000,
    ...(breaker ? { providerDown: breaker.isDown, holdMs: breaker.probeMs } : {}),
  };

  /** One "holding stage jobs" line per half-minute, however many jobs Redis refuses. */
  const freshHold = freshErrors();

  const make = (slot: Pick<Slot, "stage" | "active"> & Partial<Slot>): Worker => {
    const { stage } = slot;
    // The lock tokens of the deliveries this worker is running (see `keepRenewingLaterDeliveries`).
    const running = new Set<string>();
    const worker = new Worker(
      stage,
      async (job: Job, token?: string) => {
        // When the job's work began: after a seed's wait for the seed-ahead bound, which is no
        // work of its stage (a seed held 10 s at the bound would time as a slow sandbox create).
        let started = Date.now();
        if (token) running.add(token);
        slot.active++;
        slot.idleWithWorkSince = null;
        slot.refusalPauseMs = 0;
        // Through the seed-ahead bound; `seeded`: it ran and enqueued its run job. Not a replay:
        // of a finished rollout it enqueues nothing, and of a stored receipt (a re-delivery) the
        // run job it enqueues again is most likely waiting already, counted (counted twice until
        // the next count, a phantom taken for a rollout an agent took, and so for a faster rate).
        let entered = false;
        let seeded = false;
        try {
          if (stage === "seed" && seedAhead) {
            entered = await seedAhead.enter(handBack.signal, job.timestamp, job.data?.rolloutId);
            started = Date.now();
          }
          const outcome = await runStageJob(stage, job, deps, runOptions);
          const ms = Date.now() - started;
          countStageJob(deps, stage, outcome, ms);
          // One line per stage job: a rollout traced across the processes by its id.
          deps.logger.info(
            { rolloutId: job.data?.rolloutId, stage, outcome, attempt: job.attemptsMade + 1, ms },
            "stage job done",
          );
          seeded = outcome === "ok";
          return outcome;
        } catch (err) {
          if (isHandBack(err) && token) {
            // Shutting down (or a seed that waited long for the seed-ahead bound): back to the
            // queue for another worker, without spending an attempt. Counted on the job first
            // (`handBacksOf`), so that its deliveries are not taken for Redis holds; a count
            // that fails leaves the hand-back to go on (the move says whether Redis takes it).
            await job.updateProgress({ handBacks: handBacksOf(job) + 1 }).catch(() => undefined);
            const deferral = isDeferral(err);
            // `until` is on the fleet's clock; BullMQ counts the delay on this host's.
            const move = deferral
              ? job.moveToDelayed(localTime(deps, err.until), token)
              : job.moveToWait(token);
            await move.catch((moveErr: unknown) => {
              // Refused (the lock lapsed or another worker holds the job) or Redis unreachable:
              // the job stays active until a stalled check takes it back. Said here: BullMQ
              // drops the error it makes of this while its worker closes.
              deps.logger.warn(
                { stage, rolloutId: job.data?.rolloutId, err: String(moveErr) },
                "could not hand the job back to the queue; it stays active until a stalled check takes it back",
              );
              throw moveErr;
            });
            // A seed that waited its time for the seed-ahead bound: routine, not worth a line
            // each; counted (no duration: it did no work).
            const waited = err instanceof SeedWaitOver;
            if (waited || deferral) deps.metrics?.stageJobs.inc({ stage, outcome: "requeued" });
            if (deferral) {
              deps.logger.info(
                { stage, rolloutId: job.data?.rolloutId, until: err.until, why: err.message },
                "handed the job back until a later time (no attempt spent)",
              );
              throw new DelayedError();
            }
            deps.logger[waited ? "debug" : "info"](
              { stage, rolloutId: job.data?.rolloutId },
              "handed the job back",
            );
            throw new WaitingError();
          }
          if (
            token &&
            refusedByRedis(err) &&
            // Each hold is a delivery that spent no attempt and was not handed back: past
            // MAX_REDIS_HOLDS of them (a Redis at its memory's edge, taking the begin and refusing
            // the receipt, would run the agent again every hold until the deadline), attempts are
            // spent as before. (A seed waiting for the seed-ahead bound is handed back every 10 s:
            // those deliveries are not holds.)
            job.attemptsStarted - job.attemptsMade - handBacksOf(job) <= MAX_REDIS_HOLDS
          ) {
            // Redis refused the stage (full under noeviction, read-only after a failover): back
            // to the queue, delayed, without spending an attempt. Moving the job is a write too,
            // but one a full Redis takes (BullMQ's move frees the job's lock first, and a script
            // that has freed memory may go on writing). Not moved (Redis out of reach, or the
            // lock lapsed): BullMQ's own retry, as for any failure.
            const moved = await job.moveToDelayed(Date.now() + REDIS_HOLD_MS, token).then(
              () => true,
              () => false,
            );
            if (moved) {
              countStageJob(deps, stage, "redis_held", Date.now() - started);
              // Thousands of jobs may be held at once: a line now and then, not one each.
              if (freshHold("held")) {
                deps.logger.warn(
                  { stage, rolloutId: job.data?.rolloutId, err: (err as Error).message },
                  "the fleet's Redis refuses writes (full, read-only) or cannot be reached: holding stage jobs (no attempt spent) until it takes them",
                );
              }
              throw new DelayedError();
            }
          }
          if (breaker && isProviderHold(err) && token) {
            // The provider is down: back to the queue, delayed, without spending an attempt;
            // this process takes no seed, run or verify job until the provider answers.
            // Tripped first: the workers stop taking jobs even if the move fails (a lost lock:
            // another worker has the job by now).
            breaker.trip(err instanceof Error ? err.message : String(err));
            await job.moveToDelayed(Date.now() + breaker.probeMs, token);
            countStageJob(deps, stage, "held", Date.now() - started);
            throw new DelayedError();
          }
          const name = (err as Error).name;
          countStageJob(
            deps,
            stage,
            name === "UnrecoverableError" ? "failed" : "retry",
            Date.now() - started,
          );
          throw err;
        } finally {
          if (entered) seedAhead?.leave(seeded);
          if (token) running.delete(token);
          slot.active--;
        }
      },
      {
        connection: duplicateRedis(options.connection),
        prefix: options.prefix,
        concurrency: options.concurrency,
        lockDuration: options.lockDurationMs ?? 30_000,
        stalledInterval: options.stalledIntervalMs ?? 15_000,
        maxStalledCount: options.maxStalledCount ?? 3,
        autorun: true,
      },
    );
    keepRenewingLaterDeliveries(worker, running, deps.logger);
    const fresh = freshErrors();
    worker.on("error", (err) => {
      if (isRedisUnavailable(err)) pauseForRefusal(slot as Slot, worker);
      if (!fresh(err.message)) return;
      if (LOST_LOCK.test(err.message)) {
        // This process was paused or cut off past the lock's duration: not a failure of its own
        // to chase, and nothing is lost (the job is taken back and its stage replays its receipt).
        deps.logger.warn(
          { stage, err: err.message },
          "this worker's lock on a stage job lapsed (it was paused or cut off from Redis for longer than the lock lasts): another worker takes the job over, and this worker's outcome for it is dropped",
        );
        return;
      }
      deps.logger.error({ stage, err: err.message }, "worker error");
    });
    // A job BullMQ fails by itself, without running it (stalled more often than
    // `maxStalledCount`: its workers kept dying on it), never reaches `runStageJob`: record the
    // failure and close the rollout now, rather than leave it to the watchdog at its deadline.
    worker.on("failed", (job, err) => {
      if (!job) return;
      if (err instanceof UnrecordedFailureError) {
        // A final failure Redis refused to record: recorded now, as Redis takes it, and closed.
        void whileRedisRefuses(
          deps,
          stage,
          job,
          () => recordFinalFailure(deps, err.rolloutId, err.final),
          () => closing,
        ).catch((e: unknown) =>
          deps.logger.error(
            { stage, rolloutId: err.rolloutId, err: String(e) },
            "could not record a rollout's final failure; the watchdog will close it",
          ),
        );
        return;
      }
      // BullMQ's own failure, or a last attempt that failed before the stage runner could
      // decide anything (its begin, or a skip's enqueue, hit a Redis blip): the runner ends
      // every failure it handles on a last attempt with UnrecoverableError, having recorded it.
      const lastAttemptUnhandled =
        err.name !== "UnrecoverableError" && job.attemptsMade >= (job.opts.attempts ?? 1);
      if (!BULLMQ_OWN_FAILURES.has(err.message) && !lastAttemptUnhandled) return;
      const reason = bullmqFailureReason(stage, err);
      void whileRedisRefuses(
        deps,
        stage,
        job,
        () => closeAfterBullmqFailure(deps, stage, job, reason),
        () => closing,
      ).catch((e: unknown) =>
        deps.logger.error(
          { stage, rolloutId: job.data?.rolloutId, err: String(e) },
          "could not close a rollout whose job BullMQ failed; the watchdog will",
        ),
      );
    });
    options.onWorker?.(worker, stage);
    return worker;
  };

  /**
   * Redis refused a worker's own call (taking a job, renewing locks, the stalled check: full
   * under noeviction, read-only). BullMQ asks again at once for what is not a connection error:
   * thousands of refused calls a second against a Redis already in trouble. Paused instead, 250 ms
   * doubling to `REFUSAL_PAUSE_MAX_MS`, then resumed to ask again; a job taken resets the pause.
   * The jobs in flight go on (a refusal of theirs holds them: `RedisHoldError`).
   */
  const pauseForRefusal = (slot: Slot, worker: Worker) => {
    if (closing || slot.worker !== worker) return; // a replaced worker's errors are not the slot's
    slot.refusedAt = Date.now();
    // Resumed meanwhile by someone else (the provider breaker): paused again all the same.
    if (!worker.isPaused()) void worker.pause(true).catch(() => undefined);
    if (slot.refusalResume) return;
    slot.refusalPauseMs = Math.min(Math.max(slot.refusalPauseMs * 2, 250), REFUSAL_PAUSE_MAX_MS);
    slot.refusalResume = setTimeout(() => {
      slot.refusalResume = null;
      if (closing || slot.worker !== worker) return;
      // The provider breaker paused it too: the breaker resumes it.
      if (breaker?.open && breaker.holds(slot.stage)) return;
      void worker.resume();
    }, slot.refusalPauseMs);
    slot.refusalResume.unref();
  };

  const slots: Slot[] = stages.map((stage) => {
    const slot = {
      stage,
      active: 0,
      idleWithWorkSince: null,
      refusedAt: 0,
      refusalPauseMs: 0,
      refusalResume: null,
    } as unknown as Slot;
    slot.worker = make(slot);
    return slot;
  });

  const supervise = options.supervise === undefined ? DEFAULT_SUPERVISE : options.supervise;
  const presence =
    options.presence === false
      ? null
      : keepWorkerPresence(deps, stages, options.presence?.intervalMs ?? PRESENCE_INTERVAL_MS);

  const replace = (slot: Slot, why: string) => {
    const old = slot.worker;
    // A pause for a refusal is the old worker's: its resume must not be waited for by the new one.
    if (slot.refusalResume) clearTimeout(slot.refusalResume);
    slot.refusalResume = null;
    slot.refusalPauseMs = 0;
    slot.worker = make(slot);
    slot.idleWithWorkSince = null;
    recreated++;
    deps.logger.warn({ stage: slot.stage, why }, "replaced a stuck stage worker");
    // The old one may hang on its dead connections: close it in the background, bounded.
    void boundedClose(old, 5_000).catch(() => undefined);
  };

  const check = async () => {
    if (closing || !supervise) return;
    for (const slot of slots) {
      if (closing) return;
      // Paused by the provider breaker on purpose (a paused worker also stops "running").
      if (breaker?.holds(slot.stage) && breaker.open) {
        slot.idleWithWorkSince = null; // idle on purpose: no count toward a replacement after it
        continue;
      }
      // Paused, or idle, because Redis refuses it: a new worker would be refused the same way.
      if (slot.refusalResume || Date.now() - slot.refusedAt < supervise.stuckAfterMs) {
        slot.idleWithWorkSince = null;
        continue;
      }
      if (!slot.worker.isRunning() && !slot.worker.closing) {
        replace(slot, "the worker stopped running");
        continue;
      }
      if (slot.active > 0) {
        slot.idleWithWorkSince = null;
        continue;
      }
      let waiting = 0;
      try {
        const queue = deps.queues.queues[slot.stage];
        if (await queue.isPaused()) continue;
        waiting = await queue.getWaitingCount();
      } catch {
        continue; // Redis itself is unreachable: nothing a new worker would fix.
      }
      if (closing) return; // the workers are being closed: none is replaced any more
      if (waiting === 0 || slot.active > 0) {
        slot.idleWithWorkSince = null;
        continue;
      }
      const now = Date.now();
      slot.idleWithWorkSince ??= now;
      if (now - slot.idleWithWorkSince >= supervise.stuckAfterMs) {
        replace(slot, `idle for ${now - slot.idleWithWorkSince} ms while ${waiting} job(s) waited`);
      }
    }
  };

  let checking: Promise<void> = Promise.resolve();
  // One check at a time: during a Redis outage a check waits (the main connection queues its
  // commands until Redis is back), and ticks meanwhile are skipped rather than queued up.
  let inFlight = false;
  const timer = supervise
    ? setInterval(() => {
        if (inFlight) return;
        inFlight = true;
        checking = checking
          .then(check)
          .catch((err: unknown) => {
            deps.logger.warn({ err: String(err) }, "stage worker supervisor check failed");
          })
          .finally(() => {
            inFlight = false;
          });
      }, supervise.intervalMs)
    : null;
  timer?.unref();

  return {
    get workers() {
      return slots.map((s) => s.worker);
    },
    get recreated() {
      return recreated;
    },
    get providerDown() {
      return breaker?.open ?? false;
    },
    get seedAhead() {
      return seedAhead?.state() ?? null;
    },
    check: () => {
      checking = checking.then(check);
      return checking;
    },
    async close(timeoutMs = 30_000) {
      closing = true;
      let abandoned = 0;
      let closed = true;
      if (timer) clearInterval(timer);
      // Taking no more jobs: no longer counted as consuming its queues.
      const left = presence?.stop(Math.min(2_000, timeoutMs));
      breaker?.stop();
      // Seeds waiting for the bound go back to the queue now, not at the hand-back.
      seedAhead?.stop();
      const started = Date.now();
      // A supervisor check in flight is not waited for: it replaces no worker once `closing` is
      // set, and one hung on Redis would spend the budget the jobs need to hand themselves back.
      const workers = slots.map((s) => s.worker);
      const graceful = Promise.all(workers.map((w) => w.close())).then(() => "done" as const);
      graceful.catch(() => undefined);
      const within = (ms: number) =>
        Promise.race([
          graceful,
          delay(Math.max(0, ms - (Date.now() - started))).then(() => "timeout" as const),
        ]);
      if ((await within(handBackAfterMs(timeoutMs))) === "timeout") {
        const active = slots.reduce((n, s) => n + s.active, 0);
        deps.logger.warn(
          { active },
          active > 0
            ? "jobs still running at shutdown; handing them back"
            : "the workers have not closed (is Redis reachable?); still waiting",
        );
        handBack.abort();
        if ((await within(timeoutMs)) === "timeout") {
          // (No force-close to try: BullMQ answers a second close with the first, graceful one.)
          closed = false;
          abandoned = slots.reduce((n, s) => n + s.active, 0);
          deps.logger.warn(
            { abandoned },
            "shutdown budget spent; closing the connections with jobs not handed back (each is delivered again once its lock lapses)",
          );
        }
      }
      // Bounded too: a worker's disconnect from a Redis Cluster was seen to never settle (about 1
      // close in 5 in `cluster.int.test.ts`); the connections are dropped either way.
      await Promise.all(
        workers.map((w) =>
          Promise.race([
            w.disconnect().catch(() => undefined),
            delay(Math.max(1_000, timeoutMs - (Date.now() - started))),
          ]),
        ),
      );
      await left;
      return { closed, abandoned };
    },
  };
}

interface ProviderBreaker {
  readonly probeMs: number;
  readonly open: boolean;
  /** Whether the provider fails to answer a listing now (concurrent asks share one call). */
  isDown(): Promise<boolean>;
  /** Open the breaker (no-op when open): pause the held stages' workers, probe until the provider answers. */
  trip(reason: string): void;
  /** Whether the breaker pauses this stage's worker. */
  holds(stage: StageName): boolean;
  stop(): void;
}

/** The stages that cannot get anywhere without the provider, and whose attempts a hold saves. */
const HELD_STAGES: ReadonlySet<StageName> = new Set<StageName>(["seed", "run", "verify"]);

/**
 * The stage workers' breaker: a `providerGate` probed every `probeMs`, which pauses the held
 * stages' workers while the provider is down and resumes them once it answers.
 */
function providerBreaker(
  deps: PipelineDeps,
  options: { probeMs: number; callTimeoutMs: number },
  slots: () => readonly Slot[],
  closing: () => boolean,
): ProviderBreaker {
  let asking: Promise<boolean> | null = null;
  const isDown = (): Promise<boolean> => {
    asking ??= (async () => {
      try {
        return (await providerProblem(deps.provider, options.callTimeoutMs)) !== null;
      } finally {
        asking = null;
      }
    })();
    return asking;
  };
  const gate = providerGate(deps, {
    callTimeoutMs: options.callTimeoutMs,
    firstDelayMs: options.probeMs,
    maxDelayMs: options.probeMs,
    words: {
      down: "sandbox provider unreachable; no seed, run or verify job is taken until it answers (jobs held, no attempt spent)",
      up: "sandbox provider answers again; taking seed, run and verify jobs again",
    },
    closing,
    // Without waiting for the jobs in flight: they fail against the same provider and are held
    // in turn.
    onDown: () => {
      for (const slot of slots()) if (HELD_STAGES.has(slot.stage)) void slot.worker.pause(true);
    },
    onUp: () => {
      for (const slot of slots()) if (HELD_STAGES.has(slot.stage)) void slot.worker.resume();
    },
  });
  return {
    probeMs: options.probeMs,
    get open() {
      return !gate.up;
    },
    isDown,
    trip: (reason) => gate.trip(reason),
    holds: (stage) => HELD_STAGES.has(stage),
    stop: () => gate.stop(),
  };
}

export interface SeedAheadOptions {
  /** The bound when fewer runs are in progress (at least 1). */
  min: number;
  /** How often the waiting rollouts are counted. */
  intervalMs: number;
  /**
   * How often, at most, while a seed waits for the bound: the first count after the bound filled
   * (or a seed got through) comes this soon, each after a count that found no room twice as late,
   * up to `intervalMs`.
   */
  recountMs: number;
  /**
   * A seed that waited this long goes back to its queue (no attempt spent) and its worker slot
   * takes a job again: a job is not held active for as long as a batch backs up (its lock would
   * have to be renewed all along, and a lapse counts as a stall). @defaultValue 10 s
   */
  maxWaitMs?: number;
}

export interface SeedAheadState {
  /** Whether a seed waits for the bound. */
  held: boolean;
  /** Rollouts seeded and waiting for an agent or a verifier: as last counted, plus this process's seeds since. */
  ahead: number;
  /** Seeds let through and not finished. */
  inFlight: number;
  /** The bound at the last count: `max(min, runs in progress, rollouts taken per count interval)`. */
  bound: number;
  /** Seeds that waited `maxWaitMs` and went back to their queue. */
  requeued: number;
}

export interface SeedAhead {
  /**
   * Wait until one more seed fits under the bound. Rejects with `HandBackError` on shutdown, and
   * with `SeedWaitOver` (a `HandBackError`) after `maxWaitMs`. Waiting seeds go in `order` (the
   * job's creation time): one that went back to its queue and came again is not passed by
   * younger ones (a later batch must not overtake an earlier one). Resolves true when let
   * through (in flight until `leave`), or false when `rolloutId`'s seed proved, while it waited,
   * to make no sandbox (its rollout cancelled, closing or ended: `RolloutStore.seedsSkipped`): it
   * goes on uncounted, to be skipped, instead of holding its worker slot, and the seeds behind
   * it, until the bound frees.
   */
  enter(signal: AbortSignal, order: number, rolloutId?: string): Promise<boolean>;
  /** A seed let through (`enter` resolved true) ended; `seeded`: its run job was enqueued. */
  leave(seeded: boolean): void;
  state(): SeedAheadState;
  stop(): void;
}

/** A seed that waited for the seed-ahead bound for `maxWaitMs`: back to its queue, no attempt spent. */
export class SeedWaitOver extends HandBackError {
  constructor() {
    super("waited for the seed-ahead bound; the job goes back to its queue");
  }
}

/** How long a count may take before it is given up (and tried again). */
const SEED_AHEAD_COUNT_TIMEOUT_MS = 5_000;
/** Waiting seeds' rollouts looked at per count, at most (see `enter`). */
const SEED_AHEAD_LOOKS = 100;

/** The seed-ahead bound (see `StageWorkerOptions.seedAhead`). */
export function seedAheadBound(deps: PipelineDeps, options: SeedAheadOptions): SeedAhead {
  if (!(options.min >= 1)) throw new Error(`seedAhead.min must be at least 1, got ${options.min}`);
  const maxWaitMs = options.maxWaitMs ?? 10_000;
  /** Whether a count has landed: until then nothing is let through (the backlog is unknown). */
  let known = false;
  let ahead = 0;
  let inFlight = 0;
  let bound = options.min;
  /** This process's seeds that enqueued a run, ever (see `count`). */
  let seededTotal = 0;
  let requeued = 0;
  let stopped = false;
  let held = false;
  const waiters: Array<{
    order: number;
    /** Its seed's rollout, and when it was last looked at (see `enter`), or when it came. */
    rolloutId?: string;
    checkedAt: number;
    go: () => void;
    /** On uncounted: its rollout's seed makes no sandbox. */
    pass: () => void;
    fail: (err: Error) => void;
  }> = [];
  let counting = false;
  let lastCountAt = 0;
  /** When the last count ended, landed or not: the next is `spacing` after it (a failed one's too). */
  let lastTriedAt = 0;
  /** Consecutive failed counts (the next is tried later and later). */
  let failedCounts = 0;
  /**
   * Consecutive counts that found no room for a waiting seed: the next is later and later too, up
   * to `intervalMs`. A bound full for long (agents busy for minutes, or none running: the steady
   * state of a large batch) was counted every `recountMs`: ~200 counts/s per resources worker,
   * 2,500 Redis commands/s, doing nothing. Room the agents make is then seen within about as long
   * as the bound has been full, never later than `intervalMs`; the seeds waiting for an agent
   * meanwhile are at least the agents' take of one interval (the bound).
   */
  let fullCounts = 0;
  let recount: NodeJS.Timeout | null = null;
  /** When `recount` is due (`Date.now()`'s clock). */
  let recountAt = 0;
  /** Runs taken by agents per millisecond, smoothed (see `count`). */
  let takenPerMs = 0;
  /**
   * The seeds the other processes' bounds are making, as each last said (`shareSeeding`): this
   * process says its own at every count (and reads the others'), and as soon as it lets more in
   * (`tell`), so that R processes do not each let in their own bound's worth (which held up to R
   * times as many sandboxes). Fewer are said at the next count: meanwhile the others count a seed
   * that ended twice (in flight, and its rollout waiting), never one too few.
   */
  const self = `${deps.workerId}:${randomUUID()}`;
  let others = 0;
  /** What this process last said it is making, and whether it is saying more now. */
  let said = 0;
  let saying = false;
  /** An entry lives this long unless said again (at every count, `intervalMs`, while this process lives). */
  const shareTtlMs = 3 * options.intervalMs + SEED_AHEAD_COUNT_TIMEOUT_MS;
  /** Say this process's seeds now (and, with `read`, learn the others'). */
  const say = async (read: boolean): Promise<void> => {
    const now = clock(deps);
    const seeds = inFlight;
    if (read) others = await deps.store.shareSeeding(self, seeds, now, now + shareTtlMs);
    else await deps.store.saySeeding(self, seeds, now, now + shareTtlMs);
    said = seeds;
  };
  const share = () => say(true);
  /** While stopped with seeds in flight: says them until the last ends (`stop`). */
  let draining: NodeJS.Timeout | null = null;
  /** Its seeds are no longer the others' to count (an entry left expires in `shareTtlMs`). */
  const forget = () => {
    if (draining) clearInterval(draining);
    draining = null;
    void deps.store.forgetSeeding(self).catch(() => undefined);
  };
  /**
   * Say this process's seeds now that it let more in than it last said: one write, one at a time
   * (the latest number wins). One that fails is left to the next count, which says them again.
   */
  const tell = () => {
    if (saying || stopped || inFlight <= said) return;
    saying = true;
    say(false).then(
      () => {
        saying = false;
        tell();
      },
      () => {
        saying = false;
      },
    );
  };

  const setHeld = (now: boolean) => {
    if (now === held) return;
    held = now;
    deps.metrics?.seedingHeld.set(now ? 1 : 0);
    deps.logger.debug(
      { ahead, inFlight, bound },
      now ? "seeding paused: enough rollouts wait for an agent or a verifier" : "seeding resumed",
    );
  };
  const fits = () => known && ahead + others + inFlight < bound;
  const pump = () => {
    while (waiters.length > 0 && fits()) {
      inFlight++;
      waiters.shift()?.go();
      // A seed got through (at a count, or at a seed's `leave`): the next count comes soon again.
      fullCounts = 0;
    }
    tell();
    setHeld(waiters.length > 0);
    if (waiters.length > 0 && !counting && !stopped) {
      const spacing = Math.min(
        options.intervalMs,
        options.recountMs * 2 ** Math.min(failedCounts + fullCounts, 10),
      );
      const at = Math.max(Date.now(), lastTriedAt + spacing);
      // One already due sooner stays; one set while the bound stayed full (backed off, up to
      // `intervalMs`) is brought forward: kept, the seeds behind one the interval's count let
      // through waited for it, up to an interval, not `recountMs`.
      if (recount && recountAt <= at) return;
      if (recount) clearTimeout(recount);
      recountAt = at;
      recount = setTimeout(() => {
        recount = null;
        void count();
      }, at - Date.now());
      recount.unref();
    }
  };
  const count = async () => {
    if (counting || stopped) return;
    counting = true;
    // Seeds that end while the count is on its way may or may not be in it: those are added to
    // what it says (one may be counted twice until the next count, never missed).
    const seededBefore = seededTotal;
    // The waiters that waited an interval since they came or were last looked at: whether their
    // rollouts were cancelled (or closed, or ended) meanwhile. Not one that waits briefly: a
    // batch's seeds waiting for agents to catch up cost nothing more.
    const lookedAt = Date.now();
    const looking = waiters
      .filter((w) => w.rolloutId !== undefined && lookedAt - w.checkedAt >= options.intervalMs)
      .slice(0, SEED_AHEAD_LOOKS);
    for (const w of looking) w.checkedAt = lookedAt;
    try {
      // Rollouts waiting for an agent, and those waiting for a verifier: both hold their sandbox,
      // and seeding faster than the verifiers take them only piles sandboxes up.
      const { run, verify } = deps.queues.queues;
      const [c, v, , skipped] = await withTimeout(
        Promise.all([
          run.getJobCounts("wait", "prioritized", "delayed", "active"),
          verify.getJobCounts("wait", "prioritized", "delayed"),
          // Said again at every count, so that it does not expire while this process lives. A
          // refused write (Redis full, or read-only) does not fail the count, which only reads:
          // the others' seeds stay as last read.
          share().catch(() => undefined),
          // (A look that fails is tried again an interval later.)
          looking.length > 0
            ? deps.store.seedsSkipped(looking.map((w) => w.rolloutId!)).catch(() => null)
            : null,
        ]),
        SEED_AHEAD_COUNT_TIMEOUT_MS,
        `no answer within ${SEED_AHEAD_COUNT_TIMEOUT_MS} ms`,
      );
      const now = Date.now();
      const waiting = (x: Record<string, number>) => (x.wait ?? 0) + (x.prioritized ?? 0) + (x.delayed ?? 0);
      const counted = waiting(c) + waiting(v) + (seededTotal - seededBefore);
      // Rollouts taken since the last count (less what other processes seeded meanwhile): in a
      // steady state what the slower of agents and verifiers take, as a rate smoothed over
      // about `intervalMs`.
      if (known && now > lastCountAt) {
        const dt = now - lastCountAt;
        const taken = Math.max(0, ahead - counted) / dt;
        takenPerMs += (taken - takenPerMs) * (1 - Math.exp(-dt / options.intervalMs));
      }
      ahead = counted;
      // Never fewer waiting than agents busy (a large agent fleet is not starved by a small
      // `min`), nor than the agents take within one count interval (fast agents are not starved
      // between counts).
      bound = Math.max(options.min, c.active ?? 0, Math.ceil(takenPerMs * options.intervalMs));
      known = true;
      lastCountAt = now;
      if (failedCounts > 0) deps.logger.info("the seed-ahead bound counts the waiting rollouts again");
      failedCounts = 0;
      skipped?.forEach((skip, i) => {
        if (skip) looking[i]!.pass();
      });
      fullCounts = waiters.length > 0 && !fits() ? fullCounts + 1 : 0;
    } catch (err) {
      // Redis unreachable or slow: counted again later, backing off (a seed could not get
      // anywhere meanwhile either). Said once per outage.
      if (failedCounts++ === 0) {
        deps.logger.warn(
          { err: err instanceof Error ? err.message : String(err) },
          "the seed-ahead bound cannot count the rollouts waiting for an agent or a verifier; seeds wait",
        );
      }
    } finally {
      counting = false;
      lastTriedAt = Date.now();
    }
    pump();
  };
  const timer = setInterval(() => void count(), options.intervalMs);
  timer.unref();
  void count();

  return {
    enter(signal, order, rolloutId) {
      if (stopped || signal.aborted) return Promise.reject(new HandBackError());
      if (waiters.length === 0 && fits()) {
        inFlight++;
        tell();
        return Promise.resolve(true);
      }
      return new Promise<boolean>((resolve, reject) => {
        const settle = () => {
          clearTimeout(tooLong);
          signal.removeEventListener("abort", onAbort);
          const i = waiters.indexOf(waiter);
          if (i >= 0) waiters.splice(i, 1);
        };
        const onAbort = () => {
          settle();
          reject(new HandBackError());
          pump();
        };
        const tooLong = setTimeout(() => {
          settle();
          requeued++;
          reject(new SeedWaitOver());
          pump();
        }, maxWaitMs);
        tooLong.unref();
        const waiter = {
          order,
          rolloutId,
          checkedAt: Date.now(),
          go: () => {
            settle();
            resolve(true);
          },
          pass: () => {
            settle();
            resolve(false);
          },
          fail: (err: Error) => {
            settle();
            reject(err);
          },
        };
        signal.addEventListener("abort", onAbort, { once: true });
        // After every waiter no younger than this one (equals keep their arrival order).
        let at = waiters.length;
        while (at > 0 && waiters[at - 1]!.order > order) at--;
        waiters.splice(at, 0, waiter);
        pump();
      });
    },
    leave(seeded) {
      inFlight--;
      if (seeded) {
        ahead++;
        seededTotal++;
      }
      if (stopped && inFlight === 0) forget();
      pump();
    },
    state: () => ({ held, ahead, inFlight, bound, requeued }),
    stop() {
      if (stopped) return; // (a second `stop` would start a second draining, never cleared)
      stopped = true;
      clearInterval(timer);
      if (recount) clearTimeout(recount);
      // Its seeds in flight go on making their sandboxes while the process shuts down: still said
      // (before its entry expires) until the last ends, then its entry goes.
      if (inFlight === 0) forget();
      else {
        draining = setInterval(() => void share().catch(() => undefined), options.intervalMs);
        draining.unref();
      }
      for (const waiter of [...waiters]) waiter.fail(new HandBackError());
      setHeld(false);
    },
  };
}

/** BullMQ's errors for a job whose lock this worker no longer holds (its renewal, or its move on). */
const LOST_LOCK = /could not renew lock|Missing lock for job|Lock mismatch for job/i;

/** Reasons BullMQ fails a job with, without running it (BullMQ 6: a deferred failure). */
const BULLMQ_OWN_FAILURES = new Set([
  "job stalled more than allowable limit",
  "job started more than allowable limit",
]);

/**
 * A stage job's failure that Redis caused by refusing or not answering (`RedisHoldError` from the
 * stage runner, or ioredis's own error thrown before it ran), never a final failure: what the
 * worker holds, and what a masked rollout's reason says when it could not.
 */
function refusedByRedis(err: unknown): boolean {
  return isRedisHold(err) || ((err as Error).name !== "UnrecoverableError" && isRedisRefusal(err));
}

/**
 * How many times a job was handed back to its queue without an attempt spent (shutdown, the
 * seed-ahead bound's wait): kept in its BullMQ `progress` as `{ handBacks }`, which the fleet
 * uses for nothing else (Bull Board shows it). 0 for any other progress.
 */
export function handBacksOf(job: Pick<Job, "progress">): number {
  const p = job.progress;
  const n = typeof p === "object" && p !== null ? (p as { handBacks?: unknown }).handBacks : undefined;
  return typeof n === "number" && Number.isInteger(n) && n > 0 ? n : 0;
}

/**
 * Why a rollout is masked when BullMQ failed its stage job for good without the stage runner
 * deciding it: BullMQ's own failure (its workers kept dying on it), a last attempt that Redis
 * refused and that was not held (past `MAX_REDIS_HOLDS`, or its move back failed too: out of
 * reach, or the lock lapsed; BullMQ's retry instead, and none was left), or a last attempt that
 * failed before its stage began.
 */
export function bullmqFailureReason(stage: StageName, err: Error): string {
  if (BULLMQ_OWN_FAILURES.has(err.message)) {
    return `the ${stage} job failed in BullMQ: ${err.message} (its workers kept dying on it)`;
  }
  if (refusedByRedis(err)) {
    return `the ${stage} job's last attempt was refused by the fleet's Redis and not held for it (held ${MAX_REDIS_HOLDS} times already, or the move back failed): ${err.message}`;
  }
  return `the ${stage} job's last attempt failed before its stage began: ${err.message}`;
}

async function closeAfterBullmqFailure(
  deps: PipelineDeps,
  stage: StageName,
  job: Job,
  reason: string,
): Promise<void> {
  const rolloutId = (job.data as { rolloutId?: unknown } | undefined)?.rolloutId;
  if (typeof rolloutId !== "string") return;
  const rec = await deps.store.get(rolloutId);
  if (!rec || isTerminal(rec.status)) return;
  const next = nextAfter(stage);
  if (rec.receipts[stage] && next) {
    // Its work was done and stored (the worker died after the receipt, before completing the
    // job): go on as a replay would, never mask a stored result (e.g. a reward).
    await deps.queues.enqueue(next, rolloutId);
    return;
  }
  deps.logger.warn({ stage, rolloutId, reason }, "the stage job failed for good; closing the rollout");
  if (stage === "close") {
    // Its id is taken while the failed job is kept: make room for a new close.
    await job.remove().catch(() => undefined);
    // A close that kills every worker taking it comes back here each time BullMQ fails it: it is
    // enqueued again only within the watchdog's count, then closed here without destroys (no
    // Docker call: what killed the workers is likelier there). Unbounded, it crash-looped the
    // resources workers for good, and the watchdog never saw it (always queued or running).
    const closes = await deps.store.noteCloseAgain(rolloutId);
    if (closes === 0) return; // it finished meanwhile
    if (closes > CLOSE_AGAIN_LIMIT) {
      deps.logger.warn(
        { rolloutId, closes: closes - 1 },
        "the rollout's closes keep ending without finalizing: closed without destroys, its sandboxes left to the teardown ledger",
      );
      await closeWithoutDestroys(deps, rolloutId, clock(deps));
      return;
    }
  } else if (!rec.cancelRequested) {
    // (A stop a cancel claimed ends cancelled: close composes it from the claim; a failure
    // recorded here would turn it into a mask.) Only while the result is still undecided.
    await deps.store.recordFailure(
      rolloutId,
      {
        stage,
        terminal: true,
        failureKind: "provider_unavailable",
        mask: true,
        reason: capText(reason),
        at: clock(deps),
      },
      { beforeDecided: true },
    );
  }
  await deps.queues.enqueue("close", rolloutId);
}

/**
 * BullMQ (6.7) renews the locks of the jobs a worker runs by job id, not by delivery: a job whose
 * lock lapsed (this process paused, or cut off from Redis, for longer than the lock lasts) and
 * that this same worker took again runs twice here for a while, and when the first delivery
 * ends (superseded: its stage sees the later launch and drops its outcome), BullMQ stops renewing
 * the job's lock, the later delivery's with it. That lock lapses in its turn, the job stalls
 * again, is taken again, and so on until `maxStalledCount`: one lapse masked the rollout and ran
 * its agent four times. So a lock's tracking is only dropped when the delivery it renews has
 * ended (its token is no longer among `running`, which the processor keeps).
 *
 * Patches the worker's lock manager in place; a BullMQ whose lock manager is not as expected is
 * left alone, with a warning (`worker.int.test.ts` fails for it).
 */
export function keepRenewingLaterDeliveries(
  worker: Worker,
  running: ReadonlySet<string>,
  logger: Pick<PipelineDeps["logger"], "warn">,
): void {
  const manager = (worker as unknown as { lockManager?: unknown }).lockManager as
    | { untrackJob?: (jobId: string) => void; trackedJobs?: unknown }
    | undefined;
  const tracked = manager?.trackedJobs;
  const untrack = manager?.untrackJob;
  if (!manager || !(tracked instanceof Map) || typeof untrack !== "function") {
    logger.warn(
      { queue: worker.name },
      "BullMQ's lock manager is not the one this release knows: a job taken again by the worker that lost its lock may stall again",
    );
    return;
  }
  manager.untrackJob = (jobId: string) => {
    const entry = tracked.get(jobId) as { token?: string } | undefined;
    // A later delivery of the job, still running here, holds the tracking: keep renewing its lock.
    if (entry?.token !== undefined && running.has(entry.token)) return;
    untrack.call(manager, jobId);
  };
}

/**
 * fleet_queue_stalled_jobs_total{queue}: BullMQ reports a stalled job (its worker died or froze
 * past the lock; it goes back to wait) to the worker whose check found it. The series starts at 0;
 * each is counted and logged with `message`.
 */
export function countStalledJobs(
  worker: Worker,
  deps: Pick<PipelineDeps, "metrics" | "logger">,
  message: string,
): void {
  deps.metrics?.queueStalledJobs.inc({ queue: worker.name }, 0);
  worker.on("stalled", (jobId) => {
    deps.metrics?.queueStalledJobs.inc({ queue: worker.name });
    deps.logger.warn({ queue: worker.name, jobId }, message);
  });
}

/**
 * BullMQ repeats the same connection error on every reconnect attempt: whether an error is worth
 * a log line, each distinct one at most every `windowMs`, so an outage is visible without
 * flooding the log.
 */
export function freshErrors(windowMs = 30_000): (message: string) => boolean {
  let last = "";
  let lastAt = 0;
  return (message) => {
    const at = Date.now();
    if (message === last && at - lastAt < windowMs) return false;
    last = message;
    lastAt = at;
    return true;
  };
}

/** A stage job's outcome and its wall time in `fleet_stage_jobs_total` and the duration histogram. */
function countStageJob(deps: PipelineDeps, stage: StageName, outcome: StageOutcome, ms: number): void {
  deps.metrics?.stageJobs.inc({ stage, outcome });
  deps.metrics?.stageDuration.observe({ stage, outcome }, ms / 1000);
}

/** The longest a worker Redis refused pauses before it asks again (see `pauseForRefusal`). */
export const REFUSAL_PAUSE_MAX_MS = 2_000;

/**
 * How long a stage job Redis refused waits before it is taken again. Short: a held job costs
 * Redis one move, and a full Redis does not hand it out (taking a job is a write it refuses).
 */
export const REDIS_HOLD_MS = 2_000;
/**
 * How many deliveries of one stage job may spend no attempt before a Redis refusal spends one:
 * Redis holds, provider holds and stalls count; hand-backs (shutdown, a seed's wait for the
 * seed-ahead bound) do not, being counted on the job (`handBacksOf`). A hand-back's count is
 * itself a write a full Redis refuses (its move back is not): one made while Redis is full is
 * not counted, and counts as a hold (the cap comes sooner, an attempt is spent: never an extra
 * run of the agent).
 */
export const MAX_REDIS_HOLDS = 30;

/** How long a worker keeps trying to close a rollout whose job BullMQ failed (see below). */
export const CLOSE_AFTER_FAILURE_RETRY_MS = 15 * 60_000;

/**
 * What a worker does for a job BullMQ failed for good (`closeAfterBullmqFailure`, or the record
 * of a final failure Redis refused), tried again with backoff (1 s doubling to 30 s) while Redis
 * refuses it (out of memory under noeviction, a read-only replica after a failover: the same
 * outage that failed the job), for up to `CLOSE_AFTER_FAILURE_RETRY_MS` and while this process
 * runs: a rollout is not left running, its sandbox up, until the watchdog's pass at its deadline
 * an hour on.
 */
async function whileRedisRefuses(
  deps: PipelineDeps,
  stage: StageName,
  job: Job,
  action: () => Promise<unknown>,
  closing: () => boolean,
): Promise<void> {
  const until = Date.now() + CLOSE_AFTER_FAILURE_RETRY_MS;
  for (let wait = 1_000, tries = 1; ; wait = Math.min(wait * 2, 30_000), tries++) {
    try {
      await action();
      return;
    } catch (err) {
      // Only Redis refusing or unreachable is worth waiting out; anything else will not pass.
      if (!isRedisUnavailable(err) || closing() || Date.now() + wait > until) throw err;
      if (tries === 1) {
        deps.logger.warn(
          { stage, rolloutId: job.data?.rolloutId, err: String(err) },
          "could not close a rollout whose job failed for good; trying again",
        );
      }
      await delay(wait);
    }
  }
}

/** Close a worker (force: without waiting for its jobs), giving up after `ms`. */
export async function boundedClose(worker: Worker, ms: number, force = true): Promise<void> {
  await Promise.race([worker.close(force), delay(ms)]);
  await Promise.race([worker.disconnect(), delay(ms)]);
}

/** A timer for racing against shutdown steps; unref'd, so a step that wins leaves nothing holding the process. */
function delay(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms).unref());
}
