/** Per-rollout limits on model calls. Absent = unlimited. */
export interface CapLimits {
  /** Calls allowed (answered or in flight). */
  maxCalls?: number | undefined;
  /** Tokens (prompt + completion, summed over answered calls) after which no call starts. */
  maxTokens?: number | undefined;
}

/** What has been used so far. */
export interface CapState {
  /** Answered calls plus calls in flight. */
  calls: number;
  /** Tokens of answered calls; `null` when some call did not report them. */
  tokens: number | null;
  /**
   * A call may have been billed unread (the agent abandoned it, or its 2xx answer was over the
   * size bound): an unknown total is then no sure failure of the upstream.
   */
  abandoned?: boolean;
}

/**
 * `usage_unreported`: the token cap cannot be checked, the upstream's doing; `token_total_unknown`:
 * it cannot, a call having gone unread: the agent abandoned it (its own doing, or its client's
 * timeout on an overloaded upstream: the gateway cannot tell which), or its 2xx answer was over
 * the gateway's size bound (the request's doing).
 */
export type CapCode = "call_cap_exceeded" | "token_cap_exceeded" | "usage_unreported" | "token_total_unknown";
/** Every code a cap refusal may carry. */
export const CAP_CODES: ReadonlySet<string> = new Set<CapCode>([
  "call_cap_exceeded",
  "token_cap_exceeded",
  "usage_unreported",
  "token_total_unknown",
]);

export interface CapRefusal {
  code: CapCode;
  message: string;
}

/**
 * Whether the next call must be refused. Pure.
 *
 * - Call cap: call number `maxCalls + 1` is refused (calls `1..maxCalls` run).
 * - Token cap: a call is refused when the recorded total has *reached or crossed* `maxTokens`;
 *   the call that crosses it still runs (its size is unknown until it is answered), so the
 *   refused call is the first one started after the running total crossed the cap. Calls in
 *   flight at that moment are not stopped and are counted when answered.
 * - A token cap with a total that is unknown (some call did not report usage) cannot be
 *   checked, so it refuses (fail closed): with `usage_unreported` when the upstream did not
 *   report it (its shortcoming: the gateway counts it as an upstream failure), with
 *   `token_total_unknown` when a call went unread (abandoned by the agent, or answered over the
 *   size bound; the gateway leaves the upstream's health as it was: an SDK that gave up on an
 *   overloaded upstream abandons calls too).
 */
export function capRefusal(state: CapState, limits: CapLimits): CapRefusal | null {
  if (limits.maxCalls !== undefined && state.calls >= limits.maxCalls) {
    return {
      code: "call_cap_exceeded",
      message: `this rollout's model call cap (${limits.maxCalls} calls) is reached`,
    };
  }
  if (limits.maxTokens !== undefined) {
    if (state.tokens === null) {
      return state.abandoned
        ? {
            code: "token_total_unknown",
            message: `this rollout's token cap (${limits.maxTokens}) cannot be enforced: an earlier call's tokens are unknown (the agent abandoned it, or its answer was too large to read)`,
          }
        : {
            code: "usage_unreported",
            message: `this rollout's token cap (${limits.maxTokens}) cannot be enforced: the upstream did not report usage for an earlier call`,
          };
    }
    if (state.tokens >= limits.maxTokens) {
      return {
        code: "token_cap_exceeded",
        message: `this rollout's token cap is reached (${state.tokens} of ${limits.maxTokens} tokens used)`,
      };
    }
  }
  return null;
}
