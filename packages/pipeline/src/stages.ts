import { randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import {
  type CleanupReceipt,
  capText,
  describeOverCeiling,
  endedBySignal,
  type FailureRecord,
  FleetError,
  fileModes,
  isFleetError,
  isTerminal,
  type ProbeReport,
  type RolloutResult,
  type RunReceipt,
  runBudgetShortfall,
  type SandboxHandle,
  type StageName,
  sandboxOverCeiling,
  type TaskContent,
  type Usage,
  usageOf,
  withTimeout,
  withUsage,
} from "@fleet/contracts";
import type { UpstreamHealth } from "@fleet/gateway";
import { agentDeadline, createHarness as defaultCreateHarness, stageWorkspace } from "@fleet/harness";
import {
  type BeginOptions,
  type BeginResult,
  type DeliveryFence,
  deliveryFence,
  isInvalidStoredData,
  type LedgerEntry,
  type RolloutRecord,
  type SandboxEntry,
  sandboxKey,
} from "@fleet/queue";
import {
  AGENT_USER,
  FENCE_EXEC_MS,
  KILL_GRACE_S,
  type KillOptions,
  ROOT_USER,
  SANDBOX_PATHS,
  type SandboxProvider,
  SCRATCH_DIRS,
  scrubScratch,
  TestsSupersededError,
} from "@fleet/sandbox";
import { verify as defaultVerify } from "@fleet/verifiers";
import type { Job } from "bullmq";
import { clock, localTime, type PipelineDeps } from "./deps.ts";
import { DeferralError, HandBackError, isHandBack } from "./hand-back.ts";
import { gatewayNetworkFor, type ModelAccess, needsModelAccess, openModelAccess } from "./model-access.ts";
import { composeResult } from "./result.ts";

/** What `store.begin` did for the stage besides reading the record (see `beginOptions`). */
export type Begun = Omit<BeginResult, "record" | "failures" | "unreadableFailures"> & {
  /**
   * A run's launch fence, set by the run handler once it holds a launch claim (and cleared when
   * it gives the claim back): the stage runner records the run's failure only while the launch
   * holds it, as a seed's or a verify's only while it holds its own (`deliveryFence`).
   */
  launchFence?: DeliveryFence;
};

/**
 * `begin`'s answer without its record and failure log (`const { record, failures, unreadableFailures, ...begun }`),
 * as a literal: a rest copy runs on V8's slow path (Node 20), a few µs a stage job.
 */
export function begunOf(b: BeginResult): Begun {
  return {
    intentRecorded: b.intentRecorded,
    intentFresh: b.intentFresh,
    launch: b.launch,
    verifyToken: b.verifyToken,
    seedToken: b.seedToken,
    testsSweepLeftMs: b.testsSweepLeftMs,
    earlierVerifyLeft: b.earlierVerifyLeft,
    verifyEpoch: b.verifyEpoch,
    earlierVerifyFenceAware: b.earlierVerifyFenceAware,
    sandboxes: b.sandboxes,
  };
}

/** The record a handler gets: as `begin` read it, with what `begin` did for the stage and the failure log. */
export type StageRecord = RolloutRecord & {
  begun: Begun;
  failureLog: FailureRecord[];
  /**
   * The job's BullMQ lock: taken at `since` (epoch ms) for `durationMs`, renewed while the worker
   * can reach Redis. Before half of it has passed no other worker can have been given the job.
   */
  lock?: { since: number; durationMs: number };
};

/** A stage job's BullMQ lock when its worker does not say (`runStageJob`'s `lockDurationMs`). */
export const DEFAULT_LOCK_MS = 30_000;

/** Whether another worker may have been handed this job meanwhile (its lock could have lapsed). */
function mayBeTakenOver(rec: StageRecord): boolean {
  return lockMayHaveLapsed(rec.lock);
}

/** `mayBeTakenOver` for a job's lock (`StageRecord.lock`; none known: it may have). */
export function lockMayHaveLapsed(lock: StageRecord["lock"]): boolean {
  return lock === undefined || Date.now() - lock.since >= lock.durationMs / 2;
}

/**
 * What a handler returns when a later delivery of its stage took the stage over (its lock had
 * lapsed): nothing stored or enqueued, and the job is counted `superseded`, not `ok`.
 */
export const SUPERSEDED = "superseded";

/**
 * A stage handler stores its receipt (enqueueing the next stage with it) and returns a stage
 * still to enqueue (e.g. close when a stop won), null, or `SUPERSEDED`.
 */
export type StageHandler = (
  rec: StageRecord,
  deps: PipelineDeps,
  attempt: number,
  /** Aborted when the worker shuts down (see `HandBackError`). */
  shutdown?: AbortSignal,
) => Promise<StageName | null | typeof SUPERSEDED>;

/** Sandboxes outlive their rollout's deadline by this much before the janitor may reap them. */
export const SANDBOX_EXPIRY_SLACK_MS = 10 * 60_000;

/**
 * What a stage's `store.begin` does besides reading the record, in the same round trip: seed
 * persists its sandbox intent (DESIGN §2 rule 9), run claims the fenced launch (rule 10), verify
 * takes the verify fence (rule 2: one verify at a time).
 */
export function beginOptions(
  stage: StageName,
  deps: PipelineDeps,
  /**
   * The delivery: a run's launch is claimed only while it holds its job's BullMQ lock (the job
   * key's `:lock`), when it came from a worker (a token) whose queue is known.
   */
  job: Partial<Pick<Job, "id" | "token" | "queueQualifiedName">> = {},
): BeginOptions {
  switch (stage) {
    case "seed":
      return {
        intent: { owner: "resources", provider: deps.provider.name, expirySlackMs: SANDBOX_EXPIRY_SLACK_MS },
        seedToken: `${deps.workerId}:${randomUUID()}`,
      };
    case "run":
      return {
        launchToken: `${deps.workerId}:${randomUUID()}`,
        launchLock:
          job.token && job.queueQualifiedName && job.id !== undefined
            ? { key: `${job.queueQualifiedName}:${job.id}:lock`, token: job.token }
            : undefined,
      };
    case "verify":
      return { verifyToken: `${deps.workerId}:${randomUUID()}` };
    default:
      return {};
  }
}

async function loadTask(rec: RolloutRecord, deps: PipelineDeps): Promise<TaskContent> {
  let task: TaskContent | null;
  try {
    task = await deps.store.getTask(rec.meta.taskDigest);
  } catch (err) {
    // Stored under an older, looser schema (or torn): no retry can make it valid.
    if (isInvalidStoredData(err)) {
      throw FleetError.nonRetryable(
        "invalid_task",
        `stored task ${rec.meta.taskDigest} is no longer valid: ${capText(err.message, 500)}`,
        err,
      );
    }
    throw err;
  }
  if (!task) throw FleetError.nonRetryable("invalid_task", `task ${rec.meta.taskDigest} is not stored`);
  return task;
}

/**
 * Persist intent (unless `begin` did), create (or find) a sandbox, attach the handle (unless the
 * caller attaches it with its receipt: `deferAttach`). Null when a close won the race.
 */
async function createSandbox(
  rec: StageRecord,
  deps: PipelineDeps,
  owner: SandboxEntry["owner"],
  task: TaskContent,
  options: {
    intentRecorded?: boolean;
    intentFresh?: boolean;
    deferAttach?: boolean;
    /** Replace a sandbox an earlier attempt left, even a running one, instead of reusing it. */
    replace?: boolean;
    /**
     * Asked right before a sandbox found is destroyed to be replaced: false leaves it and returns
     * null (this attempt was taken over meanwhile, and the sandbox may be the later one's).
     */
    mayReplace?: () => Promise<boolean>;
    /** Stops the provider's create (the worker shutting down: see `SandboxProvider.create`). */
    signal?: AbortSignal | undefined;
  } = {},
): Promise<{ handle: SandboxHandle; entry: SandboxEntry; createMs: number; reused: boolean } | null> {
  // Over what this worker's operator allows a sandbox (a dispatcher configured otherwise admitted
  // it): the task's, final, before anything is made.
  const over = deps.sandboxCeiling ? sandboxOverCeiling(rec.meta.sandbox, deps.sandboxCeiling) : [];
  if (over.length > 0) {
    throw FleetError.nonRetryable("invalid_task", describeOverCeiling(over));
  }
  const now = clock(deps);
  const entry: SandboxEntry = {
    key: sandboxKey(rec.meta.id, owner),
    rolloutId: rec.meta.id,
    owner,
    provider: deps.provider.name,
    handle: null,
    createdAt: now,
    expiresAt: rec.meta.deadlineAt + SANDBOX_EXPIRY_SLACK_MS,
  };
  // DESIGN §2 rule 9: the intent is durable before the sandbox exists; a tombstone refuses it.
  if (!options.intentRecorded) {
    const intent = await deps.ledger.recordIntent(entry);
    if (intent !== "ok") return null;
  }
  const t0 = clock(deps);
  // Only an attempt after one that recorded the intent can find a sandbox (a label lookup lists
  // the daemon's containers: not on every rollout).
  let handle = options.intentFresh ? null : await deps.provider.find(rec.meta.id, owner);
  if (handle && (options.replace || !(await deps.provider.alive(handle)))) {
    // An earlier attempt's sandbox that is not running (its worker died between create and
    // start, or it stopped): nothing in it can be trusted or used, and no agent ran in it yet
    // that a new one would lose. Replace it rather than probe it until the attempts run out.
    // A seed replaces even a running one: the earlier attempt may have staged the task already,
    // and a probe of it would take those files for the image's own (`workspaceEmpty` false),
    // which would turn any later rerun of the agent into a mask.
    if (options.mayReplace && !(await options.mayReplace())) return null;
    const gone = await deps.provider.destroy(handle);
    if (!gone.confirmed)
      throw FleetError.retryable("provider_unavailable", "could not remove a dead sandbox");
    handle = null;
  }
  const reused = handle !== null;
  if (!handle) {
    // The sandbox the agent runs in joins the rollout's sealed gateway network when the agent
    // talks to a model; every other sandbox (the task's, when the agent has its own) has no
    // network at all.
    const agentRunsHere = owner === "agent" || rec.meta.agent.sandbox !== "own";
    const network =
      agentRunsHere && needsModelAccess(rec.meta.agent)
        ? (await gatewayNetworkFor(deps, rec.meta.id)).name
        : "none";
    handle = await deps.provider.create(
      {
        image: task.image,
        rolloutId: rec.meta.id,
        owner,
        expiresAt: entry.expiresAt,
        options: rec.meta.sandbox ?? {},
        network,
      },
      options.signal ? { signal: options.signal } : undefined,
    );
    deps.metrics?.sandboxCreateDuration.observe({ provider: deps.provider.name }, (clock(deps) - t0) / 1000);
  }
  // `{ ...entry, handle }` as a literal (a spread is a slow path on Node 20), in its key order.
  const created: SandboxEntry = {
    key: entry.key,
    rolloutId: entry.rolloutId,
    owner: entry.owner,
    provider: entry.provider,
    handle,
    createdAt: entry.createdAt,
    expiresAt: entry.expiresAt,
  };
  // A close that ran while we were creating could not see the handle: destroy it ourselves.
  if (!options.deferAttach && (await deps.ledger.attachHandle(created))) {
    await destroyOrLedger(deps, created);
    return null;
  }
  return { handle, entry: created, createMs: clock(deps) - t0, reused };
}

/**
 * The isolation probe, its verdict checked here too (DESIGN §2 rule 4, §5): a provider is to
 * throw final `isolation_refused` for a sandbox that is not isolated, and one that reports
 * `isolated: false` instead is refused all the same, never used.
 */
async function probeIsolated(deps: PipelineDeps, handle: SandboxHandle): Promise<ProbeReport> {
  const report = await deps.provider.probe(handle);
  if (!report.isolated) {
    const failed = Object.entries(report.checks)
      .filter(([, ok]) => !ok)
      .map(([name]) => name);
    throw FleetError.nonRetryable(
      "isolation_refused",
      capText(
        `sandbox ${handle.name} is not isolated from the host (failed: ${failed.join(", ") || "none named"}): ${report.detail}`,
        1000,
      ),
    );
  }
  return report;
}

/** One sandbox: the same id on the same provider endpoint. */
function isSameSandbox(a: SandboxHandle, b: SandboxHandle): boolean {
  return a.provider === b.provider && a.endpoint === b.endpoint && a.id === b.id;
}

/**
 * Destroy a sandbox; on failure leave a ledger entry for the janitor. Returns the teardown state.
 * With `deferConfirm`, a confirmed destroy is not yet removed from the sandboxes hash and ledger:
 * the caller passes `confirmedKey` to `store.finalize`, which removes it in its script.
 */
export async function destroyOrLedger(
  deps: PipelineDeps,
  entry: SandboxEntry,
  options: {
    deferConfirm?: boolean;
    /** The ledger entry `ledger.take` wrote for this attempt (already counted): a failure is not counted again. */
    taken?: LedgerEntry;
  } = {},
): Promise<{
  teardown: "confirmed" | "pending";
  receipt: CleanupReceipt | null;
  confirmedKey: string | null;
  /** With `confirmedKey`: the sandbox destroyed (null: none was found), for `store.finalize`. */
  destroyed?: SandboxHandle | null;
}> {
  const now = clock(deps);
  // Only the entry of the sandbox destroyed here (or of none): one recorded meanwhile for a
  // sandbox that replaced it under the same key is not this destroy's to forget.
  const confirm = async (destroyed: SandboxHandle | null) => {
    if (!options.deferConfirm) await deps.ledger.confirm(entry, destroyed);
  };
  try {
    const handle = entry.handle ?? (await deps.provider.find(entry.rolloutId, entry.owner));
    if (!handle) {
      // An intent whose sandbox never appeared: only after a grace period may we trust that.
      if (now - entry.createdAt < (deps.intentGraceMs ?? 5 * 60_000)) {
        throw FleetError.retryable("provider_unavailable", "sandbox intent without a handle yet");
      }
      await confirm(null);
      deps.metrics?.teardownAttempts.inc({ result: "already_gone" });
      return {
        teardown: "confirmed",
        receipt: { confirmed: true, scope: "sandbox", at: now, alreadyGone: true, remaining: 0 },
        confirmedKey: entry.key,
        destroyed: null,
      };
    }
    const receipt = await deps.provider.destroy(handle);
    if (!receipt.confirmed)
      throw FleetError.retryable("provider_unavailable", receipt.detail ?? "destroy not confirmed");
    await confirm(handle);
    deps.metrics?.teardownAttempts.inc({ result: receipt.alreadyGone ? "already_gone" : "confirmed" });
    return { teardown: "confirmed", receipt, confirmedKey: entry.key, destroyed: handle };
  } catch (err) {
    const reason = err instanceof Error ? err.message : String(err);
    await deps.ledger.recordFailure(entry, reason, now, undefined, { taken: options.taken });
    deps.metrics?.teardownAttempts.inc({ result: "failed" });
    deps.logger.warn(
      { rolloutId: entry.rolloutId, owner: entry.owner, err: reason },
      "teardown failed; left on the ledger",
    );
    return { teardown: "pending", receipt: null, confirmedKey: null };
  }
}

/**
 * How long after an agent's deadline and its command's kill grace the run stage kills what is
 * left of it itself (its `timeout`, the agent's own, may have been stopped by the agent).
 */
export const DEADLINE_SWEEP_AFTER_MS = 500;

/** How long a sandbox that still looks alive after an error is watched before the error stands. */
export const SANDBOX_SETTLE_MS = 2_000;

/** Count what an agent's model calls spent (`fleet_model_tokens_total`), whatever its run's outcome. */
function countTokens(deps: PipelineDeps, usage: Usage | null): void {
  if (!usage || !deps.metrics) return;
  if (usage.promptTokens) deps.metrics.modelTokens.inc({ kind: "prompt" }, usage.promptTokens);
  if (usage.completionTokens) deps.metrics.modelTokens.inc({ kind: "completion" }, usage.completionTokens);
  if (usage.cachedTokens) deps.metrics.modelTokens.inc({ kind: "cached" }, usage.cachedTokens);
}

/**
 * An error from inside a sandbox that has meanwhile disappeared is `sandbox_lost` (masked),
 * whatever surface it came through: a put racing the container's removal can look like a missing
 * path or a killed `tar` (invalid_task) and must not fail the rollout as the task's fault. A
 * container being force-removed still reports itself running for a moment after its processes
 * were killed, so the check is repeated for up to `SANDBOX_SETTLE_MS` before the error stands
 * (only on this error path).
 */
async function sandboxLostIfGone(deps: PipelineDeps, handle: SandboxHandle, err: unknown): Promise<unknown> {
  // Nor a deadline: a run that ran out of the rollout's time is not graded, the sandbox's fate aside.
  if (
    isFleetError(err) &&
    (err.kind === "sandbox_lost" || err.kind === "provider_unavailable" || err.kind === "deadline_exceeded")
  )
    return err;
  const isAlive = () => deps.provider.alive(handle).catch(() => true);
  const until = Date.now() + (deps.sandboxSettleMs ?? SANDBOX_SETTLE_MS);
  let alive = await isAlive();
  while (alive && Date.now() < until) {
    await sleep(100);
    alive = await isAlive();
  }
  if (alive) return err;
  const message = err instanceof Error ? err.message : String(err);
  return FleetError.nonRetryable("sandbox_lost", `the sandbox disappeared: ${message}`, err);
}

/**
 * `sandboxLostIfGone` for a sandbox no agent has run in yet (a seed's, or a run's own before its
 * launch): one found gone is retried (`sandbox_lost`, retryable), as the next attempt makes
 * another, never masked at once nor failed as the task's.
 */
async function lostBeforeAnAgent(deps: PipelineDeps, handle: SandboxHandle, err: unknown): Promise<unknown> {
  const fe = await sandboxLostIfGone(deps, handle, err);
  return isFleetError(fe) && fe.kind === "sandbox_lost" && !fe.retryable
    ? FleetError.retryable("sandbox_lost", fe.message, err)
    : fe;
}

/**
 * Put the sandbox back to how the task started, for a run that starts again after an interrupted
 * one: the task's initial workspace (everything else in /workspace removed) and nothing of the
 * agent's left in the scratch directories (its notes in /tmp must not reach the new run). Only
 * when the seed's probe saw /workspace empty and scratch clean (a read-only root, and no agent
 * files in the scratch directories): otherwise what the image brought could not be told apart or
 * put back, or the agent could write elsewhere, so such a rollout is `sandbox_lost`, as is one whose
 * sandbox cannot be reset (retried first): masked, never graded on another run's leftovers or on
 * a sandbox missing part of its start.
 */
async function resetForRerun(
  deps: PipelineDeps,
  handle: SandboxHandle,
  task: TaskContent,
  probe: ProbeReport,
): Promise<void> {
  const cannot = (why: string) =>
    FleetError.nonRetryable(
      "sandbox_lost",
      `the run was interrupted after its agent started, and ${why}, so the sandbox cannot be put back for a new run`,
    );
  if (probe.workspaceEmpty !== true) throw cannot("the image has its own /workspace files");
  if (probe.scratchClean !== true) {
    throw cannot(
      `the agent could write outside /workspace and ${SCRATCH_DIRS.join(", ")} (a writable root), or the image has its own agent-owned files there`,
    );
  }
  try {
    await deps.provider.put(handle, SANDBOX_PATHS.workspace, task.workspace, {
      user: AGENT_USER,
      modes: fileModes(task, "workspace"),
      replace: true,
    });
    await scrubScratch(deps.provider, handle, AGENT_USER);
  } catch (err) {
    if (isFleetError(err) && (err.kind === "provider_unavailable" || err.kind === "sandbox_lost")) throw err;
    const message = err instanceof Error ? err.message : String(err);
    throw FleetError.retryable("sandbox_lost", `could not reset the sandbox for a new run: ${message}`, err);
  }
}

export const seed: StageHandler = async (rec, deps, _attempt, shutdown) => {
  // A final failure (the task, a missing image, an isolation refusal): the intent this begin
  // recorded will never get a sandbox (a create that fails for good leaves no container; one it
  // could not remove is retryable): drop it, so close can confirm the teardown at once instead
  // of waiting out the intent grace period. Not one an earlier attempt recorded: that attempt may
  // have created the sandbox, and close must still find it. Nor once a later delivery began (this
  // one's lock lapsed): the intent is that delivery's, which may be making the sandbox now (its
  // handle is stored only with its receipt), so only while this one holds the seed fence.
  const seedFence = deliveryFence(rec.begun);
  const dropFreshIntent = async (err: unknown) => {
    if (rec.begun.intentFresh && isFleetError(err) && !err.retryable) {
      await deps.ledger.confirm(
        { key: sandboxKey(rec.meta.id, "resources"), rolloutId: rec.meta.id },
        null,
        seedFence ? { deliveryFence: seedFence } : {},
      );
    }
  };
  let task: TaskContent;
  try {
    task = await loadTask(rec, deps);
  } catch (err) {
    await dropFreshIntent(err);
    throw err;
  }
  // The intent was persisted by this stage's begin (same round trip as the record read); the
  // handle is attached with the receipt.
  let created: Awaited<ReturnType<typeof createSandbox>>;
  let takenOver = false;
  try {
    // Its provider calls before the create (the sandbox an earlier attempt left: find, alive,
    // destroy) take no signal: not waited for past the worker's shutdown either.
    created = await unlessShutDown(
      createSandbox(rec, deps, "resources", task, {
        intentRecorded: rec.begun.intentRecorded,
        intentFresh: rec.begun.intentFresh,
        deferAttach: true,
        replace: true,
        // Held long enough for its lock to have lapsed: the sandbox found may be the one of a later
        // delivery (its run working there by now), not an earlier attempt's.
        mayReplace: async () => {
          const ours =
            !mayBeTakenOver(rec) ||
            seedFence === null ||
            (await deps.store.holdsFence(rec.meta.id, seedFence));
          takenOver = !ours;
          return ours;
        },
        // A create the daemon is slow to answer would hold the job past the worker's shutdown
        // budget: its lock would lapse and BullMQ count a stall (a few rolling restarts, and it
        // fails the rollout for the fleet's own doing). Stopped instead, and the job handed back;
        // the intent `begin` recorded stays, so the next delivery finds by its labels whatever the
        // stopped create made, and replaces it (as would a close, or the janitor's label sweep).
        signal: shutdown,
      }),
      shutdown,
    );
  } catch (err) {
    // Stopped at the worker's shutdown: back to the queue, no attempt spent (a final error stands).
    if (shutdown?.aborted && !(isFleetError(err) && !err.retryable)) throw new HandBackError();
    await dropFreshIntent(err);
    throw err;
  }
  // Closed meanwhile (tombstone): nothing to do, no sandbox made. Or taken over meanwhile: the
  // sandbox found is left to the later delivery.
  if (!created) return takenOver ? SUPERSEDED : null;
  // Held long enough for its lock to have lapsed: another seed may have stored its receipt, and
  // its run may use the sandbox now. A create that met that sandbox by its fixed name adopted it:
  // probing and staging it again would put the task's files back under a running agent.
  if (mayBeTakenOver(rec) && (await yieldToStoredSeed(deps, rec, created.handle))) return SUPERSEDED;
  const t1 = clock(deps);
  let t2: number;
  let probe: Awaited<ReturnType<SandboxProvider["probe"]>>;
  try {
    // Not held past the worker's shutdown either (the provider's calls take no signal): handed
    // back, the sandbox left as a stopped create leaves it (no handle stored, its intent kept),
    // for the next delivery to find by its labels and replace.
    ({ probe, t2 } = await unlessShutDown(
      (async () => {
        const report = await probeIsolated(deps, created.handle);
        const probed = clock(deps);
        await stageWorkspace(deps.provider, created.handle, task);
        return { probe: report, t2: probed };
      })(),
      shutdown,
    ));
  } catch (err) {
    if (isHandBack(err)) throw err;
    // A cancel's close destroyed the sandbox under the staging: the close reports the rollout
    // (enqueued again: a cancel whose own enqueue of it never happened is still closed).
    if (await stoppedUnder(deps, rec.meta.id)) return "close";
    // A sandbox that died under the staging (killed from outside, its daemon's doing) fails its
    // commands in ways that read as the task's (a staging step's exit 126 is `invalid_task`):
    // the sandbox's, so retried, and the next attempt makes it anew (rule 6: never the task's).
    // So is one the provider found gone (its probe's or its staging's own `sandbox_lost`): this
    // seed made it, before any agent ran there, and the next attempt makes another.
    throw await lostBeforeAnAgent(deps, created.handle, err);
  }
  const t3 = clock(deps);
  // Held long enough for its lock to have lapsed: a later delivery may hold the seed fence, and
  // run is enqueued only for a stored receipt (a run sent behind a refused one would spend its
  // attempts waiting for that delivery's). Otherwise run's job goes with the receipt.
  const contested = mayBeTakenOver(rec);
  // Set key by key, not spread in (`...(contested ? {} : { next })`): V8 (Node 20) copies a
  // spread on a slow path, a few µs a rollout.
  const receiptOptions: Parameters<PipelineDeps["store"]["storeReceipt"]>[5] = { attach: created.entry };
  if (!contested) receiptOptions.next = { queues: deps.queues, stage: "run" };
  // Only while this delivery is the one that began last: a later one (this one's lock
  // lapsed) may be replacing this sandbox by now, as an earlier attempt's.
  if (seedFence) receiptOptions.deliveryFence = seedFence;
  const saved = await deps.store.storeReceipt(
    rec.meta,
    "seed",
    {
      handle: created.handle,
      probe,
      createMs: created.createMs,
      probeMs: t2 - t1,
      stageMs: t3 - t2,
      reused: created.reused,
      at: t3,
    },
    "seeded",
    t3,
    receiptOptions,
  );
  // A later delivery of this seed began (this one's lock lapsed): the seed is its to finish. It
  // finds this sandbox by its labels and replaces it, or met it by its fixed name and adopted
  // it, so it is left alone, unless that delivery stored its receipt with another sandbox.
  if (saved === "superseded") {
    if (!(await yieldToStoredSeed(deps, rec, created.handle))) {
      deps.logger.warn(
        { rolloutId: rec.meta.id },
        "a later delivery of the seed began; this one stores no receipt and leaves its sandbox to it",
      );
    }
    return SUPERSEDED;
  }
  // A close that ran meanwhile may not have seen the handle: destroy the sandbox ourselves.
  if (saved === "refused") await destroyOrLedger(deps, created.entry);
  // Another seed of this rollout stored its receipt first (this one's lock had lapsed): its
  // sandbox is the rollout's, and the entry under the shared key is its. Destroy ours by handle
  // only; should that fail, the janitor's label sweep finds it once the rollout is over.
  if (saved === "taken") {
    // Unless it is the very sandbox the winner stored: sandbox names are fixed per rollout, so a
    // create that met the winner's sandbox by its name adopted it (Docker), and it is the rollout's.
    if (!(await yieldToStoredSeed(deps, rec, created.handle)))
      await destroyLosingSeed(deps, rec, created.handle);
  }
  return contested && saved === "stored" ? "run" : null;
};

/**
 * `work`, or a `HandBackError` once `shutdown` aborts (the worker shutting down), whichever comes
 * first: for provider calls that take no signal, which a daemon slow to answer would hold past
 * the shutdown budget (the job's lock lapses: a stall). `work` goes on unheeded meanwhile.
 */
async function unlessShutDown<T>(work: Promise<T>, shutdown: AbortSignal | undefined): Promise<T> {
  if (!shutdown) return work;
  let onAbort = () => {};
  const stopped = new Promise<never>((_resolve, reject) => {
    onAbort = () => reject(new HandBackError());
    shutdown.addEventListener("abort", onAbort, { once: true });
  });
  if (shutdown.aborted) onAbort();
  try {
    return await Promise.race([work, stopped]);
  } finally {
    shutdown.removeEventListener("abort", onAbort);
  }
}

/**
 * Whether another seed of this rollout stored its receipt; if so this one lost, and its sandbox
 * is destroyed unless it is the winner's own (a create that met it by its fixed name adopted it).
 */
async function yieldToStoredSeed(
  deps: PipelineDeps,
  rec: StageRecord,
  handle: SandboxHandle,
): Promise<boolean> {
  const winner = (await deps.store.get(rec.meta.id))?.receipts.seed?.handle;
  if (!winner) return false;
  if (!isSameSandbox(winner, handle)) await destroyLosingSeed(deps, rec, handle);
  return true;
}

/** Destroy a losing seed's own sandbox by handle; should that fail, the janitor's label sweep finds it. */
async function destroyLosingSeed(deps: PipelineDeps, rec: StageRecord, handle: SandboxHandle): Promise<void> {
  const gone = await deps.provider.destroy(handle).catch(() => null);
  if (!gone?.confirmed)
    deps.logger.warn({ rolloutId: rec.meta.id }, "could not destroy a losing seed's sandbox");
}

/** How long a run that ends without a receipt waits for Redis to keep what its agent spent. */
const KEEP_SPEND_TIMEOUT_MS = 5_000;

export const run: StageHandler = async (rec, deps, _attempt, shutdown) => {
  const seedReceipt = rec.receipts.seed;
  // DESIGN §2 rule 10: launch and stop race on one atomic claim (made by this stage's begin).
  const claim =
    rec.begun.launch ??
    (await (async () => {
      const token = `${deps.workerId}:${randomUUID()}`;
      return { ...(await deps.store.claimLaunch(rec.meta.id, token)), token };
    })());
  const { previous, launches, token } = claim;
  if (previous === "stopped") return "close";
  // This delivery's claim reached Redis after its job's lock lapsed, or was sent again after a
  // later delivery's claim: that delivery has the run, and this one touches nothing.
  if (previous === "superseded") {
    deps.logger.warn(
      { rolloutId: rec.meta.id },
      "the run's launch claim came after a later delivery's; leaving the run to it",
    );
    return SUPERSEDED;
  }
  const id = rec.meta.id;
  // This launch's failure is the rollout's only while it holds the fence: one taken over (a
  // later delivery claimed the launch, and may have replaced its own sandbox under it) must not
  // record a failure over the launch that replaced it (see `runStageJob`).
  rec.begun.launchFence = { field: "fence", token: `launched:${token}` };
  // A claim that launched nothing goes back (see the catch below).
  /** Whether it went back. */
  const giveBack = async (): Promise<boolean> => {
    if (previous !== "") return false;
    // Given back, the fence is no longer this launch's to record under (the failure below is);
    // refused (another launch claimed it meanwhile: this one was taken over), it still fences
    // this launch's failure out.
    if (!(await deps.store.releaseLaunch(id, token, previous).catch(() => false))) return false;
    delete rec.begun.launchFence;
    return true;
  };
  // The run job is sent right behind seed's receipt; should the receipt not be there (its script
  // failed, or was re-sent after a NOSCRIPT), retry while seed's own retry writes it; when the
  // attempts run out the rollout is masked as sandbox_lost.
  if (!seedReceipt) {
    await giveBack();
    throw FleetError.retryable("sandbox_lost", "run stage without a seed receipt (yet)");
  }
  // Held long enough for its lock to have lapsed (a slow or cut-off start): another worker may
  // have taken the run over, and may run its agent now. Before anything that could hurt that
  // launch (replacing an own sandbox, killing and resetting before a rerun) and again before
  // launching, look at the fence.
  const fence = async (): Promise<"run" | "lost" | "stop"> =>
    mayBeTakenOver(rec) ? deps.store.launchState(id, token) : "run";
  /** A stop (cancel, close) came for this rollout: read now, whatever the lock's age. */
  const stopped = async (): Promise<boolean> =>
    (await deps.store.launchState(id, token).catch(() => "run")) === "stop";
  /** What to return when the fence is no longer this launch's (undefined: go on). */
  const unlessOurs = async (): Promise<StageName | typeof SUPERSEDED | undefined> => {
    const state = await fence();
    if (state === "lost")
      deps.logger.warn({ rolloutId: id }, "the run was taken over by another worker; stopping");
    return state === "lost" ? SUPERSEDED : state === "stop" ? "close" : undefined;
  };

  let handle = seedReceipt.handle;
  let owned: SandboxEntry | null = null;
  let ownReleased = false;
  /**
   * A stop ended the run: its own sandbox is this launch's to destroy (rule 11), its agent
   * stopped. Close only hands an agent's sandbox to the janitor (the ledger), so it would stay up
   * and the result say teardown "pending" until the janitor's next pass; destroyed here, the
   * confirm forgets the ledger entry and marks the finalized result's teardown confirmed. A failed
   * destroy goes to the ledger, as close's hand-over did.
   */
  const releaseOwnAtStop = async (): Promise<void> => {
    if (!owned?.handle || ownReleased) return;
    ownReleased = true;
    // Only while no later launch claimed the run: a stop reads before a lost fence, and the
    // later launch may have replaced this sandbox under its name, or adopted it (its own now).
    const last = await deps.store.get(id).then(
      (r) => r?.launches === launches,
      () => false,
    );
    if (!last) return;
    await destroyOrLedger(deps, owned).catch((err: unknown) =>
      deps.logger.warn(
        { rolloutId: id, err: err instanceof Error ? err.message : String(err) },
        "could not destroy the run's own sandbox at its stop; the janitor removes it",
      ),
    );
  };
  let task: TaskContent;
  /** Why a run starting now cannot be graded whatever its agent does (`runBudgetShortfall`), or null. */
  const shortfallNow = () =>
    runBudgetShortfall({
      task,
      agent: rec.meta.agent,
      at: clock(deps),
      rolloutDeadlineMs: rec.meta.deadlineAt,
    });
  try {
    task = await loadTask(rec, deps);
    const notOurs = await unlessOurs();
    if (notOurs !== undefined) return notOurs;
    // DESIGN §2 rule 6: a run the rollout's deadline would cut before its agent's own timeout and
    // the verification is masked now, before its agent can make the mask depend on its speed.
    const short = shortfallNow();
    if (short) throw FleetError.nonRetryable("deadline_exceeded", short);
    if (rec.meta.agent.sandbox === "own") {
      // An earlier attempt's own sandbox is never reused: it may have failed between create and
      // staging (a probe that timed out), and an agent run in an unstaged workspace would be graded.
      // The sandbox found may be the own sandbox of a launch that took this run over since the
      // look at the fence above (its agent running there): looked at again right before replacing.
      const taken: { notOurs?: StageName | typeof SUPERSEDED } = {};
      // Its calls before the create (an earlier attempt's own sandbox: find, alive, the
      // replacing destroy) take no signal: not waited for past the worker's shutdown either.
      const created = await unlessShutDown(
        createSandbox(rec, deps, "agent", task, {
          replace: true,
          mayReplace: async () => {
            const notOurs = await unlessOurs();
            if (notOurs !== undefined) taken.notOurs = notOurs;
            return notOurs === undefined;
          },
          // Stopped at the worker's shutdown, as the seed's is (a create the daemon is slow to
          // answer would hold the job past the shutdown budget, and its lock lapse: a stall), and
          // the job handed back with its claim (the catch below gives it back): nothing launched.
          // The intent recorded before the create stays, for the next delivery's replace.
          signal: shutdown,
        }).catch((err: unknown) => {
          if (shutdown?.aborted && !(isFleetError(err) && !err.retryable)) throw new HandBackError();
          throw err;
        }),
        shutdown,
      );
      if (taken.notOurs !== undefined) return taken.notOurs;
      if (!created) return "close";
      // Taken over while it made the sandbox (paused past its lock between the look at the fence
      // and the create): the sandbox may be the later launch's own, adopted by its name, with
      // that launch's agent at work in it. Neither probed, staged nor destroyed by this attempt.
      if (mayBeTakenOver(rec)) {
        const notOurs = await unlessOurs();
        // Stopped (a cancel while it made the sandbox, an image pull, say): the sandbox is this
        // launch's, destroyed as at any stop, unless a later launch claimed the run meanwhile
        // (`releaseOwnAtStop` looks: a stop reads before a lost fence).
        if (notOurs === "close") {
          owned = created.entry;
          await releaseOwnAtStop();
        }
        if (notOurs !== undefined) return notOurs;
      }
      handle = created.handle;
      owned = created.entry;
      // Isolation is proven before anything is staged or run in it (DESIGN §5), as the seed did
      // for the task's sandbox: a refusal is final, a probe that could not run is retried.
      // Not held past the worker's shutdown (the provider's calls take no signal): handed back
      // with its claim, as at a stopped create; the sandbox, its handle attached, is the next
      // delivery's to replace.
      await unlessShutDown(
        (async () => {
          await probeIsolated(deps, created.handle);
          if (!created.reused) await stageWorkspace(deps.provider, created.handle, task);
        })(),
        shutdown,
      );
    }
    // A rerun in the task's sandbox kills what the earlier launch left and resets the sandbox; an
    // own sandbox was just made afresh (the earlier one, and all in it, destroyed by the replace).
    if (previous !== "" && rec.meta.agent.sandbox !== "own") {
      const stillOurs = await unlessOurs();
      if (stillOurs !== undefined) return stillOurs;
      // Re-delivered (a worker died mid-run): whatever it started must be gone before we start again.
      const leftover = await deps.provider.killProcesses(handle, AGENT_USER);
      if (!leftover.confirmed)
        throw FleetError.retryable("sandbox_lost", "could not stop a previous attempt's processes");
      // ...and the run starts from the task's start, not from what the interrupted one left. (An
      // owned sandbox comes from the same image and options, so the seed's probe speaks for its start.)
      await resetForRerun(deps, handle, task, seedReceipt.probe);
    }
  } catch (err) {
    // Failed before its harness started: this claim launched nothing, so give the fence back,
    // or the next attempt would take itself for a rerun after an agent ran (and mask the rollout
    // where the sandbox cannot be put back). A worker that dies here leaves the claim: then the
    // next attempt resets the sandbox, which is only cautious.
    // Only a first claim goes back. A claim that took over an earlier launch keeps the fence:
    // handing it back would make that launch (perhaps only cut off, and already killed by this
    // attempt) the fence's holder again, free to store its interrupted run.
    await giveBack();
    if (isHandBack(err)) throw err;
    // An own sandbox made for this launch (its probe refused it, staging failed) is this stage's
    // to destroy (rule 11), as at the deadline check below: close only hands an agent's sandbox to
    // the janitor, so it would stay up and the result say teardown "pending" until the janitor's
    // next pass. A retry makes a fresh one anyway. A failed destroy goes to the ledger.
    if (owned) {
      // One that died under its probe or staging (killed from outside, its daemon's doing) fails
      // in ways that read as final or as the task's (a staging step's exit 126 is `invalid_task`):
      // the sandbox's, and no agent ran there yet, so retried in a fresh one, as the seed does.
      const fe = await lostBeforeAnAgent(deps, handle, err);
      await destroyOrLedger(deps, owned).catch(() => undefined);
      throw fe;
    }
    throw err;
  }
  // Shutting down before the harness started: hand the job back with the claim, as nothing ran.
  if (shutdown?.aborted) {
    await giveBack();
    throw new HandBackError();
  }
  // Launching now, after a takeover, would run a second agent beside the new launch.
  const notOursAtLaunch = await unlessOurs();
  if (notOursAtLaunch === "close") await releaseOwnAtStop();
  if (notOursAtLaunch !== undefined) return notOursAtLaunch;
  // Again at launch: making, probing and staging an own sandbox, or resetting for a rerun, took
  // time the check before them did not count.
  const shortAtLaunch = shortfallNow();
  if (shortAtLaunch) {
    await giveBack();
    // Its own sandbox is this stage's to destroy (rule 11); a failure goes to the ledger.
    if (owned) await destroyOrLedger(deps, owned);
    throw FleetError.nonRetryable("deadline_exceeded", shortAtLaunch);
  }

  const make = deps.createHarness ?? defaultCreateHarness;
  // Requests the harness itself sent to the agent's model (a tool loop's): see `handBack`.
  let modelRequests = 0;
  const harness = make(rec.meta.agent, {
    ...deps.harnessDeps,
    onModelRequest: () => {
      modelRequests++;
    },
  });
  const startedAt = clock(deps);
  const deadlineFrom = (from: number) =>
    agentDeadline({ task, agent: rec.meta.agent, startedAt: from, rolloutDeadlineMs: rec.meta.deadlineAt });
  // The agent's deadline and which bound set it: from the run's start until the harness says the
  // agent starts (`agentStarts`, below), from then on after: the harness's setup and the model
  // gateway's opening are not the agent's time.
  let { deadlineMs, limitedBy } = deadlineFrom(startedAt);
  /** When the agent itself started (`agentStarts`): the run receipt's `startedAt` (`timings.agentMs`). */
  let agentStartedAt = startedAt;
  // A command agent with a model reaches it only through this rollout's gateway (issue 5).
  let access: ModelAccess | null = null;
  let gatewayUsage: Usage | null = null;
  let upstream: UpstreamHealth | null = null;
  // Once, and awaited by every caller: a stop's `closeWithSpend` (returned, not awaited, from
  // inside the try below) may still be finishing when the `finally` counts the spend.
  let finishing: Promise<void> | undefined;
  const finishAccess = (): Promise<void> =>
    (finishing ??= (async () => {
      const open = access;
      access = null;
      if (open) ({ usage: gatewayUsage, health: upstream } = await open.finish());
    })());
  let outcome: Awaited<ReturnType<typeof harness.run>>;
  // What the harness reported spending (its outcome's usage, or the usage its error carries):
  // counted once, whatever the run's end (`countSpent`), the gateway's count first.
  let harnessUsage: Usage | null = null;
  let counted = false;
  const countSpent = (): Usage | null => {
    const spent = (gatewayUsage as Usage | null) ?? harnessUsage;
    if (!counted) countTokens(deps, spent);
    counted = true;
    return spent;
  };
  // The earlier launches of a rerun spent too (what their failures recorded is in the failure
  // log; a launch whose worker died recorded nothing): a gap, never a silent undercount.
  const withRerunGap = (usage: Usage | null): Usage | null =>
    usage !== null && launches > 1
      ? {
          ...usage,
          gaps: [
            ...usage.gaps,
            `${launches - 1} earlier launch(es) of this rollout not counted here (see failures[].usage for what was recorded)`,
          ],
        }
      : usage;
  /**
   * What this launch's agent spent (`spent`), kept for the rollout's result when no run receipt
   * will carry it (see `saveStoppedRunUsage`). Not stored (Redis unreachable): said, and counted
   * in the metrics as every spend is.
   */
  const keepUsage = async (spent: Usage | null): Promise<void> => {
    if (spent === null) return;
    // Bounded: a Redis that does not answer (a shutdown's handback while it is away) must not
    // hold the stage past what it would have taken without this.
    await withTimeout(
      deps.store.saveStoppedRunUsage(id, spent, { token, launches }),
      KEEP_SPEND_TIMEOUT_MS,
      `Redis did not answer within ${KEEP_SPEND_TIMEOUT_MS} ms`,
    ).catch((err: unknown) =>
      deps.logger.warn(
        { rolloutId: id, err: err instanceof Error ? err.message : String(err) },
        "could not keep the run's model usage for its result; the result may say none",
      ),
    );
  };
  /** What this launch's agent spent, kept as above (a stop or a shutdown ended it). */
  const keepSpend = async (): Promise<void> => {
    await finishAccess().catch(() => undefined);
    await keepUsage(withRerunGap(countSpent()));
  };
  /** A stop ended this launch (a cancel's or the deadline's close reports the rollout). */
  const closeWithSpend = async (): Promise<"close"> => {
    await keepSpend();
    await releaseOwnAtStop();
    return "close";
  };
  /**
   * Handed back. When nothing of the agent ran, the claim goes back, as for a failure before
   * launch (below): kept, it would make the next delivery a rerun, whose reset an image with its
   * own /workspace files cannot have (masked `sandbox_lost`) for an agent that never touched the
   * sandbox. Nothing ran: no command of its started in the sandbox, its harness sent no request
   * to its model (a tool loop's first step: billed perhaps though it failed or was cut off, which
   * can leave no usage to tell), and it reports no spend. Otherwise (or when the claim cannot go
   * back: a rerun's, or one taken over), at a worker's shutdown, what the launch spent is kept as
   * a stopped run's is, for a cancel (or the deadline) that comes before the next delivery, whose
   * claim then finds the run stopped and launches nothing; a next launch's receipt or stop
   * replaces it, and says this launch's gap. Not when the fence went unanswered (Redis
   * unreachable, and the run perhaps another launch's now).
   */
  const handBack = async (reason: HandBackError): Promise<never> => {
    await finishAccess().catch(() => undefined);
    const spent = countSpent();
    const ranNothing = !watched.started() && modelRequests === 0 && isNoSpend(spent);
    if (!(ranNothing && (await giveBack())) && shutdown?.aborted) await keepUsage(withRerunGap(spent));
    throw reason;
  };
  let cleanup: CleanupReceipt;
  let contested = true;
  const abort = new AbortController();
  /** A kill sweep under way (a stop's, the deadline's, a shutdown's): awaited before the run ends. */
  let stopping: Promise<unknown> = Promise.resolve();
  // When the fence last answered that the run is this launch's (a monotonic clock; the look
  // above, right before launching, is the first). Once the job may have been handed to another
  // worker, a launch that cannot hear from Redis for half its lock cannot tell whether another
  // launch runs now: it starts nothing more of its agent (`watchExecs`' gate), and its stop poll
  // below stops waiting and hands the job back.
  let fenceAnsweredAt = performance.now();
  const pollMs = deps.stopPollMs ?? 1000;
  // Half the lock, and never under three polls (a lock shorter than that could not be confirmed).
  const confirmWithinMs = Math.max((rec.lock?.durationMs ?? DEFAULT_LOCK_MS) / 2, 3 * pollMs);
  /** How long since `since`, once the job may have been handed to another worker (else 0). */
  const silentFor = (since: number) => (mayBeTakenOver(rec) ? performance.now() - since : 0);
  /**
   * Stop the harness (once) for what the fence said: a stop (its processes killed, which makes
   * the exec in flight return), a launch another worker took over (nothing touched: it already
   * killed this launch's processes, and its own must not be), or no answer within
   * `confirmWithinMs` (handed back; nothing killed, as the processes may be another launch's).
   */
  const stopHarness = (why: "stop" | "lost" | "silent") => {
    if (abort.signal.aborted) return;
    if (why === "lost") abort.abort(new LostLaunchError());
    else if (why === "silent") {
      abort.abort(new HandBackError("the run's launch could not be confirmed; the job is handed back"));
    } else {
      abort.abort(FleetError.nonRetryable("cancelled", "stop requested while the agent ran"));
      stopping = deps.provider.killProcesses(handle, AGENT_USER).catch(() => undefined);
    }
  };
  const watched = watchExecs(deps.provider, async () => {
    // An agent's next step (a tool loop's exec) once this launch may no longer hold the run
    // would run beside the launch that took over, or its verify. Not heard from the fence for a
    // while (the model gateway's opening took long, the poll went unanswered): asked now.
    const refused = () =>
      new FleetError(
        "provider_unavailable",
        "this run's launch cannot be confirmed as the rollout's (stopped, taken over, or the fleet's Redis unreachable): nothing more of its agent is started",
        { retryable: true, nothingStarted: true },
      );
    if (abort.signal.aborted) throw refused();
    if (silentFor(fenceAnsweredAt) <= confirmWithinMs) return;
    const state = await withTimeout(deps.store.launchState(id, token), pollMs, "fence").catch(() => null);
    if (state === "run" && !abort.signal.aborted) {
      fenceAnsweredAt = performance.now();
      return;
    }
    // The harness stops as the poll would have stopped it (a stop's processes killed: an own
    // sandbox outlives the close until the janitor's pass), never a failure of the run's own.
    stopHarness(state === "stop" || state === "lost" ? state : "silent");
    throw refused();
  });
  try {
    if (needsModelAccess(rec.meta.agent)) access = await openModelAccess(deps, rec.meta.id, rec.meta.agent);
    // Worker shutdown: stop the harness now and hand the job back (the next attempt kills
    // whatever is left before it launches again).
    const onShutdown = () => {
      if (abort.signal.aborted) return;
      abort.abort(new HandBackError());
      // Handed back whether or not the stop is confirmed (the next delivery kills what is left,
      // and confirms it, before it launches again); said, as agent processes may outlive this one.
      const unconfirmed = (why: Record<string, unknown>) =>
        deps.logger.warn(
          { rolloutId: id, ...why },
          "handing the run back at shutdown with its agent's processes not confirmed stopped; its next delivery stops them before it launches",
        );
      stopping = deps.provider.killProcesses(handle, AGENT_USER).then(
        (receipt) => {
          if (!receipt.confirmed) unconfirmed({ remaining: receipt.remaining, detail: receipt.detail });
        },
        (err: unknown) => unconfirmed({ err: err instanceof Error ? err.message : String(err) }),
      );
    };
    if (shutdown?.aborted) onShutdown();
    shutdown?.addEventListener("abort", onShutdown, { once: true });
    const pollStartedAt = performance.now();
    const poll = setInterval(() => {
      if (!abort.signal.aborted && silentFor(Math.max(fenceAnsweredAt, pollStartedAt)) > confirmWithinMs) {
        // Not heard from Redis for half the job's lock, which may have lapsed: another worker may
        // run this rollout's agent now. Stop waiting and hand the job back, killing nothing (the
        // processes may be the other launch's); whichever launch runs next stops what this one
        // left before it starts, and this one's next steps are refused (`watchExecs`' gate).
        deps.logger.warn(
          { rolloutId: id, silentMs: Math.round(performance.now() - fenceAnsweredAt) },
          "the run's fence has not answered for half the job's lock; stopping the harness and handing the job back",
        );
        stopHarness("silent");
        return;
      }
      deps.store.launchState(id, token).then(
        (state) => {
          if (state === "run") fenceAnsweredAt = performance.now();
          else stopHarness(state);
        },
        () => undefined,
      );
    }, pollMs);
    // The agent's deadline, enforced from here too: the `timeout` that ends its command runs as
    // the agent's user, which can stop it (SIGSTOP) and work on until the provider's own timer,
    // seconds later, and be graded on that. Once the agent's deadline (from when the harness says
    // it starts: its setup is not the agent's time, and runs as the agent's user too) and the kill
    // grace are past, its processes are killed (all of them: its time is over). Its command then
    // ends killed past its deadline, which the provider reports as a timeout (`-1`), as when its
    // `timeout` fires; one that ended by itself keeps its own exit.
    let deadlineSweep: NodeJS.Timeout | undefined;
    const armDeadlineSweep = () => {
      clearTimeout(deadlineSweep);
      const at = localTime(deps, deadlineMs) + KILL_GRACE_S * 1000 + DEADLINE_SWEEP_AFTER_MS;
      deadlineSweep = setTimeout(
        () => {
          if (abort.signal.aborted) return;
          stopping = deps.provider.killProcesses(handle, AGENT_USER).catch(() => undefined);
        },
        Math.max(0, at - Date.now()),
      );
    };
    try {
      outcome = await harness.run({
        provider: watched.provider,
        handle,
        task,
        agent: rec.meta.agent,
        // The harness counts down on this host's clock.
        deadlineMs: localTime(deps, deadlineMs),
        agentStarts: () => {
          const now = clock(deps);
          // The setup took so long that the agent's own budget, the tests' and the margin no
          // longer fit before the rollout's deadline (the agent would end later by the setup's
          // time): masked before the agent starts, as a run whose budget does not fit at launch
          // is (started, it would be graded when quick and masked when slow).
          const short = shortfallNow();
          if (short !== null) {
            throw FleetError.nonRetryable(
              "deadline_exceeded",
              `preparing the agent's run took ${Math.round(now - startedAt)} ms: ${short}`,
            );
          }
          ({ deadlineMs, limitedBy } = deadlineFrom(now));
          agentStartedAt = now;
          armDeadlineSweep();
          return localTime(deps, deadlineMs);
        },
        signal: abort.signal,
        env: access?.env,
      });
      harnessUsage = outcome.usage;
      // A deadline sweep under way ends before the run's own stop below.
      await stopping;
    } catch (err) {
      harnessUsage = usageOf(err);
      await stopping;
      if (abort.signal.aborted) {
        await stopping;
        if (abort.signal.reason instanceof HandBackError) return handBack(abort.signal.reason);
        if (abort.signal.reason instanceof LostLaunchError) return SUPERSEDED;
        return closeWithSpend();
      }
      // One read of the fence. Taken over while it ran (only possible once its lock may have
      // lapsed): the new launch may have replaced or reset the sandbox under this one; its error
      // is not this rollout's failure. Stopped (a cancel, whose close may have destroyed the
      // sandbox under the agent before the stop poll saw it): not the agent's failure, nor a
      // lost sandbox.
      const state = await deps.store.launchState(id, token).catch(() => "run");
      if (state === "lost" && mayBeTakenOver(rec)) return SUPERSEDED;
      if (state === "stop") return closeWithSpend();
      // The rollout's own deadline was the agent's limit and has passed (preparing the sandbox
      // took what was left, say): whatever failed, the rollout ran out of time.
      if (limitedBy === "rollout" && clock(deps) >= deadlineMs) {
        const why = err instanceof Error ? err.message : String(err);
        throw withUsage(
          FleetError.nonRetryable(
            "deadline_exceeded",
            capText(`the rollout's deadline passed during the agent's run (${why})`),
          ),
          harnessUsage,
        );
      }
      throw withUsage(await sandboxLostIfGone(deps, handle, err), harnessUsage);
    } finally {
      clearInterval(poll);
      clearTimeout(deadlineSweep);
      shutdown?.removeEventListener("abort", onShutdown);
    }
    // Told to stop, its harness returned of itself (one that does not watch the signal): as
    // above, never its outcome stored.
    if (abort.signal.aborted) {
      if (abort.signal.reason instanceof HandBackError) return handBack(abort.signal.reason);
      if (abort.signal.reason instanceof LostLaunchError) return SUPERSEDED;
      return closeWithSpend();
    }
    // The harness returned: before this launch stops anything or reports, make sure the run is
    // still its own. One that lost the fence (handed to another worker while this one was cut off
    // from Redis) must not kill the new launch's processes nor store an outcome over it. Only a
    // job held long enough for its lock to have lapsed can have been handed over.
    contested = mayBeTakenOver(rec);
    if (contested && (await deps.store.launchState(id, token)) === "lost") {
      deps.logger.warn(
        { rolloutId: id },
        "the run was taken over by another worker; dropping this launch's outcome",
      );
      return SUPERSEDED;
    }
    if (outcome.exec.timedOut && limitedBy === "rollout") {
      throw FleetError.nonRetryable("deadline_exceeded", "the rollout's deadline ended the agent's run");
    }
    // Stop the harness and confirm its processes are gone (DESIGN §2 rules 2, 10).
    try {
      cleanup = await deps.provider.killProcesses(handle, AGENT_USER);
    } catch (err) {
      if (isFleetError(err) && err.kind === "sandbox_lost" && (await stopped())) return closeWithSpend();
      throw err;
    }
    if (cleanup.alreadyGone || !(await deps.provider.alive(handle))) {
      // Destroyed by the close of a cancel (a stop): the close reports the rollout.
      if (await stopped()) return closeWithSpend();
      // The sandbox vanished under the agent: exit envelope -2, masked (rule 6).
      throw FleetError.nonRetryable("sandbox_lost", "the sandbox disappeared while the agent ran");
    }
    if (!cleanup.confirmed) {
      throw FleetError.nonRetryable(
        "sandbox_lost",
        `agent processes could not be confirmed stopped (${cleanup.remaining} left)`,
      );
    }
    // The agent is confirmed stopped: revoke its token and keep the usage the gateway saw.
    await finishAccess();
  } catch (err) {
    // Failed before any exec of the agent's could have started (the daemon went away before its
    // command was created; the model gateway did not open): nothing of the agent ran, so the
    // claim goes back as above, and the next attempt is a first launch with no sandbox reset,
    // which an image with its own /workspace files could not have had (masked `sandbox_lost`).
    // So too for a harness that returned without an exec (a model's answer alone, then a failed
    // stop): it changed nothing in the sandbox. (Its launch is then not counted in `attempts`.)
    if (!watched.started()) await giveBack();
    // What the agent's calls through the gateway spent goes with the failure (a masked run
    // still reports its cost); a harness's own error may carry its usage already.
    await finishAccess().catch(() => undefined);
    const spent = countSpent();
    const usage = withRerunGap(usageOf(err) ?? spent);
    // Kept for the result too, as a stopped run's is: a failure with a retry due goes to the
    // failure log only, so a cancel or the deadline before the next launch (whose close reports
    // the rollout) would say no usage where this launch, the last, spent. A next launch claims
    // the run, and the kept usage is then not the last launch's (`fleetFinalize`); nor is one
    // given back above, whose number the next launch takes (refused: `saveStoppedRunUsage`).
    // Not for a handback: kept at a shutdown's, and one whose fence went unanswered may no
    // longer be the rollout's.
    if (!isHandBack(err)) await keepUsage(usage);
    throw withUsage(err, usage, true);
  } finally {
    // Stopped or taken over mid-run (no receipt, no failure of its own): counted all the same.
    await finishAccess().catch(() => undefined);
    countSpent();
  }
  // An agent that did not finish cleanly while its model upstream was failing (its last call
  // through the gateway an outage, a 5xx, a 429, the operator's key refused) failed for the
  // infrastructure, not on its own: masked, never a zero (rule 6). One that exited 0 all the same
  // (many agent CLIs do after API errors) is graded, and masked at verify unless its work earns a
  // full reward. One whose last call was answered is graded as usual.
  const lastFailure = (upstream as UpstreamHealth | null)?.lastInfraFailure ?? null;
  const usage = withRerunGap(countSpent());
  // A call the gateway never sent: the spec's endpoint resolved to a link-local address.
  const refused = (upstream as UpstreamHealth | null)?.refusedEndpoint ?? null;
  if (refused !== null) throw new FleetError("agent_error", refused, { retryable: false, usage });
  let upstreamFailing: string | null = null;
  if (lastFailure !== null) {
    const { answered, infraFailures } = upstream as unknown as UpstreamHealth;
    upstreamFailing = `the model upstream was failing when the agent stopped (${infraFailures} failed call(s), ${answered} answered; last: ${capText(lastFailure, 300)})`;
    if (outcome.exec.exitCode !== 0 || outcome.exec.timedOut) {
      throw new FleetError("provider_unavailable", upstreamFailing, { retryable: false, usage });
    }
  }
  let ownedSandbox: RunReceipt["ownedSandbox"] = null;
  if (owned?.handle) {
    // DESIGN §2 rule 11: the owner destroys its own sandbox; a failure goes to the ledger.
    ownReleased = true;
    const released = await destroyOrLedger(deps, owned);
    ownedSandbox = {
      handle: owned.handle,
      released: released.receipt ?? {
        confirmed: false,
        scope: "sandbox",
        at: clock(deps),
        alreadyGone: false,
        remaining: 0,
      },
    };
  }
  const stoppedAt = clock(deps);
  const receipt: RunReceipt = {
    exec: outcome.exec,
    answer: outcome.answer,
    ...(outcome.answerTruncated ? { answerTruncated: true } : {}),
    transcript: outcome.transcript,
    usage,
    cleanup,
    ownedSandbox,
    startedAt: agentStartedAt,
    stoppedAt,
    attempts: launches,
    upstreamFailing,
    at: stoppedAt,
  };
  // Stored only while this launch holds the fence. A launch that cannot have been taken over
  // sends verify's job with the receipt (one round trip; a verify after a stop skips). Otherwise
  // verify is enqueued only for a stored receipt: a launch that lost the fence must not wake a
  // verify that would find no run receipt and spend its attempts before the new launch ends.
  // Decided again now: the kill sweep and an owned sandbox's release may have taken long enough
  // for the job's lock to lapse since the check above.
  // Not stored there (a stop came after the harness returned, while this launch stopped its
  // agent and released its sandbox): as below, the close reports the rollout, with the spend.
  if (!contested && !mayBeTakenOver(rec)) {
    const stored = await deps.store.saveReceipt(rec.meta, "run", receipt, "ran", stoppedAt, {
      fence: token,
      next: { queues: deps.queues, stage: "verify" },
    });
    if (stored || !(await stopped())) return null;
    return closeWithSpend();
  }
  const saved = await deps.store.saveReceipt(rec.meta, "run", receipt, "ran", stoppedAt, { fence: token });
  if (saved) return "verify";
  // Not stored: a stop won (close must run, whoever else may have enqueued it; a repeat is a
  // no-op), or another launch took the fence, which is then the run's to finish.
  return (await deps.store.launchState(id, token)) === "lost" ? SUPERSEDED : closeWithSpend();
};

/** A usage that says nothing was spent: none, or no call, token or gap. */
function isNoSpend(usage: Usage | null): boolean {
  return (
    usage === null ||
    (usage.calls === 0 &&
      !usage.promptTokens &&
      !usage.completionTokens &&
      !usage.cachedTokens &&
      usage.gaps.length === 0)
  );
}

/**
 * `provider`, counting the execs that may have started something: every exec from its call on,
 * less those that failed with `nothingStarted`. (Counted at the call: one still under way may
 * have started its command.) `gate` runs before each exec and refuses one by throwing.
 */
function watchExecs(
  provider: SandboxProvider,
  gate: () => Promise<void> = async () => undefined,
): { provider: SandboxProvider; started(): boolean } {
  let execs = 0;
  const exec: SandboxProvider["exec"] = async (handle, argv, options) => {
    // Refused before it is counted: nothing of it started.
    await gate();
    execs++;
    try {
      return await provider.exec(handle, argv, options);
    } catch (err) {
      if (isFleetError(err) && err.nothingStarted === true) execs--;
      throw err;
    }
  };
  const watched = new Proxy(provider, {
    get(target, prop) {
      if (prop === "exec") return exec;
      const value: unknown = Reflect.get(target, prop, target);
      return typeof value === "function" ? value.bind(target) : value;
    },
  });
  return { provider: watched, started: () => execs > 0 };
}

/** The run's fence went to another launch (see `RolloutStore.launchState`). */
class LostLaunchError extends Error {
  override readonly name = "LostLaunchError";
}

/** Past an earlier attempt's tests budget: staging before them, the in-sandbox `timeout -k 2`. */
const EARLIER_TESTS_GRACE_MS = 15_000;

/**
 * A verify delivered again (its worker died, or its exec broke) may find the earlier attempt's
 * tests still running in the sandbox as root: a Docker exec outlives its client. Staging new
 * tests and clearing /logs/verifier under them could mix the two runs' rewards. None when no
 * attempt got that far, or its staging failed (which clears its note): a retry starts at once
 * (once it has fenced the sandbox: the last case below).
 * - The earlier attempt left the sandbox (`leaveVerifyWork`: its exec broke, say, and it gave the
 *   job back): its code starts nothing there any more, so this attempt, holding the verify fence,
 *   stops what of its tests still runs (`stopLeftTests`) and starts at once once none is left.
 * - It did not (its worker died, or it may be paused past its lock and still start them): this
 *   attempt raises the sandbox's verify fence to its epoch as it stops them (the same sweep), so
 *   that the earlier attempt's runner, started later, refuses to start anything
 *   (`TestsSupersededError`); fenced and stopped, it starts at once.
 * - Else (the sandbox has no fence, or that stop could not confirm): the earlier tests end by
 *   their own budget (the in-sandbox `timeout` kills
 *   their process group): wait that out, counted from when an earlier attempt last began work in
 *   the sandbox (noted before it staged its tests and again just before it started them, so a
 *   worker that died after noting may not have started anything: waited for all the same; `begin`
 *   returns it). A wait that would pass the rollout's deadline is its end (masked); a shutdown
 *   hands the job back.
 * - No note, or one past its tests' budget, and an earlier attempt began all the same (this
 *   attempt's epoch is not the first): nothing of its tests is known to run, but it may yet start
 *   some: one paused for longer than the budget between its note and its exec, or one handed back
 *   whose exec was still queued in its client when its own sweep ended. This attempt fences the
 *   sandbox against it (and stops whatever it started) before it stages anything; a sandbox
 *   without the fence starts at once, as it always did.
 * Returns `start`, or why not: `superseded` (a later attempt began) or `terminal` (the rollout
 * ended meanwhile: close reports it). A sweep that found the sandbox fenced past this attempt's
 * epoch throws `TestsSupersededError` (the caller's `fencedOut` tells why).
 */
async function waitOutEarlierTests(
  rec: StageRecord,
  deps: PipelineDeps,
  task: TaskContent,
  handle: SandboxHandle,
  token: string,
  shutdown?: AbortSignal,
): Promise<"start" | "superseded" | "terminal"> {
  if (task.verifier.kind !== "tests") return "start";
  let earlier = rec.times["verify:prev"];
  let left = rec.begun.earlierVerifyLeft;
  if (rec.begun.testsSweepLeftMs > 0) {
    await waitOutSweep(rec, deps, shutdown);
    // A sweep that confirmed the earlier tests stopped took their note with it, and the attempt
    // that swept left the sandbox after it: read both again.
    const note = await deps.store.verifyNote(rec.meta.id).catch(() => ({ at: earlier, left }));
    earlier = note?.at;
    left = note?.left ?? false;
  }
  let now = clock(deps);
  let until = earlier === undefined ? now : earlier + task.timeouts.verifierS * 1000 + EARLIER_TESTS_GRACE_MS;
  let awaiting = "the earlier attempt's tests";
  if (until <= now) {
    // Nothing of an earlier attempt's tests to wait out (no note, or past its budget).
    const epoch = rec.begun.verifyEpoch;
    if (epoch === null || epoch <= 1) return "start";
    const fenced = await stopLeftTests(rec, deps, handle, token, null, epoch, "unnoted");
    if (fenced === "superseded" || fenced === "terminal") return fenced;
    if (fenced !== "unanswered") return "start";
    // A sweep with no answer may yet land, and kill this attempt's tests: start nothing before
    // its claim lapses.
    now = clock(deps);
    until = now + SWEEP_CLAIM_MS;
    awaiting = UNANSWERED_SWEEP;
  } else {
    // Left, or not (its worker died, or it is paused past its lock and may yet start them) where
    // this attempt has an epoch to raise the sandbox's verify fence to and that attempt honours
    // the fence (not one of an older release): stop them and start at once.
    const epoch = rec.begun.earlierVerifyFenceAware ? rec.begun.verifyEpoch : null;
    if (left || epoch !== null) {
      const stopped = await stopLeftTests(
        rec,
        deps,
        handle,
        token,
        earlier ?? null,
        left ? null : epoch,
        "noted",
      );
      if (stopped === "stopped") return "start";
      if (stopped === "superseded" || stopped === "terminal") return stopped;
      // A sweep with no answer may yet land: nothing of this attempt's starts before its claim
      // lapses (nor before the earlier tests' budget ends).
      now = clock(deps);
      if (stopped === "unanswered" && now + SWEEP_CLAIM_MS > until) {
        until = now + SWEEP_CLAIM_MS;
        awaiting = UNANSWERED_SWEEP;
      }
    }
  }
  if (until >= rec.meta.deadlineAt) {
    throw FleetError.nonRetryable(
      "deadline_exceeded",
      `a verify delivered again could not wait out ${awaiting} before the rollout's deadline`,
    );
  }
  if (until - now > DEFER_ABOVE_MS) {
    // Not asleep in one of the worker's slots for it (a tests' budget can be half an hour, and a
    // verifier that died had as many rollouts verifying as its concurrency): back to the queue
    // until then, no attempt spent. Taken again then, it begins anew and finds the wait over.
    throw new DeferralError(until, `verify delivered again: waiting out ${awaiting} before starting`);
  }
  deps.logger.info(
    { rolloutId: rec.meta.id, waitMs: until - now },
    `verify delivered again: waiting out ${awaiting} before starting`,
  );
  try {
    await sleep(until - now, undefined, { signal: shutdown });
  } catch {
    throw new HandBackError();
  }
  return "start";
}

/** What a verify waits out after its own sweep had no answer (it could yet land, and kill its tests). */
const UNANSWERED_SWEEP =
  "the claim on its own sweep, which had no answer (it could yet land and kill its tests)";

/** A verify's wait for an earlier attempt's tests longer than this hands its job back until then. */
const DEFER_ABOVE_MS = 2_000;

/**
 * The earlier attempt left the sandbox (`earlierVerifyLeft`), or it did not and this attempt
 * fences the sandbox against it first (`fenceEpoch`: the sweep raises the sandbox's verify fence
 * before it kills; `resisted` when it could not): what of its tests still runs there (every root
 * process: see `stopOwnTests`) is nobody's, and this attempt, holding the verify fence, stops it, as a handed-back attempt stops its own: under a claim on the sweep taken while
 * its token holds the fence (`claimTestsSweep`), so that an attempt beginning meanwhile waits for
 * the sweep's end (the claim's) before it starts anything, and one that began since (this one
 * paused) is not swept under. The outcome:
 * - `stopped`: none is left; the claim ended with the earlier note (start at once);
 * - `resisted`: the sweep counted processes it could not stop, or could not fence the sandbox;
 *   the claim ended (wait them out; `unnoted`: start all the same, as before the fence);
 * - `unanswered`: the sweep failed or had no answer and may yet land; the claim lapses by itself
 *   (start nothing before it has);
 * - `superseded` / `terminal`: no claim (a later attempt began; the rollout ended): no sweep.
 * A daemon still down is the provider's error (retried; the claim lapses, the note is kept). A
 * sweep that found the sandbox fenced past `fenceEpoch` (a later attempt's, raised while this
 * sweep was on its way) stopped there: `TestsSupersededError` is thrown (its claim ended).
 */
async function stopLeftTests(
  rec: StageRecord,
  deps: PipelineDeps,
  handle: SandboxHandle,
  token: string,
  notedAt: number | null,
  fenceEpoch: number | null,
  /** `noted`: the earlier tests' budget is not over (what resists is waited out); `unnoted`: it is, or there was no note (this attempt starts all the same). */
  earlier: "noted" | "unnoted",
): Promise<"stopped" | "resisted" | "unanswered" | "superseded" | "terminal"> {
  const id = rec.meta.id;
  const then =
    earlier === "noted"
      ? "waiting them out"
      : "starting all the same (no budget of theirs is left to wait out)";
  const fence = fenceEpoch === null ? {} : { fenceEpoch };
  const swept = await sweepTestsUnderClaim(deps, handle, id, token, notedAt, fence).catch((err: unknown) => {
    throw FleetError.retryable(
      "provider_unavailable",
      `could not claim the sweep of the tests an earlier verify left: ${err instanceof Error ? err.message : String(err)}`,
      err,
    );
  });
  if (!swept.claimed) return swept.why;
  const { stopped } = swept;
  if (!("confirmed" in stopped)) {
    const err = stopped.error;
    if (isFleetError(err) && (err.kind === "provider_unavailable" || err.kind === "sandbox_lost")) throw err;
    // The sandbox is fenced past this attempt's epoch (`fencedOut` tells why).
    if (err instanceof TestsSupersededError) throw err;
    deps.logger.warn(
      { rolloutId: id, err: err instanceof Error ? err.message : String(err) },
      "verify delivered again: the sweep of the tests the earlier attempt left had no answer; starting nothing before its claim lapses",
    );
    return "unanswered";
  }
  if (!stopped.confirmed) {
    const resisted = stopped.remaining > 0;
    deps.logger.warn(
      { rolloutId: id, remaining: stopped.remaining, detail: stopped.detail },
      resisted
        ? `verify delivered again: the tests the earlier attempt left did not stop; ${then}`
        : "verify delivered again: the sweep of the earlier attempt's tests did not report; starting nothing before its claim lapses",
    );
    return resisted ? "resisted" : "unanswered";
  }
  if (!fenceHolds(stopped, fenceEpoch)) {
    // Stopped, but the earlier attempt may still start them (the sandbox has no fence: made
    // before it had one, or on a provider without): a note stands, and is waited out; with none
    // within its budget, this attempt starts as it did before the fence (said at info: every
    // verify delivered again to such a sandbox comes here).
    const log = earlier === "noted" ? deps.logger.warn : deps.logger.info;
    log.call(
      deps.logger,
      { rolloutId: id, detail: stopped.detail },
      `verify delivered again: could not fence the sandbox against the earlier attempt; ${then}`,
    );
    return "resisted";
  }
  deps.logger.info(
    { rolloutId: id, ...(fenceEpoch !== null ? { fence: fenceEpoch } : {}) },
    earlier === "unnoted"
      ? "verify delivered again: fenced the sandbox against earlier attempts (no tests of theirs noted within their budget); starting at once"
      : fenceEpoch !== null
        ? "verify delivered again: fenced the sandbox against the earlier attempt and stopped its tests; starting at once"
        : "verify delivered again: stopped the tests the earlier attempt left behind; starting at once",
  );
  return "stopped";
}

/**
 * The sweep of a verify's tests in the sandbox (every root process), as both a handed-back
 * attempt (`stopOwnTests`) and one that finds tests an earlier attempt left (`stopLeftTests`) run
 * it: under a claim taken while `token` holds the verify fence (`claimTestsSweep`; not claimed:
 * superseded or terminal, no sweep), each step bounded (a shutdown has seconds). The claim ends
 * only once the sweep is known to have: it confirmed (the note at `notedAt` goes too: nothing to
 * wait out; when asked to raise the sandbox's verify fence to `fenceEpoch` first, only if it
 * did), or counted what is left. Given up on, or failed as it started (it may have started
 * all the same), its claim lapses, and `stopped` holds the error; one that stopped at a fence
 * above its epoch (`TestsSupersededError`) is over, and its claim ends. A claim that fails throws.
 */
async function sweepTestsUnderClaim(
  deps: PipelineDeps,
  handle: SandboxHandle,
  id: string,
  token: string,
  notedAt: number | null,
  /** Raise the fence to `fenceEpoch` first, or only stop at one above `refuseAbove` (`KillOptions`). */
  fence: Pick<KillOptions, "fenceEpoch" | "refuseAbove"> = {},
): Promise<
  | { claimed: false; why: "superseded" | "terminal" }
  | { claimed: true; stopped: CleanupReceipt | { error: unknown } }
> {
  const claimed = await withTimeout(
    deps.store.claimTestsSweep(id, token, SWEEP_CLAIM_MS),
    STOP_TESTS_MS,
    `no answer within ${STOP_TESTS_MS} ms`,
  );
  if (!claimed.claimed) return claimed;
  let stopped: CleanupReceipt;
  try {
    // With a fence to raise first, that exec's bound and its kill grace on top (FENCE_EXEC_MS).
    const bound = 2 * STOP_TESTS_MS + (fence.fenceEpoch !== undefined ? 2 * FENCE_EXEC_MS : 0);
    stopped = await withTimeout(
      deps.provider.killProcesses(handle, ROOT_USER, { quickMs: STOP_TESTS_MS, ...fence }),
      bound,
      `the sweep had no answer within ${bound} ms`,
    );
  } catch (error) {
    // Found the sandbox fenced past its epoch: the sweep stopped there, and is over.
    if (error instanceof TestsSupersededError) await endSweep(deps, id, claimed.claim, null);
    return { claimed: true, stopped: { error } };
  }
  if (stopped.confirmed || stopped.remaining > 0) {
    // The note goes with a confirmed sweep, unless it was to fence the sandbox and could not:
    // the attempt that noted may still start its tests then.
    const settled = stopped.confirmed && fenceHolds(stopped, fence.fenceEpoch ?? null);
    await endSweep(deps, id, claimed.claim, settled ? notedAt : null);
  }
  return { claimed: true, stopped };
}

/** `store.endTestsSweep`, bounded and best effort: a claim not ended lapses. */
async function endSweep(
  deps: PipelineDeps,
  id: string,
  claim: string,
  notedAt: number | null,
): Promise<void> {
  await withTimeout(deps.store.endTestsSweep(id, claim, notedAt), STOP_TESTS_MS, "no answer").catch(
    (err: unknown) =>
      deps.logger.warn(
        { rolloutId: id, detail: err instanceof Error ? err.message : String(err) },
        "could not end the claim on a verify's sweep; it lapses",
      ),
  );
}

/**
 * Whether a sweep asked to raise the sandbox's verify fence to `fenceEpoch` (null: not asked)
 * left it raised, or found the sandbox gone (nothing of it can start).
 */
function fenceHolds(stopped: CleanupReceipt, fenceEpoch: number | null): boolean {
  return fenceEpoch === null || stopped.fenced === true || stopped.alreadyGone;
}

/** How often a verify waiting for a handed-back attempt's sweep asks whether it ended. */
const SWEEP_POLL_MS = 250;

/**
 * An earlier attempt handed back at shutdown may be sweeping its tests (every root process:
 * `stopOwnTests`): nothing of this attempt's may run in the sandbox before its claim ends (the
 * sweep ended) or lapses. Its time left is Redis's, counted here on this process's monotonic
 * clock. Past the rollout's deadline it is the end (masked); a shutdown hands the job back.
 */
async function waitOutSweep(rec: StageRecord, deps: PipelineDeps, shutdown?: AbortSignal): Promise<void> {
  const lapses = performance.now() + rec.begun.testsSweepLeftMs;
  deps.logger.info(
    { rolloutId: rec.meta.id, atMostMs: rec.begun.testsSweepLeftMs },
    "verify delivered again: waiting for the earlier attempt's sweep of its tests to end",
  );
  try {
    for (;;) {
      const left = lapses - performance.now();
      if (left <= 0) return;
      if (clock(deps) >= rec.meta.deadlineAt) {
        throw FleetError.nonRetryable(
          "deadline_exceeded",
          "a verify delivered again could not start before the rollout's deadline: an earlier attempt was still sweeping its tests",
        );
      }
      await sleep(Math.min(SWEEP_POLL_MS, left), undefined, { signal: shutdown });
      // A Redis blip, or no answer in time: not ended, as far as this attempt can tell.
      const claimLeft = await withTimeout(
        deps.store.testsSweepLeftMs(rec.meta.id),
        4 * SWEEP_POLL_MS,
        "no answer",
      ).catch(() => 1);
      if (claimLeft === 0) return;
    }
  } catch (err) {
    if (shutdown?.aborted) throw new HandBackError();
    throw err;
  }
}

/** The bound of the sweep that stops a handed-back verify's tests (see `stopOwnTests`). */
const STOP_TESTS_MS = 5_000;
/**
 * The claim on the sweep of a handed-back verify's tests, from when it lands in Redis: the sweep
 * is given up here after `2 × STOP_TESTS_MS`, and its exec ends in the sandbox `STOP_TESTS_MS`
 * + the `timeout -k` grace after it starts; the rest is slack for an exec that starts late. A
 * claim ended by its sweep frees the next attempt at once; one given up on holds it this long.
 */
const SWEEP_CLAIM_MS = 30_000;

/**
 * A verify handed back at shutdown stops its tests (every root process in the sandbox: the
 * tests run as root, the keepalive as nobody, and the agent's processes were confirmed gone
 * before verify) and, once none is left, clears its note of work in the sandbox (`notedAt`), so
 * the next attempt has no tests to wait out. Only under a claim taken while this attempt holds
 * the verify fence, atomically with that check (`claimTestsSweep`): a later attempt's tests are
 * not its to stop, and one that begins during the sweep waits for its end; a sweep that lands
 * late, after its claim lapsed and a later attempt fenced the sandbox, stops at that fence
 * (`KillOptions.refuseAbove`: its own epoch). Best effort: whatever fails leaves the note, and
 * the next attempt waits as before.
 */
async function stopOwnTests(
  deps: PipelineDeps,
  handle: SandboxHandle,
  id: string,
  token: string,
  notedAt: number | null,
  epoch: number | null,
): Promise<void> {
  const warn = (detail: string, msg: string) => deps.logger.warn({ rolloutId: id, detail }, msg);
  const reason = (err: unknown) => (err instanceof Error ? err.message : String(err));
  try {
    // Its own epoch: a sweep that lands late, once a later attempt fenced the sandbox, stops
    // there (the tests it finds then are that attempt's).
    const refuse = epoch === null ? {} : { refuseAbove: epoch };
    const swept = await sweepTestsUnderClaim(deps, handle, id, token, notedAt, refuse);
    if (!swept.claimed) return;
    const { stopped } = swept;
    if (!("confirmed" in stopped)) {
      if (!(stopped.error instanceof TestsSupersededError)) throw stopped.error;
      deps.logger.info(
        { rolloutId: id, fence: stopped.error.fence },
        "handing back a verify whose sweep found the sandbox fenced by a later attempt: the tests there are that attempt's",
      );
    } else if (!stopped.confirmed) {
      warn(
        stopped.detail ?? "",
        "handing back a verify whose tests did not stop; the next attempt waits them out",
      );
    }
  } catch (err) {
    warn(reason(err), "handing back a verify without stopping its tests; the next attempt waits them out");
  }
}

/**
 * A later verify attempt began (this one's lock lapsed while it was paused, say, and the job was
 * delivered again): the verification is that attempt's. This one neither starts its tests nor
 * stores a receipt; it ends without a trace.
 */
class VerifySupersededError extends Error {
  override readonly name = "VerifySupersededError";
}

/**
 * A verify attempt's staging or runner found the sandbox's verify fence above its epoch. Taken
 * over by a later attempt: it ends as superseded. But while it still holds the verify fence in
 * Redis, no later attempt began: the fence holds an epoch Redis lost (a failover since it was
 * given out, say). Redis's epochs are raised past it, and the verify is retried: the next
 * attempt's epoch is above the fence.
 */
async function fencedOut(
  deps: PipelineDeps,
  id: string,
  fence: DeliveryFence,
  err: TestsSupersededError,
): Promise<typeof SUPERSEDED> {
  if (!(await deps.store.holdsFence(id, fence))) return superseded(deps, id, "does not start its tests", err);
  await deps.store.raiseVerifyEpoch(id, err.fence);
  throw FleetError.retryable(
    "verifier_error",
    `the sandbox's verify fence (epoch ${err.fence}) is above this attempt's (${err.epoch}) though no later attempt began (Redis lost the epochs?); retried with a later one`,
    err,
  );
}

/** A verify (or seed) attempt that a later one superseded ends here: logged, nothing stored or enqueued. */
export function superseded(
  deps: PipelineDeps,
  rolloutId: string,
  what: string,
  err?: unknown,
  stage: StageName = "verify",
): typeof SUPERSEDED {
  const detail = err === undefined ? {} : { err: err instanceof Error ? err.message : String(err) };
  deps.logger.warn({ rolloutId, ...detail }, `a later ${stage} attempt began; this one ${what}`);
  return SUPERSEDED;
}

/** A cancel or close came for the rollout while this stage ran (read now). */
async function stoppedUnder(deps: PipelineDeps, id: string): Promise<boolean> {
  const now = await deps.store.get(id).catch(() => null);
  return now !== null && (now.closed || now.cancelRequested);
}

export const verifyStage: StageHandler = async (rec, deps, attempt, shutdown) => {
  const work: VerifyWork = { token: null };
  try {
    return await verifyAttempt(rec, deps, attempt, shutdown, work);
  } catch (err) {
    // It noted work in the sandbox and ends without a verdict (its exec broke in a daemon
    // outage, say): it leaves the sandbox, so the next attempt stops what of its tests still
    // runs rather than wait out their budget (`waitOutEarlierTests`). Not at a shutdown: its
    // own sweep (`stopOwnTests`) did that, and an exec of its still queued in the client could
    // yet start.
    if (work.token !== null && !shutdown?.aborted && !isHandBack(err)) {
      await leaveVerifyWork(deps, rec.meta.id, work.token);
    }
    throw err;
  }
};

/** Whether a verify attempt noted work in the sandbox (its token, once it tried to). */
interface VerifyWork {
  token: string | null;
}

/** `store.leaveVerifyWork`, bounded and best effort: without it the next attempt waits as before. */
async function leaveVerifyWork(deps: PipelineDeps, id: string, token: string): Promise<void> {
  await withTimeout(deps.store.leaveVerifyWork(id, token), STOP_TESTS_MS, "no answer").catch((err: unknown) =>
    deps.logger.warn(
      { rolloutId: id, err: err instanceof Error ? err.message : String(err) },
      "could not mark a verify as gone from the sandbox; the next attempt waits its tests out",
    ),
  );
}

const verifyAttempt = async (
  rec: StageRecord,
  deps: PipelineDeps,
  _attempt: number,
  shutdown: AbortSignal | undefined,
  work: VerifyWork,
): Promise<StageName | null | typeof SUPERSEDED> => {
  const runReceipt = rec.receipts.run;
  const seedReceipt = rec.receipts.seed;
  // DESIGN §2 rule 10: never verify without a positive cleanup receipt. A run receipt not
  // there at all may be late (as in `run` above): retried; one without confirmed cleanup is final.
  if (!runReceipt || !seedReceipt) {
    throw FleetError.retryable(
      "verifier_error",
      "no run receipt (yet), so no confirmed cleanup receipt for the agent: refusing to verify",
    );
  }
  if (!runReceipt.cleanup.confirmed) {
    throw FleetError.nonRetryable(
      "verifier_error",
      "no confirmed cleanup receipt for the agent: refusing to verify",
    );
  }
  // DESIGN §2 rule 2: one verify at a time. This attempt's token holds the verify fence until a
  // later attempt begins; only while it does may this one work in the sandbox (checked with the
  // note of that work, before staging the tests and again before starting them), record a
  // failure (`runStageJob`) or store its receipt.
  const fence = deliveryFence(rec.begun);
  if (fence === null) {
    throw FleetError.nonRetryable("verifier_error", "verify began without its fence token (beginOptions)");
  }
  const token = fence.token;
  const task = await loadTask(rec, deps);
  const id = rec.meta.id;
  const earlier = await waitOutEarlierTests(rec, deps, task, seedReceipt.handle, token, shutdown).catch(
    (err: unknown) => {
      // Its sweep found the sandbox fenced past its epoch: it killed nothing of that attempt's.
      if (err instanceof TestsSupersededError) return fencedOut(deps, id, fence, err);
      throw err;
    },
  );
  if (earlier === null) return null;
  if (earlier === "superseded") return superseded(deps, id, "does not touch the sandbox");
  // The rollout ended meanwhile (a cancel, its deadline): close reports it (a repeat is a no-op).
  if (earlier === "terminal") return "close";
  // A Redis blip here is retried (rule 5), not taken for a verifier crash (masked) below.
  // When this attempt last noted its work in the sandbox (a sweep that stops its tests clears it).
  let notedAt: number | null = null;
  const note = async (at: number | null) => {
    work.token = token;
    const noted = await deps.store.noteVerifyWork(id, at, token).catch((err: unknown) => {
      throw FleetError.retryable(
        "provider_unavailable",
        `could not note the verifier's work in the sandbox: ${err instanceof Error ? err.message : String(err)}`,
        err,
      );
    });
    if (noted === "superseded") throw new VerifySupersededError();
    notedAt = at;
  };
  const startedAt = clock(deps);
  const grade = deps.verify ?? defaultVerify;
  let verdict: Awaited<ReturnType<typeof grade>>;
  try {
    verdict = await grade({
      provider: deps.provider,
      handle: seedReceipt.handle,
      task,
      run: {
        answer: runReceipt.answer,
        answerTruncated: runReceipt.answerTruncated === true,
        exec: runReceipt.exec,
      },
      // The verifier counts down on this host's clock.
      deadlineMs: localTime(deps, rec.meta.deadlineAt),
      signal: shutdown,
      fenceEpoch: rec.begun.verifyEpoch ?? undefined,
      onSandboxWork: () => note(clock(deps)),
      // Nothing of the tests started: a retry need not wait for them.
      onStagingFailed: () => note(null),
    });
  } catch (err) {
    if (err instanceof VerifySupersededError) return superseded(deps, id, "does not touch the sandbox");
    // Its staging or runner found the sandbox's fence raised by a later attempt: nothing started.
    if (err instanceof TestsSupersededError) return fencedOut(deps, id, fence, err);
    // Worker shutdown: the job goes back to the queue, no attempt spent. Not a cancel. Its tests
    // are stopped first, as a run stops its agent, so the next attempt starts at once; else it
    // waits them out (`waitOutEarlierTests`: their whole budget, which at a rolling restart of
    // the verifiers delayed every verification in flight by it, and masked tight deadlines).
    if (shutdown?.aborted) {
      await stopOwnTests(deps, seedReceipt.handle, id, token, notedAt, rec.begun.verifyEpoch);
      throw new HandBackError();
    }
    // A cancel's close destroyed the sandbox under the tests: the close reports the rollout
    // (enqueued again: a cancel whose own enqueue of it never happened is still closed).
    if (await stoppedUnder(deps, rec.meta.id)) return "close";
    // A verifier that crashes masks; the provider being down is retried first.
    const fe = await sandboxLostIfGone(deps, seedReceipt.handle, err);
    if (isFleetError(fe)) throw fe;
    throw FleetError.nonRetryable("verifier_error", err instanceof Error ? err.message : String(err), err);
  }
  // Tests ended by a signal grade 0 (the agent's code may have killed them), unless the whole
  // sandbox went (killed from outside, its daemon's doing): then nothing was graded (rule 6).
  const ended = verdict.details as { kind?: unknown; exitCode?: unknown };
  if (ended.kind === "tests" && typeof ended.exitCode === "number" && endedBySignal(ended.exitCode)) {
    const lost = await sandboxLostIfGone(
      deps,
      seedReceipt.handle,
      new Error(`the tests ended by a signal (exit ${ended.exitCode})`),
    );
    if (isFleetError(lost) && lost.kind === "sandbox_lost") {
      if (await stoppedUnder(deps, rec.meta.id)) return "close";
      throw lost;
    }
  }
  // The agent exited 0 while its model upstream was failing: only a full reward stands (rule 6).
  if (runReceipt.upstreamFailing && verdict.reward < 1) {
    throw FleetError.nonRetryable(
      "provider_unavailable",
      capText(`${runReceipt.upstreamFailing}; its work graded ${verdict.reward}, so not scored`),
    );
  }
  const at = clock(deps);
  const receipt = { reward: verdict.reward, details: verdict.details, startedAt, at };
  // Stored only while this attempt holds the verify fence, and close enqueued only for a stored
  // receipt or a stop, after the receipt's reply: an attempt superseded by a later one (paused
  // past its lock, or its commands held in ioredis's offline queue through an outage, then
  // woken) must not close the rollout under the tests of the attempt now verifying.
  if (await deps.store.saveReceipt(rec.meta, "verify", receipt, "verified", at, { deliveryFence: fence })) {
    return "close";
  }
  if (!(await deps.store.holdsFence(id, fence))) return superseded(deps, id, "drops its verdict");
  return "close"; // refused for a stop (terminal or closed): close must run; a repeat is a no-op
};

/**
 * How many times close is enqueued again for a rollout whose close ended without finalizing, by
 * the deadline watchdog and by the stage workers (for a close job BullMQ failed as stalled) counted
 * together (`store.noteCloseAgain`). A close that fails every attempt, or kills every worker
 * that takes it, was otherwise enqueued again for good: a poison job crash-looping the resources
 * workers. Past it, whichever finds it next (a stage worker at once, or the janitor's watchdog
 * past the deadline) gives up on close jobs: `closeWithoutDestroys`.
 */
export const CLOSE_AGAIN_LIMIT = 3;

/**
 * Close a rollout whose close jobs keep ending without finalizing (`CLOSE_AGAIN_LIMIT`): as a
 * close job's runner would (begin sets the tombstone and reads what close needs), then
 * `closeRollout` without destroys, at `now` (the sandboxes it hands to the ledger are due then).
 * No Docker call: its sandboxes go to the teardown ledger, whose retries back off, its gateway
 * network to the network retries, and its result says the teardown is pending until they are
 * gone. The result as stored, or null when another closer finalized (only a close this call
 * finalized is counted in `fleet_closes_given_up_total`).
 */
export async function closeWithoutDestroys(
  deps: PipelineDeps,
  rolloutId: string,
  now: number,
): Promise<RolloutResult | null> {
  const { record, failures, ...begun } = await deps.store.begin(rolloutId, "close", now);
  if (!record || isTerminal(record.status)) return null;
  const stored = await closeRollout(
    { ...record, failureLog: failures, begun },
    { ...deps, now: () => now },
    { destroy: false },
  );
  if (stored) deps.metrics?.closesGivenUp.inc();
  return stored;
}

export const close: StageHandler = async (rec, deps) => {
  await closeRollout(rec, deps, { destroy: true });
  return null;
};

/**
 * Close a rollout: destroy its sandboxes (or, without `destroy`, hand every one to the teardown
 * ledger, as the janitor's close does: see `CLOSE_AGAIN_LIMIT`), remove its gateway network (a
 * failed removal goes to the ledger's network retries; without `destroy`, the removal goes there
 * at once), and finalize the result composed from `rec`.
 * The result as stored if this call finalized it; null if another closer did (a close job running
 * meanwhile, or another janitor pass): only the one that finalized counts it.
 */
export async function closeRollout(
  rec: StageRecord,
  deps: PipelineDeps,
  options: { destroy: boolean },
): Promise<RolloutResult | null> {
  // `rec` was read by `store.begin`, which set the tombstone first: no stage writes after it.
  const id = rec.meta.id;
  const fresh = rec;
  let teardown: "confirmed" | "pending" = "confirmed";
  let cleanup: CleanupReceipt | null = null;
  // Read by this stage's begin, after the tombstone (no intent can be added after it).
  const entries = fresh.begun.sandboxes ?? (await deps.ledger.sandboxesOf(id));
  const confirmed: { key: string; destroyed: SandboxHandle | null }[] = [];
  for (const owner of entries.unreadable) {
    // A registry entry this release cannot read (torn, or another release's shape in a rolling
    // upgrade): it cannot be put on the ledger, nor its sandbox destroyed from it (the task's is,
    // from the seed's receipt, below). The teardown is pending: the janitor's label sweep
    // removes what is left of the rollout once it is over, and its confirm forgets the entry and
    // confirms the teardown (nothing left: the janitor retires the entry, `retireUnreadableEntry`). Close goes on: it must end the rollout whatever it cannot read.
    deps.logger.warn(
      { rolloutId: id, owner },
      "a sandbox registry entry does not parse; its sandbox is left to the janitor's label sweep",
    );
    teardown = "pending";
  }
  for (const owner of ["resources", "agent"] as const) {
    const key = sandboxKey(id, owner);
    let entry = entries[owner];
    if (!entry && owner === "resources" && fresh.receipts.seed) {
      entry = {
        key,
        rolloutId: id,
        owner,
        provider: fresh.receipts.seed.handle.provider,
        handle: fresh.receipts.seed.handle,
        createdAt: fresh.receipts.seed.at,
        expiresAt: fresh.meta.deadlineAt + SANDBOX_EXPIRY_SLACK_MS,
      };
    }
    if (!entry) continue;
    if (owner === "agent" || !options.destroy) {
      // Not ours to destroy (rule 11): the agent worker that owned it is gone; hand it to the
      // janitor. Without `destroy` (the janitor's own close), every sandbox goes there.
      await deps.ledger.schedule(entry, clock(deps));
      teardown = "pending";
      continue;
    }
    // The confirm is folded into finalize's script below.
    const r = await destroyOrLedger(deps, entry, { deferConfirm: true });
    // Only the sandbox it destroyed: one that replaced it meanwhile (a seed attempt still
    // creating, whose own destroy failed) keeps its ledger entry.
    if (r.confirmedKey) confirmed.push({ key: r.confirmedKey, destroyed: r.destroyed ?? null });
    if (r.teardown === "pending") teardown = "pending";
    cleanup = r.receipt;
  }
  if (needsModelAccess(fresh.meta.agent) && deps.networks && !options.destroy) {
    // Its sandbox is left to the ledger, still on the network (which Docker will not remove with
    // a container on it): the janitor's networks step removes it, after its ledger step, and no
    // Docker call is made here (the janitor's close runs in its watchdog, which needs only Redis).
    await deps.ledger.networkRemovalFailed(id, clock(deps));
    teardown = "pending";
  } else if (needsModelAccess(fresh.meta.agent) && deps.networks) {
    // The rollout's gateway network goes with its sandbox; a failure is persisted for the
    // janitor to retry (the network, or the firewall rules its removal left behind), and the
    // teardown is pending until it has (the janitor's retry marks the result confirmed).
    await deps.networks.remove(id).catch(async (err: unknown) => {
      deps.logger.warn(
        { rolloutId: id, err: String(err) },
        "gateway network removal failed; the janitor retries",
      );
      await deps.ledger.networkRemovalFailed(id, clock(deps));
      teardown = "pending";
    });
  }
  const at = clock(deps);
  const closeReceipt = { cleanup, teardown, at };
  const result = composeResult(fresh, closeReceipt, at, fresh.failureLog);
  // The close receipt is stored with the result, in the one finalizing script; the metrics count
  // the result as stored (its teardown, and so a completed one's failure kind, may differ).
  const stored = await deps.store.finalizeStored(fresh.meta, result, at, closeReceipt, confirmed);
  if (stored && deps.metrics) {
    deps.metrics.rolloutsFinished.inc({ status: stored.status, failure_kind: stored.failureKind ?? "none" });
    const total = stored.timings.totalMs;
    if (total !== null) deps.metrics.rolloutDuration.observe({ status: stored.status }, total / 1000);
    if (stored.reward !== null) deps.metrics.reward.observe(stored.reward);
  }
  return stored;
}

export const HANDLERS: Record<StageName, StageHandler> = { seed, run, verify: verifyStage, close };
