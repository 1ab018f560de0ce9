export { CommandHarness } from "./command-harness.ts";
export {
  EXEC_OUTPUT_BYTES,
  FLEET_DIR,
  INSTRUCTION_ENV,
  INSTRUCTION_FILE,
  MAX_ANSWER_CHARS,
  MAX_OUTPUT_CHARS,
} from "./constants.ts";
export { createHarness } from "./create-harness.ts";
export { agentDeadline } from "./deadline.ts";
export type { Harness, HarnessContext, HarnessDeps, HarnessOutcome } from "./harness.ts";
export { OracleHarness } from "./oracle-harness.ts";
export { capTail } from "./run-command.ts";
export { stageWorkspace } from "./stage-workspace.ts";
