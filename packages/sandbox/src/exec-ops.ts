import { readFileSync, readlinkSync } from "node:fs";
import type { Readable, Writable } from "node:stream";
import {
  type CleanupReceipt,
  capText,
  ExecOptions,
  type ExecResult,
  endedBySignal,
  FileSet,
  FleetError,
  isFleetError,
  MAX_DURATION_S,
  Millis,
  type ProviderName,
  type SandboxHandle,
  SandboxOptions,
  SandboxSpec,
  type SandboxSpecInput,
} from "@fleet/contracts";
import { KEEPALIVE_USER, type SandboxLimits } from "./docker/container-config.ts";
import { KILL_GRACE_S, parseNumericUser, TIMEOUT_PATH } from "./exec-command.ts";
import type { CappedBuffer } from "./output.ts";
import {
  AGENT_USER,
  type KillOptions,
  madeByAnotherInstance,
  OPS_CWD,
  type PutOptions,
  ROOT_USER,
  SANDBOX_PATHS,
  type SandboxInfo,
  TestsSupersededError,
  VERIFY_FENCE_FILE,
} from "./provider.ts";
import { buildTar } from "./tar.ts";
import { formatIssues } from "./validation.ts";

/**
 * Sandbox operations both providers build on an exec of their own (Docker exec API, or
 * nsenter into a bwrap tree). Internal to this package: not re-exported from `index.ts`.
 */

/** The defaults both providers' execs share; each provider's own defaults extend these. */
export interface ExecDefaults {
  /** User execs run as when the caller names none. @defaultValue AGENT_USER (`1000:1000`) */
  execUser: string;
  /** Cap for stdout and for stderr of one exec. @defaultValue 1 MiB */
  maxOutputBytes: number;
  /** Budget of the isolation probe. @defaultValue 10_000 */
  probeTimeoutMs: number;
  /** Seconds between SIGTERM and SIGKILL at an exec's deadline. @defaultValue 2 */
  killGraceS: number;
  /** Slack of the host-side safety timer beyond deadline + kill grace. @defaultValue 5_000 */
  execSlackMs: number;
  /** Rounds of `kill -9 -1` + /proc scan in `killProcesses`. @defaultValue 50 */
  killRounds: number;
}

export const DEFAULT_EXEC_DEFAULTS: Readonly<ExecDefaults> = Object.freeze({
  execUser: AGENT_USER,
  maxOutputBytes: 1024 * 1024,
  probeTimeoutMs: 10_000,
  killGraceS: KILL_GRACE_S,
  execSlackMs: 5_000,
  killRounds: 50,
});

/** Why a value is none a provider default can take (null when it is one). */
export type DefaultCheck = (value: unknown) => string | null;

/** A check by a contracts schema (the one a task's own value of it passes). */
export function bySchema(schema: {
  safeParse(value: unknown): { success: boolean; error?: { issues: Parameters<typeof formatIssues>[0] } };
}): DefaultCheck {
  return (value) => {
    if (value === undefined) return "must be set";
    const parsed = schema.safeParse(value);
    return parsed.success ? null : formatIssues(parsed.error?.issues ?? []);
  };
}

const MAX_DEFAULT_MS = MAX_DURATION_S * 1000;

/** A finite number of `min` or more (`inclusive`) or above it, at most `max`. */
function numberCheck(
  what: string,
  min: number,
  inclusive: boolean,
  max: number,
  whole = false,
): DefaultCheck {
  return (value) =>
    typeof value === "number" &&
    Number.isFinite(value) &&
    (inclusive ? value >= min : value > min) &&
    value <= max &&
    (!whole || Number.isInteger(value))
      ? null
      : `must be ${what}`;
}

/** The checks of `ExecDefaults`, which both providers' defaults extend. */
export const EXEC_DEFAULTS_CHECKS: Readonly<Record<keyof ExecDefaults, DefaultCheck>> = Object.freeze({
  execUser: (v) => (typeof v === "string" && v !== "" ? null : "must be a user (uid[:gid] or a name)"),
  maxOutputBytes: bySchema(ExecOptions.shape.maxOutputBytes.unwrap()),
  probeTimeoutMs: bySchema(Millis),
  // 0 is no kill at all (`timeout -k 0` never sends the SIGKILL).
  killGraceS: numberCheck(`a number of seconds above 0, at most ${MAX_DURATION_S}`, 0, false, MAX_DURATION_S),
  execSlackMs: numberCheck(`a number of milliseconds from 0 to ${MAX_DEFAULT_MS}`, 0, true, MAX_DEFAULT_MS),
  killRounds: numberCheck("a whole number from 1", 1, true, Number.MAX_SAFE_INTEGER, true),
});

/** The checks of `SandboxLimits` (a task's own bounds of each, in `SandboxOptions`). */
export const SANDBOX_LIMITS_CHECKS: Readonly<Record<keyof SandboxLimits, DefaultCheck>> = Object.freeze({
  memoryMb: bySchema(SandboxOptions.shape.memoryMb.unwrap()),
  cpus: bySchema(SandboxOptions.shape.cpus.unwrap()),
  pidsLimit: bySchema(SandboxOptions.shape.pidsLimit.unwrap()),
  tmpfsMb: bySchema(SandboxOptions.shape.tmpfsMb.unwrap()),
  // null: an uncapped workspace (a volume), opted into by the operator.
  diskMb: (v) => (v === null ? null : bySchema(SandboxOptions.shape.diskMb.unwrap())(v)),
  readOnlyRoot: (v) => (typeof v === "boolean" ? null : "must be true or false"),
});

