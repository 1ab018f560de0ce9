import { readFileSync } from "node:fs";

/** Where Yama, the kernel's ptrace restriction, says who may trace whom; absent without Yama. */
export const PTRACE_SCOPE_FILE = "/proc/sys/kernel/yama/ptrace_scope";

/**
 * Why the tests' own processes are open to the agent's code they run, on a kernel read through
 * `read` (this host's `PTRACE_SCOPE_FILE` by default), or null when they are not.
 *
 * The tests run as root without capabilities, and so does the agent's code they import or start:
 * the same credentials. Unless Yama restricts it (`ptrace_scope` 1 or more: a process may trace
 * only its descendants), the agent's code may `ptrace` its ancestors, the tests and the fleet's
 * runner, or write their memory through `/proc/<pid>/mem`, and make them report a pass. No
 * sandbox setting closes that: the kernel checks only that the credentials match.
 */
export function testsTamperRisk(
  read: () => string = () => readFileSync(PTRACE_SCOPE_FILE, "utf8"),
): string | null {
  let scope: string;
  try {
    scope = read().trim();
  } catch {
    return `the kernel has no Yama ptrace restriction (${PTRACE_SCOPE_FILE} is missing)`;
  }
  return /^[1-3]$/.test(scope) ? null : `kernel.yama.ptrace_scope is ${scope || "empty"}, not 1 or more`;
}
