import { randomUUID } from "node:crypto";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  canonicalJson,
  MAX_RECORD_BYTES,
  RolloutRequest,
  type RolloutResult,
  sha256Hex,
  TaskContent,
} from "@fleet/contracts";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import {
  admit,
  batchIdFor,
  digestTask,
  MAX_METADATA_BYTES,
  prepareRollouts,
  rolloutIds,
} from "./admission.ts";
import { cancelBatch, cancelRollout } from "./cancel.ts";
import { assertRedisDurable, createRedis, isRedisUnavailable } from "./connection.ts";
import { claimSandboxHost, createKeys, fleetInstance, keepFleetInstance, keepSandboxHost } from "./keys.ts";
import { LocalRedisServer } from "./local-redis.ts";
import { ADMIT_CHUNK_BYTES, admissionOf, BATCH_ADMISSION_LEASE_MS, RolloutStore } from "./rollout-store.ts";
import { withScripts } from "./scripts.ts";
import { StageQueues } from "./stage-queues.ts";
import { INVALID_PUT_OFF_MS, sandboxKey, TeardownLedger, teardownBackoffMs } from "./teardown-ledger.ts";
import { FailoverPair } from "./testing/index.ts";
import { sandboxEntry } from "./testing/sandbox-entry.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
/** A masked run failure, as a stage logs one. */
const SANDBOX_LOST = {
  stage: "run",
  terminal: false,
  failureKind: "sandbox_lost",
  mask: true,
  reason: "x",
  at: 1,
} as const;
const task: TaskContent = {
  id: "t1",
  instruction: "do it",
  image: "img",
  workspace: {},
  solution: { "solve.sh": "true" },
  tests: { "test.sh": "exit 0" },
  timeouts: { agentS: 10, verifierS: 10 },
  verifier: { kind: "tests" },
  metadata: {},
};

