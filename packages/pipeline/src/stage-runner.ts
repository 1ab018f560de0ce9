import { setTimeout as sleep } from "node:timers/promises";
import {
  capText,
  classifyFailure,
  FleetError,
  isFleetError,
  isTerminal,
  parseStageJob,
  type StageName,
  stageAfter,
} from "@fleet/contracts";
import {
  type DeliveryFence,
  deliveryFence,
  isRedisUnavailable,
  maxBackoffMs,
  STAGE_CATALOG,
  stageJobId,
} from "@fleet/queue";
import { type Job, UnrecoverableError } from "bullmq";
import { clock, type PipelineDeps } from "./deps.ts";
import { isHandBack, ProviderHoldError, RedisHoldError } from "./hand-back.ts";
import {
  beginOptions,
  begunOf,
  DEFAULT_LOCK_MS,
  HANDLERS,
  lockMayHaveLapsed,
  SUPERSEDED,
  superseded,
} from "./stages.ts";

export type StageRunOutcome = "ok" | "replayed" | "skipped" | "unknown" | "superseded" | "stray";

/**
 * Anything thrown, as a FleetError: unclassified errors are infrastructure (retryable, masked).
 * One from the fleet's Redis (down, or refusing writes: full, read-only) says so in its reason,
 * so that a page for masks sends the operator to Redis, not to the sandbox provider.
 */
export function asFleetError(err: unknown): FleetError {
  if (isFleetError(err)) return err as FleetError;
  const message = err instanceof Error ? err.message : String(err);
  const why = isRedisUnavailable(err) ? `the fleet's Redis cannot serve now: ${message}` : message;
  return FleetError.retryable("provider_unavailable", why, err);
}

/**
 * Whether Redis itself refused what failed, or could not be reached: an error of ioredis's
 * (`isRedisUnavailable`), thrown as it is or as the cause of a retryable FleetError (a stage that
 * says what it was doing). Never a FleetError's own message (one that quotes such words: a model
 * upstream's body, a test's output): a final failure stays final, and a sandbox's error is the
 * provider's.
 */
export function isRedisRefusal(err: unknown): boolean {
  if (!isFleetError(err)) return isRedisUnavailable(err);
  const fe = err as FleetError;
  return fe.retryable && fe.cause !== undefined && !isFleetError(fe.cause) && isRedisUnavailable(fe.cause);
}

/**
 * Runs one stage job with the lifecycle contract around the handler: replay of stored
 * receipts (idempotency), skip-ahead to close on a recorded failure, cancel or deadline, and the
 * retry decision (retryable errors retry only while attempts remain and the next attempt can
 * start before the rollout's deadline; otherwise the failure is recorded and close is enqueued).
 */
