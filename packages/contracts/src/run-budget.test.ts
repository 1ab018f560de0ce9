import { describe, expect, it } from "vitest";
import { AgentSpec } from "./agent.ts";
import { RUN_MARGIN_MS, runBudgetShortfall } from "./run-budget.ts";
import { TaskContent } from "./task.ts";

const TASK = TaskContent.parse({
  id: "t1",
  instruction: "Print the answer.",
  image: "rollout-fleet/base:latest",
  solution: { "solve.sh": "echo 42\n" },
  tests: { "test.sh": "exit 0\n" },
});

describe("runBudgetShortfall", () => {
  const oracle = AgentSpec.parse({ harness: "oracle" });
  // TASK: the agent's 120 s and the tests' 60 s (the defaults).
  const need = (120 + 60) * 1000 + RUN_MARGIN_MS;

  it("is null while the rollout has the agent's timeout, the tests' and the margin left; says what is short otherwise", () => {
    const at = (left: number) =>
      runBudgetShortfall({ task: TASK, agent: oracle, at: 1_000_000 - left, rolloutDeadlineMs: 1_000_000 });
    expect(at(need)).toBeNull();
    expect(at(need + 1)).toBeNull();
    expect(at(need - 1)).toBe(
      "the rollout's deadline leaves 187.9 s, less than the 188 s that the agent's timeout (120 s), the tests' (60 s) and stopping and grading (8 s) need: the agent was not started (its run could not be graded whatever it did)",
    );
    expect(at(-5000)).toMatch(/^the rollout's deadline leaves 0 s, less than the 188 s/);
  });

  it("counts the agent's own timeout over the task's, and no tests' time for a match verifier", () => {
    const quick = AgentSpec.parse({ harness: "oracle", timeoutS: 5 });
    const args = { agent: quick, at: 0, rolloutDeadlineMs: 73_000 };
    expect(runBudgetShortfall({ ...args, task: TASK })).toBeNull();
    expect(runBudgetShortfall({ ...args, rolloutDeadlineMs: 73_000 - 1, task: TASK })).toMatch(
      /^the rollout's deadline leaves 72\.9 s, less than the 73 s that the agent's timeout \(5 s\), the tests' \(60 s\)/,
    );
    const match = TaskContent.parse({ ...TASK, tests: {}, verifier: { kind: "match", expected: "42" } });
    expect(runBudgetShortfall({ ...args, rolloutDeadlineMs: 13_000, task: match })).toBeNull();
    expect(runBudgetShortfall({ ...args, rolloutDeadlineMs: 12_999, task: match })).toBe(
      "the rollout's deadline leaves 12.9 s, less than the 13 s that the agent's timeout (5 s) and stopping and grading (8 s) need: the agent was not started (its run could not be graded whatever it did)",
    );
  });
});
