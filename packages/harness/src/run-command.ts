import { randomBytes } from "node:crypto";
import { capText, type ExecResult, FleetError, isFleetError } from "@fleet/contracts";
import { AGENT_USER, SANDBOX_PATHS } from "@fleet/sandbox";
import {
  EXEC_OUTPUT_BYTES,
  FLEET_DIR,
  INSTRUCTION_ENV,
  INSTRUCTION_FILE,
  MAX_ANSWER_CHARS,
  MAX_OUTPUT_CHARS,
} from "./constants.ts";
import type { HarnessContext, HarnessOutcome } from "./harness.ts";

/** The error an abort throws: the signal's reason when it is a FleetError, else `cancelled`. */
export function abortError(signal: AbortSignal): FleetError {
  const reason: unknown = signal.reason;
  if (isFleetError(reason)) return reason;
  const why = reason instanceof Error ? reason.message : reason === undefined ? "aborted" : String(reason);
  return new FleetError("cancelled", `harness stopped: ${why}`, { cause: reason });
}

/** Stop waiting for `promise` when `signal` aborts (the work itself is the caller's to kill). */
export function untilAborted<T>(promise: Promise<T>, signal: AbortSignal): Promise<T> {
  // The promise may settle after we stopped waiting; never leave that rejection unhandled.
  promise.catch(() => {});
  if (signal.aborted) return Promise.reject(abortError(signal));
  return new Promise<T>((resolve, reject) => {
    const onAbort = (): void => reject(abortError(signal));
    signal.addEventListener("abort", onAbort, { once: true });
    promise.then(
      (value) => {
        signal.removeEventListener("abort", onAbort);
        resolve(value);
      },
      (err: unknown) => {
        signal.removeEventListener("abort", onAbort);
        reject(err);
      },
    );
  });
}

/**
 * Run one provider call under the abort signal. A provider `FleetError` propagates unchanged;
 * anything else a provider throws is a provider fault (`provider_unavailable`, cause kept).
 */
export async function providerStep<T>(ctx: HarnessContext, what: string, call: () => Promise<T>): Promise<T> {
  if (ctx.signal.aborted) throw abortError(ctx.signal);
  try {
    return await untilAborted(call(), ctx.signal);
  } catch (err) {
    if (isFleetError(err)) throw err;
    const message = err instanceof Error ? err.message : String(err);
    throw new FleetError("provider_unavailable", `sandbox provider failed to ${what}: ${message}`, {
      cause: err,
    });
  }
}

/** An exit envelope for a command that never got to start because its deadline had passed. */
export function deadlinePassed(): ExecResult {
  return {
    exitCode: -1,
    timedOut: true,
    stdout: "",
    stderr: "",
    stdoutTruncated: false,
    stderrTruncated: false,
    durationMs: 0,
    oomKilled: false,
  };
}

/** The last `max` characters of `text`, marking the cut at the front. */
export function capTail(text: string, max = MAX_OUTPUT_CHARS): string {
  const mark = "[truncated]…";
  if (text.length <= max) return text;
  return mark + text.slice(text.length - Math.max(0, max - mark.length));
}

/**
 * Runs before the agent's command, in the same exec and as the same user: reads a nonce line from
 * stdin, writes the rest of stdin to the instruction file (`$2`, in directory `$1`), then replaces
 * itself with the command (`$3…`) on /dev/null, as a command without stdin had it (a socket stdin,
 * as bubblewrap's, would also make a `bash -c` agent read ~/.bashrc). A failed write is reported as
 * `<nonce> instruction-failed` after a newline on stderr, exit 97; a good one as the line
 * `<nonce> started` first on stderr, which proves the exec's output reached us from its start (a
 * transport that dropped the stream when stdin ended must not turn into an empty answer, graded
 * 0). The nonce never reaches the command (not in argv or the environment, and gone with the
 * shell), so the agent can fake neither line.
 */
