import type { AgentSpec, TaskContent } from "@fleet/contracts";

/**
 * The absolute deadline for the agent's command: its own budget (`agent.timeoutS`, else the
 * task's `timeouts.agentS`) from `startedAt`, never past the rollout's deadline. `limitedBy`
 * says which one bound it, so the caller can tell the agent's own timeout (graded,
 * `agent_timeout`) from the rollout running out.
 */
export function agentDeadline(input: {
  task: TaskContent;
  agent: AgentSpec;
  startedAt: number;
  rolloutDeadlineMs?: number | null;
}): { deadlineMs: number; limitedBy: "agent" | "rollout" } {
  const ownS = input.agent.timeoutS ?? input.task.timeouts.agentS;
  const own = input.startedAt + ownS * 1000;
  const rollout = input.rolloutDeadlineMs ?? Number.POSITIVE_INFINITY;
  return rollout < own
    ? { deadlineMs: rollout, limitedBy: "rollout" }
    : { deadlineMs: own, limitedBy: "agent" };
}
