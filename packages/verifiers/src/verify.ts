import { capText, FleetError, isFleetError } from "@fleet/contracts";
import { ROOT_USER, SANDBOX_PATHS } from "@fleet/sandbox";
import { matchAnswer } from "./match.ts";
import { parseReward } from "./reward-file.ts";
import type { Verdict, VerifyContext } from "./verdict.ts";

/** Where tests may leave a reward (a number in [0, 1]) that wins over their exit status. */
export const REWARD_FILE = `${SANDBOX_PATHS.logs}/verifier/reward.txt`;
/** Cap for each of the stdout/stderr tails kept in verdict details (characters). */
export const MAX_DETAIL_CHARS = 2000;
/** Budget for clearing /tests and /logs/verifier before staging the tests. */
const PREPARE_TIMEOUT_MS = 30_000;

/**
 * Grade one run. `tests`: stage the task's tests at /tests and run `bash /tests/test.sh` as root
 * (no capabilities) in /workspace; the reward file wins, else exit 0 → 1.0, non-zero → 0.0.
 * `match`: compare the answer (exact, trimmed; or regex, full match); no answer → 0.
 *
 * @throws FleetError `verifier_error` (masked, never a zero) when the tests time out, the
 * reward file is malformed, or the provider fails (retryable when the provider error was);
 * `deadline_exceeded` when the rollout's deadline leaves no time or cuts the tests short;
 * `invalid_task` for a task that cannot be graded (no tests/test.sh, bad regex).
 */
export async function verify(ctx: VerifyContext): Promise<Verdict> {
  const { verifier } = ctx.task;
  switch (verifier.kind) {
    case "match":
      return matchAnswer(verifier, ctx.run);
    case "tests":
      return runTests(ctx);
    default:
      return assertNever(verifier);
  }
}

function assertNever(x: never): never {
  throw new Error(`unhandled verifier kind: ${JSON.stringify(x)}`);
}

/**
 * Clear what a previous attempt (or a misbehaving agent) may have left in /tests and
 * /logs/verifier, and prove it is gone: root has no CAP_FOWNER, so a file the agent planted in a
 * sticky, world-writable directory cannot be removed, and grading on top of it could be gamed.
 */
const PREPARE_SCRIPT = `set -u
rm -rf /logs/verifier 2>/dev/null
find /tests -mindepth 1 -delete 2>/dev/null
if [ -e /logs/verifier ] || [ -L /logs/verifier ]; then
  echo "cannot clear /logs/verifier (owned by uid $(stat -c %u /logs/verifier))" >&2; exit 3
fi
if [ -n "$(ls -A /tests 2>/dev/null)" ]; then
  echo "cannot clear /tests, left: $(ls -A /tests | head -n 5 | tr '\\n' ' ')" >&2; exit 3
fi
mkdir -p /logs/verifier || exit 3
`;

