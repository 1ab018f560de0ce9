import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { describe, expect, it } from "vitest";
import { REPO_ROOT } from "../../scripts/lib/fleet-processes.ts";
import { hasPromtool, lintMetrics, PROMTOOL_MISSING, promtool } from "./prom.ts";

const DIR = join(REPO_ROOT, "configs/prometheus");
const available = hasPromtool();
if (!available) console.warn(`\n!!! test/ops/promtool.test.ts ${PROMTOOL_MISSING}\n`);

/** Alert names of alerts.yml. */
function alertNames(rules: string): string[] {
  return [...rules.matchAll(/^\s*- alert: (\w+)\s*$/gm)].map((m) => m[1]!);
}

/** For each alert, how many test cases expect it firing and how many expect nothing. */
function casesByAlert(tests: string): Map<string, { fires: number; quiet: number }> {
  const cases = new Map<string, { fires: number; quiet: number }>();
  const lines = tests.split("\n");
  lines.forEach((line, i) => {
    const m = /^\s*alertname: (\w+)\s*$/.exec(line);
    if (!m) return;
    const c = cases.get(m[1]!) ?? { fires: 0, quiet: 0 };
    if (/^\s*exp_alerts: \[\]\s*$/.test(lines[i + 1] ?? "")) c.quiet++;
    else if (/^\s*exp_alerts:\s*$/.test(lines[i + 1] ?? "")) c.fires++;
    cases.set(m[1]!, c);
  });
  return cases;
}

describe("the alerts' documentation", () => {
  it("configs/prometheus/README.md has a row for every alert of alerts.yml, and none for an alert it has not", () => {
    const alerts = alertNames(readFileSync(join(DIR, "alerts.yml"), "utf8"));
    const rows = [...readFileSync(join(DIR, "README.md"), "utf8").matchAll(/^\| `(Fleet\w+)`/gm)].map(
      (m) => m[1]!,
    );
    expect(alerts.length).toBeGreaterThan(10);
    expect([...rows].sort()).toEqual([...alerts].sort());
  });
});

describe.skipIf(!available)("Prometheus config and alert rules (promtool)", () => {
  it("prometheus.yml and the rules it loads are valid", () => {
    const r = promtool(["check", "config", join(DIR, "prometheus.yml")]);
    expect(r.output).toContain("SUCCESS");
    expect(r.status).toBe(0);
  });

  it("every alert fires and resolves in its promtool unit tests", () => {
    const rules = readFileSync(join(DIR, "alerts.yml"), "utf8");
    const tests = readFileSync(join(DIR, "alerts.test.yml"), "utf8");
    const names = alertNames(rules);
    expect(names.length).toBeGreaterThanOrEqual(11);
    const cases = casesByAlert(tests);
    for (const name of names) {
      expect(cases.get(name)?.fires ?? 0, `${name} fires in a test case`).toBeGreaterThan(0);
      expect(cases.get(name)?.quiet ?? 0, `${name} resolves in a test case`).toBeGreaterThan(0);
    }
    // Each rule carries its runbook text.
    expect(rules.match(/^\s+runbook: /gm)?.length).toBe(names.length);

    const r = promtool(["test", "rules", join(DIR, "alerts.test.yml")]);
    expect(r.output).toContain("SUCCESS");
    expect(r.status).toBe(0);
  });

  it("the rule tests catch a broken rule (a masked-ratio threshold of 50 %)", () => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-rules-"));
    try {
      cpSync(join(DIR, "alerts.test.yml"), join(dir, "alerts.test.yml"));
      const broken = readFileSync(join(DIR, "alerts.yml"), "utf8").replace("> 0.05", "> 0.5");
      writeFileSync(join(dir, "alerts.yml"), broken);
      const r = promtool(["test", "rules", join(dir, "alerts.test.yml")]);
      expect(r.status).not.toBe(0);
      expect(r.output).toContain("FleetMaskedRatioHigh");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("every fleet metric, with default process metrics, passes promtool check metrics", async () => {
    const registry = createMetricsRegistry({ app: "lint" });
    const m = createFleetMetrics(registry);
    m.rolloutsFinished.inc({ status: "masked", failure_kind: "sandbox_lost" });
    m.stageDuration.observe({ stage: "seed", outcome: "ok" }, 1.5);
    m.rolloutDuration.observe({ status: "completed" }, 30);
    m.queueJobs.set({ queue: "seed", state: "waiting" }, 3);
    m.queueOldestWaitingAge.set({ queue: "seed" }, 12);
    m.queueWorkers.set({ queue: "seed" }, 1);
    m.queueStalledJobs.inc({ queue: "run" });
    m.sandboxesActive.set({ provider: "docker", owner: "resources" }, 2);
    m.sandboxCreateDuration.observe({ provider: "docker" }, 0.3);
    m.teardownLedgerEntries.set(0);
    m.reward.observe(0.75);
    m.workerHeartbeat.set({ worker: "agent-worker" }, Date.now() / 1000);
    m.rolloutsInflight.set(4);
    m.redisUp.set(1);
    const text = await registry.metrics();
    expect(text).toContain("nodejs_eventloop_lag_seconds");
    expect(lintMetrics(text)).toBe("");
    // And the lint can fail: a gauge with a counter's suffix.
    expect(lintMetrics("# HELP x_total a gauge\n# TYPE x_total gauge\nx_total 1\n")).toMatch(/_total/);
  });
});
