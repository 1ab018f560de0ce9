import {
  type CloseReceipt,
  classifyFailure,
  type FailureKind,
  type FailureRecord,
  type RolloutResult,
  type Stage,
  type TerminalStatus,
  type Timings,
} from "@fleet/contracts";
import type { RolloutRecord } from "@fleet/queue";

/** Exit envelope for a sandbox/provider failure during the run (DESIGN §2 rule 6). */
export const EXIT_SANDBOX_FAILURE = -2;

function span(start: number | undefined, end: number | undefined): number | null {
  return start !== undefined && end !== undefined && end >= start ? end - start : null;
}

export function timings(rec: RolloutRecord, finishedAt: number): Timings {
  const t = rec.times;
  return {
    queuedMs: span(rec.meta.createdAt, t["seed:start"]),
    seedMs: span(t["seed:start"], t["seed:end"]),
    runMs: span(t["run:start"], t["run:end"]),
    verifyMs: span(t["verify:start"], t["verify:end"]),
    closeMs: span(t["close:start"], finishedAt),
    // The dispatcher's stamp against a worker's (both on Redis's clock in the apps): a negative
    // span (clocks that disagreed) is no fact, so null as the others, not 0.
    totalMs: span(rec.meta.createdAt, finishedAt),
    agentMs: rec.receipts.run ? span(rec.receipts.run.startedAt, rec.receipts.run.stoppedAt) : null,
  };
}

/** The terminal status a rollout gets for a failure of this kind (DESIGN §2). */
export function statusFor(kind: FailureKind): TerminalStatus {
  const { outcome } = classifyFailure(kind);
  switch (outcome) {
    case "fail":
      return "failed";
    case "mask":
      return "masked";
    case "cancel":
      return "cancelled";
    case "graded":
      return "completed";
  }
}

/** What a result says of the rollout's outcome (`composeResult`'s part that depends on it). */
type Verdict = Pick<
  RolloutResult,
  "status" | "reward" | "mask" | "failureKind" | "stage" | "reason" | "exitCode" | "details"
>;

/**
 * The one result of a rollout, from its record at close. A recorded failure decides the
 * status (masked results never carry a reward); otherwise the verifier's reward stands, with
 * `agent_timeout` / `teardown_failed` as information.
 */
export function composeResult(
  rec: RolloutRecord,
  close: CloseReceipt,
  finishedAt: number,
  failures: FailureRecord[],
): RolloutResult {
  const { meta, receipts } = rec;
  const v = verdict(rec, close);
  // One object literal, not the common fields spread into each outcome's (`{ ...base, status, … }`):
  // on Node 20's V8 a spread followed by more properties took ~40 us a result (a fresh hidden
  // class per call, and the garbage of it), where the literal takes well under one. Same fields,
  // in the same order.
  return {
    id: meta.id,
    batchId: meta.batchId,
    taskId: meta.taskId,
    taskDigest: meta.taskDigest,
    agent: meta.agentName,
    teardown: close.teardown,
    // A run that failed after its agent called a model (masked for its upstream, say) keeps what it spent.
    usage: receipts.run?.usage ?? (rec.failure?.stage === "run" ? rec.failure.usage : undefined) ?? null,
    agentLaunches: rec.launches,
    timings: timings(rec, finishedAt),
    failures,
    metadata: meta.metadata,
    createdAt: meta.createdAt,
    finishedAt,
    status: v.status,
    reward: v.reward,
    mask: v.mask,
    failureKind: v.failureKind,
    stage: v.stage,
    reason: v.reason,
    exitCode: v.exitCode,
    details: v.details,
  };
}

/** The outcome `composeResult` reports for a record at close. */
function verdict(rec: RolloutRecord, close: CloseReceipt): Verdict {
  const { receipts } = rec;
  const failure = rec.failure;
  let exitCode: number | null = receipts.run?.exec.exitCode ?? null;
  if (failure) {
    if (
      exitCode === null &&
      failure.stage === "run" &&
      (failure.failureKind === "sandbox_lost" || failure.failureKind === "provider_unavailable")
    ) {
      exitCode = EXIT_SANDBOX_FAILURE;
    }
    const status = statusFor(failure.failureKind);
    return {
      status,
      reward: null,
      mask: status === "masked",
      failureKind: failure.failureKind,
      stage: failure.stage,
      reason: failure.reason,
      exitCode,
      details: receipts.verify?.details ?? null,
    };
  }
  if (receipts.verify) {
    const timedOut = receipts.run?.exec.timedOut === true;
    const info: FailureKind | null = timedOut
      ? "agent_timeout"
      : close.teardown === "pending"
        ? "teardown_failed"
        : null;
    return {
      status: "completed",
      reward: receipts.verify.reward,
      mask: false,
      failureKind: info,
      stage: "close",
      reason: timedOut ? "the agent reached its deadline and was graded on what it left" : null,
      exitCode,
      details: receipts.verify.details,
    };
  }
  const stage: Stage = receipts.run ? "verify" : receipts.seed ? "run" : "seed";
  if (rec.cancelRequested) {
    // A cancel claimed the stop (the run saw it and went to close) but its failure record never
    // landed (the dispatcher died or stalled between the two writes): still the user's cancel,
    // not an infrastructure mask.
    return {
      status: "cancelled",
      reward: null,
      mask: false,
      failureKind: "cancelled",
      stage,
      reason: "cancelled by request",
      exitCode,
      details: null,
    };
  }
  // Closed without a verdict and without a recorded failure: the rollout ran out of time or
  // was closed by the watchdog. Never a zero.
  return {
    status: "masked",
    reward: null,
    mask: true,
    failureKind: "deadline_exceeded",
    stage,
    reason: "closed before a verdict was reached",
    exitCode,
    details: null,
  };
}
