import type { ExecResult, SandboxHandle, TaskContent } from "@fleet/contracts";
import type { SandboxProvider } from "@fleet/sandbox";

export interface VerifyContext {
  provider: SandboxProvider;
  /** The task sandbox, after the agent's cleanup was confirmed. Unused by `match`. */
  handle: SandboxHandle;
  task: TaskContent;
  /** What the run stage recorded. */
  run: { answer: string | null; exec: ExecResult };
  /** Absolute epoch ms: the rollout's deadline. The tests never run past it. */
  deadlineMs?: number;
  /** Abort: stop waiting (throws the reason, or `cancelled`). */
  signal?: AbortSignal;
  /**
   * Called (and awaited) just before the tests start in the sandbox, each time they do: a verify
   * delivered again waits out only tests that may have started (they outlive their client).
   */
  onTestsStart?: () => Promise<void>;
}

export interface Verdict {
  /** In [0, 1]. */
  reward: number;
  /** What the grade rests on: `kind`, `source`, exit code, bounded output tails, ... */
  details: Record<string, unknown>;
}
