import { setTimeout as sleep } from "node:timers/promises";
import { FleetError, type SandboxHandle, withUsage } from "@fleet/contracts";
import { sandboxKey } from "@fleet/queue";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it, vi } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { isHandBack } from "./hand-back.ts";
import { runStageJob } from "./stage-runner.ts";
import { beginOptions } from "./stages.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { untilStopped } from "./testing/no-op-stages.ts";

const job = (id: string, processedOn?: number, attemptsMade = 0) => ({
  data: { rolloutId: id },
  attemptsMade,
  opts: { attempts: 3 },
  ...(processedOn === undefined ? {} : { processedOn }),
});

/** `provider` with some methods replaced; the others are the provider's own, called on it. */
function patched(
  provider: InMemorySandboxProvider,
  methods: Partial<InMemorySandboxProvider>,
): InMemorySandboxProvider {
  return new Proxy(provider, {
    get(target, prop) {
      if (Object.hasOwn(methods, prop)) return methods[prop as keyof typeof methods];
      const value: unknown = Reflect.get(target, prop, target);
      return typeof value === "function" ? value.bind(target) : value;
    },
  });
}

/** `store` whose `launchState` never answers while `silent()` (a worker cut off from Redis). */
function silencing(store: PipelineDeps["store"], silent: () => boolean): PipelineDeps["store"] {
  return new Proxy(store, {
    get(target, prop) {
      if (prop === "launchState" && silent()) return () => new Promise(() => undefined);
      const value: unknown = Reflect.get(target, prop, target);
      return typeof value === "function" ? value.bind(target) : value;
    },
  });
}

/**
 * An agent that does not watch the signal: one step, then (once `resume` opens) another, whose
 * refusal it keeps (`step2Error`). `signal` is the one its harness was given.
 */
function twoStepAgent() {
  const stepped = latch();
  const resume = latch();
  const seen: { signal?: AbortSignal; step2Error?: string } = {};
  const createHarness: PipelineDeps["createHarness"] = (agent) => ({
    name: agent.harness,
    run: async (ctx) => {
      seen.signal = ctx.signal;
      await ctx.provider.exec(ctx.handle, ["agent-A", "step-1"], { deadlineMs: ctx.deadlineMs });
      stepped.open();
      await resume.opened;
      await ctx.provider
        .exec(ctx.handle, ["agent-A", "step-2"], { deadlineMs: ctx.deadlineMs })
        .catch((err: unknown) => {
          seen.step2Error = String(err);
        });
      return { exec: execResult(), answer: null, transcript: null, usage: null };
    },
  });
  return { createHarness, stepped, resume, seen };
}

