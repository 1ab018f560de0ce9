import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { RolloutRequest, type SandboxSpecInput } from "@fleet/contracts";
import { LocalRedisServer, RolloutStore, STAGE_CATALOG, STAGES, stageJobId } from "@fleet/queue";
import { FailoverPair, LocalSentinel } from "@fleet/queue/testing";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createLogger } from "@fleet/telemetry";
import { Redis } from "ioredis";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { type Latch, latch } from "./testing/latch.ts";
import { NO_OP_AGENT_AND_VERIFIER, until } from "./testing/no-op-stages.ts";
import { createStageWorkers, MAX_REDIS_HOLDS, type StageWorkers } from "./worker.ts";

/** An in-memory provider whose creates wait for `createGate`; `entered` opens when one has begun. */
class GatedProvider extends InMemorySandboxProvider {
  readonly entered: Latch = latch();
  readonly createGate: Latch = latch();
  override async create(spec: SandboxSpecInput) {
    this.entered.open();
    await this.createGate.opened;
    return super.create(spec);
  }
}

const SEED_ATTEMPTS = STAGE_CATALOG.seed.options.attempts!;
const seedJobKey = (fleet: InProcessFleet, id: string) => `${fleet.prefix}:seed:${stageJobId(id, "seed")}`;

// A Redis of the test's own: it is made full (maxmemory under what it holds, noeviction), which
// the shared one must never be.
describe("a Redis that refuses writes (full under noeviction)", () => {
  let dir = "";
  let server: LocalRedisServer | null = null;
  let admin: Redis | null = null;
  let fleet: InProcessFleet | null = null;
  let workers: StageWorkers | null = null;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), "fleet-refusal-"));
  });
  afterEach(async () => {
    await admin?.config("SET", "maxmemory", "0").catch(() => undefined);
    await workers?.close(10_000);
    await fleet?.close();
    admin?.disconnect();
    await server?.kill();
    [server, admin, fleet, workers] = [null, null, null, null];
    rmSync(dir, { recursive: true, force: true });
  });

  /**
   * A Redis of the test's own (and `admin` on it), a fleet on it whose workers the test starts,
   * and `n` hello-file rollouts submitted; with `lastSeedAttempt`, their seeds' attempts but one
   * spent (a refusal BullMQ counted would end them).
   */
  async function submitted(
    n: number,
    provider: InMemorySandboxProvider,
    deps: Partial<PipelineDeps> = NO_OP_AGENT_AND_VERIFIER,
    lastSeedAttempt = false,
  ): Promise<{ fleet: InProcessFleet; ids: string[]; admin: Redis }> {
    server = await LocalRedisServer.start({ dir });
    const client = new Redis(server.url);
    admin = client;
    const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
    const started = await startInProcessFleet({ provider, redisUrl: server.url, startWorkers: false, deps });
    fleet = started;
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await started.submit(Array.from({ length: n }, () => request));
    if (lastSeedAttempt) {
      for (const id of ids)
        await started.redis.hset(seedJobKey(started, id), "atm", String(SEED_ATTEMPTS - 1));
    }
    return { fleet: started, ids, admin: client };
  }

  it("holds a stage it refused, on its last attempt, without spending the attempt; the rollout completes once Redis takes writes again", async () => {
    const provider = new GatedProvider();
    const lines: string[] = [];
    const logger = createLogger({
      name: "test",
      level: "warn",
      destination: { write: (l: string) => lines.push(l) },
    });
    const { fleet, ids, admin } = await submitted(1, provider, { ...NO_OP_AGENT_AND_VERIFIER, logger }, true);
    const id = ids[0]!;
    const seedJob = seedJobKey(fleet, id);
    workers = createStageWorkers(STAGES, fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: 1,
      supervise: false,
    });

    // The seed has begun (its intent stored) and is creating its sandbox: Redis fills up now,
    // so the seed's receipt is refused.
    await provider.entered.opened;
    await admin.config("SET", "maxmemory", "1");
    await expect(admin.set(`${fleet.prefix}:probe`, "x")).rejects.toThrow(/^OOM /);
    provider.createGate.open();

    // Put back, delayed, while Redis still refuses: not failed, not closed.
    const seedQueue = fleet.deps.queues.queues.seed;
    await until(
      "the refused seed held",
      async () => (await seedQueue.getJobState(stageJobId(id, "seed"))) === "delayed",
    );
    expect(Number(await fleet.redis.hget(seedJob, "atm"))).toBe(SEED_ATTEMPTS - 1);
    expect((await fleet.deps.store.get(id))!.status).toBe("accepted");
    expect(lines.join("\n")).toMatch(
      /the fleet's Redis refuses writes \(full, read-only\) or cannot be reached: holding stage jobs/,
    );

    await admin.config("SET", "maxmemory", "0");
    const [result] = await fleet.waitForResults([id], 60_000);
    expect(result).toMatchObject({ status: "completed", reward: 1 });
    // The seed ran again and stored its receipt on the same, last, attempt.
    expect(Number(await fleet.redis.hget(seedJob, "atm"))).toBe(SEED_ATTEMPTS);
    expect((await fleet.deps.store.get(id))!.failure).toBeNull();
  });

  it.each([
    ["holds it: not spent, the rollout completes", 0, 0],
    [
      `spends it once the job had ${MAX_REDIS_HOLDS} deliveries that spent none: the rollout ends masked`,
      MAX_REDIS_HOLDS,
      0,
    ],
    [
      `holds it after ${MAX_REDIS_HOLDS + 20} deliveries that spent none, 30 of them hand-backs (a seed that waited for the seed-ahead bound): the rollout completes`,
      MAX_REDIS_HOLDS + 20,
      30,
    ],
  ] as const)(
    "a last attempt whose begin hit a connection blip (back by the move): %s",
    async (_what, spentNone, handBacks) => {
      const { fleet, ids } = await submitted(1, new InMemorySandboxProvider(), undefined, true);
      const id = ids[0]!;
      const seedJob = seedJobKey(fleet, id);
      // Deliveries that spent no attempt (BullMQ counts every delivery in `ats`, attempts in `atm`),
      // and those of them that were hand-backs (counted in the job's progress).
      await fleet.redis.hset(seedJob, "ats", String(SEED_ATTEMPTS - 1 + spentNone));
      if (handBacks > 0) await fleet.redis.hset(seedJob, "progress", JSON.stringify({ handBacks }));
      const store = fleet.deps.store;
      let blips = 0;
      const blipping = Object.assign(Object.create(store) as typeof store, {
        begin: async (...a: Parameters<typeof store.begin>) => {
          if (a[0] === id && a[1] === "seed" && blips++ === 0) throw new Error("Connection is closed.");
          return store.begin(...a);
        },
      });
      workers = createStageWorkers(
        STAGES,
        { ...fleet.deps, store: blipping },
        { connection: fleet.redis, prefix: fleet.prefix, concurrency: 1, supervise: false },
      );
      const [result] = await fleet.waitForResults([id], 30_000);
      if (spentNone - handBacks <= MAX_REDIS_HOLDS - 1) {
        expect(result).toMatchObject({ status: "completed", reward: 1 });
        expect(blips).toBe(2);
        expect(await fleet.deps.store.failureLog(id)).toEqual([]);
      } else {
        expect(result).toMatchObject({
          status: "masked",
          failureKind: "provider_unavailable",
          stage: "seed",
        });
        expect(result!.reason).toMatch(
          /^the seed job's last attempt was refused by the fleet's Redis and not held for it \(held 30 times already, /,
        );
        expect(blips).toBe(1);
      }
      expect(Number(await fleet.redis.hget(seedJob, "atm"))).toBe(SEED_ATTEMPTS);
    },
  );

  it("pauses a worker Redis refuses to give a job, longer each time, instead of asking again at once; the supervisor replaces none for it", async () => {
    const { fleet, ids, admin } = await submitted(5, new InMemorySandboxProvider());
    // Full before any worker starts: the seed worker's every fetch is refused.
    await admin.config("SET", "maxmemory", "1");
    const pauses: number[] = [];
    workers = createStageWorkers(STAGES, fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: 2,
      // A worker idle while jobs wait would be replaced after half a second.
      supervise: { intervalMs: 50, stuckAfterMs: 500 },
      onWorker: (worker, stage) => {
        if (stage === "seed") worker.on("paused", () => pauses.push(Date.now()));
      },
    });
    await until("the seed worker paused five times", () => pauses.length >= 5, 20_000);
    // 250 ms, 500, 1 s, 2 s: asked again after each pause, not thousands of times a second.
    const gaps = pauses.slice(1).map((at, i) => at - pauses[i]!);
    expect(gaps.at(-1)).toBeGreaterThanOrEqual(1_500);
    expect(workers.recreated).toBe(0);
    expect((await fleet.deps.store.get(ids[0]!))!.status).toBe("accepted");

    // Redis takes writes again: the rollouts go through.
    await admin.config("SET", "maxmemory", "0");
    const results = await fleet.waitForResults(ids, 30_000);
    expect(results.map((r) => r.status)).toEqual(Array(5).fill("completed"));
  });
});

