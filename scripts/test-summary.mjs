// Prints vitest's JSON report as one plain closing line: "vitest: N passed, N failed, N skipped".
// With --fail-on-skip (CI), names every skipped test and exits 1 when there is one: the tests
// that skip without a tool or a kernel feature (promtool, Chromium, compose, bwrap, cgroups)
// must all run on the CI machine, where a skip would otherwise pass for green.
import { readFileSync } from "node:fs";

const args = process.argv.slice(2);
const failOnSkip = args.includes("--fail-on-skip");
const file = args.find((a) => !a.startsWith("--")) ?? "test-artifacts/vitest.json";
let r;
try {
  r = JSON.parse(readFileSync(file, "utf8"));
} catch (err) {
  console.log(`vitest: no report at ${file} (${err instanceof Error ? err.message : String(err)})`);
  process.exit(failOnSkip ? 1 : 0);
}
const skipped = (r.numPendingTests ?? 0) + (r.numTodoTests ?? 0);
console.log(`vitest: ${r.numPassedTests} passed, ${r.numFailedTests} failed, ${skipped} skipped`);
if (failOnSkip && skipped > 0) {
  for (const f of r.testResults ?? []) {
    for (const t of f.assertionResults ?? []) {
      if (["pending", "skipped", "todo"].includes(t.status)) console.log(`SKIPPED: ${f.name}: ${t.fullName}`);
    }
  }
  console.log(`FAIL: ${skipped} test(s) skipped; CI runs every test`);
  process.exit(1);
}
