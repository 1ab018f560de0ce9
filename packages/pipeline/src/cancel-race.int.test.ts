import { type CleanupReceipt, FleetError, type SandboxHandle, withUsage } from "@fleet/contracts";
import { chatReply, type ScriptedUpstream, startScriptedUpstream } from "@fleet/gateway/testing";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { afterEach, describe, expect, it } from "vitest";
import { createCredentialResolver } from "./credentials.ts";
import type { GatewayNetworks, PipelineDeps } from "./deps.ts";
import { isHandBack } from "./hand-back.ts";
import { runStageJob } from "./stage-runner.ts";
import {
  cancelAndClose as cancelFleetRun,
  type InProcessFleet,
  startInProcessFleet,
} from "./testing/in-process-fleet.ts";
import { type Latch, latch } from "./testing/latch.ts";
import { untilStopped } from "./testing/no-op-stages.ts";

const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/**
 * A cancel's close destroys the sandbox while a stage still works in it (before the run's stop
 * poll sees the cancel): the stage ends quietly, for the close to report `cancelled`, not as a
 * lost sandbox (a false `sandbox_lost` in the logs, a failed job on the board and in the metrics).
 */
describe("a stage whose sandbox a cancel's close destroyed", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  let provider: InMemorySandboxProvider;

  async function start(
    deps: Partial<PipelineDeps>,
    killOnGone: "throws" | "alreadyGone" = "throws",
    /** "own" with a task its verifier grades by the answer (tests would not see an own sandbox). */
    sandbox: "borrow" | "own" = "borrow",
  ) {
    provider = new InMemorySandboxProvider();
    if (killOnGone === "alreadyGone") {
      // As the Docker provider answers a kill in a container that is gone.
      const kill = provider.killProcesses.bind(provider);
      provider.killProcesses = async (h: SandboxHandle): Promise<CleanupReceipt> =>
        (await provider.alive(h))
          ? kill(h)
          : { confirmed: true, scope: "processes", at: Date.now(), alreadyGone: true, remaining: 0 };
    }
    // No stop poll in time: only what the stage reads when it fails can tell a stop.
    fleet = await startInProcessFleet({
      provider,
      startWorkers: false,
      deps: { stopPollMs: 600_000, ...deps },
    });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === (sandbox === "own" ? "sum-answer" : "hello-file"))!;
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle", sandbox } }])) as [string];
    return id;
  }

  /** `start` in an own sandbox with an agent that only notes it was launched: `launched()` says. */
  async function startOwnNotingLaunch() {
    let launched = false;
    const id = await start(
      {
        createHarness: (agent) => ({
          name: agent.harness,
          run: async () => {
            launched = true;
            return { exec: execResult({ exitCode: 0 }), answer: null, transcript: null, usage: null };
          },
        }),
      },
      "throws",
      "own",
    );
    return { id, launched: () => launched };
  }

  /** What the dispatcher's cancel does, then the close it enqueues. */
  async function cancelAndClose(id: string) {
    expect(await cancelFleetRun(fleet!, id)).toBe("ok");
  }

  /**
   * Once the stage works in its sandbox, a cancel and its close; then the stage's exec ends
   * (killed with the sandbox): the stage ends, enqueueing close, and the rollout is cancelled.
   */
  async function cancelUnder(id: string, stage: Promise<unknown>, working: Latch, killed: Latch) {
    await working.opened;
    await cancelAndClose(id);
    killed.open();
    expect(await stage).toBe("ok");
    // It enqueues close itself: a cancel whose dispatcher died before enqueueing it still closes.
    expect(await fleet!.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
    const result = await fleet!.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "cancelled", failureKind: "cancelled" });
    expect(result!.failures.map((f) => f.failureKind)).toEqual(["cancelled"]);
  }

  it.each(["throws", "alreadyGone"] as const)(
    "the run (a kill in the gone sandbox %s): the agent's exec ends (killed with its sandbox); the run stage ends, the rollout is cancelled",
    async (killOnGone) => {
      const working = latch();
      const killed = latch();
      const id = await start(
        {
          createHarness: (agent) => ({
            name: agent.harness,
            run: async () => {
              working.open();
              await killed.opened;
              return { exec: execResult({ exitCode: 137 }), answer: null, transcript: null, usage: null };
            },
          }),
        },
        killOnGone,
      );
      expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
      await cancelUnder(id, runStageJob("run", job(id), fleet!.deps), working, killed);
    },
  );

  it("the verify: the tests' exec fails with the sandbox gone; the verify stage ends, the rollout is cancelled", async () => {
    const working = latch();
    const killed = latch();
    const id = await start({
      verify: async () => {
        working.open();
        await killed.opened;
        throw new Error("exec failed: no such container");
      },
    });
    for (const stage of ["seed", "run"] as const)
      expect(await runStageJob(stage, job(id), fleet!.deps)).toBe("ok");
    await cancelUnder(id, runStageJob("verify", job(id), fleet!.deps), working, killed);
  });

  /** What the run's model calls had spent when its stop came. */
  const spent = { calls: 4, promptTokens: 400, completionTokens: 40, cachedTokens: 100, gaps: [] };

  it("the run's agent had spent model tokens: the cancelled result says what, though the close finalized before the run stopped", async () => {
    const working = latch();
    const killed = latch();
    const id = await start({
      createHarness: (agent) => ({
        name: agent.harness,
        run: async () => {
          working.open();
          await killed.opened;
          return { exec: execResult({ exitCode: 137 }), answer: null, transcript: null, usage: spent };
        },
      }),
    });
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    await cancelUnder(id, runStageJob("run", job(id), fleet!.deps), working, killed);
    expect((await fleet!.deps.store.getResult(id))?.usage).toEqual(spent);
  });

  it("the run's agent had spent model tokens and its stop poll saw the cancel before the close: the close's result says what", async () => {
    const working = latch();
    const id = await start({
      stopPollMs: 20,
      // As the tool loop ends on its signal: its error carries what it spent.
      createHarness: untilStopped(working, () =>
        withUsage(FleetError.nonRetryable("cancelled", "stopped"), spent),
      ),
    });
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    const run = runStageJob("run", job(id), fleet!.deps);
    await working.opened;
    await fleet!.deps.store.requestCancel(id);
    expect(await run).toBe("ok");
    expect(await fleet!.deps.store.getResult(id)).toBeNull();
    expect(await runStageJob("close", job(id), fleet!.deps)).toBe("ok");
    expect(await fleet!.deps.store.getResult(id)).toMatchObject({ status: "cancelled", usage: spent });
  });

  it("the run's agent had spent model tokens and the cancel came after its harness returned, before its receipt was stored: the close's result says what", async () => {
    let returned = false;
    const id = await start({
      createHarness: (agent) => ({
        name: agent.harness,
        run: async () => {
          returned = true;
          return { exec: execResult({ exitCode: 0 }), answer: null, transcript: null, usage: spent };
        },
      }),
    });
    // The cancel lands while the run confirms its agent stopped (its receipt not stored yet).
    const provider = fleet!.deps.provider;
    const kill = provider.killProcesses.bind(provider);
    provider.killProcesses = async (h, user) => {
      if (returned) await fleet!.deps.store.requestCancel(id);
      return kill(h, user);
    };
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    expect(await fleet!.deps.store.getResult(id)).toBeNull();
    expect(await runStageJob("close", job(id), fleet!.deps)).toBe("ok");
    expect(await fleet!.deps.store.getResult(id)).toMatchObject({ status: "cancelled", usage: spent });
  });

  /**
   * A run whose harness has spent `spent` and runs until told to stop (as the tool loop ends:
   * its error carries what it spent), handed back at its worker's shutdown, `deps` over the
   * fleet's for that run. Returns the rollout's id once the run stage has handed back.
   */
  async function handedBackAtShutdown(
    deps: (d: PipelineDeps) => PipelineDeps = (d) => d,
    /** What the harness does when launched again. */
    again: () => Promise<never> | never = () => {
      throw new Error("launched again");
    },
  ): Promise<string> {
    const working = latch();
    let launches = 0;
    const id = await start({
      createHarness: (agent) => ({
        name: agent.harness,
        run: async (ctx) => {
          if (++launches > 1) return again();
          working.open();
          await new Promise((resolve) => ctx.signal?.addEventListener("abort", resolve, { once: true }));
          throw withUsage(FleetError.retryable("agent_error", "stopped for the shutdown"), spent);
        },
      }),
    });
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    const shutdown = new AbortController();
    const run = runStageJob("run", job(id), deps(fleet!.deps), { signal: shutdown.signal }).catch(
      (e: unknown) => e,
    );
    await working.opened;
    shutdown.abort();
    expect(isHandBack(await run)).toBe(true);
    return id;
  }

  it("the run's agent had spent model tokens when its worker shut down and handed the run back, and a cancel came before the next delivery: the result says what", async () => {
    const id = await handedBackAtShutdown();
    await cancelAndClose(id);
    // The next delivery finds the rollout closed: it launches nothing.
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("replayed");
    expect(await fleet!.deps.store.getResult(id)).toMatchObject({ status: "cancelled", usage: spent });
  });

  it("a launch handed back at shutdown, then run again and failed (a retry due), then a cancel: the result's usage is the last launch's, not the handed-back launch's", async () => {
    const later = { ...spent, calls: 9 };
    const id = await handedBackAtShutdown(undefined, () => {
      throw withUsage(FleetError.retryable("agent_error", "the second launch failed"), later);
    });
    // The next delivery launches again; its agent spends, and fails (a retry due).
    await expect(runStageJob("run", job(id), fleet!.deps)).rejects.toThrow(/the second launch failed/);
    await cancelAndClose(id);
    const result = await fleet!.deps.store.getResult(id);
    expect(result!.failures.some((f) => f.usage?.calls === 9)).toBe(true);
    // The last launch's spend, saying the one before it is not counted; not the handed-back
    // launch's said as the rollout's.
    expect(result!.usage).toEqual({
      ...later,
      gaps: [
        "1 earlier launch(es) of this rollout not counted here (see failures[].usage for what was recorded)",
      ],
    });
  });

  it("a launch that spent model tokens, then failed with a retry due, then a cancel before the next launch: the result says what it spent", async () => {
    let launches = 0;
    const id = await start({
      createHarness: (agent) => ({
        name: agent.harness,
        run: async (ctx) => {
          launches++;
          await ctx.provider.exec(ctx.handle, ["agent"], { deadlineMs: ctx.deadlineMs });
          throw withUsage(FleetError.retryable("agent_error", "the model call timed out"), spent);
        },
      }),
    });
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    await expect(runStageJob("run", job(id), fleet!.deps)).rejects.toThrow(/the model call timed out/);
    await cancelAndClose(id);
    // The retry finds the rollout closed: it launches nothing.
    expect(await runStageJob("run", { ...job(id), attemptsMade: 1 }, fleet!.deps)).toBe("replayed");
    expect(launches).toBe(1);
    const result = await fleet!.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "cancelled", usage: spent });
    expect(result!.failures.map((f) => f.usage ?? null)).toEqual([spent, null]);
  });

  /** Owners of the sandboxes alive now. */
  const liveOwners = () =>
    [...provider.sandboxes.values()]
      .filter((s) => s.alive)
      .map((s) => s.handle.owner)
      .sort();

  /** Cancelled, every sandbox gone, the teardown confirmed and nothing left on the ledger for the janitor. */
  async function expectOwnSandboxGone(id: string) {
    expect(liveOwners()).toEqual([]);
    expect(await fleet!.deps.store.getResult(id)).toMatchObject({
      status: "cancelled",
      teardown: "confirmed",
    });
    expect(await fleet!.deps.ledger.size()).toBe(0);
  }

  it("a run in its own sandbox stopped by a cancel destroys that sandbox itself: the result's teardown is confirmed without the janitor", async () => {
    const working = latch();
    const id = await start(
      {
        stopPollMs: 20,
        createHarness: untilStopped(working, () => FleetError.nonRetryable("cancelled", "stopped")),
      },
      "throws",
      "own",
    );
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    const run = runStageJob("run", job(id), fleet!.deps);
    await working.opened;
    expect(liveOwners()).toEqual(["agent", "resources"]);
    // The close destroys the task's sandbox and hands the agent's to the janitor (not its own).
    // The run's stop poll sees the stop (before the close finalizes or after); it stops its
    // agent and destroys its own sandbox.
    await cancelAndClose(id);
    expect(await run).toBe("ok");
    await expectOwnSandboxGone(id);
  });

  it("a run in its own sandbox whose cancel came while it made that sandbox (its lock old by then) destroys that sandbox itself", async () => {
    const { id, launched } = await startOwnNotingLaunch();
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    // The cancel lands while the provider makes the agent's sandbox (an image pull, say).
    const create = provider.create.bind(provider);
    provider.create = async (spec) => {
      const handle = await create(spec);
      if (spec.owner === "agent") await fleet!.deps.store.requestCancel(id);
      return handle;
    };
    // Taken 20 s ago (its sandbox's create that long): past half its 30 s lock, the fence is read.
    expect(await runStageJob("run", { ...job(id), processedOn: Date.now() - 20_000 }, fleet!.deps)).toBe(
      "ok",
    );
    expect(launched()).toBe(false);
    await cancelAndClose(id);
    await expectOwnSandboxGone(id);
  });

  it("a run in its own sandbox whose rollout a close tombstoned while it made that sandbox (its lock fresh) destroys it at its attach and never launches (rule 9)", async () => {
    const { id, launched } = await startOwnNotingLaunch();
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    // The cancel and its close begin (the tombstone) while the provider makes the agent's sandbox,
    // after the run recorded its intent: the close cannot see the handle, so the run's attach must.
    const create = provider.create.bind(provider);
    provider.create = async (spec) => {
      if (spec.owner === "agent") await cancelFleetRun(fleet!, id).catch(() => undefined);
      return create(spec);
    };
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    expect(launched()).toBe(false);
    expect(liveOwners()).toEqual([]);
  });

  it("a run in its own sandbox whose rollout a close tombstoned while it loaded its task makes no sandbox at all: its intent is refused (rule 9)", async () => {
    const { id, launched } = await startOwnNotingLaunch();
    expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
    // The cancel and its close begin (the tombstone) after the run's begin, while it loads its task.
    const store = fleet!.deps.store;
    const getTask = store.getTask.bind(store);
    let closing = true;
    store.getTask = async (digest) => {
      if (closing) {
        closing = false;
        await cancelAndClose(id);
      }
      return getTask(digest);
    };
    const created: string[] = [];
    const create = provider.create.bind(provider);
    provider.create = async (spec) => {
      created.push(spec.owner);
      return create(spec);
    };
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    expect(launched()).toBe(false);
    // Refused before its create, not made and then destroyed by the close's attach check.
    expect(created).toEqual([]);
    expect((await fleet!.deps.ledger.sandboxesOf(id)).agent).toBeNull();
  });
  it("a handback at shutdown whose Redis does not answer the spend's write is not held by it for good", async () => {
    // Only this write goes unanswered (as to a Redis gone away); the rest of the stage is as ever.
    const hanging = (d: PipelineDeps): PipelineDeps => ({
      ...d,
      store: new Proxy(d.store, {
        get: (target, prop, receiver) => {
          if (prop === "saveStoppedRunUsage") return () => new Promise(() => undefined);
          const v = Reflect.get(target, prop, receiver);
          return typeof v === "function" ? v.bind(target) : v;
        },
      }),
    });
    await handedBackAtShutdown(hanging);
  }, 20_000);
});

