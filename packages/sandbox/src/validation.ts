/** One line per zod issue: `path: message` (zod's issue shape, without importing zod). */
export function formatIssues(
  issues: ReadonlyArray<{ path: ReadonlyArray<PropertyKey>; message: string }>,
): string {
  return issues
    .map((i) => {
      const path = i.path.map((p) => (typeof p === "symbol" ? p.toString() : String(p))).join(".");
      return path ? `${path}: ${i.message}` : i.message;
    })
    .join("; ");
}
