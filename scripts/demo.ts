/**
 * `npm run demo`: the fleet's main job on its embedded defaults.
 *
 * 1. Bring up what is missing: Debian packages, the Docker daemon and the offline sandbox image
 *    (scripts/ensure-services.sh), and a private Redis with AOF when REDIS_URL is unset.
 * 2. Run the dispatcher, the resources / agent / verifier workers and the janitor as separate
 *    processes.
 * 3. Submit the bundled example suite with the `oracle` agent and with a deliberately wrong agent
 *    through the `fleet` CLI, wait, and write results JSONL.
 * 4. Print a summary (counts by status, mean reward, p50/p95 of each stage) and the results path;
 *    shut everything down. Exit 0 only if the oracle scored 1.0 and the wrong agent 0 everywhere.
 */
import { execFileSync } from "node:child_process";
import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { LocalRedisServer } from "@fleet/queue";
import { FleetProcesses, REPO_ROOT } from "./lib/fleet-processes.ts";

interface ResultLine {
  status: string;
  reward: number | null;
  taskId: string;
  failureKind: string | null;
  timings: Record<string, number | null>;
}

const stamp = new Date().toISOString().replace(/[:.]/g, "-");
const runDir = join(REPO_ROOT, ".fleet", "demo", stamp);
mkdirSync(runDir, { recursive: true });
const say = (msg: string) => console.log(`[demo] ${msg}`);

function ensureServices(): Record<string, string> {
  say("checking Docker, the sandbox image and the Debian packages (installing what is missing)…");
  // REDIS_URL is set to a placeholder so the script does not start its shared Redis: we start a private one.
  const out = execFileSync("bash", [join(REPO_ROOT, "scripts/ensure-services.sh")], {
    env: { ...process.env, REDIS_URL: process.env.REDIS_URL ?? "private" },
    stdio: ["ignore", "pipe", "inherit"],
    encoding: "utf8",
  });
  const exported: Record<string, string> = {};
  for (const m of out.matchAll(/^export (\w+)=(.*)$/gm)) exported[m[1]!] = m[2]!;
  return exported;
}

/**
 * The demo's Redis, in its own process group: a Ctrl-C must not take Redis away before the fleet
 * has shut down (workers hand their jobs back through it); this process stops it last, or at exit.
 */
async function startPrivateRedis(): Promise<LocalRedisServer> {
  const dir = join(runDir, "redis");
  mkdirSync(dir, { recursive: true });
  const server = await LocalRedisServer.start({ dir, detached: true });
  process.on("exit", () => server.process?.kill("SIGTERM"));
  return server;
}

/**
 * The `fleet` CLI, run to its end while this process goes on draining the fleet's log pipes (see
 * `runAttached`: with `execFileSync` the dispatcher stopped once a `--wait` had polled it for about
 * five minutes). Throws when it fails (as when Ctrl-C ended it).
 */
async function runCli(fleet: FleetProcesses, args: string[], env: Record<string, string>): Promise<void> {
  const cli = join(REPO_ROOT, "apps/cli/bin/fleet.js");
  // Stopped, naming it, if a process of the fleet dies meanwhile (not at a Ctrl-C): the CLI would
  // wait for rollouts no one takes.
  const code = await fleet.runWhileUp(
    process.execPath,
    [cli, ...args],
    { ...process.env, ...env },
    () => interrupted,
  );
  if (code !== 0) throw new Error(`fleet ${args[0]} exited with ${code}`);
}