/**
 * Refuse a provider's defaults (the merged ones, with what the constructor was given) of which
 * any is none it can use, or names none it has: a final `invalid_task` from the constructor,
 * saying which. Unchecked, a provider built with one (a `maxOutputBytes` of 0, a timeout of
 * NaN) started as if well, and then failed every rollout's execs or sandboxes, each a final
 * `invalid_task` blamed on the task, or gave no limit (a `pidsLimit` of 0 or less is none to Docker).
 */
export function checkProviderDefaults(
  provider: ProviderName,
  defaults: Readonly<Record<string, unknown>>,
  checks: Readonly<Record<string, DefaultCheck>>,
): void {
  const problems: string[] = [];
  for (const [key, value] of Object.entries(defaults)) {
    const check = Object.hasOwn(checks, key) ? checks[key] : undefined;
    const problem = check ? check(value) : `is no default of the ${provider} provider`;
    if (problem !== null) problems.push(`${key}: ${problem}`);
  }
  if (problems.length > 0) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `invalid ${provider} provider defaults: ${problems.join("; ")}`,
    );
  }
}

/**
 * A command's standard input: one buffer, or a source read from its start for each exec (a
 * `Spool`: an image's /workspace archive, up to the workspace's cap, in memory or in a file).
 */
export type ExecStdin = Buffer | { read(): Readable };

/**
 * Write `stdin` to a command's input stream and end it. A source that fails part way destroys
 * the stream: the command sees its input cut, never a whole one.
 */
export function endWithStdin(stream: Writable, stdin: ExecStdin): void {
  if (Buffer.isBuffer(stdin)) {
    stream.end(stdin);
    return;
  }
  const source = stdin.read();
  source.once("error", (err) => stream.destroy(err));
  source.pipe(stream);
}

/** What the operations below pass to a provider's exec. */
export interface ExecCall {
  deadlineMs: number;
  user: string;
  stdin: ExecStdin | null;
  maxOutputBytes: number;
  /**
   * Capabilities the command keeps (none otherwise): only the root kill sweep asks, for `kill`,
   * from providers whose exec can grant one (bubblewrap's).
   */
  keepCaps?: readonly string[];
  /** Where the command starts: the operations below pass `OPS_CWD`. */
  cwd?: string;
}

/** A provider's exec, bound to one sandbox. */
export type SandboxExec = (argv: readonly string[], o: ExecCall) => Promise<ExecResult>;

/** A validated `exec` call: `SandboxProvider.exec`'s options with the provider's default user. */
export interface ParsedExecOptions extends ExecCall {
  env?: Record<string, string>;
  cwd?: string | undefined;
}

/** Where the staging-only mounts are; `put` there defaults to root so the agent cannot write them. */
const ROOT_STAGED = [SANDBOX_PATHS.tests, SANDBOX_PATHS.solution];

export function parseSandboxSpec(input: SandboxSpecInput): SandboxSpec {
  const parsed = SandboxSpec.safeParse(input);
  if (!parsed.success) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `invalid sandbox spec: ${formatIssues(parsed.error.issues)}`,
    );
  }
  return parsed.data;
}

/**
 * A caller's exec options checked, with the provider's defaults (`ExecDefaults`) for the user
 * and the output cap it names none of.
 */
export function parseExecOptions(
  options: ExecOptions,
  defaults: Pick<ExecDefaults, "execUser" | "maxOutputBytes">,
): ParsedExecOptions {
  // The provider's cap, not the schema's own default: `defaults.maxOutputBytes` is what an
  // operator set to bound every command's output.
  const parsed = ExecOptions.safeParse(
    options?.maxOutputBytes === undefined ? { ...options, maxOutputBytes: defaults.maxOutputBytes } : options,
  );
  if (!parsed.success) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `invalid exec options: ${formatIssues(parsed.error.issues)}`,
    );
  }
  const o = parsed.data;
  return {
    deadlineMs: o.deadlineMs,
    env: o.env,
    cwd: o.cwd,
    user: o.user ?? defaults.execUser,
    stdin: o.stdin === undefined ? null : Buffer.from(o.stdin, "utf8"),
    maxOutputBytes: o.maxOutputBytes,
  };
}

/** The `ExecResult` of finished (or host-timed-out) output buffers, plus the unmapped exit code. */
export function execResult(
  exitCode: number,
  timedOut: boolean,
  stdout: CappedBuffer,
  stderr: CappedBuffer,
  durationMs: number,
  rawExitCode: number,
): ExecResult & { rawExitCode: number } {
  return {
    exitCode,
    timedOut,
    stdout: stdout.text(),
    stderr: stderr.text(),
    stdoutTruncated: stdout.truncated,
    stderrTruncated: stderr.truncated,
    durationMs,
    oomKilled: false,
    rawExitCode,
  };
}

/** `find` on top of `list`: the sandbox of the expected name if several match. */
export async function findSandbox(
  list: (labels: Record<string, string>) => Promise<SandboxInfo[]>,
  labels: Record<string, string>,
  expectedName: string,
  /** This deployment's id: another's sandbox for the same rollout id is never this rollout's. */
  instance?: string,
): Promise<SandboxHandle | null> {
  const found = (await list(labels)).filter((s) => !madeByAnotherInstance(s.labels, instance));
  if (found.length === 0) return null;
  return (found.find((s) => s.handle.name === expectedName) ?? found[0]!).handle;
}

/** `get`'s path checked: absolute, normalized, without `..`. */
export function getTarget(path: string): string {
  if (!path.startsWith("/"))
    throw FleetError.nonRetryable("invalid_task", `get needs an absolute path: ${path}`);
  return normalizeAbsolute(path);
}

export function normalizeAbsolute(path: string): string {
  const parts: string[] = [];
  for (const p of path.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") throw FleetError.nonRetryable("invalid_task", `path must not contain '..': ${path}`);
    parts.push(p);
  }
  return `/${parts.join("/")}`;
}

