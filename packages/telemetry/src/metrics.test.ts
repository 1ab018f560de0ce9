import { register as globalRegistry } from "prom-client";
import { afterEach, describe, expect, it } from "vitest";
import { createFleetMetrics, createMetricsRegistry } from "./metrics.ts";
import { type MetricsServer, startMetricsServer } from "./metrics-server.ts";

describe("createMetricsRegistry / createFleetMetrics", () => {
  it("gives each registry its own metrics, labelled with its app, and leaves the global registry alone", async () => {
    const a = createMetricsRegistry({ app: "a", defaultMetrics: false });
    const b = createMetricsRegistry({ app: "b", defaultMetrics: false });
    const ma = createFleetMetrics(a);
    const mb = createFleetMetrics(b);
    ma.rolloutsFinished.inc({ status: "completed", failure_kind: "none" }, 3);
    mb.reward.observe(1);

    const textA = await a.metrics();
    const textB = await b.metrics();
    expect(textA).toContain(
      'fleet_rollouts_finished_total{status="completed",failure_kind="none",app="a"} 3',
    );
    expect(textB).not.toContain("fleet_rollouts_finished_total{");
    expect(textB).toContain('fleet_reward_count{app="b"} 1');
    expect(textA).toContain('fleet_reward_count{app="a"} 0');
    expect(globalRegistry.getSingleMetric("fleet_reward")).toBeUndefined();
  });

  it("registers every documented metric with base-unit names", async () => {
    const r = createMetricsRegistry({ app: "x", defaultMetrics: false });
    createFleetMetrics(r);
    const names = (await r.getMetricsAsJSON()).map((m) => m.name).sort();
    expect(names).toEqual(
      [
        "fleet_closes_given_up_total",
        "fleet_janitor_last_pass_timestamp_seconds",
        "fleet_janitor_step_failures_total",
        "fleet_model_tokens_total",
        "fleet_queue_jobs",
        "fleet_queue_oldest_waiting_age_seconds",
        "fleet_queue_stalled_jobs_total",
        "fleet_queue_workers",
        "fleet_redis_up",
        "fleet_redis_writable",
        "fleet_redis_durable",
        "fleet_redis_tls_cert_expiry_timestamp_seconds",
        "fleet_sandbox_provider_up",
        "fleet_seeding_held",
        "fleet_rollouts_inflight",
        "fleet_reward",
        "fleet_rollout_duration_seconds",
        "fleet_rollouts_finished_total",
        "fleet_sandbox_create_duration_seconds",
        "fleet_sandboxes_active",
        "fleet_stage_duration_seconds",
        "fleet_stage_jobs_total",
        "fleet_teardown_attempts_total",
        "fleet_teardown_ledger_entries",
        "fleet_teardown_ledger_oldest_age_seconds",
        "fleet_worker_heartbeat_timestamp_seconds",
      ].sort(),
    );
  });

  it("initialises known counter series to zero", async () => {
    const r = createMetricsRegistry({ app: "x", defaultMetrics: false });
    createFleetMetrics(r);
    expect(await r.metrics()).toContain('fleet_stage_jobs_total{stage="verify",outcome="retry",app="x"} 0');
  });

  it("exports no sampled gauge before its sampler set it: a worker never reports Redis down or nothing in flight", async () => {
    const r = createMetricsRegistry({ app: "agent-worker", defaultMetrics: false });
    const m = createFleetMetrics(r);
    const samples = async () => (await r.metrics()).split("\n").filter((l) => !l.startsWith("#"));
    for (const name of [
      "fleet_redis_up",
      "fleet_redis_writable",
      "fleet_redis_durable",
      "fleet_redis_tls_cert_expiry_timestamp_seconds",
      "fleet_rollouts_inflight",
      "fleet_teardown_ledger_entries",
      "fleet_teardown_ledger_oldest_age_seconds",
    ]) {
      expect((await samples()).filter((l) => l.startsWith(`${name}{`))).toEqual([]);
    }
    m.redisUp.set(1);
    expect(await samples()).toContain('fleet_redis_up{app="agent-worker"} 1');
  });

  it("tells long rollouts' and runs' durations apart up to a week (a rollout's longest deadline): a 2-day and a 6-day one land in finite buckets of their own, not both in +Inf", async () => {
    const r = createMetricsRegistry({ app: "x", defaultMetrics: false });
    const m = createFleetMetrics(r);
    const day = 86_400;
    /** The smallest bucket bound that counts an observation of `labels` (the histogram holds one). */
    const firstBucket = async (name: string, labels: Record<string, string>) => {
      const metric = (await r.getMetricsAsJSON()).find((x) => x.name === name);
      const buckets = (metric?.values ?? []).filter(
        (v) =>
          (v as { metricName?: string }).metricName === `${name}_bucket` &&
          Object.entries(labels).every(([k, want]) => v.labels[k] === want) &&
          v.value > 0,
      );
      return Math.min(
        ...buckets.map((v) => (v.labels.le === "+Inf" ? Number.POSITIVE_INFINITY : Number(v.labels.le))),
      );
    };
    m.rolloutDuration.observe({ status: "completed" }, 2 * day);
    m.rolloutDuration.observe({ status: "masked" }, 6 * day);
    m.stageDuration.observe({ stage: "run", outcome: "ok" }, 2 * day);
    m.stageDuration.observe({ stage: "verify", outcome: "ok" }, 6 * day);
    const rollouts = [
      await firstBucket("fleet_rollout_duration_seconds", { status: "completed" }),
      await firstBucket("fleet_rollout_duration_seconds", { status: "masked" }),
    ];
    const stages = [
      await firstBucket("fleet_stage_duration_seconds", { stage: "run" }),
      await firstBucket("fleet_stage_duration_seconds", { stage: "verify" }),
    ];
    for (const [twoDays, sixDays] of [rollouts, stages]) {
      expect(sixDays).toBeLessThanOrEqual(7 * day);
      expect(twoDays).toBeLessThan(sixDays!);
    }
  });

  it("refuses to register the fleet metrics twice in one registry", () => {
    const r = createMetricsRegistry({ app: "x", defaultMetrics: false });
    createFleetMetrics(r);
    expect(() => createFleetMetrics(r)).toThrow(/already been registered/);
  });

  it("collects default process metrics when asked", async () => {
    const r = createMetricsRegistry({ app: "x" });
    expect(await r.metrics()).toContain('process_cpu_user_seconds_total{app="x"}');
  });
});

