/**
 * The seed-ahead bound, measured: N rollouts through the four stages in one process (in-memory
 * sandboxes, so only the pacing is measured), agents that each take `--agent-ms`, with the bound
 * off and on (`FLEET_SEED_AHEAD`'s default, or `--min`), after a warm-up run of each, in
 * `--rounds` pairs whose order alternates (the first run of a process is its slowest: run first
 * and alone, "off" looked slower than it is). Prints, for each, the median rollouts/s and the most
 * sandboxes alive at once (sampled whenever one is created), and the ratios on/off (the rate's:
 * the median of the rounds' own).
 *
 *   npx tsx scripts/bench-seed-ahead.ts [--n 1000] [--concurrency 8] [--agent-ms 50] [--min 16] [--rounds 3]
 *
 * Needs Redis at REDIS_URL (default redis://127.0.0.1:6379).
 */
import { parseArgs } from "node:util";
import { RolloutRequest, type SandboxSpecInput } from "@fleet/contracts";
import { DEFAULT_SEED_AHEAD, type SeedAheadOptions, startInProcessFleet } from "@fleet/pipeline";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { median, positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({
  options: {
    n: { type: "string", default: "1000" },
    concurrency: { type: "string", default: "8" },
    "agent-ms": { type: "string", default: "50" },
    min: { type: "string", default: String(DEFAULT_SEED_AHEAD.min) },
    rounds: { type: "string", default: "3" },
  },
});
const ROUNDS = positiveInt(values.rounds, "--rounds");
const N = positiveInt(values.n, "--n");
const CONCURRENCY = positiveInt(values.concurrency, "--concurrency");
const AGENT_MS = positiveInt(values["agent-ms"], "--agent-ms");
const MIN = positiveInt(values.min, "--min");

const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file");
if (!task) throw new Error(`no hello-file task in ${EXAMPLE_SUITE_DIR}`);
const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });

async function measure(seedAhead: SeedAheadOptions | false) {
  const provider = new InMemorySandboxProvider();
  let peak = 0;
  const create = provider.create.bind(provider);
  provider.create = async (spec: SandboxSpecInput) => {
    const handle = await create(spec);
    let live = 0;
    for (const box of provider.sandboxes.values()) if (box.alive) live++;
    peak = Math.max(peak, live);
    return handle;
  };
  const fleet = await startInProcessFleet({
    provider,
    concurrency: CONCURRENCY,
    workerOptions: { seedAhead },
    deps: {
      createHarness: (agent) => ({
        name: agent.harness,
        run: async () => {
          await new Promise((r) => setTimeout(r, AGENT_MS));
          return { exec: execResult(), answer: null, transcript: null, usage: null };
        },
      }),
      verify: async () => ({ reward: 1, details: { kind: "bench" } }),
    },
  });
  try {
    const t0 = performance.now();
    const ids = await fleet.submit(Array.from({ length: N }, () => request));
    const results = await fleet.waitForResults(ids, 600_000);
    const rate = (N * 1000) / (performance.now() - t0);
    const completed = results.filter((r) => r.status === "completed").length;
    if (completed !== N) throw new Error(`${N - completed} of ${N} rollouts did not complete`);
    return { rate, peak };
  } finally {
    await fleet.close();
  }
}

const bounded = { ...DEFAULT_SEED_AHEAD, min: MIN };
// Warm-up (JIT, connections, scripts loaded), not counted: one run of each.
await measure(false);
await measure(bounded);
const offs: { rate: number; peak: number }[] = [];
const ons: { rate: number; peak: number }[] = [];
for (let i = 0; i < ROUNDS; i++) {
  // Alternate who goes first, so neither side always runs on a warmer process.
  for (const side of i % 2 === 0 ? (["off", "on"] as const) : (["on", "off"] as const)) {
    if (side === "off") offs.push(await measure(false));
    else ons.push(await measure(bounded));
  }
}
const off = { rate: median(offs.map((r) => r.rate)), peak: Math.max(...offs.map((r) => r.peak)) };
const on = { rate: median(ons.map((r) => r.rate)), peak: Math.max(...ons.map((r) => r.peak)) };
const rateRatio = median(ons.map((r, i) => r.rate / offs[i]!.rate));
const f1 = (x: number) => x.toFixed(1);
console.log(
  `seed-ahead: ${N} rollouts, concurrency ${CONCURRENCY} per stage, agents of ${AGENT_MS} ms, in-memory sandboxes; ${ROUNDS} round(s) alternating, after a warm-up run of each\n`,
);
console.log(`${"bound".padEnd(14)} ${"rollouts/s".padStart(10)} ${"most sandboxes alive".padStart(22)}`);
console.log(`${"off".padEnd(14)} ${f1(off.rate).padStart(10)} ${String(off.peak).padStart(22)}`);
console.log(`${`min ${MIN}`.padEnd(14)} ${f1(on.rate).padStart(10)} ${String(on.peak).padStart(22)}`);
console.log(
  `${"on/off".padEnd(14)} ${rateRatio.toFixed(2).padStart(10)} ${(on.peak / off.peak).toFixed(2).padStart(22)}`,
);
process.exit(0);
