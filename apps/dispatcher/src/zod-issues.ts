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
 * Flatten zod issues into `{ path, message }`. A union failure (task: inline content or
 * `{ digest }`) reports the branch that came closest (fewest issues) rather than every branch,
 * so "instruction: required" is not buried under "digest: required".
 */
export function describeIssues(issues: readonly z.core.$ZodIssue[], prefix: Path = []): Issue[] {
  const out: Issue[] = [];
  for (const issue of issues) {
    const path = [...prefix, ...issue.path];
    if (issue.code === "invalid_union" && issue.errors.length > 0) {
      const closest = issue.errors.reduce((best, branch) => (branch.length < best.length ? branch : best));
      out.push(...describeIssues(closest, path));
      continue;
    }
    if (issue.code === "invalid_key" && issue.issues.length > 0) {
      // A record key refused by its own schema: say why, not "Invalid key in record".
      out.push(...describeIssues(issue.issues, path));
      continue;
    }
    out.push({ path: formatPath(path), message: messageOf(issue) });
  }
  return out;
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