describe("Redis durability check", () => {
  let server: LocalRedisServer;
  let url: string;
  beforeAll(async () => {
    // A Redis without AOF and with an evicting policy: the fleet must refuse it.
    server = await LocalRedisServer.start({
      dir: mkdtempSync(join(tmpdir(), "redis-")),
      args: ["--appendonly", "no", "--maxmemory-policy", "allkeys-lru"],
    });
    url = server.url;
  });
  // SIGKILL: a SIGTERM that lands during the AOF rewrite this test triggers can leave it running.
  afterAll(async () => server?.kill("SIGKILL"));

  it("refuses a Redis without AOF and noeviction, saying what to change", async () => {
    const r = createRedis(url);
    try {
      await expect(assertRedisDurable(r)).rejects.toThrow(
        /appendonly.*noeviction|CONFIG SET appendonly yes/s,
      );
      await r.config("SET", "appendonly", "yes");
      await expect(assertRedisDurable(r)).rejects.toThrow(/maxmemory-policy is "allkeys-lru"/);
      await r.config("SET", "maxmemory-policy", "noeviction");
      // AOF fsynced once a second (Redis's default): a crash of its host loses the last second or
      // two of acknowledged writes (a 202'd rollout comes back 404, a finished one is decided
      // again): refused unless the operator accepts that.
      await r.config("SET", "appendfsync", "everysec");
      await expect(assertRedisDurable(r)).rejects.toThrow(
        /appendfsync is "everysec".*CONFIG SET appendfsync always.*FLEET_REDIS_ACCEPT_WRITE_LOSS/s,
      );
      await expect(assertRedisDurable(r, { acceptWriteLoss: true })).resolves.toBeUndefined();
      await r.config("SET", "appendfsync", "always");
      await expect(assertRedisDurable(r)).resolves.toBeUndefined();
    } finally {
      r.disconnect();
    }
  });

  it("refuses a database the Redis does not have (REDIS_URL .../99), whose SELECT failed and left every write in database 0", async () => {
    const at = (db: number) => {
      const u = new URL(REDIS_URL);
      u.pathname = `/${db}`;
      return u.href;
    };
    const missing = createRedis(at(99));
    missing.on("error", () => undefined);
    const present = createRedis(at(1));
    try {
      await expect(assertRedisDurable(missing)).rejects.toThrow(/REDIS_URL names database 99.*out of range/);
      await expect(assertRedisDurable(present)).resolves.toBeUndefined();
    } finally {
      missing.disconnect();
      present.disconnect();
    }
  });

  it("a Redis whose CONFIG is disabled (managed Redis) is judged by INFO: AOF on and noeviction pass, its appendfsync unknown and not refused on a guess", async () => {
    const managed = await LocalRedisServer.start({
      dir: mkdtempSync(join(tmpdir(), "redis-")),
      // Its appendfsync left at Redis's default (everysec), which the check cannot read here.
      args: ["--appendfsync", "everysec", "--rename-command", "CONFIG", ""],
    });
    const r = createRedis(managed.url);
    try {
      await expect(r.config("GET", "appendfsync")).rejects.toThrow(/unknown command/i);
      await expect(assertRedisDurable(r)).resolves.toBeUndefined();
    } finally {
      r.disconnect();
      await managed.kill();
    }
  });

  it("judged by INFO (CONFIG disabled), a Redis without AOF and with an evicting policy is refused as well", async () => {
    const managed = await LocalRedisServer.start({
      dir: mkdtempSync(join(tmpdir(), "redis-")),
      args: ["--appendonly", "no", "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""],
    });
    const r = createRedis(managed.url);
    try {
      await expect(assertRedisDurable(r)).rejects.toThrow(
        /appendonly is "no".*maxmemory-policy is "allkeys-lru"/s,
      );
    } finally {
      r.disconnect();
      await managed.kill();
    }
  });
});

describe("rollout store", () => {
  const prefix = `{t-store-${Math.random().toString(36).slice(2, 8)}}`;
  let redis: Redis;
  let store: RolloutStore;
  let queues: StageQueues;
  /**
   * `call` with each call of `script` run twice, as ioredis re-sends one whose reply a reconnect
   * lost (`between` run in between): the second reply is the one heard.
   */
  const sentTwice = async <T>(
    script: "fleetSetField" | "fleetAdmit",
    call: () => Promise<T>,
    between: () => Promise<unknown> = async () => undefined,
  ): Promise<T> => {
    const scripted = withScripts(redis);
    const real = scripted[script].bind(scripted);
    const spy = vi.spyOn(scripted, script).mockImplementation(async (...args) => {
      await real(...args);
      await between();
      return real(...args);
    });
    try {
      return await call();
    } finally {
      spy.mockRestore();
    }
  };
  beforeAll(() => {
    redis = createRedis(REDIS_URL);
    store = new RolloutStore(redis, prefix);
    queues = new StageQueues(redis, prefix);
  });
  afterAll(async () => {
    await queues.obliterate();
    await queues.close();
    const keys = await redis.keys(`${prefix}*`);
    if (keys.length) await redis.del(...keys);
    redis.disconnect();
  });

  const admitOne = async (key?: string) =>
    admit(
      store,
      queues,
      {
        requests: [{ task, agent: { harness: "oracle", sandbox: "borrow" } }],
        batch: false,
        idempotencyKey: key,
      },
      { maxTaskBytes: 1e6 },
    );

  /** A Docker sandbox handle of the rollout, its id and name marked with `tag`. */
  const dockerHandle = (id: string, owner: "resources" | "agent", tag: string) => ({
    provider: "docker" as const,
    endpoint: "unix:///var/run/docker.sock",
    id: `c${tag}-${id}`,
    name: `n${tag}-${id}`,
    rolloutId: id,
    owner,
    volumes: [],
  });

  const resultFor = (id: string, status: RolloutResult["status"]): RolloutResult => ({
    id,
    batchId: null,
    taskId: "t1",
    taskDigest: digestTask(task),
    agent: "oracle",
    status,
    reward: status === "completed" ? 1 : null,
    mask: status === "masked",
    failureKind: status === "masked" ? "provider_unavailable" : null,
    stage: "close",
    reason: null,
    teardown: "confirmed",
    exitCode: 0,
    usage: null,
    agentLaunches: 1,
    timings: { queuedMs: 1, seedMs: 1, runMs: 1, verifyMs: 1, closeMs: 1, totalMs: 5, agentMs: 1 },
    details: null,
    failures: [],
    metadata: null,
    createdAt: 1,
    finishedAt: 2,
  });

  it("says which rollouts' seeds make no sandbox: gone, cancelled, closing or finished ones, not one waiting for its seed", async () => {
    const [waiting, cancelled, closing, finished] = await Promise.all(
      Array.from({ length: 4 }, async () => (await admitOne()).ids[0]!),
    );
    await store.requestCancel(cancelled!);
    await store.begin(closing!, "close", 20);
    const meta = (await store.get(finished!))!.meta;
    expect(await store.finalize(meta, resultFor(finished!, "completed"), 10)).toBe(true);
    expect(await store.seedsSkipped([waiting!, cancelled!, closing!, finished!, "no-such-rollout"])).toEqual([
      false,
      true,
      true,
      true,
      true,
    ]);
    // One whose record is not a hash (torn, or written by hand) says nothing of the others: its
    // seed is counted as before (its begin reports the record), the cancelled one's still passes.
    const torn = `torn-${randomUUID()}`;
    await redis.set(store.keys.rollout(torn), "not a hash");
    expect(await store.seedsSkipped([torn, cancelled!, waiting!])).toEqual([false, true, false]);
  });

  it("a finalize sent again with the same arguments (a reconnect lost its reply) still says it finalized; another closer's does not", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const result = resultFor(id, "completed");
    expect(await store.finalize(meta, result, 10, undefined, [], "call-1")).toBe(true);
    expect(await store.finalize(meta, result, 10, undefined, [], "call-1")).toBe(true);
    expect(await store.finalize(meta, result, 10, undefined, [], "call-2")).toBe(false);
    expect(await store.finalize(meta, result, 10)).toBe(false);
    expect((await store.get(id))?.status).toBe("completed");
  });

  it("a stopped run's usage goes to its result: kept for a close still to finalize, put in a finalized result that says none, never over another usage or a run receipt's, nothing for a rollout gone", async () => {
    const usage = {
      calls: 2,
      promptTokens: 20,
      completionTokens: 4,
      cachedTokens: null,
      gaps: ["one call's usage unknown"],
    };
    const [before, after, other, receipted] = await Promise.all(
      Array.from({ length: 4 }, async () => (await admitOne()).ids[0]!),
    );
    /** The run's launch, claimed as the run stage claims it. */
    const launch = async (id: string, token = `w:${randomUUID()}`) => ({
      token,
      launches: (await store.claimLaunch(id, token)).launches,
    });
    const finalize = async (id: string, result = resultFor(id, "cancelled")) =>
      expect(await store.finalize((await store.get(id))!.meta, result, 10)).toBe(true);
    // Stopped before its close finalized: the close's result says it.
    expect(await store.saveStoppedRunUsage(before!, usage, await launch(before!))).toBe("kept");
    await finalize(before!);
    expect(await store.getResult(before!)).toEqual({ ...resultFor(before!, "cancelled"), usage });
    // Stopped after: the finalized result is edited, nothing else of it.
    const afterLaunch = await launch(after!);
    await finalize(after!);
    expect(await store.saveStoppedRunUsage(after!, usage, afterLaunch)).toBe("in-result");
    expect(await store.getResult(after!)).toEqual({ ...resultFor(after!, "cancelled"), usage });
    // A result that says a usage keeps it (the failure's, say).
    const theirs = { ...usage, calls: 9 };
    const otherLaunch = await launch(other!);
    await finalize(other!, { ...resultFor(other!, "cancelled"), usage: theirs });
    expect(await store.saveStoppedRunUsage(other!, usage, otherLaunch)).toBe("kept");
    expect((await store.getResult(other!))?.usage).toEqual(theirs);
    // A run receipt carries its own usage: nothing stored beside it, and a usage kept before it
    // (a launch handed back at a shutdown, then run again) is not the result's.
    const receiptedLaunch = await launch(receipted!);
    expect(await store.saveStoppedRunUsage(receipted!, usage, receiptedLaunch)).toBe("kept");
    await redis.hset(store.keys.rollout(receipted!), "r:run", "{}");
    expect(await store.saveStoppedRunUsage(receipted!, { ...usage, calls: 3 }, receiptedLaunch)).toBe("none");
    expect(JSON.parse((await redis.hget(store.keys.rollout(receipted!), "u:run"))!)).toEqual(usage);
    await finalize(receipted!);
    expect((await store.getResult(receipted!))?.usage).toBeNull();
    // A rollout gone (its retention ended): no record is made again.
    const gone = `gone-${randomUUID()}`;
    expect(await store.saveStoppedRunUsage(gone, usage, { token: "w:gone", launches: 1 })).toBe("none");
    expect(await redis.exists(store.keys.rollout(gone))).toBe(0);
    // A launch taken over (its lock lapsed), then stopped: the launch that took over is the
    // result's, never the earlier one's; nor a launch whose token never claimed on this record
    // (a rollout admitted again under the same id since).
    const [takenOver] = (await admitOne()).ids;
    const earlier = await launch(takenOver!);
    const later = await launch(takenOver!);
    expect(await store.saveStoppedRunUsage(takenOver!, usage, later)).toBe("kept");
    expect(await store.saveStoppedRunUsage(takenOver!, { ...usage, calls: 1 }, earlier)).toBe("none");
    expect(await store.saveStoppedRunUsage(takenOver!, usage, { token: "w:stranger", launches: 2 })).toBe(
      "none",
    );
    await finalize(takenOver!);
    expect((await store.getResult(takenOver!))?.usage).toEqual(usage);
    // Many gaps: the first are kept, the rest said as one.
    const many = { ...usage, gaps: Array.from({ length: 25 }, (_, i) => `gap ${i}`) };
    const { ids } = await admitOne();
    const manyLaunch = await launch(ids[0]!);
    await finalize(ids[0]!);
    await store.saveStoppedRunUsage(ids[0]!, many, manyLaunch);
    expect((await store.getResult(ids[0]!))?.usage?.gaps).toEqual([
      ...many.gaps.slice(0, 20),
      "5 more gap(s) not kept",
    ]);
  });

  it("a stopped run's usage put in a result near its 16 KiB bound keeps the result within it, whichever comes first", async () => {
    const usage = {
      calls: 40,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      gaps: [
        "usage missing on calls 3, 7-9, 12, 15, 18-20, 23, 31, 33-35, 38, 40",
        "3 failed upstream attempts not counted (usage unknown)",
        "2 calls in flight at revocation aborted (usage unknown)",
      ],
    };
    // Gaps that do not fit beside the result: said as one.
    const wide = { ...usage, gaps: Array.from({ length: 20 }, (_, i) => `${i}: ${"g".repeat(480)}`) };
    for (const [order, spent] of [
      ["finalized first", usage],
      ["stopped first", usage],
      ["finalized first", wide],
      ["stopped first", wide],
    ] as const) {
      const [id] = (await admitOne()).ids;
      const meta = (await store.get(id!))!.meta;
      const launched = { token: `w:${randomUUID()}`, launches: 0 };
      launched.launches = (await store.claimLaunch(id!, launched.token)).launches;
      // A cancelled result just within the bound (nothing of it cut).
      const base = { ...resultFor(id!, "cancelled"), reason: "r".repeat(4000) };
      const pad =
        MAX_RECORD_BYTES - 16 - Buffer.byteLength(JSON.stringify({ ...base, details: { log: "" } }));
      const result = { ...base, details: { log: "x".repeat(pad) } };
      if (order === "finalized first") expect(await store.finalize(meta, result, 10)).toBe(true);
      await store.saveStoppedRunUsage(id!, spent, launched);
      if (order === "stopped first") expect(await store.finalize(meta, result, 10)).toBe(true);
      const raw = (await redis.hget(store.keys.rollout(id!), "result"))!;
      expect({ order, bytes: Buffer.byteLength(raw) <= MAX_RECORD_BYTES }).toEqual({ order, bytes: true });
      expect((await store.getResult(id!))?.usage).toEqual(
        spent === usage
          ? usage
          : {
              ...usage,
              gaps: ["20 gap(s) of this usage left out, to keep the result within its size bound"],
            },
      );
    }
  });

  it("finalizes exactly once under concurrent closers", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const outcomes = await Promise.all(
      Array.from({ length: 20 }, (_, i) =>
        store.finalize(meta, resultFor(id, i % 2 ? "completed" : "masked"), Date.now()),
      ),
    );
    expect(outcomes.filter(Boolean)).toHaveLength(1);
    expect(await redis.zscore(`${prefix}:x:inflight`, id)).toBeNull();
    // A receipt after the terminal state is refused.
    expect(
      await store.saveReceipt(
        meta,
        "verify",
        { reward: 0, details: {}, startedAt: 1, at: 2 },
        "verified",
        Date.now(),
      ),
    ).toBe(false);
  });

  it("stamps a live stage's heartbeat on an open rollout only: never on a closed or gone one (no key of its own)", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    expect(await store.beat(id, "run", 1234)).toBe(true);
    expect((await store.get(id))!.times["run:beat"]).toBe(1234);
    const gone = `gone-${id}`;
    expect(await store.beat(gone, "run", 1234)).toBe(false);
    expect(await redis.exists(store.keys.rollout(gone))).toBe(0);
    await redis.hset(store.keys.rollout(id), "closed", "1");
    expect(await store.beat(id, "run", 5678)).toBe(false);
    expect((await store.get(id))!.times["run:beat"]).toBe(1234);
  });

  it("keeps the first terminal failure and logs every failure, bounded", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const f = (kind: "provider_unavailable" | "verifier_error", terminal: boolean) => ({
      stage: "run" as const,
      terminal,
      failureKind: kind,
      mask: true,
      reason: "x".repeat(10_000),
      at: Date.now(),
    });
    for (let i = 0; i < 30; i++) await store.recordFailure(id, f("provider_unavailable", false));
    expect(await store.recordFailure(id, f("verifier_error", true))).toBe(true);
    expect(await store.recordFailure(id, f("provider_unavailable", true))).toBe(false);
    const rec = (await store.get(id))!;
    expect(rec.failure?.failureKind).toBe("verifier_error");
    expect(rec.failure!.reason.length).toBeLessThanOrEqual(4000);
    expect((await store.failureLog(id)).length).toBe(20);
  });

  it("a deciding failure sent again (a reconnect lost the reply of the call that set it) is answered set, and logged", async () => {
    const id = (await admitOne()).ids[0]!;
    const failure = {
      stage: "run",
      terminal: true,
      failureKind: "sandbox_lost",
      mask: true,
      reason: "gone",
      at: 7,
    } as const;
    expect(
      await sentTwice("fleetSetField", () => store.recordFailure(id, failure, { beforeDecided: true })),
    ).toBe(true);
    expect(await store.failureLog(id)).toEqual([failure]);
    // A run's failure under its launch fence, a cancel (which stops the launch) between the two
    // sends: still its own.
    const fenced = (await admitOne()).ids[0]!;
    await store.claimLaunch(fenced, "T");
    const deliveryFence = { field: "fence", token: "launched:T" } as const;
    expect(
      await sentTwice(
        "fleetSetField",
        () => store.recordFailure(fenced, failure, { beforeDecided: true, deliveryFence }),
        () => store.requestCancel(fenced),
      ),
    ).toBe(true);
    expect(await store.failureLog(fenced)).toEqual([failure]);
    // Another call is refused, the same record too (two cancels in one millisecond write the
    // same): the first decided, and only its row is logged.
    expect(await store.recordFailure(id, failure, { beforeDecided: true })).toBe(false);
    expect(await store.recordFailure(id, { ...failure, at: 8 }, { beforeDecided: true })).toBe(false);
    expect(await store.failureLog(id)).toEqual([failure]);
    expect((await store.get(id))!.failure).toEqual(failure);
  });

  it("same idempotency key → same rollout and one seed job", async () => {
    const a = await admitOne("same-key");
    const b = await admitOne("same-key");
    expect(b.ids).toEqual(a.ids);
    expect(a.created).toHaveLength(1);
    expect(b.created).toHaveLength(0);
    const jobs = await queues.queues.seed.getJobs(["waiting", "delayed", "prioritized"]);
    expect(jobs.filter((j) => j.id === `${a.ids[0]}.seed`)).toHaveLength(1);
  });

  it("a rollout's one deadline counts from its acceptance, and a replay of its request never moves it (rule 5)", async () => {
    const accepted = Date.now() - 60_000; // accepted a minute ago
    const request = {
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
      deadlineS: 300,
    };
    const send = (now?: number) =>
      admit(
        store,
        queues,
        { requests: [request], batch: false, idempotencyKey: "one-deadline" },
        { maxTaskBytes: 1e6, ...(now === undefined ? {} : { now }) },
      );
    const first = await send(accepted);
    const id = first.ids[0]!;
    const deadline = accepted + 300_000;
    expect((await store.get(id))!.meta).toMatchObject({ createdAt: accepted, deadlineAt: deadline });
    // The field the stage scripts read, and the in-flight index the watchdog reads, agree.
    expect(Number(await redis.hget(store.keys.rollout(id), "deadline"))).toBe(deadline);
    expect(Number(await redis.zscore(store.keys.inflight(), id))).toBe(deadline);
    // The client sends it again now (its answer was lost): the same rollout, the same deadline.
    const again = await send();
    expect(again).toMatchObject({ ids: [id], created: [] });
    expect((await store.get(id))!.meta.deadlineAt).toBe(deadline);
  });

  it("batch counters follow status changes and count terminal rollouts once", async () => {
    const r = await admit(
      store,
      queues,
      {
        requests: [1, 2, 3].map(() => ({
          task,
          agent: { harness: "oracle" as const, sandbox: "borrow" as const },
        })),
        batch: true,
      },
      { maxTaskBytes: 1e6 },
    );
    const b0 = (await store.getBatch(r.batchId!))!;
    expect(b0).toMatchObject({ total: 3, done: 0 });
    expect(b0.counts.accepted).toBe(3);
    const meta = (await store.get(r.ids[0]!))!.meta;
    await store.finalize(meta, { ...resultFor(r.ids[0]!, "completed"), batchId: r.batchId }, Date.now());
    await store.finalize(meta, { ...resultFor(r.ids[0]!, "completed"), batchId: r.batchId }, Date.now());
    const b1 = (await store.getBatch(r.batchId!))!;
    expect(b1).toMatchObject({ total: 3, done: 1 });
    expect(b1.counts.completed).toBe(1);
    expect(b1.counts.accepted).toBe(2);
  });

  const runReceiptFor = (at: number) => ({
    exec: {
      exitCode: 0,
      timedOut: false,
      stdout: "",
      stderr: "",
      stdoutTruncated: false,
      stderrTruncated: false,
      durationMs: 1,
      oomKilled: false,
    },
    answer: null,
    transcript: null,
    usage: null,
    cleanup: { confirmed: true, scope: "processes" as const, at, alreadyGone: false, remaining: 0 },
    ownedSandbox: null,
    startedAt: at - 1,
    stoppedAt: at,
    attempts: 1,
    at,
  });

  const seedReceipt = (id: string) => ({
    handle: {
      provider: "docker" as const,
      endpoint: "unix:///x",
      id: `c-${id}`,
      name: `n-${id}`,
      rolloutId: id,
      owner: "resources" as const,
      volumes: [],
    },
    probe: { isolated: true, checks: {}, detail: "", durationMs: 1 },
    createMs: 1,
    probeMs: 1,
    stageMs: 1,
    reused: false,
    at: 3,
  });
  /** The task sandbox's entry for a seed receipt's handle. */
  const seedEntry = (id: string, receipt: ReturnType<typeof seedReceipt>) => ({
    key: sandboxKey(id, "resources"),
    rolloutId: id,
    owner: "resources" as const,
    provider: "docker" as const,
    handle: receipt.handle,
    createdAt: 1,
    expiresAt: 2,
  });

  it("seed's begin persists the sandbox intent with the stage check, and not once the rollout is closed", async () => {
    const intent = { owner: "resources" as const, provider: "docker" as const, expirySlackMs: 600_000 };
    const { ids } = await admitOne();
    const id = ids[0]!;
    const begun = await store.begin(id, "seed", 1_000, { intent });
    expect([begun.intentRecorded, begun.intentFresh]).toEqual([true, true]);
    // A re-delivered seed finds the intent an earlier attempt recorded: not fresh (its sandbox
    // may exist, to be found by label); the entry, still without a handle, dates from this
    // attempt (which may be the one creating the sandbox: the intent grace counts from it).
    const again = await store.begin(id, "seed", 2_000, { intent });
    expect([again.intentRecorded, again.intentFresh]).toEqual([true, false]);
    const entry = JSON.parse((await redis.hget(store.keys.sandboxes(), sandboxKey(id, "resources")))!);
    // A valid SandboxEntry whose expiry is the rollout's deadline plus the slack.
    expect(entry).toEqual({
      key: sandboxKey(id, "resources"),
      rolloutId: id,
      owner: "resources",
      provider: "docker",
      handle: null,
      createdAt: 2_000,
      expiresAt: begun.record!.meta.deadlineAt + 600_000,
    });
    // Before close, the record carries what the stages read, not the timings.
    expect(begun.record!.times).toEqual({});

    // Past the deadline the runner skips the stage: no intent may be left without a sandbox.
    const late = (await admitOne()).ids[0]!;
    const deadlineAt = (await store.get(late))!.meta.deadlineAt;
    expect((await store.begin(late, "seed", deadlineAt, { intent })).intentRecorded).toBe(false);
    expect(await redis.hexists(store.keys.sandboxes(), sandboxKey(late, "resources"))).toBe(0);
    expect((await store.begin(late, "seed", deadlineAt - 1, { intent })).intentRecorded).toBe(true);

    // Free metadata that JSON.parse accepts but Redis' Lua JSON decoder refuses (a lone
    // surrogate) must not stop a seed: the script never decodes meta.
    const odd = await admit(
      store,
      queues,
      {
        requests: [{ task, agent: { harness: "oracle", sandbox: "borrow" }, metadata: { x: "\ud800" } }],
        batch: false,
      },
      { maxTaskBytes: 1e6 },
    );
    expect(await redis.hget(store.keys.rollout(odd.ids[0]!), "meta")).toContain("\\ud800");
    expect((await store.begin(odd.ids[0]!, "seed", 1_000, { intent })).intentRecorded).toBe(true);

    const other = (await admitOne()).ids[0]!;
    await store.tombstone(other);
    const refused = await store.begin(other, "seed", 1_000, { intent });
    expect([refused.intentRecorded, refused.intentFresh]).toEqual([false, false]);
    expect(await redis.hexists(store.keys.sandboxes(), sandboxKey(other, "resources"))).toBe(0);
  });

  it("run's begin claims the fenced launch; a stop wins over a later claim", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const first = await store.begin(id, "run", 1, { launchToken: "a" });
    expect(first.launch).toEqual({ previous: "", launches: 1, token: "a" });
    // The record is as the begin left it: its fence is this claim.
    expect(first.record!.fence).toBe("launched:a");
    const again = await store.begin(id, "run", 2, { launchToken: "b" });
    expect(again.launch).toEqual({ previous: "launched:a", launches: 2, token: "b" });
    await redis.hset(store.keys.rollout(id), "fence", "stopped");
    expect((await store.begin(id, "run", 3, { launchToken: "c" })).launch).toEqual({
      previous: "stopped",
      launches: 0,
      token: "c",
    });
    // Skipped stages claim nothing: after a cancel the fence stays as the cancel left it.
    await store.requestCancel(id);
    expect((await store.begin(id, "run", 4, { launchToken: "d" })).launch).toBeNull();
    expect(await redis.hget(store.keys.rollout(id), "fence")).toBe("stopped");
  });

  it("a begin sent again with the same arguments (ioredis re-sends one whose reply a reconnect lost) answers as the first did", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const first = await store.begin(id, "run", 1, { launchToken: "a" });
    const resent = await store.begin(id, "run", 1, { launchToken: "a" });
    // Not a second launch: a run told "previous: launched:a" would reset the sandbox for a rerun.
    expect(resent.launch).toEqual(first.launch);
    expect(resent.launch).toEqual({ previous: "", launches: 1, token: "a" });
    // A real second attempt is still told of the first.
    const second = await store.begin(id, "run", 2, { launchToken: "b" });
    expect(second.launch).toEqual({ previous: "launched:a", launches: 2, token: "b" });
    expect((await store.begin(id, "run", 2, { launchToken: "b" })).launch).toEqual(second.launch);
    expect(await store.claimLaunch(id, "b")).toEqual({ previous: "launched:a", launches: 2 });
    // The first attempt's begin sent again late, after the second's claim (ioredis re-sends one
    // whose reply a reconnect lost): it takes nothing back from the launch that holds the fence,
    // and counts no launch.
    expect((await store.begin(id, "run", 1, { launchToken: "a" })).launch).toEqual({
      previous: "superseded",
      launches: 0,
      token: "a",
    });
    expect(await store.claimLaunch(id, "a")).toEqual({ previous: "superseded", launches: 0 });
    expect(await redis.hmget(store.keys.rollout(id), "fence", "launches")).toEqual(["launched:b", "2"]);
    expect(await store.launchState(id, "b")).toBe("run");
    // A claim given back (its harness never started) is not taken again by its own late copy.
    const given = (await admitOne()).ids[0]!;
    expect(await store.claimLaunch(given, "g")).toEqual({ previous: "", launches: 1 });
    expect(await store.releaseLaunch(given, "g", "")).toBe(true);
    expect(await store.claimLaunch(given, "g")).toEqual({ previous: "superseded", launches: 0 });

    // With its delivery's job lock: claimed only while the lock holds the delivery's token.
    const locked = (await admitOne()).ids[0]!;
    const lockKey = `${prefix}:run:${locked}.run:lock`;
    const launchLock = { key: lockKey, token: "lock-a" };
    // The lock lapsed (BullMQ's key gone), or a later delivery holds it: nothing is claimed.
    expect((await store.begin(locked, "run", 1, { launchToken: "a", launchLock })).launch).toEqual({
      previous: "superseded",
      launches: 0,
      token: "a",
    });
    await redis.set(lockKey, "lock-b", "PX", 60_000);
    expect((await store.begin(locked, "run", 1, { launchToken: "a", launchLock })).launch).toMatchObject({
      previous: "superseded",
    });
    expect(await redis.hmget(store.keys.rollout(locked), "fence", "launches")).toEqual([null, null]);
    // Held: claimed.
    await redis.set(lockKey, "lock-a", "PX", 60_000);
    expect((await store.begin(locked, "run", 1, { launchToken: "a", launchLock })).launch).toEqual({
      previous: "",
      launches: 1,
      token: "a",
    });
    expect(await redis.hget(store.keys.rollout(given), "fence")).toBeNull();

    // Verify: a begin (sent again or not) is no earlier attempt whose tests it must wait out;
    // only tests noted as started are, the latest of them.
    const v = (await admitOne()).ids[0]!;
    await store.begin(v, "verify", 10, { verifyToken: "v1" });
    expect(
      (await store.begin(v, "verify", 10, { verifyToken: "v1" })).record!.times["verify:prev"],
    ).toBeUndefined();
    expect(
      (await store.begin(v, "verify", 20, { verifyToken: "v2" })).record!.times["verify:prev"],
    ).toBeUndefined();
    expect(await store.noteVerifyWork(v, 25, "v2")).toBe("noted");
    expect((await store.begin(v, "verify", 30, { verifyToken: "v3" })).record!.times["verify:prev"]).toBe(25);
    expect((await store.begin(v, "verify", 30, { verifyToken: "v3" })).record!.times["verify:prev"]).toBe(25);
    expect(await store.noteVerifyWork(v, 35, "v3")).toBe("noted");
    expect((await store.begin(v, "verify", 40, { verifyToken: "v4" })).record!.times["verify:prev"]).toBe(35);
  });

  it("each verify attempt gets an epoch one above the attempt's before it; a begin sent again gets its own again, and other stages none", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    expect((await store.begin(id, "seed", 1, { seedToken: "s" })).verifyEpoch).toBeNull();
    expect((await store.begin(id, "verify", 1)).verifyEpoch).toBeNull();
    expect((await store.begin(id, "verify", 1, { verifyToken: "a" })).verifyEpoch).toBe(1);
    expect((await store.begin(id, "verify", 2, { verifyToken: "b" })).verifyEpoch).toBe(2);
    // A's begin sent again (a reconnect lost its reply): its epoch, not a new one, and the fence stays B's.
    expect((await store.begin(id, "verify", 1, { verifyToken: "a" })).verifyEpoch).toBe(1);
    expect(await store.holdsFence(id, { field: "vfence", token: "b" })).toBe(true);
    expect((await store.begin(id, "verify", 3, { verifyToken: "c" })).verifyEpoch).toBe(3);
    expect((await store.begin(id, "verify", 3, { verifyToken: "b" })).verifyEpoch).toBe(2);
    // Whether the attempt whose note a begin reads honours the sandbox's fence: one of this
    // release does; one of an older release (it notes no `vaware`) does not, even after one
    // that did.
    expect((await store.begin(id, "verify", 3, { verifyToken: "c" })).earlierVerifyFenceAware).toBe(false);
    expect(await store.noteVerifyWork(id, 3, "c")).toBe("noted");
    expect((await store.begin(id, "verify", 3, { verifyToken: "c" })).earlierVerifyFenceAware).toBe(true);
    // A note of a release older still (it sets only the time) after an aware one: not aware.
    await redis.hset(store.keys.rollout(id), "t:verify:last", "5");
    expect((await store.begin(id, "verify", 4, { verifyToken: "c" })).earlierVerifyFenceAware).toBe(false);
    await redis.hset(store.keys.rollout(id), "t:verify:last", "4", "vnote", "older-release");
    expect((await store.begin(id, "verify", 4, { verifyToken: "c" })).earlierVerifyFenceAware).toBe(false);
    // A fence above Redis's epochs (Redis lost them): raised past it, never lowered.
    expect(await store.raiseVerifyEpoch(id, 9)).toBe(9);
    expect(await store.raiseVerifyEpoch(id, 2)).toBe(9);
    expect((await store.begin(id, "verify", 5, { verifyToken: "e" })).verifyEpoch).toBe(10);
    // A verify skipped (a cancel came) takes no epoch.
    await store.requestCancel(id);
    expect((await store.begin(id, "verify", 4, { verifyToken: "d" })).verifyEpoch).toBeNull();
    expect(await redis.hget(store.keys.rollout(id), "vepoch")).toBe("10");
  });

  it("only the verify attempt that began last may note its tests' start or store its receipt", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const a = await store.begin(id, "verify", 1, { verifyToken: "a" });
    expect(a.verifyToken).toBe("a");
    expect(await store.holdsFence(id, { field: "vfence", token: "a" })).toBe(true);
    // A paused before its tests; its job went to B.
    await store.begin(id, "verify", 2, { verifyToken: "b" });
    expect(await store.holdsFence(id, { field: "vfence", token: "a" })).toBe(false);
    expect(await store.noteVerifyWork(id, 3, "a")).toBe("superseded");
    expect(await redis.hget(store.keys.rollout(id), "t:verify:last")).toBeNull();
    expect(await store.noteVerifyWork(id, 4, "b")).toBe("noted");
    // A's begin sent again by ioredis after a reconnect (its reply lost) takes nothing back.
    await store.begin(id, "verify", 1, { verifyToken: "a" });
    expect(await store.holdsFence(id, { field: "vfence", token: "b" })).toBe(true);
    // A cannot clear B's note, nor record a failure that would end the rollout under B.
    expect(await store.noteVerifyWork(id, null, "a")).toBe("superseded");
    expect(await redis.hget(store.keys.rollout(id), "t:verify:last")).toBe("4");
    const failure = {
      stage: "verify",
      terminal: true,
      failureKind: "verifier_error",
      mask: true,
      reason: "crashed",
      at: 4,
    } as const;
    expect(
      await store.recordFailure(id, failure, {
        beforeDecided: true,
        deliveryFence: { field: "vfence", token: "a" },
      }),
    ).toBe(false);
    expect((await store.get(id))!.failure).toBeNull();
    // Nor logged: a refused failure would show in the result's failures as if it had counted.
    expect(await store.failureLog(id)).toEqual([]);
    // B's staging failed: its note goes (a retry need not wait for tests that never started).
    expect(await store.noteVerifyWork(id, null, "b")).toBe("noted");
    expect(await redis.hget(store.keys.rollout(id), "t:verify:last")).toBeNull();
    const receipt = { reward: 1, details: { kind: "tests" }, startedAt: 4, at: 5 };
    expect(
      await store.saveReceipt(meta, "verify", receipt, "verified", 5, {
        deliveryFence: { field: "vfence", token: "a" },
      }),
    ).toBe(false);
    expect((await store.get(id))!.receipts.verify).toBeUndefined();
    expect(
      await store.saveReceipt(meta, "verify", receipt, "verified", 6, {
        deliveryFence: { field: "vfence", token: "b" },
      }),
    ).toBe(true);
    // A skipped stage takes no fence: B keeps it.
    expect((await store.begin(id, "verify", 7, { verifyToken: "c" })).record!.receipts.verify).toBeDefined();
    expect(await store.holdsFence(id, { field: "vfence", token: "b" })).toBe(true);
    // Terminal: nothing to note, nothing to refuse for.
    await redis.hset(store.keys.rollout(id), "status", "completed");
    expect(await store.noteVerifyWork(id, 8, "b")).toBe("terminal");
  });

  it("a handed-back verify claims the sweep of its tests only while it holds the fence, timed by Redis; a later attempt's begin sees the claim's time left until it ends", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    await store.begin(id, "verify", 1, { verifyToken: "a" });
    expect((await store.begin(id, "verify", 1, { verifyToken: "a" })).testsSweepLeftMs).toBe(0);
    expect(await store.noteVerifyWork(id, 5, "a")).toBe("noted");
    const claimed = await store.claimTestsSweep(id, "a", 30_000);
    if (!claimed.claimed) throw new Error(`not claimed: ${claimed.why}`);
    // Its end is Redis's clock plus the window, whatever this process's clock says.
    const [sec, micro] = await redis.time();
    const redisNow = Number(sec) * 1000 + Math.floor(Number(micro) / 1000);
    expect(Number(claimed.claim) - redisNow).toBeGreaterThan(29_000);
    expect(Number(claimed.claim) - redisNow).toBeLessThanOrEqual(30_000);
    // B begins during A's sweep (by its own clock, far off): it is told how long the claim has left.
    const b = await store.begin(id, "verify", 10_000_000_000_000, { verifyToken: "b" });
    expect(b.testsSweepLeftMs).toBeGreaterThan(29_000);
    expect(b.testsSweepLeftMs).toBeLessThanOrEqual(30_000);
    expect(await store.testsSweepLeftMs(id)).toBeGreaterThan(0);
    // A can claim no other sweep now: the tests there are B's.
    expect(await store.claimTestsSweep(id, "a", 30_000)).toEqual({ claimed: false, why: "superseded" });
    // Ending another claim changes nothing; A's own end, its tests confirmed stopped, takes the
    // claim and A's note of its work (B, waiting on the claim, noted nothing).
    await store.endTestsSweep(id, "1", 5);
    expect(await store.testsSweepLeftMs(id)).toBeGreaterThan(0);
    expect((await store.verifyNote(id))?.at).toBe(5);
    await store.endTestsSweep(id, claimed.claim, 5);
    expect(await store.testsSweepLeftMs(id)).toBe(0);
    expect(await store.verifyNote(id)).toBeUndefined();
    expect((await store.begin(id, "verify", 3, { verifyToken: "c" })).testsSweepLeftMs).toBe(0);
    expect(await store.noteVerifyWork(id, 7, "c")).toBe("noted");
    const c = await store.claimTestsSweep(id, "c", 50);
    if (!c.claimed) throw new Error(`not claimed: ${c.why}`);
    // A claim lapses by Redis's clock, ended or not.
    await vi.waitFor(async () => expect(await store.testsSweepLeftMs(id)).toBe(0), { timeout: 10_000 });
    // A note that is no longer the ender's (another was noted since) stays.
    await store.endTestsSweep(id, c.claim, 6);
    expect((await store.verifyNote(id))?.at).toBe(7);
    expect(await store.testsSweepLeftMs(id)).toBe(0);
    await redis.hset(store.keys.rollout(id), "status", "completed");
    expect(await store.claimTestsSweep(id, "c", 30_000)).toEqual({ claimed: false, why: "terminal" });
  });

  it("a verify attempt that leaves the sandbox marks only its own note: a later attempt's begin is told so, never for a note another attempt took since", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const prevLeft = async (token: string) => {
      const b = await store.begin(id, "verify", 1, { verifyToken: token });
      return { at: b.record!.times["verify:prev"], left: b.earlierVerifyLeft };
    };
    // No note yet: nothing to leave.
    expect(await prevLeft("a")).toEqual({ at: undefined, left: false });
    expect(await store.leaveVerifyWork(id, "a")).toBe(false);
    expect(await store.noteVerifyWork(id, 5, "a")).toBe("noted");
    // A's note, A still at work (say its worker died): B must wait its tests out.
    expect(await prevLeft("b")).toEqual({ at: 5, left: false });
    // B began but noted nothing; B leaving marks nothing: the note is A's, and A may be paused.
    expect(await store.leaveVerifyWork(id, "b")).toBe(false);
    expect(await store.verifyNote(id)).toEqual({ at: 5, left: false });
    // A leaves (its exec broke): its note is marked, and the next attempt's begin says so.
    expect(await store.leaveVerifyWork(id, "a")).toBe(true);
    expect(await store.leaveVerifyWork(id, "a")).toBe(false);
    expect(await store.verifyNote(id)).toEqual({ at: 5, left: true });
    expect(await prevLeft("c")).toEqual({ at: 5, left: true });
    // An attempt of an older release (it notes no vnote) notes since: its tests are not left.
    await redis.hset(store.keys.rollout(id), "t:verify:last", "6");
    expect(await prevLeft("c")).toEqual({ at: 6, left: false });
    await redis.hset(store.keys.rollout(id), "t:verify:last", "5");
    // C notes its own work: the mark is gone with A's note.
    expect(await store.noteVerifyWork(id, 9, "c")).toBe("noted");
    expect(await prevLeft("d")).toEqual({ at: 9, left: false });
    // A late leave by A (its call held through an outage) marks nothing of C's.
    expect(await store.leaveVerifyWork(id, "a")).toBe(false);
    expect(await store.verifyNote(id)).toEqual({ at: 9, left: false });
  });

  it("the task cache is bounded by size, not only by count: the oldest go first, a task over a quarter of it is never kept", async () => {
    const names = ["a", "b", "c", "d", "e", "f", "big"];
    const tasks = names.map((name) =>
      TaskContent.parse({
        id: `cache-${name}`,
        instruction: name === "big" ? "x".repeat(3000) : name.repeat(700),
        image: "img",
        tests: { "test.sh": "true" },
      }),
    );
    const digests = tasks.map((t) => digestTask(t));
    const small = JSON.stringify(tasks[0]).length;
    // Room for four of the small ones (each a quarter of it); the big one is over a quarter.
    const cached = new RolloutStore(redis, prefix, { taskCacheChars: 4 * small + 10 });
    for (const [i, t] of tasks.entries()) await cached.putTask(t, digests[i]!);
    for (const d of digests) expect((await cached.getTask(d))?.id).toMatch(/^cache-/);
    // Gone from Redis: only what the cache kept can still be read.
    await redis.del(...digests.map((d) => cached.keys.task(d)));
    const kept = [];
    for (const d of digests) kept.push((await cached.getTask(d))?.id ?? null);
    expect(kept).toEqual([null, null, "cache-c", "cache-d", "cache-e", "cache-f", null]);
  });

  it("a match-graded task with tests/ that an earlier version stored is read without them, not refused: its rollout is graded", async () => {
    const stored = {
      id: "older-match",
      instruction: "Answer 42.",
      image: "img",
      tests: { "test.sh": "exit 1\n" },
      verifier: { kind: "match", expected: "42" },
    };
    // Admission refuses it now; stored as an older version's admission wrote it.
    expect(TaskContent.safeParse(stored).success).toBe(false);
    const digest = `older-${Date.now()}`;
    await redis.set(store.keys.task(digest), JSON.stringify(stored));
    const task = await store.getTask(digest);
    expect(task).toMatchObject({ id: "older-match", tests: {}, verifier: { kind: "match", expected: "42" } });
  });

  it("a task an earlier version stored with file paths not spelled plainly is read with them spelled as they were staged, not refused: its rollout runs", async () => {
    const stored = {
      id: "older-paths",
      instruction: "Fix it.",
      image: "img",
      workspace: { "./src//main.py": "print(1)\n", "docs/./a.md": "a", "ok.txt": "k" },
      solution: { "./solve.sh": "true" },
      tests: { "test.sh": "exit 0\n", "data/": "d" },
    };
    // Admission refuses it now; stored as an older version's admission wrote it.
    expect(TaskContent.safeParse(stored).success).toBe(false);
    const digest = `older-paths-${Date.now()}`;
    await redis.set(store.keys.task(digest), JSON.stringify(stored));
    const task = await store.getTask(digest);
    expect(task).toMatchObject({
      workspace: { "src/main.py": "print(1)\n", "docs/a.md": "a", "ok.txt": "k" },
      solution: { "solve.sh": "true" },
      tests: { "test.sh": "exit 0\n", data: "d" },
    });
  });

  it("a backlog reservation re-sent (a reconnect lost its reply) still holds, not counted against itself", async () => {
    const own = new RolloutStore(redis, `${prefix}-res`);
    const scripted = withScripts(redis);
    const keys = [own.keys.inflight(), own.keys.reservations()];
    const args = ["res-1", "3", "4", "1000", "60000"];
    expect(await scripted.fleetReserve(...keys, ...args)).toEqual([1, 0, 0, 0]);
    expect(await scripted.fleetReserve(...keys, ...args)).toEqual([1, 0, 0, 0]);
    expect(await redis.zrange(own.keys.reservations(), "0", "-1")).toEqual(["res-1:3"]);
    // Another submission still sees it: 3 reserved + 2 > 4.
    const other = await own.reserveBacklog(2, 4, 2000);
    expect(other).toMatchObject({ reserved: false, inflight: 0, reservedByOthers: 3 });
    await redis.del(...keys);
  });

  it("a run's receipt is stored only while its launch holds the fence; a claim that launched nothing is given back", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const a = await store.begin(id, "run", 1, { launchToken: "a" });
    expect(await store.launchState(id, "a")).toBe("run");
    // A failure before the harness started: the claim is undone, as if it never was.
    expect(await store.releaseLaunch(id, "a", a.launch!.previous)).toBe(true);
    expect(await redis.hmget(store.keys.rollout(id), "fence", "launches")).toEqual([null, "0"]);
    expect((await store.begin(id, "run", 2, { launchToken: "b" })).launch).toMatchObject({ previous: "" });
    // B launched; its job then went to C (B was cut off): B lost the fence, C holds it.
    await store.begin(id, "run", 3, { launchToken: "c" });
    expect(await store.launchState(id, "b")).toBe("lost");
    expect(await store.releaseLaunch(id, "b", "")).toBe(false); // not B's to give back any more
    const receipt = runReceiptFor(5);
    expect(await store.saveReceipt(meta, "run", receipt, "ran", 5, { fence: "b" })).toBe(false);
    expect((await store.get(id))!.receipts.run).toBeUndefined();
    expect(await store.saveReceipt(meta, "run", receipt, "ran", 6, { fence: "c" })).toBe(true);
    await store.requestCancel(id);
    expect(await store.launchState(id, "c")).toBe("stop");
  });

  it("stored receipts, failures and results stay within 16 KiB, the graded answer whole", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const receipt = runReceiptFor(5);
    // Each field within its 4,000 characters, the record far past 16 KiB once serialised.
    receipt.exec.stdout = "漢".repeat(4000);
    receipt.exec.stderr = "\u001b".repeat(4000);
    (receipt as { answer: string | null }).answer = "答".repeat(3000);
    expect(await store.saveReceipt(meta, "run", receipt, "ran", 5)).toBe(true);
    const raw = (await redis.hget(store.keys.rollout(id), "r:run"))!;
    expect(Buffer.byteLength(raw)).toBeLessThanOrEqual(MAX_RECORD_BYTES);
    expect(JSON.parse(raw).answer).toBe("答".repeat(3000));
    const failure = {
      stage: "run" as const,
      terminal: false,
      failureKind: "provider_unavailable" as const,
      mask: true,
      reason: "\u0001".repeat(4000),
      at: 6,
    };
    for (let i = 0; i < 5; i++) await store.logFailure(id, failure);
    for (const row of await redis.lrange(store.keys.failures(id), 0, -1)) {
      expect(Buffer.byteLength(row)).toBeLessThanOrEqual(MAX_RECORD_BYTES);
    }
  });

  it("a result too big for 16 KiB keeps who it is and how it ended; only free text is cut", async () => {
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const long = `${"t".repeat(60)}-task`;
    const result = {
      ...resultFor(id, "masked"),
      taskId: long,
      reason: "\u0001".repeat(4000),
      details: { log: "x".repeat(4000) },
      // Numbers cannot be cut: as admitted before the metadata bound existed.
      metadata: { tokens: Array.from({ length: 4000 }, (_, i) => 100_000 + i) },
    };
    expect(await store.finalize(meta, result, Date.now())).toBe(true);
    const [stored] = await store.getResults([id]);
    expect(stored).toMatchObject({
      id,
      taskId: long,
      taskDigest: result.taskDigest,
      agent: "oracle",
      status: "masked",
      failureKind: "provider_unavailable",
      teardown: "confirmed",
    });
    expect(stored!.reason).toContain("…[truncated]");
  });

  it("a batch whose creation was cut short after its body hash is completed by the replay, and counts are never reset", async () => {
    const key = `k-${Date.now()}`;
    const requests = [
      { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } },
      { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } },
    ];
    const submit = () =>
      admit(store, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 });
    // A dispatcher died right after recording the batch's body hash, before admitting anything.
    const batchId = batchIdFor(rolloutIds(2, key, "batch"));
    const bodyHash = sha256Hex(`[${requests.map((r) => canonicalJson(RolloutRequest.parse(r))).join(",")}]`);
    await redis.hset(store.keys.batch(batchId), "bodyHash", bodyHash);
    expect(await store.getBatch(batchId)).toBeNull();
    expect((await submit()).batchId).toBe(batchId);
    expect(await store.getBatch(batchId)).toMatchObject({ total: 2, done: 0 });
    // Creating it again (a concurrent replay's) leaves what admission counted alone.
    expect(await store.createBatch(batchId, bodyHash, Date.now())).toBe(bodyHash);
    expect(await store.getBatch(batchId)).toMatchObject({ total: 2 });
    // createBatch never writes the counts at all (admission and finalize HINCRBY them), so a
    // creation that lands late, after a concurrent replay admitted, cannot reset them to 0.
    const fresh = `b-fresh-${Date.now()}`;
    expect(await store.createBatch(fresh, bodyHash, 5)).toBe(bodyHash);
    expect(await redis.hgetall(store.keys.batch(fresh))).toEqual({ bodyHash, createdAt: "5" });
    // A creation again (a replay's) keeps when the batch was created.
    expect(await store.createBatch(fresh, bodyHash, 9)).toBe(bodyHash);
    expect((await store.getBatch(fresh))!.createdAt).toBe(5);
  });

  it("a batch none of whose rollouts was recorded expires after the admission lease; its first rollout ends the lease, and a replay meanwhile admits it", async () => {
    const key = `lease-${Date.now()}`;
    const requests = [
      { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } },
      { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } },
    ];
    const batchId = batchIdFor(rolloutIds(2, key, "batch"));
    const bodyHash = sha256Hex(`[${requests.map((r) => canonicalJson(RolloutRequest.parse(r))).join(",")}]`);
    // The dispatcher recorded the batch, then died (or lost Redis) before admitting anything.
    expect(await store.createBatch(batchId, bodyHash, Date.now())).toBe(bodyHash);
    const lease = await redis.pttl(store.keys.batch(batchId));
    expect(lease).toBeGreaterThan(BATCH_ADMISSION_LEASE_MS - 60_000);
    expect(lease).toBeLessThanOrEqual(BATCH_ADMISSION_LEASE_MS);
    // The client's replay within the lease admits the batch: the lease is not a finished batch's TTL.
    const replay = await admit(
      store,
      queues,
      { requests, batch: true, idempotencyKey: key },
      { maxTaskBytes: 1e6 },
    );
    expect(replay.batchId).toBe(batchId);
    expect(replay.created).toHaveLength(2);
    expect(await redis.pttl(store.keys.batch(batchId))).toBe(-1);
    expect(await store.getBatch(batchId)).toMatchObject({ total: 2, done: 0, bodyHash });
    // Created again by a concurrent replay's late creation: no lease on a batch with rollouts.
    expect(await store.createBatch(batchId, bodyHash, Date.now())).toBe(bodyHash);
    expect(await redis.pttl(store.keys.batch(batchId))).toBe(-1);
  });

  it("retention: a finished rollout's keys expire after resultTtlMs, a batch's once its last rollout finished, a task a week later still", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const forever = new RolloutStore(redis, prefix, { resultTtlMs: 0 });
    const pttl = (key: string) => redis.pttl(key);
    const requests = [
      { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } },
      { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } },
    ];
    const digest = digestTask(task);
    await redis.del(store.keys.task(digest));
    const { batchId, ids } = await admit(kept, queues, { requests, batch: true }, { maxTaskBytes: 1e6 });
    // A task outlives the longest rollout (two week-long timeouts, an hour's slack, close's retries).
    const taskTtl = await pttl(store.keys.task(digest));
    expect(taskTtl).toBeGreaterThan(60_000 + (14 * 24 + 2) * 3600 * 1000 - 10_000);
    const [a, b] = ids as [string, string];
    const failure = SANDBOX_LOST;
    await kept.logFailure(a, failure);
    // While it runs, its failure log outlives it whatever happens (expiring, should it be left behind).
    expect(await pttl(kept.keys.failures(a))).toBeGreaterThan((14 * 24 + 2) * 3600 * 1000);
    const metaA = (await kept.get(a))!.meta;
    expect(await kept.finalize(metaA, { ...resultFor(a, "completed"), batchId }, Date.now())).toBe(true);
    for (const key of [kept.keys.rollout(a), kept.keys.failures(a)]) {
      expect(await pttl(key)).toBeGreaterThan(50_000);
      expect(await pttl(key)).toBeLessThanOrEqual(60_000);
    }
    // One rollout of the batch still runs: the batch keeps its keys.
    expect(await pttl(kept.keys.batch(batchId!))).toBe(-1);
    expect(await pttl(kept.keys.rollout(b))).toBe(-1);
    const metaB = (await kept.get(b))!.meta;
    expect(await kept.finalize(metaB, { ...resultFor(b, "completed"), batchId }, Date.now())).toBe(true);
    for (const key of [
      kept.keys.batch(batchId!),
      kept.keys.batchIds(batchId!),
      kept.keys.batchDone(batchId!),
      kept.keys.rollout(b),
    ]) {
      expect(await pttl(key)).toBeGreaterThan(50_000);
    }
    expect(await kept.batchDoneIds(batchId!, 0, -1)).toEqual([a, b]);
    expect(await kept.getBatch(batchId!)).toMatchObject({ total: 2, done: 2 });

    // A replay of the finished batch after one of its rollouts expired admits nothing again.
    const keyed = { requests, batch: true, idempotencyKey: `ret-${Date.now()}` };
    const first = await admit(kept, queues, keyed, { maxTaskBytes: 1e6 });
    for (const id of first.ids) {
      const m = (await kept.get(id))!.meta;
      await kept.finalize(m, { ...resultFor(id, "completed"), batchId: first.batchId }, Date.now());
    }
    await redis.del(kept.keys.rollout(first.ids[0]!));
    const err = await admit(kept, queues, keyed, { maxTaskBytes: 1e6 }).catch((e: unknown) => e);
    expect(err).toMatchObject({ name: "AdmissionError", code: "conflict" });
    expect((err as Error).message).toContain("finished and its rollouts are expiring");
    expect(await kept.get(first.ids[0]!)).toBeNull();
    expect(await kept.getBatch(first.batchId!)).toMatchObject({ total: 2, done: 2 });
    expect(await redis.llen(kept.keys.batchIds(first.batchId!))).toBe(2);

    // A rollout admitted again under a key whose earlier rollout expired starts without its failures.
    const single = `single-${Date.now()}`;
    const [sid] = rolloutIds(1, single, "rollout") as [string];
    await redis.rpush(kept.keys.failures(sid), JSON.stringify(failure));
    await admit(
      kept,
      queues,
      { requests: [requests[0]!], batch: false, idempotencyKey: single },
      { maxTaskBytes: 1e6 },
    );
    expect(await kept.failureLog(sid)).toEqual([]);

    // resultTtlMs 0 keeps everything.
    const c = (
      await admit(forever, queues, { requests: [requests[0]!], batch: false }, { maxTaskBytes: 1e6 })
    ).ids[0]!;
    const metaC = (await forever.get(c))!.meta;
    expect(await forever.finalize(metaC, resultFor(c, "completed"), Date.now())).toBe(true);
    expect(await pttl(forever.keys.rollout(c))).toBe(-1);
    // A late failure logged with retention off for a rollout gone (expired, finalized by a release
    // with retention) leaves no log behind: there is no rollout to expire it with.
    await forever.logFailure(first.ids[0]!, failure);
    expect(await redis.exists(forever.keys.failures(first.ids[0]!))).toBe(0);
  });

  it("retention is the admitting process's (the dispatcher's, which serves the results), whatever the finalizing worker's FLEET_RESULT_TTL_S says", async () => {
    const dispatcherKeeps = new RolloutStore(redis, prefix, { resultTtlMs: 0 });
    const dispatcherMinute = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const workerWeek = new RolloutStore(redis, prefix); // the default: 7 days
    const workerKeeps = new RolloutStore(redis, prefix, { resultTtlMs: 0 });
    const request = { task, agent: { harness: "oracle" as const, sandbox: "borrow" as const } };
    const failure = SANDBOX_LOST;
    // Kept for good by the dispatcher's word; the worker's week (its failure-log append included) is not applied.
    const [kept] = (
      await admit(dispatcherKeeps, queues, { requests: [request], batch: false }, { maxTaskBytes: 1e6 })
    ).ids as [string];
    await workerWeek.logFailure(kept, failure);
    expect(
      await workerWeek.finalize((await workerWeek.get(kept))!.meta, resultFor(kept, "completed"), Date.now()),
    ).toBe(true);
    expect(await redis.pttl(workerWeek.keys.rollout(kept))).toBe(-1);
    expect(await redis.pttl(workerWeek.keys.failures(kept))).toBe(-1);
    // A minute by the dispatcher's word, though the worker keeps everything.
    const [minute] = (
      await admit(dispatcherMinute, queues, { requests: [request], batch: false }, { maxTaskBytes: 1e6 })
    ).ids as [string];
    expect(
      await workerKeeps.finalize(
        (await workerKeeps.get(minute))!.meta,
        resultFor(minute, "completed"),
        Date.now(),
      ),
    ).toBe(true);
    expect(await redis.pttl(workerKeeps.keys.rollout(minute))).toBeGreaterThan(50_000);
    expect(await redis.pttl(workerKeeps.keys.rollout(minute))).toBeLessThanOrEqual(60_000);
    // A failure logged after that finalize by the worker keeping everything (its first: finalize
    // had no log to cut) goes with the rollout, not never.
    await workerKeeps.logFailure(minute, failure);
    expect(await redis.pttl(workerKeeps.keys.failures(minute))).toBeGreaterThan(50_000);
    expect(await redis.pttl(workerKeeps.keys.failures(minute))).toBeLessThanOrEqual(60_000);
  });

  it.each([
    ["an hour", 3_600_000],
    ["for good", 0],
  ] as const)(
    "a batch outlives each of its rollouts: one admitted by a dispatcher keeping results %s, finished first, keeps it past the minute of the one that finished last",
    async (_, longest) => {
      const long = new RolloutStore(redis, prefix, { resultTtlMs: longest });
      const minute = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
      const key = `mixed-${longest}-${Date.now()}`;
      const requests = Array.from({ length: 2 }, () => ({
        task,
        agent: { harness: "oracle" as const, sandbox: "borrow" as const },
      }));
      const submit = (s: RolloutStore) =>
        admit(s, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 });
      // One dispatcher recorded the first rollout and died (a rolling restart); the client's replay
      // reached another, of a shorter retention, which admitted the second.
      const dying = Object.create(long) as RolloutStore;
      dying.admit = async (metas, now) => {
        await long.admit(metas.slice(0, 1), now);
        throw new Error("the dispatcher died");
      };
      await expect(submit(dying)).rejects.toThrow("the dispatcher died");
      const { batchId, ids } = await submit(minute);
      const [a, b] = ids as [string, string];
      for (const id of [a, b]) {
        const m = (await minute.get(id))!.meta;
        expect(await minute.finalize(m, { ...resultFor(id, "completed"), batchId }, Date.now())).toBe(true);
      }
      const kept = longest === 0 ? -1 : longest;
      if (longest === 0) expect(await redis.pttl(minute.keys.rollout(a))).toBe(-1);
      else expect(await redis.pttl(minute.keys.rollout(a))).toBeGreaterThan(longest - 10_000);
      expect(await redis.pttl(minute.keys.rollout(b))).toBeLessThanOrEqual(60_000);
      for (const k of [
        minute.keys.batch(batchId!),
        minute.keys.batchIds(batchId!),
        minute.keys.batchDone(batchId!),
      ]) {
        const pttl = await redis.pttl(k);
        if (kept === -1) expect(pttl).toBe(-1);
        else expect(pttl).toBeGreaterThan(kept - 10_000);
      }
    },
  );

  it("an admission cut short after recording some of its rollouts is noted as under way with them; a replay once those finished admits the rest (no 409) and finishes it", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const key = `cut-${Date.now()}`;
    const requests = Array.from({ length: 5 }, () => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    const submit = (s: RolloutStore) =>
      admit(s, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 });
    // The dispatcher recorded the batch and its first 2 rollouts, then died: no seeds enqueued.
    const dying = Object.create(kept) as RolloutStore;
    dying.admit = async (metas, now) => {
      await kept.admit(metas.slice(0, 2), now);
      throw new Error("the dispatcher died");
    };
    await expect(submit(dying)).rejects.toThrow("the dispatcher died");
    const ids = rolloutIds(5, key, "batch");
    const batchId = batchIdFor(ids);
    const member = `b:${batchId}`;
    const noted = await kept.admissionsBefore(Date.now() + 1, 1000);
    expect(noted.map((a) => a.admission)).toContain(member);
    // The janitor removes only the note it read: one a live admission refreshed stays.
    const score = noted.find((a) => a.admission === member)!.score;
    await redis.zadd(kept.keys.admitting(), score + 1, member);
    await kept.admissionDone(member, score);
    expect(await redis.zscore(kept.keys.admitting(), member)).toBe(String(score + 1));
    expect(await kept.unseededOf(member)).toEqual(ids.slice(0, 2));
    // A record Redis cannot read is an error, never taken for one that is gone.
    const record = kept.keys.rollout(ids[1]!);
    await redis.rename(record, `${record}:aside`);
    await redis.set(record, "not a hash");
    await expect(kept.unseededOf(member)).rejects.toThrow(/WRONGTYPE/);
    await redis.rename(`${record}:aside`, record);
    expect(await queues.queues.seed.getJob(`${ids[0]}.seed`)).toBeUndefined();
    // Its 2 rollouts ran out their deadline and were closed (the watchdog's): the batch looks finished.
    for (const id of ids.slice(0, 2)) {
      const m = (await kept.get(id))!.meta;
      expect(await kept.finalize(m, { ...resultFor(id, "masked"), batchId }, Date.now())).toBe(true);
    }
    expect(await kept.getBatch(batchId)).toMatchObject({ total: 2, done: 2 });
    expect(await redis.pttl(kept.keys.batch(batchId))).toBeGreaterThan(0);
    // The client's replay with its key admits the 3 never recorded, seeds them, and the batch lives on.
    const replay = await submit(kept);
    expect(replay.ids).toEqual(ids);
    expect(replay.created).toEqual(ids.slice(2));
    expect(await kept.getBatch(batchId)).toMatchObject({ total: 5, done: 2 });
    for (const k of [kept.keys.batch(batchId), kept.keys.batchIds(batchId), kept.keys.batchDone(batchId)]) {
      expect(await redis.pttl(k)).toBe(-1);
    }
    expect(await queues.queues.seed.getJob(`${ids[4]}.seed`)).toBeDefined();
    expect((await kept.admissionsBefore(Date.now() + 1, 1000)).map((a) => a.admission)).not.toContain(member);
    // A replay of a batch that finished whole still admits none of its expired rollouts again.
    for (const id of ids.slice(2)) {
      const m = (await kept.get(id))!.meta;
      await kept.finalize(m, { ...resultFor(id, "completed"), batchId }, Date.now());
    }
    await redis.del(kept.keys.rollout(ids[3]!));
    expect(await submit(kept).catch((e: unknown) => e)).toMatchObject({
      name: "AdmissionError",
      code: "conflict",
    });
    expect(await kept.get(ids[3]!)).toBeNull();
  });

  it("a replay of a batch cut short whose admitted rollouts finished and one of them expired is refused whole: nothing of it recorded, nothing left noted", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const key = `cut-expired-${Date.now()}`;
    const requests = Array.from({ length: 5 }, () => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    const dying = Object.create(kept) as RolloutStore;
    dying.admit = async (metas, now) => {
      await kept.admit(metas.slice(0, 2), now);
      throw new Error("the dispatcher died");
    };
    const submit = (s: RolloutStore) =>
      admit(s, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 });
    await expect(submit(dying)).rejects.toThrow("the dispatcher died");
    const ids = rolloutIds(5, key, "batch");
    const batchId = batchIdFor(ids);
    for (const id of ids.slice(0, 2)) {
      const m = (await kept.get(id))!.meta;
      await kept.finalize(m, { ...resultFor(id, "masked"), batchId }, Date.now());
    }
    await kept.admissionDone(`b:${batchId}`); // the janitor's
    await redis.del(kept.keys.rollout(ids[0]!)); // its retention ended first
    expect(await submit(kept).catch((e: unknown) => e)).toMatchObject({
      name: "AdmissionError",
      code: "conflict",
    });
    expect(await Promise.all(ids.slice(2).map((id) => kept.get(id)))).toEqual([null, null, null]);
    expect(await kept.getBatch(batchId)).toMatchObject({ total: 2, done: 2 });
    expect((await kept.admissionsBefore(Date.now() + 1, 1000)).map((a) => a.admission)).not.toContain(
      `b:${batchId}`,
    );
  });

  it("a replay finishes a batch admitted under an older, looser deadline bound (not a 422), and a batch made anew drops a finish-order list an older release left behind", async () => {
    const key = `old-bound-${Date.now()}`;
    // deadlineS 30: under today's bound for this task (10 + 10 + 8 + 10 = 38 s), over the old one.
    const requests = Array.from({ length: 3 }, () =>
      RolloutRequest.parse({ task, agent: { harness: "oracle" }, deadlineS: 30 }),
    );
    await expect(
      admit(store, queues, { requests, batch: true, idempotencyKey: `fresh-${key}` }, { maxTaskBytes: 1e6 }),
    ).rejects.toMatchObject({ code: "invalid" });
    // As an older release admitted it, cut short after 1 of its 3 rollouts.
    const ids = rolloutIds(3, key, "batch");
    const batchId = batchIdFor(ids);
    const canonical = requests.map((r) => canonicalJson(r));
    const metas = await prepareRollouts(
      store,
      requests,
      ids,
      batchId,
      { maxTaskBytes: 1e6, replay: true },
      canonical,
    );
    expect(await store.createBatch(batchId, sha256Hex(`[${canonical.join(",")}]`), Date.now())).toBeTruthy();
    await store.admit(metas.slice(0, 1), Date.now());
    const replay = await admit(
      store,
      queues,
      { requests, batch: true, idempotencyKey: key },
      { maxTaskBytes: 1e6 },
    );
    expect(replay.created).toEqual(ids.slice(1));

    // A finish-order list that outlived its batch (an older finalize set no expiry on it).
    const stale = `b-stale-${Date.now()}`;
    await redis.rpush(store.keys.batchDone(stale), "old-0", "old-1");
    expect(await store.createBatch(stale, "h", Date.now())).toBe("h");
    expect(await redis.exists(store.keys.batchDone(stale))).toBe(0);
    // One left without expiry beside a batch that has one: the cursor's read gives it the batch's.
    await redis.hset(store.keys.batch(stale), "total", "2");
    await redis.pexpire(store.keys.batch(stale), 60_000);
    await redis.rpush(store.keys.batchDone(stale), "r-0");
    expect(await store.batchDoneCount(stale)).toBe(1);
    expect(await redis.pttl(store.keys.batchDone(stale))).toBeGreaterThan(50_000);
  });

  it("a replay of a batch whose inline task is over a task bound lowered since (FLEET_MAX_TASK_BYTES, a restart) gets its batch back, finished, not a 413", async () => {
    const key = `old-task-bound-${Date.now()}`;
    const requests = Array.from({ length: 3 }, () =>
      RolloutRequest.parse({ task, agent: { harness: "oracle" } }),
    );
    const bytes = Buffer.byteLength(canonicalJson(TaskContent.parse(task)));
    // Admitted whole under the bound of its day; a new batch of it is over today's.
    const first = await admit(
      store,
      queues,
      { requests, batch: true, idempotencyKey: key },
      { maxTaskBytes: bytes },
    );
    expect(first.created).toEqual(first.ids);
    await expect(
      admit(
        store,
        queues,
        { requests, batch: true, idempotencyKey: `fresh-${key}` },
        { maxTaskBytes: bytes - 1 },
      ),
    ).rejects.toMatchObject({ code: "payload_too_large" });
    const replay = await admit(
      store,
      queues,
      { requests, batch: true, idempotencyKey: key },
      { maxTaskBytes: bytes - 1 },
    );
    expect(replay).toEqual({ ...first, created: [] });
  });

  it("dates an admission's note on the store's clock (the fleet's, Redis's in the apps), which the janitor compares with its own", async () => {
    const dated = new RolloutStore(redis, prefix, { now: () => 1_234_567 });
    const batchId = `b-dated-${Math.random().toString(36).slice(2, 8)}`;
    await dated.createBatch(batchId, "h", Date.now());
    try {
      expect(await redis.zscore(dated.keys.admitting(), admissionOf({ batchId }))).toBe("1234567");
    } finally {
      await dated.admissionDone(admissionOf({ batchId }));
    }
  });

  it("a batch cancelled while it is being admitted: the rollouts its admission records afterwards are recorded cancelled", async () => {
    const requests = Array.from({ length: 3 }, () => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    let batchId = "";
    const cancelling = Object.create(store) as RolloutStore;
    cancelling.admit = async (metas, now) => {
      batchId = metas[0]!.batchId!;
      const first = await store.admit(metas.slice(0, 1), now);
      // A cancel from another replica lands between two of the admission's chunks.
      expect(await store.cancelBatchAdmission(batchId, 1234)).toBe(true);
      const rest = await store.admit(metas.slice(1), now);
      return { ...rest, created: [...first.created, ...rest.created] };
    };
    const { ids } = await admit(cancelling, queues, { requests, batch: true }, { maxTaskBytes: 1e6 });
    const records = await Promise.all(ids.map((id) => store.get(id)));
    expect(records.map((r) => r!.cancelRequested)).toEqual([false, true, true]);
    // The cancel is noted under way (for the janitor, should its walker die), with its date.
    expect(await redis.zscore(store.keys.cancelling(), batchId)).toBe("1234");
    expect(await store.cancelBatchAdmission("b-no-such-batch", 1234)).toBe(false);
    expect(await redis.exists(store.keys.batch("b-no-such-batch"))).toBe(0);
    expect(await redis.zscore(store.keys.cancelling(), "b-no-such-batch")).toBeNull();
  });

  it("a batch's cancel goes on past a rollout whose status this release does not know (another release's): every rollout is asked to stop, the walk is done", async () => {
    const requests = Array.from({ length: 3 }, () => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    const { ids, batchId } = await admit(store, queues, { requests, batch: true }, { maxTaskBytes: 1e6 });
    await redis.hset(store.keys.rollout(ids[0]!), "status", "paused");
    expect(await cancelRollout(store, queues, ids[0]!, Date.now())).toMatchObject({
      kind: "cancelling",
      previous: "unreadable",
    });
    await expect(cancelBatch(store, queues, batchId!)).resolves.toBe(2);
    for (const id of ids) expect(await redis.hget(store.keys.rollout(id), "cancel"), id).toBe("1");
    expect(await redis.zscore(store.keys.cancelling(), batchId!)).toBeNull();
  });

  it("admission refuses metadata over MAX_METADATA_BYTES (422 at the API)", async () => {
    const digest = digestTask(task);
    await store.putTask(task, digest);
    const big = { tokens: Array.from({ length: 1000 }, (_, i) => 100_000 + i) };
    const err = await admit(
      store,
      queues,
      {
        requests: [{ task: { digest }, agent: { harness: "oracle" }, metadata: big }] as never,
        batch: false,
      },
      { maxTaskBytes: 1 << 20 },
    ).catch((e: unknown) => e);
    expect(err).toMatchObject({
      name: "AdmissionError",
      code: "invalid",
      details: { limit: MAX_METADATA_BYTES },
    });
    expect((err as Error).message).toMatch(/metadata is \d+ bytes of JSON, over the limit of 4096/);
  });

  it("a receipt is written once: a second seed that ran alongside the first replaces neither its receipt nor its sandbox entry", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const meta = (await store.get(id))!.meta;
    const entryFor = (receipt: ReturnType<typeof seedReceipt>) => seedEntry(id, receipt);
    const first = seedReceipt(id);
    expect(await store.saveReceipt(meta, "seed", first, "seeded", 5, { attach: entryFor(first) })).toBe(true);
    // The same receipt sent again (ioredis resends a command whose reply a reconnect lost): stored.
    expect(await store.saveReceipt(meta, "seed", first, "seeded", 5, { attach: entryFor(first) })).toBe(true);
    const second = { ...seedReceipt(id), handle: { ...first.handle, id: `c2-${id}`, name: `n2-${id}` } };
    expect(await store.storeReceipt(meta, "seed", second, "seeded", 6, { attach: entryFor(second) })).toBe(
      "taken",
    );
    expect((await store.get(id))!.receipts.seed?.handle.id).toBe(`c-${id}`);
    expect((await ledger.sandboxesOf(id)).resources?.handle?.id).toBe(`c-${id}`);
  });

  it("a seed's receipt is stored only by the delivery that began last (the seed fence), and a superseded one attaches nothing", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const meta = (await store.get(id))!.meta;
    const intent = { owner: "resources" as const, provider: "docker" as const, expirySlackMs: 0 };
    expect((await store.begin(id, "seed", 1, { intent, seedToken: "a" })).seedToken).toBe("a");
    await store.begin(id, "seed", 2, { intent, seedToken: "b" });
    // "a" sent again by ioredis (a reconnect lost its reply) takes nothing back.
    await store.begin(id, "seed", 1, { intent, seedToken: "a" });
    const first = seedReceipt(id);
    expect(
      await store.storeReceipt(meta, "seed", first, "seeded", 5, {
        attach: seedEntry(id, first),
        deliveryFence: { field: "sfence", token: "a" },
      }),
    ).toBe("superseded");
    expect((await store.get(id))!.receipts.seed).toBeUndefined();
    // The registry keeps the later delivery's intent.
    expect((await ledger.sandboxesOf(id)).resources?.handle).toBeNull();
    const second = { ...seedReceipt(id), handle: { ...first.handle, id: `c2-${id}`, name: `n2-${id}` } };
    expect(
      await store.storeReceipt(meta, "seed", second, "seeded", 6, {
        attach: seedEntry(id, second),
        deliveryFence: { field: "sfence", token: "b" },
      }),
    ).toBe("stored");
    expect((await ledger.sandboxesOf(id)).resources?.handle?.id).toBe(`c2-${id}`);
  });

  it("a receipt with a next stage enqueues it in the same write; attach keeps the handle even when closed", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const id = ids[0]!;
    const meta = (await store.get(id))!.meta;
    const receipt = seedReceipt(id);
    const entry = seedEntry(id, receipt);
    const saved = await store.saveReceipt(meta, "seed", receipt, "seeded", 5, {
      attach: entry,
      next: { queues, stage: "run" },
    });
    expect(saved).toBe(true);
    expect((await store.get(id))!.receipts.seed?.handle.id).toBe(`c-${id}`);
    expect((await queues.queues.run.getJob(`${id}.run`))?.data).toEqual({ rolloutId: id });
    expect((await ledger.sandboxesOf(id)).resources?.handle?.id).toBe(`c-${id}`);

    // Closed meanwhile: the receipt is refused, but the handle is stored for whoever destroys it.
    const late = (await admitOne()).ids[0]!;
    const lateMeta = (await store.get(late))!.meta;
    await store.tombstone(late);
    const refused = await store.saveReceipt(lateMeta, "seed", seedReceipt(late), "seeded", 5, {
      attach: { ...entry, key: sandboxKey(late, "resources"), rolloutId: late },
      next: { queues, stage: "run" },
    });
    expect(refused).toBe(false);
    // The entry's handle itself: `?.handle` of a missing entry is undefined, which `not.toBeNull()` let pass.
    expect((await ledger.sandboxesOf(late)).resources?.handle?.id).toBe(`c-${id}`);
  });

  it("a tombstone for a rollout with no record (never admitted, or its retention ended) writes nothing", async () => {
    const id = `gone-${Date.now()}`;
    expect(await store.tombstone(id)).toBe("");
    // A bare hash there (no status, no TTL) would stay for good.
    expect(await redis.exists(store.keys.rollout(id))).toBe(0);
  });

  it("an intent is refused once the rollout is tombstoned, before it is terminal (rule 9: nothing made after a close began)", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const id = ids[0]!;
    await store.tombstone(id);
    expect((await store.get(id))!.status).not.toBe("completed");
    const entry = { ...sandboxEntry(id), key: sandboxKey(id, "agent"), owner: "agent" as const };
    expect(await ledger.recordIntent(entry)).toBe("closed");
    expect(await redis.hexists(store.keys.sandboxes(), sandboxKey(id, "agent"))).toBe(0);
  });

  it("an intent recorded again (a re-delivered run making its own sandbox) dates a handle-less entry from now, and leaves one with a handle as it is", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const id = ids[0]!;
    const entry = { ...sandboxEntry(id, "agent"), handle: null, createdAt: 1_000 };
    expect(await ledger.recordIntent(entry)).toBe("ok");
    // The earlier attempt never got a handle: the grace before "never created" counts from now.
    expect(await ledger.recordIntent({ ...entry, createdAt: 2_000 })).toBe("ok");
    expect((await ledger.getSandbox(entry.key))?.createdAt).toBe(2_000);
    // One that got its handle is the earlier attempt's sandbox: kept as it is.
    const handle = {
      provider: "docker" as const,
      endpoint: "unix:///var/run/docker.sock",
      id: `c-${id}`,
      name: `n-${id}`,
      rolloutId: id,
      owner: "agent" as const,
      volumes: [],
    };
    await redis.hset(
      store.keys.sandboxes(),
      entry.key,
      JSON.stringify({ ...entry, handle, createdAt: 2_000 }),
    );
    expect(await ledger.recordIntent({ ...entry, createdAt: 3_000 })).toBe("ok");
    expect(await ledger.getSandbox(entry.key)).toMatchObject({ handle: { id: handle.id }, createdAt: 2_000 });
  });

  it("close's begin reads the sandbox entries; finalize forgets the confirmed ones even when not first", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const id = ids[0]!;
    const entry = sandboxEntry(id);
    const { key } = entry;
    expect(await ledger.recordIntent(entry)).toBe("ok");
    await ledger.recordFailure(entry, "boom", 10);
    const begun = await store.begin(id, "close", 20);
    expect(begun.sandboxes).toEqual({ resources: entry, agent: null, unreadable: [] });
    const meta = begun.record!.meta;
    expect(await store.finalize(meta, resultFor(id, "completed"), 30)).toBe(true);
    expect(await ledger.isPending(id)).toBe(true);
    // A second closer's destroy confirmed it: its finalize loses the race but still forgets it.
    expect(await store.finalize(meta, resultFor(id, "completed"), 31, undefined, [key])).toBe(false);
    expect(await ledger.isPending(id)).toBe(false);
    expect(await ledger.size()).toBe(0);
    expect((await ledger.sandboxesOf(id)).resources).toBeNull();
  });

  it("a pending teardown is confirmed in the result by whichever comes last: the ledger's confirm (a sandbox's, a network's) or finalize", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const entryOf = sandboxEntry;
    const pendingResult = (id: string) => ({
      ...resultFor(id, "completed"),
      teardown: "pending" as const,
      failureKind: "teardown_failed" as const,
    });

    // Finalized pending with both sandboxes on the ledger; the last confirm edits the result.
    const a = (await admitOne()).ids[0]!;
    await ledger.schedule(entryOf(a, "resources"), 10);
    await ledger.schedule(entryOf(a, "agent"), 10);
    const metaA = (await store.begin(a, "close", 20)).record!.meta;
    expect(await store.finalize(metaA, pendingResult(a), 30)).toBe(true);
    await ledger.confirm(entryOf(a, "resources"));
    expect(await store.getResult(a)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    await ledger.confirm(entryOf(a, "agent"));
    expect(await store.getResult(a)).toMatchObject({ teardown: "confirmed", failureKind: null, reward: 1 });

    // The ledger was emptied (the janitor destroyed it) while close ran: finalize stores it confirmed.
    const b = (await admitOne()).ids[0]!;
    await ledger.schedule(entryOf(b, "agent"), 10);
    const metaB = (await store.begin(b, "close", 20)).record!.meta;
    await ledger.confirm(entryOf(b, "agent"));
    expect(await store.getResult(b)).toBeNull();
    expect(await store.finalize(metaB, pendingResult(b), 30)).toBe(true);
    expect(await store.getResult(b)).toMatchObject({ teardown: "confirmed", failureKind: null, reward: 1 });

    // Still on the ledger at finalize: pending stands.
    const c = (await admitOne()).ids[0]!;
    await ledger.schedule(entryOf(c, "resources"), 10);
    const metaC = (await store.begin(c, "close", 20)).record!.meta;
    expect(await store.finalize(metaC, pendingResult(c), 30)).toBe(true);
    expect(await store.getResult(c)).toMatchObject({ teardown: "pending" });
    await ledger.confirm(entryOf(c, "resources"));
    expect(await store.getResult(c)).toMatchObject({ teardown: "confirmed" });

    // Two closers: B's destroy failed and it finalized pending; A's destroy then succeeded, and
    // its finalize loses the race but confirms the teardown it took off the ledger.
    const d = (await admitOne()).ids[0]!;
    const metaD = (await store.begin(d, "close", 20)).record!.meta;
    await ledger.recordFailure(entryOf(d, "resources"), "removal in progress", 25);
    expect(await store.finalize(metaD, pendingResult(d), 30)).toBe(true);
    const confirmedByA = resultFor(d, "completed");
    expect(await store.finalize(metaD, confirmedByA, 31, undefined, [sandboxKey(d, "resources")])).toBe(
      false,
    );
    expect(await store.getResult(d)).toMatchObject({ teardown: "confirmed", failureKind: null, reward: 1 });
    expect(await ledger.size()).toBe(0);

    // A gateway network removal left to retry keeps it pending, through a sandbox's confirm and
    // through finalize, until the retry is done; whichever comes last confirms it.
    const g = (await admitOne()).ids[0]!;
    await ledger.schedule(entryOf(g, "agent"), 10);
    await ledger.networkRemovalFailed(g, 15);
    const metaG = (await store.begin(g, "close", 20)).record!.meta;
    expect(await store.finalize(metaG, pendingResult(g), 30)).toBe(true);
    await ledger.confirm(entryOf(g, "agent"));
    expect(await store.getResult(g)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    await ledger.networkRemoved(g);
    expect(await store.getResult(g)).toMatchObject({ teardown: "confirmed", failureKind: null, reward: 1 });
    const h = (await admitOne()).ids[0]!;
    await ledger.networkRemovalFailed(h, 15);
    const metaH = (await store.begin(h, "close", 20)).record!.meta;
    expect(await store.finalize(metaH, pendingResult(h), 30)).toBe(true);
    expect(await store.getResult(h)).toMatchObject({ teardown: "pending" });
    await ledger.networkRemoved(h);
    expect(await store.getResult(h)).toMatchObject({ teardown: "confirmed", failureKind: null });
    // Removed (by the janitor) before close finalized: finalize stores it confirmed.
    const k = (await admitOne()).ids[0]!;
    await ledger.networkRemovalFailed(k, 15);
    const metaK = (await store.begin(k, "close", 20)).record!.meta;
    await ledger.networkRemoved(k);
    expect(await store.finalize(metaK, pendingResult(k), 30)).toBe(true);
    expect(await store.getResult(k)).toMatchObject({ teardown: "confirmed", failureKind: null });

    // The edit is the top-level fields': the same names inside metadata are the user's, echoed as given.
    const infra = { infra: { teardown: "pending", failureKind: "teardown_failed" } };
    const e = (await admitOne()).ids[0]!;
    const metaE = (await store.begin(e, "close", 20)).record!.meta;
    expect(await store.finalize(metaE, { ...resultFor(e, "completed"), metadata: infra }, 30)).toBe(true);
    expect(await store.getResult(e)).toMatchObject({
      teardown: "confirmed",
      failureKind: null,
      metadata: infra,
    });
    const f = (await admitOne()).ids[0]!;
    await ledger.schedule(entryOf(f, "agent"), 10);
    const metaF = (await store.begin(f, "close", 20)).record!.meta;
    const timedOut = {
      ...resultFor(f, "completed"),
      teardown: "pending" as const,
      failureKind: "agent_timeout" as const,
      metadata: infra,
    };
    expect(await store.finalize(metaF, timedOut, 30)).toBe(true);
    await ledger.confirm(entryOf(f, "agent"));
    expect(await store.getResult(f)).toMatchObject({
      teardown: "confirmed",
      failureKind: "agent_timeout",
      metadata: infra,
    });
  });

  it("finalizeStored answers the result as stored when finalize edited its teardown (what close's metrics count), null for a closer that lost", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const finalizeAndRead = async (id: string, result: RolloutResult) => {
      const meta = (await store.begin(id, "close", 20)).record!.meta;
      const stored = await store.finalizeStored(meta, result, 30);
      expect(stored).toEqual(await store.getResult(id));
      return stored;
    };
    // Composed confirmed, but a sandbox of the rollout is on the ledger: stored pending.
    const a = (await admitOne()).ids[0]!;
    await ledger.schedule(sandboxEntry(a, "agent"), 10);
    expect(await finalizeAndRead(a, resultFor(a, "completed"))).toMatchObject({
      teardown: "pending",
      failureKind: "teardown_failed",
      reward: 1,
    });
    // Composed pending, but the ledger was emptied meanwhile: stored confirmed.
    const b = (await admitOne()).ids[0]!;
    const pending = {
      ...resultFor(b, "completed"),
      teardown: "pending" as const,
      failureKind: "teardown_failed" as const,
    };
    expect(await finalizeAndRead(b, pending)).toMatchObject({ teardown: "confirmed", failureKind: null });
    // Neither: stored as given. A masked result keeps its own failure kind when turned pending.
    const c = (await admitOne()).ids[0]!;
    expect(await finalizeAndRead(c, resultFor(c, "completed"))).toEqual(resultFor(c, "completed"));
    const d = (await admitOne()).ids[0]!;
    await ledger.schedule(sandboxEntry(d, "resources"), 10);
    const masked = { ...resultFor(d, "masked"), failureKind: "sandbox_lost" as const };
    expect(await finalizeAndRead(d, masked)).toMatchObject({
      teardown: "pending",
      failureKind: "sandbox_lost",
    });
    // Another closer's finalize: not this call's to count.
    const meta = (await store.begin(c, "close", 40)).record!.meta;
    expect(await store.finalizeStored(meta, resultFor(c, "completed"), 50)).toBeNull();
    await ledger.confirm(sandboxEntry(a, "agent"));
    await ledger.confirm(sandboxEntry(d, "resources"));
  });

  it("a destroy that found no sandbox forgets only a handle-less entry: one that got its handle meanwhile stays, through the ledger's confirm and finalize's", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const handleOf = (id: string) => ({
      provider: "docker" as const,
      endpoint: "unix:///var/run/docker.sock",
      id: `c-${id}`,
      name: `n-${id}`,
      rolloutId: id,
      owner: "resources" as const,
      volumes: [],
    });
    // The janitor read a handle-less intent and found no sandbox by label (null); meanwhile the
    // attempt still creating made one and attached its handle (its own destroy then failed).
    const a = (await admitOne()).ids[0]!;
    const intentA = sandboxEntry(a);
    await ledger.recordIntent(intentA);
    await ledger.recordFailure(intentA, "sandbox intent without a handle yet", 10);
    const metaA = (await store.begin(a, "close", 20)).record!.meta;
    const pendingResult = { ...resultFor(a, "completed"), teardown: "pending" as const };
    expect(await store.finalize(metaA, { ...pendingResult, failureKind: "teardown_failed" }, 30)).toBe(true);
    const madeA = { ...intentA, handle: handleOf(a) };
    await ledger.attachHandle(madeA);
    await ledger.recordFailure(madeA, "daemon blip", 40);
    await ledger.confirm(intentA, null);
    expect((await ledger.getSandbox(intentA.key))?.handle?.id).toBe(`c-${a}`);
    expect(await ledger.isPending(a)).toBe(true);
    expect(await store.getResult(a)).toMatchObject({ teardown: "pending" });

    // The same at close (its confirm folded into finalize): the sandbox attached meanwhile stays.
    const b = (await admitOne()).ids[0]!;
    const intentB = sandboxEntry(b);
    await ledger.recordIntent(intentB);
    const metaB = (await store.begin(b, "close", 20)).record!.meta;
    await ledger.attachHandle({ ...intentB, handle: handleOf(b) });
    const confirmedB = [{ key: intentB.key, destroyed: null }];
    expect(await store.finalize(metaB, resultFor(b, "completed"), 30, undefined, confirmedB)).toBe(true);
    expect((await ledger.getSandbox(intentB.key))?.handle?.id).toBe(`c-${b}`);
    expect(await store.getResult(b)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    // Still handle-less at the confirm: forgotten, and the teardown confirmed.
    const c = (await admitOne()).ids[0]!;
    const intentC = sandboxEntry(c);
    await ledger.recordIntent(intentC);
    const metaC = (await store.begin(c, "close", 20)).record!.meta;
    const confirmedC = [{ key: intentC.key, destroyed: null }];
    expect(await store.finalize(metaC, resultFor(c, "completed"), 30, undefined, confirmedC)).toBe(true);
    expect(await ledger.getSandbox(intentC.key)).toBeNull();
    expect(await store.getResult(c)).toMatchObject({ teardown: "confirmed", failureKind: null });
    // The sandboxes attached meanwhile, once destroyed, confirm their rollouts' teardowns.
    await ledger.confirm(intentA, handleOf(a));
    await ledger.confirm(intentB, handleOf(b));
    expect(await store.getResult(a)).toMatchObject({ teardown: "confirmed", failureKind: null });
    expect(await store.getResult(b)).toMatchObject({ teardown: "confirmed", failureKind: null });
  });

  it("an orphan the sweep took under a live rollout's key: a close confirming another sandbox there finalizes pending until the orphan's destroy confirms; one confirming the same sandbox takes the sweep's entry with it", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    // Another sandbox (one this rollout's registry sandbox replaced) taken by the sweep.
    const a = (await admitOne()).ids[0]!;
    const regA = { ...sandboxEntry(a), handle: dockerHandle(a, "resources", "y") };
    await ledger.recordIntent(sandboxEntry(a));
    await ledger.attachHandle(regA);
    const orphanA = { ...regA, handle: dockerHandle(a, "resources", "x") };
    const tookA = await ledger.takeNew(orphanA, 25);
    expect("taken" in tookA).toBe(true);
    const metaA = (await store.begin(a, "close", 20)).record!.meta;
    expect(
      await store.finalize(metaA, resultFor(a, "completed"), 30, undefined, [
        { key: regA.key, destroyed: regA.handle },
      ]),
    ).toBe(true);
    expect(await store.getResult(a)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    // The janitor died in the orphan's destroy; the ledger step's retry confirms it later.
    await ledger.confirm(orphanA, orphanA.handle);
    expect(await store.getResult(a)).toMatchObject({ teardown: "confirmed", failureKind: null });
    expect(await ledger.isPending(a)).toBe(false);
    expect(await ledger.getSandbox(regA.key)).toBeNull();

    // The same sandbox (expired), taken by the sweep while the close destroys it too.
    const b = (await admitOne()).ids[0]!;
    const regB = { ...sandboxEntry(b), handle: dockerHandle(b, "resources", "y") };
    await ledger.recordIntent(sandboxEntry(b));
    await ledger.attachHandle(regB);
    const tookB = await ledger.takeNew(regB, 25);
    if (!("taken" in tookB)) throw new Error("not taken");
    const metaB = (await store.begin(b, "close", 20)).record!.meta;
    expect(
      await store.finalize(metaB, resultFor(b, "completed"), 30, undefined, [
        { key: regB.key, destroyed: regB.handle },
      ]),
    ).toBe(true);
    expect(await store.getResult(b)).toMatchObject({ teardown: "confirmed", failureKind: null });
    expect(await ledger.isPending(b)).toBe(false);
    // The sweep's destroy then fails (the removal was the close's): nothing comes back.
    expect(
      await ledger.recordFailure(regB, "removal already in progress", 40, undefined, { taken: tookB.taken }),
    ).toBeNull();
    expect(await ledger.isPending(b)).toBe(false);
    // A sweep that took it only after the finalize: its confirm (alreadyGone) leaves it as it was.
    const late = await ledger.takeNew(regB, 50);
    expect("taken" in late).toBe(true);
    await ledger.confirm(regB, regB.handle);
    expect(await ledger.isPending(b)).toBe(false);
    expect(await store.getResult(b)).toMatchObject({ teardown: "confirmed", failureKind: null });
  });

  it("a sandbox attached after its rollout was finalized (the close gave up on its handle-less intent while the create ran) turns the result's teardown pending, until its destroy is confirmed", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const intent = sandboxEntry(id, "agent");
    await ledger.recordIntent(intent);
    const meta = (await store.begin(id, "close", 20)).record!.meta;
    const confirmed = [{ key: intent.key, destroyed: null }];
    expect(await store.finalize(meta, resultFor(id, "completed"), 30, undefined, confirmed)).toBe(true);
    expect(await store.getResult(id)).toMatchObject({ teardown: "confirmed", failureKind: null });
    const made = { ...intent, handle: dockerHandle(id, "agent", "6") };
    // The create returns: closed meanwhile, so its creator destroys it; until then it lives.
    expect(await ledger.attachHandle(made)).toBe(true);
    expect(await store.getResult(id)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    await ledger.recordFailure(made, "daemon blip", 40);
    expect(await ledger.isPending(id)).toBe(true);
    expect(await store.getResult(id)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    await ledger.confirm(made, made.handle);
    expect(await store.getResult(id)).toMatchObject({ teardown: "confirmed", failureKind: null });
  });

  it("a finalize that finds a sandbox left stores the teardown pending as result.ts composes it: a completed result says teardown_failed, its close receipt says pending", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const handle = (id: string) => ({
      provider: "docker" as const,
      endpoint: "unix:///var/run/docker.sock",
      id: `c2-${id}`,
      name: `n2-${id}`,
      rolloutId: id,
      owner: "resources" as const,
      volumes: [],
    });
    const closeReceipt = { cleanup: null, teardown: "confirmed" as const, at: 30 };
    // A sandbox registered with a handle that this close did not destroy (it replaced the one it did).
    const finalizeWithOneLeft = async (result: (id: string) => RolloutResult) => {
      const id = (await admitOne()).ids[0]!;
      await ledger.recordIntent(sandboxEntry(id));
      await ledger.attachHandle({ ...sandboxEntry(id), handle: handle(id) });
      const meta = (await store.begin(id, "close", 20)).record!.meta;
      expect(await store.finalize(meta, result(id), 30, closeReceipt)).toBe(true);
      return id;
    };
    const completed = await finalizeWithOneLeft((id) => resultFor(id, "completed"));
    expect(await store.getResult(completed)).toMatchObject({
      status: "completed",
      reward: 1,
      teardown: "pending",
      failureKind: "teardown_failed",
    });
    expect((await store.get(completed))?.receipts.close).toMatchObject({ teardown: "pending" });
    // Not over a failure kind the result already has.
    const timedOut = await finalizeWithOneLeft((id) => ({
      ...resultFor(id, "completed"),
      failureKind: "agent_timeout",
    }));
    expect(await store.getResult(timedOut)).toMatchObject({
      teardown: "pending",
      failureKind: "agent_timeout",
    });
    const masked = await finalizeWithOneLeft((id) => resultFor(id, "masked"));
    expect(await store.getResult(masked)).toMatchObject({
      teardown: "pending",
      failureKind: "provider_unavailable",
    });
    // Its destroy confirmed later: confirmed, and the teardown_failed it was given goes with it.
    for (const id of [completed, timedOut, masked]) await ledger.confirm(sandboxEntry(id), handle(id));
    expect(await store.getResult(completed)).toMatchObject({ teardown: "confirmed", failureKind: null });

    // The same finalize sent again (a reconnect lost its reply) hands back what is stored, as the
    // first did: pending while the sandbox is left, confirmed once its destroy is.
    const again = (await admitOne()).ids[0]!;
    await ledger.recordIntent(sandboxEntry(again));
    await ledger.attachHandle({ ...sandboxEntry(again), handle: handle(again) });
    const meta = (await store.begin(again, "close", 20)).record!.meta;
    const send = () =>
      store.finalizeStored(meta, resultFor(again, "completed"), 30, closeReceipt, [], "call-1");
    const pending = { teardown: "pending", failureKind: "teardown_failed" };
    expect(await send()).toMatchObject(pending);
    expect(await send()).toMatchObject(pending);
    await ledger.confirm(sandboxEntry(again), handle(again));
    expect(await send()).toMatchObject({ teardown: "confirmed", failureKind: null });
    expect(await store.getResult(again)).toMatchObject({ teardown: "confirmed", failureKind: null });
  });

  it("a gateway network's removal, done last, does not mark the teardown confirmed while a sandbox of the rollout is registered with a handle", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const entry = sandboxEntry(id, "agent");
    const handle = {
      provider: "docker" as const,
      endpoint: "unix:///var/run/docker.sock",
      id: `c4-${id}`,
      name: `n4-${id}`,
      rolloutId: id,
      owner: "agent" as const,
      volumes: [],
    };
    await ledger.recordIntent(entry);
    await ledger.networkRemovalFailed(id, 15);
    const meta = (await store.begin(id, "close", 20)).record!.meta;
    // A sandbox that replaced the one close destroyed, attached after close read the entries.
    await ledger.attachHandle({ ...entry, handle });
    expect(await store.finalize(meta, resultFor(id, "completed"), 30)).toBe(true);
    expect(await store.getResult(id)).toMatchObject({ teardown: "pending" });
    await ledger.networkRemoved(id);
    expect(await store.getResult(id)).toMatchObject({ teardown: "pending", failureKind: "teardown_failed" });
    await ledger.confirm(entry, handle);
    expect(await store.getResult(id)).toMatchObject({ teardown: "confirmed", failureKind: null });
  });

  it("a confirm whose key holds a torn entry (a registry or ledger entry that does not parse) forgets it rather than failing", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const entry = sandboxEntry(id);
    await redis.hset(ledger.keys.sandboxes(), entry.key, '{"key":');
    await redis.hset(ledger.keys.teardownEntries(), entry.key, "{torn");
    await redis.zadd(ledger.keys.teardownDue(), 10, entry.key);
    const handle = {
      provider: "docker" as const,
      endpoint: "unix:///var/run/docker.sock",
      id: `c3-${id}`,
      name: `n3-${id}`,
      rolloutId: id,
      owner: "resources" as const,
      volumes: [],
    };
    await ledger.confirm(entry, handle);
    expect(await redis.hexists(ledger.keys.sandboxes(), entry.key)).toBe(0);
    expect(await redis.hexists(ledger.keys.teardownEntries(), entry.key)).toBe(0);
    expect(await redis.zscore(ledger.keys.teardownDue(), entry.key)).toBeNull();
  });

  it("a failed destroy whose key holds a torn ledger entry is recorded over it, with a backoff, not thrown", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const entry = sandboxEntry(id);
    for (const torn of ["{torn", '{"key":"x","attempts":"many"}']) {
      await redis.hset(ledger.keys.teardownEntries(), entry.key, torn);
      await redis.zadd(ledger.keys.teardownDue(), 10, entry.key);
      const recorded = (await ledger.recordFailure(entry, "device busy", 1_000, () => 1))!;
      expect(recorded).toMatchObject({
        key: entry.key,
        attempts: 1,
        lastError: "device busy",
        firstFailedAt: 1_000,
      });
      expect(recorded.dueAt).toBeGreaterThan(1_000);
      expect(JSON.parse((await redis.hget(ledger.keys.teardownEntries(), entry.key))!)).toEqual(recorded);
      expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(recorded.dueAt);
    }
    await ledger.confirm(entry);
    expect(await ledger.size()).toBe(0);
  });

  it("a due entry that does not parse is put off only while it is still the text read: a failure recorded over it meanwhile keeps its backoff, a confirm is not undone", async () => {
    // The janitor's read, on a connection of its own that runs `between` once it has read the
    // entries: a close's write landing between the janitor's read and its put-off.
    const racy = createRedis(REDIS_URL);
    let between: () => Promise<unknown> = async () => undefined;
    const real = racy.hmgetBuffer.bind(racy);
    vi.spyOn(racy, "hmgetBuffer").mockImplementation((async (...args: Parameters<typeof racy.hmget>) => {
      const read = await real(...args);
      await between();
      return read;
    }) as typeof racy.hmgetBuffer);
    try {
      const janitorLedger = new TeardownLedger(racy, prefix);
      const ledger = new TeardownLedger(redis, prefix);
      const id = (await admitOne()).ids[0]!;
      const entry = sandboxEntry(id);
      const mine = (due: { key: string }[]) => due.filter((e) => e.key === entry.key);
      const now = 5_000_000;
      await redis.hset(ledger.keys.teardownEntries(), entry.key, "{torn");
      await redis.zadd(ledger.keys.teardownDue(), 10, entry.key);
      // A close's destroy fails meanwhile: its failure is recorded over the torn entry, due soon.
      let recorded: Awaited<ReturnType<typeof ledger.recordFailure>> = null;
      between = async () => {
        between = async () => undefined;
        recorded = await ledger.recordFailure(entry, "device busy", now, () => 1);
      };
      expect(mine(await janitorLedger.due(now, 1000, () => undefined))).toEqual([]);
      expect(recorded).not.toBeNull();
      // Retried on its backoff, not an hour on (the put-off meant for the torn text).
      expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(recorded!.dueAt);
      expect(mine(await ledger.due(recorded!.dueAt, 1000))).toHaveLength(1);

      // Torn again, and confirmed meanwhile: nothing is brought back.
      await redis.hset(ledger.keys.teardownEntries(), entry.key, "{torn");
      await redis.zadd(ledger.keys.teardownDue(), 10, entry.key);
      between = async () => {
        between = async () => undefined;
        await ledger.confirm(entry);
      };
      expect(mine(await janitorLedger.due(now, 1000, () => undefined))).toEqual([]);
      expect(await redis.hget(ledger.keys.teardownEntries(), entry.key)).toBeNull();
      expect(await redis.zscore(ledger.keys.teardownDue(), entry.key)).toBeNull();
    } finally {
      racy.disconnect();
    }
  });

  it("a due entry torn in the middle of a character (its bytes no UTF-8) is put off all the same: never left due, first in every pass's read", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const entry = sandboxEntry(id);
    // `{"lastError":"é` cut after the first of é's two bytes.
    const torn = Buffer.concat([Buffer.from('{"lastError":"'), Buffer.from("é").subarray(0, 1)]);
    await redis.hset(ledger.keys.teardownEntries(), entry.key, torn);
    await redis.zadd(ledger.keys.teardownDue(), 10, entry.key);
    const told: string[] = [];
    const now = 5_000_000;
    const due = await ledger.due(now, 1000, (key) => told.push(key));
    expect(due.filter((e) => e.key === entry.key)).toEqual([]);
    expect(told).toEqual([entry.key]);
    expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(now + INVALID_PUT_OFF_MS);
    // Kept as it was, for a release that can read it.
    expect(await redis.hgetBuffer(ledger.keys.teardownEntries(), entry.key)).toEqual(torn);
    await redis.hdel(ledger.keys.teardownEntries(), entry.key);
    await redis.zrem(ledger.keys.teardownDue(), entry.key);
  });

  it("the teardown ledger backs off and forgets confirmed entries", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const entry = sandboxEntry(ids[0]!);
    const now = 1_000_000;
    expect(await ledger.oldestSince()).toBeNull();
    const first = (await ledger.recordFailure(entry, "boom", now, () => 1))!;
    const second = (await ledger.recordFailure(entry, "boom again", now + 500, () => 1))!;
    // Waiting since its first failure, however often it failed since; the oldest entry counts.
    const other = sandboxEntry(ids[0]!, "agent");
    await ledger.recordFailure(other, "boom", now + 100, () => 1);
    expect(await ledger.oldestSince()).toBe(now);
    await ledger.confirm(other);
    expect(second.attempts).toBe(2);
    expect(second.dueAt - now).toBeGreaterThan(first.dueAt - now);
    expect(await ledger.due(now + 500)).toHaveLength(0);
    expect(await ledger.due(second.dueAt)).toHaveLength(1);
    expect(await ledger.isPending(ids[0]!)).toBe(true);
    await ledger.confirm(entry);
    expect(await ledger.size()).toBe(0);
    expect(await ledger.oldestSince()).toBeNull();
    expect(await ledger.isPending(ids[0]!)).toBe(false);
  });

  it("a due entry taken for a destroy attempt is counted and put off before the destroy is tried: one whose destroy never returns (the janitor killed in it) is not due again before its backoff, its failure is not counted twice, and one changed since it was read is not taken", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const entry = sandboxEntry(ids[0]!);
    const stored = async () => JSON.parse((await redis.hget(ledger.keys.teardownEntries(), entry.key))!);
    const mine = <T extends { entry: { key: string } }>(due: T[]) =>
      due.filter((d) => d.entry.key === entry.key);
    const now = 1_000_000;
    const failed = (await ledger.recordFailure(entry, "device busy", now, () => 1))!;
    const [read] = mine(await ledger.dueToTake(failed.dueAt, 1000));
    const taken = (await ledger.take(read!, failed.dueAt, () => 1))!;
    expect(taken).toMatchObject({
      attempts: 2,
      firstFailedAt: now,
      dueAt: failed.dueAt + teardownBackoffMs(1, () => 1),
    });
    expect(taken.lastError).toMatch(/attempt 2 began at .* no outcome recorded .*; attempt 1: device busy$/);
    // The "crash": nothing is recorded after the take. The attempt counted, the entry put off.
    expect(await stored()).toEqual(taken);
    expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(taken.dueAt);
    expect(mine(await ledger.dueToTake(taken.dueAt - 1, 1000))).toEqual([]);
    // What was read before the take (another pass's read) is not taken again.
    expect(await ledger.take(read!, failed.dueAt, () => 1)).toBeNull();
    expect(await stored()).toEqual(taken);

    // Due again: the next attempt counts on from it, and its failure records without counting.
    const [again] = mine(await ledger.dueToTake(taken.dueAt, 1000));
    const next = (await ledger.take(again!, taken.dueAt, () => 1))!;
    expect(next.attempts).toBe(3);
    const recorded = await ledger.recordFailure(entry, "still busy", taken.dueAt + 50, () => 1, {
      taken: next,
    });
    expect(recorded).toEqual({ ...next, lastError: "still busy" });
    expect(await stored()).toEqual(recorded);
    expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(next.dueAt);

    // A taken entry whose destroy another confirmed meanwhile: its late failure brings nothing back.
    const [third] = mine(await ledger.dueToTake(next.dueAt, 1000));
    const last = (await ledger.take(third!, next.dueAt, () => 1))!;
    await ledger.confirm(entry);
    expect(await ledger.recordFailure(entry, "late", next.dueAt + 50, () => 1, { taken: last })).toBeNull();
    expect(await redis.hget(ledger.keys.teardownEntries(), entry.key)).toBeNull();
    expect(await redis.zscore(ledger.keys.teardownDue(), entry.key)).toBeNull();
    expect(await ledger.isPending(ids[0]!)).toBe(false);
  });

  it("a poisoned entry's takes, each with no outcome recorded (the janitor died in every one), keep the last real error once, not nested one note a death until the cap cuts it off", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const entry = sandboxEntry(ids[0]!);
    const now = 1_000_000;
    const failed = (await ledger.recordFailure(entry, "device busy", now, () => 1))!;
    let at = failed.dueAt;
    let last = failed;
    // 40 passes, each dying in this entry's destroy (about 3 hours at the backoff's cap).
    for (let i = 0; i < 40; i++) {
      const [read] = (await ledger.dueToTake(at, 1000)).filter((d) => d.entry.key === entry.key);
      last = (await ledger.take(read!, at, () => 1))!;
      at = last.dueAt;
    }
    expect(last.attempts).toBe(41);
    expect(last.lastError).toMatch(
      /^destroy attempt 41 began at .* no outcome recorded .*; attempt 1: device busy$/,
    );
    // One note, not forty.
    expect(last.lastError.match(/no outcome recorded/g)).toHaveLength(1);
    await ledger.confirm(entry);
  });

  it("a taken orphan's entry whose attempt never ended, taken again, says so once", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const entry = sandboxEntry(ids[0]!);
    const took = await ledger.takeNew(entry, 1_000_000, () => 1);
    if (!("taken" in took)) throw new Error("not taken");
    const [read] = (await ledger.dueToTake(took.taken.dueAt, 1000)).filter((d) => d.entry.key === entry.key);
    const again = (await ledger.take(read!, took.taken.dueAt, () => 1))!;
    expect(again.lastError).toMatch(
      /^destroy attempt 2 began at .* no outcome recorded [^;]*; attempt 1: no outcome recorded either$/,
    );
    await ledger.confirm(entry);
  });

  it("a sandbox not on the ledger is put on it taken for its first destroy attempt (an orphan's), only where its key is free: a key held is told what holds it, nothing written", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const entry = sandboxEntry(ids[0]!);
    const stored = async () => redis.hget(ledger.keys.teardownEntries(), entry.key);
    const now = 1_000_000;
    const took = await ledger.takeNew(entry, now, () => 1);
    expect(took).toEqual({
      taken: {
        ...entry,
        attempts: 1,
        lastError: expect.stringMatching(/attempt 1 .* no outcome recorded/),
        firstFailedAt: now,
        dueAt: now + teardownBackoffMs(0, () => 1),
      },
    });
    if (!("taken" in took)) throw new Error("not taken");
    // The "crash": nothing recorded after it. On the ledger, due only after its backoff.
    expect(JSON.parse((await stored())!)).toEqual(took.taken);
    expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(took.taken.dueAt);
    expect((await ledger.due(took.taken.dueAt - 1, 1000)).filter((e) => e.key === entry.key)).toEqual([]);
    // Its failure records without counting again.
    expect(
      await ledger.recordFailure(entry, "device busy", now + 10, () => 1, { taken: took.taken }),
    ).toEqual({ ...took.taken, lastError: "device busy" });
    // Held (by its own entry, another sandbox's, or a torn one): told, and left as it is.
    const held = await stored();
    expect(await ledger.takeNew({ ...entry, handle: null }, now + 20)).toEqual({
      held: { ...took.taken, lastError: "device busy" },
    });
    expect(await stored()).toBe(held);
    await redis.hset(ledger.keys.teardownEntries(), entry.key, "{torn");
    expect(await ledger.takeNew(entry, now + 30)).toEqual({ held: null });
    expect(await stored()).toBe("{torn");
    await ledger.confirm(entry);
  });

  it("two failures of one destroy recorded at once count twice, a failure recorded as the sweep schedules its sandbox stands, and one confirmed meanwhile is not brought back", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const { ids } = await admitOne();
    const entry = sandboxEntry(ids[0]!);
    // Both read the entry before either writes (one connection: the reads go first).
    const [a, b] = await Promise.all([
      ledger.recordFailure(entry, "busy", 1_000, () => 1),
      ledger.recordFailure(entry, "busy too", 1_000, () => 1),
    ]);
    expect([a?.attempts, b?.attempts].sort()).toEqual([1, 2]);
    const stored = JSON.parse((await redis.hget(ledger.keys.teardownEntries(), entry.key))!);
    expect(stored.attempts).toBe(2);
    expect(Number(await redis.zscore(ledger.keys.teardownDue(), entry.key))).toBe(stored.dueAt);

    // The janitor's sweep scheduling the sandbox while a failure is recorded: the failure stands.
    await ledger.confirm(entry);
    const [failedToo, scheduled] = await Promise.all([
      ledger.recordFailure(entry, "busy", 1_500, () => 1),
      ledger.schedule(entry, 1_500),
    ]);
    expect(scheduled).toBe(true);
    expect(failedToo?.lastError).toBe("busy");
    expect(JSON.parse((await redis.hget(ledger.keys.teardownEntries(), entry.key))!)).toEqual(failedToo);
    expect(await ledger.schedule(entry, 1_600)).toBe(false);

    // A failure whose destroy another confirmed after it read the entry: nothing recorded. (The
    // confirm's script run once first, so neither call waits on loading its script.)
    await ledger.confirm(sandboxEntry(ids[0]!, "agent"));
    const late = ledger.recordFailure(entry, "busy again", 2_000, () => 1);
    const confirmed = ledger.confirm(entry);
    expect(await late).toBeNull();
    await confirmed;
    expect(await redis.hget(ledger.keys.teardownEntries(), entry.key)).toBeNull();
    expect(await redis.zscore(ledger.keys.teardownDue(), entry.key)).toBeNull();
    expect(await ledger.isPending(ids[0]!)).toBe(false);

    // But a confirm of the sandbox this one replaced under the key: this failure is recorded.
    const handle = (id: string) => ({
      provider: "docker" as const,
      endpoint: "unix:///d",
      name: `s-${id}`,
      id,
      owner: "resources" as const,
      volumes: [],
    });
    const old = { ...entry, handle: { ...handle("old"), rolloutId: ids[0]! } };
    const replacement = { ...entry, handle: { ...handle("new"), rolloutId: ids[0]! } };
    await ledger.recordFailure(old, "busy", 3_000, () => 1);
    const replaced = ledger.recordFailure(replacement, "busy too", 3_000, () => 1);
    const oldGone = ledger.confirm(old, old.handle);
    expect(await replaced).toMatchObject({ attempts: 1, lastError: "busy too", handle: { id: "new" } });
    await oldGone;
    expect(JSON.parse((await redis.hget(ledger.keys.teardownEntries(), entry.key))!)).toMatchObject({
      handle: { id: "new" },
    });
    await ledger.confirm(replacement);
  });

  it("close's begin is the tombstone (rule 9): a seed begun after it records no intent, a sandbox intent is refused, a launch claim loses", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const intent = { owner: "resources" as const, provider: "docker" as const, expirySlackMs: 600_000 };
    const id = (await admitOne()).ids[0]!;
    await store.begin(id, "close", 10);
    const late = await store.begin(id, "seed", 11, { intent });
    expect([late.intentRecorded, late.intentFresh]).toEqual([false, false]);
    expect(await ledger.recordIntent(sandboxEntry(id, "agent"))).toBe("closed");
    expect(await ledger.sandboxesOf(id)).toEqual({ resources: null, agent: null, unreadable: [] });
    expect(await store.claimLaunch(id, "late")).toEqual({ previous: "stopped", launches: 0 });
  });

  it("a stage begun after a terminal failure is skipped atomically: no sandbox intent, no launch claim", async () => {
    const intent = { owner: "resources" as const, provider: "docker" as const, expirySlackMs: 600_000 };
    const id = (await admitOne()).ids[0]!;
    const failure = {
      stage: "seed",
      terminal: true,
      failureKind: "isolation_refused",
      mask: false,
      reason: "shared PID namespace",
      at: 1,
    } as const;
    expect(await store.recordFailure(id, failure)).toBe(true);
    const seed = await store.begin(id, "seed", 2, { intent });
    expect([seed.intentRecorded, seed.record!.failure?.failureKind]).toEqual([false, "isolation_refused"]);
    expect(await redis.hexists(store.keys.sandboxes(), sandboxKey(id, "resources"))).toBe(0);
    expect((await store.begin(id, "run", 3, { launchToken: "a" })).launch).toBeNull();
    expect(await redis.hmget(store.keys.rollout(id), "fence", "launches")).toEqual([null, null]);
  });

  it("close's begin reads the failure log, and a stage begun again keeps its first start time (its timings are facts)", async () => {
    const id = (await admitOne()).ids[0]!;
    const retried = {
      stage: "seed",
      terminal: false,
      failureKind: "provider_unavailable",
      mask: true,
      reason: "daemon unreachable",
      at: 150,
    } as const;
    await store.begin(id, "seed", 100);
    await store.logFailure(id, retried);
    await store.begin(id, "seed", 200);
    const first = await store.begin(id, "close", 300);
    const again = await store.begin(id, "close", 400);
    expect(first.failures).toEqual([retried]);
    expect(again.failures).toEqual([retried]);
    expect(again.record!.times).toMatchObject({ "seed:start": 100, "close:start": 300 });
    // The record is as the begin left it: the tombstone and its start time are in the first's.
    expect([first.record!.closed, first.record!.fence, first.record!.times["close:start"]]).toEqual([
      true,
      "stopped",
      300,
    ]);
  });

  it("a cancel claims the stop, so a later launch claim loses; once close began it sets nothing (close composed the result already)", async () => {
    const a = (await admitOne()).ids[0]!;
    expect(await store.requestCancel(a)).toBe("accepted");
    expect(await store.claimLaunch(a, "after-cancel")).toEqual({ previous: "stopped", launches: 0 });
    const b = (await admitOne()).ids[0]!;
    await store.begin(b, "close", 10);
    expect(await store.requestCancel(b)).toBe("accepted");
    expect((await store.get(b))!.cancelRequested).toBe(false);
    expect(await store.requestCancel("no-such-rollout")).toBeNull();
  });

  it("a close enqueued again is counted only while the rollout is open (a finished one counts 0), and once against the count its caller read", async () => {
    const id = (await admitOne()).ids[0]!;
    expect(await store.noteCloseAgain(id)).toBe(1);
    expect(await store.noteCloseAgain(id)).toBe(2);
    // Against the count its caller read: counted if it is still that, else the count now, negated.
    expect((await store.get(id))!.closesAgain).toBe(2);
    expect(await store.noteCloseAgain(id, 2)).toBe(3);
    expect(await store.noteCloseAgain(id, 2)).toBe(-3);
    expect((await store.get(id))!.closesAgain).toBe(3);
    // The same call sent again (a reconnect lost its reply): the count it made, not another one,
    // nor that count read as another caller's.
    expect(await store.noteCloseAgain(id, 3, "call-1")).toBe(4);
    expect(await store.noteCloseAgain(id, 3, "call-1")).toBe(4);
    expect(await store.noteCloseAgain(id, undefined, "call-2")).toBe(5);
    expect(await store.noteCloseAgain(id, undefined, "call-2")).toBe(5);
    // …also when another caller counted between the two sends.
    expect(await store.noteCloseAgain(id, undefined, "call-3")).toBe(6);
    expect(await store.noteCloseAgain(id, undefined, "call-4")).toBe(7);
    expect(await store.noteCloseAgain(id, undefined, "call-3")).toBe(6);
    expect((await store.get(id))!.closesAgain).toBe(7);
    const meta = (await store.begin(id, "close", 10)).record!.meta;
    expect(await store.finalize(meta, resultFor(id, "completed"), 20)).toBe(true);
    expect(await store.noteCloseAgain(id)).toBe(0);
    expect(await store.noteCloseAgain("no-such-rollout")).toBe(0);
  });

  it("a sandbox attached after the rollout closed tells its creator so (it destroys it); an intent for an unknown rollout is refused; a confirm without the sandbox named forgets the entry whatever it holds", async () => {
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const entry = sandboxEntry(id);
    const made = { ...entry, handle: dockerHandle(id, "resources", "5") };
    expect(await ledger.recordIntent(entry)).toBe("ok");
    expect(await ledger.attachHandle(made)).toBe(false);
    await store.tombstone(id);
    expect(await ledger.attachHandle(made)).toBe(true);
    // Stored all the same, for whoever destroys it.
    expect((await ledger.getSandbox(entry.key))?.handle?.id).toBe(`c5-${id}`);
    await ledger.confirm(entry);
    expect(await ledger.getSandbox(entry.key)).toBeNull();

    const unknown = `no-such-${Date.now()}`;
    expect(await ledger.recordIntent(sandboxEntry(unknown))).toBe("missing");
    expect(await ledger.getSandbox(sandboxKey(unknown, "resources"))).toBeNull();
  });

  it("the backlog bound counts rollouts in flight and live reservations, admits up to it exactly, forgets lapsed reservations, and lets a request's replay share its reservation", async () => {
    const own = new RolloutStore(redis, `${prefix}-bound`);
    await redis.zadd(own.keys.inflight(), 1, "r1", 2, "r2");
    const a = await own.reserveBacklog(3, 6, 1_000); // 2 + 0 + 3 = 5
    expect(a).toMatchObject({ reserved: true, inflight: 2, reservedByOthers: 0 });
    // 2 + 3 + 2 = 7 > 6
    expect(await own.reserveBacklog(2, 6, 1_000)).toMatchObject({
      reserved: false,
      inflight: 2,
      reservedByOthers: 3,
    });
    // 2 + 3 + 1 = 6: the bound itself is allowed. Its holder dies without a release: it lapses at 1_500.
    expect((await own.reserveBacklog(1, 6, 1_000, 500)).reserved).toBe(true);
    expect(await own.reserveBacklog(1, 6, 1_200)).toMatchObject({ reserved: false, reservedByOthers: 4 });
    const after = await own.reserveBacklog(1, 6, 1_500);
    expect(after).toMatchObject({ reserved: true, reservedByOthers: 3 });
    await after.release();
    await a.release();
    // The same request (its idempotency key) while its first call still admits: it shares that
    // room, never refused for it; its release leaves the first's reservation alone.
    const first = await own.reserveBacklog(4, 6, 2_000, 60_000, "key-x"); // 2 + 0 + 4 = 6
    expect(first.reserved).toBe(true);
    const replay = await own.reserveBacklog(4, 6, 2_000, 60_000, "key-x");
    expect(replay).toMatchObject({ reserved: true, reservedByOthers: 4 });
    await replay.release();
    expect(await own.reserveBacklog(1, 6, 2_000)).toMatchObject({ reserved: false, reservedByOthers: 4 });
    await first.release();
    const last = await own.reserveBacklog(1, 6, 2_000);
    expect(last).toMatchObject({ reserved: true, reservedByOthers: 0 });
    await redis.del(own.keys.inflight(), own.keys.reservations());
  });

  it("a backlog reservation taken without a clock lapses by Redis's (TIME); refreshed, it lapses that long after the refresh", async () => {
    const own = new RolloutStore(redis, `${prefix}-time`);
    const redisNow = async () => {
      const [sec, usec] = await redis.time();
      return Number(sec) * 1000 + Math.floor(Number(usec) / 1000);
    };
    const score = async () => Number(await redis.zscore(own.keys.reservations(), (await members())[0]!));
    const members = () => redis.zrange(own.keys.reservations(), "0", "-1");
    const before = await redisNow();
    const room = await own.reserveBacklog(2, 6, null, 5_000);
    const after = await redisNow();
    expect(room.reserved).toBe(true);
    expect(await score()).toBeGreaterThanOrEqual(before + 5_000);
    expect(await score()).toBeLessThanOrEqual(after + 5_000);
    const taken = await score();
    while ((await redisNow()) <= taken - 5_000) await new Promise((resolve) => setTimeout(resolve, 5));
    expect(await room.refresh()).toBe(true);
    expect(await score()).toBeGreaterThan(taken);
    await room.release();
    expect(await members()).toEqual([]);
    // Released: nothing to refresh, nothing brought back.
    expect(await room.refresh()).toBe(false);
    expect(await members()).toEqual([]);
  });

  it("admission records a rollout in flight scored by its deadline (what the watchdog reads) and a single rollout's admission as under way until its seed is enqueued", async () => {
    const ids = rolloutIds(1, null, "rollout");
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const [meta] = await prepareRollouts(store, [request], ids, null, { maxTaskBytes: 1e6, now: 5_000 });
    expect((await store.admit([meta!], 5_000)).created).toEqual(ids);
    expect(Number(await redis.zscore(store.keys.inflight(), meta!.id))).toBe(meta!.deadlineAt);
    expect(await store.pastDeadline(meta!.deadlineAt - 1, 1000)).not.toContain(meta!.id);
    expect(await store.pastDeadline(meta!.deadlineAt, 1000)).toContain(meta!.id);
    const member = `r:${meta!.id}`;
    expect(await store.admissionsBefore(Date.now() + 1, 1000)).toContainEqual({
      admission: member,
      score: 5_000,
    });
    expect(await store.unseededOf(member)).toEqual(ids);
    // Seeded since (its seed was enqueued after all): nothing of it left to seed.
    expect(await store.saveReceipt(meta!, "seed", seedReceipt(meta!.id), "seeded", 6_000)).toBe(true);
    expect(await store.unseededOf(member)).toEqual([]);
    await store.admissionDone(member);
  });

  it("a batch of a single rollout ends its admission lease with that rollout: it lives as long as its rollout", async () => {
    const { batchId } = await admit(
      store,
      queues,
      { requests: [{ task, agent: { harness: "oracle", sandbox: "borrow" } }], batch: true },
      { maxTaskBytes: 1e6 },
    );
    expect(await redis.pttl(store.keys.batch(batchId!))).toBe(-1);
    expect(await store.getBatch(batchId!)).toMatchObject({ total: 1, done: 0 });
  });

  it("admission's own write refuses what the checks before it refuse, for a request that raced past them: another body, a key that names a batch, a gone rollout of an expiring batch", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const key = `race-${Date.now()}`;
    const [id] = rolloutIds(1, key, "rollout") as [string];
    const [meta] = await prepareRollouts(store, [request], [id], null, { maxTaskBytes: 1e6 });
    // The same id under another body (a concurrent request with the same key).
    expect((await store.admit([meta!], Date.now())).created).toEqual([id]);
    const other = { ...meta!, bodyHash: "another-body" };
    expect(await store.admit([other], Date.now())).toMatchObject({ created: [], conflicting: [id] });
    expect((await store.get(id))!.meta.bodyHash).toBe(meta!.bodyHash);
    // A single rollout whose key names a batch recorded meanwhile on the other route.
    const key2 = `race2-${Date.now()}`;
    const [single] = rolloutIds(1, key2, "rollout") as [string];
    const keyBatch = batchIdFor(rolloutIds(1, key2, "batch"));
    expect(await store.createBatch(keyBatch, "h", Date.now())).toBe("h");
    const [meta2] = await prepareRollouts(store, [request], [single], null, { maxTaskBytes: 1e6 });
    expect(await store.admit([meta2!], Date.now(), keyBatch)).toMatchObject({
      created: [],
      otherRoute: [single],
    });
    expect(await store.exists(single)).toBe(false);
    // A batch that finished and is expiring, one of whose rollouts is gone already.
    const { batchId, ids } = await admit(
      kept,
      queues,
      { requests: [request, request], batch: true },
      { maxTaskBytes: 1e6 },
    );
    for (const rid of ids) {
      const m = (await kept.get(rid))!.meta;
      expect(await kept.finalize(m, { ...resultFor(rid, "completed"), batchId }, Date.now())).toBe(true);
    }
    await redis.del(kept.keys.rollout(ids[0]!));
    const metas = await prepareRollouts(kept, [request, request], ids, batchId, { maxTaskBytes: 1e6 });
    expect(await kept.admit(metas.slice(0, 1), Date.now())).toMatchObject({ created: [], expired: [ids[0]] });
    expect(await kept.get(ids[0]!)).toBeNull();
    expect(await kept.getBatch(batchId!)).toMatchObject({ total: 2, done: 2 });
  });

  it("a batch's rollouts are recorded in one call, each on its own: one whose record cannot be written fails the admission, the others are recorded, listed and counted", async () => {
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = rolloutIds(3, null, "batch");
    const batchId = batchIdFor(ids);
    const metas = await prepareRollouts(store, [request, request, request], ids, batchId, {
      maxTaskBytes: 1e6,
    });
    expect(await store.createBatch(batchId, "h", Date.now())).toBe("h");
    // The middle one's key holds a string (not a hash): its commands fail with WRONGTYPE.
    await redis.set(store.keys.rollout(ids[1]!), "not a hash");
    await expect(store.admit(metas, Date.now())).rejects.toThrow(/^WRONGTYPE /);
    expect((await store.get(ids[0]!))?.status).toBe("accepted");
    expect((await store.get(ids[2]!))?.status).toBe("accepted");
    expect(await store.getBatch(batchId)).toMatchObject({ total: 2, done: 0, counts: { accepted: 2 } });
    expect(await store.batchRolloutIds(batchId)).toEqual([ids[0], ids[2]]);
    expect(await redis.zscore(store.keys.inflight(), ids[1]!)).toBeNull();
    expect(Number(await redis.zscore(store.keys.inflight(), ids[2]!))).toBe(metas[2]!.deadlineAt);
    // Its first rollout ended the batch's admission lease; its admission is noted as under way.
    expect(await redis.pttl(store.keys.batch(batchId))).toBe(-1);
    expect((await store.admissionsBefore(Date.now() + 1, 1000)).map((a) => a.admission)).toContain(
      `b:${batchId}`,
    );
    await store.admissionDone(`b:${batchId}`);
    await redis.del(store.keys.rollout(ids[1]!));
  });

  it("an admission Redis refuses for now (no good replicas: NOREPLICAS; a demoted master: READONLY) throws Redis's own reply, single rollout or batch, so the dispatcher answers 503 (try again), not 500", async () => {
    // Its own Redis: min-replicas-to-write makes every script's first write fail with NOREPLICAS
    // (caught by fleetAdmit's per-rollout pcall, as READONLY on a replica is).
    const server = await LocalRedisServer.start({ dir: mkdtempSync(join(tmpdir(), "redis-")) });
    const r = createRedis(server.url);
    try {
      const own = new RolloutStore(r, prefix);
      const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
      const single = rolloutIds(1, null, "single");
      const singleMetas = await prepareRollouts(own, [request], single, null, { maxTaskBytes: 1e6 });
      const batch = rolloutIds(2, null, "batch");
      const batchId = batchIdFor(batch);
      const batchMetas = await prepareRollouts(own, [request, request], batch, batchId, {
        maxTaskBytes: 1e6,
      });
      expect(await own.createBatch(batchId, "h", Date.now())).toBe("h");
      await r.config("SET", "min-replicas-to-write", "1");
      for (const metas of [singleMetas, batchMetas]) {
        const err = await own.admit(metas, Date.now()).then(
          () => null,
          (e: unknown) => e,
        );
        expect((err as Error).message).toMatch(/^NOREPLICAS /);
        expect(isRedisUnavailable(err)).toBe(true);
      }
      await r.config("SET", "min-replicas-to-write", "0");
      expect(await own.get(single[0]!)).toBeNull();
    } finally {
      r.disconnect();
      await server.kill();
    }
  });

  it("an admission on a connection left on a demoted master is refused once (READONLY, 503), and the next reaches the new master behind the URL's name: the refusal, caught per rollout inside fleetAdmit, still makes the connection reconnect", async () => {
    const pair = await FailoverPair.start();
    const r = createRedis(pair.url);
    try {
      const own = new RolloutStore(r, prefix);
      const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
      const ids = rolloutIds(1, null, "failover");
      const metas = await prepareRollouts(own, [request], ids, null, { maxTaskBytes: 1e6 });
      await r.ping();
      await pair.failOver();
      const refused = await own.admit(metas, Date.now()).then(
        () => null,
        (e: unknown) => e,
      );
      expect((refused as Error).message).toMatch(/^READONLY /);
      expect(isRedisUnavailable(refused)).toBe(true);
      // The dispatcher's caller tries again (503, Retry-After): a few tries at most, not forever.
      let tries = 1;
      for (;;) {
        try {
          await own.admit(metas, Date.now());
          break;
        } catch (err) {
          if (!isRedisUnavailable(err) || ++tries > 50) throw err;
          await new Promise((resolve) => setTimeout(resolve, 20));
        }
      }
      expect((await new RolloutStore(pair.adminB, prefix).get(ids[0]!))?.status).toBe("accepted");
    } finally {
      r.disconnect();
      await pair.stop();
    }
  });

  it("a stage's receipt moves its batch's count from the old status to the new once, and records the stage and its end time", async () => {
    const r = await admit(
      store,
      queues,
      {
        requests: [1, 2].map(() => ({
          task,
          agent: { harness: "oracle" as const, sandbox: "borrow" as const },
        })),
        batch: true,
      },
      { maxTaskBytes: 1e6 },
    );
    const counts = async () => (await store.getBatch(r.batchId!))!.counts;
    const meta = (await store.get(r.ids[0]!))!.meta;
    expect(await store.saveReceipt(meta, "seed", seedReceipt(meta.id), "seeded", 50)).toBe(true);
    expect(await counts()).toMatchObject({ accepted: 1, seeded: 1 });
    const rec = (await store.get(meta.id))!;
    expect(rec).toMatchObject({ status: "seeded", stage: "seed" });
    expect(rec.times["seed:end"]).toBe(50);
    // Sent again (a reconnect lost its reply): counted once.
    expect(await store.saveReceipt(meta, "seed", seedReceipt(meta.id), "seeded", 50)).toBe(true);
    expect(await counts()).toMatchObject({ accepted: 1, seeded: 1 });
    const result = { ...resultFor(meta.id, "completed"), batchId: r.batchId };
    expect(await store.finalize(meta, result, 60)).toBe(true);
    expect(await counts()).toMatchObject({ accepted: 1, seeded: 0, completed: 1 });
  });

  it("a task admitted again lives on from that admission: its expiry is refreshed, not left to the first one's", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const t = TaskContent.parse({ ...task, id: `refresh-${Date.now()}` });
    const digest = digestTask(t);
    await kept.putTask(t, digest);
    const full = await redis.pttl(kept.keys.task(digest));
    // Much later: the first admission's expiry is near.
    await redis.pexpire(kept.keys.task(digest), 5_000);
    await kept.putTask(t, digest);
    expect(await redis.pttl(kept.keys.task(digest))).toBeGreaterThan(full - 60_000);
    // Admitted again by a release with retention off (a rolling restart that turned it off): kept
    // for good, not left to the lease the first one gave it.
    await redis.pexpire(kept.keys.task(digest), 5_000);
    await new RolloutStore(redis, prefix, { resultTtlMs: 0 }).putTask(t, digest);
    expect(await redis.pttl(kept.keys.task(digest))).toBe(-1);
  });

  it("teardown backoff is jittered between half and all of base·2^n, capped; a sandbox scheduled again keeps its failures' backoff; a network retry keeps its first time and, once done, is not brought back", async () => {
    expect([teardownBackoffMs(0, () => 0), teardownBackoffMs(0, () => 1)]).toEqual([1_000, 2_000]);
    expect(teardownBackoffMs(3, () => 0)).toBe(8_000);
    expect([teardownBackoffMs(30, () => 0), teardownBackoffMs(30, () => 1)]).toEqual([150_000, 300_000]);
    const ledger = new TeardownLedger(redis, prefix);
    const id = (await admitOne()).ids[0]!;
    const entry = sandboxEntry(id);
    await ledger.recordFailure(entry, "boom", 1_000, () => 1);
    const failed = (await ledger.recordFailure(entry, "boom again", 2_000, () => 1))!;
    // The janitor's orphan sweep finds the same sandbox: its attempts and backoff stand.
    await ledger.schedule(entry, 2_500);
    const mine = (entries: { key: string }[]) => entries.filter((e) => e.key === entry.key);
    expect(mine(await ledger.pending())).toEqual([failed]);
    expect(mine(await ledger.due(failed.dueAt - 1, 1000))).toEqual([]);
    await ledger.confirm(entry);

    await ledger.networkRemovalFailed(id, 3_000);
    await ledger.networkRemovalFailed(id, 3_500);
    expect(await redis.zscore(ledger.keys.networkRetries(), id)).toBe("3000");
    await ledger.networkRemoved(id);
    // A janitor pass that read it before the removal puts it off: nothing to put off any more.
    await ledger.networkRetryLater(id, 4_000);
    expect(await redis.zscore(ledger.keys.networkRetries(), id)).toBeNull();
  });

  it("admit() refuses another body under its batch's key, or a key that names the other route, recorded between its checks and its write (409, nothing admitted)", async () => {
    const requests = [1, 2].map(() => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    const key = `late-${Date.now()}`;
    const ids = rolloutIds(2, key, "batch");
    const batchId = batchIdFor(ids);
    // Another body under the key lands right after this request read nothing there.
    const racing = Object.create(store) as RolloutStore;
    racing.getBatch = async () => {
      await store.createBatch(batchId, "another-body", Date.now());
      return null;
    };
    await expect(
      admit(racing, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 }),
    ).rejects.toMatchObject({ name: "AdmissionError", code: "conflict" });
    expect(await store.getBatch(batchId)).toMatchObject({ total: 0, bodyHash: "another-body" });
    expect(await store.exists(ids[0]!)).toBe(false);
    await store.admissionDone(`b:${batchId}`);

    // A batch under a single rollout's key lands right after that request checked there was none.
    const key2 = `late2-${Date.now()}`;
    const [single] = rolloutIds(1, key2, "rollout") as [string];
    const keyBatch = batchIdFor(rolloutIds(1, key2, "batch"));
    const racing2 = Object.create(store) as RolloutStore;
    racing2.batchExists = async () => {
      await store.createBatch(keyBatch, "h", Date.now());
      return false;
    };
    await expect(
      admit(
        racing2,
        queues,
        { requests: [requests[0]!], batch: false, idempotencyKey: key2 },
        { maxTaskBytes: 1e6 },
      ),
    ).rejects.toMatchObject({ name: "AdmissionError", code: "conflict" });
    expect(await store.exists(single)).toBe(false);
    expect(await queues.queues.seed.getJob(`${single}.seed`)).toBeUndefined();
    await store.admissionDone(`b:${keyBatch}`);
  });

  it("a replay of a batch still running, one of whose finished rollouts expired already (its retention ended first), admits that rollout never again: nothing runs twice, nothing counts twice", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const key = `live-expired-${Date.now()}`;
    const requests = [1, 2].map(() => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    const submit = () =>
      admit(kept, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 });
    const { batchId, ids } = await submit();
    const [a, b] = ids as [string, string];
    // A finished quickly; B still runs when A's retention ends.
    const metaA = (await kept.get(a))!.meta;
    expect(await kept.finalize(metaA, { ...resultFor(a, "completed"), batchId }, Date.now())).toBe(true);
    expect(await redis.pttl(kept.keys.batch(batchId!))).toBe(-1);
    await redis.del(kept.keys.rollout(a));
    // The client sends the batch again under its key (its first answer lost).
    const replay = await submit();
    expect(replay).toMatchObject({ batchId, ids, created: [] });
    expect(await kept.get(a)).toBeNull();
    // (Nor is its seed enqueued again: see the next test.)
    expect(await kept.getBatch(batchId!)).toMatchObject({ total: 2, done: 1 });
    expect(await kept.batchRolloutIds(batchId!)).toEqual([a, b]);
    expect(await redis.zscore(kept.keys.inflight(), a)).toBeNull();
  });

  it("a replay of a batch still running enqueues seeds only for its rollouts still waiting for one: none for one gone (its retention ended), one seeded or one finished", async () => {
    const kept = new RolloutStore(redis, prefix, { resultTtlMs: 60_000 });
    const key = `live-seeds-${Date.now()}`;
    const requests = [1, 2, 3, 4].map(() => ({
      task,
      agent: { harness: "oracle" as const, sandbox: "borrow" as const },
    }));
    const submit = () =>
      admit(kept, queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e6 });
    const { batchId, ids } = await submit();
    const [gone, seeded, finished, waiting] = ids as [string, string, string, string];
    // Their seed jobs ran and were trimmed (removeOnComplete), or were never taken (`waiting`).
    for (const id of ids) await queues.queues.seed.remove(`${id}.seed`);
    const meta = async (id: string) => (await kept.get(id))!.meta;
    expect(
      await kept.finalize(await meta(gone), { ...resultFor(gone, "completed"), batchId }, Date.now()),
    ).toBe(true);
    await redis.del(kept.keys.rollout(gone));
    const receipt = seedReceipt(seeded);
    expect(
      await kept.saveReceipt(await meta(seeded), "seed", receipt, "seeded", Date.now(), {
        attach: seedEntry(seeded, receipt),
      }),
    ).toBe(true);
    expect(
      await kept.finalize(await meta(finished), { ...resultFor(finished, "completed"), batchId }, Date.now()),
    ).toBe(true);
    // The client sends the batch again under its key (its first answer lost).
    expect(await submit()).toMatchObject({ batchId, ids, created: [] });
    const seeds = await Promise.all(ids.map((id) => queues.queues.seed.getJob(`${id}.seed`)));
    expect(seeds.map((job) => job?.data ?? null)).toEqual([null, null, null, { rolloutId: waiting }]);
  });

  it("a batch's admission refreshes its note with every chunk it records: the janitor finishes only an admission left for dead", async () => {
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = rolloutIds(2, null, "batch");
    const batchId = batchIdFor(ids);
    const member = `b:${batchId}`;
    expect(await store.createBatch(batchId, "h", Date.now())).toBe("h");
    // Its note as an admission that began long ago (its task uploads took long) would show it.
    await redis.zadd(store.keys.admitting(), 1, member);
    const metas = await prepareRollouts(store, [request, request], ids, batchId, { maxTaskBytes: 1e6 });
    const before = Date.now();
    expect((await store.admit(metas.slice(0, 1), Date.now())).created).toEqual(ids.slice(0, 1));
    expect(Number(await redis.zscore(store.keys.admitting(), member))).toBeGreaterThanOrEqual(before);
    expect((await store.admissionsBefore(before - 1, 1000)).map((a) => a.admission)).not.toContain(member);
    await store.admissionDone(member);
  });

  it("a batch whose rollouts carry long agent specs is recorded in calls of about a megabyte each, not one call holding Redis for the whole body, in its order", async () => {
    // A prompt of 50 Ki characters in each rollout's argv, half of them CJK (3 bytes each in
    // UTF-8): 40 of them are 8 MiB of records, counted in bytes, not characters.
    const prompt = "p語".repeat(25 * 1024);
    const agent = { harness: "command" as const, argv: ["agent", "--prompt", prompt] };
    const request = RolloutRequest.parse({ task, agent });
    const ids = rolloutIds(40, null, "batch");
    const batchId = batchIdFor(ids);
    expect(await store.createBatch(batchId, "h", Date.now())).toBe("h");
    const metas = await prepareRollouts(store, Array(40).fill(request), ids, batchId, { maxTaskBytes: 1e6 });
    const scripted = withScripts(redis);
    const real = scripted.fleetAdmit.bind(scripted);
    const calls: { rollouts: number; bytes: number }[] = [];
    const spy = vi.spyOn(scripted, "fleetAdmit").mockImplementation((...args) => {
      const records = args.filter((a): a is string => typeof a === "string" && a.startsWith('{"id":'));
      calls.push({ rollouts: records.length, bytes: records.reduce((n, r) => n + Buffer.byteLength(r), 0) });
      return real(...(args as [number, ...string[]]));
    });
    try {
      expect((await store.admit(metas, Date.now())).created).toEqual(ids);
    } finally {
      spy.mockRestore();
    }
    const record = Buffer.byteLength(JSON.stringify(metas[0]));
    expect(calls.reduce((n, c) => n + c.rollouts, 0)).toBe(40);
    expect(calls.length).toBeGreaterThanOrEqual(Math.ceil((40 * record) / (ADMIT_CHUNK_BYTES + record)));
    for (const c of calls) expect(c.bytes).toBeLessThanOrEqual(ADMIT_CHUNK_BYTES + record);
    expect(await redis.lrange(store.keys.batchIds(batchId), 0, -1)).toEqual(ids);
  });

  it("an admission sent again (a reconnect lost its reply) is told it created its rollouts, counted once, not that they were replays", async () => {
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle", sandbox: "borrow" } });
    const ids = rolloutIds(3, null, "batch");
    const batchId = batchIdFor(ids);
    expect(await store.createBatch(batchId, "h", Date.now())).toBe("h");
    const metas = await prepareRollouts(store, Array(3).fill(request), ids, batchId, { maxTaskBytes: 1e6 });
    expect((await sentTwice("fleetAdmit", () => store.admit(metas, Date.now()))).created).toEqual(ids);
    expect(await redis.hmget(store.keys.batch(batchId), "total", "count:accepted")).toEqual(["3", "3"]);
    expect(await redis.lrange(store.keys.batchIds(batchId), 0, -1)).toEqual(ids);
    const single = rolloutIds(1, null, "single");
    const [first] = await prepareRollouts(store, [request], single, null, { maxTaskBytes: 1e6 });
    expect((await sentTwice("fleetAdmit", () => store.admit([first!], Date.now()))).created).toEqual(single);
    // A real replay (another call) is still told the rollout existed.
    const again = rolloutIds(1, null, "single");
    const [meta] = await prepareRollouts(store, [request], again, null, { maxTaskBytes: 1e6 });
    expect((await store.admit([meta!], Date.now())).created).toEqual(again);
    expect((await store.admit([meta!], Date.now())).created).toEqual([]);
  });

  it("shares the seeds each process's seed-ahead bound is making: the others' as they last said, none of one past its expiry (a process that died), which is removed", async () => {
    const own = new RolloutStore(redis, `${prefix}-seeding`);
    const now = Date.now();
    expect(await own.shareSeeding("a", 2, now, now + 5_000)).toBe(0);
    expect(await own.shareSeeding("b", 3, now, now + 5_000)).toBe(2);
    await own.saySeeding("a", 4, now, now + 5_000);
    expect(await own.shareSeeding("b", 1, now, now + 5_000)).toBe(4);
    // "c" said last that it expires now: gone, not counted, and its field removed. Its short
    // expiry does not shorten the hash's (which would drop the others' entries with it).
    await own.saySeeding("c", 7, now - 1, now);
    expect(await redis.pttl(own.keys.seeding())).toBeGreaterThan(4_000);
    expect(await own.shareSeeding("a", 0, now, now + 5_000)).toBe(1);
    // (Its removal is sent before the next command on the same connection, so done by its reply.)
    expect(await redis.hexists(own.keys.seeding(), "c")).toBe(0);
    // The hash lasts as long as the latest entry said; a process that stops takes its own out.
    expect(await redis.pttl(own.keys.seeding())).toBeGreaterThan(4_000);
    await own.forgetSeeding("a");
    expect(await own.shareSeeding("b", 0, now, now + 5_000)).toBe(0);
    expect(await redis.hkeys(own.keys.seeding())).toEqual(["b"]);
  });

  it("counts the worker processes present on a queue: not one past its expiry (a process that died), which is removed, nor one that left", async () => {
    const own = new RolloutStore(redis, `${prefix}-workers`);
    const now = Date.now();
    expect(await own.workersPresent("run", now)).toBe(0);
    await own.sayWorkerPresent("run", "a", now, now + 5_000);
    await own.sayWorkerPresent("run", "b", now, now + 5_000);
    // Said again: still one process.
    await own.sayWorkerPresent("run", "a", now, now + 6_000);
    await own.sayWorkerPresent("verify", "c", now, now + 5_000);
    expect(await own.workersPresent("run", now)).toBe(2);
    expect(await own.workersPresent("verify", now)).toBe(1);
    // "b" not said again past its expiry: not counted, and its field removed.
    expect(await own.workersPresent("run", now + 5_500)).toBe(1);
    expect(await redis.hkeys(own.keys.workers("run"))).toEqual(["a"]);
    // The hash lasts as long as the latest entry said.
    expect(await redis.pttl(own.keys.workers("run"))).toBeGreaterThan(5_000);
    // A process that closes takes its own out.
    await own.forgetWorkerPresent("run", "a");
    expect(await own.workersPresent("run", now)).toBe(0);
    // A process saying its presence removes the others' past their expiry too.
    await own.sayWorkerPresent("verify", "d", now + 6_000, now + 10_000);
    expect(await redis.hkeys(own.keys.workers("verify"))).toEqual(["d"]);
  });
});

