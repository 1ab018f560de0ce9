import { leafIssues } from "@fleet/contracts";
import type { z } from "zod";

/** One readable validation problem: where (`agent.timeoutS`, `""` for the body) and what. */
export interface Issue {
  path: string;
  message: string;
}

/** Most issues reported for one request; a 10,000-row batch with one bad field each stays readable. */
export const MAX_ISSUES = 20;

type Path = readonly PropertyKey[];

/**
 * Flatten zod issues into `{ path, message }` (`leafIssues`: a union's closest branch, a refused
 * record key's own reasons).
 */
export function describeIssues(issues: readonly z.core.$ZodIssue[], prefix: Path = []): Issue[] {
  return leafIssues(issues, prefix).map((leaf) => ({
    path: formatPath(leaf.path),
    message: messageOf(leaf.issue),
  }));
}

function messageOf(issue: z.core.$ZodIssue): string {
  // zod reports JSON's 1e999 (Infinity) as "expected number, received Infinity": say so plainly.
  const received = (issue as { received?: unknown }).received;
  if (issue.code === "invalid_type" && typeof received === "string" && !issue.message.includes(received)) {
    return `${issue.message} (got ${received})`;
  }
  return issue.message;
}

/** `["rollouts", 3, "task", "id"]` → `rollouts[3].task.id`. */
export function formatPath(path: Path): string {
  let out = "";
  for (const part of path) {
    if (typeof part === "number") out += `[${part}]`;
    else out += out === "" ? String(part) : `.${String(part)}`;
  }
  return out;
}

/** The first `MAX_ISSUES` issues and how many there were in all. */
export function capIssues<T>(issues: readonly T[]): { issues: T[]; total: number } {
  return { issues: issues.slice(0, MAX_ISSUES), total: issues.length };
}
