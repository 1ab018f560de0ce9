/** Directory for harness files inside the sandbox (outside the agent's workspace). */
export const FLEET_DIR = "/tmp/fleet";
/** Where every harness writes the task's instruction before the agent starts. */
export const INSTRUCTION_FILE = `${FLEET_DIR}/instruction.md`;
/** Environment variable naming the instruction file for the agent's command. */
export const INSTRUCTION_ENV = "FLEET_INSTRUCTION_FILE";
/** Cap for the final answer (characters): the contracts' own, which a match task's `expected` is held to. */
export { MAX_ANSWER_CHARS } from "@fleet/contracts";
/** Cap for the stdout/stderr tails kept in a harness outcome (characters, each). */
export const MAX_OUTPUT_CHARS = 4000;
/** Bytes of stdout/stderr the provider collects from an agent command (each). */
export const EXEC_OUTPUT_BYTES = 256 * 1024;