describe("fleetInstance", () => {
  it("is made once per Redis and prefix and read back the same by every app after (concurrent starts included)", async () => {
    const redis = createRedis(REDIS_URL);
    const prefix = `{inst-${randomUUID().slice(0, 8)}}`;
    const other = `{inst-${randomUUID().slice(0, 8)}}`;
    try {
      const ids = await Promise.all(Array.from({ length: 8 }, () => fleetInstance(redis, prefix)));
      expect(new Set(ids).size).toBe(1);
      expect(ids[0]).toMatch(/^[0-9a-f-]{36}$/);
      expect(await fleetInstance(redis, prefix)).toBe(ids[0]);
      expect(await redis.get(createKeys(prefix).instance())).toBe(ids[0]);
      // Another prefix (another fleet on this Redis): another id.
      expect(await fleetInstance(redis, other)).not.toBe(ids[0]);
    } finally {
      await redis.del(createKeys(prefix).instance(), createKeys(other).instance());
      redis.disconnect();
    }
  });

  it("is put back by an app that reconnects to a Redis that lost it; an app that finds another there is told", async () => {
    const redis = createRedis(REDIS_URL);
    const admin = createRedis(REDIS_URL);
    const prefix = `{inst-${randomUUID().slice(0, 8)}}`;
    const key = createKeys(prefix).instance();
    const others: string[] = [];
    try {
      const id = await fleetInstance(redis, prefix);
      keepFleetInstance(redis, prefix, id, (current) => others.push(current));
      // The data lost (a Redis restarted without its AOF), the app's connection dropped and back.
      await admin.del(key);
      redis.disconnect(true);
      await vi.waitFor(async () => expect(await admin.get(key)).toBe(id), { timeout: 10_000 });
      expect(others).toEqual([]);
      // Another app started first and made a new one: this one is told at its reconnect.
      await admin.set(key, "newer");
      redis.disconnect(true);
      await vi.waitFor(() => expect(others).toEqual(["newer"]), { timeout: 10_000 });
    } finally {
      await admin.del(key);
      redis.disconnect();
      admin.disconnect();
    }
  });
});

