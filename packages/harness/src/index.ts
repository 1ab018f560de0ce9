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
export {
  BASH_TOOL,
  TOOL_EXEC_OUTPUT_BYTES,
  TOOL_LOOP_SYSTEM_PROMPT,
  TOOL_OUTPUT_CHARS,
} from "./tool-loop/bash-tool.ts";
export {
  backoffMs,
  DEFAULT_RETRY_POLICY,
  isContextLengthError,
  type RetryPolicy,
  retryAfterMs,
} from "./tool-loop/chat-client.ts";
export {
  ToolLoopHarness,
  type ToolLoopHarnessOptions,
  type ToolLoopStop,
} from "./tool-loop/tool-loop-harness.ts";
export { TRANSCRIPT_MAX_CHARS } from "./tool-loop/transcript.ts";
