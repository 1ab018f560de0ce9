import { randomUUID } from "node:crypto";
import { FleetError, isTerminal, RolloutRequest, type SandboxHandle } from "@fleet/contracts";
import {
  admit,
  cancelBatch,
  cancelRollout,
  duplicateRedis,
  JANITOR_QUEUE,
  LONGEST_LIFE_MS,
  rolloutIds,
  sandboxKey,
  teardownBackoffMs,
} from "@fleet/queue";
import {
  DockerGatewayNetworks,
  DockerSandboxProvider,
  gatewayNetworkName,
  LABEL_OWNER,
  LABEL_ROLLOUT,
} from "@fleet/sandbox";
import { execResult, InMemorySandboxProvider, MemoryGatewayFirewall } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createFleetMetrics, createLogger, createMetricsRegistry } from "@fleet/telemetry";
import { Queue, UnrecoverableError, Worker } from "bullmq";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import {
  CLOSE_DELAY_LIMIT_MS,
  JANITOR_SCHEDULER,
  janitorTick,
  REPORTED_ENTRY_FAILURES,
  STALE_HELPER_MS,
  startJanitor,
  WATCHDOG_PAGE,
} from "./janitor.ts";
import { requeueLostJobs } from "./lost-jobs.ts";
import { runStageJob } from "./stage-runner.ts";
import { CLOSE_AGAIN_LIMIT } from "./stages.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { createStageWorkers } from "./worker.ts";

const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
// Scoped to this file's run: its janitor passes sweep every sandbox their provider lists, and
// must never take another test file's (they run at the same time on the one daemon). A random
// run id, not the pid: jobs in containers sharing one daemon (or a killed run's leftovers) have
// the same pids.
const RUN = randomUUID().slice(0, 8);
const docker = new DockerSandboxProvider({ scope: `janitor-test-${RUN}` });

/** The example suite's hello-file task, on the test image. */
async function helloFile() {
  const suite = await loadSuite(EXAMPLE_SUITE_DIR);
  return { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE };
}

/** A stage job of `id` as `runStageJob` takes it: a first attempt of three. */
/** An in-memory provider whose sandboxes are listed with their rollout's labels, as Docker's are. */
function listedWithRolloutLabels(memory: InMemorySandboxProvider): InMemorySandboxProvider {
  return Object.assign(Object.create(memory) as InMemorySandboxProvider, {
    list: async () =>
      (await memory.list()).map((info) => ({
        ...info,
        labels: { ...info.labels, [LABEL_ROLLOUT]: info.handle.rolloutId, [LABEL_OWNER]: info.handle.owner },
      })),
  });
}

/**
 * A resources sandbox of rollout `id` made on `memory` at `now` (an hour to live), whose destroy
 * failed at `failedAt`: on `ledger`, due again after its backoff.
 */
async function failedOnLedger(
  memory: InMemorySandboxProvider,
  ledger: InProcessFleet["deps"]["ledger"],
  id: string,
  now: number,
  failedAt: number,
): Promise<void> {
  const expiresAt = now + 3_600_000;
  const handle = await memory.create({ image: "img", rolloutId: id, owner: "resources", expiresAt });
  const entry = {
    key: sandboxKey(id, "resources"),
    rolloutId: id,
    owner: "resources" as const,
    provider: memory.name,
    handle,
    createdAt: failedAt,
    expiresAt,
  };
  await ledger.recordFailure(entry, "device or resource busy", failedAt);
}

const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/**
 * An in-memory fleet whose janitor meets a poisoned sandbox: `poison`'s destroy never settles (a
 * daemon call that hangs the janitor until its supervisor kills it, or crashes it), so each pass
 * that tries it is abandoned in it; `behind`'s is as ever. Both are of rollouts the fleet does not
 * know, made at `at`, `poison` first. `labelled`: listed with their rollout's labels, as Docker's
 * are (`listedWithRolloutLabels`), for the orphan sweep.
 */
async function poisonedFleet(tag: string, labelled: boolean) {
  const memory = new InMemorySandboxProvider();
  const own = await startInProcessFleet({ provider: memory, startWorkers: false });
  const hung = latch();
  const destroys = { poison: 0 };
  const listed = labelled ? listedWithRolloutLabels(memory) : memory;
  const at = Date.now();
  const make = (rolloutId: string) =>
    memory.create({ image: "img", rolloutId, owner: "resources", expiresAt: at + 3_600_000 });
  const poison = await make(`${tag}poison${RUN}`);
  const behind = await make(`${tag}behind${RUN}`);
  const provider = Object.assign(Object.create(listed) as typeof listed, {
    destroy: async (h: SandboxHandle) => {
      if (h.id !== poison.id) return memory.destroy(h);
      destroys.poison++;
      await hung.opened;
      throw new Error("the janitor was killed in this destroy");
    },
  });
  const deps = { ...own.deps, provider, now: () => at };
  return { memory, own, hung, destroys, listed, at, poison, behind, deps, ledger: own.deps.ledger };
}

