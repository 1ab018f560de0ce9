/**
 * What a resources worker costs while its seed-ahead bound stays full: one process with the seed
 * and close workers (concurrency 8, the bound's defaults, in-memory sandboxes), 100 rollouts and
 * no agent, so 16 are seeded and the rest wait at the bound for good. After a settling time it
 * samples, over `--seconds`, the Redis commands per second (`INFO stats`, server-wide: use a
 * Redis nothing else uses), Redis's CPU and this process's CPU (share of one core).
 *
 *   npx tsx scripts/measure-seed-ahead-held.ts [--seconds 10]
 *
 * Needs Redis at REDIS_URL (default redis://127.0.0.1:6379).
 */
import { parseArgs } from "node:util";
import { RolloutRequest } from "@fleet/contracts";
import { createStageWorkers, DEFAULT_SEED_AHEAD, startInProcessFleet } from "@fleet/pipeline";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { Redis } from "ioredis";
import { positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({ options: { seconds: { type: "string", default: "10" } } });
const SECONDS = positiveInt(values.seconds, "--seconds");
const url = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file");
if (!task) throw new Error(`no hello-file task in ${EXAMPLE_SUITE_DIR}`);

const fleet = await startInProcessFleet({
  provider: new InMemorySandboxProvider(),
  redisUrl: url,
  startWorkers: false,
});
const workers = createStageWorkers(["seed", "close"], fleet.deps, {
  connection: fleet.redis,
  prefix: fleet.prefix,
  concurrency: 8,
  seedAhead: DEFAULT_SEED_AHEAD,
});
const redis = new Redis(url);
try {
  await fleet.submit(
    Array.from({ length: 100 }, () => RolloutRequest.parse({ task, agent: { harness: "oracle" } })),
  );
  const sample = async () => {
    const cpu = await redis.info("cpu");
    const stats = await redis.info("stats");
    const field = (text: string, name: string) => Number(new RegExp(`${name}:([\\d.]+)`).exec(text)?.[1]);
    return {
      redisCpuS: field(cpu, "used_cpu_sys") + field(cpu, "used_cpu_user"),
      commands: field(stats, "total_commands_processed"),
      node: process.cpuUsage(),
      at: performance.now(),
    };
  };
  // Settled: the bound full, seeds waiting (and backed off, if they do).
  await new Promise((r) => setTimeout(r, 3_000));
  const a = await sample();
  await new Promise((r) => setTimeout(r, SECONDS * 1_000));
  const b = await sample();
  const s = (b.at - a.at) / 1_000;
  const node = process.cpuUsage(a.node);
  console.log(
    `seed-ahead held (bound full, no agent), over ${s.toFixed(1)} s; state ${JSON.stringify(workers.seedAhead)}`,
  );
  console.log(`redis commands/s    ${((b.commands - a.commands) / s).toFixed(0)}`);
  console.log(`redis cpu (core)    ${((b.redisCpuS - a.redisCpuS) / s).toFixed(4)}`);
  console.log(`node cpu (core)     ${((node.user + node.system) / 1e6 / s).toFixed(4)}`);
} finally {
  await workers.close(5_000);
  await fleet.close();
  redis.disconnect();
}