export async function runStageJob(
  stage: StageName,
  job: Pick<Job, "data" | "attemptsMade" | "opts"> &
    Partial<Pick<Job, "processedOn" | "id" | "token" | "queueQualifiedName">>,
  deps: PipelineDeps,
  options: {
    /** Aborted when the worker shuts down: a long stage stops and hands its job back (`HandBackError`). */
    signal?: AbortSignal;
    /** The job's BullMQ lock duration (see `StageRecord.lock`). @defaultValue 30 s */
    lockDurationMs?: number;
    /**
     * Whether the sandbox provider is down as a whole (it does not answer a listing). Asked
     * after a seed, run or verify failed `provider_unavailable`: when it is, the job is held
     * (`ProviderHoldError`: back to the queue, no attempt spent) rather than retried, for as
     * long as the rollout's deadline is at least `holdMs` away. Never throws.
     */
    providerDown?: () => Promise<boolean>;
    /** How far ahead of the deadline a hold must end. @defaultValue 2 s */
    holdMs?: number;
  } = {},
): Promise<StageRunOutcome> {
  // When this worker took the job: its lock dates from then (wall clock, as BullMQ's).
  const lock = {
    since: job.processedOn ?? Date.now(),
    durationMs: options.lockDurationMs ?? DEFAULT_LOCK_MS,
  };
  const { rolloutId } = parseStageJob(job.data);
  if (job.id !== undefined && job.id !== stageJobId(rolloutId, stage)) {
    // Not the fleet's own job (those are `<rolloutId>.<stage>`, rule 7): one added by hand, by
    // Bull Board's "duplicate" or a script. Taken for a delivery of the rollout's stage, it would
    // take over a live agent's launch and run it again: dropped, untouched.
    deps.logger.warn(
      { rolloutId, stage, jobId: job.id },
      `a ${stage} job whose id is not the fleet's own (${stageJobId(rolloutId, stage)}): added by hand or a script; dropping it`,
    );
    return "stray";
  }
  // One round trip: the record, the stage's start time, for close the tombstone, failure log and
  // sandbox entries, for seed its sandbox intent, for run its launch claim.
  // The same `now` for begin and the deadline check below: begin records seed's intent only
  // before the deadline, exactly when this runner does not skip for it.
  const now = clock(deps);
  const begin = await deps.store.begin(rolloutId, stage, now, beginOptions(stage, deps, job));
  const rec = begin.record;
  const failures = begin.failures;
  const begun = begunOf(begin);
  if (!rec) {
    deps.logger.warn({ rolloutId, stage }, "stage job for an unknown rollout; dropping it");
    return "unknown";
  }
  if (begin.unreadableFailures > 0) {
    deps.logger.warn(
      { rolloutId, stage, unreadable: begin.unreadableFailures },
      "rows of the rollout's failure log do not read as failure records (another release's, or edited); left out of its result",
    );
  }
  if (isTerminal(rec.status)) return "replayed";

  if (stage !== "close") {
    if (rec.closed) return "skipped"; // a close is under way or done: nothing may start
    if (rec.failure) {
      await deps.queues.enqueue("close", rolloutId);
      return "skipped";
    }
    if (rec.receipts[stage]) {
      // Re-delivered after its receipt was stored: replay, no side effect repeated. Before the
      // cancel and deadline checks: a stage that is done stays done (a verify re-delivered past
      // the deadline, or after a cancel its API call was told came too late, keeps its reward).
      const next = nextAfter(stage);
      if (next) await deps.queues.enqueue(next, rolloutId);
      return "replayed";
    }
    if (rec.cancelRequested) {
      await fail(deps, rolloutId, stage, FleetError.nonRetryable("cancelled", "cancelled by request"), now);
      return "skipped";
    }
    if (now >= rec.meta.deadlineAt) {
      await fail(
        deps,
        rolloutId,
        stage,
        FleetError.nonRetryable("deadline_exceeded", "the rollout's deadline passed"),
        now,
      );
      return "skipped";
    }
  }

  const attempt = job.attemptsMade + 1;
  // A stage writes nothing else to its record while it works (an agent's run: an hour, maybe):
  // without a heartbeat the janitor took a live delivery older than its grace whose job an
  // operator removed or obliterated for a lost one, and started the stage again beside it.
  const beat = stage === "close" ? null : startBeat(deps, rolloutId, stage);
  try {
    const next = await HANDLERS[stage](
      // The record `begin` parsed for this job alone, with the stage's own fields added in place:
      // a copy (`{ ...rec, failureLog, begun, lock }`) adds properties to a spread clone, which
      // V8 (Node 20) runs on a slow path, several µs a job.
      Object.assign(rec, { failureLog: failures, begun, lock }),
      deps,
      attempt,
      options.signal,
    );
    if (next === SUPERSEDED) return "superseded";
    if (next) await deps.queues.enqueue(next, rolloutId);
    return "ok";
  } catch (err) {
    if (isHandBack(err)) throw err; // not a failure: the job goes back to the queue
    // A verify attempt a later one superseded (its lock lapsed: see `verifyStage`) failed: the
    // verification is the later attempt's, so nothing of this failure is recorded (no retry
    // entry, no hold, no failure ending the rollout, no close under the later attempt's tests).
    // So too a seed delivery a later one superseded: that one replaces this one's sandbox (an
    // earlier attempt's, to it), and this one's failure (its sandbox gone under it) is not the
    // rollout's; and a run launch a later one took over (its own sandbox replaced, its stop
    // failing `sandbox_lost`): the later launch's run is the rollout's. The final record below
    // is fenced too, atomically.
    const fence = deliveryFence(begun);
    const holdsFence = async (): Promise<boolean> =>
      fence === null || (await deps.store.holdsFence(rolloutId, fence));
    if (lockMayHaveLapsed(lock) && !(await holdsFence().catch(() => true))) {
      superseded(deps, rolloutId, "does not record its failure", err, stage);
      return "superseded";
    }
    if (isRedisRefusal(err)) {
      // Redis refused (full, read-only, loading) or is out of reach: nothing the stage did, and
      // nothing to record (Redis is what refuses). Before the attempts are counted: a refusal on
      // the last attempt is no more final than on the first. The worker puts the job back,
      // delayed, without spending an attempt (`RedisHoldError`).
      throw new RedisHoldError(`the fleet's Redis cannot serve now: ${(err as Error).message}`, {
        cause: err,
      });
    }
    const fe = asFleetError(err);
    const at = clock(deps);
    const maxAttempts = job.opts.attempts ?? STAGE_CATALOG[stage].options.attempts ?? 1;
    const attemptsLeft = attempt < maxAttempts;
    const fitsDeadline = stage === "close" || at + maxBackoffMs(stage, attempt) < rec.meta.deadlineAt;
    const log = deps.logger.child({ rolloutId, stage });
    if (
      // Only what a retry would retry (a final failure stays final), never close (a destroy
      // that fails goes to the teardown ledger and the result is recorded all the same), and at
      // most MAX_HOLDS times per stage: each hold of a run starts its agent again, so a provider
      // that flaps must not rerun it until the deadline.
      fe.retryable &&
      fe.kind === "provider_unavailable" &&
      stage !== "close" &&
      options.providerDown &&
      at + (options.holdMs ?? DEFAULT_HOLD_MS) < rec.meta.deadlineAt &&
      (await heldTimes(deps, rolloutId, stage)) < MAX_HOLDS &&
      (await options.providerDown())
    ) {
      log.warn(
        { err: fe.message, attempt },
        "sandbox provider unreachable; holding the job (no attempt spent)",
      );
      await deps.store.logFailure(rolloutId, {
        ...failureRecord(stage, fe, false, at),
        reason: capText(`${HELD_REASON}${fe.message}`),
      });
      throw new ProviderHoldError(fe.message);
    }
    if (fe.retryable && attemptsLeft && fitsDeadline) {
      log.warn({ err: fe.message, kind: fe.kind, attempt }, "stage failed; will retry");
      await deps.store.logFailure(rolloutId, failureRecord(stage, fe, false, at));
      throw fe;
    }
    if (stage === "close") {
      // Close could not even record its outcome (Redis down for all attempts): the watchdog re-enqueues it.
      log.error({ err: fe.message }, "close stage exhausted its attempts");
      throw new UnrecoverableError(capText(fe.message));
    }
    log.warn({ err: fe.message, kind: fe.kind, attempt }, "stage failed for good; closing the rollout");
    // A final failure stays final even when recording it hits a Redis blip: a plain error here
    // would make BullMQ retry the stage (and run the agent again). A few tries here, then the
    // worker's `failed` handler keeps trying while Redis refuses (`UnrecordedFailureError`).
    const final: FinalFailure = { failure: failureRecord(stage, fe, true, at), fence, recorded: false };
    for (let tries = 1; ; tries++) {
      try {
        if (!(await recordFinalFailure(deps, rolloutId, final))) {
          superseded(deps, rolloutId, "does not record its failure", fe, stage);
          return "superseded";
        }
        break;
      } catch (recordErr) {
        if (tries >= FAIL_RECORD_TRIES) {
          log.error(
            { err: String(recordErr) },
            "could not record a final failure; the worker tries again while Redis refuses, then the watchdog closes the rollout",
          );
          throw new UnrecordedFailureError(capText(`${fe.kind}: ${fe.message}`), rolloutId, final);
        }
        await sleep(FAIL_RECORD_BACKOFF_MS * tries);
      }
    }
    throw new UnrecoverableError(capText(`${fe.kind}: ${fe.message}`));
  } finally {
    beat?.stop();
  }
}

