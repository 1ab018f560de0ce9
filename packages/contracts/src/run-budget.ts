import type { AgentSpec } from "./agent.ts";
import type { TaskContent } from "./task.ts";

/**
 * How far past its own deadline an agent can keep its run going: its command ignores the SIGTERM
 * at its deadline and is killed the kill grace (2 s) later, or it stops the `timeout` that would
 * kill it and the run stage's own sweep kills it half a second after that; then the kill's own
 * call. A run's margin holds this apart, so an agent that makes the most of it takes none of the
 * time the fleet's own steps have (its tests then cut by the rollout's deadline, and masked: a
 * mask the agent chose by being slow to stop). Not covered: an agent that also kills every sweep
 * of its uid, whose stop waits for a reaper (Docker: a helper container, seconds on a loaded
 * host); nor a fork bomb's, which takes as long as the kernel needs to end it.
 */
export const AGENT_OVERRUN_MS = 3_000;

/**
 * Time a run must still have before the rollout's deadline beyond the agent's own budget and
 * the verifier's: the agent's overrun (`AGENT_OVERRUN_MS`), then 5 s for the fleet's own steps:
 * stopping the agent and confirming it gone, the hops to verify, staging the tests, reading the
 * reward, closing.
 */
export const RUN_MARGIN_MS = AGENT_OVERRUN_MS + 5_000;

/**
 * Why a run starting at `at` cannot be graded whatever its agent does, or `null` when it can: the
 * rollout's deadline comes before the agent's own timeout, the verification (a `tests`
 * verifier's `timeouts.verifierS`) and `RUN_MARGIN_MS`. Such a run is masked before it starts
 * (DESIGN §2 rule 6): started, it would be graded when its agent was quick and masked when it
 * was slow, and a policy could trade its slow failures for masks (the masks biased toward
 * failures). It comes of a rollout that waited long in the queues or a `deadlineS` shorter than
 * the task's timeouts, never of anything the agent did.
 */
export function runBudgetShortfall(input: {
  task: TaskContent;
  agent: AgentSpec;
  at: number;
  rolloutDeadlineMs: number;
}): string | null {
  const { ownS, verifyS, needMs } = runNeeds(input.task, input.agent);
  const leftMs = input.rolloutDeadlineMs - input.at;
  if (leftMs >= needMs) return null;
  const s = (ms: number) => `${Math.max(0, Math.floor(ms / 100) / 10)} s`;
  return (
    `the rollout's deadline leaves ${s(leftMs)}, less than the ${s(needMs)} that the agent's timeout (${ownS} s)` +
    (verifyS > 0 ? `, the tests' (${verifyS} s)` : "") +
    ` and stopping and grading (${RUN_MARGIN_MS / 1000} s) need: the agent was not started (its run could not be graded whatever it did)`
  );
}

/** What a run needs of its rollout's budget when it starts: the agent's timeout, the tests' and `RUN_MARGIN_MS`. */
export function runNeeds(
  task: TaskContent,
  agent: Pick<AgentSpec, "timeoutS">,
): { ownS: number; verifyS: number; needMs: number } {
  const ownS = agent.timeoutS ?? task.timeouts.agentS;
  const verifyS = task.verifier.kind === "tests" ? task.timeouts.verifierS : 0;
  return { ownS, verifyS, needMs: (ownS + verifyS) * 1000 + RUN_MARGIN_MS };
}

/**
 * What admission adds to `runNeeds` for the time before the run starts (queueing, the sandbox's
 * making and probe): a `deadlineS` with less could never reach its run with enough left (422).
 */
export const ADMISSION_ALLOWANCE_MS = 10_000;
