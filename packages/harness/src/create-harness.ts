import type { AgentSpec } from "@fleet/contracts";
import { CommandHarness } from "./command-harness.ts";
import type { Harness, HarnessDeps } from "./harness.ts";
import { OracleHarness } from "./oracle-harness.ts";
import { ToolLoopHarness } from "./tool-loop/tool-loop-harness.ts";

function assertNever(x: never): never {
  throw new Error(`unhandled harness: ${JSON.stringify(x)}`);
}

/**
 * The one place that maps an agent spec to its harness.
 */
export function createHarness(agent: AgentSpec, deps: HarnessDeps = {}): Harness {
  switch (agent.harness) {
    case "oracle":
      return new OracleHarness();
    case "command":
      // With a `model`, the run stage supplies the gateway's URL and token through `ctx.env`.
      return new CommandHarness(agent);
    case "tool-loop":
      return new ToolLoopHarness(agent, deps);
    default:
      return assertNever(agent);
  }
}
