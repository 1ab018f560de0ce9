import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { JANITOR_STEPS, STAGE_OUTCOMES, TEARDOWN_RESULTS } from "./metrics.ts";

const README = readFileSync(new URL("../README.md", import.meta.url), "utf8");

/** The README's table row of a metric. */
function row(metric: string): string {
  const line = README.split("\n").find((l) => l.startsWith(`| \`${metric}\``));
  if (line === undefined) throw new Error(`no row for ${metric} in the README`);
  return line;
}

describe("the README's metric table names every label value the code gives", () => {
  it.each([
    ["fleet_stage_jobs_total", STAGE_OUTCOMES],
    ["fleet_janitor_step_failures_total", JANITOR_STEPS],
    ["fleet_teardown_attempts_total", TEARDOWN_RESULTS],
  ] as const)("%s", (metric, values) => {
    const text = row(metric);
    const missing = values.filter((v) => !new RegExp(`(^|[^\\w])${v}([^\\w]|$)`).test(text));
    expect(missing).toEqual([]);
  });
});
