/**
 * Drill: Redis fills up mid-run. N no-op rollouts (in-memory sandboxes, agents of `--agent-ms`)
 * through the four stages in one process, on a Redis of the drill's own; once the first agents
 * ran, its maxmemory is set under what it holds (`noeviction`: every write that needs memory is
 * refused) for `--full-s`, then lifted. Prints the rollouts' outcomes (status / failure kind), how
 * many stage jobs were held (`redis_held`) and retried, how many commands a second Redis ran while
 * full (refused ones included), and how long the last result took after Redis took writes again. With Redis refusals held (no attempt spent) every rollout completes.
 *
 *   npx tsx scripts/drill-redis-full.ts [--n 200] [--full-s 60] [--agent-ms 50] [--concurrency 4]
 *
 * Needs `redis-server` on PATH; starts and stops its own on a free loopback port.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { RolloutRequest } from "@fleet/contracts";
import { startInProcessFleet } from "@fleet/pipeline";
import { LocalRedisServer } from "@fleet/queue";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { Redis } from "ioredis";
import { positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({
  options: {
    n: { type: "string", default: "200" },
    "full-s": { type: "string", default: "60" },
    "agent-ms": { type: "string", default: "50" },
    concurrency: { type: "string", default: "4" },
  },
});
const N = positiveInt(values.n, "--n");
const FULL_MS = positiveInt(values["full-s"], "--full-s") * 1000;
const AGENT_MS = positiveInt(values["agent-ms"], "--agent-ms");
const CONCURRENCY = positiveInt(values.concurrency, "--concurrency");

const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file");
if (!task) throw new Error(`no hello-file task in ${EXAMPLE_SUITE_DIR}`);
const dir = mkdtempSync(join(tmpdir(), "fleet-drill-"));
const server = await LocalRedisServer.start({ dir });
const admin = new Redis(server.url);
const metrics = createFleetMetrics(createMetricsRegistry({ app: "drill", defaultMetrics: false }));
let runs = 0;
const fleet = await startInProcessFleet({
  provider: new InMemorySandboxProvider(),
  redisUrl: server.url,
  concurrency: CONCURRENCY,
  deps: {
    metrics,
    createHarness: (agent) => ({
      name: agent.harness,
      run: async () => {
        runs++;
        await new Promise((r) => setTimeout(r, AGENT_MS));
        return { exec: execResult(), answer: null, transcript: null, usage: null };
      },
    }),
    verify: async () => ({ reward: 1, details: { kind: "test" } }),
  },
});
try {
  const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
  const ids = await fleet.submit(Array.from({ length: N }, () => request));
  while (runs < CONCURRENCY) await new Promise((r) => setTimeout(r, 20));
  const used = Number((await admin.info("memory")).match(/used_memory:(\d+)/)?.[1]);
  await admin.config("SET", "maxmemory", String(Math.max(1, used - 100_000)));
  console.log(
    `Redis full (maxmemory under its ${used} bytes) after ${runs} agent runs, for ${FULL_MS / 1000} s`,
  );
  const processed = async () =>
    Number((await admin.info("stats")).match(/total_commands_processed:(\d+)/)?.[1]);
  const before = await processed();
  await new Promise((r) => setTimeout(r, FULL_MS));
  const whileFull = (await processed()) - before;
  await admin.config("SET", "maxmemory", "0");
  const freedAt = Date.now();
  console.log(`Redis takes writes again; ${runs} agent runs so far`);
  const results = await fleet.waitForResults(ids, 10 * 60_000);
  const lastMs = Date.now() - freedAt;
  const outcomes = new Map<string, number>();
  for (const r of results) {
    const key = r.failureKind ? `${r.status} / ${r.failureKind}` : r.status;
    outcomes.set(key, (outcomes.get(key) ?? 0) + 1);
  }
  const jobs = (await metrics.stageJobs.get()).values;
  const count = (outcome: string) =>
    jobs.filter((v) => v.labels.outcome === outcome).reduce((sum, v) => sum + v.value, 0);
  console.log(`\n${N} rollouts, Redis full for ${FULL_MS / 1000} s`);
  for (const [key, n] of [...outcomes].sort()) console.log(`  ${key.padEnd(36)} ${n}`);
  console.log(`  stage jobs held (redis_held)          ${count("redis_held")}`);
  console.log(`  stage jobs retried (an attempt spent) ${count("retry")}`);
  console.log(`  last result, after Redis took writes  ${(lastMs / 1000).toFixed(1)} s`);
  console.log(`  commands Redis ran while full, a second ${(whileFull / (FULL_MS / 1000)).toFixed(0)}`);
  // Why attempts were spent: BullMQ keeps a job's last failure (`failedReason`) after it retried
  // and completed (finished jobs are trimmed past 10,000 a queue, more than this drill makes).
  const reasons = new Map<string, number>();
  for (const key of await admin.keys(`${fleet.prefix}:*`)) {
    const m = /:(seed|run|verify|close):[^:]+$/.exec(key);
    if (!m || (await admin.type(key)) !== "hash") continue;
    const reason = await admin.hget(key, "failedReason");
    if (!reason) continue;
    const k = `${m[1]}: ${reason.slice(0, 160)}`;
    reasons.set(k, (reasons.get(k) ?? 0) + 1);
  }
  if (reasons.size > 0) console.log("  stage jobs with a failure kept (their last), by stage and reason:");
  for (const [k, n] of [...reasons].sort((a, b) => b[1] - a[1]))
    console.log(`    ${String(n).padStart(4)}  ${k}`);
} finally {
  await admin.config("SET", "maxmemory", "0").catch(() => undefined);
  await fleet.close();
  admin.disconnect();
  await server.kill();
  rmSync(dir, { recursive: true, force: true });
}
