import type { Usage } from "@fleet/contracts";

/** What one chat-completions response reported about its tokens; `null` = not reported. */
export interface CallUsage {
  /** The response had no `usage` object at all. */
  usageMissing: boolean;
  promptTokens: number | null;
  completionTokens: number | null;
  /** `usage.prompt_tokens_details.cached_tokens`. */
  cachedTokens: number | null;
  /** `usage.total_tokens`, else prompt + completion when both are known. */
  totalTokens: number | null;
}

/** More tokens than any one call can have: a count above it is not believed (a gap, not a sum). */
export const MAX_CALL_TOKENS = 1_000_000_000;

function count(value: unknown): number | null {
  return typeof value === "number" && Number.isSafeInteger(value) && value >= 0 && value <= MAX_CALL_TOKENS
    ? value
    : null;
}

/** Read the usage an OpenAI-compatible chat-completions response body reported. Never throws. */
export function readCallUsage(body: unknown): CallUsage {
  const usage = typeof body === "object" && body !== null ? (body as { usage?: unknown }).usage : undefined;
  if (typeof usage !== "object" || usage === null) {
    return {
      usageMissing: true,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      totalTokens: null,
    };
  }
  const u = usage as {
    prompt_tokens?: unknown;
    completion_tokens?: unknown;
    total_tokens?: unknown;
    prompt_tokens_details?: unknown;
  };
  const promptTokens = count(u.prompt_tokens);
  const completionTokens = count(u.completion_tokens);
  const details = u.prompt_tokens_details;
  const cachedTokens =
    typeof details === "object" && details !== null
      ? count((details as { cached_tokens?: unknown }).cached_tokens)
      : null;
  const reportedTotal = count(u.total_tokens);
  const totalTokens =
    reportedTotal ??
    (promptTokens !== null && completionTokens !== null ? promptTokens + completionTokens : null);
  return { usageMissing: false, promptTokens, completionTokens, cachedTokens, totalTokens };
}

/** At most this many call ranges are listed in one gap; the rest are counted. */
const MAX_RANGES = 8;

