// Prints vitest's JSON report as one plain closing line: "vitest: N passed, N failed, N skipped".
import { readFileSync } from "node:fs";

const file = process.argv[2] ?? "test-artifacts/vitest.json";
try {
  const r = JSON.parse(readFileSync(file, "utf8"));
  const skipped = (r.numPendingTests ?? 0) + (r.numTodoTests ?? 0);
  console.log(`vitest: ${r.numPassedTests} passed, ${r.numFailedTests} failed, ${skipped} skipped`);
} catch (err) {
  console.log(`vitest: no report at ${file} (${err instanceof Error ? err.message : String(err)})`);
}