/**
 * How often a stage at work stamps its heartbeat (`RolloutStore.beat`): well within the
 * janitor's lost-job grace (`DEFAULT_LOST_JOB_GRACE_MS`, 2 min); a write per stage job at work
 * per half minute, none for one that ends sooner.
 */
export const STAGE_BEAT_MS = 30_000;

function startBeat(deps: PipelineDeps, rolloutId: string, stage: StageName): { stop(): void } {
  const every = deps.stageBeatMs ?? STAGE_BEAT_MS;
  let stopped = false;
  let timer: NodeJS.Timeout | undefined;
  // One beat in flight at a time: the next is sent once the last answered (a Redis slower than
  // the period, a stall or a failover, never has several in flight, nor one sent after a refused
  // one), `every` after the last was sent: a beat that waited out an outage, stamped when it
  // was sent, is followed at once by a fresh one.
  const next = (delayMs: number) => {
    if (stopped) return;
    timer = setTimeout(() => {
      // (A monotonic clock: a wall clock stepped back meanwhile would put the next beat off.)
      const sentAt = performance.now();
      const again = () => next(Math.min(every, Math.max(0, every - (performance.now() - sentAt))));
      deps.store.beat(rolloutId, stage, clock(deps)).then(
        // Closed, or its record gone: nothing left to keep fresh (a handler wedged past its
        // rollout's close would beat for good).
        (open) => {
          if (open) again();
        },
        again,
      );
    }, delayMs);
    timer.unref();
  };
  next(every);
  return {
    stop: () => {
      stopped = true;
      clearTimeout(timer);
    },
  };
}