// Two Redis servers of the test's own, B a replica of A, and the fleet's URL a name (a TCP
// forwarder) that a failover moves from A to B, as a managed Redis's endpoint or a DNS name does.
describe("a failover of the fleet's Redis behind its URL's name", () => {
  let pair: FailoverPair | null = null;
  let fleet: InProcessFleet | null = null;
  let sentinel: LocalSentinel | null = null;
  let dir = "";
  afterEach(async () => {
    await fleet?.close();
    await sentinel?.stop();
    await pair?.stop();
    [fleet, pair, sentinel] = [null, null, null];
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it("a Redis Sentinel's failover (REDIS_URL=redis-sentinel://…/name): rollouts in flight complete on the master it promoted", async () => {
    pair = await FailoverPair.start();
    dir = mkdtempSync(join(tmpdir(), "fleet-sentinel-"));
    const watching = await LocalSentinel.start(dir, pair.a.port);
    sentinel = watching;
    const provider = new GatedProvider();
    fleet = await startInProcessFleet({ provider, redisUrl: watching.url, deps: NO_OP_AGENT_AND_VERIFIER });
    const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await fleet.submit(Array.from({ length: 4 }, () => request));
    await provider.entered.opened;
    // B has every write A took so far (admission, the seeds' begins): a sentinel promotes a replica
    // without waiting for it, and what it lacks is lost to any client (asynchronous replication,
    // not the fleet's doing: under a loaded CI host the admission's records were lost so). The
    // writes from here on meet the failover as a client's would. WAIT waits for this client's own
    // last write only (none: it answered at once, and CI lost the admission's records so), and
    // replication is in order: a write of its own first covers every earlier one.
    await pair.adminA.set(`${fleet.prefix}:replicated`, "1");
    expect(await pair.adminA.call("WAIT", "1", "10000")).toBe(1);
    expect(await watching.failOver()).toBe(pair.b.port);
    // Until the sentinel demotes A (its next check, within 10 s), A still takes the writes of a
    // connection not yet moved, and loses them when it resyncs from B (Redis's replication is
    // asynchronous; `min-replicas-to-write` narrows that window): the seeds go on once it has.
    const adminA = pair.adminA;
    await until("A demoted", async () => /^role:slave/m.test(await adminA.info("replication")), 30_000);
    provider.createGate.open();

    const results = await fleet.waitForResults(ids, 60_000).catch(async (err: unknown) => {
      // What the sentinel did and where each server stands, for a failure on a loaded CI host.
      const log = readFileSync(join(dir, `sentinel-${watching.port}.log`), "utf8")
        .split("\n")
        .slice(-40);
      const roles = await Promise.all(
        [pair!.adminA, pair!.adminB].map((r) =>
          r.info("replication").then(
            (i) => i.split("\r\n").slice(0, 6).join(" "),
            (e: unknown) => String(e),
          ),
        ),
      );
      throw new Error(
        `${(err as Error).message}\nA: ${roles[0]}\nB: ${roles[1]}\nsentinel log:\n${log.join("\n")}`,
      );
    });
    expect(results.map((r) => [r.status, r.reward])).toEqual(ids.map(() => ["completed", 1]));
    const onB = new RolloutStore(pair.adminB, fleet.prefix);
    for (const id of ids) expect((await onB.get(id))?.status).toBe("completed");
    expect(await provider.list()).toEqual([]);
  });

  it("rollouts in flight when the master is demoted complete on the new one: the workers' connections, left on the old master and refused (READONLY), reconnect through the name", async () => {
    pair = await FailoverPair.start();
    const { adminA, adminB } = pair;

    const provider = new GatedProvider();
    fleet = await startInProcessFleet({ provider, redisUrl: pair.url, deps: NO_OP_AGENT_AND_VERIFIER });
    const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await fleet.submit(Array.from({ length: 4 }, () => request));
    // Seeds have begun on A (their intents stored) and are creating sandboxes: A is demoted now,
    // so their receipts, and every write after, meet a read-only replica.
    await provider.entered.opened;
    await pair.failOver();
    expect(await adminA.set(`${fleet.prefix}:probe`, "x").catch((e: Error) => e.message)).toMatch(
      /^READONLY /,
    );
    provider.createGate.open();

    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => [r.status, r.reward])).toEqual(ids.map(() => ["completed", 1]));
    // On the new master, each ended once: its record says so, and nothing of it is left in flight.
    const onB = new RolloutStore(adminB, fleet.prefix);
    for (const id of ids) {
      const record = await onB.get(id);
      expect(record?.status).toBe("completed");
      expect(record?.failure).toBeNull();
    }
    expect(await provider.list()).toEqual([]);
  });
});