/** `call 3` / `calls 1-4, 7` / `calls 1, 3, 5, … (+12 more)`: bounded however many calls. */
export function describeCalls(calls: readonly number[]): string {
  const ranges: Array<[number, number]> = [];
  for (const n of calls) {
    const last = ranges[ranges.length - 1];
    if (last && n === last[1] + 1) last[1] = n;
    else ranges.push([n, n]);
  }
  const shown = ranges.slice(0, MAX_RANGES).map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`));
  const hidden = ranges.slice(MAX_RANGES).reduce((sum, [a, b]) => sum + (b - a + 1), 0);
  const more = hidden > 0 ? `, … (+${hidden} more)` : "";
  return `${calls.length === 1 ? "call" : "calls"} ${shown.join(", ")}${more}`;
}

/** Why a call the upstream may have billed went unmetered (`UsageMeter.recordAbandoned`). */
export type UnmeteredReason = "agent" | "unread";

/**
 * Sums the usage of one rollout's model calls. A count is `null` as soon as any call did not
 * report it, and `gaps` names the calls that did not (DESIGN §2 rule 12: a gap, never a zero).
 * Calls are numbered from 1 in the order they are recorded.
 */
export class UsageMeter {
  private calls = 0;
  private prompt = 0;
  private completion = 0;
  private cached = 0;
  private total = 0;
  private readonly missing = {
    usage: [] as number[],
    prompt: [] as number[],
    completion: [] as number[],
    cached: [] as number[],
    total: [] as number[],
  };
  private failed = 0;
  /** Calls whose tokens are unknown, by why (`recordAbandoned`). */
  private readonly abandonedBy: Record<UnmeteredReason, number> = { agent: 0, unread: 0 };
  private readonly notes: string[] = [];

  /** Record one answered call; returns its number. */
  record(usage: CallUsage): number {
    const n = ++this.calls;
    if (usage.usageMissing) {
      this.missing.usage.push(n);
      return n;
    }
    if (usage.promptTokens === null) this.missing.prompt.push(n);
    else this.prompt += usage.promptTokens;
    if (usage.completionTokens === null) this.missing.completion.push(n);
    else this.completion += usage.completionTokens;
    if (usage.cachedTokens === null) this.missing.cached.push(n);
    else this.cached += usage.cachedTokens;
    if (usage.totalTokens === null) this.missing.total.push(n);
    else this.total += usage.totalTokens;
    return n;
  }

  /** An attempt the upstream did not answer with a usable response (its cost, if any, is unknown). */
  recordFailure(): void {
    this.failed += 1;
  }

  /**
   * An attempt the upstream may have billed, whose usage was never read: a failure as above, and
   * for the caps a call whose tokens are unknown, so that it is no way around them. `agent`: the
   * agent abandoned it (closed its connection mid-generation, or the tool loop's deadline came
   * while it was asked); `unread`: answered (2xx) over the size bound the fleet reads (the
   * gateway's, the tool loop's; many choices, logprobs, no max_tokens: the request's doing).
   */
  recordAbandoned(why: UnmeteredReason = "agent"): void {
    this.recordFailure();
    this.abandonedBy[why] += 1;
  }

  /** Whether a call went unmetered (`recordAbandoned`: the agent abandoned it, or its 2xx was unread). */
  get abandonedAny(): boolean {
    return this.abandonedBy.agent + this.abandonedBy.unread > 0;
  }

  /**
   * Calls that count toward a call cap: every one forwarded, answered or not (failed and
   * abandoned ones included): requests the upstream refuses are no way around the cap, nor a way
   * to provoke its rate limit.
   */
  get cappedCalls(): number {
    return this.calls + this.failed;
  }

  /** Any other fact about what could not be observed (bounded by the caller). */
  note(gap: string): void {
    if (this.notes.length < 16) this.notes.push(gap);
  }

  /**
   * Tokens used so far (prompt + completion); `null` once any call did not report them, or the
   * call went unmetered (`recordAbandoned`: what the upstream spent on it is unknown).
   */
  get totalTokens(): number | null {
    const unknown = this.missing.usage.length > 0 || this.missing.total.length > 0 || this.abandonedAny;
    return unknown ? null : this.total;
  }

  summary(): Usage {
    const m = this.missing;
    const noUsage = m.usage.length > 0;
    const gaps: string[] = [];
    if (noUsage) gaps.push(`usage missing on ${describeCalls(m.usage)}`);
    if (m.prompt.length > 0) gaps.push(`prompt_tokens missing on ${describeCalls(m.prompt)}`);
    if (m.completion.length > 0) gaps.push(`completion_tokens missing on ${describeCalls(m.completion)}`);
    if (m.cached.length > 0) {
      gaps.push(`cached_tokens (prompt_tokens_details) missing on ${describeCalls(m.cached)}`);
    }
    if (this.failed > 0) {
      gaps.push(
        `${this.failed} failed upstream attempt${this.failed === 1 ? "" : "s"} not counted (usage unknown)`,
      );
    }
    // A call abandoned mid-generation or answered unread was likely billed: the token sums would be an
    // undercount that looks whole (DESIGN §2 rule 12: a gap, never a made-up number).
    const abandoned = this.abandonedAny;
    const calls = (n: number) => `${n} call${n === 1 ? "" : "s"}`;
    const by = this.abandonedBy;
    if (by.agent > 0)
      gaps.push(`${calls(by.agent)} abandoned by the agent mid-generation: token totals unknown`);
    if (by.unread > 0) {
      gaps.push(
        `${calls(by.unread)} answered over the size bound the fleet reads, unread: token totals unknown`,
      );
    }
    gaps.push(...this.notes);
    return {
      calls: this.calls,
      promptTokens: noUsage || abandoned || m.prompt.length > 0 ? null : this.prompt,
      completionTokens: noUsage || abandoned || m.completion.length > 0 ? null : this.completion,
      cachedTokens: noUsage || abandoned || m.cached.length > 0 ? null : this.cached,
      gaps,
    };
  }
}
