import { describe, expect, it } from "vitest";
import { ResultTally, renderSummary } from "./summary.ts";

describe("ResultTally", () => {
  it("counts statuses, masks and failure kinds, and averages rewards over graded results only", () => {
    const t = new ResultTally();
    const lines = [
      {
        status: "completed",
        reward: 1,
        mask: false,
        failureKind: null,
        teardown: "confirmed",
        agentLaunches: 2,
      },
      { status: "completed", reward: 0, mask: false, failureKind: "agent_timeout", teardown: "pending" },
      { status: "masked", reward: null, mask: true, failureKind: "sandbox_lost" },
      { status: "masked", reward: 0, mask: true, failureKind: "verifier_error" }, // a masked 0 is not a score
      { status: "failed", reward: null, mask: false, failureKind: "invalid_task" },
    ];
    for (const l of lines) t.addLine(JSON.stringify(l));
    t.addLine("not json");
    t.addLine("[1]");
    const s = t.summary();
    expect(s).toEqual({
      total: 5,
      byStatus: { completed: 2, masked: 2, failed: 1 },
      graded: 2,
      meanReward: 0.5,
      masked: 2,
      byFailureKind: { agent_timeout: 1, sandbox_lost: 1, verifier_error: 1, invalid_task: 1 },
      failureKindsByStatus: {
        completed: { agent_timeout: 1 },
        masked: { sandbox_lost: 1, verifier_error: 1 },
        failed: { invalid_task: 1 },
      },
      teardownPending: 1,
      rerun: 1,
      unreadable: 2,
    });
    expect(renderSummary(s)).toBe(
      [
        "results: 5",
        "  completed 2  masked 2  failed 1  cancelled 0",
        "  mean reward: 0.5000 over 2 graded",
        "  masked: 2  (failure kinds: sandbox_lost 1, verifier_error 1)",
        "  completed: 2  (failure kinds: agent_timeout 1)",
        "  failed: 1  (failure kinds: invalid_task 1)",
        "  agent rerun: 1 (launched more than once: its worker died, or its sandbox failed under it)",
        "  teardown pending: 1 (the janitor is retrying)",
        "  unreadable result lines: 2",
      ].join("\n"),
    );
  });

  it("lists only masked results' failure kinds on the masked line", () => {
    const t = new ResultTally();
    for (let i = 0; i < 5; i++) t.add({ status: "cancelled", mask: false, failureKind: "cancelled" });
    t.add({ status: "completed", reward: 1, mask: false, failureKind: null });
    const text = renderSummary(t.summary());
    expect(text).toContain("  masked: 0\n");
    expect(text).not.toContain("masked: 0  (");
    expect(text).toContain("  cancelled: 5  (failure kinds: cancelled 5)");
    expect(text).not.toContain("rerun"); // none was
  });

  it("has no mean when nothing was graded", () => {
    const s = new ResultTally().summary();
    expect(s.meanReward).toBeNull();
    expect(renderSummary(s)).toContain("mean reward: n/a");
  });
});