/** A `put` call checked: absolute target, valid files, the writing user (numeric) and its ids. */
export interface PutPlan {
  target: string;
  files: FileSet;
  user: string;
  ids: { uid: number; gid: number };
}

export function planPut(
  dir: string,
  files: FileSet,
  userOption: string | undefined,
  execUser: string,
): PutPlan {
  if (!dir.startsWith("/"))
    throw FleetError.nonRetryable("invalid_task", `put needs an absolute directory: ${dir}`);
  const checked = FileSet.safeParse(files);
  if (!checked.success) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `invalid files for ${dir}: ${formatIssues(checked.error.issues)}`,
    );
  }
  const target = normalizeAbsolute(dir);
  const user =
    userOption ??
    (ROOT_STAGED.some((p) => target === p || target.startsWith(`${p}/`)) ? ROOT_USER : execUser);
  const ids = parseNumericUser(user);
  if (ids === null)
    throw FleetError.nonRetryable("invalid_task", `put needs a numeric uid[:gid], got ${user}`);
  return { target, files: checked.data, user, ids };
}

/**
 * Shell fragment: when `$2` is 1 and directory `$1` exists, delete everything in it and exit 3
 * naming what is left if anything could not be deleted (e.g. a file of another user in a sticky
 * directory: the sandbox's root has no capabilities), or when the directory cannot be listed
 * (fail closed). What the user owns is made writable first (a read-only tree it left behind).
 * Before exiting it drains stdin, so a caller streaming an archive sees this error rather than a
 * broken pipe.
 */
const CLEAR_DIR = `if [ "$2" = 1 ] && [ -d "$1" ]; then
  chmod -R u+rwX -- "$1" 2>/dev/null
  find "$1" -mindepth 1 -delete 2>/dev/null
  if ! left=$(ls -A -- "$1" 2>&1); then
    echo "cannot clear $1: cannot list it: $left" >&2; cat > /dev/null 2>&1; exit 3
  fi
  if [ -n "$left" ]; then
    echo "cannot clear $1, left: $(printf '%s\\n' "$left" | head -n 5 | tr '\\n' ' ')" >&2
    cat > /dev/null 2>&1; exit 3
  fi
fi`;

/** Shell fragment: the sandbox's verify fence in `$f`, 0 when it is absent or no number. */
const READ_FENCE = `f=; IFS= read -r f 2>/dev/null < ${VERIFY_FENCE_FILE}; case "$f" in "" | *[!0-9]*) f=0 ;; esac;`;

/**
 * Shell fragment: when `$<epochVar>` is a verify attempt's epoch and the sandbox's verify fence
 * (`VERIFY_FENCE_FILE`) holds a higher one, run `refuse` with the fence's epoch in `$f`. Reads
 * only; a fence absent or unreadable as a number refuses nothing.
 */
export function fenceCheck(epochVar: string, refuse: string): string {
  return `case "$${epochVar}" in "" | *[!0-9]*) ;; *)
  ${READ_FENCE}
  if [ "$f" -gt "$${epochVar}" ] 2>/dev/null; then ${refuse}; fi ;;
esac`;
}

/** The exit status of a staging exec that found the sandbox fenced by a later verify attempt. */
const FENCED_EXIT = 75;

/**
 * Raise the sandbox's verify fence to the epoch `$1`, never lowering it (a later attempt's
 * stands): run as the fence's owner (`KEEPALIVE_USER`; the tests, root without capabilities,
 * can neither write nor replace it), through a temporary file renamed over it. Prints
 * `fenced=1` when the fence holds at least `$1`, else `fenced=0` (a sandbox without the fence's
 * mount, say).
 */
const RAISE_FENCE_SCRIPT = `umask 022
${READ_FENCE}
if [ "$f" -ge "$1" ] 2>/dev/null; then echo fenced=1; exit 0; fi
t=${VERIFY_FENCE_FILE}.$$
if printf '%s\\n' "$1" 2>/dev/null > "$t" && chmod 0644 "$t" && mv -f "$t" ${VERIFY_FENCE_FILE} 2>/dev/null; then
  echo fenced=1
else
  rm -f "$t" 2>/dev/null; echo fenced=0
fi`;

/**
 * `extractViaExec`'s script: `$1` the directory, `$2` 1 to empty it first, `$3` a verify epoch
 * the sandbox's verify fence must not be above ('' for none).
 */
const EXTRACT_SCRIPT = `${fenceCheck("3", `echo "fenced $f" >&2; cat > /dev/null 2>&1; exit ${FENCED_EXIT}`)}
${CLEAR_DIR}
mkdir -p -- "$1" && exec tar -x -p --no-same-owner -f - -C "$1"`;

/**
 * Extract the files inside the sandbox with `tar -x` on stdin, as the plan's user; with
 * `replace`, the target directory is emptied first in the same exec. With `fenceEpoch`, nothing
 * is touched when the sandbox's verify fence holds a higher epoch (`TestsSupersededError`).
 */
export async function extractViaExec(
  exec: SandboxExec,
  plan: PutPlan,
  options: Pick<PutOptions, "mode" | "modes" | "replace" | "fenceEpoch"> = {},
): Promise<void> {
  const { target, user } = plan;
  const replace = options.replace ?? false;
  const archive = await buildTar(plan.files, { ...plan.ids, mode: options.mode, modes: options.modes });
  const what = `staging ${Object.keys(plan.files).length} file(s) into ${target}`;
  const epoch = options.fenceEpoch === undefined ? "" : String(options.fenceEpoch);
  await stagingScript(
    exec,
    EXTRACT_SCRIPT,
    [target, replace ? "1" : "0", epoch],
    user,
    archive,
    what,
    (r) => {
      const fenced = r.exitCode === FENCED_EXIT ? /(?:^|\n)fenced (\d+)\n/.exec(r.stderr) : null;
      if (fenced) throw new TestsSupersededError(Number(fenced[1]), options.fenceEpoch ?? 0);
    },
  );
}

