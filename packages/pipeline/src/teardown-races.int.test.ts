import { randomUUID } from "node:crypto";
import { FleetError, type SandboxHandle, type TaskContent } from "@fleet/contracts";
import { sandboxKey } from "@fleet/queue";
import { DockerSandboxProvider, type SandboxProvider } from "@fleet/sandbox";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { janitorTick } from "./janitor.ts";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

/**
 * Teardown that races the stages (DESIGN §2 rules 3 and 9): a result that says `teardown:
 * "confirmed"` has nothing of its rollout alive. Real Redis, real Docker; stages driven one job
 * at a time, the provider wrapped to hold or fail a call at a chosen point. A scope of the file's
 * own, so its janitor passes see no other test's sandboxes.
 */
const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const docker = new DockerSandboxProvider({ scope: `races-${randomUUID().slice(0, 8)}` });
let suite: TaskContent[];
const task = (id: string) => ({ ...suite.find((t) => t.id === id)!, image: IMAGE });
const job = (rolloutId: string, attemptsMade = 0) => ({
  data: { rolloutId },
  attemptsMade,
  opts: { attempts: 8 },
});
const ORPHAN_GRACE_MS = 120_000;

/** A point a provider call waits at until the test opens it. */
function gate() {
  let open!: () => void;
  const opened = new Promise<void>((r) => {
    open = r;
  });
  return { open, opened };
}

/** The Docker provider with some of its calls replaced. */
function wrapped(over: Partial<SandboxProvider>): SandboxProvider {
  return Object.assign(Object.create(docker) as SandboxProvider, over);
}

