import type { CloseReceipt, FailureRecord, RunReceipt } from "@fleet/contracts";
import type { RolloutRecord } from "@fleet/queue";
import { execResult } from "@fleet/sandbox/testing";
import { describe, expect, it } from "vitest";
import { composeResult, timings } from "./result.ts";

const exec = execResult({ durationMs: 1 });
const cleanup = { confirmed: true, scope: "processes" as const, at: 5, alreadyGone: false, remaining: 0 };
const runReceipt = (over: Partial<RunReceipt> = {}): RunReceipt => ({
  exec,
  answer: null,
  transcript: null,
  usage: null,
  cleanup,
  ownedSandbox: null,
  startedAt: 3,
  stoppedAt: 5,
  attempts: 1,
  at: 5,
  ...over,
});

function record(over: Partial<RolloutRecord> = {}): RolloutRecord {
  return {
    meta: {
      id: "r1",
      batchId: null,
      bodyHash: "h",
      taskDigest: "d",
      taskId: "t",
      agent: { harness: "oracle", sandbox: "borrow" },
      agentName: "oracle",
      metadata: { run: 7 },
      createdAt: 0,
      deadlineAt: 1000,
    },
    status: "verified",
    stage: "verify",
    receipts: {},
    failure: null,
    cancelRequested: false,
    closed: true,
    fence: null,
    launches: 1,
    closesAgain: 0,
    result: null,
    times: {
      "seed:start": 1,
      "seed:end": 2,
      "run:start": 3,
      "run:end": 5,
      "verify:start": 6,
      "verify:end": 7,
      "close:start": 8,
    },
    ...over,
  };
}
const closed: CloseReceipt = { cleanup: null, teardown: "confirmed", at: 9 };
const failure = (
  kind: FailureRecord["failureKind"],
  stage: FailureRecord["stage"] = "run",
): FailureRecord => ({
  stage,
  terminal: true,
  failureKind: kind,
  mask: false,
  reason: "why",
  at: 4,
});