/** How far ahead of a rollout's deadline a provider hold must end (see `runStageJob`). */
export const DEFAULT_HOLD_MS = 2_000;
/** How many times one stage of a rollout may be held; later failures spend attempts as usual. */
export const MAX_HOLDS = 5;
/** The start of a hold's entry in the failure log (how holds are counted). */
export const HELD_REASON = "held while the sandbox provider is unreachable: ";

/** How many times this stage of the rollout was held (its entries in the failure log; only asked on a hold's path). */
async function heldTimes(deps: PipelineDeps, rolloutId: string, stage: StageName): Promise<number> {
  const log = await deps.store.failureLog(rolloutId);
  return log.filter((f) => f.stage === stage && f.reason.startsWith(HELD_REASON)).length;
}

/** A stage's final failure, as the stage runner records it (see `recordFinalFailure`). */
export interface FinalFailure {
  failure: ReturnType<typeof failureRecord>;
  /** The delivery's fence (seed, verify): a later delivery at work refuses the record. */
  fence: DeliveryFence | null;
  /** Whether the record landed (a later try only enqueues close: the failure is logged once). */
  recorded: boolean;
}

/**
 * Record a final failure (only while the result is undecided: a verify whose receipt, its reward,
 * was stored keeps it, close composes it) and enqueue close. False when a later delivery holds
 * the stage's fence (it is at work: its outcome decides).
 */
export async function recordFinalFailure(
  deps: PipelineDeps,
  rolloutId: string,
  final: FinalFailure,
): Promise<boolean> {
  if (!final.recorded) {
    const stored = await deps.store.recordFailure(rolloutId, final.failure, {
      beforeDecided: true,
      ...(final.fence === null ? {} : { deliveryFence: final.fence }),
    });
    // Refused for the fence (not for a decided result): a later attempt is verifying (seeding).
    if (!stored && final.fence !== null && !(await deps.store.holdsFence(rolloutId, final.fence))) {
      return false;
    }
    final.recorded = true;
  }
  await deps.queues.enqueue("close", rolloutId);
  return true;
}

/**
 * A final failure the stage runner could not record (Redis refused each of its tries): the job
 * fails for good all the same (never retried: that would run the stage again), and the worker's
 * `failed` handler records it once Redis takes it and closes the rollout. Left unrecorded, the
 * rollout stayed open with no job, and once the failed job was trimmed (its age, BullMQ's count,
 * an operator's clean) the janitor's lost-job step enqueued the stage again: the agent ran twice.
 */
export class UnrecordedFailureError extends UnrecoverableError {
  constructor(
    message: string,
    readonly rolloutId: string,
    readonly final: FinalFailure,
  ) {
    super(message);
    // BullMQ and the worker's counts know a final failure by this name.
    this.name = "UnrecoverableError";
  }
}

/** How often, and how far apart, a final failure's record is tried before the worker's `failed` handler is left to it. */
const FAIL_RECORD_TRIES = 4;
const FAIL_RECORD_BACKOFF_MS = 250;

/** The stage a stored receipt of `stage` leads to (null after close). */
export function nextAfter(stage: StageName): StageName | null {
  // After a stage job's stage comes another stage job's (never `admission`).
  return stageAfter(stage) as StageName | null;
}

function failureRecord(stage: StageName, fe: FleetError, terminal: boolean, at: number) {
  return {
    stage,
    terminal,
    failureKind: fe.kind,
    mask: classifyFailure(fe.kind).outcome === "mask",
    reason: reasonOf(fe),
    at,
    ...(fe.usage ? { usage: fe.usage } : {}),
  };
}

/**
 * A failure's reason (DESIGN §2 rule 12): its message, or for an error thrown without one (`throw
 * new Error()` in a verifier or harness, a thrown non-Error) what is known of it. Stored as it
 * was, the result said `reason: ""`: a mask nobody could act on.
 */
function reasonOf(fe: FleetError): string {
  if (fe.message.trim() !== "") return capText(fe.message);
  const cause = fe.cause;
  const thrown = cause instanceof Error ? cause.name : cause === undefined ? "FleetError" : typeof cause;
  return `${fe.kind}: the error thrown (${thrown}) carried no message`;
}

/** Record a terminal failure (the first one wins) and skip ahead to close. */
async function fail(
  deps: PipelineDeps,
  rolloutId: string,
  stage: StageName,
  fe: FleetError,
  at: number,
): Promise<void> {
  await deps.store.recordFailure(rolloutId, failureRecord(stage, fe, true, at), { beforeDecided: true });
  await deps.queues.enqueue("close", rolloutId);
}
