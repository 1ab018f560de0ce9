import type { z } from "zod";

/** A zod issue reduced to where (the full path) and what. */
export interface LeafIssue {
  path: PropertyKey[];
  message: string;
  /** zod's issue, for what a caller says of its kind (`received`). */
  issue: z.core.$ZodIssue;
}

/**
 * The issues a reader can act on, each with its full path: a union's failure as the branch that
 * came closest (a task given inline or by `{ digest }`), so "instruction: required" is not buried
 * under "digest: required"; a record key refused by its own schema as that schema's issues (why,
 * not zod's "Invalid key in record"). The closest branch is one that takes every key the value
 * has, if any does (`{ "id": "t1" }` is an inline task short of fields, not a digest given an
 * unknown `id`), then the one with the fewest issues.
 */
export function leafIssues(
  issues: readonly z.core.$ZodIssue[],
  prefix: readonly PropertyKey[] = [],
): LeafIssue[] {
  const out: LeafIssue[] = [];
  for (const issue of issues) {
    const path = [...prefix, ...issue.path];
    if (issue.code === "invalid_union" && issue.errors.length > 0) {
      const refusesKeys = (branch: readonly z.core.$ZodIssue[]) =>
        branch.some((i) => i.code === "unrecognized_keys" && i.path.length === 0);
      const further = (a: readonly z.core.$ZodIssue[], b: readonly z.core.$ZodIssue[]) =>
        refusesKeys(a) !== refusesKeys(b) ? refusesKeys(a) : a.length > b.length;
      const closest = issue.errors.reduce((best, branch) => (further(best, branch) ? branch : best));
      out.push(...leafIssues(closest, path));
      continue;
    }
    if (issue.code === "invalid_key" && issue.issues.length > 0) {
      out.push(...leafIssues(issue.issues, path));
      continue;
    }
    out.push({ path, message: issue.message, issue });
  }
  return out;
}