describe("teardown racing the stages (real Docker)", () => {
  let fleet: InProcessFleet;
  beforeAll(async () => {
    suite = await loadSuite(EXAMPLE_SUITE_DIR);
    fleet = await startInProcessFleet({ provider: docker, startWorkers: false });
  });
  afterAll(async () => {
    for (const s of await docker.list()) await docker.destroy(s.handle).catch(() => undefined);
    await fleet.close();
  });

  /**
   * Two janitor passes 5 and 20 minutes on: past the orphan grace the registry step puts a
   * registered sandbox no worker destroyed on the ledger, and the pass after removes it.
   */
  async function janitorPastOrphanGrace(): Promise<void> {
    for (const m of [5, 20]) {
      await janitorTick(
        { ...fleet.deps, now: () => Date.now() + m * 60_000 },
        { orphanGraceMs: ORPHAN_GRACE_MS },
      );
    }
  }

  /**
   * A rollout whose agent asks for its own sandbox, seeded; its run's first attempt makes and
   * records that sandbox (H1), then its worker dies.
   */
  async function ownSandboxThenWorkerDies(): Promise<{ id: string; h1: SandboxHandle }> {
    const [id] = await fleet.submit([
      {
        task: task("sum-answer"),
        agent: { harness: "command", argv: ["true"], sandbox: "own" },
        deadlineS: 3600,
      },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    let h1: SandboxHandle | null = null;
    // The worker dies while probing H1: its stage never goes on, so nothing of it (its error
    // handling included, which would destroy H1) runs again. Its promise is left unsettled.
    const probing = gate();
    const dies = wrapped({
      create: async (...args) => {
        const h = await docker.create(...args);
        if (h.owner === "agent") h1 = h;
        return h;
      },
      probe: async (...args) => {
        if (args[0].owner === "agent") {
          probing.open();
          return new Promise<never>(() => {});
        }
        return docker.probe(...args);
      },
    });
    void runStageJob("run", job(id!, 0), { ...fleet.deps, provider: dies }).catch(() => undefined);
    await probing.opened;
    expect((await fleet.deps.ledger.getSandbox(sandboxKey(id!, "agent")))?.handle?.id).toBe(h1!.id);
    return { id: id!, h1: h1! };
  }

  for (const closer of ["close", "the janitor"] as const) {
    it(`${closer} never takes a retried seed's intent for "never created" while that retry creates the sandbox (the intent grace counts from the latest attempt)`, async () => {
      const [id] = await fleet.submit([
        { task: task("hello-file"), agent: { harness: "oracle" }, deadlineS: 3600 },
      ]);
      const t0 = Date.now();
      // Attempt 1 records the intent, then the daemon blips before anything is made.
      const blip = wrapped({
        create: async () => {
          throw FleetError.retryable("provider_unavailable", "daemon blip");
        },
      });
      await expect(runStageJob("seed", job(id!, 0), { ...fleet.deps, provider: blip })).rejects.toThrow(
        /blip/,
      );
      expect(await fleet.deps.ledger.getSandbox(sandboxKey(id!, "resources"))).toMatchObject({
        handle: null,
      });

      // Attempt 2 comes later than the grace after attempt 1 (close's is 5 min, the janitor's
      // 2): its create is held at the daemon, and its worker dies right after (no handle stored).
      const later = t0 + (closer === "close" ? 6 : 3) * 60_000;
      const inCreate = gate();
      const release = gate();
      let made: SandboxHandle | null = null;
      const slow = wrapped({
        create: async (...args) => {
          inCreate.open();
          await release.opened;
          made = await docker.create(...args);
          throw new Error("the seed worker died right after its create");
        },
      });
      const seeding = runStageJob("seed", job(id!, 1), {
        ...fleet.deps,
        provider: slow,
        now: () => later,
      }).catch((err: unknown) => err);
      await inCreate.opened;

      // Cancelled now: close runs (and, for the janitor, a pass just after it).
      await fleet.deps.store.requestCancel(id!);
      await runStageJob("close", job(id!), { ...fleet.deps, now: () => later });
      if (closer === "the janitor") {
        await janitorTick(
          { ...fleet.deps, intentGraceMs: ORPHAN_GRACE_MS, now: () => later + 5_000 },
          { orphanGraceMs: ORPHAN_GRACE_MS },
        );
      }
      release.open();
      expect(String(await seeding)).toMatch(/died right after its create/);
      expect(made).not.toBeNull();
      expect(await docker.alive(made!)).toBe(true);
      // Reported pending, on the ledger: not confirmed while the sandbox lives.
      expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("pending");
      expect(await fleet.deps.ledger.isPending(id!)).toBe(true);

      // Past the grace from the creating attempt, the janitor finds it by label and removes it.
      await janitorTick(
        { ...fleet.deps, intentGraceMs: ORPHAN_GRACE_MS, now: () => later + ORPHAN_GRACE_MS + 60_000 },
        { orphanGraceMs: ORPHAN_GRACE_MS },
      );
      expect(await docker.alive(made!)).toBe(false);
      expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("confirmed");
    });
  }

  for (const closer of ["close", "the janitor"] as const) {
    it(`${closer}, finding no sandbox for a handle-less intent, never forgets the handle a seed attempt attached meanwhile`, async () => {
      const [id] = await fleet.submit([
        { task: task("hello-file"), agent: { harness: "oracle" }, deadlineS: 3600 },
      ]);
      const key = sandboxKey(id!, "resources");
      // Attempt 1 records the intent, then the daemon blips before anything is made.
      const blip = wrapped({
        create: async () => {
          throw FleetError.retryable("provider_unavailable", "daemon blip");
        },
      });
      await expect(runStageJob("seed", job(id!, 0), { ...fleet.deps, provider: blip })).rejects.toThrow(
        /blip/,
      );
      // Attempt 2 (begun before the close's tombstone) is held in its create; once made, its
      // sandbox's handle is attached (the rollout closed meanwhile) and its own destroy fails.
      const inCreate = gate();
      const releaseCreate = gate();
      let made: SandboxHandle | null = null;
      const second = wrapped({
        create: async (...args) => {
          inCreate.open();
          await releaseCreate.opened;
          made = await docker.create(...args);
          return made;
        },
        destroy: async (...args) => {
          if (made && args[0].id === made.id)
            throw FleetError.retryable("provider_unavailable", "daemon blip");
          return docker.destroy(...args);
        },
      });
      const seeding = runStageJob("seed", job(id!, 1), { ...fleet.deps, provider: second }).catch(
        (err: unknown) => err,
      );
      await inCreate.opened;
      // The closer's label lookup finds nothing: then the held create goes on, and the lookup's
      // answer (none) arrives only once that sandbox is attached and on the ledger.
      const lateFind = wrapped({
        find: async (...args) => {
          const found = await docker.find(...args);
          releaseCreate.open();
          await seeding;
          return found;
        },
      });
      await fleet.deps.store.requestCancel(id!);
      // Past the intent grace (5 min) from the intent: taken for "never created" if nothing is found.
      const later = Date.now() + 6 * 60_000;
      if (closer === "close") {
        await runStageJob("close", job(id!), { ...fleet.deps, provider: lateFind, now: () => later });
      } else {
        // Close (within the grace) hands the handle-less intent to the ledger; the janitor,
        // later, finds no sandbox for it. (A long orphan grace: its label sweep leaves the
        // sandbox to the ledger here.)
        await runStageJob("close", job(id!), fleet.deps);
        expect((await fleet.deps.ledger.pending()).find((e) => e.key === key)?.handle).toBeNull();
        await janitorTick(
          { ...fleet.deps, provider: lateFind, now: () => later },
          { orphanGraceMs: 3_600_000 },
        );
      }
      await seeding;
      expect(made).not.toBeNull();
      expect(await docker.alive(made!)).toBe(true);
      // The sandbox made meanwhile keeps its entries, and the teardown is not confirmed.
      expect((await fleet.deps.ledger.getSandbox(key))?.handle?.id).toBe(made!.id);
      expect((await fleet.deps.ledger.pending()).find((e) => e.key === key)?.handle?.id).toBe(made!.id);
      expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("pending");

      // The janitor's next retry of it (its backoff over) removes it, and then it is confirmed.
      await janitorTick({ ...fleet.deps, now: () => later + 20 * 60_000 }, { orphanGraceMs: 3_600_000 });
      expect(await docker.alive(made!)).toBe(false);
      expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("confirmed");
    });
  }

  it("a confirmed destroy of an agent sandbox forgets only its own entry, never that of the sandbox which replaced it", async () => {
    // Run attempt 1 makes and records its own sandbox H1, then its worker dies.
    const { id, h1 } = await ownSandboxThenWorkerDies();

    // Run attempt 2 (re-delivered) replaces H1; its create of H2 is held, and its destroy of H2
    // will fail (a daemon blip).
    const inCreate = gate();
    const releaseCreate = gate();
    let h2: SandboxHandle | null = null;
    const second = wrapped({
      create: async (...args) => {
        inCreate.open();
        await releaseCreate.opened;
        h2 = await docker.create(...args);
        return h2;
      },
      destroy: async (...args) => {
        if (h2 && args[0].id === h2.id) throw FleetError.retryable("provider_unavailable", "daemon blip");
        return docker.destroy(...args);
      },
    });
    const running = runStageJob("run", job(id!, 1), { ...fleet.deps, provider: second }).catch(
      (err: unknown) => err,
    );
    await inCreate.opened;

    // Cancelled: close hands the agent entry it read (H1) to the janitor.
    await fleet.deps.store.requestCancel(id!);
    await runStageJob("close", job(id!), fleet.deps);
    const agentEntry = async () => (await fleet.deps.ledger.pending()).find((e) => e.owner === "agent");
    expect((await agentEntry())?.handle?.id).toBe(h1!.id);

    // A janitor pass takes H1's entry; its destroy is held.
    const inDestroy = gate();
    const releaseDestroy = gate();
    const slowJanitor = wrapped({
      destroy: async (...args) => {
        if (args[0].id === h1!.id) {
          inDestroy.open();
          await releaseDestroy.opened;
        }
        return docker.destroy(...args);
      },
    });
    const pass = janitorTick(
      { ...fleet.deps, provider: slowJanitor, now: () => Date.now() + 10_000 },
      { orphanGraceMs: ORPHAN_GRACE_MS },
    );
    await inDestroy.opened;
    // Attempt 2 goes on: H2 made, its attach finds the rollout closed, its destroy fails: H2 is
    // put on the ledger under the same key.
    releaseCreate.open();
    await running;
    expect((await agentEntry())?.handle?.id).toBe(h2!.id);
    // The janitor's destroy of H1 ends (gone already): H2's entry stays, the teardown pending.
    releaseDestroy.open();
    await pass;
    expect(await docker.alive(h2!)).toBe(true);
    expect((await agentEntry())?.handle?.id).toBe(h2!.id);
    expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("pending");

    // The next pass (its backoff over) removes H2, and only then is the teardown confirmed.
    await janitorTick(
      { ...fleet.deps, now: () => Date.now() + 20 * 60_000 },
      { orphanGraceMs: ORPHAN_GRACE_MS },
    );
    expect(await docker.alive(h2!)).toBe(false);
    expect(await agentEntry()).toBeUndefined();
    expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("confirmed");
  });

  it("close's confirm (folded into finalize) never forgets the ledger entry of a sandbox that replaced the one it destroyed", async () => {
    const [id] = await fleet.submit([
      { task: task("hello-file"), agent: { harness: "oracle" }, deadlineS: 3600 },
    ]);
    // Seed attempt 1 makes H1, then its worker dies (probe).
    let h1: SandboxHandle | null = null;
    const dies = wrapped({
      create: async (...a) => (h1 = await docker.create(...a)),
      probe: async () => {
        throw new Error("the seed worker died");
      },
    });
    await expect(runStageJob("seed", job(id!, 0), { ...fleet.deps, provider: dies })).rejects.toThrow(/died/);
    expect(await docker.alive(h1!)).toBe(true);

    // Seed attempt 2 begins (before close's tombstone); its label lookup is held.
    const inFind = gate();
    const releaseFind = gate();
    let h2: SandboxHandle | null = null;
    const second = wrapped({
      find: async (...a) => {
        inFind.open();
        await releaseFind.opened;
        return docker.find(...a);
      },
      create: async (...a) => (h2 = await docker.create(...a)),
      destroy: async (...a) => {
        if (h2 && a[0].id === h2.id) throw FleetError.retryable("provider_unavailable", "daemon blip");
        return docker.destroy(...a);
      },
    });
    const seeding = runStageJob("seed", job(id!, 1), { ...fleet.deps, provider: second }).catch(
      (e: unknown) => e,
    );
    await inFind.opened;

    // Cancelled: close finds H1 and destroys it; it is slow to get from there to its finalize.
    await fleet.deps.store.requestCancel(id!);
    const destroyed = gate();
    const releaseClose = gate();
    const slowClose = wrapped({
      destroy: async (...a) => {
        const r = await docker.destroy(...a);
        destroyed.open();
        await releaseClose.opened;
        return r;
      },
    });
    const closing = runStageJob("close", job(id!), { ...fleet.deps, provider: slowClose });
    await destroyed.opened;
    // Seed attempt 2 goes on: finds nothing, makes H2, its receipt is refused (closed), its
    // destroy of H2 fails: H2 goes on the ledger under the resources key.
    releaseFind.open();
    await seeding;
    expect(h2).not.toBeNull();
    expect(h2!.id).not.toBe(h1!.id);
    expect((await fleet.deps.ledger.pending()).map((e) => e.handle?.id)).toEqual([h2!.id]);
    releaseClose.open();
    await closing;
    const alive = await docker.alive(h2!);
    const result = await fleet.deps.store.getResult(id!);
    const pendingAfter = await fleet.deps.ledger.pending();
    expect(alive).toBe(true);
    // Not confirmed while H2 lives, and H2's entry kept for the janitor.
    expect(result?.teardown).toBe("pending");
    expect(pendingAfter.some((e) => e.handle?.id === h2!.id)).toBe(true);
  });

  it("a seed whose receipt a finished close refused turns the result's teardown pending while its sandbox lives (its worker dead before its own destroy)", async () => {
    const [id] = await fleet.submit([
      { task: task("hello-file"), agent: { harness: "oracle" }, deadlineS: 3600 },
    ]);
    // Seed attempt 1 makes H1, then fails (its probe): H1 is left for the next attempt to replace.
    let h1: SandboxHandle | null = null;
    const first = wrapped({
      create: async (...a) => (h1 = await docker.create(...a)),
      probe: async () => {
        throw new Error("the seed's probe failed");
      },
    });
    await expect(runStageJob("seed", job(id!, 0), { ...fleet.deps, provider: first })).rejects.toThrow(
      /probe failed/,
    );
    // Seed attempt 2 begins (before close's tombstone); its label lookup is held.
    const inFind = gate();
    const releaseFind = gate();
    const inDestroyH2 = gate();
    let h2: SandboxHandle | null = null;
    const second = wrapped({
      find: async (...a) => {
        inFind.open();
        await releaseFind.opened;
        return docker.find(...a);
      },
      create: async (...a) => (h2 = await docker.create(...a)),
      // The seed worker dies here: its destroy of H2 (its receipt refused) never happens.
      destroy: async (...a) => {
        if (h2 && a[0].id === h2.id) {
          inDestroyH2.open();
          return new Promise<never>(() => undefined);
        }
        return docker.destroy(...a);
      },
    });
    void runStageJob("seed", job(id!, 1), { ...fleet.deps, provider: second }).catch(() => undefined);
    await inFind.opened;
    // Cancelled: close finds H1 by its label, destroys it and finalizes, nothing else of the
    // rollout known: confirmed.
    await fleet.deps.store.requestCancel(id!);
    expect(await runStageJob("close", job(id!), fleet.deps)).toBe("ok");
    expect(await docker.alive(h1!)).toBe(false);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "cancelled",
      teardown: "confirmed",
    });
    // Attempt 2 goes on: finds nothing, makes H2, probes and stages it; its receipt is refused.
    releaseFind.open();
    await inDestroyH2.opened;
    expect(await docker.alive(h2!)).toBe(true);
    expect((await fleet.deps.ledger.getSandbox(sandboxKey(id!, "resources")))?.handle?.id).toBe(h2!.id);
    // Not confirmed while H2 lives.
    expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("pending");

    // Past the orphan grace the registry step puts H2 on the ledger, and the pass after removes
    // it: only then is the teardown confirmed.
    await janitorPastOrphanGrace();
    expect(await docker.alive(h2!)).toBe(false);
    expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("confirmed");
  });

  it("the janitor's confirm of H1 does not mark the teardown confirmed while H2 (attached under the same key, its run worker dead before its own destroy) lives", async () => {
    const { id, h1 } = await ownSandboxThenWorkerDies();
    const inCreate = gate();
    const releaseCreate = gate();
    const inDestroyH2 = gate();
    let h2: SandboxHandle | null = null;
    const second = wrapped({
      create: async (...a) => {
        inCreate.open();
        await releaseCreate.opened;
        h2 = await docker.create(...a);
        return h2;
      },
      // The run worker dies here: its destroy of H2 never happens.
      destroy: async (...a) => {
        if (h2 && a[0].id === h2.id) {
          inDestroyH2.open();
          return new Promise<never>(() => undefined);
        }
        return docker.destroy(...a);
      },
    });
    void runStageJob("run", job(id!, 1), { ...fleet.deps, provider: second }).catch(() => undefined);
    await inCreate.opened;
    await fleet.deps.store.requestCancel(id!);
    await runStageJob("close", job(id!), fleet.deps);
    releaseCreate.open();
    await inDestroyH2.opened;
    expect((await fleet.deps.ledger.getSandbox(sandboxKey(id!, "agent")))?.handle?.id).toBe(h2!.id);
    await janitorTick({ ...fleet.deps, now: () => Date.now() + 10_000 }, { orphanGraceMs: ORPHAN_GRACE_MS });
    // H1 is gone (replaced, then its entry confirmed by the janitor); H2 lives, registered.
    expect([await docker.alive(h1), await docker.alive(h2!)]).toEqual([false, true]);
    expect((await fleet.deps.store.getResult(id))?.teardown).toBe("pending");
    // Past the orphan grace the registry step puts H2 on the ledger; the pass after removes it.
    await janitorPastOrphanGrace();
    expect(await docker.alive(h2!)).toBe(false);
    expect((await fleet.deps.store.getResult(id!))?.teardown).toBe("confirmed");
  });

  it("close ends the rollout when a sandbox registry entry does not parse (another release's shape): teardown pending, then the janitor's label sweep removes that sandbox and confirms", async () => {
    const [id] = await fleet.submit([
      { task: task("hello-file"), agent: { harness: "oracle" }, deadlineS: 3600 },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    const { store, ledger } = fleet.deps;
    const seeded = (await store.get(id!))!.receipts.seed!.handle;
    // An agent sandbox a release with another entry shape recorded.
    const other = await docker.create({
      image: IMAGE,
      rolloutId: id!,
      owner: "agent",
      expiresAt: Date.now() + 3_600_000,
    });
    const key = sandboxKey(id!, "agent");
    await fleet.redis.hset(
      ledger.keys.sandboxes(),
      key,
      JSON.stringify({ v: 2, key, sandbox: { id: other.id } }),
    );
    await store.requestCancel(id!);
    expect(await runStageJob("close", job(id!), fleet.deps)).toBe("ok");
    expect(await store.getResult(id!)).toMatchObject({ status: "cancelled", teardown: "pending" });
    // The task's sandbox went (from the seed's receipt); the one close could not read is left.
    expect([await docker.alive(seeded), await docker.alive(other)]).toEqual([false, true]);
    await janitorTick(
      { ...fleet.deps, now: () => Date.now() + ORPHAN_GRACE_MS + 60_000 },
      { orphanGraceMs: ORPHAN_GRACE_MS },
    );
    expect(await docker.alive(other)).toBe(false);
    expect((await store.getResult(id!))?.teardown).toBe("confirmed");
    expect(await fleet.redis.hexists(ledger.keys.sandboxes(), key)).toBe(0);
  });

  it("close's metrics count the result as finalize stored it: a sandbox put on the ledger while close ran makes it teardown_failed, not none", async () => {
    const [id] = await fleet.submit([
      { task: task("hello-file"), agent: { harness: "oracle" }, deadlineS: 3600 },
    ]);
    for (const stage of ["seed", "run", "verify"] as const) await runStageJob(stage, job(id!), fleet.deps);
    // Between close's begin (its read of the rollout's sandboxes) and its finalize, a sandbox
    // of the rollout goes on the ledger (a replacement whose own destroy failed).
    const { store, ledger } = fleet.deps;
    const racing = Object.assign(Object.create(store) as typeof store, {
      begin: async (...a: Parameters<typeof store.begin>) => {
        const begun = await store.begin(...a);
        if (a[1] === "close") {
          const handle = {
            ...begun.record!.receipts.seed!.handle,
            id: "replacement",
            owner: "agent" as const,
          };
          const entry = { key: sandboxKey(id!, "agent"), rolloutId: id!, owner: "agent" as const };
          await ledger.recordFailure(
            {
              ...entry,
              provider: handle.provider,
              handle,
              createdAt: Date.now(),
              expiresAt: Date.now() + 60_000,
            },
            "daemon blip",
            Date.now(),
          );
        }
        return begun;
      },
    });
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "races-test", defaultMetrics: false }));
    await runStageJob("close", job(id!), { ...fleet.deps, store: racing, metrics });
    expect(await store.getResult(id!)).toMatchObject({
      status: "completed",
      reward: 1,
      teardown: "pending",
      failureKind: "teardown_failed",
    });
    const finished = (await metrics.rolloutsFinished.get()).values.map((v) => [
      v.labels.failure_kind,
      v.value,
    ]);
    expect(finished).toEqual([["teardown_failed", 1]]);
    await ledger.confirm({ key: sandboxKey(id!, "agent"), rolloutId: id! });
  });
});