/**
 * `fleet_model_tokens_total` counts every launch's spend, a stopped one's too: a command agent's
 * spend is what the rollout's gateway counted, known once its access is finished.
 */
describe("a run stopped by a cancel whose agent spent through the model gateway", () => {
  let fleet: InProcessFleet | undefined;
  let upstream: ScriptedUpstream | undefined;
  afterEach(async () => {
    await fleet?.close();
    await upstream?.close();
  });

  it("counts what the gateway counted in fleet_model_tokens_total, as the result says it", async () => {
    upstream = await startScriptedUpstream([
      chatReply({ content: "hi", usage: { prompt: 10, completion: 5 } }),
    ]);
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "test", defaultMetrics: false }));
    // A gateway network on loopback: only the in-memory sandboxes are made here.
    const networks: GatewayNetworks = {
      ensure: async (rolloutId) => ({
        name: `net-${rolloutId}`,
        id: rolloutId,
        rolloutId,
        bridge: "lo",
        subnet: "127.0.0.0/8",
        gatewayIp: "127.0.0.1",
      }),
      allowGateway: async () => undefined,
      remove: async () => ({ alreadyGone: false }),
      list: async () => [],
    };
    const working = latch();
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      startWorkers: false,
      deps: {
        metrics,
        networks,
        stopPollMs: 20,
        harnessDeps: {
          resolveCredential: createCredentialResolver({
            env: {
              FLEET_CREDENTIAL_UPSTREAM: "sk-test",
              FLEET_CREDENTIAL_UPSTREAM_BASE_URL: upstream.baseUrl,
            },
          }),
        },
        // The agent's command asks the model once, then works on until its stop kills it.
        createHarness: (agent) => ({
          name: agent.harness,
          run: async (ctx) => {
            const res = await fetch(`${ctx.env!.OPENAI_BASE_URL}/chat/completions`, {
              method: "POST",
              headers: {
                authorization: `Bearer ${ctx.env!.OPENAI_API_KEY}`,
                "content-type": "application/json",
              },
              body: JSON.stringify({
                model: ctx.env!.FLEET_MODEL,
                messages: [{ role: "user", content: "hi" }],
              }),
            });
            expect(res.status).toBe(200);
            await res.text();
            await ctx.provider.exec(ctx.handle, ["agent"], { deadlineMs: ctx.deadlineMs });
            working.open();
            await new Promise((resolve) => ctx.signal?.addEventListener("abort", resolve, { once: true }));
            throw new Error("killed");
          },
        }),
      },
    });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === "sum-answer")!;
    const [id] = (await fleet.submit([
      {
        task,
        agent: {
          harness: "command",
          argv: ["agent"],
          model: { name: "served-model", baseUrl: upstream.baseUrl, credential: "upstream" },
        },
      },
    ])) as [string];
    expect(await runStageJob("seed", job(id), fleet.deps)).toBe("ok");
    const run = runStageJob("run", job(id), fleet.deps);
    await working.opened;
    await fleet.deps.store.requestCancel(id);
    expect(await run).toBe("ok");
    expect(await runStageJob("close", job(id), fleet.deps)).toBe("ok");
    const result = await fleet.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "cancelled", usage: { promptTokens: 10, completionTokens: 5 } });
    const counted = Object.fromEntries(
      (await metrics.modelTokens.get()).values.map((v) => [v.labels.kind, v.value]),
    );
    expect(counted).toMatchObject({ prompt: 10, completion: 5 });
  });
});