/**
 * Extract a tar as Docker's archive API makes it (entries `<dir name>/…`) into `dir`, as `user`
 * (the files become theirs; modes kept).
 */
export async function extractArchiveViaExec(
  exec: SandboxExec,
  archive: ExecStdin,
  dir: string,
  user: string,
): Promise<void> {
  const script = 'exec tar -x -p --no-same-owner --strip-components=1 -f - -C "$1"';
  await stagingScript(exec, script, [dir], user, archive, `staging the image's ${dir} files`);
}

/**
 * Run a staging shell script as `user`; a non-zero exit is final `invalid_task` saying `what`
 * failed. Out of time or killed (exit -1, or 128 + a signal: a loaded host, a daemon stall, the
 * sandbox killed) is nothing the task did: retryable `provider_unavailable`.
 */
async function stagingScript(
  exec: SandboxExec,
  script: string,
  args: readonly string[],
  user: string,
  stdin: ExecStdin | null,
  what: string,
  check?: (r: ExecResult) => void,
): Promise<void> {
  const r = await exec(["/bin/sh", "-c", script, "sh", ...args], {
    deadlineMs: 120_000,
    cwd: OPS_CWD,
    user,
    stdin,
    maxOutputBytes: 16 * 1024,
  });
  check?.(r);
  if (r.timedOut || endedBySignal(r.exitCode)) {
    throw FleetError.retryable(
      "provider_unavailable",
      `${what} as ${user} ${r.timedOut ? "ran out of time" : `was killed (exit ${r.exitCode})`}: ${r.stderr.trim()}`,
    );
  }
  if (r.exitCode !== 0) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `${what} as ${user} failed (exit ${r.exitCode}): ${r.stderr.trim()}`,
    );
  }
}

/**
 * Read a regular file with `cat`, trying `users` in order until one reads it: null when it is
 * missing (for all of them) or not a regular file; `invalid_task` when it is there and no one
 * may read it.
 */
export async function readViaExec(
  exec: SandboxExec,
  path: string,
  users: readonly string[],
  maxBytes: number,
): Promise<string | null> {
  // 44: not there, or not visible to this user (root without capabilities cannot search an
  // agent's 0700 directory): the next user may see it. 46: there, but not a regular file (a
  // directory, a FIFO `cat` would block on): null, as for a missing one. 45: not readable.
  // Only the first `maxBytes` are read (`head -c`): all of them (`cat`) took a sparse file of
  // 200 GiB, which costs the sandbox no space, past the exec's minute, a retryable failure where
  // the code under test chose it (the verifier reads a long reward file this way).
  // Readable is told by opening it (`true < "$1"`: a regular built-in, whose failed redirection
  // does not end the shell), not by `[ -r ]` alone: busybox's `sh` (an Alpine image's, coreutils
  // installed) says yes to root for any file, and root here has no capability to read one of
  // mode 000, so `head` failed (exit 1), a retryable exec failure (masked) for a file the code
  // under test made unreadable.
  const script =
    'if [ ! -e "$1" ]; then exit 44; fi; [ -f "$1" ] || exit 46; { [ -r "$1" ] && true 2>/dev/null < "$1"; } || exit 45; exec head -c "$2" -- "$1"';
  let unreadable = false;
  for (const user of users) {
    const r = await exec(["/bin/sh", "-c", script, "sh", path, String(maxBytes)], {
      deadlineMs: 60_000,
      cwd: OPS_CWD,
      user,
      stdin: null,
      maxOutputBytes: maxBytes,
    });
    if (r.exitCode === 0) return r.stdout;
    if (r.exitCode === 46) return null;
    if (r.exitCode === 45) unreadable = true;
    else if (r.exitCode !== 44) {
      throw FleetError.retryable(
        "provider_unavailable",
        `reading ${path} failed (exit ${r.exitCode}): ${r.stderr}`,
      );
    }
  }
  if (!unreadable) return null;
  throw FleetError.nonRetryable("invalid_task", `${path} exists but is not readable in the sandbox`);
}

/** What the probe compares the sandbox with: this process's namespaces and command line. */
export interface HostProbeFacts {
  pidNs: string;
  netNs: string;
  /** The host sentinel: this very process, whose pid must name nothing (or someone else) inside. */
  sentinelPid: number;
  sentinelCmdline: string;
}

let hostFacts: HostProbeFacts | null = null;

/** This process's facts, read from /proc once (they do not change while it lives). */
export function hostProbeFacts(): HostProbeFacts {
  hostFacts ??= {
    pidNs: readlinkSync("/proc/self/ns/pid"),
    netNs: readlinkSync("/proc/self/ns/net"),
    sentinelPid: process.pid,
    sentinelCmdline: readFileSync("/proc/self/cmdline").toString("latin1").replaceAll("\0", " ").trim(),
  };
  return hostFacts;
}

/** The probe script's line printing the sentinel's command line as seen inside (empty if absent). */
export function sentinelProbeLine(sentinelPid: number): string {
  return `tr '\\000' ' ' < /proc/${sentinelPid}/cmdline 2>/dev/null; echo`;
}

/** The probe script's line saying whether /workspace is empty (`empty`; `files` also when unreadable). */
export const WORKSPACE_PROBE_LINE = `w=${SANDBOX_PATHS.workspace}; if [ -d "$w" ] && l=$(ls -A "$w") && [ -z "$l" ]; then echo empty; else echo files; fi`;