async function runTests(ctx: VerifyContext): Promise<Verdict> {
  const { provider, handle, task } = ctx;
  if (task.tests["test.sh"] === undefined) {
    throw FleetError.nonRetryable("invalid_task", `task "${task.id}" has no tests/test.sh to verify with`);
  }
  const started = Date.now();
  const ownMs = task.timeouts.verifierS * 1000;
  const leftMs = ctx.deadlineMs === undefined ? Number.POSITIVE_INFINITY : ctx.deadlineMs - started;
  if (leftMs <= 0)
    throw new FleetError("deadline_exceeded", "the rollout deadline passed before verification");
  const cutByRollout = leftMs < ownMs;
  const endsAt = started + Math.min(ownMs, leftMs);
  const remaining = (): number => Math.max(1, Math.floor(endsAt - Date.now()));

  const prepared = await step(ctx, "prepare /tests and /logs/verifier", () =>
    provider.exec(handle, ["bash", "-c", PREPARE_SCRIPT], {
      deadlineMs: Math.min(remaining(), PREPARE_TIMEOUT_MS),
      cwd: "/",
      user: ROOT_USER,
    }),
  );
  if (prepared.exitCode !== 0) {
    throw FleetError.nonRetryable(
      "verifier_error",
      `could not prepare a clean /tests and /logs/verifier (exit ${prepared.exitCode}): ${capText(prepared.stderr.trim(), 500)}`,
    );
  }
  await step(ctx, "stage the tests", () =>
    provider.put(handle, SANDBOX_PATHS.tests, task.tests, { user: ROOT_USER }),
  );
  const result = await step(ctx, "run the tests", () =>
    provider.exec(handle, ["bash", `${SANDBOX_PATHS.tests}/test.sh`], {
      deadlineMs: remaining(),
      cwd: SANDBOX_PATHS.workspace,
      user: ROOT_USER,
    }),
  );

  const details: Record<string, unknown> = {
    kind: "tests",
    exitCode: result.exitCode,
    timedOut: result.timedOut,
    durationMs: result.durationMs,
    stdoutTail: capTail(result.stdout),
    stderrTail: capTail(result.stderr),
    agentExitCode: ctx.run.exec.exitCode,
  };
  if (result.timedOut) {
    const limit = Math.round(Math.min(ownMs, leftMs) / 1000);
    if (cutByRollout) {
      throw new FleetError("deadline_exceeded", `the rollout deadline cut the tests short after ${limit} s`);
    }
    throw FleetError.nonRetryable("verifier_error", `the tests did not finish within ${limit} s`);
  }
  if (result.oomKilled)
    throw FleetError.nonRetryable("provider_oom_killed", "the tests were killed for lack of memory");

  const rewardText = await step(ctx, "read the reward file", () =>
    provider.get(handle, REWARD_FILE, { maxBytes: 1024 }),
  );
  if (rewardText !== null) {
    const reward = parseReward(rewardText);
    return {
      reward,
      details: { ...details, source: "reward_file", rewardText: capText(rewardText.trim(), 100) },
    };
  }
  return { reward: result.exitCode === 0 ? 1 : 0, details: { ...details, source: "exit_code" } };
}

/**
 * One provider call, under the abort signal. A provider failure keeps its kind (masked, retried
 * when retryable); anything else becomes `verifier_error` (masked), keeping the cause.
 */
async function step<T>(ctx: VerifyContext, what: string, call: () => Promise<T>): Promise<T> {
  const signal = ctx.signal;
  if (signal?.aborted) throw abortError(signal);
  try {
    const pending = call();
    if (signal === undefined) return await pending;
    pending.catch(() => {});
    return await new Promise<T>((resolve, reject) => {
      const onAbort = (): void => reject(abortError(signal));
      signal.addEventListener("abort", onAbort, { once: true });
      pending.then(resolve, reject).finally(() => signal.removeEventListener("abort", onAbort));
    });
  } catch (err) {
    if (signal?.aborted && err === signal.reason) throw err;
    // The provider's own failures keep their kind: a daemon outage is `provider_unavailable`,
    // a vanished sandbox `sandbox_lost` (both masked), not a verifier crash.
    if (
      isFleetError(err) &&
      (err.kind === "cancelled" ||
        err.kind === "deadline_exceeded" ||
        err.kind === "provider_unavailable" ||
        err.kind === "sandbox_lost")
    ) {
      throw err;
    }
    const kind = isFleetError(err) ? `${err.kind}: ` : "";
    const message = err instanceof Error ? err.message : String(err);
    throw new FleetError("verifier_error", `verifier failed to ${what}: ${kind}${message}`, {
      retryable: isFleetError(err) ? err.retryable : false,
      cause: err,
    });
  }
}

function abortError(signal: AbortSignal): FleetError {
  const reason: unknown = signal.reason;
  if (isFleetError(reason)) return reason;
  const why = reason instanceof Error ? reason.message : reason === undefined ? "aborted" : String(reason);
  return new FleetError("cancelled", `verification stopped: ${why}`, { cause: reason });
}

/** The last `max` characters of `text`, marking the cut at the front. */
export function capTail(text: string, max = MAX_DETAIL_CHARS): string {
  const mark = "[truncated]…";
  if (text.length <= max) return text;
  return mark + text.slice(text.length - Math.max(0, max - mark.length));
}
