import { execStringProblem, FleetError } from "@fleet/contracts";

/** Seconds between the deadline's SIGTERM and the SIGKILL that follows (`timeout -k`). */
export const KILL_GRACE_S = 2;

/** Exit codes of coreutils `timeout` when it stopped the command: TERM worked / KILL was needed. */
export const TIMEOUT_EXIT_CODES: ReadonlySet<number> = new Set([124, 137]);

/**
 * Wrap `argv` so the deadline is enforced inside the sandbox by coreutils `timeout`. Without
 * `--foreground`, `timeout` makes itself a process-group leader and on expiry signals the whole
 * group (TERM, then KILL after `killAfterS`), so a command's children die with it: the process
 * tree, not only its root. (A process that leaves the group with `setsid` escapes this; the
 * borrower's `killProcesses` sweep catches those.)
 */
export function deadlineArgv(
  argv: readonly string[],
  deadlineMs: number,
  killAfterS = KILL_GRACE_S,
): string[] {
  if (argv.length === 0)
    throw FleetError.nonRetryable("invalid_task", "exec needs a command (argv is empty)");
  if (!Number.isFinite(deadlineMs) || deadlineMs <= 0) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `exec deadline must be finite and positive, got ${deadlineMs}`,
    );
  }
  const nul = argv.findIndex((a) => a.includes("\0"));
  if (nul >= 0) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `exec argument ${nul} contains a NUL byte, which no command can take`,
    );
  }
  for (const [i, arg] of argv.entries()) {
    const problem = execStringProblem(arg);
    if (problem) throw FleetError.nonRetryable("invalid_task", `exec argument ${i} ${problem}`);
  }
  // By its path: the command's PATH (the caller's to set) must not choose the deadline's enforcer.
  return [TIMEOUT_PATH, "-k", String(killAfterS), formatSeconds(deadlineMs), ...argv];
}

/**
 * coreutils' `timeout`, which every image must have (the probe refuses another, such as busybox's
 * in Alpine without `coreutils`: `assertCoreutilsTimeout`).
 */
export const TIMEOUT_PATH = "/usr/bin/timeout";

/** Milliseconds as a `timeout` duration: seconds with up to 3 decimals, never 0 (which disables it). */
export function formatSeconds(ms: number): string {
  const s = Math.max(ms, 1) / 1000;
  return Number.isInteger(s) ? String(s) : s.toFixed(3).replace(/0+$/, "");
}

/**
 * The exit envelope (DESIGN §2 rule 6): the command's own code, or `-1` with `timedOut` when
 * `timeout` stopped it at the deadline. A 124/137 before the deadline is the command's own code.
 */
export function execOutcome(
  rawExitCode: number,
  elapsedMs: number,
  deadlineMs: number,
): { exitCode: number; timedOut: boolean } {
  if (TIMEOUT_EXIT_CODES.has(rawExitCode) && elapsedMs >= deadlineMs) return { exitCode: -1, timedOut: true };
  return { exitCode: rawExitCode, timedOut: false };
}

/** `uid[:gid]` → numbers; `null` for a user name (resolved inside the sandbox). */
export function parseNumericUser(user: string): { uid: number; gid: number } | null {
  const m = /^(\d+)(?::(\d+))?$/.exec(user);
  if (!m) return null;
  const uid = Number(m[1]);
  return { uid, gid: m[2] === undefined ? uid : Number(m[2]) };
}

/** `{K: V}` → `["K=V"]`, refusing names Docker or a shell would mangle. */
export function envList(env: Readonly<Record<string, string>> | undefined): string[] | undefined {
  if (!env) return undefined;
  const out: string[] = [];
  for (const [k, v] of Object.entries(env)) {
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(k)) {
      throw FleetError.nonRetryable(
        "invalid_task",
        `invalid environment variable name: ${JSON.stringify(k)}`,
      );
    }
    if (v.includes("\0")) {
      throw FleetError.nonRetryable("invalid_task", `environment variable ${k} contains a NUL byte`);
    }
    const entry = `${k}=${v}`;
    const problem = execStringProblem(entry);
    if (problem) throw FleetError.nonRetryable("invalid_task", `environment variable ${k} ${problem}`);
    out.push(entry);
  }
  return out.length > 0 ? out : undefined;
}