describe("janitor", () => {
  let fleet: InProcessFleet;
  beforeAll(async () => {
    fleet = await startInProcessFleet({ provider: docker, startWorkers: false });
  });
  afterAll(async () => fleet.close());

  it("leaves a sandbox of another deployment with the same scope (its own Redis) until it expires, uncounted, and says so", async () => {
    // Two fleets with this file's scope: this one (instance "ours") and another ("theirs"),
    // whose rollouts this fleet's Redis does not know.
    const ours = new DockerSandboxProvider({ scope: docker.scope, instance: `ours-${RUN}` });
    const theirs = new DockerSandboxProvider({ scope: docker.scope, instance: `theirs-${RUN}` });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const warned = vi.spyOn(fleet.deps.logger, "warn");
    const deps = { ...fleet.deps, provider: ours, metrics };
    const live = await theirs.create({
      image: IMAGE,
      rolloutId: `theirs${Date.now()}`,
      owner: "resources",
      expiresAt: Date.now() + 3_600_000,
    });
    const counted = async () => (await metrics.sandboxesActive.get()).values.reduce((n, v) => n + v.value, 0);
    try {
      // Same scope: this fleet's provider lists it (never finds it for its own rollout).
      expect((await ours.list({ "fleet.rollout": live.rolloutId })).map((i) => i.handle.id)).toEqual([
        live.id,
      ]);
      // Hours past the grace period, its rollout unknown here: not this fleet's to judge.
      const later = { ...deps, now: () => Date.now() + 1_800_000 };
      const report = await janitorTick(later, { orphanGraceMs: 60_000 });
      expect(report.orphansRemoved).toBe(0);
      expect(await theirs.alive(live)).toBe(true);
      expect(await counted()).toBe(0);
      expect(warned).toHaveBeenCalledWith(
        expect.objectContaining({ instances: [`theirs-${RUN}`], own: `ours-${RUN}` }),
        expect.stringMatching(/another fleet with this FLEET_PREFIX/),
      );
      // Past its expiry, whoever made it: removed.
      const expired = { ...deps, now: () => Date.now() + 7_200_000 };
      expect((await janitorTick(expired, { orphanGraceMs: 60_000 })).orphansRemoved).toBeGreaterThanOrEqual(
        1,
      );
      expect(await theirs.alive(live)).toBe(false);
    } finally {
      warned.mockRestore();
      await theirs.destroy(live);
    }
  });

  it("removes a labelled sandbox whose rollout is unknown, but only past the grace period", async () => {
    const orphanId = `orphan${Date.now()}`;
    const handle = await docker.create({
      image: IMAGE,
      rolloutId: orphanId,
      owner: "resources",
      expiresAt: Date.now() + 3_600_000,
    });
    try {
      const fresh = await janitorTick(fleet.deps, { orphanGraceMs: 60_000 });
      expect(fresh.orphansRemoved).toBe(0);
      expect(await docker.alive(handle)).toBe(true);
      const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
      const report = await janitorTick(later, { orphanGraceMs: 60_000 });
      expect(report.orphansRemoved).toBeGreaterThanOrEqual(1);
      expect(await docker.alive(handle)).toBe(false);
    } finally {
      await docker.destroy(handle);
    }
  });

  it("two janitor passes at once remove an orphan once: counted once in their reports and in fleet_teardown_attempts_total (confirmed), the other already gone", async () => {
    const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
    // Other orphans of this scope, if any, out of the way first.
    await janitorTick(later, { orphanGraceMs: 60_000 });
    const handle = await docker.create({
      image: IMAGE,
      rolloutId: `orphan2x${Date.now()}`,
      owner: "resources",
      expiresAt: Date.now() + 3_600_000,
    });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    try {
      const reports = await Promise.all(
        [0, 1].map(() => janitorTick({ ...later, metrics }, { orphanGraceMs: 60_000 })),
      );
      expect(reports.flatMap((r) => r.errors)).toEqual([]);
      expect(reports[0]!.orphansRemoved + reports[1]!.orphansRemoved).toBe(1);
      const attempts = (await metrics.teardownAttempts.get()).values;
      expect(attempts.find((v) => v.labels.result === "confirmed")?.value).toBe(1);
      expect(await docker.alive(handle)).toBe(false);
    } finally {
      await docker.destroy(handle);
    }
  });

  it("leaves a sandbox on the teardown ledger to the ledger's backoff: one destroy per due retry, not one more every pass", async () => {
    const id = `ledgered${Date.now()}`;
    const handle = await docker.create({
      image: IMAGE,
      rolloutId: id,
      owner: "resources",
      expiresAt: Date.now() + 3_600_000,
    });
    let destroys = 0;
    const provider = Object.assign(Object.create(docker) as typeof docker, {
      destroy: async () => {
        destroys++;
        throw new Error("device or resource busy");
      },
    });
    const deps = { ...fleet.deps, provider };
    try {
      // Its rollout is unknown and the grace period long past: an orphan, whose destroy failed
      // just now and waits on the ledger.
      const at = Date.now() + 120_000;
      const entry = {
        key: `${id}:resources`,
        rolloutId: id,
        owner: "resources" as const,
        provider: docker.name,
        handle,
        createdAt: Date.now(),
        expiresAt: Date.now() + 3_600_000,
      };
      expect(entry.key).toBe(sandboxKey(id, "resources"));
      const recorded = (await fleet.deps.ledger.recordFailure(entry, "device or resource busy", at))!;
      await janitorTick({ ...deps, now: () => at }, { orphanGraceMs: 60_000 });
      expect(destroys).toBe(0); // not due yet
      await janitorTick({ ...deps, now: () => recorded.dueAt }, { orphanGraceMs: 60_000 });
      expect(destroys).toBe(1); // the ledger's retry, and no second try by the orphan sweep
      expect((await fleet.deps.ledger.pending()).find((e) => e.key === entry.key)?.attempts).toBe(2);
    } finally {
      await fleet.deps.ledger.confirm({ key: sandboxKey(id, "resources"), rolloutId: id });
      await docker.destroy(handle);
    }
  });

  it("a ledger entry whose destroy never returns (the pass dies in it) is counted and put off before it is tried: the next pass destroys the entry behind it and tries it again only after its backoff, until confirmed", async () => {
    const { memory, own, hung, destroys, at, poison, behind, deps, ledger } = await poisonedFleet("", false);
    const entryOf = (h: SandboxHandle) => ({
      key: sandboxKey(h.rolloutId, "resources"),
      rolloutId: h.rolloutId,
      owner: "resources" as const,
      provider: memory.name,
      handle: h,
      createdAt: at,
      expiresAt: at + 3_600_000,
    });
    // Both due; the poisoned one longer, so every pass reads it first.
    await ledger.schedule(entryOf(poison), at - 10_000);
    await ledger.schedule(entryOf(behind), at - 5_000);
    const options = { orphanGraceMs: 3_600_000 };
    const abandoned: Promise<unknown>[] = [];
    try {
      abandoned.push(janitorTick(deps, options));
      await vi.waitFor(() => expect(destroys.poison).toBe(1), { timeout: 10_000 });
      // The pass is gone with it (never to record anything); a fresh one runs.
      abandoned.push(janitorTick(deps, options));
      await vi.waitFor(async () => {
        expect(await memory.alive(behind)).toBe(false);
        expect(await ledger.isPending(behind.rolloutId)).toBe(false);
      }, 10_000);
      expect(destroys.poison).toBe(1); // not tried first again, nor at all before its backoff
      const [kept] = (await ledger.pending()).filter((e) => e.key === entryOf(poison).key);
      // Never lost: on the ledger, its attempt counted, due after its backoff.
      expect(kept).toMatchObject({ attempts: 1, lastError: expect.stringMatching(/no outcome recorded/) });
      expect(kept!.dueAt).toBeGreaterThan(at);
      // Once due, tried again; a destroy that returns this time confirms it.
      const report = await janitorTick({ ...deps, provider: memory, now: () => kept!.dueAt }, options);
      expect(report).toMatchObject({ retried: 1, confirmed: 1 });
      expect(await memory.alive(poison)).toBe(false);
      expect(await ledger.isPending(poison.rolloutId)).toBe(false);
      // The abandoned pass ending late (its destroy failing at last) brings no entry back.
      hung.open();
      await Promise.all(abandoned);
      expect(await ledger.size()).toBe(0);
    } finally {
      hung.open();
      await Promise.allSettled(abandoned);
      await own.close();
    }
  });

  it("an orphan whose destroy never returns (the pass dies in it) is put on the ledger, taken, before it is tried: the next pass removes the orphan behind it and runs its later steps, and the ledger step tries it again after its backoff, until confirmed", async () => {
    // Orphans (of rollouts this fleet does not know), listed in creation order: the poisoned first.
    const { memory, own, hung, destroys, listed, at, poison, behind, deps, ledger } = await poisonedFleet(
      "orphan",
      true,
    );
    const options = { orphanGraceMs: 60_000 };
    const abandoned: Promise<unknown>[] = [];
    try {
      abandoned.push(janitorTick(deps, options));
      await vi.waitFor(() => expect(destroys.poison).toBe(1), { timeout: 10_000 });
      // The pass is gone with it (never to record anything); a fresh one runs.
      const fresh = janitorTick(deps, options);
      abandoned.push(fresh);
      await vi.waitFor(async () => expect(await memory.alive(behind)).toBe(false), 10_000);
      // It ran to its end (the steps after the orphan sweep too), and left no entry of the one it removed.
      expect(await fresh).toMatchObject({ orphansRemoved: 1, retried: 0, errors: [] });
      expect(await ledger.isPending(behind.rolloutId)).toBe(false);
      expect(destroys.poison).toBe(1); // not tried first again, nor at all before its backoff
      const [kept] = (await ledger.pending()).filter(
        (e) => e.key === sandboxKey(poison.rolloutId, "resources"),
      );
      // Never lost: on the ledger, its attempt counted, due after its backoff.
      expect(kept).toMatchObject({
        handle: poison,
        attempts: 1,
        lastError: expect.stringMatching(/no outcome recorded/),
      });
      expect(kept!.dueAt).toBeGreaterThan(at);
      // Once due, tried again by the ledger step; a destroy that returns this time confirms it.
      const report = await janitorTick({ ...deps, provider: listed, now: () => kept!.dueAt }, options);
      expect(report).toMatchObject({ retried: 1, confirmed: 1, orphansRemoved: 0 });
      expect(await memory.alive(poison)).toBe(false);
      expect(await ledger.isPending(poison.rolloutId)).toBe(false);
      // The abandoned pass ending late (its destroy failing at last) brings no entry back.
      hung.open();
      await Promise.all(abandoned);
      expect(await ledger.size()).toBe(0);
    } finally {
      hung.open();
      await Promise.allSettled(abandoned);
      await own.close();
    }
  });

  it("an orphan whose ledger key holds a torn entry (not JSON) is still taken before its destroy: a pass that dies in it leaves the next pass to the orphans behind it", async () => {
    const { memory, own, hung, destroys, at, poison, behind, deps, ledger } = await poisonedFleet(
      "torn",
      true,
    );
    // Torn under the poisoned orphan's key (a write cut off, a hand edit): no release reads it.
    const tornKey = sandboxKey(poison.rolloutId, "resources");
    await own.redis.hset(ledger.keys.teardownEntries(), tornKey, "{torn");
    await own.redis.zadd(ledger.keys.teardownDue(), at + 3_600_000, tornKey);
    const options = { orphanGraceMs: 60_000 };
    const abandoned: Promise<unknown>[] = [];
    try {
      abandoned.push(janitorTick(deps, options));
      await vi.waitFor(() => expect(destroys.poison).toBe(1), { timeout: 10_000 });
      const fresh = janitorTick(deps, options);
      abandoned.push(fresh);
      await vi.waitFor(async () => expect(await memory.alive(behind)).toBe(false), 5_000);
      expect(await fresh).toMatchObject({ orphansRemoved: 1 });
      expect(destroys.poison).toBe(1);
      expect((await ledger.pending()).find((e) => e.key === tornKey)).toMatchObject({
        handle: poison,
        attempts: 1,
      });
    } finally {
      hung.open();
      await Promise.allSettled(abandoned);
      await own.close();
    }
  });

  it("an orphan taken whose destroy fails is counted once; one whose key holds another sandbox's entry is removed untaken, that entry kept; one whose own entry came since the sweep's look is left to the ledger step", async () => {
    const memory = new InMemorySandboxProvider();
    const own = await startInProcessFleet({ provider: memory, startWorkers: false });
    const at = Date.now();
    const make = (rolloutId: string) =>
      memory.create({ image: "img", rolloutId, owner: "resources", expiresAt: at + 3_600_000 });
    const failing = await make(`failing${RUN}`);
    const replacing = await make(`replacing${RUN}`);
    const raced = await make(`raced${RUN}`);
    const destroyed: string[] = [];
    const labelled = listedWithRolloutLabels(memory);
    const provider = Object.assign(Object.create(labelled) as typeof labelled, {
      destroy: async (h: SandboxHandle) => {
        destroyed.push(h.id);
        if (h.id === failing.id) throw new Error("device or resource busy");
        return memory.destroy(h);
      },
    });
    const { ledger } = own.deps;
    const entryOf = (h: SandboxHandle) => ({
      key: sandboxKey(h.rolloutId, "resources"),
      rolloutId: h.rolloutId,
      owner: "resources" as const,
      provider: memory.name,
      handle: h,
      createdAt: at,
      expiresAt: at + 3_600_000,
    });
    // Backing off under `replacing`'s key: the sandbox it replaced. Under `raced`'s: its own
    // failure, recorded after the sweep read the ledger (its look below finds nothing).
    const replaced = { ...replacing, id: `gone-${RUN}`, name: `gone-${RUN}` };
    await ledger.recordFailure(entryOf(replaced), "daemon blip", at + 600_000);
    await ledger.recordFailure(entryOf(raced), "daemon blip", at + 600_000);
    const before = await ledger.pending();
    const sweepsLook = Object.assign(Object.create(ledger) as typeof ledger, { pending: async () => [] });
    const deps = { ...own.deps, provider, ledger: sweepsLook, now: () => at };
    try {
      const report = await janitorTick(deps, { orphanGraceMs: 60_000 });
      const after = new Map((await ledger.pending()).map((e) => [e.key, e]));
      // Taken before its destroy, then failed: its error recorded, the attempt counted once.
      expect(after.get(entryOf(failing).key)).toMatchObject({
        handle: failing,
        attempts: 1,
        lastError: "device or resource busy",
      });
      expect(after.get(entryOf(failing).key)!.dueAt).toBeLessThanOrEqual(at + teardownBackoffMs(0, () => 1));
      // Removed as before, the entry of the one it replaced left as it was.
      expect(await memory.alive(replacing)).toBe(false);
      const heldBefore = (k: string) => before.find((e) => e.key === k);
      expect(after.get(entryOf(replacing).key)).toEqual(heldBefore(entryOf(replacing).key));
      // The ledger step's, on its backoff: neither tried nor touched.
      expect(destroyed).not.toContain(raced.id);
      expect(after.get(entryOf(raced).key)).toEqual(heldBefore(entryOf(raced).key));
      expect(report).toMatchObject({ orphansRemoved: 1, retried: 0 });
    } finally {
      await own.close();
    }
  });

  it("a slow or hung daemon holds up neither the deadline watchdog (it runs first) nor the pass (destroys stop at the budget)", async () => {
    const task = await helloFile();
    const [overdue] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 108 }]);
    const at = Date.now() + 120_000;
    const stamp = Date.now();
    const entries = ["a", "b"].map((n) => ({
      key: sandboxKey(`slow-${n}-${stamp}`, "resources"),
      rolloutId: `slow-${n}-${stamp}`,
      owner: "resources" as const,
      provider: docker.name,
      handle: {
        provider: docker.name,
        endpoint: "",
        id: `id-${n}-${stamp}`,
        name: `slow-${n}-${stamp}`,
        rolloutId: `slow-${n}-${stamp}`,
        owner: "resources" as const,
        volumes: [],
      },
      createdAt: stamp,
      expiresAt: stamp,
    }));
    for (const e of entries) await fleet.deps.ledger.schedule(e, stamp);
    const closeQueuedAtDestroy: boolean[] = [];
    const provider = Object.assign(Object.create(docker) as typeof docker, {
      // A daemon that answers only after the pass's budget is spent.
      destroy: async () => {
        closeQueuedAtDestroy.push(!!(await fleet.deps.queues.queues.close.getJob(`${overdue}.close`)));
        await new Promise((r) => setTimeout(r, 2_500));
        throw new Error("daemon timeout");
      },
    });
    try {
      const report = await janitorTick(
        { ...fleet.deps, provider, now: () => at },
        // (The budget counts from the ledger step's start, not the pass's: its Redis steps before take none of it.)
        { orphanGraceMs: 3_600_000, watchdogGraceMs: 1000, destroyBudgetMs: 2_000 },
      );
      expect(report.watchdogClosed).toBe(1);
      expect(closeQueuedAtDestroy).toEqual([true]); // the watchdog ran before any destroy
      expect(report.retried).toBe(1); // the second entry waits for the next pass
    } finally {
      for (const e of entries) await fleet.deps.ledger.confirm(e);
    }
  });

  it("a pass whose Redis steps before the ledger's took longer than the destroy budget (a slow Redis, a registry of thousands) still retries the due teardowns: the budget bounds the destroys, not the steps before them", async () => {
    const memory = new InMemorySandboxProvider();
    const own = await startInProcessFleet({ provider: memory, startWorkers: false });
    const realNow = Date.now.bind(Date);
    let taken = 0;
    const slow = vi.spyOn(Date, "now").mockImplementation(() => realNow() + taken);
    try {
      const at = realNow();
      const id = `slowsteps${RUN}`;
      // Its destroy failed 10 minutes ago: due now.
      await failedOnLedger(memory, own.deps.ledger, id, at, at - 600_000);
      // The trim step (Redis only, before the ledger's) takes two minutes of the pass.
      const queues = Object.assign(Object.create(own.deps.queues) as typeof own.deps.queues, {
        trimFinished: async (...args: Parameters<typeof own.deps.queues.trimFinished>) => {
          const trimmed = await own.deps.queues.trimFinished(...args);
          taken += 120_000;
          return trimmed;
        },
      });
      const report = await janitorTick({ ...own.deps, queues, now: () => at }, { orphanGraceMs: 60_000 });
      expect(taken).toBe(120_000);
      expect(report).toMatchObject({ retried: 1, confirmed: 1, errors: [] });
      expect(await memory.list()).toEqual([]);
    } finally {
      slow.mockRestore();
      await own.close();
    }
  });

  it("asks the provider to remove its stale helper containers; a failure there stops no other step", async () => {
    const asked: number[] = [];
    const provider = Object.assign(Object.create(fleet.deps.provider) as typeof fleet.deps.provider, {
      removeStaleHelpers: async (olderThanMs: number) => {
        asked.push(olderThanMs);
        throw new Error("daemon hiccup");
      },
    });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const report = await janitorTick({ ...fleet.deps, provider, metrics }, { orphanGraceMs: 60_000 });
    expect(asked).toEqual([STALE_HELPER_MS]);
    expect(report.errors).toEqual(["helpers: daemon hiccup"]);
    // Counted by step, so an alert sees a janitor whose step keeps failing.
    const failures = (await metrics.janitorStepFailures.get()).values.map((v) => [v.labels.step, v.value]);
    expect(failures.filter(([, n]) => n !== 0)).toEqual([["helpers", 1]]);
    // Every step's series starts at 0 (an alert on increase() misses a series' first sample).
    expect(failures.map(([step]) => step)).toEqual(
      expect.arrayContaining(["orphans", "admissions", "watchdog"]),
    );
  });

  it("a stored entry or rollout record that does not parse is reported and skipped: every other teardown, retry and orphan still goes", async () => {
    const { redis } = fleet;
    const { ledger, store } = fleet.deps;
    const now = Date.now();
    const later = { ...fleet.deps, now: () => now + 120_000 };
    const mk = (rolloutId: string) =>
      docker.create({ image: IMAGE, rolloutId, owner: "resources", expiresAt: now + 3_600_000 });
    // Torn or of another shape: a registry entry, a due ledger entry, a rollout's record.
    const badReg = `badreg${RUN}:resources`;
    const badDue = `baddue${RUN}:resources`;
    await redis.hset(ledger.keys.sandboxes(), badReg, '{"key":');
    await redis.hset(ledger.keys.teardownEntries(), badDue, JSON.stringify({ key: badDue, rolloutId: "x" }));
    await redis.zadd(ledger.keys.teardownDue(), now - 1_000, badDue);
    const unreadable = `unreadable${RUN}`;
    await redis.hset(store.keys.rollout(unreadable), "meta", "{torn");
    // Beside them: a due retry of a real sandbox, and an orphan of an unknown rollout.
    const retried = await mk(`retried${RUN}`);
    await ledger.schedule(
      {
        key: sandboxKey(retried.rolloutId, "resources"),
        rolloutId: retried.rolloutId,
        owner: "resources",
        provider: docker.name,
        handle: retried,
        createdAt: now,
        expiresAt: now + 3_600_000,
      },
      now,
    );
    const orphan = await mk(`orphan${RUN}`);
    const ofUnreadable = await mk(unreadable);
    // Past its fleet.expires, a sandbox goes whatever its rollout: its record is not even read.
    const expiredUnreadable = `expunreadable${RUN}`;
    await redis.hset(store.keys.rollout(expiredUnreadable), "meta", "{torn");
    const expired = await docker.create({
      image: IMAGE,
      rolloutId: expiredUnreadable,
      owner: "resources",
      expiresAt: now + 60_000,
    });
    try {
      const report = await janitorTick(later, { orphanGraceMs: 60_000 });
      expect(await docker.alive(retried)).toBe(false);
      expect(await docker.alive(orphan)).toBe(false);
      expect(await docker.alive(expired)).toBe(false);
      expect(await docker.alive(ofUnreadable)).toBe(true); // its rollout's state cannot be read
      expect(report.errors).toEqual(
        expect.arrayContaining([
          expect.stringMatching(new RegExp(`^registry ${badReg}: stored entry does not parse`)),
          expect.stringMatching(new RegExp(`^ledger ${badDue}: stored entry does not parse`)),
          expect.stringMatching(new RegExp(`^orphans ${unreadable}:resources: `)),
        ]),
      );
      // The bad due entry is kept, put off, not read again every pass.
      expect(Number(await redis.zscore(ledger.keys.teardownDue(), badDue))).toBeGreaterThan(now + 120_000);
      expect(await redis.hexists(ledger.keys.teardownEntries(), badDue)).toBe(1);
    } finally {
      for (const h of [retried, orphan, ofUnreadable, expired]) await docker.destroy(h);
      await redis.hdel(ledger.keys.sandboxes(), badReg);
      await redis.hdel(ledger.keys.teardownEntries(), badDue);
      await redis.zrem(ledger.keys.teardownDue(), badDue);
      await redis.del(store.keys.rollout(unreadable), store.keys.rollout(expiredUnreadable));
    }
  });

  it("due marks whose ledger entry was removed from outside are dropped and reported, and the real retry behind them goes: 50 of them took every pass's read", async () => {
    const { redis } = fleet;
    const { ledger } = fleet.deps;
    const now = Date.now();
    const later = { ...fleet.deps, now: () => now + 120_000 };
    const bare = Array.from({ length: 50 }, (_, i) => `bare${i}${RUN}:resources`);
    for (const key of bare) await redis.zadd(ledger.keys.teardownDue(), now - 10_000, key);
    const stuck = await docker.create({
      image: IMAGE,
      rolloutId: `behind${RUN}`,
      owner: "resources",
      expiresAt: now + 3_600_000,
    });
    const entry = {
      key: sandboxKey(stuck.rolloutId, "resources"),
      rolloutId: stuck.rolloutId,
      owner: "resources" as const,
      provider: docker.name,
      handle: stuck,
      createdAt: now,
      expiresAt: now + 3_600_000,
    };
    await ledger.schedule(entry, now);
    try {
      const report = await janitorTick(later, { orphanGraceMs: 3_600_000 });
      expect(report.errors).toEqual(
        expect.arrayContaining([
          expect.stringMatching(new RegExp(`^ledger ${bare[0]}: .*without its entry`)),
        ]),
      );
      expect(await redis.zmscore(ledger.keys.teardownDue(), ...bare)).toEqual(bare.map(() => null));
      // The next pass reaches the real entry (this one, if the read had room).
      await janitorTick(later, { orphanGraceMs: 3_600_000 });
      expect(await docker.alive(stuck)).toBe(false);
      expect(await redis.hexists(ledger.keys.teardownEntries(), entry.key)).toBe(0);
    } finally {
      await docker.destroy(stuck);
      await ledger.confirm(entry);
      await redis.zrem(ledger.keys.teardownDue(), ...bare);
    }
  });

  it("failure log rows this release cannot read (torn, or another release's kind) are left out: the rollout still closes, with the rows it can read", async () => {
    const task = await helloFile();
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    for (const stage of ["seed", "run", "verify"] as const) {
      expect(await runStageJob(stage, job(id), fleet.deps)).toBe("ok");
    }
    const readable = {
      stage: "run",
      terminal: false,
      failureKind: "sandbox_lost",
      mask: true,
      reason: "an earlier attempt's sandbox went away",
      at: Date.now(),
    };
    await fleet.redis.rpush(
      fleet.deps.store.keys.failures(id),
      "{torn",
      JSON.stringify({ ...readable, failureKind: "kind_of_a_later_release" }),
      JSON.stringify(readable),
    );
    expect(await fleet.deps.store.failureLog(id)).toEqual([readable]);
    expect(await runStageJob("close", job(id), fleet.deps)).toBe("ok");
    const result = await fleet.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
    expect(result!.failures).toEqual([
      expect.objectContaining({ failureKind: "sandbox_lost", stage: "run" }),
    ]);
  });

  it(`a rollout past its deadline whose stored data every close refuses (a receipt of another shape) is set aside after ${CLOSE_AGAIN_LIMIT} closes, not left in flight`, async () => {
    const task = await helloFile();
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [string];
    const { store, queues } = fleet.deps;
    // Valid JSON that no result can be composed from: every close throws on it.
    await fleet.redis.hset(store.keys.rollout(id), "r:run", JSON.stringify({ exec: { exitCode: "oops" } }));
    const later = { ...fleet.deps, now: () => Date.now() + 3_660_000 };
    const opts = { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 };
    const closeJob = () => queues.queues.close.getJob(`${id}.close`);
    for (let i = 0; i < CLOSE_AGAIN_LIMIT; i++) {
      await (await closeJob())?.remove();
      const report = await janitorTick(later, opts);
      expect(report.errors).toEqual([]);
      expect(report.watchdogClosed).toBe(1);
    }
    await (await closeJob())?.remove();
    const lines: string[] = [];
    const logger = createLogger({
      name: "test",
      level: "error",
      destination: { write: (l: string) => lines.push(l) },
    });
    const report = await janitorTick({ ...later, logger }, opts);
    expect(report.setAside).toBe(1);
    // The operator is told which field: the receipt's refusal, not just "cannot be read".
    const logged = lines.map((l) => JSON.parse(l)).find((l) => l.rolloutId === id);
    expect(logged?.cause).toMatch(/exitCode/);
    expect(report.errors).toEqual([
      expect.stringMatching(new RegExp(`^watchdog ${id}: its record cannot be read`)),
    ]);
    expect(await store.pastDeadline(Date.now() + 7_200_000)).not.toContain(id);
    expect(await store.unreadable()).toContain(id);
    expect((await store.get(id))!.status).toBe("accepted"); // kept as it is, for an operator
    await fleet.redis.zrem(store.keys.unreadable(), id);
  });

  it("retires a registry entry that does not parse once its rollout is over past the grace period and nothing labelled with it is left: kept aside, its rollout's teardown confirmed", async () => {
    const { redis } = fleet;
    const { ledger, store } = fleet.deps;
    const task = await helloFile();
    // A rollout closed with a torn entry in the registry: its teardown is pending.
    const [closed] = (await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [
      string,
    ];
    const tornClosed = sandboxKey(closed, "agent");
    await redis.hset(ledger.keys.sandboxes(), tornClosed, '{"key":');
    await runStageJob(
      "close",
      { data: { rolloutId: closed }, attemptsMade: 0, opts: { attempts: 3 } },
      fleet.deps,
    );
    expect((await store.getResult(closed))?.teardown).toBe("pending");
    // Of an unknown rollout, one with a container still labelled with it, one of a live rollout.
    const tornUnknown = `retire${RUN}:resources`;
    const withSandbox = `retirekeep${RUN}`;
    const sandbox = await docker.create({
      image: IMAGE,
      rolloutId: withSandbox,
      owner: "agent",
      expiresAt: Date.now() + 3_600_000,
    });
    const [live] = (await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [
      string,
    ];
    const torn = [
      tornClosed,
      tornUnknown,
      sandboxKey(withSandbox, "resources"),
      sandboxKey(live, "resources"),
    ];
    for (const key of torn.slice(1)) await redis.hset(ledger.keys.sandboxes(), key, '{"key":');
    const options = { orphanGraceMs: 60_000 };
    const registered = async () =>
      (
        await Promise.all(
          torn.map(async (k) => [k, await redis.hexists(ledger.keys.sandboxes(), k)] as const),
        )
      )
        .filter(([, n]) => n === 1)
        .map(([k]) => k);
    try {
      // The closed rollout's, within the grace period: kept, reported. The unknown rollout's (a
      // record gone: over for its retention already) goes; the one with a sandbox stays this
      // pass (the orphan sweep removes the sandbox after the registry step).
      const young = await janitorTick(fleet.deps, options);
      expect(await registered()).toEqual([torn[0], torn[2], torn[3]]);
      expect(young.registryRetired).toBe(1);
      // Kept as it was stored, for an operator.
      expect(await redis.hget(ledger.keys.retiredSandboxes(), tornUnknown)).toBe('{"key":');
      const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
      const first = await janitorTick(later, options);
      expect((await store.getResult(closed))?.teardown).toBe("confirmed");
      expect(await docker.alive(sandbox)).toBe(false);
      expect(first.registryRetired).toBe(1);
      expect(await registered()).toEqual([torn[2], torn[3]]);
      const second = await janitorTick(later, options);
      expect(second.registryRetired).toBe(1);
      expect(await registered()).toEqual([torn[3]]); // its rollout is in flight: its close reads it
    } finally {
      await docker.destroy(sandbox);
      await redis.hdel(ledger.keys.sandboxes(), ...torn);
      await redis.del(ledger.keys.retiredSandboxes());
      await redis.zrem(store.keys.inflight(), live, closed);
    }
  });

  it("reads no rollout record it need not: a registered sandbox past its expiry goes on the ledger whatever its rollout (an unreadable record kept it for good), a young labelled one is left unread", async () => {
    const { redis } = fleet;
    const { ledger, store } = fleet.deps;
    const now = Date.now();
    // A handle-less intent past its expiry (its create never happened), younger than the orphan
    // grace, of a rollout whose record cannot be read.
    const expiredId = `expreg${RUN}`;
    const key = sandboxKey(expiredId, "resources");
    const intent = {
      key,
      rolloutId: expiredId,
      owner: "resources" as const,
      provider: docker.name,
      handle: null,
      createdAt: now - 10 * 60_000,
      expiresAt: now - 1_000,
    };
    await redis.hset(ledger.keys.sandboxes(), key, JSON.stringify(intent));
    // A labelled sandbox younger than the orphan grace, of another unreadable rollout.
    const youngId = `youngunreadable${RUN}`;
    const young = await docker.create({
      image: IMAGE,
      rolloutId: youngId,
      owner: "resources",
      expiresAt: now + 3_600_000,
    });
    for (const id of [expiredId, youngId]) await redis.hset(store.keys.rollout(id), "meta", "{torn");
    try {
      const report = await janitorTick(fleet.deps, { orphanGraceMs: 3_600_000 });
      expect(report.errors.filter((e) => e.includes(expiredId) || e.includes(youngId))).toEqual([]);
      expect(report.expiredScheduled).toBeGreaterThanOrEqual(1);
      // Scheduled, then retried in the same pass: no sandbox by its label, past the intent grace.
      expect(await ledger.getSandbox(key)).toBeNull();
      expect(await docker.alive(young)).toBe(true);
    } finally {
      await docker.destroy(young);
      await redis.hdel(ledger.keys.sandboxes(), key);
      await redis.hdel(ledger.keys.teardownEntries(), key);
      await redis.zrem(ledger.keys.teardownDue(), key);
      await redis.del(store.keys.rollout(expiredId), store.keys.rollout(youngId));
    }
  });

  it("counts a registered sandbox as scheduled only when it put it on the ledger: one already there, backing off, is not counted again every pass (the pass is logged for it)", async () => {
    const { ledger } = fleet.deps;
    const now = Date.now();
    const rolloutId = `backingoff${RUN}`;
    const key = sandboxKey(rolloutId, "resources");
    const entry = {
      key,
      rolloutId,
      owner: "resources" as const,
      provider: docker.name,
      handle: {
        provider: docker.name,
        endpoint: "",
        id: `id-${rolloutId}`,
        name: rolloutId,
        rolloutId,
        owner: "resources" as const,
        volumes: [],
      },
      createdAt: now - 3_600_000,
      expiresAt: now + 3_600_000,
    };
    // Registered, its rollout unknown (over) past the grace; its destroy failed and backs off.
    await fleet.redis.hset(ledger.keys.sandboxes(), key, JSON.stringify(entry));
    await ledger.recordFailure(entry, "daemon blip", now + 600_000);
    try {
      const report = await janitorTick(fleet.deps, { orphanGraceMs: 60_000 });
      expect(report.expiredScheduled).toBe(0);
      expect(report.retried).toBe(0);
      expect((await ledger.pending()).find((e) => e.key === key)?.attempts).toBe(1);
    } finally {
      await ledger.confirm({ key, rolloutId });
    }
  });

  it("removes a labelled orphan whose key's ledger entry is another sandbox's (the one it replaced), leaving that entry to its backoff", async () => {
    const { ledger } = fleet.deps;
    const now = Date.now();
    const rolloutId = `replaced${RUN}`;
    const key = sandboxKey(rolloutId, "resources");
    const h2 = await docker.create({
      image: IMAGE,
      rolloutId,
      owner: "resources",
      expiresAt: now + 3_600_000,
    });
    // On the ledger and backing off: H1, the sandbox H2 replaced under the same key.
    const h1 = { ...h2, id: `gone-${RUN}`, name: `gone-${RUN}` };
    const base = { key, rolloutId, owner: "resources" as const, provider: docker.name, createdAt: now };
    await ledger.recordFailure(
      { ...base, handle: h1, expiresAt: now + 3_600_000 },
      "daemon blip",
      now + 600_000,
    );
    try {
      await janitorTick({ ...fleet.deps, now: () => now + 120_000 }, { orphanGraceMs: 60_000 });
      expect(await docker.alive(h2)).toBe(false);
      expect((await ledger.pending()).find((e) => e.key === key)?.handle?.id).toBe(h1.id);
    } finally {
      await docker.destroy(h2);
      await ledger.confirm({ key, rolloutId });
    }
  });

  it("a loop reports its first few failing entries one by one and the rest in one line (a rolling upgrade's old-shape registry is not a warning per entry per pass)", async () => {
    const { redis } = fleet;
    const { ledger } = fleet.deps;
    const keys = Array.from({ length: 10 }, (_, i) => `oldshape${RUN}-${i}:resources`);
    for (const key of keys)
      await redis.hset(ledger.keys.sandboxes(), key, JSON.stringify({ key, shape: "old" }));
    try {
      const report = await janitorTick(fleet.deps, { orphanGraceMs: 60_000 });
      const registry = report.errors.filter((e) => e.startsWith("registry"));
      expect(registry).toHaveLength(REPORTED_ENTRY_FAILURES + 1);
      expect(
        registry.slice(0, REPORTED_ENTRY_FAILURES).every((e) => /^registry oldshape.*does not parse/.test(e)),
      ).toBe(true);
      expect(registry.at(-1)).toMatch(
        new RegExp(
          `^registry: ${keys.length - REPORTED_ENTRY_FAILURES} more entries failed .*does not parse`,
        ),
      );
    } finally {
      await redis.hdel(ledger.keys.sandboxes(), ...keys);
    }
  });

  it("the ledger loop sums up its failing entries past the first few too, even one more; torn entries stop no gauge", async () => {
    const { redis } = fleet;
    const { ledger } = fleet.deps;
    const now = Date.now();
    const keys = Array.from(
      { length: REPORTED_ENTRY_FAILURES + 1 },
      (_, i) => `torndue${RUN}-${i}:resources`,
    );
    for (const key of keys) {
      await redis.hset(ledger.keys.teardownEntries(), key, "{torn");
      await redis.zadd(ledger.keys.teardownDue(), now - 1_000, key);
    }
    try {
      const report = await janitorTick(fleet.deps, { orphanGraceMs: 60_000 });
      const failed = report.errors.filter((e) => e.startsWith("ledger"));
      expect(failed).toHaveLength(REPORTED_ENTRY_FAILURES + 1);
      expect(failed.at(-1)).toMatch(/^ledger: 1 more entries failed .*does not parse/);
      // Nor does a torn entry stop the ledger's gauges (its age is skipped, not a failed step).
      expect(report.errors.filter((e) => e.startsWith("metrics"))).toEqual([]);
    } finally {
      await redis.hdel(ledger.keys.teardownEntries(), ...keys);
      await redis.zrem(ledger.keys.teardownDue(), ...keys);
    }
  });

  it("removes a sandbox volume its container left (a destroy cut off between the two) once its rollout is over or unknown past the grace period; never one a container uses, nor a live rollout's", async () => {
    const uncapped = new DockerSandboxProvider({ scope: `janitor-test-${RUN}`, defaults: { diskMb: null } });
    const task = await helloFile();
    const [liveId] = (await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [
      string,
    ];
    const now = Date.now();
    const mk = (rolloutId: string) =>
      uncapped.create({ image: IMAGE, rolloutId, owner: "resources", expiresAt: now + 3_600_000 });
    // Left by a destroy cut off after its container went: an unknown rollout's and a live one's.
    const left = await mk(`volleft${RUN}`);
    const ofLive = await mk(liveId);
    // Still used by its container, an orphan the ledger backs off (the orphan sweep leaves it).
    const used = await mk(`volused${RUN}`);
    const usedEntry = {
      key: sandboxKey(used.rolloutId, "resources"),
      rolloutId: used.rolloutId,
      owner: "resources" as const,
      provider: docker.name,
      handle: used,
      createdAt: now,
      expiresAt: now + 3_600_000,
    };
    await fleet.deps.ledger.recordFailure(usedEntry, "device or resource busy", now + 120_000);
    // The volumes of this file's fleet no container uses.
    const unused = async () => (await docker.listUnusedVolumes()).map((v) => v.name);
    try {
      // A destroy cut off after the container: the handle's volumes not reached.
      for (const h of [left, ofLive]) await uncapped.destroy({ ...h, volumes: [] });
      expect(left.volumes).toHaveLength(1);
      expect(await unused()).toEqual(expect.arrayContaining([left.volumes[0], ofLive.volumes[0]]));
      // Young: left alone (it may be a create under way).
      const young = await janitorTick(fleet.deps, { orphanGraceMs: 60_000 });
      expect(young.volumesRemoved).toBe(0);
      expect(await unused()).toContain(left.volumes[0]);
      const report = await janitorTick(
        { ...fleet.deps, now: () => now + 120_000 },
        { orphanGraceMs: 60_000 },
      );
      expect(await unused()).not.toContain(left.volumes[0]);
      expect(report.volumesRemoved).toBe(1);
      expect(await unused()).toContain(ofLive.volumes[0]); // its rollout is in flight
      expect(report.errors).toEqual([]);
      // The used one outlived the pass: its container still runs, and without it the volume is there.
      expect(await docker.alive(used)).toBe(true);
      await uncapped.destroy({ ...used, volumes: [] });
      expect(await unused()).toContain(used.volumes[0]);
    } finally {
      await fleet.deps.ledger.confirm({ key: usedEntry.key, rolloutId: used.rolloutId });
      for (const h of [left, ofLive, used]) await uncapped.destroy(h);
      // Out of the in-flight index: no later test's watchdog pass takes it for one of its own.
      await fleet.redis.zrem(fleet.deps.store.keys.inflight(), liveId);
    }
  });

  it("removes a sandbox whose fleet.expires passed, even for a live rollout", async () => {
    const task = await helloFile();
    // No workers run: the rollout stays `accepted`, well before its deadline.
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    const handle = await docker.create({
      image: IMAGE,
      rolloutId: id,
      owner: "agent",
      expiresAt: Date.now() + 1000,
    });
    try {
      const later = { ...fleet.deps, now: () => Date.now() + 5000 };
      await janitorTick(later, { orphanGraceMs: 3_600_000 });
      expect((await fleet.deps.store.get(id))?.status).toBe("accepted");
      expect((await docker.list()).some((s) => s.labels[LABEL_ROLLOUT] === id)).toBe(false);
    } finally {
      await docker.destroy(handle);
      // Ended, so the watchdog of the tests after this one (hours later) never counts it.
      await runStageJob("close", job(id), fleet.deps);
    }
  });

  it("leaves a live rollout's sandbox whose fleet.expires label is blank, as one without the label: no expiry to go by, not one long passed", async () => {
    const memory = new InMemorySandboxProvider();
    const own = await startInProcessFleet({ provider: memory, startWorkers: false });
    try {
      const task = await helloFile();
      // No workers run: the rollout stays `accepted`, well before its deadline.
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" } }])) as [string];
      const blank = await memory.create({
        image: "img",
        rolloutId: id,
        owner: "resources",
        expiresAt: Date.now() + 3_600_000,
      });
      const provider = Object.assign(Object.create(memory) as InMemorySandboxProvider, {
        list: async () =>
          (await memory.list()).map((info) => ({
            ...info,
            createdAt: Date.now(),
            labels: { ...info.labels, [LABEL_ROLLOUT]: id, [LABEL_OWNER]: "resources", "fleet.expires": " " },
          })),
      });
      const report = await janitorTick({ ...own.deps, provider }, { orphanGraceMs: 3_600_000 });
      expect(report.errors).toEqual([]);
      expect((await own.deps.store.get(id))?.status).toBe("accepted");
      expect(report.orphansRemoved).toBe(0);
      expect(await memory.alive(blank)).toBe(true);
    } finally {
      await own.close();
    }
  });

  it("removes an orphan whose fleet.expires label or creation time is no whole epoch ms (a fractional or huge label, no creation time given): its ledger entry is not refused before the destroy", async () => {
    const memory = new InMemorySandboxProvider();
    const own = await startInProcessFleet({ provider: memory, startWorkers: false });
    const at = Date.now();
    try {
      // Rollouts this fleet does not know; each sandbox's labels and creation time as listed.
      const odd: Array<{ expires: string; createdAt: number }> = [
        { expires: String(at - 60_000.5), createdAt: at - 3_600_000 }, // expired, fractional
        { expires: "1e20", createdAt: at - 3_600_000 }, // unknown rollout past the grace, far future
        { expires: String(at - 60_000), createdAt: Number.NaN }, // expired, no creation time
      ];
      const handles = await Promise.all(
        odd.map((_, i) =>
          memory.create({ image: "img", rolloutId: `oddlabel${i}${RUN}`, owner: "resources", expiresAt: at }),
        ),
      );
      const provider = Object.assign(Object.create(memory) as InMemorySandboxProvider, {
        list: async () =>
          (await memory.list()).map((info) => {
            const i = handles.findIndex((h) => h.id === info.handle.id);
            return {
              ...info,
              createdAt: odd[i]!.createdAt,
              labels: {
                ...info.labels,
                [LABEL_ROLLOUT]: info.handle.rolloutId,
                [LABEL_OWNER]: info.handle.owner,
                "fleet.expires": odd[i]!.expires,
              },
            };
          }),
      });
      const report = await janitorTick({ ...own.deps, provider, now: () => at }, { orphanGraceMs: 60_000 });
      expect(report.errors).toEqual([]);
      expect(report.orphansRemoved).toBe(3);
      expect(await Promise.all(handles.map((h) => memory.alive(h)))).toEqual([false, false, false]);
      expect(await own.deps.ledger.size()).toBe(0);
    } finally {
      await own.close();
    }
  });

  it("closes a rollout stuck past its deadline as masked deadline_exceeded", async () => {
    const task = await helloFile();
    // No workers run: the rollout sits in `accepted` until the watchdog closes it.
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 108 }]);
    const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
    const report = await janitorTick(later, { orphanGraceMs: 60_000, watchdogGraceMs: 1000 });
    expect(report.watchdogClosed).toBe(1);
    const closeJob = await fleet.deps.queues.queues.close.getJob(`${id}.close`);
    expect(closeJob).toBeTruthy();
  });

  it("while its provider gate says the provider is down, a pass runs only its Redis steps (the watchdog closes) and asks the provider nothing; a pass whose orphan listing fails marks the gate down", async () => {
    const task = await helloFile();
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 108 }]);
    // The daemon gone: every listing fails; each call the janitor makes is noted.
    const calls: string[] = [];
    const gone = new Proxy(docker, {
      get(target, prop, receiver) {
        const value = Reflect.get(target, prop, receiver);
        if (typeof value !== "function") return value;
        return (...args: unknown[]) => {
          calls.push(String(prop));
          if (prop === "list") return Promise.reject(new Error("docker list failed: ENOENT"));
          return value.apply(target, args);
        };
      },
    });
    const later = { ...fleet.deps, provider: gone, now: () => Date.now() + 120_000 };
    const trips: string[] = [];
    const providerGate = { up: false, trip: (reason: string) => void trips.push(reason) };
    const options = { orphanGraceMs: 60_000, watchdogGraceMs: 1000, providerGate };
    const down = await janitorTick(later, options);
    expect(down.watchdogClosed).toBe(1);
    expect(await fleet.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
    expect(down.providerDown).toBe(true);
    expect(down.errors).toEqual([]);
    expect(calls).toEqual([]);
    // Up by the gate, but the listing fails: the gate is told.
    providerGate.up = true;
    const up = await janitorTick(later, options);
    expect(up.providerDown).toBe(false);
    expect(up.errors).toContainEqual(expect.stringMatching(/^orphans: .*ENOENT/));
    expect(trips).toEqual([expect.stringContaining("ENOENT")]);
  });

  it("an overdue rollout whose record cannot be read (torn, without a status or with an unknown one, or gone) is set aside, its record kept: 100 of them do not hold up the watchdog for every other", async () => {
    const { redis } = fleet;
    const { store } = fleet.deps;
    const task = await helloFile();
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 108 }])) as [string];
    // The watchdog reads the first 100 overdue rollouts: 99 torn records and one gone, all due
    // before the real one.
    const torn = Array.from({ length: 99 }, (_, i) => `torn${RUN}-${i}`);
    const gone = `gone${RUN}`;
    for (const [i, t] of torn.entries()) {
      await redis.hset(store.keys.rollout(t), "meta", "{torn", "status", "accepted");
      await redis.zadd(store.keys.inflight(), i + 1, t);
    }
    // Two whose meta reads but whose status does not: its field deleted by hand, and a status
    // another release wrote. No script finalizes either (they take it for terminal).
    await redis.hdel(store.keys.rollout(torn[1]!), "status");
    await redis.hset(store.keys.rollout(torn[1]!), "meta", "{}");
    await redis.hset(store.keys.rollout(torn[2]!), "meta", "{}", "status", "paused");
    await redis.zadd(store.keys.inflight(), 100, gone);
    const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
    const options = { orphanGraceMs: 60_000, watchdogGraceMs: 1000 };
    try {
      const first = await janitorTick(later, options);
      const second = await janitorTick(later, options);
      // The second pass reaches the real rollout: the first took the unreadable ones out.
      expect(await fleet.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
      expect([first.setAside, second.setAside]).toEqual([100, 0]);
      expect(first.errors).toEqual(
        expect.arrayContaining([
          expect.stringMatching(new RegExp(`^watchdog ${torn[0]}: its record cannot be read: set aside`)),
        ]),
      );
      // Out of the in-flight index (no place, no backlog room held), into the unreadable one,
      // in deadline order; each torn record kept as it was.
      expect(await redis.zscore(store.keys.inflight(), torn[0]!)).toBeNull();
      expect(await store.unreadable(200)).toEqual([...torn, gone]);
      expect(await redis.hget(store.keys.rollout(torn[98]!), "meta")).toBe("{torn");
    } finally {
      await redis.del(store.keys.unreadable(), ...torn.map((t) => store.keys.rollout(t)));
      await redis.zrem(store.keys.inflight(), ...torn, gone);
    }
  });

  it("finishes an admission its dispatcher died in once past its grace: the recorded rollouts' seeds are enqueued, so they run instead of waiting out their deadline", async () => {
    const task = await helloFile();
    const requests = [0, 1, 2].map(() => RolloutRequest.parse({ task, agent: { harness: "oracle" } }));
    const { store, queues } = fleet.deps;
    const key = `stranded-${Date.now()}`;
    // The dispatcher recorded 2 of the batch's 3 rollouts, then died before enqueueing any seed.
    const dying = Object.create(store) as typeof store;
    dying.admit = async (metas, now) => {
      await store.admit(metas.slice(0, 2), now);
      throw new Error("the dispatcher died");
    };
    await expect(
      admit(
        dying,
        queues,
        { requests, batch: true, idempotencyKey: key },
        { maxTaskBytes: 10 * 1024 * 1024 },
      ),
    ).rejects.toThrow("the dispatcher died");
    const ids = rolloutIds(3, key, "batch");
    const seedJob = (id: string) => queues.queues.seed.getJob(`${id}.seed`);
    // Within its grace it may still be under way: left alone.
    expect((await janitorTick(fleet.deps, { orphanGraceMs: 60_000 })).admissionsFinished).toBe(0);
    expect(await seedJob(ids[0]!)).toBeUndefined();
    const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
    expect((await janitorTick(later, { orphanGraceMs: 60_000 })).admissionsFinished).toBe(1);
    for (const id of ids.slice(0, 2)) expect(await seedJob(id)).toBeDefined();
    expect(await store.get(ids[2]!)).toBeNull(); // never recorded: the client's replay sends it
    expect((await janitorTick(later, { orphanGraceMs: 60_000 })).admissionsFinished).toBe(0);
    for (const id of ids.slice(0, 2)) {
      await runStageJob(
        "close",
        { data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } },
        fleet.deps,
      );
    }
  });

  it("walks again a batch cancel its dispatcher died in once past its grace: every rollout the walk did not reach is cancelled and closed", async () => {
    const task = await helloFile();
    const requests = [0, 1, 2].map(() => RolloutRequest.parse({ task, agent: { harness: "oracle" } }));
    const { store, queues } = fleet.deps;
    const { ids, batchId } = await admit(
      store,
      queues,
      { requests, batch: true },
      { maxTaskBytes: 10 * 1024 * 1024 },
    );
    // The dispatcher's walk asked the first rollout to stop, then died.
    const dying = Object.create(store) as typeof store;
    dying.getResultsJson = async (page) => {
      await cancelRollout(store, queues, page[0]!, Date.now());
      throw new Error("the dispatcher died");
    };
    await expect(cancelBatch(dying, queues, batchId!)).rejects.toThrow("died");
    const cancelled = async () =>
      (await Promise.all(ids.map((id) => store.get(id)))).map((r) => r!.cancelRequested);
    expect(await cancelled()).toEqual([true, false, false]);
    // Within its grace the walk may still be under way: left alone.
    expect((await janitorTick(fleet.deps, { orphanGraceMs: 60_000 })).cancelsResumed).toBe(0);
    expect(await cancelled()).toEqual([true, false, false]);
    const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
    expect((await janitorTick(later, { orphanGraceMs: 60_000 })).cancelsResumed).toBe(1);
    for (const id of ids) {
      const rec = await store.get(id);
      expect(rec?.cancelRequested, id).toBe(true);
      expect(rec?.failure?.failureKind, id).toBe("cancelled");
      expect(await queues.queues.close.getJob(`${id}.close`), id).toBeDefined();
    }
    // Done: its note is gone, so the next pass walks nothing.
    expect((await janitorTick(later, { orphanGraceMs: 60_000 })).cancelsResumed).toBe(0);
    for (const id of ids) {
      await runStageJob(
        "close",
        { data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } },
        fleet.deps,
      );
      expect((await store.get(id))?.status, id).toBe("cancelled");
    }
  });

  it("enqueues again the stage job of an open rollout that an operator removed (Bull Board), once its record has not changed for the grace: it runs on instead of waiting out its deadline", async () => {
    const task = await helloFile();
    const { store, queues } = fleet.deps;
    const [admitted, seeded, untouched] = await fleet.submit(
      [0, 1, 2].map(() => ({ task, agent: { harness: "oracle" } })),
    );
    expect(await runStageJob("seed", job(seeded!), fleet.deps)).toBe("ok");
    // Removed by hand: the first one's seed job, the second one's run job. The third keeps its seed job.
    await (await queues.queues.seed.getJob(`${admitted}.seed`))!.remove();
    await (await queues.queues.run.getJob(`${seeded}.run`))!.remove();
    const ours = (ids: string[]) => ids.filter((id) => [admitted, seeded, untouched].includes(id)).sort();
    const all = { page: 100_000 };
    // Within the grace (a stage may be between its receipt and its next job): left alone.
    expect(ours(await requeueLostJobs(fleet.deps, Date.now(), { next: 0 }, all))).toEqual([]);
    expect(await queues.queues.seed.getJob(`${admitted}.seed`)).toBeUndefined();
    const in3min = Date.now() + 180_000;
    expect(ours(await requeueLostJobs(fleet.deps, in3min, { next: 0 }, all))).toEqual(
      [admitted, seeded].sort(),
    );
    // Enqueued once: the next walk finds them there.
    expect(ours(await requeueLostJobs(fleet.deps, in3min, { next: 0 }, all))).toEqual([]);
    expect(await queues.queues.seed.getJob(`${admitted}.seed`)).toBeDefined();
    expect(await queues.queues.run.getJob(`${seeded}.run`)).toBeDefined();
    // A janitor pass does it, a page of the in-flight index at a time.
    await (await queues.queues.seed.getJob(`${admitted}.seed`))!.remove();
    const later = { ...fleet.deps, now: () => Date.now() + 180_000 };
    const cursor = { next: 0 };
    let lostRequeued = 0;
    do {
      lostRequeued += (await janitorTick(later, { orphanGraceMs: 3_600_000, lostJobCursor: cursor }))
        .lostRequeued;
    } while (cursor.next !== 0);
    expect(lostRequeued).toBeGreaterThanOrEqual(1);
    expect(await queues.queues.seed.getJob(`${admitted}.seed`)).toBeDefined();
    // The run job enqueued again runs the stage as if it had never gone.
    expect(await runStageJob("run", job(seeded!), fleet.deps)).toBe("ok");
    expect((await store.get(seeded!))?.receipts.run).toBeDefined();
    for (const id of [admitted!, seeded!, untouched!]) {
      await fleet.deps.store.requestCancel(id);
      await runStageJob("close", job(id), fleet.deps);
      expect(isTerminal((await store.get(id))!.status), id).toBe(true);
    }
  });

  it(`a rollout whose close job is lost after ${CLOSE_AGAIN_LIMIT} closes is neither enqueued nor counted again by the lost-job step (each count keeps a field on its record): the watchdog closes it at its deadline`, async () => {
    const task = await helloFile();
    const { store, queues } = fleet.deps;
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" } }]);
    await (await queues.queues.seed.getJob(`${id}.seed`))?.remove();
    // Failed (a close is what it waits for), and its closes counted up to the limit; no close job.
    const failure = {
      stage: "seed",
      terminal: true,
      failureKind: "sandbox_lost",
      mask: true,
      reason: "gone",
      at: Date.now(),
    } as const;
    expect(await store.recordFailure(id!, failure, { beforeDecided: true })).toBe(true);
    for (let i = 0; i < CLOSE_AGAIN_LIMIT; i++) await store.noteCloseAgain(id!);
    const in3min = Date.now() + 180_000;
    for (let pass = 0; pass < 3; pass++) {
      expect(await requeueLostJobs(fleet.deps, in3min, { next: 0 }, { page: 100_000 })).not.toContain(id);
    }
    expect((await store.get(id!))!.closesAgain).toBe(CLOSE_AGAIN_LIMIT);
    expect(await queues.queues.close.getJob(`${id}.close`)).toBeUndefined();
    await store.requestCancel(id!);
    await runStageJob("close", job(id!), fleet.deps);
    expect(isTerminal((await store.get(id!))!.status)).toBe(true);
  });

  it("a graded rollout past its deadline keeps its reward; a queued close is left alone; a pass never logs twice", async () => {
    const task = await helloFile();
    const [graded, stuck] = await fleet.submit([
      { task, agent: { harness: "oracle" } },
      { task, agent: { harness: "oracle" }, deadlineS: 108 },
    ]);
    for (const stage of ["seed", "run", "verify"] as const) {
      expect(await runStageJob(stage, job(graded!), fleet.deps)).toBe("ok");
    }
    const closeOf = (id: string) => fleet.deps.queues.queues.close.getJob(`${id}.close`);
    expect(await (await closeOf(graded!))!.getState()).toBe("waiting");
    const later = { ...fleet.deps, now: () => Date.now() + 7_200_000 };
    const opts = { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 };

    // Both overdue: the graded one's close is queued (left alone); the stuck one has no job.
    const first = await janitorTick(later, opts);
    expect(first.errors).toEqual([]);
    expect(first.watchdogClosed).toBe(1);
    expect((await fleet.deps.store.get(graded!))!.failure).toBeNull();
    expect(await fleet.deps.store.failureLog(stuck!)).toHaveLength(1);
    // The stuck one's close is queued now: the next pass neither re-enqueues nor logs again.
    const second = await janitorTick(later, opts);
    expect(second.watchdogClosed).toBe(0);
    expect(await fleet.deps.store.failureLog(stuck!)).toHaveLength(1);

    // The graded one's close job is lost: the watchdog re-enqueues it without a failure.
    await (await closeOf(graded!))!.remove();
    expect((await janitorTick(later, opts)).watchdogClosed).toBe(1);
    expect(await runStageJob("close", job(graded!), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(graded!)).toMatchObject({
      status: "completed",
      reward: 1,
      teardown: "confirmed",
    });
    expect(await runStageJob("close", job(stuck!), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(stuck!)).toMatchObject({
      status: "masked",
      failureKind: "deadline_exceeded",
    });
  });

  it("a run whose agent runs longer than the lost-job grace is never taken for lost, though an operator obliterated its job: its heartbeat keeps the record fresh, one launch", async () => {
    let launches = 0;
    let release!: () => void;
    const released = new Promise<void>((r) => {
      release = r;
    });
    const own = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      deps: {
        createHarness: (agent) => ({
          name: agent.harness,
          async run({ signal }) {
            launches++;
            await new Promise<void>((resolve, reject) => {
              signal?.addEventListener("abort", () => reject(signal.reason), { once: true });
              void released.then(resolve);
            });
            return { exec: execResult(), answer: null, transcript: null, usage: null };
          },
        }),
        verify: async () => ({ reward: 1, details: { kind: "test" } }),
        stopPollMs: 50,
        stageBeatMs: 200,
      },
    });
    try {
      const task = await helloFile();
      const [id] = await own.submit([{ task, agent: { harness: "oracle" } }]);
      await vi.waitFor(() => expect(launches).toBe(1), { timeout: 10_000 });
      // An operator force-obliterates the run queue while the agent runs.
      await own.deps.queues.queues.run.obliterate({ force: true });
      // Fifteen beat periods: a stall of the test process (GC on a loaded host) misses no beat's window.
      const grace = 3_000;
      // The agent has run past the grace since its run began (the record's last stage stamp).
      const runStart = (await own.deps.store.get(id!))!.times["run:start"]!;
      await vi.waitFor(() => expect(Date.now() - runStart).toBeGreaterThan(grace + 500), { timeout: 10_000 });
      const report = await janitorTick(own.deps, { orphanGraceMs: 3_600_000, lostJobGraceMs: grace });
      expect(report.errors).toEqual([]);
      expect(report.lostRequeued).toBe(0);
      expect((await own.deps.store.get(id!))!.times["run:beat"]).toBeGreaterThan(runStart);
      release();
      const [result] = await own.waitForResults([id!]);
      expect(result).toMatchObject({ status: "completed", reward: 1 });
      expect(launches).toBe(1);
      expect((await own.deps.store.get(id!))!.launches).toBe(1);
    } finally {
      release();
      await own.close();
    }
  });

  it("a stage's beats go one at a time, and a beat that waited out a slow Redis is followed at once by a fresh one (its stamp is from when it was sent)", async () => {
    const released = latch();
    const every = 2_000;
    const own = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      startWorkers: false,
      deps: {
        createHarness: (agent) => ({
          name: agent.harness,
          async run() {
            await released.opened;
            return { exec: execResult(), answer: null, transcript: null, usage: null };
          },
        }),
        verify: async () => ({ reward: 1, details: { kind: "test" } }),
        stageBeatMs: every,
      },
    });
    const store = own.deps.store;
    const sent: number[] = [];
    let inFlight = 0;
    let most = 0;
    const slowAnswered = latch();
    let answeredAt = 0;
    const slowRedis = latch(); // the first beat's answer waits for it
    const slow = Object.assign(Object.create(store) as typeof store, {
      beat: async (...a: Parameters<typeof store.beat>) => {
        sent.push(Date.now());
        most = Math.max(most, ++inFlight);
        try {
          if (sent.length === 1) await slowRedis.opened;
          return await store.beat(...a);
        } finally {
          inFlight--;
          if (sent.length === 1) {
            answeredAt = Date.now();
            slowAnswered.open();
          }
        }
      },
    });
    try {
      const task = await helloFile();
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" } }])) as [string];
      expect(await runStageJob("seed", job(id), own.deps)).toBe("ok");
      const running = runStageJob("run", job(id), { ...own.deps, store: slow }).catch((e: unknown) => e);
      await vi.waitFor(() => expect(sent).toHaveLength(1), { timeout: 10_000 });
      // Answered after two periods and a half: no second beat sent meanwhile.
      await vi.waitFor(() => expect(Date.now() - sent[0]!).toBeGreaterThan(2.5 * every), { timeout: 10_000 });
      expect(sent).toHaveLength(1);
      slowRedis.open();
      await slowAnswered.opened;
      await vi.waitFor(() => expect(sent).toHaveLength(2), { timeout: 10_000 });
      // At once, not a whole period after the slow answer.
      expect(sent[1]! - answeredAt).toBeLessThan(every / 2);
      expect(most).toBe(1);
      released.open();
      await running;
    } finally {
      released.open();
      await own.close();
    }
  });

  it("a stage wedged past its rollout's end stops beating once the beat finds the record gone (or closed)", async () => {
    const released = latch();
    const own = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      startWorkers: false,
      deps: {
        createHarness: (agent) => ({
          name: agent.harness,
          async run() {
            await released.opened; // deaf to its signal
            return { exec: execResult(), answer: null, transcript: null, usage: null };
          },
        }),
        verify: async () => ({ reward: 1, details: { kind: "test" } }),
        stageBeatMs: 50,
      },
    });
    const beats: boolean[] = [];
    const store = own.deps.store;
    const counting = Object.assign(Object.create(store) as typeof store, {
      beat: async (...a: Parameters<typeof store.beat>) => {
        const open = await store.beat(...a);
        beats.push(open);
        return open;
      },
    });
    const deps = { ...own.deps, store: counting };
    let ticks = 0;
    const clock = setInterval(() => ticks++, 50);
    try {
      const task = await helloFile();
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" } }])) as [string];
      expect(await runStageJob("seed", job(id), deps)).toBe("ok");
      const running = runStageJob("run", job(id), deps).catch((e: unknown) => e);
      await vi.waitFor(() => expect(beats).toContain(true), { timeout: 5_000 });
      await own.redis.del(store.keys.rollout(id));
      await vi.waitFor(() => expect(beats).toContain(false), { timeout: 5_000 });
      // Ten more beat periods: no beat after the refused one.
      const from = ticks;
      await vi.waitFor(() => expect(ticks).toBeGreaterThanOrEqual(from + 10), { timeout: 5_000 });
      expect(beats.filter((open) => !open)).toEqual([false]);
      expect(beats.at(-1)).toBe(false);
      released.open();
      await running;
    } finally {
      clearInterval(clock);
      released.open();
      await own.close();
    }
  });

  it("a verify that stores its grade after the watchdog recorded the deadline is refused: the record shows no reward the masked result does not report", async () => {
    let grading!: () => void;
    const graded = new Promise<void>((r) => {
      grading = r;
    });
    let finish!: () => void;
    const finished = new Promise<void>((r) => {
      finish = r;
    });
    const own = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      startWorkers: false,
      deps: {
        createHarness: (agent) => ({
          name: agent.harness,
          run: async () => ({ exec: execResult(), answer: null, transcript: null, usage: null }),
        }),
        verify: async () => {
          grading();
          await finished;
          return { reward: 1, details: { kind: "test" } };
        },
      },
    });
    try {
      const task = await helloFile();
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" } }])) as [string];
      for (const stage of ["seed", "run"] as const)
        expect(await runStageJob(stage, job(id), own.deps)).toBe("ok");
      const verifying = runStageJob("verify", job(id), own.deps);
      await graded;
      // The watchdog's pass past the deadline while the tests still run (a verifier frozen past it).
      const later = { ...own.deps, now: () => Date.now() + 7_200_000 };
      const report = await janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
      expect(report.watchdogClosed).toBe(1);
      finish();
      expect(await verifying).toBe("ok");
      const rec = (await own.deps.store.get(id))!;
      expect(rec.receipts.verify).toBeUndefined();
      expect(rec.status).toBe("ran");
      expect(rec.failure?.failureKind).toBe("deadline_exceeded");
      expect(await runStageJob("close", job(id), own.deps)).toBe("ok");
      expect(await own.deps.store.getResult(id)).toMatchObject({
        status: "masked",
        reward: null,
        failureKind: "deadline_exceeded",
      });
    } finally {
      finish();
      await own.close();
    }
  });

  it("trims finished stage jobs past their retention, which BullMQ trims only when another job of the queue finishes: a key replayed after its rollout expired then admits a rollout that runs", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    const worker = new Worker("seed", null, { connection: duplicateRedis(own.redis), prefix: own.prefix });
    try {
      const task = await helloFile();
      const key = `expired-${RUN}`;
      const submit = () =>
        admit(
          own.deps.store,
          own.deps.queues,
          {
            requests: [RolloutRequest.parse({ task, agent: { harness: "oracle" } })],
            batch: false,
            idempotencyKey: key,
          },
          { maxTaskBytes: 10 * 1024 * 1024 },
        );
      const [id] = (await submit()).ids as [string];
      // Its seed failed for good (a missing image, say); the rollout closed, and much later its
      // record expired (the result's TTL: at least two days), the queue quiet all along.
      const taken = await worker.getNextJob("dead-end");
      expect(taken?.id).toBe(`${id}.seed`);
      await taken!.moveToFailed(new UnrecoverableError("invalid_task"), "dead-end");
      await own.deps.store.requestCancel(id);
      expect(await runStageJob("close", job(id), own.deps)).toBe("ok");
      const seedState = async () => (await own.deps.queues.queues.seed.getJob(`${id}.seed`))?.getState();
      expect(await seedState()).toBe("failed");
      for (const k of await own.redis.keys(`${own.deps.store.keys.rollout(id)}*`)) await own.redis.del(k);
      expect(await own.deps.store.get(id)).toBeNull();

      // Within its retention (a day for a failed job) a pass leaves it.
      expect((await janitorTick(own.deps, { orphanGraceMs: 3_600_000 })).jobsTrimmed).toBe(0);
      expect(await seedState()).toBe("failed");
      // A pass with the retention short: the old job goes, and the key's replay runs afresh.
      const report = await janitorTick(own.deps, {
        orphanGraceMs: 3_600_000,
        finishedJobAgeMs: { completed: 0, failed: 0 },
      });
      expect(report.errors).toEqual([]);
      expect(report.jobsTrimmed).toBeGreaterThanOrEqual(1);
      expect(await seedState()).toBeUndefined();
      expect((await submit()).created).toEqual([id]);
      expect(await seedState()).toBe("waiting");
    } finally {
      await worker.close();
      await own.close();
    }
  });

  it("an overdue rollout whose close was delayed far past any retry's backoff (by hand) has it promoted, its reward kept; a close delayed within a backoff is left to it", async () => {
    const task = await helloFile();
    const [far, near] = (await fleet.submit([
      { task, agent: { harness: "oracle" } },
      { task, agent: { harness: "oracle" } },
    ])) as [string, string];
    const close = fleet.deps.queues.queues.close;
    for (const [id, delay] of [
      [far, 10 * 365 * 86_400_000],
      [near, CLOSE_DELAY_LIMIT_MS - 60_000],
    ] as const) {
      for (const stage of ["seed", "run", "verify"] as const) {
        expect(await runStageJob(stage, job(id), fleet.deps)).toBe("ok");
      }
      // As a retry's backoff leaves it, then delayed again by an operator (Bull Board, BullMQ).
      await (await close.getJob(`${id}.close`))!.remove();
      const delayed = await close.add("close", { rolloutId: id }, { jobId: `${id}.close`, delay: 1_000 });
      await delayed.changeDelay(delay);
    }
    const later = { ...fleet.deps, now: () => Date.now() + 7_200_000 };
    const report = await janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
    expect(report.errors).toEqual([]);
    expect(report.closesPromoted).toBe(1);
    expect(report.watchdogClosed).toBe(0);
    expect(await (await close.getJob(`${far}.close`))!.getState()).toBe("waiting");
    expect(await (await close.getJob(`${near}.close`))!.getState()).toBe("delayed");
    expect(await runStageJob("close", job(far), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(far)).toMatchObject({
      status: "completed",
      reward: 1,
      teardown: "confirmed",
    });
    await (await close.getJob(`${near}.close`))!.promote();
    expect(await runStageJob("close", job(near), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(near)).toMatchObject({ status: "completed", reward: 1 });
  });

  it(`a page of overdue rollouts whose closes are queued does not hide a later overdue rollout from the watchdog: past the first ${WATCHDOG_PAGE}, a page a pass from a cursor`, async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    try {
      const task = await helloFile();
      // The first page's rollouts are the most overdue; the last one's deadline is later.
      const ids = await own.submit([
        ...Array.from({ length: WATCHDOG_PAGE }, () => ({
          task,
          agent: { harness: "oracle" as const },
          deadlineS: 3600,
        })),
        { task, agent: { harness: "oracle" as const }, deadlineS: 3700 },
      ]);
      const last = ids[WATCHDOG_PAGE]!;
      const later = { ...own.deps, now: () => Date.now() + 7_200_000 };
      const opts = { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000, watchdogCursor: { next: 0 } };
      // The first pass closes the first page (their closes then stay queued: no close worker).
      const passes = [];
      for (let i = 0; i < 2; i++) passes.push(await janitorTick(later, opts));
      expect(passes.flatMap((p) => p.errors)).toEqual([]);
      expect(passes.reduce((n, p) => n + p.watchdogClosed, 0)).toBe(WATCHDOG_PAGE + 1);
      expect((await own.deps.store.get(last))!.failure?.failureKind).toBe("deadline_exceeded");
      expect(await own.deps.queues.queues.close.getJob(`${last}.close`)).toBeDefined();
    } finally {
      await own.close();
    }
  });

  it(`a rollout whose close keeps ending without finalizing gets ${CLOSE_AGAIN_LIMIT} closes from the watchdog, then the janitor closes it: its sandbox through the ledger, a graded reward kept`, async () => {
    const task = await helloFile();
    const [graded, stuck] = (await fleet.submit([
      { task, agent: { harness: "oracle" }, deadlineS: 3600 },
      { task, agent: { harness: "oracle" }, deadlineS: 3600 },
    ])) as [string, string];
    for (const stage of ["seed", "run", "verify"] as const) {
      expect(await runStageJob(stage, job(graded), fleet.deps)).toBe("ok");
    }
    expect(await runStageJob("seed", job(stuck), fleet.deps)).toBe("ok");
    const { store, queues } = fleet.deps;
    const handles = await Promise.all(
      [graded, stuck].map(async (id) => (await store.get(id))!.receipts.seed!.handle),
    );
    // A minute past the deadline: within the sandboxes' expiry slack, so only close (or the
    // janitor's close) may take them.
    const later = { ...fleet.deps, now: () => Date.now() + 3_660_000 };
    const opts = { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 };
    const closeJobs = () =>
      Promise.all([graded, stuck].map((id) => queues.queues.close.getJob(`${id}.close`)));
    // Each close ends without finalizing (it failed, or killed its worker until BullMQ gave up).
    for (let i = 0; i < CLOSE_AGAIN_LIMIT; i++) {
      for (const j of await closeJobs()) await j?.remove();
      const report = await janitorTick(later, opts);
      expect(report.errors).toEqual([]);
      expect((await closeJobs()).map((j) => j?.id)).toEqual([`${graded}.close`, `${stuck}.close`]);
    }
    expect(await Promise.all(handles.map((h) => docker.alive(h)))).toEqual([true, true]);
    expect(await store.getResult(graded)).toBeNull();
    for (const j of await closeJobs()) await j?.remove();
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const report = await janitorTick({ ...later, metrics }, opts);
    expect(report.errors).toEqual([]);
    expect(report.closedByJanitor).toBeGreaterThanOrEqual(2);
    expect((await metrics.closesGivenUp.get()).values[0]?.value).toBe(report.closedByJanitor);
    expect(report.retried).toBeGreaterThanOrEqual(2); // the ledger step's destroys
    // No close enqueued again; the sandboxes went through the ledger in the same pass.
    expect(await closeJobs()).toEqual([undefined, undefined]);
    expect(await Promise.all(handles.map((h) => docker.alive(h)))).toEqual([false, false]);
    expect(await store.getResult(graded)).toMatchObject({
      status: "completed",
      reward: 1,
      teardown: "confirmed",
    });
    expect(await store.getResult(stuck)).toMatchObject({
      status: "masked",
      reward: null,
      failureKind: "deadline_exceeded",
      teardown: "confirmed",
    });
    expect((await fleet.deps.ledger.pending()).filter((e) => [graded, stuck].includes(e.rolloutId))).toEqual(
      [],
    );
  });

  it(`two janitor passes at once (a replica frozen past its pass's lock, its pass run again by another) count each close enqueued again once: the janitor's own close still comes after ${CLOSE_AGAIN_LIMIT} closes`, async () => {
    const task = await helloFile();
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [string];
    const { store, queues } = fleet.deps;
    const later = { ...fleet.deps, now: () => Date.now() + 3_660_000 };
    const opts = { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 };
    const closeJob = () => queues.queues.close.getJob(`${id}.close`);
    const twoPasses = async () => {
      const reports = await Promise.all([janitorTick(later, opts), janitorTick(later, opts)]);
      for (const r of reports) expect(r.errors).toEqual([]);
      return reports;
    };
    for (let i = 1; i <= CLOSE_AGAIN_LIMIT; i++) {
      const reports = await twoPasses();
      // One close enqueued (by one pass or the other), counted once.
      expect(reports.map((r) => r.watchdogClosed).sort()).toEqual([0, 1]);
      expect((await store.get(id))!.closesAgain).toBe(i);
      expect((await closeJob())?.id).toBe(`${id}.close`);
      expect(await store.getResult(id)).toBeNull();
      // It ends without finalizing.
      await (await closeJob())!.remove();
    }
    const reports = await twoPasses();
    expect(reports.reduce((n, r) => n + r.closedByJanitor, 0)).toBe(1);
    expect(await store.getResult(id)).toMatchObject({ status: "masked", failureKind: "deadline_exceeded" });
    expect(await closeJob()).toBeUndefined();
  });

  /** Enqueue rollout `id`'s close on `fleet` and fail it for good, unfinalized (a close that ran and failed). */
  async function failedClose(fleet: InProcessFleet, id: string): Promise<void> {
    await fleet.deps.queues.enqueue("close", id);
    const worker = new Worker("close", null, {
      connection: duplicateRedis(fleet.redis),
      prefix: fleet.prefix,
    });
    try {
      const taken = await worker.getNextJob("dead-end");
      expect(taken?.id).toBe(`${id}.close`);
      await taken!.moveToFailed(new UnrecoverableError("killed"), "dead-end");
    } finally {
      await worker.close();
    }
  }

  /** `queues` whose close job of rollout `id`, when a caller removes it, runs `remove` instead (given the job's own). */
  function closeRemovedBy(
    queues: InProcessFleet["deps"]["queues"],
    id: string,
    remove: (own: () => Promise<unknown>) => Promise<unknown>,
  ): InProcessFleet["deps"]["queues"] {
    const closeQueue = queues.queues.close;
    const close = Object.assign(Object.create(closeQueue) as typeof closeQueue, {
      getJob: async (jobId: string) => {
        const found = await closeQueue.getJob(jobId);
        if (jobId !== `${id}.close` || !found) return found;
        return Object.assign(Object.create(found) as typeof found, {
          remove: () => remove(() => found.remove()),
        });
      },
    });
    return Object.assign(Object.create(queues) as typeof queues, { queues: { ...queues.queues, close } });
  }

  it("a janitor pass that removes a failed close after another pass replaced it (the same job id) leaves the rollout its close: its lost-job step enqueues it again, counted (the janitor's own close comes one close sooner, never later)", async () => {
    // Its own fleet: the shared one's close queue holds other tests' jobs, which a worker takes first.
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    try {
      const task = await helloFile();
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [string];
      const { store, queues } = own.deps;
      const closeQueue = queues.queues.close;
      const later = { ...own.deps, now: () => Date.now() + 3_660_000 };
      const opts = { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 };
      await failedClose(own, id);
      expect(await (await closeQueue.getJob(`${id}.close`))!.getState()).toBe("failed");
      // Pass B reads the failed job, and is held at its removal while pass A replaces it.
      const atRemove = latch();
      const aDone = latch();
      const slowQueues = closeRemovedBy(queues, id, async (remove) => {
        atRemove.open();
        await aDone.opened;
        return remove();
      });
      const passB = janitorTick({ ...later, queues: slowQueues }, opts);
      await atRemove.opened;
      const reportA = await janitorTick(later, opts);
      expect(reportA.errors).toEqual([]);
      expect(reportA.watchdogClosed).toBe(1);
      expect(await (await closeQueue.getJob(`${id}.close`))!.getState()).toBe("waiting");
      aDone.open();
      const reportB = await passB;
      expect(reportB.errors).toEqual([]);
      expect(reportB.watchdogClosed).toBe(0);
      // B removed A's new close (its id); its watchdog enqueued none (A had counted), and its
      // lost-job step then found the rollout without a close: enqueued again, and counted.
      expect(reportB.lostRequeued).toBe(1);
      expect(await (await closeQueue.getJob(`${id}.close`))?.getState()).toBe("waiting");
      expect((await store.get(id))!.closesAgain).toBe(2);
    } finally {
      await own.close();
    }
  });

  it("a janitor pass that finds a failed close, which a stage worker removes and counts first (its enqueue to come), enqueues none either: its own remove then found nothing", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    try {
      const task = await helloFile();
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [string];
      const { store, queues } = own.deps;
      const closeQueue = queues.queues.close;
      const closeJob = () => closeQueue.getJob(`${id}.close`);
      await failedClose(own, id);
      // The pass reads the failed job; the stage worker (`closeAfterBullmqFailure`) removes it and
      // counts just before the pass's own remove, which then removes nothing (and says nothing).
      let workerCounted = false;
      const racingQueues = closeRemovedBy(queues, id, async (remove) => {
        await remove();
        expect(await store.noteCloseAgain(id)).toBe(1);
        workerCounted = true;
        return remove();
      });
      const report = await janitorTick(
        { ...own.deps, queues: racingQueues, now: () => Date.now() + 3_660_000 },
        // (No lost-job step: it would enqueue a close, counted, before the worker's enqueue.)
        { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000, lostJobGraceMs: 10 * 3_600_000 },
      );
      expect(report.errors).toEqual([]);
      expect(workerCounted).toBe(true);
      expect(report.watchdogClosed).toBe(0);
      expect(await closeJob()).toBeUndefined();
      expect((await store.get(id))!.closesAgain).toBe(1);
    } finally {
      await own.close();
    }
  });

  it("a janitor pass that finds no close job while a stage worker has counted a close it has not enqueued yet (BullMQ failed the last as stalled) enqueues none: the worker's is the one close, counted", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    try {
      const task = await helloFile();
      const [id] = (await own.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }])) as [string];
      const { store, queues } = own.deps;
      const closeJob = () => queues.queues.close.getJob(`${id}.close`);
      // The worker counts (`closeAfterBullmqFailure`) after the pass read the record and found no
      // close job, and before the pass counts; its enqueue comes after the pass.
      let workerCounted = false;
      const racing = Object.assign(Object.create(store) as typeof store, {
        noteCloseAgain: async (rolloutId: string, expected?: number) => {
          if (rolloutId === id && expected !== undefined && !workerCounted) {
            workerCounted = true;
            expect(await store.noteCloseAgain(id)).toBe(1);
          }
          return store.noteCloseAgain(rolloutId, expected);
        },
      });
      const report = await janitorTick(
        { ...own.deps, store: racing, now: () => Date.now() + 3_660_000 },
        // (No lost-job step: it would enqueue a close, counted, before the worker's enqueue.)
        { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000, lostJobGraceMs: 10 * 3_600_000 },
      );
      expect(report.errors).toEqual([]);
      expect(workerCounted).toBe(true);
      expect(report.watchdogClosed).toBe(0);
      // Nothing enqueued by the pass: one enqueued here could be taken and fail before the
      // worker's enqueue, which would then add a close no one counted.
      expect(await closeJob()).toBeUndefined();
      expect((await store.get(id))!.closesAgain).toBe(1);
      await queues.enqueue("close", id); // the worker's
      expect(await (await closeJob())!.getState()).toBe("waiting");
    } finally {
      await own.close();
    }
  });

  /**
   * `fleet.deps` under which every close job of rollout `id` kills each worker that takes it until
   * BullMQ fails it as stalled: what BullMQ's stalled check then leaves on it (a deferred failure)
   * is set before any worker may take it (the queue paused meanwhile). `enqueued`: how many
   * enqueues; `added`: how many of them added a job (BullMQ's events stream: a job id taken is a
   * `duplicated` event, nothing added).
   */
  function poisonedCloses(id: string) {
    const closeQueue = fleet.deps.queues.queues.close;
    let enqueued = 0;
    const queues = Object.assign(Object.create(fleet.deps.queues) as typeof fleet.deps.queues, {
      enqueue: async (...a: Parameters<typeof fleet.deps.queues.enqueue>) => {
        if (a[0] !== "close" || a[1] !== id) return fleet.deps.queues.enqueue(...a);
        await closeQueue.pause();
        await fleet.deps.queues.enqueue(...a);
        await fleet.redis.hset(
          `${fleet.prefix}:close:${id}.close`,
          "defa",
          "job stalled more than allowable limit",
        );
        enqueued++;
        await closeQueue.resume();
      },
    });
    const added = async () => {
      const events = await fleet.redis.xrange(`${fleet.prefix}:close:events`, "-", "+");
      const duplicated = events.filter(([, f]) => {
        const field = (k: string) => f[f.indexOf(k) + 1];
        return field("event") === "duplicated" && field("jobId") === `${id}.close`;
      }).length;
      return enqueued - duplicated;
    };
    return { deps: { ...fleet.deps, queues }, enqueued: () => enqueued, added };
  }

  it(`a close that kills every worker taking it (BullMQ fails it as stalled, and the stage workers enqueue it again) is enqueued at most ${CLOSE_AGAIN_LIMIT} times, then the rollout is closed without it`, async () => {
    const task = await helloFile();
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }]);
    const seedJob = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 3 } };
    expect(await runStageJob("seed", seedJob, fleet.deps)).toBe("ok");
    const handle = (await fleet.deps.store.get(id!))!.receipts.seed!.handle;
    const { deps, enqueued, added } = poisonedCloses(id!);
    const later = { ...deps, now: () => Date.now() + 3_660_000 };
    const workers = createStageWorkers(["close"], deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: 1,
      supervise: false,
    });
    // Janitor passes one after another (their first enqueues the rollout's first close).
    let passes = true;
    const janitor = (async () => {
      while (passes) await janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
    })();
    try {
      await vi.waitFor(
        async () => {
          const over = enqueued() > 4 * CLOSE_AGAIN_LIMIT;
          expect(over || (await fleet.deps.store.getResult(id!)) !== null).toBe(true);
        },
        { timeout: 60_000, interval: 50 },
      );
      // Without a bound the closes went on for good, each killing workers. (Closes added: an
      // enqueue of a close already there adds none.)
      expect(await added()).toBeLessThanOrEqual(CLOSE_AGAIN_LIMIT);
      expect(await fleet.deps.store.getResult(id!)).toMatchObject({
        status: "masked",
        failureKind: "deadline_exceeded",
      });
      await vi.waitFor(async () => expect(await docker.alive(handle)).toBe(false), { timeout: 30_000 });
    } finally {
      passes = false;
      await janitor;
      await workers.close(5_000);
      await docker.destroy(handle).catch(() => undefined);
    }
  });

  it(`a stage worker closes a rollout whose close it would enqueue a ${CLOSE_AGAIN_LIMIT + 1}th time at once, without destroys (no wait for the deadline); the janitor's next pass removes its sandbox`, async () => {
    const task = await helloFile();
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }]);
    const seedJob = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 3 } };
    expect(await runStageJob("seed", seedJob, fleet.deps)).toBe("ok");
    const { store } = fleet.deps;
    const handle = (await store.get(id!))!.receipts.seed!.handle;
    const { deps, enqueued } = poisonedCloses(id!);
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const workers = createStageWorkers(
      ["close"],
      { ...deps, metrics },
      {
        connection: fleet.redis,
        prefix: fleet.prefix,
        concurrency: 1,
        supervise: false,
      },
    );
    try {
      // Cancelled an hour before its deadline: its close is enqueued, and fails as stalled.
      expect(await store.requestCancel(id!)).toBe("seeded");
      await deps.queues.enqueue("close", id!);
      await vi.waitFor(async () => expect(await store.getResult(id!)).not.toBeNull(), {
        timeout: 60_000,
        interval: 50,
      });
      expect(enqueued()).toBe(1 + CLOSE_AGAIN_LIMIT); // its first close, then 3 again
      expect(await store.getResult(id!)).toMatchObject({ status: "cancelled", teardown: "pending" });
      expect((await metrics.closesGivenUp.get()).values[0]?.value).toBe(1);
      // No Docker call was made for it: the sandbox is the ledger's, gone at the next pass.
      expect(await docker.alive(handle)).toBe(true);
      await janitorTick(fleet.deps, { orphanGraceMs: 3 * 3_600_000 });
      expect(await docker.alive(handle)).toBe(false);
      expect(await store.getResult(id!)).toMatchObject({ status: "cancelled", teardown: "confirmed" });
    } finally {
      await workers.close(5_000);
      await docker.destroy(handle).catch(() => undefined);
    }
  });

  it("a close job that finalizes while the janitor closes the same rollout: one result, its sandbox gone, and the janitor does not count a close it lost", async () => {
    const task = await helloFile();
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 3600 }]);
    const stageJob = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 3 } };
    expect(await runStageJob("seed", stageJob, fleet.deps)).toBe("ok");
    const { store, ledger } = fleet.deps;
    const handle = (await store.get(id!))!.receipts.seed!.handle;
    // Its closes so far ended without finalizing: the next pass closes it itself.
    for (let i = 0; i < CLOSE_AGAIN_LIMIT; i++) await store.noteCloseAgain(id!);
    // The janitor's close is held at its finalize while a close job (enqueued again meanwhile,
    // e.g. for one BullMQ failed as stalled) runs and finalizes.
    let reached!: () => void;
    const atFinalize = new Promise<void>((r) => {
      reached = r;
    });
    let release!: () => void;
    const held = new Promise<void>((r) => {
      release = r;
    });
    const holding = Object.assign(Object.create(store) as typeof store, {
      finalizeStored: async (...a: Parameters<typeof store.finalizeStored>) => {
        reached();
        await held;
        return store.finalizeStored(...a);
      },
    });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const later = { ...fleet.deps, store: holding, metrics, now: () => Date.now() + 3_660_000 };
    try {
      const pass = janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
      await atFinalize;
      expect(await runStageJob("close", stageJob, fleet.deps)).toBe("ok");
      release();
      const report = await pass;
      expect(report.errors).toEqual([]);
      expect(await docker.alive(handle)).toBe(false);
      expect(await store.getResult(id!)).toMatchObject({
        status: "masked",
        failureKind: "deadline_exceeded",
        teardown: "confirmed",
      });
      expect((await ledger.pending()).filter((e) => e.rolloutId === id)).toEqual([]);
      // The close job finalized: not a rollout the janitor closed.
      expect(report.closedByJanitor).toBe(0);
      expect((await metrics.closesGivenUp.get()).values[0]?.value).toBe(0);
      expect((await metrics.rolloutsFinished.get()).values.filter((v) => v.value > 0)).toEqual([]);
    } finally {
      release();
      await docker.destroy(handle).catch(() => undefined);
    }
  });

  it("a verify that stores its reward between the watchdog's read and its write keeps it; a claimed cancel stays cancelled", async () => {
    const task = await helloFile();
    const [racing, cancelled] = (await fleet.submit([
      { task, agent: { harness: "oracle" } },
      { task, agent: { harness: "oracle" } },
    ])) as [string, string];
    for (const stage of ["seed", "run"] as const) {
      expect(await runStageJob(stage, job(racing), fleet.deps)).toBe("ok");
    }
    // The watchdog read the record (no verify receipt) and found no close job; the verify
    // finishes just before the watchdog writes its failure.
    const store = fleet.deps.store;
    const racingStore = Object.assign(Object.create(store) as typeof store, {
      recordFailure: async (...args: Parameters<typeof store.recordFailure>) => {
        if (args[0] === racing) expect(await runStageJob("verify", job(racing), fleet.deps)).toBe("ok");
        return store.recordFailure(...args);
      },
    });
    // A cancel claimed the stop; its close job was lost.
    expect(await store.requestCancel(cancelled)).toBe("accepted");
    await (await fleet.deps.queues.queues.close.getJob(`${cancelled}.close`))?.remove();
    const later = { ...fleet.deps, store: racingStore, now: () => Date.now() + 7_200_000 };
    const report = await janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
    expect(report.errors).toEqual([]);
    expect(report.watchdogClosed).toBeGreaterThanOrEqual(2);

    expect(await runStageJob("close", job(racing), fleet.deps)).toBe("ok");
    expect(await store.getResult(racing)).toMatchObject({ status: "completed", reward: 1 });
    expect(await runStageJob("close", job(cancelled), fleet.deps)).toBe("ok");
    expect(await store.getResult(cancelled)).toMatchObject({ status: "cancelled", reward: null });
  });

  it("with the Docker daemon down, the pass reports the orphan sweep's error and still runs the watchdog", async () => {
    const task = await helloFile();
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 108 }]);
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    // A pass while the daemon answered counted its sandboxes.
    await janitorTick({ ...fleet.deps, metrics }, { orphanGraceMs: 3 * 3_600_000 });
    const active = async () => (await metrics.sandboxesActive.get()).values.map((v) => v.labels.owner).sort();
    expect(await active()).toEqual(["agent", "resources"]);
    const dead = new DockerSandboxProvider({ docker: { socketPath: "/tmp/fleet-no-daemon-here.sock" } });
    const later = { ...fleet.deps, provider: dead, metrics, now: () => Date.now() + 120_000 };
    const report = await janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
    // Every step that needs the daemon reports its own error; the others still ran.
    expect(report.errors).toEqual([
      expect.stringMatching(/^orphans: /),
      expect.stringMatching(/^volumes: /),
      expect.stringMatching(/^helpers: /),
    ]);
    expect(report.watchdogClosed).toBe(1);
    expect(await fleet.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
    // No count rather than a stale one (which FleetSandboxLeak would page on).
    expect(await active()).toEqual([]);
  });

  it("replicas share one schedule: two janitors never run a pass at the same time", async () => {
    let active = 0;
    let maxActive = 0;
    let passes = 0;
    const slowDeps = {
      ...fleet.deps,
      ledger: new Proxy(fleet.deps.ledger, {
        get(target, prop, receiver) {
          if (prop === "listSandboxes") {
            return async () => {
              active++;
              maxActive = Math.max(maxActive, active);
              await new Promise((r) => setTimeout(r, 150));
              active--;
              passes++;
              return [];
            };
          }
          const v = Reflect.get(target, prop, receiver);
          return typeof v === "function" ? v.bind(target) : v;
        },
      }),
    };
    const opts = { connection: fleet.redis, prefix: fleet.prefix, intervalMs: 100, orphanGraceMs: 60_000 };
    const a = await startJanitor(slowDeps, opts);
    const b = await startJanitor(slowDeps, opts);
    const end = Date.now() + 30_000;
    while (passes < 5 && Date.now() < end) await new Promise((r) => setTimeout(r, 50));
    await a.close();
    await b.close();
    expect(passes).toBeGreaterThanOrEqual(5);
    expect(maxActive).toBe(1);
  });

  it("a replica that has run no pass for a few intervals (another runs them) drops its sandbox count", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const owners = async () => (await metrics.sandboxesActive.get()).values.map((v) => v.labels.owner).sort();
    const janitor = await startJanitor(
      { ...fleet.deps, metrics },
      { connection: fleet.redis, prefix: fleet.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    const schedule = new Queue(JANITOR_QUEUE, { connection: fleet.redis, prefix: fleet.prefix });
    try {
      await vi.waitFor(async () => expect(await owners()).toEqual(["agent", "resources"]), {
        timeout: 10_000,
      });
      // Its passes now go elsewhere (here: nowhere).
      await schedule.pause();
      await vi.waitFor(async () => expect(await owners()).toEqual([]), { timeout: 10_000 });
    } finally {
      await schedule.resume();
      await schedule.close();
      await janitor.close();
    }
  });

  /** A janitor passing every 200 ms, with metrics of its own, and its queue; `close` ends both. */
  /**
   * Make the janitor's schedule as a replica whose clock runs `aheadMs` ahead of this one's does:
   * its next tick dated on that clock (BullMQ dates ticks on the clock of whoever makes them).
   */
  async function scheduleOnClockAhead(schedule: Queue, aheadMs: number): Promise<void> {
    const realNow = Date.now.bind(Date);
    const ahead = vi.spyOn(Date, "now").mockImplementation(() => realNow() + aheadMs);
    try {
      await schedule.upsertJobScheduler(
        JANITOR_SCHEDULER,
        { every: 200 },
        { name: "tick", data: {}, opts: { removeOnComplete: 100, removeOnFail: 100 } },
      );
    } finally {
      ahead.mockRestore();
    }
  }

  async function fastJanitor() {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const janitor = await startJanitor(
      { ...fleet.deps, metrics },
      { connection: fleet.redis, prefix: fleet.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    const schedule = new Queue(JANITOR_QUEUE, { connection: fleet.redis, prefix: fleet.prefix });
    return {
      schedule,
      lastPass: async () => (await metrics.janitorLastPass.get()).values[0]?.value ?? 0,
      close: async () => {
        await schedule.close();
        await janitor.close();
      },
    };
  }

  it("starts its last-pass gauge from the newest pass any janitor finished (kept in Redis), not from its own start: one restarted after every pass it dies in still looks stopped", async () => {
    const startedAt = Date.now();
    const key = fleet.deps.store.keys.janitorLastPass();
    const first = await fastJanitor();
    try {
      // Only a pass's end moves the kept time on (a start writes it only when there is none, or
      // none that can be believed): waited for in Redis, not on the gauge, which starts from it.
      const keptAtStart = Number(await fleet.redis.get(key));
      await vi.waitFor(async () => expect(Number(await fleet.redis.get(key))).toBeGreaterThan(keptAtStart), {
        timeout: 10_000,
      });
    } finally {
      await first.close();
    }
    const kept = Number(await fleet.redis.get(key));
    expect(kept).toBeGreaterThan(startedAt);
    // No pass can run while the queue is paused: the next janitor's gauge is the kept pass's.
    const paused = new Queue(JANITOR_QUEUE, { connection: fleet.redis, prefix: fleet.prefix });
    try {
      await paused.pause();
      const second = await fastJanitor();
      try {
        expect(await second.lastPass()).toBe(kept / 1000);
      } finally {
        await second.close();
      }
      // A kept time ahead of the fleet's clock (a failover onto a node whose clock is behind) or
      // none that parses would keep the alert quiet: the next janitor starts from its own start.
      const key = fleet.deps.store.keys.janitorLastPass();
      for (const bad of [String(Date.now() + 86_400_000), "not a time"]) {
        await fleet.redis.set(key, bad);
        const before = Date.now();
        const third = await fastJanitor();
        try {
          expect(await third.lastPass()).toBeGreaterThanOrEqual(before / 1000 - 1);
          expect(await third.lastPass()).toBeLessThanOrEqual(Date.now() / 1000 + 1);
          expect(Number(await fleet.redis.get(key))).toBeLessThanOrEqual(Date.now() + 1_000);
        } finally {
          await third.close();
        }
      }
    } finally {
      await paused.resume();
      await paused.close();
    }
  });

  it("makes its schedule and its one-pass-at-a-time limit again after an obliterate of its queue (Bull Board: pause, obliterate)", async () => {
    const { schedule, close } = await fastJanitor();
    try {
      expect(await schedule.getGlobalConcurrency()).toBe(1);
      await schedule.pause();
      await schedule.obliterate({ force: true });
      expect(await schedule.getGlobalConcurrency()).toBeNull();
      await vi.waitFor(
        async () => {
          expect(await schedule.getJobScheduler(JANITOR_SCHEDULER)).toBeTruthy();
          expect(await schedule.getGlobalConcurrency()).toBe(1);
        },
        { timeout: 10_000 },
      );
    } finally {
      await close();
    }
  });

  it("takes off a rate limit set on its queue (Bull Board's queue 'rate limit'): passes go on at the schedule's pace, not one an hour", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const janitor = await startJanitor(
      { ...own.deps, metrics },
      { connection: own.redis, prefix: own.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    const schedule = new Queue(JANITOR_QUEUE, { connection: own.redis, prefix: own.prefix });
    const lastPass = async () => (await metrics.janitorLastPass.get()).values[0]?.value ?? 0;
    try {
      await schedule.setGlobalRateLimit(1, 3_600_000);
      // Passes, one after another, within a few intervals (not one an hour).
      for (let i = 0; i < 3; i++) {
        const after = Date.now() / 1000;
        await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(after), { timeout: 5_000 });
      }
      expect(await schedule.getGlobalRateLimit()).toBeNull();
    } finally {
      await schedule.close();
      await janitor.close();
      await own.close();
    }
  });

  it("takes off a rate limit set again on its queue within the window of one it took off: its passes, held by it from the first, go on", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const janitor = await startJanitor(
      { ...own.deps, metrics },
      { connection: own.redis, prefix: own.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    const schedule = new Queue(JANITOR_QUEUE, { connection: own.redis, prefix: own.prefix });
    const lastPass = async () => (await metrics.janitorLastPass.get()).values[0]?.value ?? 0;
    const passAfter = async (timeout: number) => {
      const after = Date.now() / 1000;
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(after), { timeout });
    };
    try {
      // The pass it lets through counts against it for its window (an hour), after it is taken off too.
      await schedule.setGlobalRateLimit(1, 3_600_000);
      await passAfter(5_000);
      await vi.waitFor(async () => expect(await schedule.getGlobalRateLimit()).toBeNull(), {
        timeout: 5_000,
      });
      // Set again (a script): the next tick is held at once, and no pass comes to take it off.
      await schedule.setGlobalRateLimit(1, 3_600_000);
      for (let i = 0; i < 3; i++) await passAfter(5_000);
      expect(await schedule.getGlobalRateLimit()).toBeNull();
    } finally {
      await schedule.close();
      await janitor.close();
      await own.close();
    }
  });

  it("schedules its next pass again when its tick's delay was changed far ahead (Bull Board's 'delay' of the tick job): passes go on", async () => {
    const { schedule, lastPass, close } = await fastJanitor();
    try {
      const first = await lastPass();
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(first), { timeout: 10_000 });
      // The delayed tick, put off an hour (Bull Board's job "delay" action).
      await vi.waitFor(
        async () => {
          const [tick] = await schedule.getDelayed();
          expect(tick).toBeDefined();
          await tick!.changeDelay(3_600_000);
        },
        { timeout: 5_000, interval: 20 },
      );
      const after = Date.now() / 1000;
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(after), { timeout: 10_000 });
    } finally {
      await close();
    }
  });

  it("schedules its next pass again when it was scheduled far ahead (by a replica whose clock ran 5 minutes ahead, now gone): passes go on", async () => {
    const { schedule, lastPass, close } = await fastJanitor();
    try {
      // The last pass's replica, its clock 5 minutes ahead, scheduled the next one on it.
      expect(await schedule.removeJobScheduler(JANITOR_SCHEDULER)).toBe(true);
      await scheduleOnClockAhead(schedule, 300_000);
      expect((await schedule.getJobScheduler(JANITOR_SCHEDULER))!.next!).toBeGreaterThan(
        Date.now() + 250_000,
      );
      // Wait until no pass is in flight, then for one that starts after it.
      const since = Date.now() / 1000 + 1;
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(since), { timeout: 10_000 });
      expect((await schedule.getJobScheduler(JANITOR_SCHEDULER))!.next!).toBeLessThan(Date.now() + 10_000);
    } finally {
      await close();
    }
  });

  it("schedules its next pass again when it was scheduled far ahead by a replica now gone whose clock jumped ahead since it last read Redis's: its note of that pass, ahead of the fleet's clock too, is no pass going on", async () => {
    const { schedule, lastPass, close } = await fastJanitor();
    const key = fleet.deps.store.keys.janitorLastPass();
    try {
      const realNow = Date.now.bind(Date);
      expect(await schedule.removeJobScheduler(JANITOR_SCHEDULER)).toBe(true);
      await scheduleOnClockAhead(schedule, 300_000);
      // No pass of this replica's in flight (its note would follow), then the gone replica's note
      // of its last pass: on its fleet clock (its own plus an offset measured before the jump).
      await vi.waitFor(async () => expect(await schedule.getActiveCount()).toBe(0), { timeout: 10_000 });
      await fleet.redis.set(key, String(realNow() + 300_000));
      const since = Date.now() / 1000 + 1;
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(since), { timeout: 10_000 });
      expect((await schedule.getJobScheduler(JANITOR_SCHEDULER))!.next!).toBeLessThan(Date.now() + 10_000);
    } finally {
      await close();
    }
  });

  it("schedules its next pass again when its own clock ran ahead for its last pass and was stepped back since (NTP), the only replica: passes go on, not once its clock caught up", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    // The fleet's clock (Redis's) stays right; this host's runs 5 minutes ahead for a while.
    const realNow = Date.now.bind(Date);
    const key = own.deps.store.keys.janitorLastPass();
    const janitor = await startJanitor(
      { ...own.deps, now: realNow },
      { connection: own.redis, prefix: own.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    const schedule = new Queue(JANITOR_QUEUE, { connection: own.redis, prefix: own.prefix });
    const passedSince = async (at: number, what: string) =>
      expect(Number(await own.redis.get(key)), what).toBeGreaterThan(at);
    try {
      const ahead = vi.spyOn(Date, "now").mockImplementation(() => realNow() + 300_000);
      try {
        // A pass that starts and ends on the clock ahead (its next tick dated on it).
        const since = realNow() + 300;
        await vi.waitFor(() => passedSince(since, "a pass on the clock ahead"), { timeout: 10_000 });
        await vi.waitFor(
          async () =>
            expect((await schedule.getJobScheduler(JANITOR_SCHEDULER))!.next!).toBeGreaterThan(
              realNow() + 250_000,
            ),
          { timeout: 10_000 },
        );
      } finally {
        ahead.mockRestore();
      }
      // Stepped back: the next tick 5 minutes off. Passes go on all the same.
      const stepped = Date.now();
      await vi.waitFor(() => passedSince(stepped, "a pass after the step back"), { timeout: 10_000 });
    } finally {
      await schedule.close();
      await janitor.close();
      await own.close();
    }
  });

  it("leaves the schedule alone while another replica runs the passes, though its own clock is behind theirs (the next tick looks far ahead to it): made again every check, each an extra pass", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    // This host's clock is 30 s behind the fleet's (Redis's), on which the other replica runs.
    const skewMs = 30_000;
    const fleetNow = () => Date.now() + skewMs;
    const lines: string[] = [];
    const logger = createLogger({
      name: "test",
      level: "warn",
      destination: { write: (l: string) => lines.push(l) },
    });
    const schedule = new Queue(JANITOR_QUEUE, { connection: own.redis, prefix: own.prefix });
    // The other replica's last pass dated the next tick on its clock (the fleet's).
    await scheduleOnClockAhead(schedule, skewMs);
    const lookups = vi.spyOn(Queue.prototype, "getJobScheduler");
    const janitor = await startJanitor(
      { ...own.deps, logger, now: fleetNow },
      { connection: own.redis, prefix: own.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    // Its passes go on, each ending with a note of it.
    const passes = setInterval(() => {
      void own.redis.set(own.deps.store.keys.janitorLastPass(), String(fleetNow())).catch(() => undefined);
    }, 100);
    try {
      const next = (await schedule.getJobScheduler(JANITOR_SCHEDULER))!.next!;
      expect(next).toBeGreaterThan(Date.now() + 2 * 200);
      // This replica, no pass of its own for a few intervals, checks the schedule: three checks,
      // or until it made the schedule again (from its own clock: then it takes the next pass).
      const checks = () => lookups.mock.contexts.filter((queue) => queue !== schedule).length;
      const nextNow = async () => (await schedule.getJobScheduler(JANITOR_SCHEDULER))?.next;
      await vi.waitFor(async () => expect(checks() >= 3 || (await nextNow()) !== next).toBe(true), {
        timeout: 4_000,
      });
      expect(await nextNow()).toBe(next);
      expect(lines.map((l) => JSON.parse(l).msg)).not.toContainEqual(
        expect.stringContaining("scheduled far ahead"),
      );
    } finally {
      clearInterval(passes);
      lookups.mockRestore();
      await schedule.close();
      await janitor.close();
      await own.close();
    }
  });

  it("says when it last finished a pass (FleetJanitorPassesStopped), and makes its schedule again when someone removed it", async () => {
    const { schedule, lastPass, close } = await fastJanitor();
    try {
      // From its start the newest pass kept in Redis (see "starts its last-pass gauge from the
      // newest pass"), then each pass's end.
      const first = await lastPass();
      expect(first).toBeGreaterThan(0);
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(first), { timeout: 10_000 });
      // Bull Board's job-scheduler "remove": no tick is made any more...
      expect(await schedule.removeJobScheduler(JANITOR_SCHEDULER)).toBe(true);
      expect(await schedule.getJobScheduler(JANITOR_SCHEDULER)).toBeUndefined();
      // ...until this janitor, a few intervals without a pass, makes it again; passes resume.
      await vi.waitFor(async () => expect(await schedule.getJobScheduler(JANITOR_SCHEDULER)).toBeTruthy(), {
        timeout: 10_000,
      });
      const after = Date.now() / 1000;
      await vi.waitFor(async () => expect(await lastPass()).toBeGreaterThan(after), { timeout: 10_000 });
    } finally {
      await close();
    }
  });

  it("ages its teardown ledger on the fleet's clock, on which the entries are dated: a janitor host 5 minutes ahead of Redis does not page for a fresh entry", async () => {
    const own = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    try {
      const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
      const fleetNow = () => Date.now() - 300_000;
      const deps = { ...own.deps, metrics, now: fleetNow };
      const rolloutId = `aged${RUN}`;
      const handle = {
        provider: "docker" as const,
        endpoint: "",
        id: `id-${rolloutId}`,
        name: rolloutId,
        rolloutId,
        owner: "resources" as const,
        volumes: [],
      };
      const entry = {
        key: sandboxKey(rolloutId, "resources"),
        rolloutId,
        owner: "resources" as const,
        provider: "docker" as const,
        handle,
        createdAt: fleetNow(),
        expiresAt: fleetNow() + 3_600_000,
      };
      await own.deps.ledger.recordFailure(entry, "device or resource busy", fleetNow());
      await janitorTick(deps, { orphanGraceMs: 3_600_000 });
      const age = (await metrics.teardownLedgerOldestAge.get()).values[0]?.value;
      expect(age).toBeDefined();
      expect(age!).toBeLessThan(5);
    } finally {
      await own.close();
    }
  });

  it("a replica that has run no pass for a few intervals drops its teardown ledger gauges (a stale oldest age would page)", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const samples = async () => [
      (await metrics.teardownLedgerEntries.get()).values.length,
      (await metrics.teardownLedgerOldestAge.get()).values.length,
    ];
    const janitor = await startJanitor(
      { ...fleet.deps, metrics },
      { connection: fleet.redis, prefix: fleet.prefix, intervalMs: 200, orphanGraceMs: 60_000 },
    );
    const schedule = new Queue(JANITOR_QUEUE, { connection: fleet.redis, prefix: fleet.prefix });
    try {
      await vi.waitFor(async () => expect(await samples()).toEqual([1, 1]), { timeout: 10_000 });
      // Its passes now go elsewhere (here: nowhere); the dispatcher still samples the ledger.
      await schedule.pause();
      await vi.waitFor(async () => expect(await samples()).toEqual([0, 0]), { timeout: 10_000 });
    } finally {
      await schedule.resume();
      await schedule.close();
      await janitor.close();
    }
  });

  it("a Redis outage's connection errors are not printed raw by the janitor's queue (the connection's owner logs them)", async () => {
    const printed = vi.spyOn(console, "error").mockImplementation(() => undefined);
    const heard: unknown[] = [];
    const owner = (err: unknown) => heard.push(err);
    fleet.redis.on("error", owner);
    const outage = () => fleet.redis.emit("error", new Error("connect ECONNREFUSED 127.0.0.1:6379"));
    // What this test's other users of the connection print (the test fleet's stage queues have
    // no listener of their own: the worker apps add one), before the janitor starts.
    outage();
    const before = printed.mock.calls.length;
    const janitor = await startJanitor(fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      intervalMs: 60_000,
      orphanGraceMs: 60_000,
    });
    try {
      outage();
      expect(heard).toHaveLength(2);
      expect(printed.mock.calls.length - before).toBe(before);
    } finally {
      fleet.redis.off("error", owner);
      printed.mockRestore();
      await janitor.close();
    }
  });

  it("counts a pass whose replica died holding it as stalled on the janitor queue (FleetJobsStalling)", async () => {
    // Its own prefix: no other test's schedule or passes on this janitor queue.
    const prefix = `{jstall-${randomUUID().slice(0, 8)}}`;
    const queue = new Queue(JANITOR_QUEUE, { connection: fleet.redis, prefix });
    // A replica that took a pass and died: the job active under a 200 ms lock nobody renews
    // (a manual fetch extends no lock).
    const dead = new Worker(JANITOR_QUEUE, null, {
      connection: duplicateRedis(fleet.redis),
      prefix,
      lockDuration: 200,
    });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const stalled = async () =>
      (await metrics.queueStalledJobs.get()).values.find((v) => v.labels.queue === JANITOR_QUEUE)?.value;
    let janitor: Awaited<ReturnType<typeof startJanitor>> | null = null;
    try {
      await queue.add("tick", {});
      const taken = await dead.getNextJob("dead-replica");
      expect(taken?.name).toBe("tick");
      await dead.close(true);
      janitor = await startJanitor(
        { ...fleet.deps, metrics },
        {
          connection: fleet.redis,
          prefix,
          intervalMs: 60_000,
          orphanGraceMs: 60_000,
          stalledIntervalMs: 300,
        },
      );
      expect(await stalled()).toBe(0); // the series is there from the start
      const end = Date.now() + 30_000;
      while ((await stalled()) !== 1 && Date.now() < end) await new Promise((r) => setTimeout(r, 50));
      expect(await stalled()).toBe(1);
    } finally {
      await janitor?.close();
      await dead.close(true).catch(() => undefined);
      await queue.obliterate({ force: true });
      await queue.close();
    }
  });

  it("shutdown cuts off a pass that hangs instead of waiting for it", async () => {
    let started = false;
    const hanging = {
      ...fleet.deps,
      ledger: new Proxy(fleet.deps.ledger, {
        get(target, prop, receiver) {
          if (prop === "listSandboxes") {
            return () => {
              started = true;
              return new Promise(() => undefined); // a Docker or Redis call that never answers
            };
          }
          const v = Reflect.get(target, prop, receiver);
          return typeof v === "function" ? v.bind(target) : v;
        },
      }),
    };
    const janitor = await startJanitor(hanging, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      intervalMs: 100,
      orphanGraceMs: 60_000,
    });
    const end = Date.now() + 30_000;
    while (!started && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
    expect(started).toBe(true);
    // Without the budget, close waits for the pass forever and this test times out; within it,
    // not the cut-off's fixed second past a budget under it.
    const since = performance.now();
    await janitor.close(300);
    expect(performance.now() - since).toBeLessThan(800);
  }, 20_000);

  it("a gateway network that will not go fails the networks step (counted), and the others are still removed", async () => {
    const removed: string[] = [];
    const stuck = `gone-stuck-${Date.now()}`;
    const networks = {
      ensure: async () => {
        throw new Error("not used");
      },
      allowGateway: async () => undefined,
      list: async () => [
        { name: "fleet-gw-stuck", rolloutId: stuck, createdAt: 0 },
        { name: "fleet-gw-fine", rolloutId: `gone-fine-${Date.now()}`, createdAt: 0 },
      ],
      remove: async (_id: string, name?: string) => {
        if (name === "fleet-gw-stuck") throw new Error("network has active endpoints");
        removed.push(name!);
        return { alreadyGone: false };
      },
    };
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
    const report = await janitorTick({ ...fleet.deps, networks, metrics }, { orphanGraceMs: 60_000 });
    expect(removed).toEqual(["fleet-gw-fine"]);
    expect(report.errors).toEqual([
      "networks: could not remove 1 gateway network(s): fleet-gw-stuck: network has active endpoints",
    ]);
    const failures = (await metrics.janitorStepFailures.get()).values.filter((v) => v.value !== 0);
    expect(failures.map((v) => [v.labels.step, v.value])).toEqual([["networks", 1]]);
    // Kept for a retry by rollout id: were the network gone with its firewall rules left,
    // nothing would list it again.
    expect(await fleet.deps.ledger.networkRetries(Date.now())).not.toContain(stuck); // not this pass
    expect(await fleet.deps.ledger.networkRetries(Date.now() + 120_000)).toContain(stuck);
    await fleet.deps.ledger.networkRemoved(stuck);
  });

  it("a finished rollout's gateway network still holding its sandbox, whose teardown backs off on the ledger, is retried without failing the networks step: that is the ledger's to say", async () => {
    const memory = new InMemorySandboxProvider();
    const own = await startInProcessFleet({ provider: memory, startWorkers: false });
    const { ledger } = own.deps;
    const listed = `gwheld${RUN}`;
    const retried = `gwheldretry${RUN}`;
    const tries: string[] = [];
    const networks = {
      ensure: async () => {
        throw new Error("not used");
      },
      allowGateway: async () => undefined,
      list: async () => [{ name: `fleet-gw-${listed}`, rolloutId: listed, createdAt: 0 }],
      remove: async (id: string) => {
        tries.push(id);
        throw new Error(`network fleet-gw-${id} has active endpoints`);
      },
    };
    try {
      const now = Date.now();
      // Each rollout's sandbox: its destroy failed just now, due again after its backoff.
      for (const id of [listed, retried]) {
        await failedOnLedger(memory, ledger, id, now, now);
      }
      // Close could not remove the second's network either (its sandbox was still on it).
      await ledger.networkRemovalFailed(retried, now - 1_000);
      const metrics = createFleetMetrics(createMetricsRegistry({ app: "janitor-test" }));
      const report = await janitorTick(
        { ...own.deps, networks, metrics, now: () => now },
        { orphanGraceMs: 60_000 },
      );
      expect(tries).toEqual([listed, retried]);
      expect(report.errors).toEqual([]);
      const failures = (await metrics.janitorStepFailures.get()).values.filter((v) => v.value !== 0);
      expect(failures).toEqual([]);
      // Still retried, later.
      expect(await ledger.networkRetries(now + 120_000)).toEqual(expect.arrayContaining([listed, retried]));
    } finally {
      for (const id of [listed, retried]) {
        await ledger.confirm({ key: sandboxKey(id, "resources"), rolloutId: id });
        await ledger.networkRemoved(id);
      }
      await own.close();
    }
  });

  it("a gateway network whose rollout record cannot be read is reported and skipped (removed once older than any rollout can live): the other networks and the due network retries still go", async () => {
    const { redis } = fleet;
    const { store, ledger } = fleet.deps;
    const unreadable = `gwunreadable${RUN}`;
    const unreadableOld = `gwunreadableold${RUN}`;
    const over = `gwover${RUN}`;
    const retry = `gwretry${RUN}`;
    await redis.hset(store.keys.rollout(unreadable), "meta", "{torn");
    await redis.hset(store.keys.rollout(unreadableOld), "meta", "{torn");
    await ledger.networkRemovalFailed(retry, Date.now() - 1_000);
    const removed: string[] = [];
    const networks = {
      ensure: async () => {
        throw new Error("not used");
      },
      allowGateway: async () => undefined,
      list: async () => [
        { name: `fleet-gw-${unreadable}`, rolloutId: unreadable, createdAt: Date.now() - 3_600_000 },
        {
          name: `fleet-gw-${unreadableOld}`,
          rolloutId: unreadableOld,
          createdAt: Date.now() - LONGEST_LIFE_MS - 3_600_000,
        },
        { name: `fleet-gw-${over}`, rolloutId: over, createdAt: 0 },
      ],
      remove: async (id: string) => {
        removed.push(id);
        return { alreadyGone: false };
      },
    };
    try {
      const report = await janitorTick({ ...fleet.deps, networks }, { orphanGraceMs: 60_000 });
      expect(removed).toEqual([unreadableOld, over, retry]);
      expect(await ledger.networkRetries(Date.now() + 3_600_000)).not.toContain(retry);
      const failed = report.errors.filter((e) => e.startsWith("networks"));
      expect(failed).toHaveLength(1);
      expect(failed[0]).toMatch(
        new RegExp(`^networks: could not remove 1 gateway network\\(s\\): fleet-gw-${unreadable}: `),
      );
    } finally {
      await redis.del(store.keys.rollout(unreadable), store.keys.rollout(unreadableOld));
      await ledger.networkRemoved(retry);
    }
  });

  it("firewall rules a close could not remove once its network was gone are removed by the janitor's retry, the teardown pending until then", async () => {
    // The host firewall, in memory: its unseal fails (the xtables lock busy throughout) until mended.
    const firewall = new MemoryGatewayFirewall();
    const { sealed } = firewall;
    let broken = true;
    firewall.unsealFailure = () =>
      broken ? FleetError.nonRetryable("isolation_refused", "iptables -D failed (the test)") : null;
    const scope = `janitor-unseal-${RUN}`;
    const scoped = new DockerGatewayNetworks({ scope, firewall });
    // Its passes see this test's networks only. `list` also gives every network made before
    // networks carried a scope, anyone's on the shared daemon (another job's test network, a
    // killed run's): one past the grace would be removed by this test, unsealed through its
    // failing firewall and reported beside the failure this test expects.
    const networks = Object.assign(Object.create(scoped) as typeof scoped, {
      list: async () =>
        (await scoped.list()).filter((n) => n.name === gatewayNetworkName(n.rolloutId, scope)),
    });
    const task = await helloFile();
    const model = { name: "m", baseUrl: "http://127.0.0.1:9/v1", credential: "upstream" };
    const [id] = await fleet.submit([{ task, agent: { harness: "command", argv: ["true"], model } }]);
    const net = await networks.ensure(id!);
    expect([...sealed]).toEqual([net.bridge]);
    const deps = { ...fleet.deps, networks };
    try {
      // Cancelled before it ran: close removes its network, and the unseal after it fails.
      await fleet.deps.store.requestCancel(id!);
      expect(await runStageJob("close", job(id!), deps)).toBe("ok");
      expect((await fleet.deps.store.get(id!))?.status).toBe("cancelled");
      expect((await networks.list()).map((n) => n.name)).not.toContain(net.name);
      expect([...sealed]).toEqual([net.bridge]);
      // Reported as it is: the teardown is not done while the rules stay.
      expect(await fleet.deps.store.getResult(id!)).toMatchObject({
        teardown: "pending",
        failureKind: "cancelled",
      });
      // The janitor retries it (nothing lists a gone network's rules): failing, it keeps it.
      expect((await janitorTick(deps, { orphanGraceMs: 60_000 })).errors).toEqual([
        `networks: could not remove 1 gateway network(s): ${id}'s network: iptables -D failed (the test)`,
      ]);
      // Tried again later, not on every pass (others due meanwhile come first).
      expect(await fleet.deps.ledger.networkRetries(Date.now())).not.toContain(id);
      broken = false;
      const later = { ...deps, now: () => Date.now() + 120_000 };
      expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("pending");
      expect((await janitorTick(later, { orphanGraceMs: 60_000 })).errors).toEqual([]);
      expect(sealed.size).toBe(0);
      expect(await fleet.deps.ledger.networkRetries(Date.now())).not.toContain(id);
      expect(await fleet.deps.store.getResult(id!)).toMatchObject({
        teardown: "confirmed",
        status: "cancelled",
      });
    } finally {
      broken = false;
      await networks.remove(id!);
    }
  });

  it("the janitor's own close of a rollout with model access removes its gateway network only after its sandbox is gone (no Docker call in the watchdog)", async () => {
    const firewall = new MemoryGatewayFirewall();
    const scope = `janitor-test-${RUN}`;
    const scoped = new DockerGatewayNetworks({ scope, firewall });
    // Each removal notes whether the rollout's sandbox was still there (a network with a
    // container on it cannot be removed).
    const removals: boolean[] = [];
    let handle: SandboxHandle | undefined;
    const networks = Object.assign(Object.create(scoped) as typeof scoped, {
      list: async () =>
        (await scoped.list()).filter((n) => n.name === gatewayNetworkName(n.rolloutId, scope)),
      remove: async (...a: Parameters<typeof scoped.remove>) => {
        removals.push(handle ? await docker.alive(handle) : false);
        return scoped.remove(...a);
      },
    });
    const lines: string[] = [];
    const logger = createLogger({
      name: "test",
      level: "warn",
      destination: { write: (l: string) => lines.push(l) },
    });
    const task = await helloFile();
    const model = { name: "m", baseUrl: "http://127.0.0.1:9/v1", credential: "upstream" };
    const [id] = await fleet.submit([
      { task, agent: { harness: "command", argv: ["true"], model }, deadlineS: 3600 },
    ]);
    const deps = { ...fleet.deps, networks, logger };
    const stageJob = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 3 } };
    try {
      expect(await runStageJob("seed", stageJob, deps)).toBe("ok");
      handle = (await fleet.deps.store.get(id!))!.receipts.seed!.handle;
      expect(firewall.sealed.size).toBe(1);
      for (let i = 0; i < CLOSE_AGAIN_LIMIT; i++) await fleet.deps.store.noteCloseAgain(id!);
      const later = { ...deps, now: () => Date.now() + 3_660_000 };
      const report = await janitorTick(later, { orphanGraceMs: 3 * 3_600_000, watchdogGraceMs: 1000 });
      expect(report.errors).toEqual([]);
      expect(report.closedByJanitor).toBe(1);
      // Gone in the same pass, in order: the sandbox (ledger step), then its network (networks step).
      expect(await docker.alive(handle)).toBe(false);
      expect((await networks.list()).map((n) => n.rolloutId)).not.toContain(id);
      expect(firewall.sealed.size).toBe(0);
      expect(await fleet.deps.store.getResult(id!)).toMatchObject({
        status: "masked",
        teardown: "confirmed",
      });
      expect(removals).toEqual([false]);
      expect(lines.map((l) => JSON.parse(l).msg)).not.toContain(
        "gateway network removal failed; the janitor retries",
      );
    } finally {
      if (handle) await docker.destroy(handle).catch(() => undefined);
      await scoped.remove(id!).catch(() => undefined);
    }
  });

  it("removes the gateway networks of rollouts that are over, this fleet's and those made before networks carried a scope", async () => {
    const scope = `janitor-test-${RUN}`;
    const networks = new DockerGatewayNetworks({ scope });
    const run = `${Date.now()}`;
    const [scopedId, legacyId] = [`gwj-${run}`, `gwjl-${run}`];
    // A network a close could not remove, and one made before names and labels carried the scope
    // (named `fleet-gw-<id>`, unlabelled: every fleet's janitor sweeps it).
    const scoped = await networks.ensure(scopedId);
    const legacy = await new DockerGatewayNetworks().ensure(legacyId);
    expect(legacy.name).toBe(`fleet-gw-${legacyId}`);
    const names = async () => (await networks.list()).map((n) => n.name);
    expect(await names()).toEqual(expect.arrayContaining([scoped.name, legacy.name]));
    try {
      // Its pass sees these two only: with its clock two minutes ahead it would sweep every
      // unscoped network on the shared daemon, another test file's among them.
      const ours = Object.assign(Object.create(networks) as typeof networks, {
        list: async () => (await networks.list()).filter((n) => [scoped.name, legacy.name].includes(n.name)),
      });
      const later = { ...fleet.deps, networks: ours, now: () => Date.now() + 120_000 };
      expect((await janitorTick(later, { orphanGraceMs: 60_000 })).errors).toEqual([]);
      expect(await names()).not.toContain(scoped.name);
      expect(await names()).not.toContain(legacy.name);
    } finally {
      await networks.remove(scopedId);
      await networks.remove(legacyId, legacy.name);
    }
  });

  it("leaves another deployment's gateway network (its rollout is in another Redis) until it is older than any rollout can live", async () => {
    const removed: string[] = [];
    const now = Date.now();
    const theirs = (name: string, createdAt: number) => ({
      name,
      rolloutId: `r-${name}`,
      createdAt,
      otherInstance: true,
    });
    const networks = {
      ensure: async () => {
        throw new Error("not here");
      },
      allowGateway: async () => undefined,
      remove: async (_rolloutId: string, name?: string) => {
        removed.push(name ?? "");
        return { alreadyGone: false };
      },
      list: async () => [theirs("young", now - 3_600_000), theirs("ancient", now - LONGEST_LIFE_MS - 60_000)],
    };
    const report = await janitorTick({ ...fleet.deps, networks }, { orphanGraceMs: 60_000 });
    expect(report.errors).toEqual([]);
    expect(removed).toEqual(["ancient"]);
  });
});
