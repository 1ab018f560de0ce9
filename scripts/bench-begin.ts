/**
 * Redis cost of the stages' `begin` (`fleetBegin`, batched as `fleetBeginMany` by `ScriptBatcher`)
 * per rollout, beside a floor measured in the same run: the same batched calls (same keys and
 * arguments, same item count per call) of a script whose per-item body does nothing.
 *
 * Per round: M fresh rollouts are admitted (no workers run), then `store.begin` is called for all
 * of them at once, stage by stage (seed with its intent and seed fence, run with its launch
 * claim, verify with its fence, close with its tombstone), as the stage workers call it. Redis's
 * time in scripts comes from `INFO commandstats` (EVALSHA's usec), Node's from `process.cpuUsage`.
 *
 *   npx tsx scripts/bench-begin.ts [--m 1000] [--rounds 3]
 *
 * Needs Redis at REDIS_URL (default redis://127.0.0.1:6379).
 */
import { randomBytes, randomUUID } from "node:crypto";
import { parseArgs } from "node:util";
import { RolloutRequest, type StageName } from "@fleet/contracts";
import {
  admit,
  type BeginOptions,
  createRedis,
  digestTask,
  MAX_BATCH,
  RolloutStore,
  StageQueues,
} from "@fleet/queue";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
// The batched wrapper itself, for the floor (not part of the package's API).
import { BATCHED, batchedLua } from "../packages/queue/src/scripts.ts";
import { deleteKeys } from "./lib/bench-redis.ts";
import { median, positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({
  options: { m: { type: "string", default: "1000" }, rounds: { type: "string", default: "3" } },
});
const M = positiveInt(values.m, "--m");
const ROUNDS = positiveInt(values.rounds, "--rounds");
const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";

const redis = createRedis(REDIS_URL);
const probe = createRedis(REDIS_URL);
const prefix = `{bench-begin-${randomBytes(4).toString("hex")}}`;
const store = new RolloutStore(redis, prefix);
const queues = new StageQueues(redis, prefix);

/**
 * Script calls and µs so far (server-wide): EVALSHA's and EVAL's (a script's first call on a
 * connection goes as EVAL when Redis does not have it yet).
 */
async function scriptStats(): Promise<{ calls: number; us: number }> {
  let calls = 0;
  let us = 0;
  for (const m of (await probe.info("commandstats")).matchAll(
    /^cmdstat_eval(?:sha)?:calls=(\d+),usec=(\d+)/gm,
  )) {
    calls += Number(m[1]);
    us += Number(m[2]);
  }
  return { calls, us };
}

/** Redis µs (scripts), calls and Node µs per item of `n` concurrent calls of `f`. */
async function measure(n: number, f: (i: number) => Promise<unknown>) {
  const a = await scriptStats();
  const cpu = process.cpuUsage();
  await Promise.all(Array.from({ length: n }, (_, i) => f(i)));
  const used = process.cpuUsage(cpu);
  const b = await scriptStats();
  return { redisUs: (b.us - a.us) / n, calls: b.calls - a.calls, nodeUs: (used.user + used.system) / n };
}

const OPTIONS: Record<StageName, () => BeginOptions> = {
  seed: () => ({
    intent: { owner: "resources", provider: "docker", expirySlackMs: 60_000 },
    seedToken: `bench:${randomUUID()}`,
  }),
  run: () => ({ launchToken: `bench:${randomUUID()}` }),
  verify: () => ({ verifyToken: `bench:${randomUUID()}` }),
  close: () => ({}),
};

/** fleetBeginMany's batched form (4 keys, 11 arguments an item) around a body that does nothing. */
const FLOOR_LUA = batchedLua({ prelude: "", body: " return 1", keys: 4 }, BATCHED.fleetBegin.args);

try {
  const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file");
  if (!task) throw new Error(`no hello-file task in ${EXAMPLE_SUITE_DIR}`);
  const digest = digestTask(task);
  await store.putTask(task, digest);
  const request = RolloutRequest.parse({ task: { digest }, agent: { harness: "oracle" } });
  const floorSha = (await probe.script("LOAD", FLOOR_LUA)) as string;
  const rows: Record<string, { redisUs: number[]; nodeUs: number[]; perCall: number[] }> = {};
  const note = (name: string, r: { redisUs: number; nodeUs: number; calls: number }) => {
    rows[name] ??= { redisUs: [], nodeUs: [], perCall: [] };
    rows[name].redisUs.push(r.redisUs);
    rows[name].nodeUs.push(r.nodeUs);
    rows[name].perCall.push(M / Math.max(1, r.calls));
  };
  for (let round = 0; round < ROUNDS; round++) {
    const { ids } = await admit(
      store,
      queues,
      { requests: Array.from({ length: M }, () => request), batch: true, idempotencyKey: null },
      { maxTaskBytes: 10 * 1024 * 1024 },
    );
    for (const stage of ["seed", "run", "verify", "close"] as const) {
      note(stage, await measure(M, (i) => store.begin(ids[i]!, stage, Date.now(), OPTIONS[stage]())));
    }
    // The floor: as many items, as many per call as the begins went in (ScriptBatcher's MAX_BATCH at most).
    const keys = ids.flatMap((id) => [
      store.keys.rollout(id),
      store.keys.failures(id),
      store.keys.sandboxes(),
      store.keys.rollout(id),
    ]);
    const na = BATCHED.fleetBegin.args;
    const args = ids.flatMap(() => ["run", String(Date.now()), "0", "0", "", "", "0", "t", "", "", ""]);
    const calls = Math.ceil(M / MAX_BATCH);
    note(
      "floor",
      await measure(calls, async (c) => {
        const from = c * MAX_BATCH;
        const to = Math.min(M, from + MAX_BATCH);
        await probe.evalsha(
          floorSha,
          (to - from) * 4,
          ...keys.slice(from * 4, to * 4),
          ...args.slice(from * na, to * na),
        );
      }).then((r) => ({ ...r, redisUs: (r.redisUs * calls) / M, nodeUs: 0 })),
    );
  }
  const floor = median(rows.floor!.redisUs);
  console.log(
    `begin per rollout: ${M} rollouts a round, ${ROUNDS} round(s), medians; floor = a batched no-op item of the same shape (${floor.toFixed(1)} us)`,
  );
  console.log("stage    redis us/item  x floor  node us/item  items/call");
  for (const stage of ["seed", "run", "verify", "close"]) {
    const r = rows[stage]!;
    const us = median(r.redisUs);
    console.log(
      `${stage.padEnd(8)} ${us.toFixed(1).padStart(13)} ${(us / floor).toFixed(1).padStart(8)} ${median(r.nodeUs).toFixed(1).padStart(13)} ${median(r.perCall).toFixed(0).padStart(11)}`,
    );
  }
} finally {
  await deleteKeys(probe, `${prefix}*`);
  redis.disconnect();
  probe.disconnect();
}
