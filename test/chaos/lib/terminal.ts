/** Statuses a rollout ends in. */
export const TERMINAL_STATUSES: readonly string[] = ["completed", "masked", "failed", "cancelled"];

/**
 * Failure kinds that are the infrastructure's doing (DESIGN §2 rule 6): a masked result must
 * carry one of these, never an agent's or a task's failure.
 */
export const INFRA_FAILURE_KINDS: readonly string[] = [
  "provider_unavailable",
  "provider_oom_killed",
  "sandbox_lost",
  "verifier_error",
  "deadline_exceeded",
];
