import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { TaskContent } from "@fleet/contracts";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type AppKind, FleetProcesses } from "../../scripts/lib/fleet-processes.ts";
import { containersOf, dropPrefix, IMAGE, REDIS_URL, testPrefix, waitFor } from "../helpers/env.ts";
import {
  hasPromtool,
  lintMetrics,
  PROMTOOL_MISSING,
  parseMetrics,
  type Sample,
  sampleValue,
} from "./prom.ts";

const STAGES = ["seed", "run", "verify", "close"] as const;
const TERMINAL = ["completed", "masked", "failed", "cancelled"];

/**
 * The whole fleet as processes, each with its own metrics registry (workers and janitor on a
 * FLEET_METRICS_PORT=0 server, the dispatcher on its API port): a small real batch, then every
 * scrape goes through `promtool check metrics` and carries the right numbers.
 */
if (!hasPromtool())
  console.warn(`\n!!! test/ops/metrics.test.ts: the lint test is skipped: ${PROMTOOL_MISSING}\n`);

describe("metrics of a real run", () => {
  const prefix = testPrefix("metrics");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-ops-metrics-"));
  let fleet: FleetProcesses;
  let task: TaskContent;
  const ids: string[] = [];

  const api = async (method: string, path: string, body?: unknown) => {
    const res = await fetch(`${fleet.url}${path}`, {
      method,
      headers: {
        authorization: `Bearer ${fleet.token}`,
        ...(body === undefined ? {} : { "content-type": "application/json" }),
      },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    return { status: res.status, body: (await res.json()) as Record<string, unknown> };
  };

  const scrapeUrl = (kind: AppKind) => {
    if (kind === "dispatcher") return `${fleet.url}/metrics`;
    const port = fleet.of(kind)[0]?.metricsPort;
    if (!port) throw new Error(`${kind} logged no metrics port`);
    return `http://127.0.0.1:${port}/metrics`;
  };
  const scrapeText = async (kind: AppKind) => {
    const res = await fetch(scrapeUrl(kind));
    expect(res.status).toBe(200);
    return res.text();
  };
  const scrape = async (kind: AppKind): Promise<Sample[]> => parseMetrics(await scrapeText(kind));

  beforeAll(async () => {
    task = { ...(await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!, image: IMAGE };
    fleet = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix,
      logDir,
      env: { FLEET_METRICS_PORT: "0", FLEET_JANITOR_INTERVAL_MS: "500" },
    });
  });

  afterAll(async () => {
    await fleet?.stop();
    await dropPrefix(REDIS_URL, prefix);
    expect(await containersOf(ids)).toBe(0);
  });

  it("every process serves its own metrics", async () => {
    for (const kind of ["resources", "agent", "verifier", "janitor"] as const) {
      expect(fleet.of(kind)[0]?.metricsPort, kind).toBeGreaterThan(0);
    }
    // Five registries, one per process, each labelled with its app.
    const apps = await Promise.all(
      (["dispatcher", "resources", "agent", "verifier", "janitor"] as const).map(
        async (k) => (await scrape(k)).find((s) => s.name === "process_start_time_seconds")?.labels.app,
      ),
    );
    expect(apps).toEqual(["dispatcher", "resources-worker", "agent-worker", "verifier-worker", "janitor"]);
  });

  it("while a rollout runs: the run queue's active job, the rollout in flight and its sandbox show", async () => {
    // An agent that takes a few seconds, so the gauges can be caught mid-run.
    const slow = {
      harness: "command",
      argv: ["sh", "-c", "sleep 6; echo 'Hello, fleet!' > /workspace/hello.txt"],
    };
    const res = await api("POST", "/v1/rollouts", { task, agent: slow });
    expect(res.status).toBe(202);
    ids.push(String(res.body.id));
    await waitFor("the run stage to be active", async () => {
      const d = await scrape("dispatcher");
      return sampleValue(d, "fleet_queue_jobs", { queue: "run", state: "active" }) === 1 ? d : null;
    });
    const d = await scrape("dispatcher");
    expect(sampleValue(d, "fleet_rollouts_inflight")).toBe(1);
    expect(sampleValue(d, "fleet_queue_workers", { queue: "run" })).toBe(1);
    // The janitor samples the provider each pass: the rollout's task sandbox is there.
    await waitFor(
      "the janitor to see the task sandbox",
      async () =>
        sampleValue(await scrape("janitor"), "fleet_sandboxes_active", {
          provider: "docker",
          owner: "resources",
        }) >= 1,
      20_000,
    );
  });

  it("after a small batch: finished counts, stage histograms and queue gauges are right", async () => {
    const batch = await api("POST", "/v1/batches", {
      rollouts: [
        { task, agent: { harness: "oracle" } },
        { task, agent: { harness: "oracle" } },
      ],
    });
    expect(batch.status).toBe(202);
    ids.push(...(batch.body.rolloutIds as string[]));
    const n = ids.length; // 3: the slow one and two oracles
    for (const id of ids) {
      const r = await waitFor(`result of ${id}`, async () => {
        const x = await api("GET", `/v1/rollouts/${id}`);
        return TERMINAL.includes(String(x.body.status)) ? x.body : null;
      });
      expect(r).toMatchObject({ status: "completed", reward: 1 });
    }

    // A close's job ends a moment after its result shows (its stage counted, then BullMQ moves
    // the job to completed): wait for both before reading what follows.
    await waitFor("the last close counted and its job completed", async () => {
      const closes = sampleValue(await scrape("resources"), "fleet_stage_jobs_total", {
        stage: "close",
        outcome: "ok",
      });
      const moved = sampleValue(await scrape("dispatcher"), "fleet_queue_jobs", {
        queue: "close",
        state: "completed",
      });
      return closes === n && moved === n;
    });

    // The resources worker finalises (close): finished count, rollout duration, reward.
    const res = await scrape("resources");
    expect(
      sampleValue(res, "fleet_rollouts_finished_total", { status: "completed", failure_kind: "none" }),
    ).toBe(n);
    expect(
      sampleValue(res, "fleet_rollouts_finished_total", { status: "masked", failure_kind: "sandbox_lost" }),
    ).toBe(0);
    expect(sampleValue(res, "fleet_rollout_duration_seconds_count", { status: "completed" })).toBe(n);
    expect(sampleValue(res, "fleet_reward_count")).toBe(n);
    expect(sampleValue(res, "fleet_reward_bucket", { le: "0.9" })).toBe(0);
    expect(sampleValue(res, "fleet_reward_bucket", { le: "1" })).toBe(n);
    expect(sampleValue(res, "fleet_sandbox_create_duration_seconds_count", { provider: "docker" })).toBe(n);
    expect(sampleValue(res, "fleet_teardown_attempts_total", { result: "confirmed" })).toBe(n);
    expect(sampleValue(res, "fleet_queue_stalled_jobs_total", { queue: "seed" })).toBe(0);

    // Stage histograms, each in the process that runs the stage.
    const byKind = {
      resources: res,
      agent: await scrape("agent"),
      verifier: await scrape("verifier"),
    };
    const owner = { seed: "resources", run: "agent", verify: "verifier", close: "resources" } as const;
    for (const stage of STAGES) {
      const s = byKind[owner[stage]];
      expect({
        stage,
        n: sampleValue(s, "fleet_stage_duration_seconds_count", { stage, outcome: "ok" }),
      }).toEqual({
        stage,
        n,
      });
      expect(
        sampleValue(s, "fleet_stage_duration_seconds_bucket", { stage, outcome: "ok", le: "+Inf" }),
      ).toBe(n);
      expect(sampleValue(s, "fleet_stage_duration_seconds_sum", { stage, outcome: "ok" })).toBeGreaterThan(0);
      expect(sampleValue(s, "fleet_stage_jobs_total", { stage, outcome: "ok" })).toBe(n);
    }
    // The slow agent ran ≥ 6 s: at least one run observation above the 5 s bucket.
    expect(
      sampleValue(byKind.agent, "fleet_stage_duration_seconds_bucket", {
        stage: "run",
        outcome: "ok",
        le: "5",
      }),
    ).toBeLessThan(n);
    for (const [kind, samples] of Object.entries(byKind)) {
      const beat = sampleValue(samples, "fleet_worker_heartbeat_timestamp_seconds", {
        worker: `${kind}-worker`,
      });
      expect(Date.now() / 1000 - beat).toBeLessThan(30);
    }

    // The dispatcher's queue gauges, sampled from Redis at scrape time.
    const d = await scrape("dispatcher");
    expect(sampleValue(d, "fleet_redis_up")).toBe(1);
    expect(sampleValue(d, "fleet_rollouts_inflight")).toBe(0);
    expect(sampleValue(d, "fleet_teardown_ledger_entries")).toBe(0);
    expect(sampleValue(d, "fleet_teardown_ledger_oldest_age_seconds")).toBe(0);
    for (const queue of STAGES) {
      const at = (state: string) => sampleValue(d, "fleet_queue_jobs", { queue, state });
      expect({
        queue,
        completed: at("completed"),
        waiting: at("waiting"),
        active: at("active"),
        failed: at("failed"),
      }).toEqual({
        queue,
        completed: n,
        waiting: 0,
        active: 0,
        failed: 0,
      });
      expect(sampleValue(d, "fleet_queue_oldest_waiting_age_seconds", { queue })).toBe(0);
      expect(sampleValue(d, "fleet_queue_workers", { queue })).toBe(1);
    }
    expect(sampleValue(d, "fleet_queue_workers", { queue: "janitor" })).toBe(1);

    // Only the dispatcher samples Redis and the rollouts in flight: no worker reports them (a
    // made-up 0 there fired FleetRedisDown for every worker on a healthy fleet).
    for (const kind of ["resources", "agent", "verifier", "janitor"] as const) {
      const names = new Set((await scrape(kind)).map((s) => s.name));
      expect(names.has("fleet_redis_up") || names.has("fleet_rollouts_inflight"), kind).toBe(false);
    }
    // Every app checked the Redis it runs on at its start (and checks it again at each reconnect).
    for (const kind of ["dispatcher", "resources", "agent", "verifier", "janitor"] as const) {
      expect(sampleValue(await scrape(kind), "fleet_redis_durable"), kind).toBe(1);
    }
    // The janitor: ledger empty; the heartbeat beats.
    const j = await scrape("janitor");
    expect(sampleValue(j, "fleet_teardown_ledger_entries")).toBe(0);
    expect(sampleValue(j, "fleet_teardown_ledger_oldest_age_seconds")).toBe(0);
    // It finalizes rollouts too (those whose closes keep failing, past their deadline): their
    // series start at 0, or increase() (the masked-ratio alert) would miss its first.
    expect(
      sampleValue(j, "fleet_rollouts_finished_total", {
        status: "masked",
        failure_kind: "deadline_exceeded",
      }),
    ).toBe(0);
    expect(
      Date.now() / 1000 - sampleValue(j, "fleet_worker_heartbeat_timestamp_seconds", { worker: "janitor" }),
    ).toBeLessThan(30);
  });

  // Its own test, so that a machine without promtool reports it skipped rather than passed.
  it.skipIf(!hasPromtool())("every process's scrape passes promtool's lint", async () => {
    for (const kind of ["dispatcher", "resources", "agent", "verifier", "janitor"] as const) {
      expect({ kind, lint: lintMetrics(await scrapeText(kind)) }).toEqual({ kind, lint: "" });
    }
  });
});
