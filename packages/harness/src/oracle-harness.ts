import { FleetError, fileModes } from "@fleet/contracts";
import { ROOT_USER, SANDBOX_PATHS } from "@fleet/sandbox";
import type { Harness, HarnessContext, HarnessOutcome } from "./harness.ts";
import { runAgentCommand } from "./run-command.ts";

/**
 * Runs the task's reference solution: stages `solution/` at /solution (owned by root) and runs
 * `bash /solution/solve.sh` as the agent user in /workspace under the deadline. Validates tasks
 * and the fleet itself (every example task must score 1.0 with it).
 */
export class OracleHarness implements Harness {
  readonly name = "oracle";

  async run(ctx: HarnessContext): Promise<HarnessOutcome> {
    if (ctx.task.solution["solve.sh"] === undefined) {
      throw FleetError.nonRetryable(
        "invalid_task",
        `task "${ctx.task.id}" has no solution/solve.sh, so the oracle agent cannot run it`,
      );
    }
    return runAgentCommand(ctx, ["bash", `${SANDBOX_PATHS.solution}/solve.sh`], {
      // /solution belongs to root (0755): the solution is staged as root, readable by the agent.
      stage: {
        dir: SANDBOX_PATHS.solution,
        files: ctx.task.solution,
        user: ROOT_USER,
        modes: fileModes(ctx.task, "solution"),
      },
    });
  }
}