describe("a bubblewrap fleet's host (claimSandboxHost)", () => {
  it("is one host's while its apps renew it: another host is told which holds it, and may claim it once the claim lapses", async () => {
    const redis = createRedis(REDIS_URL);
    const prefix = `{host-${randomUUID().slice(0, 8)}}`;
    const [a, b] = ["bwrap://host-a", "bwrap://host-b"];
    const told: string[] = [];
    // Renewed every third of it: a stall of the test's process or Redis (GC, an fsync) shorter
    // than two renewals keeps the claim.
    const TTL = 3_000;
    let stop = () => {};
    try {
      expect(await claimSandboxHost(redis, prefix, a, TTL)).toBeNull();
      expect(await claimSandboxHost(redis, prefix, a, TTL)).toBeNull(); // another app of host a
      expect(await claimSandboxHost(redis, prefix, b, TTL)).toBe(a);
      // Renewed by host a's apps, it stays a's past its own life...
      stop = keepSandboxHost(redis, prefix, a, (other) => told.push(other), TTL);
      const renewedUntil = Date.now() + 2 * TTL;
      while (Date.now() < renewedUntil) {
        expect(await claimSandboxHost(redis, prefix, b, TTL)).toBe(a);
        await vi.waitFor(async () =>
          expect(await redis.pttl(createKeys(prefix).sandboxHost())).toBeGreaterThan(0),
        );
      }
      // ...and lapses once they stop: host b's then, and host a's renewal is told so.
      stop();
      await vi.waitFor(async () => expect(await claimSandboxHost(redis, prefix, b, TTL)).toBeNull(), {
        timeout: 3 * TTL,
      });
      stop = keepSandboxHost(redis, prefix, a, (other) => told.push(other), TTL);
      await vi.waitFor(() => expect(told).toContain(b), { timeout: 3 * TTL });
    } finally {
      stop();
      await redis.del(createKeys(prefix).sandboxHost());
      redis.disconnect();
    }
  });
});