describe("stage jobs delivered twice (a stalled job taken over while its first worker goes on)", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  async function start(
    provider: InMemorySandboxProvider,
    deps: Partial<PipelineDeps> = {},
    agent: { harness: "oracle"; sandbox?: "own" } = { harness: "oracle" },
    taskId = "hello-file",
  ) {
    fleet = await startInProcessFleet({ provider, startWorkers: false, deps });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === taskId)!;
    const [id] = (await fleet.submit([{ task, agent }])) as [string];
    return id;
  }

  /**
   * Before the seed fence, the first delivery stored its sandbox in the receipt (and enqueued
   * run) after the second began; the second then found that sandbox by its labels and replaced
   * it, and stored nothing ("taken"), destroying its own too: the run met no sandbox (masked).
   */
  it("a seed taken over keeps the sandbox the first delivery stored in its receipt (the takeover never destroys it)", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    // The first delivery: its lock lapsed (it was paused) while it probed its sandbox.
    const probing = latch();
    const goOn = latch();
    const first = runStageJob("seed", job(id, Date.now() - 60_000), {
      ...deps,
      provider: patched(provider, {
        probe: async (h: SandboxHandle) => {
          probing.open();
          await goOn.opened;
          return provider.probe(h);
        },
      }),
    });
    await probing.opened;
    // The second delivery begins (no receipt yet); the first goes on to store its receipt before
    // the second looks for an earlier attempt's sandbox (which it replaces: it may be unstaged).
    let runJobAfterFirst: unknown = null;
    const second = runStageJob("seed", job(id), {
      ...deps,
      provider: patched(provider, {
        find: async (rolloutId: string, owner: SandboxHandle["owner"]) => {
          goOn.open();
          await first;
          runJobAfterFirst = await deps.queues.queues.run.getJob(`${id}.run`);
          return provider.find(rolloutId, owner);
        },
      }),
    });
    await second;
    await first;
    // The first stored nothing, so it enqueued no run (one would spend its attempts waiting).
    expect(runJobAfterFirst).toBeFalsy();
    const rec = await deps.store.get(id);
    const handle = rec!.receipts.seed!.handle;
    // The rollout's sandbox (the one its run job works in) is there.
    expect(await provider.alive(handle)).toBe(true);
    // And no other sandbox of the rollout is left behind.
    expect((await provider.list()).map((s) => s.handle.id)).toEqual([handle.id]);
    // Its agent runs there (not masked as a lost sandbox).
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
    expect((await deps.store.get(id))!.receipts.run?.cleanup.confirmed).toBe(true);
  });

  /**
   * The earlier delivery, on the job's last attempt, fails because the later one replaced its
   * sandbox under it (an earlier attempt's sandbox, as far as the later one can tell): its failure
   * is not the rollout's. Recorded, it masked a rollout the later delivery seeded.
   */
  it("a seed taken over records no failure of its own once a later delivery began", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    const probing = latch();
    const goOn = latch();
    // Its last attempt (3 of 3), its lock lapsed while it probed its sandbox.
    const first = runStageJob("seed", job(id, Date.now() - 60_000, 2), {
      ...deps,
      provider: patched(provider, {
        probe: async (h: SandboxHandle) => {
          probing.open();
          await goOn.opened;
          return provider.probe(h);
        },
      }),
    }).catch((err: unknown) => err);
    await probing.opened;
    // The later delivery replaces that sandbox and seeds the rollout.
    expect(await runStageJob("seed", job(id, undefined, 2), deps)).toBe("ok");
    goOn.open();
    // The earlier one's probe meets its sandbox gone.
    expect(await first).toBe("superseded");
    const rec = (await deps.store.get(id))!;
    expect(rec.failure).toBeNull();
    expect(await provider.alive(rec.receipts.seed!.handle)).toBe(true);
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
  });

  /**
   * A first seed delivery (its intent fresh) whose lock lapsed failed for good after a later
   * delivery began: it dropped the intent as one no sandbox would ever answer, while the later
   * delivery was making that sandbox (its handle is stored only with its receipt). That worker
   * dying then, the sandbox had no trail: close found nothing to destroy and said confirmed.
   */
  it("a seed superseded before it fails for good leaves the intent of the delivery that took over", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    const made = latch();
    let h2: SandboxHandle | null = null;
    // The later delivery makes the sandbox, and its worker dies right after (the create never returns).
    const dies = patched(provider, {
      create: async (...a: Parameters<InMemorySandboxProvider["create"]>) => {
        h2 = await provider.create(...a);
        made.open();
        return new Promise<never>(() => undefined);
      },
    });
    let second: Promise<unknown> = Promise.resolve();
    const first = runStageJob("seed", job(id, Date.now() - 60_000), {
      ...deps,
      provider: patched(provider, {
        create: async () => {
          // Paused past its lock: the job is handed to another worker, which begins the seed.
          second = runStageJob("seed", job(id), { ...deps, provider: dies });
          await made.opened;
          throw FleetError.nonRetryable("invalid_task", "the image is not there");
        },
      }),
    });
    expect(await first).toBe("superseded");
    void second.catch(() => undefined);
    // The later delivery's intent is there still (re-dated by its begin).
    expect(await deps.ledger.getSandbox(sandboxKey(id, "resources"))).toMatchObject({ handle: null });
    // Cancelled: close finds the sandbox by its labels from that intent, and destroys it.
    await deps.store.requestCancel(id);
    expect(await runStageJob("close", job(id), deps)).toBe("ok");
    expect(await provider.alive(h2!)).toBe(false);
    expect(await deps.store.getResult(id)).toMatchObject({ status: "cancelled", teardown: "confirmed" });
  });

  /**
   * A run whose lock lapsed passed its look at the fence, then looked for an earlier attempt's
   * own sandbox, to replace it: by then the delivery that took over had made its own and launched
   * its agent there, and the earlier one destroyed it under that agent (retried: the agent run
   * again, or masked on a last attempt).
   */
  it("a run taken over while it made its own sandbox leaves the new launch's sandbox alone", async () => {
    const provider = new InMemorySandboxProvider();
    // A match-graded task: an agent with its own sandbox leaves the task's untouched.
    const id = await start(provider, {}, { harness: "oracle", sandbox: "own" }, "sum-answer");
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    const running = latch();
    const finish = latch();
    const blocking: PipelineDeps["createHarness"] = (agent) => ({
      name: agent.harness,
      run: async () => {
        running.open();
        await finish.opened;
        return { exec: execResult(), answer: null, transcript: null, usage: null };
      },
    });
    let second: Promise<unknown> = Promise.resolve();
    const first = runStageJob("run", job(id, Date.now() - 60_000), {
      ...deps,
      provider: patched(provider, {
        find: async (rolloutId: string, owner: SandboxHandle["owner"]) => {
          // The job is handed to another worker, whose agent starts in a sandbox of its own.
          second = runStageJob("run", job(id), { ...deps, createHarness: blocking });
          await running.opened;
          return provider.find(rolloutId, owner);
        },
      }),
    });
    expect(await first).toBe("superseded"); // it stops: the run is the other's
    finish.open();
    expect(await second).toBe("ok");
    const rec = (await deps.store.get(id))!;
    expect(rec.failure).toBeNull();
    expect(rec.receipts.run?.cleanup.confirmed).toBe(true);
    expect(rec.launches).toBe(2);
    // Nothing of the earlier delivery's is left: no own sandbox of the rollout lives.
    expect((await provider.list()).map((s) => s.handle.owner)).toEqual(["resources"]);
  });

  it("a run stopped by a cancel while it made its own sandbox, taken over meanwhile by a launch whose sandbox it adopted by name, leaves that sandbox to that launch (rule 11)", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider, {}, { harness: "oracle", sandbox: "own" }, "sum-answer");
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    const running = latch();
    const finish = latch();
    const blocking: PipelineDeps["createHarness"] = (agent) => ({
      name: agent.harness,
      run: async () => {
        running.open();
        await finish.opened;
        return { exec: execResult(), answer: null, transcript: null, usage: null };
      },
    });
    let second: Promise<unknown> = Promise.resolve();
    let theirs: SandboxHandle | null = null;
    const first = runStageJob("run", job(id, Date.now() - 60_000), {
      ...deps,
      provider: patched(provider, {
        create: async () => {
          // The job is handed to another worker, whose agent starts in a sandbox of its own; then
          // a cancel. This create adopts that sandbox by its name (as Docker's conflict does).
          second = runStageJob("run", job(id), { ...deps, createHarness: blocking });
          await running.opened;
          await deps.store.requestCancel(id);
          theirs = await provider.find(id, "agent");
          return theirs!;
        },
      }),
    });
    // It reads the stop (a stop reads before a lost fence) and ends; the sandbox is not its own.
    expect(await first).toBe("ok");
    expect(await provider.alive(theirs!)).toBe(true);
    finish.open();
    await second;
  });
  it("a run taken over while it probed its own sandbox, failing for good after, records no failure over the launch that replaced it", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider, {}, { harness: "oracle", sandbox: "own" }, "sum-answer");
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    let second: Promise<unknown> = Promise.resolve();
    let probes = 0;
    const first = runStageJob("run", job(id, Date.now() - 60_000, 2), {
      ...deps,
      provider: patched(provider, {
        probe: async (h: SandboxHandle) => {
          if (probes++ === 0) {
            // Its lock lapsed while it probed its own sandbox: another worker takes the run over.
            second = runStageJob("run", job(id), deps);
            await second;
            throw FleetError.nonRetryable("isolation_refused", "refused (after the takeover)");
          }
          return provider.probe(h);
        },
      }),
    }).catch((e: unknown) => e);
    const a = await first;
    expect(await second).toBe("ok");
    const rec = (await deps.store.get(id))!;
    expect(rec.receipts.run?.cleanup.confirmed).toBe(true);
    // Its claim could not be given back (the other launch holds it): its failure stays fenced out.
    expect({ a: String(a), failure: rec.failure }).toEqual({ a: "superseded", failure: null });
  });

  /**
   * A run delivery paused past its lock (its stop poll unanswered meanwhile): another worker took
   * the run over and launched its agent again, and a cancel stopped that launch. The earlier one,
   * resumed, reads the stop too (a stop reads before a lost fence): what it spent must not replace
   * the usage of the launch that took over (the one the result speaks for, its earlier launches a gap).
   */
  it("a run taken over, then cancelled: the result's usage is the later launch's, never the earlier one's", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider, { stopPollMs: 600_000 });
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    const usage = (calls: number) => ({
      calls,
      promptTokens: calls,
      completionTokens: 1,
      cachedTokens: 0,
      gaps: [],
    });
    const aRunning = latch();
    const aResume = latch();
    const bRunning = latch();
    const first = runStageJob("run", job(id, Date.now() - 60_000), {
      ...deps,
      createHarness: (agent) => ({
        name: agent.harness,
        run: async () => {
          aRunning.open();
          await aResume.opened;
          throw withUsage(FleetError.nonRetryable("agent_error", "its processes were killed"), usage(1));
        },
      }),
    });
    await aRunning.opened;
    const second = runStageJob("run", job(id), {
      ...deps,
      stopPollMs: 20,
      createHarness: (agent) => ({
        name: agent.harness,
        run: async (ctx) => {
          bRunning.open();
          await new Promise((resolve) => ctx.signal?.addEventListener("abort", resolve, { once: true }));
          throw withUsage(FleetError.nonRetryable("cancelled", "stopped"), usage(7));
        },
      }),
    });
    await bRunning.opened;
    await deps.store.requestCancel(id);
    expect(await second).toBe("ok");
    aResume.open();
    expect(await first).toBe("ok");
    expect(await runStageJob("close", job(id), deps)).toBe("ok");
    expect((await deps.store.getResult(id))?.usage).toEqual({
      ...usage(7),
      gaps: [
        "1 earlier launch(es) of this rollout not counted here (see failures[].usage for what was recorded)",
      ],
    });
  });

  /**
   * A run delivery whose lock lapsed, on its last attempt, passed its look at the fence after
   * its agent ended; then a later delivery claimed the launch, replaced its own sandbox (the
   * earlier one destroyed) and stored its run. The earlier one's stop then met its sandbox gone
   * (`sandbox_lost`), and the runner recorded that as the rollout's final failure, unfenced: a
   * rollout whose run the later launch completed was masked.
   */
  it("a run taken over after its agent ended records no failure over the launch that replaced it", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider, {}, { harness: "oracle", sandbox: "own" }, "sum-answer");
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    let second: Promise<unknown> = Promise.resolve();
    let stops = 0;
    const first = runStageJob("run", job(id, Date.now() - 60_000, 2), {
      ...deps,
      provider: patched(provider, {
        killProcesses: async (h: SandboxHandle) => {
          // Its first stop (after its agent): the job was handed to another worker meanwhile.
          if (stops++ === 0) {
            second = runStageJob("run", job(id), deps);
            await second;
          }
          return provider.killProcesses(h);
        },
      }),
    }).catch((e: unknown) => e);
    const a = await first;
    expect(await second).toBe("ok");
    const rec = (await deps.store.get(id))!;
    expect(rec.receipts.run?.cleanup.confirmed).toBe(true);
    expect({ a: String(a), failure: rec.failure, failures: await deps.store.failureLog(id) }).toEqual({
      a: "superseded",
      failure: null,
      failures: [],
    });
  });

  /**
   * A run launch whose worker lost Redis (its fence polls unanswered) while the sandbox stayed
   * in reach: its job's lock lapsed, another worker took the run over and the rollout was
   * verified, and then the first launch's agent took its next step (a tool loop's exec) in the
   * sandbox, during or after the verify. Its stop poll waited only for a "stop" or "lost" that
   * never came.
   */
  it("a run cut off from Redis past half its lock starts nothing more of its agent and hands its job back", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    let cut = false;
    const cutOff = silencing(deps.store, () => cut);
    const agent = twoStepAgent();
    const first = runStageJob(
      "run",
      job(id),
      { ...deps, store: cutOff, createHarness: agent.createHarness, stopPollMs: 50 },
      { lockDurationMs: 400 },
    ).catch((err: unknown) => err);
    await agent.stepped.opened;
    cut = true;
    // Half its lock without an answer: it stops waiting (its harness told to stop).
    await vi.waitFor(() => expect(agent.seen.signal?.aborted).toBe(true), { timeout: 5_000, interval: 20 });
    // Its lock lapses; another worker takes the run over, and the rollout is verified.
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
    const verify: PipelineDeps["verify"] = async () => ({ reward: 1, details: { kind: "stub" } });
    expect(await runStageJob("verify", job(id), { ...deps, verify })).toBe("ok");
    const verifiedAt = provider.execCalls.length;
    // The first launch's agent takes its next step: refused, and the job is handed back.
    agent.resume.open();
    expect(String(await first)).toContain("HandBackError");
    expect(agent.seen.step2Error).toContain("cannot be confirmed");
    expect(provider.execCalls.slice(verifiedAt).map((c) => c.argv.join(" "))).toEqual([]);
  });

  it("a run whose fence goes unanswered past half its lock before its agent ran a command hands its job back with the launch given back: the next delivery is a first launch", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    let cut = false;
    const starting = latch();
    // An agent still starting (no command yet) that stops when told to.
    const createHarness = untilStopped(starting, () => new Error("stopped before its first command"));
    const first = runStageJob(
      "run",
      job(id),
      { ...deps, store: silencing(deps.store, () => cut), createHarness, stopPollMs: 50 },
      { lockDurationMs: 400 },
    ).catch((err: unknown) => err);
    await starting.opened;
    cut = true;
    expect(isHandBack(await first)).toBe(true);
    // Only the fence's reads went unanswered here: the give-back reached Redis.
    expect(await fleet!.redis.hget(deps.store.keys.rollout(id), "fence")).toBeNull();
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
    expect((await deps.store.get(id))!.receipts.run!.attempts).toBe(1);
  });

  /**
   * The exec gate, not the stop poll, is first to hear the fence's answer (the poll never ticks
   * here): an agent's next step after half the job's lock asks the fence itself. A stop kills what
   * the agent left running (a borrowed sandbox's processes would run on into the close, an own
   * sandbox's past it) and ends the run for close; a launch taken over touches nothing (the
   * processes may be the new launch's) and is superseded; no answer hands the job back, nothing
   * killed. In each, the step is refused and the harness told to stop.
   */
  it.each([
    ["stop", "ok", 1],
    ["lost", "superseded", 0],
    ["silent", "HandBackError", 0],
  ] as const)(
    "a run's exec gate that hears %s itself stops the harness as the poll would (outcome %s, %i kill)",
    async (answer, outcome, kills) => {
      const provider = new InMemorySandboxProvider();
      const id = await start(provider);
      const deps = fleet!.deps;
      expect(await runStageJob("seed", job(id), deps)).toBe("ok");
      let silent = false;
      const store = silencing(deps.store, () => silent);
      let killed = 0;
      const counting = patched(provider, {
        killProcesses: async (h: SandboxHandle) => {
          killed++;
          return provider.killProcesses(h);
        },
      });
      const agent = twoStepAgent();
      // The stop poll's interval never fires: only the gate can hear the fence.
      vi.useFakeTimers({ toFake: ["setInterval", "clearInterval"] });
      try {
        const first = runStageJob(
          "run",
          job(id),
          { ...deps, provider: counting, store, createHarness: agent.createHarness, stopPollMs: 50 },
          { lockDurationMs: 400 },
        ).catch((err: unknown) => err);
        await agent.stepped.opened;
        // Past half the lock (200 ms) since the fence last answered (before the launch, so before
        // the harness's first step: counted from here, a slow launch cannot eat the margin). Not
        // `vi.waitFor`: under fake timers it advances them, and the poll would tick.
        const steppedAt = performance.now();
        while (performance.now() - steppedAt <= 250) await sleep(20);
        if (answer === "stop") await deps.store.requestCancel(id);
        else if (answer === "lost")
          await fleet!.redis.hset(deps.store.keys.rollout(id), "fence", "launched:another");
        else silent = true;
        const killedBefore = killed;
        const execsBefore = provider.execCalls.length;
        agent.resume.open();
        expect(String(await first)).toContain(outcome);
        expect(agent.seen.signal?.aborted).toBe(true);
        expect(agent.seen.step2Error).toContain("cannot be confirmed");
        expect(provider.execCalls.slice(execsBefore).map((c) => c.argv.join(" "))).toEqual([]);
        expect(killed - killedBefore).toBe(kills);
      } finally {
        vi.useRealTimers();
      }
    },
  );

  /**
   * A seed delivery whose lock lapsed (an attempt after one that recorded the intent) looked for
   * that attempt's sandbox to replace it: by then a later delivery had seeded the rollout, and
   * the earlier one destroyed that sandbox (its run's) as an earlier attempt's.
   */
  it("a seed taken over while it looked for an earlier attempt's sandbox leaves the later delivery's alone", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    // An earlier attempt recorded the intent and died before it created anything.
    await deps.store.begin(id, "seed", Date.now(), beginOptions("seed", deps));
    let second: Promise<unknown> = Promise.resolve();
    const first = runStageJob("seed", job(id, Date.now() - 60_000), {
      ...deps,
      provider: patched(provider, {
        find: async (rolloutId: string, owner: SandboxHandle["owner"]) => {
          // The job is handed to another worker, which seeds the rollout.
          second = runStageJob("seed", job(id), deps);
          await second;
          return provider.find(rolloutId, owner);
        },
      }),
    });
    expect(await first).toBe("superseded");
    expect(await second).toBe("ok");
    const handle = (await deps.store.get(id))!.receipts.seed!.handle;
    expect(await provider.alive(handle)).toBe(true);
    expect((await provider.list()).map((s) => s.handle.id)).toEqual([handle.id]);
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
  });

  it("a stage delivered again after its rollout's final failure was recorded, its close never enqueued (the worker died between), enqueues the close (rule 1)", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    // What the run's final failure recorded before its worker died, the close not yet enqueued.
    await deps.store.recordFailure(
      id,
      {
        stage: "run",
        terminal: true,
        failureKind: "agent_error",
        mask: false,
        reason: "boom",
        at: Date.now(),
      },
      { beforeDecided: true },
    );
    expect(await deps.queues.queues.close.getJob(`${id}.close`)).toBeUndefined();
    expect(await runStageJob("run", job(id, undefined, 1), deps)).toBe("skipped");
    expect(await deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
  });
});