describe("composeResult", () => {
  it("a verdict stands as completed with its reward and timings", () => {
    const r = composeResult(
      record({ receipts: { run: runReceipt(), verify: { reward: 0.75, details: {}, startedAt: 6, at: 7 } } }),
      closed,
      10,
      [],
    );
    expect(r).toMatchObject({
      status: "completed",
      reward: 0.75,
      mask: false,
      failureKind: null,
      exitCode: 0,
      metadata: { run: 7 },
    });
    expect(r.timings).toEqual({
      queuedMs: 1,
      seedMs: 1,
      runMs: 2,
      verifyMs: 1,
      closeMs: 2,
      totalMs: 10,
      agentMs: 2,
    });
    expect(r.agentLaunches).toBe(1);
  });

  it("a rerun shows: the launches counted, agentMs the last launch's while runMs spans the stage", () => {
    const r = composeResult(
      record({
        launches: 2,
        // The first launch began at 3; its worker died; the rerun ran from 40 to 45.
        times: { "run:start": 3, "run:end": 45 },
        receipts: {
          run: runReceipt({ startedAt: 40, stoppedAt: 45, attempts: 2 }),
          verify: { reward: 1, details: {}, startedAt: 46, at: 47 },
        },
      }),
      closed,
      50,
      [],
    );
    expect(r).toMatchObject({ status: "completed", agentLaunches: 2 });
    expect(r.timings).toMatchObject({ runMs: 42, agentMs: 5 });
  });

  it("a rollout whose agent never launched says 0 launches and no agent time", () => {
    const r = composeResult(
      record({ launches: 0, failure: failure("invalid_task", "seed") }),
      closed,
      10,
      [],
    );
    expect(r.agentLaunches).toBe(0);
    expect(r.timings.agentMs).toBeNull();
  });

  it("a finish stamped before the acceptance (clocks that disagreed) gives totalMs null, neither a negative one the result schema refuses nor a made-up 0", () => {
    const rec = record();
    expect(timings(rec, rec.meta.createdAt - 250).totalMs).toBeNull();
    expect(timings(rec, rec.meta.createdAt + 250).totalMs).toBe(250);
  });

  it("an agent timeout is graded and marked agent_timeout; a pending teardown is reported", () => {
    const r = composeResult(
      record({
        receipts: {
          run: runReceipt({ exec: { ...exec, exitCode: -1, timedOut: true } }),
          verify: { reward: 0, details: {}, startedAt: 6, at: 7 },
        },
      }),
      { ...closed, teardown: "pending" },
      10,
      [],
    );
    expect(r).toMatchObject({
      status: "completed",
      reward: 0,
      failureKind: "agent_timeout",
      exitCode: -1,
      teardown: "pending",
    });
  });

  it("infrastructure failures are masked with no reward, even with a verdict stored", () => {
    for (const kind of [
      "provider_unavailable",
      "sandbox_lost",
      "verifier_error",
      "deadline_exceeded",
      "provider_oom_killed",
    ] as const) {
      const r = composeResult(
        record({
          failure: failure(kind),
          receipts: { verify: { reward: 0, details: {}, startedAt: 6, at: 7 } },
        }),
        closed,
        10,
        [],
      );
      expect(r).toMatchObject({ status: "masked", mask: true, reward: null, failureKind: kind });
    }
  });

  it("a sandbox lost during the run carries the -2 exit envelope", () => {
    const r = composeResult(record({ failure: failure("sandbox_lost", "run") }), closed, 10, []);
    expect(r.exitCode).toBe(-2);
  });

  it("a run that failed after its agent's model calls keeps their usage; a failure elsewhere, or none measured, reports none", () => {
    const usage = { calls: 2, promptTokens: 40, completionTokens: 6, cachedTokens: 0, gaps: [] };
    const masked = composeResult(
      record({ failure: { ...failure("provider_unavailable", "run"), usage } }),
      closed,
      10,
      [],
    );
    expect(masked).toMatchObject({ status: "masked", usage });
    expect(
      composeResult(record({ failure: failure("provider_unavailable", "run") }), closed, 10, []).usage,
    ).toBe(null);
    // The run's receipt, when it has one, is what its usage was.
    const ran = composeResult(
      record({
        failure: { ...failure("verifier_error", "verify"), usage: { ...usage, calls: 9 } },
        receipts: { run: runReceipt({ usage }) },
      }),
      closed,
      10,
      [],
    );
    expect(ran.usage).toEqual(usage);
    expect(
      composeResult(record({ failure: { ...failure("sandbox_lost", "seed"), usage } }), closed, 10, []).usage,
    ).toBe(null);
  });

  it("final failures are failed, cancels cancelled, neither masked", () => {
    expect(composeResult(record({ failure: failure("invalid_task", "seed") }), closed, 10, [])).toMatchObject(
      {
        status: "failed",
        mask: false,
        reward: null,
        stage: "seed",
      },
    );
    expect(composeResult(record({ failure: failure("cancelled") }), closed, 10, [])).toMatchObject({
      status: "cancelled",
      mask: false,
    });
  });

  it("a cancel whose failure record never landed is still cancelled, not masked", () => {
    const r = composeResult(
      record({ receipts: { seed: undefined, run: undefined }, cancelRequested: true }),
      closed,
      10,
      [],
    );
    expect(r).toMatchObject({ status: "cancelled", mask: false, reward: null, failureKind: "cancelled" });
  });

  it("closed without verdict or failure is masked deadline_exceeded, never 0", () => {
    const r = composeResult(record({ receipts: { run: runReceipt() } }), closed, 10, []);
    expect(r).toMatchObject({
      status: "masked",
      reward: null,
      failureKind: "deadline_exceeded",
      stage: "verify",
    });
  });
});