/**
 * The probe script's line naming the `timeout` every exec runs under (`TIMEOUT_PATH`): `coreutils`
 * when it is coreutils' (GNU's, or uutils' as in Ubuntu 25.10), `other` otherwise (busybox's, as
 * in Alpine, prints no version).
 */
export const TIMEOUT_PROBE_LINE = `case "$(${TIMEOUT_PATH} --version 2>/dev/null | head -n 1)" in *coreutils*) echo coreutils ;; *) echo other ;; esac`;

/**
 * Refuse an image whose `timeout` is not coreutils' (`TIMEOUT_PROBE_LINE` said `other`), as the
 * task's (final `invalid_task`): the deadline rests on coreutils' `timeout`. Busybox's exits 143
 * at the deadline, not 124, so a run or tests cut by it read as the command's own exit (graded,
 * never `agent_timeout`, never masked when the rollout's deadline cut them); it signals only the
 * command, not its process group; and it drops a duration's fraction (2.9 s ends at 2 s).
 */
export function assertCoreutilsTimeout(name: string, line: string): void {
  if (line === "coreutils") return;
  throw FleetError.nonRetryable(
    "invalid_task",
    `the sandbox image of ${name} has a ${TIMEOUT_PATH} that is not coreutils' (busybox's, as in Alpine?): the fleet's deadlines need coreutils' timeout; install coreutils in the image (apk add coreutils)`,
  );
}

/** The probe script's stdout, or a plain `Error` if it timed out or exited non-zero. */
export function probeStdout(r: ExecResult, timeoutMs: number): string {
  // 127: not found. 126 is also what Docker reports for any exec the runtime failed to start
  // (a loaded host): the image's fault only when the runtime says what was missing.
  const missing =
    r.exitCode === 127 ||
    (r.exitCode === 126 &&
      // The runtime names the program it could not exec (not a path of its own, such as a
      // cgroup file it failed to open under load).
      /exec: "[^"]*": (?:stat [^:]*: )?(?:no such file or directory|permission denied)|executable file not found|: not found$/im.test(
        `${r.stdout}\n${r.stderr}`,
      ));
  if (!r.timedOut && missing) {
    // Not found or not executable: the image lacks what every sandbox command needs (a coreutils
    // `/usr/bin/timeout`, `sh`, the probe's tools). Nothing a retry fixes: the task's image.
    throw FleetError.nonRetryable(
      "invalid_task",
      `the sandbox image cannot run the fleet's commands (exit ${r.exitCode}; it needs /usr/bin/timeout, sh and coreutils): ${capText(`${r.stdout.trim()} ${r.stderr.trim()}`.trim(), 300)}`,
    );
  }
  if (r.timedOut || r.exitCode !== 0) {
    throw new Error(
      r.timedOut ? `probe timed out after ${timeoutMs} ms` : `probe exited ${r.exitCode}: ${r.stderr}`,
    );
  }
  return r.stdout;
}

/**
 * True while a container's PID 1 is still the runtime's start shim (`runc init`): the container
 * start call can return before that process has exec'd the sandbox's own init, and a probe that
 * lands in between would read the shim's command line and refuse a sound sandbox.
 */
export function pid1Starting(pid1: string): boolean {
  return /^(\S*\/)?runc init( |$)/.test(pid1.trim());
}

/** How long the probe waits for a starting container's PID 1 to become the sandbox's init. */
export const PID1_SETTLE_MS = 2_000;

/**
 * Run the probe script (`once` returns its stdout) again while the PID 1 line (the second) shows
 * the runtime's start shim, or reads empty (PID 1 caught mid-exec, between the shim and the
 * sandbox's init: seen under load), every `pollMs`, for up to `settleMs`; then the last output
 * stands and the checks judge it (a PID 1 that never settles is still refused).
 */
export async function probeWhilePid1Starts(
  once: () => Promise<string>,
  settleMs: number = PID1_SETTLE_MS,
  pollMs = 50,
): Promise<string> {
  const until = Date.now() + settleMs;
  const settling = (out: string) => {
    const pid1 = out.split("\n")[1] ?? "";
    return pid1Starting(pid1) || pid1.trim() === "";
  };
  let stdout = await once();
  while (settling(stdout) && Date.now() < until) {
    await delay(pollMs);
    stdout = await once();
  }
  return stdout;
}

/** How the probe script runs: as root, within the probe's budget. */
export function probeExecCall(timeoutMs: number): ExecCall {
  return { deadlineMs: timeoutMs, user: ROOT_USER, stdin: null, maxOutputBytes: 64 * 1024 };
}

/** A probe whose checks did not all pass: final `isolation_refused`, naming the failed ones. */
export function assertIsolated(name: string, checks: Record<string, boolean>, detail: string): boolean {
  const isolated = Object.values(checks).every(Boolean);
  if (!isolated) {
    const failed = Object.entries(checks)
      .filter(([, ok]) => !ok)
      .map(([k]) => k);
    throw FleetError.nonRetryable(
      "isolation_refused",
      `sandbox ${name} is not isolated from the host (failed: ${failed.join(", ")}): ${detail}`,
    );
  }
  return isolated;
}

/**
 * Shell: `lp` sets `l` to the last pid the kernel gave out in the caller's PID namespace (the
 * fifth field of `/proc/loadavg`; empty where it cannot be read). A /proc scan lists the pids
 * once, at its start: a process made after that is not in it, and one that exits first is read
 * as gone. An agent whose every process starts the next and exits (its pid changes all the time)
 * was never there when the scan came to it, so a sweep counted none left while it ran on. A scan
 * is complete only when `l` is the same after it as before: nothing was made meanwhile.
 */
