import {
  FailureRecord,
  isTerminal,
  type RolloutResult,
  RolloutStatus,
  type RolloutTrajectory,
  Stage,
} from "@fleet/contracts";
import type { RolloutRecord } from "@fleet/queue";
import { z } from "zod";

/**
 * `GET /v1/rollouts/:id` for a rollout still in flight. A terminal rollout answers with its
 * `RolloutResult` instead; both carry `id`, `batchId`, `taskId`, `agent`, `status`, `stage`.
 */
export const RolloutView = z.object({
  id: z.string(),
  batchId: z.string().nullable(),
  status: RolloutStatus,
  /**
   * The stage it is in (a worker began it) or last finished: `admission` until its seed begins,
   * `run` from the moment a worker began the run (its agent starting) until verify begins.
   */
  stage: Stage,
  taskId: z.string(),
  taskDigest: z.string(),
  /** The agent's display name (as in results). */
  agent: z.string(),
  createdAt: z.number().int(),
  /** Absolute deadline (epoch ms): retries share it. */
  deadlineAt: z.number().int(),
  /** The first terminal failure, once one is recorded (the rollout is then on its way to close). */
  failure: FailureRecord.nullable(),
  cancelRequested: z.boolean(),
  metadata: z.record(z.string(), z.unknown()).nullable(),
});
export type RolloutView = z.infer<typeof RolloutView>;

/** The answer for a rollout: its result when terminal, else its progress view. */
export function presentRollout(record: RolloutRecord): RolloutResult | RolloutView {
  if (isTerminal(record.status) && record.result) return record.result;
  return {
    id: record.meta.id,
    batchId: record.meta.batchId,
    status: record.status,
    stage: stageOf(record),
    taskId: record.meta.taskId,
    taskDigest: record.meta.taskDigest,
    agent: record.meta.agentName,
    createdAt: record.meta.createdAt,
    deadlineAt: record.meta.deadlineAt,
    failure: record.failure,
    cancelRequested: record.cancelRequested,
    metadata: record.meta.metadata,
  };
}

/** Stages in the order a rollout goes through them. */
const ORDER = Stage.options;

/**
 * The furthest of the stage whose receipt was stored last (`record.stage`) and the last stage a
 * worker began (its start time, recorded by `store.begin`): the status says the seed is done
 * (`seeded`) while the agent already runs.
 */
function stageOf(record: RolloutRecord): Stage {
  const stored = Stage.safeParse(record.stage);
  let at = ORDER.indexOf(stored.success ? stored.data : "admission");
  for (let i = at + 1; i < ORDER.length; i++) {
    if (record.times[`${ORDER[i]}:start`] !== undefined) at = i;
  }
  return ORDER[at]!;
}

/** The trajectory of a rollout (`RolloutTrajectory`). */
export function presentTrajectory(record: RolloutRecord): RolloutTrajectory {
  const run = record.receipts.run;
  return {
    id: record.meta.id,
    status: record.status,
    agent: record.meta.agentName,
    harness: record.meta.agent.harness,
    run: run
      ? {
          exitCode: run.exec.exitCode,
          timedOut: run.exec.timedOut,
          oomKilled: run.exec.oomKilled,
          durationMs: run.exec.durationMs,
          stdout: run.exec.stdout,
          stderr: run.exec.stderr,
          stdoutTruncated: run.exec.stdoutTruncated,
          stderrTruncated: run.exec.stderrTruncated,
          answer: run.answer,
          transcript: run.transcript,
          usage: run.usage,
          startedAt: run.startedAt,
          stoppedAt: run.stoppedAt,
          attempts: run.attempts,
        }
      : null,
  };
}
