import { z } from "zod";
import { CappedText } from "./bounded.ts";

/** Pipeline stages; `admission` is the dispatcher accepting a request. */
export const Stage = z.enum(["admission", "seed", "run", "verify", "close"]);
export type Stage = z.infer<typeof Stage>;

/** The stage after `stage`, in the pipeline's order (null after close). */
export function stageAfter(stage: Stage): Stage | null {
  return Stage.options[Stage.options.indexOf(stage) + 1] ?? null;
}

/** Why a rollout did not end with a clean graded result (DESIGN §2). */
export const FailureKind = z.enum([
  "invalid_task",
  "isolation_refused",
  "provider_unavailable",
  "provider_oom_killed",
  "sandbox_lost",
  "agent_error",
  "verifier_error",
  "deadline_exceeded",
  "cancelled",
  "agent_timeout",
  "teardown_failed",
]);
export type FailureKind = z.infer<typeof FailureKind>;

/** What a failure kind does to the rollout. */
export interface FailureClass {
  /**
   * `fail`: terminal `failed` (no retry can fix it); `mask`: terminal `masked`, excluded from
   * training signal; `cancel`: terminal `cancelled`; `graded`: informational, the reward stands.
   */
  outcome: "fail" | "mask" | "cancel" | "graded";
  /** Whether an error of this kind is retried by default (an error instance may override). */
  retryable: boolean;
}

function assertNever(x: never): never {
  throw new Error(`unhandled failure kind: ${String(x)}`);
}

/** The one place that decides retry / fail / mask for a failure kind. */
export function classifyFailure(kind: FailureKind): FailureClass {
  switch (kind) {
    case "invalid_task":
    case "isolation_refused":
    case "agent_error":
      return { outcome: "fail", retryable: false };
    case "provider_unavailable":
    case "sandbox_lost":
      return { outcome: "mask", retryable: true };
    case "provider_oom_killed":
    case "verifier_error":
    case "deadline_exceeded":
      return { outcome: "mask", retryable: false };
    case "cancelled":
      return { outcome: "cancel", retryable: false };
    case "agent_timeout":
    case "teardown_failed":
      return { outcome: "graded", retryable: false };
    default:
      return assertNever(kind);
  }
}

/** Is this kind caused by infrastructure (and so must never become a reward)? */
export function isInfrastructureFailure(kind: FailureKind): boolean {
  return classifyFailure(kind).outcome === "mask";
}

/** Model usage; `gaps` names what the harness could not observe (never a silent zero). */
export const Usage = z.object({
  calls: z.number().int().nonnegative(),
  promptTokens: z.number().int().nonnegative().nullable(),
  completionTokens: z.number().int().nonnegative().nullable(),
  cachedTokens: z.number().int().nonnegative().nullable(),
  gaps: z.array(z.string()),
});
export type Usage = z.infer<typeof Usage>;

/** A stored failure fact (DESIGN §2 rule 12). */
export const FailureRecord = z.object({
  stage: Stage,
  terminal: z.boolean(),
  failureKind: FailureKind,
  mask: z.boolean(),
  reason: CappedText,
  at: z.number().int().nonnegative(),
  /**
   * The model usage the failed attempt had spent (a run whose agent called a model and then
   * failed: masked for its upstream, say). Absent when none was measured.
   */
  usage: Usage.optional(),
});
export type FailureRecord = z.infer<typeof FailureRecord>;
