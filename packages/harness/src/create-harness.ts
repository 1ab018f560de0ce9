import { type AgentSpec, FleetError } from "@fleet/contracts";
import { CommandHarness } from "./command-harness.ts";
import type { Harness, HarnessDeps } from "./harness.ts";
import { OracleHarness } from "./oracle-harness.ts";
import { ToolLoopHarness } from "./tool-loop/tool-loop-harness.ts";

function assertNever(x: never): never {
  throw new Error(`unhandled harness: ${JSON.stringify(x)}`);
}

/**
 * The one place that maps an agent spec to its harness.
 *
 * @throws FleetError `agent_error` (final) for a harness or option this build cannot run yet.
 */
export function createHarness(agent: AgentSpec, deps: HarnessDeps = {}): Harness {
  switch (agent.harness) {
    case "oracle":
      return new OracleHarness();
    case "command":
      if (agent.model !== undefined) {
        // Seam: the per-rollout model gateway (command agent with a model) comes with tool-loop.
        throw FleetError.nonRetryable(
          "agent_error",
          "command agents with a `model` (model gateway) are not available yet",
        );
      }
      return new CommandHarness(agent);
    case "tool-loop":
      return new ToolLoopHarness(agent, deps);
    default:
      return assertNever(agent);
  }
}