function percentile(values: number[], p: number): number | null {
  if (values.length === 0) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

function summarise(label: string, file: string): ResultLine[] {
  const rows = readFileSync(file, "utf8")
    .split("\n")
    .filter((l) => l.trim() !== "")
    .map((l) => JSON.parse(l) as ResultLine);
  const counts: Record<string, number> = {};
  for (const r of rows) counts[r.status] = (counts[r.status] ?? 0) + 1;
  const graded = rows.filter((r) => r.reward !== null).map((r) => r.reward!);
  const mean = graded.length ? graded.reduce((a, b) => a + b, 0) / graded.length : null;
  console.log(`\n== ${label}: ${rows.length} rollouts`);
  console.log(
    `   status      ${Object.entries(counts)
      .map(([k, v]) => `${k}=${v}`)
      .join(" ")}`,
  );
  console.log(`   mean reward ${mean === null ? "n/a" : mean.toFixed(3)} over ${graded.length} graded`);
  for (const stage of ["queuedMs", "seedMs", "runMs", "verifyMs", "closeMs", "totalMs"]) {
    const vs = rows.map((r) => r.timings[stage]).filter((v): v is number => typeof v === "number");
    console.log(
      `   ${stage.padEnd(10)}  p50 ${String(percentile(vs, 50)).padStart(6)} ms   p95 ${String(percentile(vs, 95)).padStart(6)} ms`,
    );
  }
  return rows;
}

/**
 * What the demo's fleet may have left in Docker (its sandboxes carry `fleet.scope=<prefix>`):
 * after an interrupted run, workers shutting down keep their sandboxes for another replica, and
 * the private Redis with its teardown ledger goes with the demo, so no janitor ever would.
 */
function removeDemoSandboxes(prefix: string): void {
  const label = `label=fleet.scope=${prefix}`;
  const ids = (kind: string) =>
    execFileSync("docker", [kind, "ls", "-q", ...(kind === "container" ? ["-a"] : []), "--filter", label], {
      encoding: "utf8",
    })
      .split("\n")
      .filter((id) => id !== "");
  let removed = 0;
  try {
    // In rounds: a create the daemon was still finishing when its worker stopped shows up late,
    // and a volume goes only once its container has.
    for (let round = 0; round < 10; round++) {
      const containers = ids("container");
      for (const id of containers) {
        try {
          execFileSync("docker", ["rm", "-f", "-v", id], { stdio: "ignore" });
          removed++;
        } catch {
          // its removal already in progress (a worker's destroy), or the daemon busy: the next round
        }
      }
      const rest = ["volume", "network"].flatMap((kind) => ids(kind).map((id) => [kind, id] as const));
      for (const [kind, id] of rest) {
        try {
          execFileSync("docker", [kind, "rm", id], { stdio: "ignore" });
        } catch {
          // still in use: the next round
        }
      }
      if (containers.length === 0 && rest.length === 0) break;
      execFileSync("sleep", ["1"]);
    }
    if (removed > 0) say(`removed ${removed} sandbox(es) the interrupted fleet left`);
    const left = ids("container").length + ids("volume").length + ids("network").length;
    if (left > 0) say(`could not remove everything: docker ps -a / volume ls / network ls --filter ${label}`);
  } catch (err) {
    say(`could not remove the demo's sandboxes (${label}): ${String(err)}`);
  }
}

/** Set by Ctrl-C (SIGINT), SIGTERM or a closed terminal (SIGHUP); see `main`. */
let interrupted = false;

async function main(): Promise<number> {
  // Ctrl-C reaches the CLI and the fleet's processes too (one process group): the CLI ends, and
  // this process goes on to shut the fleet down and clean up instead of dying with it. So does a
  // closed terminal (SIGHUP): dying of it would leave the private Redis (its own process group)
  // and the sandboxes behind. Writes to a terminal that is gone fail; the clean-up goes on.
  for (const signal of ["SIGINT", "SIGTERM", "SIGHUP"] as const) {
    process.on(signal, () => {
      interrupted = true;
    });
  }
  for (const stream of [process.stdout, process.stderr]) stream.on("error", () => undefined);
  const exported = ensureServices();
  let redis: LocalRedisServer | null = null;
  let redisUrl = process.env.REDIS_URL;
  if (!redisUrl) {
    redis = await startPrivateRedis();
    redisUrl = redis.url;
    say(`private Redis (AOF, noeviction) at ${redisUrl}`);
  }
  const prefix = `{demo-${stamp.slice(-12, -1)}}`;
  let fleet: FleetProcesses | null = null;
  try {
    say("starting the dispatcher, resources/agent/verifier workers and the janitor…");
    fleet = await FleetProcesses.start({
      redisUrl,
      prefix,
      logDir: join(runDir, "logs"),
      env: { FLEET_CONCURRENCY: "4" },
    });
    say(`dispatcher at ${fleet.url}; logs in ${join(runDir, "logs")}`);
    const env = { FLEET_URL: fleet.url, FLEET_TOKEN: fleet.token };
    const suite = join(REPO_ROOT, "packages/tasks/suites/example");
    const image = exported.FLEET_BASE_IMAGE;
    // The example suite names `rollout-fleet/base:latest`, which ensure-services has just tagged
    // to the image it built or found (its recipe's tag).
    if (image) say(`sandbox image rollout-fleet/base:latest (${image}), the example suite's`);

    const oracleOut = join(runDir, "results-oracle.jsonl");
    say("submitting the example suite with the oracle agent…");
    await runCli(fleet, ["submit", "--suite", suite, "--agent", "oracle", "--wait", "--out", oracleOut], env);
    // A Ctrl-C just as that CLI finished must not start the next against a fleet shutting down.
    if (interrupted) throw new Error("interrupted");
    const wrongOut = join(runDir, "results-wrong.jsonl");
    say("submitting the example suite with a deliberately wrong agent (does nothing)…");
    await runCli(
      fleet,
      [
        "submit",
        "--suite",
        suite,
        "--agent",
        JSON.stringify({ harness: "command", name: "do-nothing", argv: ["true"] }),
        "--wait",
        "--out",
        wrongOut,
      ],
      env,
    );

    if (interrupted) throw new Error("interrupted");
    const oracle = summarise("oracle agent", oracleOut);
    const wrong = summarise("wrong agent", wrongOut);
    console.log(`\nresults: ${oracleOut}\n         ${wrongOut}`);
    const oracleOk = oracle.every((r) => r.status === "completed" && r.reward === 1);
    const wrongOk = wrong.every((r) => r.status === "completed" && r.reward === 0);
    if (!oracleOk) say("UNEXPECTED: not every oracle rollout scored 1.0");
    if (!wrongOk) say("UNEXPECTED: not every wrong-agent rollout scored 0");
    return oracleOk && wrongOk ? 0 : 1;
  } finally {
    say("shutting down…");
    // Longer than a worker's own bounded shutdown (30 s), so none is cut off handing back.
    await fleet?.stop(35_000);
    removeDemoSandboxes(prefix);
    await redis?.kill("SIGTERM");
  }
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    // Interrupted: the CLI's own exit (130) is no failure of the demo's; 130 as a shell says it.
    if (interrupted) {
      console.error("[demo] interrupted: the fleet was shut down");
      process.exit(130);
    }
    console.error(`[demo] failed: ${err instanceof Error ? err.message : String(err)}`);
    process.exit(1);
  },
);
