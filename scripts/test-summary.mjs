// Prints vitest's JSON report as a closing line, "vitest: N passed, N failed, N skipped", then each
// failed test and file with the gist of its error, and the slowest files ("durations: ...").
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
// What failed and why, in a few lines each: CI's log may be seen only from its end. A file's own
// message is a hook's or an import's error (its tests are then reported skipped).
const gist = (text) =>
  String(text ?? "")
    // biome-ignore lint/suspicious/noControlCharactersInRegex: the terminal's colour codes
    .replace(/\x1b\[[0-9;]*m/g, "")
    .split("\n")
    .map((l) => l.trim())
    .filter((l) => l && !l.startsWith("at "))
    .slice(0, 3)
    .join(" | ")
    .slice(0, 400);
const files = r.testResults ?? [];
for (const f of files) {
  if (f.status === "failed" && f.message) console.log(`FAILED FILE: ${f.name}: ${gist(f.message)}`);
  for (const t of f.assertionResults ?? []) {
    if (t.status === "failed")
      console.log(`FAILED: ${f.name}: ${t.fullName}: ${gist(t.failureMessages?.[0])}`);
  }
}
// The slowest files, to tell a slow host (everything longer) from one file that waited.
const timed = files
  .filter((f) => Number.isFinite(f.endTime - f.startTime))
  .sort((a, b) => b.endTime - b.startTime - (a.endTime - a.startTime));
const total = timed.reduce((sum, f) => sum + (f.endTime - f.startTime), 0);
console.log(
  `durations: ${(total / 1000).toFixed(0)} s in ${timed.length} files; slowest: ${timed
    .slice(0, 8)
    .map(
      (f) =>
        `${f.name.replace(/^.*?\/(packages|apps|test)\//, "$1/")} ${((f.endTime - f.startTime) / 1000).toFixed(0)} s`,
    )
    .join(", ")}`,
);
if (failOnSkip && skipped > 0) {
  for (const f of r.testResults ?? []) {
    for (const t of f.assertionResults ?? []) {
      if (["pending", "skipped", "todo"].includes(t.status)) console.log(`SKIPPED: ${f.name}: ${t.fullName}`);
    }
  }
  console.log(`FAIL: ${skipped} test(s) skipped; CI runs every test`);
  process.exit(1);
}