const LAST_PID = "lp() { l=; read -r _a _b _c _d l _e 2>/dev/null < /proc/loadavg; };";

/**
 * Shell, for a sweep that stops processes (`sig STOP`) before it kills them: stop passes until
 * one ran while no process was made (every process of the uid is then stopped, and a stopped
 * process cannot fork), at most 20 a round.
 */
const STOP_UNTIL_STILL =
  'j=0; while :; do lp; l0=$l; sig STOP; lp; [ "$l0" = "$l" ] && break; j=$((j+1)); [ "$j" -ge 20 ] && break; done;';

/**
 * Shell: `setup`, then rounds of `kill` each followed by a count (`n`) of the live, non-zombie
 * processes of uid `$<uidVar>` other than this shell (a /proc scan, shell builtins only), until
 * none remains or the rounds (`$<roundsArg>`) run out; prints `remaining=<n>`. A count of none
 * during which a process was made (`LAST_PID`) is no count: it is taken for one left. A process
 * shown as a zombie with more than one thread is live (its main thread exited, another runs on:
 * an agent hid that way from the count).
 */
function sweepScript(setup: string, kill: string, uidVar: string, roundsArg: string): string {
  const count = `lp; l0=$l; n=0; for s in /proc/[0-9]*/status; do p=\${s#/proc/}; p=\${p%/status}; case "$keep" in *" $p "*) continue;; esac; u=; st=; th=; while read -r k v rest; do case "$k" in Uid:) u=$v;; State:) st=$v;; Threads:) th=$v;; esac; done 2>/dev/null < "$s"; [ "$u" = "$${uidVar}" ] && { [ "$st" != Z ] || [ "\${th:-1}" -gt 1 ] 2>/dev/null; } && n=$((n+1)); done; lp; [ "$n" -eq 0 ] && [ "$l0" != "$l" ] && n=1;`;
  return `${LAST_PID} ${setup} i=0; while :; do ${kill} ${count} [ "$n" -eq 0 ] && break; i=$((i+1)); [ "$i" -ge "$${roundsArg}" ] && break; sleep 0.1; done; echo "remaining=$n"`;
}

// Runs as the user itself: with every capability dropped, only that uid may signal its
// processes. `kill -9 -1` spares the caller. Rounds: $1.
const KILL_SWEEP_SCRIPT = sweepScript('uid=$(id -u); keep=" $$ ";', "kill -9 -1 2>/dev/null;", "uid", "1");

/**
 * Counts once, kills nothing: the live, non-zombie processes of uid `$1` (`remaining=<n>`; a
 * count during which a process was made is taken for one left). For a count by an uid no
 * process of `$1` can reach (`countProcessesViaExec`).
 */
const COUNT_SCRIPT = sweepScript('t=$1; keep=" $$ "; r=1;', ":;", "t", "r");

/**
 * How many processes of `uid` live, counted by `counter` (an uid none of them can signal or
 * read: the sandbox's `KEEPALIVE_USER`), or null when the count could not be taken. A sweep run
 * as the swept uid itself (`KILL_SWEEP_SCRIPT`) reports what that uid can forge: an agent can
 * stop the sweep's shell and write `remaining=0` to its stdout through `/proc/<pid>/fd/1` (its
 * own uid's process), then kill it, and ran on past a "confirmed" stop, reading the tests as
 * verify staged them. Only this count confirms such a sweep.
 */
export async function countProcessesViaExec(
  exec: SandboxExec,
  uid: number,
  counter: string,
): Promise<number | null> {
  try {
    const r = await exec(["/bin/sh", "-c", COUNT_SCRIPT, "sh", String(uid)], {
      deadlineMs: BACKED_UP_SWEEP_MS,
      cwd: OPS_CWD,
      user: counter,
      stdin: null,
      maxOutputBytes: 4096,
    });
    const m = /(?:^|\n)remaining=(\d+)\n/.exec(r.stdout);
    return r.exitCode === 0 && m ? Number(m[1]) : null;
  } catch {
    return null;
  }
}

/**
 * The root sweep's first step when given a verify epoch (`$2`): whether root, as the tests'
 * staging and runner read it, sees the fence at least at that epoch (`fence-seen=1`; else 0: a
 * fence it cannot read is none to them). A fence raised but unreadable to root fences nothing.
 */
const ROOT_SEES_FENCE = `if [ -n "$2" ]; then v=0; ${READ_FENCE} if [ "$f" -ge "$2" ] 2>/dev/null; then v=1; fi; echo "fence-seen=$v"; fi;`;

/**
 * The kill sweep for root's own processes (the tests', which run as root), run as root without
 * capabilities: `kill -9 -1` would take the sweep's own parents (the exec's `timeout`, ending
 * the exec before it reports) and count the sandbox's PID 1 (bubblewrap's, root's) for ever. It
 * spares PID 1, itself and its parents (walked up `/proc/<pid>/stat`), stops then kills every
 * other process of uid 0. Rounds: $1. With a verify epoch (`$2`), it says whether root sees the
 * fence at it (`ROOT_SEES_FENCE`), and stops, killing nothing more, once the fence is above it
 * (`superseded=<fence>`).
 */
