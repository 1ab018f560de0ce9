interface IssueLike {
  path: ReadonlyArray<PropertyKey>;
  message: string;
  /** A refused record key's own issues (zod's `invalid_key`). */
  issues?: ReadonlyArray<IssueLike>;
}

/** One line per zod issue: `path: message` (zod's issue shape, without importing zod). */
export function formatIssues(issues: ReadonlyArray<IssueLike>): string {
  const lines: string[] = [];
  const walk = (list: ReadonlyArray<IssueLike>, prefix: ReadonlyArray<PropertyKey>) => {
    for (const i of list) {
      const at = [...prefix, ...i.path];
      if (i.issues && i.issues.length > 0) {
        walk(i.issues, at);
        continue;
      }
      const path = at.map((p) => (typeof p === "symbol" ? p.toString() : String(p))).join(".");
      lines.push(path ? `${path}: ${i.message}` : i.message);
    }
  };
  walk(issues, []);
  return lines.join("; ");
}