export const WITH_INSTRUCTION_SCRIPT = `IFS= read -r nonce
if ! { mkdir -p -- "$1" && cat > "$2"; }; then
  printf '\\n%s instruction-failed\\n' "$nonce" >&2; exit 97
fi
printf '%s started\\n' "$nonce" >&2
unset nonce
shift 2
exec "$@" < /dev/null`;

/** `text` without `line`, which must start it or follow a newline; null when it is not there. */
function takeLine(text: string, line: string): string | null {
  const at = text.startsWith(line) ? 0 : text.indexOf(`\n${line}`) + 1;
  if (at === 0 && !text.startsWith(line)) return null;
  return text.slice(0, at) + text.slice(at + line.length);
}

/** The exec's argv: `argv` behind the instruction writer (see `WITH_INSTRUCTION_SCRIPT`). */
export function withInstructionArgv(argv: readonly string[]): string[] {
  return ["sh", "-c", WITH_INSTRUCTION_SCRIPT, "fleet-agent", FLEET_DIR, INSTRUCTION_FILE, ...argv];
}

/**
 * The shared body of the oracle and command harnesses: stage `files` (if any), then in one exec
 * write the instruction file and run `argv` as the agent user in /workspace until the deadline,
 * and turn the result into an outcome whose answer is the trimmed stdout.
 */
export async function runAgentCommand(
  ctx: HarnessContext,
  argv: string[],
  options: {
    env?: Record<string, string>;
    /** Files to stage before the command starts, and their owner. */
    stage?: { dir: string; files: Record<string, string>; user: string };
  } = {},
): Promise<HarnessOutcome> {
  const { provider, handle, task } = ctx;
  const stage = options.stage;
  if (stage !== undefined) {
    await providerStep(ctx, `stage ${stage.dir}`, () =>
      provider.put(handle, stage.dir, stage.files, { user: stage.user }),
    );
  }

  const remainingMs = Math.floor(ctx.deadlineMs - Date.now());
  const nonce = randomBytes(16).toString("hex");
  const exec =
    remainingMs <= 0
      ? deadlinePassed()
      : await providerStep(ctx, "run the agent command", () =>
          provider.exec(handle, withInstructionArgv(argv), {
            deadlineMs: remainingMs,
            cwd: SANDBOX_PATHS.workspace,
            user: AGENT_USER,
            env: { ...options.env, ...ctx.env, [INSTRUCTION_ENV]: INSTRUCTION_FILE },
            stdin: `${nonce}\n${task.instruction}`,
            maxOutputBytes: EXEC_OUTPUT_BYTES,
          }),
        );
  if (exec.exitCode === 97 && exec.stderr.includes(`\n${nonce} instruction-failed\n`)) {
    throw FleetError.nonRetryable(
      "invalid_task",
      `writing the instruction file ${INSTRUCTION_FILE} as ${AGENT_USER} failed: ${capText(exec.stderr.trim(), 500)}`,
    );
  }
  if (remainingMs > 0) {
    const started = takeLine(exec.stderr, `${nonce} started\n`);
    // Without the line the command's output cannot be trusted (a command killed at its deadline
    // before the line is graded as it stands, on nothing).
    if (started === null && !exec.timedOut) {
      throw FleetError.retryable(
        "provider_unavailable",
        `the agent's exec returned without its start line (exit ${exec.exitCode}): its output was lost on the way`,
      );
    }
    if (started !== null) exec.stderr = started;
  }

  return {
    exec: {
      ...exec,
      stdout: capTail(exec.stdout),
      stderr: capTail(exec.stderr),
      stdoutTruncated: exec.stdoutTruncated || exec.stdout.length > MAX_OUTPUT_CHARS,
      stderrTruncated: exec.stderrTruncated || exec.stderr.length > MAX_OUTPUT_CHARS,
    },
    answer: capText(exec.stdout.trim(), MAX_ANSWER_CHARS),
    transcript: null,
    usage: null,
  };
}
