/** The fields of a result line the summary reads; everything else is passed through untouched. */
interface ResultFields {
  status?: unknown;
  reward?: unknown;
  mask?: unknown;
  failureKind?: unknown;
  teardown?: unknown;
  agentLaunches?: unknown;
}

export interface ResultSummary {
  total: number;
  /** Results per status (`completed`, `masked`, `failed`, `cancelled`, ...). */
  byStatus: Record<string, number>;
  /** Unmasked results with a numeric reward. */
  graded: number;
  /** Mean reward over graded results; null when none was graded. */
  meanReward: number | null;
  /** Results with `mask: true` (infrastructure failures, never scored). */
  masked: number;
  /** Results per failure kind (any status). */
  byFailureKind: Record<string, number>;
  /** Results per status, then per failure kind; a result with `mask: true` counts under `masked`. */
  failureKindsByStatus: Record<string, Record<string, number>>;
  /** Results whose sandbox teardown is still pending (the janitor retries it). */
  teardownPending: number;
  /** Results whose agent was launched more than once (rerun after its worker died, say). */
  rerun: number;
  /** Lines that were not JSON objects. */
  unreadable: number;
}

/** Accumulates a summary over result lines as they stream past. */
export class ResultTally {
  private readonly s: ResultSummary = {
    total: 0,
    byStatus: {},
    graded: 0,
    meanReward: null,
    masked: 0,
    byFailureKind: {},
    failureKindsByStatus: {},
    teardownPending: 0,
    rerun: 0,
    unreadable: 0,
  };
  private rewardSum = 0;

  /** Add one result line (raw JSON text). */
  addLine(line: string): void {
    let value: unknown;
    try {
      value = JSON.parse(line);
    } catch {
      this.s.unreadable++;
      return;
    }
    if (typeof value !== "object" || value === null || Array.isArray(value)) {
      this.s.unreadable++;
      return;
    }
    this.add(value as ResultFields);
  }

  add(result: ResultFields): void {
    const s = this.s;
    s.total++;
    const status = typeof result.status === "string" ? result.status : "unknown";
    s.byStatus[status] = (s.byStatus[status] ?? 0) + 1;
    if (result.mask === true) s.masked++;
    if (typeof result.failureKind === "string") {
      const kind = result.failureKind;
      s.byFailureKind[kind] = (s.byFailureKind[kind] ?? 0) + 1;
      const group = result.mask === true ? "masked" : status;
      const kinds = s.failureKindsByStatus[group] ?? {};
      kinds[kind] = (kinds[kind] ?? 0) + 1;
      s.failureKindsByStatus[group] = kinds;
    }
    if (result.teardown === "pending") s.teardownPending++;
    if (typeof result.agentLaunches === "number" && result.agentLaunches > 1) s.rerun++;
    if (result.mask !== true && typeof result.reward === "number" && Number.isFinite(result.reward)) {
      s.graded++;
      this.rewardSum += result.reward;
    }
  }

  summary(): ResultSummary {
    return {
      ...this.s,
      byStatus: { ...this.s.byStatus },
      byFailureKind: { ...this.s.byFailureKind },
      failureKindsByStatus: Object.fromEntries(
        Object.entries(this.s.failureKindsByStatus).map(([st, kinds]) => [st, { ...kinds }]),
      ),
      meanReward: this.s.graded > 0 ? this.rewardSum / this.s.graded : null,
    };
  }
}

const STATUS_ORDER = ["completed", "masked", "failed", "cancelled"];

/** The terminal statuses in their usual order, then any other status seen. */
function statusNames(byStatus: Record<string, number>): string[] {
  return [...STATUS_ORDER, ...Object.keys(byStatus).filter((st) => !STATUS_ORDER.includes(st))];
}

/** Human-readable summary, one fact per line. */
export function renderSummary(s: ResultSummary): string {
  const statuses = statusNames(s.byStatus).map((st) => `${st} ${s.byStatus[st] ?? 0}`);
  const lines = [`results: ${s.total}`, `  ${statuses.join("  ")}`];
  lines.push(
    s.meanReward === null
      ? "  mean reward: n/a (nothing graded)"
      : `  mean reward: ${s.meanReward.toFixed(4)} over ${s.graded} graded`,
  );
  // Each status's failure kinds on its own line: a cancelled or failed rollout is not masked.
  const kindsOf = (status: string) => {
    const kinds = Object.entries(s.failureKindsByStatus[status] ?? {})
      .sort((a, b) => b[1] - a[1])
      .map(([k, n]) => `${k} ${n}`);
    return kinds.length > 0 ? `  (failure kinds: ${kinds.join(", ")})` : "";
  };
  lines.push(`  masked: ${s.masked}${kindsOf("masked")}`);
  for (const status of statusNames(s.byStatus)) {
    if (status !== "masked" && kindsOf(status) !== "") {
      lines.push(`  ${status}: ${s.byStatus[status] ?? 0}${kindsOf(status)}`);
    }
  }
  if (s.rerun > 0) {
    lines.push(
      `  agent rerun: ${s.rerun} (launched more than once: its worker died, or its sandbox failed under it)`,
    );
  }
  if (s.teardownPending > 0) lines.push(`  teardown pending: ${s.teardownPending} (the janitor is retrying)`);
  if (s.unreadable > 0) lines.push(`  unreadable result lines: ${s.unreadable}`);
  return lines.join("\n");
}