export const ROOT_SELF_SWEEP_SCRIPT = sweepScript(
  `r=$1; e=$2; ${ROOT_SEES_FENCE}` +
    // biome-ignore lint/suspicious/noTemplateCurlyInString: POSIX shell parameter expansion
    ' uid=0; keep=" 1 "; p=$$; while [ "$p" -gt 1 ] 2>/dev/null; do keep="$keep$p "; line=; read -r line 2>/dev/null < "/proc/$p/stat" || break; set -- ${line##*) }; p=${2:-0}; done; sig() { for s in /proc/[0-9]*/status; do p=${s#/proc/}; p=${p%/status}; case "$keep" in *" $p "*) continue;; esac; u=; while read -r k v rest; do [ "$k" = Uid: ] && u=$v && break; done 2>/dev/null < "$s"; [ "$u" = 0 ] && kill -"$1" "$p" 2>/dev/null; done; };',
  // Given an epoch, before each round: a fence above it (a later verify attempt took the
  // sandbox over since this sweep was sent: it landed late) stops the sweep, killing nothing of
  // that attempt's tests.
  `${fenceCheck("e", 'echo "superseded=$f"; exit 0')}; ${STOP_UNTIL_STILL} sig KILL;`,
  "uid",
  "r",
);

/**
 * The kill sweep for a target uid ($1, not root) run by a root process holding CAP_KILL (a reaper
 * beside the sandbox, in its PID namespace): no process of that uid can signal it or outrun it.
 * Each round stops every process of the uid (a stopped process can neither fork nor kill), then
 * kills them, then counts what is left that is not a zombie (a /proc scan, shell builtins only);
 * until none remains or the rounds ($2) run out. Prints `remaining=<n>`.
 */
export const ROOT_KILL_SWEEP_SCRIPT = sweepScript(
  // biome-ignore lint/suspicious/noTemplateCurlyInString: POSIX shell parameter expansion
  't=$1; keep=" $$ "; sig() { for s in /proc/[0-9]*/status; do p=${s#/proc/}; p=${p%/status}; u=; while read -r k v rest; do [ "$k" = Uid: ] && u=$v && break; done 2>/dev/null < "$s"; [ "$u" = "$t" ] && kill -"$1" "$p" 2>/dev/null; done; };',
  `${STOP_UNTIL_STILL} sig KILL;`,
  "t",
  "2",
);

/**
 * `killProcesses` on an exec: up to 3 sweeps as `user` (quick: 2, the second only for a sweep
 * killed as it ran, within the one budget). A `sandbox_lost` exec error is a confirmed "already
 * gone"; an error `isFatal` accepts is rethrown; any other is retried. A root sweep given a verify
 * epoch (`fenceEpoch`, `refuseAbove`) that finds the fence above it throws `TestsSupersededError`,
 * having killed nothing since.
 */
