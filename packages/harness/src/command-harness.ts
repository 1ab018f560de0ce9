import type { AgentSpec } from "@fleet/contracts";
import type { Harness, HarnessContext, HarnessOutcome } from "./harness.ts";
import { runAgentCommand } from "./run-command.ts";

type CommandAgent = Extract<AgentSpec, { harness: "command" }>;

/**
 * Runs an agent CLI that is already in the image: the instruction is written to
 * `/tmp/fleet/instruction.md` and named by `FLEET_INSTRUCTION_FILE`; `argv` runs as the agent
 * user in /workspace with the agent's `env` (the worker's `ctx.env` wins on a clash, and
 * `FLEET_INSTRUCTION_FILE` always wins). The answer is the trimmed stdout, capped.
 */
export class CommandHarness implements Harness {
  readonly name = "command";

  constructor(private readonly agent: CommandAgent) {}

  run(ctx: HarnessContext): Promise<HarnessOutcome> {
    return runAgentCommand(ctx, [...this.agent.argv], { env: this.agent.env });
  }
}
