import type { ExecResult } from "@fleet/contracts";
import { capTail } from "../run-command.ts";

/** Characters of stdout and of stderr (each, the tail) a tool result gives back to the model. */
export const TOOL_OUTPUT_CHARS = 8000;
/** Bytes of stdout/stderr the provider collects from one tool command (each). */
export const TOOL_EXEC_OUTPUT_BYTES = 64 * 1024;

/** The one tool the model gets. */
export const BASH_TOOL = {
  type: "function",
  function: {
    name: "bash",
    description:
      "Run a bash command in the task's Linux sandbox (working directory /workspace) and return its exit code, stdout and stderr. Each call starts a fresh shell: only files persist between calls. Commands are killed at a time limit.",
    parameters: {
      type: "object",
      properties: { command: { type: "string", description: "The bash command line to run." } },
      required: ["command"],
      additionalProperties: false,
    },
  },
} as const;

export const TOOL_LOOP_SYSTEM_PROMPT =
  "You are an autonomous agent solving a task in a Linux sandbox. Use the bash tool to inspect and change files in /workspace and to run programs. When you are done, reply with your final answer as plain text and no tool call.";

/** The command of a `bash` tool call, or the error text to give the model instead. */
export function parseBashArguments(args: string): { command: string } | { error: string } {
  // JSON spells a byte in at most 6 characters (`\u0000`): longer arguments hold too long a
  // command, said without parsing megabytes first.
  if (args.length > 6 * MAX_COMMAND_BYTES + 1024) {
    return {
      error: `error: the bash tool's arguments are ${args.length} characters, more than a command of at most ${MAX_COMMAND_BYTES} bytes needs; write long content to a file in smaller pieces`,
    };
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(args);
  } catch {
    return { error: 'error: the bash tool\'s arguments must be a JSON object like {"command": "ls"}' };
  }
  const command =
    typeof parsed === "object" && parsed !== null ? (parsed as { command?: unknown }).command : undefined;
  if (typeof command !== "string" || command.trim() === "") {
    return { error: "error: the bash tool needs a non-empty string `command`" };
  }
  if (command.includes("\0")) {
    return { error: "error: the command contains a NUL byte, which no command line can hold" };
  }
  // One argv string; Linux refuses any over 128 KiB (E2BIG) before the command even starts.
  const bytes = Buffer.byteLength(command);
  if (bytes > MAX_COMMAND_BYTES) {
    return {
      error: `error: the command is ${bytes} bytes, over the ${MAX_COMMAND_BYTES} a command line can hold; write long content to a file in smaller pieces`,
    };
  }
  return { command };
}

/** Longest `command` the bash tool takes (Linux's per-argument limit is 128 KiB). */
export const MAX_COMMAND_BYTES = 100 * 1024;

/** What the model reads back from one command: exit envelope plus capped output tails. */
export function formatToolResult(result: ExecResult, limitS: number): string {
  const status = result.timedOut
    ? `exit_code: -1 (killed: the command did not finish within ${limitS} s)`
    : `exit_code: ${result.exitCode}${result.oomKilled ? " (killed: out of memory)" : ""}`;
  const out = (name: string, text: string, truncated: boolean): string => {
    const capped = capTail(text, TOOL_OUTPUT_CHARS);
    const note = truncated || capped.length < text.length ? " (truncated: last part shown)" : "";
    return `${name}${note}:\n${capped}`;
  };
  return [
    status,
    out("stdout", result.stdout, result.stdoutTruncated),
    out("stderr", result.stderr, result.stderrTruncated),
  ].join("\n");
}
