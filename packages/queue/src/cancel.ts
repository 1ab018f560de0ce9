import { isTerminal, type RolloutStatus, Stage, stageAfter } from "@fleet/contracts";
import { type RolloutRecord, type RolloutStore, UnreadableRecordError } from "./rollout-store.ts";
import type { StageQueues } from "./stage-queues.ts";

/** `previous`: the status the cancel found (`"unreadable"`: one this release does not know). */
export type CancelOutcome =
  | { kind: "unknown" }
  | { kind: "terminal"; status: RolloutStatus }
  | { kind: "cancelling"; previous: RolloutStatus | "unreadable" }
  /** An earlier terminal failure (not a cancel) decides how the rollout ends: it is closing anyway. */
  | { kind: "decided"; previous: RolloutStatus | "unreadable"; failureKind: string }
  /** Its close began, or it is graded: its result is decided already (a graded reward stands). */
  | { kind: "closing"; previous: RolloutStatus | "unreadable"; graded: boolean };

export const CANCEL_REASON = "cancelled by request";

/**
 * Cancel one rollout: claim the stop (a harness not yet launched never starts), record the
 * terminal `cancelled` failure (the first terminal failure wins, so a repeated cancel changes
 * nothing), and enqueue close, which always runs and finalizes the rollout. Idempotent. A rollout
 * already closing for another terminal failure is stopped all the same but ends by that failure
 * (`decided`); one whose close began or that is graded already ends as it would have (`closing`:
 * close composes the result from what it read when it began, and a reward is never thrown away).
 */
export async function cancelRollout(
  store: RolloutStore,
  queues: StageQueues,
  id: string,
  now: number,
): Promise<CancelOutcome> {
  const previous = await store.requestCancel(id);
  if (previous === null) return { kind: "unknown" };
  if (previous !== "unreadable" && isTerminal(previous)) return { kind: "terminal", status: previous };
  // A record that does not parse as a whole: its stage from its raw fields, most often intact.
  const record = (await readable(store, id)) ?? (await store.stageFields(id));
  const won = await store.recordFailure(
    id,
    {
      stage: currentStage(record),
      terminal: true,
      failureKind: "cancelled",
      mask: false,
      reason: CANCEL_REASON,
      at: now,
    },
    { beforeDecided: true },
  );
  await queues.enqueue("close", id);
  if (won) return { kind: "cancelling", previous };
  // Not recorded: the rollout finished meanwhile (its own close won), or another terminal
  // failure came first and decides how it ends (a repeated cancel finds its own).
  const current = await readable(store, id);
  if (current && isTerminal(current.status)) return { kind: "terminal", status: current.status };
  const failureKind = current?.failure?.failureKind;
  if (failureKind === "cancelled") return { kind: "cancelling", previous };
  if (failureKind !== undefined) return { kind: "decided", previous, failureKind };
  const graded = current?.receipts.verify !== undefined;
  // Not graded, and the stop was claimed before close began (an earlier cancel whose failure
  // record never landed, this one repeating it): close read the claim and ends it cancelled.
  if (!graded && current?.cancelRequested) return { kind: "cancelling", previous };
  return { kind: "closing", previous, graded };
}

/**
 * A rollout's record, or null when it cannot be read: such a rollout is still stopped and closed
 * (the watchdog sets it aside at its deadline), and a batch's cancel goes on to the rest.
 */
async function readable(store: RolloutStore, id: string): Promise<RolloutRecord | null> {
  try {
    return await store.get(id);
  } catch (err) {
    if (err instanceof UnreadableRecordError) return null;
    throw err;
  }
}

/** How many cancels of one batch run at once (each is a few Redis round trips). */
export const CANCEL_CONCURRENCY = 100;
/** Rollout ids read per page when walking a batch. */
export const BATCH_PAGE = 500;

/**
 * Cancel every non-terminal rollout of a batch; returns how many it asked to stop (a repeated
 * cancel counts those still on their way to close again), or null for no such batch. A batch
 * still being admitted has its later rollouts recorded cancelled (they stop at their seed; not
 * in the count).
 *
 * The walk is noted in Redis (`Keys.cancelling`), dated by `clock` (the fleet's) at its start,
 * which is also the cancels' time, and at each page,
 * and the note goes when it is done: a walk cut short (its dispatcher died) leaves its note to
 * age, and the janitor walks the batch again (`resumeCancels`). Walking twice changes nothing.
 */
export async function cancelBatch(
  store: RolloutStore,
  queues: StageQueues,
  batchId: string,
  clock: () => number = Date.now,
): Promise<number | null> {
  // First: a rollout recorded after this is cancelled as it is recorded; one recorded before is
  // in the list walked below.
  const now = clock();
  let noted = now;
  if (!(await store.cancelBatchAdmission(batchId, noted))) return null;
  let cancelled = 0;
  for (let start = 0; ; start += BATCH_PAGE) {
    const ids = await store.batchRolloutIds(batchId, start, start + BATCH_PAGE - 1);
    if (ids.length === 0) break;
    // Which have a result (read as stored: a result another release wrote must not fail the cancel).
    const results = await store.getResultsJson(ids);
    const open = ids.filter((_, i) => results[i] === null);
    for (let i = 0; i < open.length; i += CANCEL_CONCURRENCY) {
      const outcomes = await Promise.all(
        open.slice(i, i + CANCEL_CONCURRENCY).map((id) => cancelRollout(store, queues, id, now)),
      );
      cancelled += outcomes.filter((o) => o.kind === "cancelling").length;
    }
    if (ids.length < BATCH_PAGE) break;
    noted = clock();
    await store.cancelProgress(batchId, noted);
  }
  await store.cancelDone(batchId, noted);
  return cancelled;
}

/**
 * The stage a rollout is in: the one after the last that finished (`record.stage`) once it has
 * begun (its start time is stored), else that last one: a rollout whose agent runs is in `run`,
 * not in `seed`; one queued for its seed is still in `admission`.
 */
export function currentStage(record: { stage: string; times: Record<string, number> } | null): Stage {
  const last = Stage.safeParse(record?.stage);
  if (!last.success) return "admission";
  const next = stageAfter(last.data);
  return next !== null && record!.times[`${next}:start`] !== undefined ? next : last.data;
}
