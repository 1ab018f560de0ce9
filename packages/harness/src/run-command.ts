import { FleetError, isFleetError, keptAnswer, tailWithin } from "@fleet/contracts";
import { AGENT_USER, SANDBOX_PATHS } from "@fleet/sandbox";
import {
  EXEC_OUTPUT_BYTES,
  FLEET_DIR,
  INSTRUCTION_ENV,
  INSTRUCTION_FILE,
  MAX_OUTPUT_CHARS,
} from "./constants.ts";
import type { HarnessContext, HarnessOutcome } from "./harness.ts";

/**
 * A harness outcome's answer of the agent's text (`keptAnswer`), and whether it was cut: by the
 * keeping, or already (`cut`: the sandbox kept only the head and tail of a longer output).
 */
export function answerFields(text: string, cut = false): Pick<HarnessOutcome, "answer" | "answerTruncated"> {
  const { answer, truncated } = keptAnswer(text);
  return truncated || cut ? { answer, answerTruncated: true } : { answer };
}

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

/** The last `max` characters of `text`, marking the cut at the front. */
export function capTail(text: string, max = MAX_OUTPUT_CHARS): string {
  return tailWithin(text, max);
}

/**
 * The shared body of the oracle and command harnesses: write the instruction file, stage
 * `files` (if any), run `argv` as the agent user in /workspace until the deadline, and turn the
 * result into an outcome whose answer is the trimmed stdout.
 */
export async function runAgentCommand(
  ctx: HarnessContext,
  argv: string[],
  options: {
    env?: Record<string, string>;
    /** Files to stage before the command starts, and their owner. */
    stage?: { dir: string; files: Record<string, string>; user: string; modes?: Record<string, number> };
  } = {},
): Promise<HarnessOutcome> {
  const { provider, handle, task } = ctx;
  const prepStarted = Date.now();
  // A put of its own, not a writer in front of the command in the command's exec (tried, and
  // reverted): whatever that exec writes, the agent can read back (its output pipes belong to
  // its uid), so it could carry no proof of a good write or an intact stream that the agent could
  // not forge, and choosing to be masked instead of graded is a reward hack.
  await providerStep(ctx, "write the instruction file", () =>
    provider.put(handle, FLEET_DIR, { "instruction.md": task.instruction }, { user: AGENT_USER }),
  );
  const stage = options.stage;
  if (stage !== undefined) {
    await providerStep(ctx, `stage ${stage.dir}`, () =>
      provider.put(handle, stage.dir, stage.files, { user: stage.user, modes: stage.modes }),
    );
  }

  const remainingMs = Math.floor((ctx.agentStarts?.() ?? ctx.deadlineMs) - Date.now());
  if (remainingMs <= 0) {
    // Its time went on preparing the sandbox (a slow daemon): nothing of the agent ran, so there
    // is nothing to grade. Masked (retried while the rollout's deadline allows), never a 0.
    throw FleetError.retryable(
      "provider_unavailable",
      `the agent's time ran out before its command started (writing its files took ${Date.now() - prepStarted} ms); nothing of the agent ran`,
    );
  }
  const exec = await providerStep(ctx, "run the agent command", () =>
    provider.exec(handle, argv, {
      deadlineMs: remainingMs,
      cwd: SANDBOX_PATHS.workspace,
      user: AGENT_USER,
      env: { ...options.env, ...ctx.env, [INSTRUCTION_ENV]: INSTRUCTION_FILE },
      maxOutputBytes: EXEC_OUTPUT_BYTES,
    }),
  );

  return {
    exec: {
      ...exec,
      stdout: capTail(exec.stdout),
      stderr: capTail(exec.stderr),
      stdoutTruncated: exec.stdoutTruncated || exec.stdout.length > MAX_OUTPUT_CHARS,
      stderrTruncated: exec.stderrTruncated || exec.stderr.length > MAX_OUTPUT_CHARS,
    },
    ...answerFields(exec.stdout, exec.stdoutTruncated),
    transcript: null,
    usage: null,
  };
}