describe("startMetricsServer", () => {
  let server: MetricsServer | undefined;
  afterEach(async () => {
    await server?.close();
    server = undefined;
  });

  it("serves /metrics in the Prometheus text format and /healthz on 127.0.0.1", async () => {
    const registry = createMetricsRegistry({ app: "srv", defaultMetrics: false });
    const metrics = createFleetMetrics(registry);
    metrics.teardownLedgerEntries.set(4);
    server = await startMetricsServer({ registry, port: 0 });
    expect(server.port).toBeGreaterThan(0);
    expect(server.host).toBe("127.0.0.1");

    const res = await fetch(`http://127.0.0.1:${server.port}/metrics`);
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("text/plain");
    const text = await res.text();
    expect(text).toContain("# TYPE fleet_teardown_ledger_entries gauge");
    expect(text).toContain('fleet_teardown_ledger_entries{app="srv"} 4');

    const health = await fetch(`http://127.0.0.1:${server.port}/healthz`);
    expect(health.status).toBe(200);
    expect(await health.json()).toEqual({ status: "ok" });
    expect((await fetch(`http://127.0.0.1:${server.port}/nope`)).status).toBe(404);
    expect((await fetch(`http://127.0.0.1:${server.port}/metrics`, { method: "POST" })).status).toBe(405);
  });

  it("stops accepting connections after close", async () => {
    const registry = createMetricsRegistry({ app: "srv", defaultMetrics: false });
    const s = await startMetricsServer({ registry, port: 0 });
    await fetch(`http://127.0.0.1:${s.port}/healthz`);
    await s.close();
    await s.close();
    await expect(fetch(`http://127.0.0.1:${s.port}/healthz`)).rejects.toThrow();
  });
});
