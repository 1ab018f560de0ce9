import type { ExecResult, SandboxHandle, TaskContent } from "@fleet/contracts";
import type { SandboxProvider } from "@fleet/sandbox";

export interface VerifyContext {
  provider: SandboxProvider;
  /** The task sandbox, after the agent's cleanup was confirmed. Unused by `match`. */
  handle: SandboxHandle;
  task: TaskContent;
  /** What the run stage recorded. */
  /** `answerTruncated`: the answer was kept cut (`keptAnswer`); a match verifier grades it 0. */
  run: { answer: string | null; answerTruncated?: boolean; exec: ExecResult };
  /** Absolute epoch ms: the rollout's deadline. The tests never run past it. */
  deadlineMs?: number;
  /** Abort: stop waiting (throws the reason, or `cancelled`). */
  signal?: AbortSignal;
  /**
   * Called (and awaited) before the verifier works in the sandbox: before staging the tests
   * (`stage`), and again just before they start (`tests`), each time they do. A verify delivered
   * again waits out only work that may have started (it outlives its client); throwing stops the
   * verification there.
   */
  onSandboxWork?: (phase: "stage" | "tests") => Promise<void>;
  /**
   * This verify attempt's epoch (`BeginResult.verifyEpoch`): its tests' runner starts nothing
   * once a later attempt raised the sandbox's verify fence past it (`TestsSupersededError`).
   * None: no check.
   */
  fenceEpoch?: number;
  /** Staging the tests failed (not aborted): none of them started, so a retry need not wait. */
  onStagingFailed?: () => Promise<void>;
}

export interface Verdict {
  /** In [0, 1]. */
  reward: number;
  /** What the grade rests on: `kind`, `source`, exit code, bounded output tails, ... */
  details: Record<string, unknown>;
}
