import { isTerminal, type StageName } from "@fleet/contracts";
import { type RolloutRecord, stageJobId, UnreadableRecordError } from "@fleet/queue";
import type { PipelineDeps } from "./deps.ts";
import { CLOSE_AGAIN_LIMIT } from "./stages.ts";

/**
 * The stage job an open rollout is waiting on, read from its record: close once it is closing
 * or a terminal failure is recorded, else the stage after the last receipt stored.
 */
export function expectedStage(rec: Pick<RolloutRecord, "closed" | "failure" | "receipts">): StageName {
  if (rec.closed || rec.failure) return "close";
  if (rec.receipts.verify) return "close";
  if (rec.receipts.run) return "verify";
  if (rec.receipts.seed) return "run";
  return "seed";
}

/** A rollout whose record has not changed for this long may have lost its stage job. @defaultValue 2 min */
export const DEFAULT_LOST_JOB_GRACE_MS = 120_000;
/** Open rollouts looked at per janitor pass (a cursor walks the in-flight index, a page a pass). */
export const LOST_JOB_PAGE = 200;

/** Where the walk of the in-flight index is (per janitor replica; a restart starts over). */
export interface LostJobCursor {
  next: number;
}

/**
 * Find open rollouts whose stage job is gone (removed, cleaned or drained by an operator in Bull
 * Board, an obliterated queue, a job lost with Redis data) and enqueue it again: without this,
 * such a rollout waited out its deadline (an hour by default) holding its sandbox, its batch
 * unfinished, and then ended masked as past its deadline even when its agent had finished. The
 * job is added with its deterministic id, so a job that exists in any state is left alone, and
 * a stage that already ran replays its receipt. Only rollouts whose record has not changed for
 * `graceMs` are looked at: a stage stores its receipt and adds the next job in one round trip,
 * an admission's seeds are the admissions step's, and a stage at work stamps a heartbeat
 * (`STAGE_BEAT_MS`), so that a live run or verify whose job was removed is never started again
 * beside it. Returns the rollouts whose job it enqueued.
 */
export async function requeueLostJobs(
  deps: PipelineDeps,
  now: number,
  cursor: LostJobCursor,
  options: { graceMs?: number; page?: number } = {},
): Promise<string[]> {
  const page = options.page ?? LOST_JOB_PAGE;
  const grace = options.graceMs ?? DEFAULT_LOST_JOB_GRACE_MS;
  const ids = await deps.store.inflightPage(cursor.next, page);
  // Past the end: the next pass starts over.
  cursor.next = ids.length < page ? 0 : cursor.next + ids.length;
  const requeued: string[] = [];
  for (const id of ids) {
    let rec: RolloutRecord | null;
    try {
      rec = await deps.store.get(id);
    } catch (err) {
      if (err instanceof UnreadableRecordError) continue; // the watchdog sets it aside at its deadline
      throw err;
    }
    if (!rec || isTerminal(rec.status)) continue;
    const latest = Math.max(rec.meta.createdAt, ...Object.values(rec.times));
    if (now - latest < grace) continue;
    const stage = expectedStage(rec);
    if (await deps.queues.queues[stage].getJob(stageJobId(id, stage))) continue;
    if (stage === "close") {
      // Counted as every close enqueued again is (`CLOSE_AGAIN_LIMIT`): a close that kills the
      // workers taking it is gone between BullMQ failing it and its next enqueue, and must not
      // come back for good from here. Past the limit the watchdog closes the rollout itself.
      // Only if no one counted since the record was read (another janitor's lost step, which
      // enqueues it): counted twice, the limit came after fewer closes.
      // Past the limit already: nothing to enqueue, and nothing to count (each count keeps a
      // field on the record, and this step comes round every pass until the deadline).
      if (rec.closesAgain >= CLOSE_AGAIN_LIMIT) continue;
      const closes = await deps.store.noteCloseAgain(id, rec.closesAgain);
      if (closes <= 0 || closes > CLOSE_AGAIN_LIMIT) continue;
    }
    await deps.queues.enqueue(stage, id);
    requeued.push(id);
  }
  return requeued;
}