export async function killProcessesViaExec(
  exec: SandboxExec,
  user: string,
  rounds: number,
  isFatal: (err: unknown) => boolean = () => false,
  options: KillOptions & {
    /**
     * For a uid other than root's, run `ROOT_KILL_SWEEP_SCRIPT` as root, asking the exec to keep
     * CAP_KILL (`keepCaps`); the exec must grant it and nothing else. For root's own processes,
     * keep CAP_KILL in its sweep too: not to signal more (the same uid), but so that root in the
     * sandbox, with no capability, cannot reach the sweep (ptrace, `pidfd_getfd`,
     * `/proc/<pid>/fd` need the target's capabilities): the tests' code took the sweep's stdout,
     * wrote `remaining=0` there and killed the sweep, a confirmed stop while it ran on.
     */
    rootSweep?: boolean;
    /**
     * A reaper outside the sandbox's limits takes over when this sweep cannot confirm (the Docker
     * provider's, for a uid other than root's): one try within `BACKED_UP_SWEEP_MS`, not three of
     * 30 s each. Inside a sandbox a fork bomb holds at its pids limit, a sweep can neither fork nor
     * outrun it: three tries took 50 to 86 s, past the stop's margin in the run's budget, and
     * masked the rollout the agent's bomb should have been graded in.
     */
    backedUp?: boolean;
  } = {},
): Promise<CleanupReceipt> {
  let lastError = "";
  const uid = parseNumericUser(user)?.uid;
  const asRoot = options.rootSweep === true && uid !== undefined && uid !== 0;
  // The epoch a root sweep of root's own processes stops at (the fence above it).
  const epoch = options.fenceEpoch ?? options.refuseAbove;
  const argv = asRoot
    ? ["/bin/sh", "-c", ROOT_KILL_SWEEP_SCRIPT, "sh", String(uid), String(rounds)]
    : uid === 0
      ? [
          "/bin/sh",
          "-c",
          ROOT_SELF_SWEEP_SCRIPT,
          "sh",
          String(rounds),
          ...(epoch === undefined ? [] : [String(epoch)]),
        ]
      : ["/bin/sh", "-c", KILL_SWEEP_SCRIPT, "sh", String(rounds)];
  // The fence first, by its owner, in an exec of its own: whatever of an older attempt's starts
  // after it refuses to, and whatever started before it is one of the processes swept below.
  let fenced: boolean | undefined;
  /** Why the fence was not raised, for the receipt's detail. */
  let unfencedWhy = "";
  if (uid === 0 && options.fenceEpoch !== undefined) {
    // Short: the sweep after it has the caller's budget (`FENCE_EXEC_MS`). Tried again, with what
    // is left of that bound, when it failed before its end (an exec refused or broken, as Docker
    // may do for a moment after a restart); not when its script ran and could not write the fence
    // (no mount: a sandbox older than the fence), nor once less than QUICK_RETRY_MIN_MS of it is left
    // (one that timed out has none).
    const fenceBudgetMs = Math.min(options.quickMs ?? 30_000, FENCE_EXEC_MS);
    const fenceStarted = Date.now();
    for (let attempt = 1; attempt <= 2; attempt++) {
      const deadlineMs = deadlineWithin(fenceBudgetMs, fenceStarted, attempt);
      if (deadlineMs === null) break;
      try {
        const r = await exec(["/bin/sh", "-c", RAISE_FENCE_SCRIPT, "sh", String(options.fenceEpoch)], {
          deadlineMs,
          cwd: OPS_CWD,
          user: KEEPALIVE_USER,
          stdin: null,
          maxOutputBytes: 4096,
        });
        fenced = /(?:^|\n)fenced=1\n/.test(r.stdout);
        if (fenced) break;
        const refused = /(?:^|\n)fenced=0\n/.test(r.stdout);
        unfencedWhy = refused
          ? "its file could not be written"
          : `its exec ${r.timedOut ? "timed out" : `exited ${r.exitCode}`}${r.stderr.trim() ? `: ${r.stderr.trim()}` : ""}`;
        if (refused) break;
      } catch (err) {
        if (isFleetError(err) && err.kind === "sandbox_lost") return goneReceipt();
        if (isFatal(err)) throw err;
        fenced = false;
        unfencedWhy = `its exec failed: ${err instanceof Error ? err.message : String(err)}`;
      }
    }
  }
  /** A receipt with its word on the fence, when asked to raise one (`CleanupReceipt.fenced`; `seen` by root). */
  const withFence = (receipt: CleanupReceipt, seen: boolean): CleanupReceipt => {
    if (fenced === undefined) return receipt;
    if (fenced && seen) return { ...receipt, fenced: true };
    const why = fenced ? "fence raised but not seen by root" : `fence not raised: ${unfencedWhy}`;
    return { ...receipt, fenced: false, detail: `${receipt.detail ?? ""}; ${why}` };
  };
  // A quick sweep (its caller has seconds) tries again only when it was killed as it ran, at
  // once (a signal, not its deadline): the reaper of the very tests it stops (the tests' runner
  // kills every process started after it as a stray) may take it for one of theirs; the second
  // sweep kills that reaper.
  // The retry gets what is left of the one budget: the caller's bound holds.
  const quick = options.quickMs !== undefined;
  const backedUp = !quick && options.backedUp === true;
  const attempts = quick ? 2 : backedUp ? 1 : 3;
  const budgetMs = options.quickMs ?? (backedUp ? BACKED_UP_SWEEP_MS : 30_000);
  const started = Date.now();
  for (let attempt = 1; attempt <= attempts; attempt++) {
    // A slow sweep's tries each get the whole budget; a quick one's share it.
    const deadlineMs = quick ? deadlineWithin(budgetMs, started, attempt) : budgetMs;
    if (deadlineMs === null) break;
    try {
      const r = await exec(argv, {
        deadlineMs,
        cwd: OPS_CWD,
        user: asRoot ? ROOT_USER : user,
        stdin: null,
        maxOutputBytes: 4096,
        ...(options.rootSweep === true && uid !== undefined ? { keepCaps: ["kill"] } : {}),
      });
      const later = /(?:^|\n)superseded=(\d+)\n/.exec(r.stdout);
      if (later && uid === 0 && epoch !== undefined) throw new TestsSupersededError(Number(later[1]), epoch);
      const m = /remaining=(\d+)/.exec(r.stdout);
      if (m) {
        const remaining = Number(m[1]);
        return withFence(
          {
            confirmed: remaining === 0,
            scope: "processes",
            at: Date.now(),
            alreadyGone: false,
            remaining,
            detail: `uid of ${user}: ${remaining === 0 ? "no process left" : `${remaining} process(es) still alive`}`,
          },
          // Raised, and seen by root as the tests' staging and runner will read it.
          /(?:^|\n)fence-seen=1\n/.test(r.stdout),
        );
      }
      lastError = `kill sweep exited ${r.exitCode}: ${r.stderr.trim()}`;
      if (quick && (r.timedOut || !endedBySignal(r.exitCode))) break;
    } catch (err) {
      if (err instanceof TestsSupersededError) throw err;
      if (isFleetError(err) && err.kind === "sandbox_lost") return goneReceipt();
      if (isFatal(err)) throw err;
      // e.g. the pids limit is exhausted and the sweep itself cannot start: try again.
      lastError = err instanceof Error ? err.message : String(err);
      if (quick) break;
    }
    if (attempt < attempts && !quick) await delay(200 * attempt);
  }
  return withFence(
    {
      confirmed: false,
      scope: "processes",
      at: Date.now(),
      alreadyGone: false,
      remaining: 0,
      detail: lastError,
    },
    true,
  );
}

/** The budget of a sweep a reaper backs up (`backedUp`): a sweep that works takes well under a second. */
export const BACKED_UP_SWEEP_MS = 10_000;

/** A quick sweep killed as it ran (or a fence exec that failed) tries again only with at least this much of its budget left. */
const QUICK_RETRY_MIN_MS = 250;

/**
 * The deadline of try `attempt` of an exec whose tries share one budget (`budgetMs`, from
 * `started`): the first gets all of it; a later one what is left, or none (null) when that is
 * under `QUICK_RETRY_MIN_MS`.
 */
function deadlineWithin(budgetMs: number, started: number, attempt: number): number | null {
  if (attempt === 1) return budgetMs;
  const left = budgetMs - (Date.now() - started);
  return left < QUICK_RETRY_MIN_MS ? null : left;
}

/**
 * The bound of the exec that raises the verify fence before a root sweep (`killProcessesViaExec`
 * with `fenceEpoch`): one read, one write and a rename; a caller's budget for the sweep is this
 * plus its exec's kill grace longer.
 */
export const FENCE_EXEC_MS = 2_000;

/** A sweep's receipt for a sandbox found gone: nothing of it runs, nor can start. */
function goneReceipt(): CleanupReceipt {
  return {
    confirmed: true,
    scope: "processes",
    at: Date.now(),
    alreadyGone: true,
    remaining: 0,
    detail: "sandbox is gone",
  };
}

export function delay(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
