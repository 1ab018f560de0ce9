import {
  type ExecOptions,
  FleetError,
  RolloutRequest,
  type SandboxHandle,
  type TaskContent,
} from "@fleet/contracts";
import { stageJobId } from "@fleet/queue";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { ProviderHoldError } from "./hand-back.ts";
import { janitorTick } from "./janitor.ts";
import { HELD_REASON, MAX_HOLDS, runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { NO_OP_AGENT_AND_VERIFIER } from "./testing/no-op-stages.ts";

/** An in-memory provider that counts how often it was asked for a listing (the breaker's probe). */
class CountingProvider extends InMemorySandboxProvider {
  lists = 0;
  /** Only the listing fails (the breaker's question), every other call works. */
  listFails = false;
  override async list() {
    this.lists++;
    if (this.listFails) throw FleetError.retryable("provider_unavailable", "no answer to the listing");
    return super.list();
  }
}

/**
 * A task image with its own /workspace files (the seed's probe says so): a run interrupted after
 * its agent started cannot be put back for another, and is masked `sandbox_lost`. The agent is
 * one exec, `agent`; `onAgent` runs first (to break the provider as it starts).
 */
class OwnWorkspaceProvider extends CountingProvider {
  agentExecs = 0;
  onAgent: () => void = () => undefined;
  override async probe(handle: SandboxHandle) {
    return { ...(await super.probe(handle)), workspaceEmpty: false };
  }
  override async exec(handle: SandboxHandle, argv: string[], options: ExecOptions) {
    if (argv[0] === "agent") {
      this.agentExecs++;
      this.onAgent();
    }
    return super.exec(handle, argv, options);
  }
}

const execHarness: Pick<PipelineDeps, "createHarness" | "verify"> = {
  createHarness: (agent) => ({
    name: agent.harness,
    run: async (ctx) => ({
      exec: await ctx.provider.exec(ctx.handle, ["agent"], { deadlineMs: 10_000 }),
      answer: null,
      transcript: null,
      usage: null,
    }),
  }),
  verify: async () => ({ reward: 1, details: { kind: "test" } }),
};

describe("the provider breaker (real Redis and BullMQ, an in-memory provider that stops answering)", () => {
  let fleet: InProcessFleet | undefined;
  let task: TaskContent;
  beforeAll(async () => {
    task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
  });
  afterEach(async () => {
    await fleet?.close();
    fleet = undefined;
  });

  /** A fleet without workers whose provider answers no listing and fails every create, and one rollout. */
  const downFleet = async () => {
    const provider = new CountingProvider();
    provider.listFails = true;
    const started = await startInProcessFleet({
      provider,
      deps: NO_OP_AGENT_AND_VERIFIER,
      startWorkers: false,
    });
    fleet = started; // closed by afterEach
    provider.create = async () => {
      throw FleetError.retryable("provider_unavailable", "docker create failed: ECONNREFUSED");
    };
    const [id] = await started.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    return { provider, id, fleet: started };
  };

  it("holds seeds while the provider does not answer, spending no attempt however long it lasts, and grades them once it answers", async () => {
    const provider = new CountingProvider();
    provider.unreachable = true;
    const registry = createMetricsRegistry({ app: "breaker-test", defaultMetrics: false });
    const metrics = createFleetMetrics(registry);
    fleet = await startInProcessFleet({
      provider,
      concurrency: 4,
      deps: { ...NO_OP_AGENT_AND_VERIFIER, metrics },
      workerOptions: {
        providerBreaker: { probeMs: 100, callTimeoutMs: 1_000 },
        // A supervisor quick to replace a stopped worker must leave the paused ones alone.
        supervise: { intervalMs: 50, stuckAfterMs: 1_000 },
      },
    });
    const ids = await fleet.submit(
      Array.from({ length: 3 }, () => RolloutRequest.parse({ task, agent: { harness: "oracle" } })),
    );
    const seedJobs = () =>
      Promise.all(ids.map((id) => fleet!.deps.queues.queues.seed.getJob(stageJobId(id, "seed"))));

    await vi.waitFor(() => expect(fleet!.workers!.providerDown).toBe(true), { timeout: 10_000 });
    // Well past the attempts a retry would have spent (8 for seed), with jobs already delayed
    // by the probe interval each: the breaker keeps asking, nothing is spent, nothing recorded.
    const listsAtTrip = provider.lists;
    await vi.waitFor(() => expect(provider.lists).toBeGreaterThan(listsAtTrip + 20), {
      timeout: 20_000,
      interval: 50,
    });
    for (const job of await seedJobs()) {
      expect(job!.attemptsMade).toBe(0);
      expect(["delayed", "waiting"]).toContain(await job!.getState());
    }
    for (const id of ids) {
      const rec = await fleet.deps.store.get(id);
      expect(rec?.status).toBe("accepted");
      expect(rec?.failure).toBeNull();
    }
    const log = (await Promise.all(ids.map((id) => fleet!.deps.store.failureLog(id)))).flat();
    expect(log.length).toBeGreaterThan(0);
    // The workers stopped taking seeds: a job is held once (twice if a fetch already under way
    // brought it back), not once per probe interval as a worker that kept taking them would.
    expect(log.length).toBeLessThanOrEqual(2 * ids.length);
    for (const entry of log) {
      expect(entry).toMatchObject({ stage: "seed", terminal: false, failureKind: "provider_unavailable" });
      expect(entry.reason).toMatch(/^held while the sandbox provider is unreachable: /);
    }
    expect(await registry.metrics()).toMatch(/^fleet_sandbox_provider_up\{app="breaker-test"\} 0$/m);
    expect(fleet.workers!.recreated).toBe(0);

    provider.unreachable = false;
    const results = await fleet.waitForResults(ids, 30_000);
    expect(results.map((r) => [r.status, r.reward])).toEqual(Array(3).fill(["completed", 1]));
    expect(fleet.workers!.providerDown).toBe(false);
    expect(await registry.metrics()).toMatch(/^fleet_sandbox_provider_up\{app="breaker-test"\} 1$/m);
    expect(await registry.metrics()).toMatch(
      /^fleet_stage_jobs_total\{stage="seed",outcome="held",app="breaker-test"\} [1-9]/m,
    );
  });

  it("does not hold a failure when the provider still answers: the retries are spent as before", async () => {
    const provider = new CountingProvider();
    const create = provider.create.bind(provider);
    let creates = 0;
    provider.create = async (spec) => {
      if (++creates <= 1) {
        throw FleetError.retryable("provider_unavailable", "docker create failed: HTTP 500: boom");
      }
      return create(spec);
    };
    fleet = await startInProcessFleet({
      provider,
      deps: NO_OP_AGENT_AND_VERIFIER,
      workerOptions: { providerBreaker: { probeMs: 100, callTimeoutMs: 1_000 } },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    const [result] = await fleet.waitForResults([id!], 30_000);
    expect(result).toMatchObject({ status: "completed", reward: 1 });
    const log = await fleet.deps.store.failureLog(id!);
    expect(log).toHaveLength(1);
    // A retry's entry, not a hold's.
    expect(log[0]!.reason).toBe("docker create failed: HTTP 500: boom");
    expect(fleet.workers!.providerDown).toBe(false);
  });

  it("a rollout held past its deadline ends masked, deadline_exceeded, by the watchdog and a close that runs while the provider is down", async () => {
    const provider = new CountingProvider();
    provider.unreachable = true;
    fleet = await startInProcessFleet({
      provider,
      deps: { ...NO_OP_AGENT_AND_VERIFIER, intentGraceMs: 0 },
      workerOptions: { providerBreaker: { probeMs: 100, callTimeoutMs: 1_000 } },
    });
    // Timeouts as short as a task has (1 s each): the shortest deadline it admits is 20 s.
    const quick = { ...task, timeouts: { agentS: 1, verifierS: 1 } };
    const [id] = await fleet.submit([
      RolloutRequest.parse({ task: quick, agent: { harness: "oracle" }, deadlineS: 20 }),
    ]);
    await vi.waitFor(() => expect(fleet!.workers!.providerDown).toBe(true), { timeout: 10_000 });
    const rec = await fleet.deps.store.get(id!);
    // The watchdog (the janitor's, run here by hand) closes it once past the deadline.
    await vi.waitFor(
      async () => {
        const report = await janitorTick(fleet!.deps, { orphanGraceMs: 60_000, watchdogGraceMs: 0 });
        expect(Date.now()).toBeGreaterThan(rec!.meta.deadlineAt);
        expect(report.watchdogClosed).toBe(1);
      },
      { timeout: 40_000, interval: 200 },
    );
    const [result] = await fleet.waitForResults([id!], 10_000);
    expect(result).toMatchObject({ status: "masked", reward: null });
    expect(result!.failureKind).toBe("deadline_exceeded");
    expect(fleet.workers!.providerDown).toBe(true);
  });

  it("a run held before its agent's command was created starts afresh: an image with its own /workspace files is graded, not masked", async () => {
    const provider = new OwnWorkspaceProvider();
    // The daemon goes away as the agent's exec is sent: it is refused before anything starts.
    provider.onAgent = () => {
      if (provider.agentExecs === 1) provider.unreachable = true;
    };
    fleet = await startInProcessFleet({
      provider,
      deps: execHarness,
      workerOptions: { providerBreaker: { probeMs: 100, callTimeoutMs: 1_000 } },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await vi.waitFor(() => expect(fleet!.workers!.providerDown).toBe(true), { timeout: 10_000 });
    provider.unreachable = false;
    const [result] = await fleet.waitForResults([id!], 30_000);
    expect(result).toMatchObject({ status: "completed", reward: 1 });
    expect(provider.agentExecs).toBe(2);
    expect(result!.failures.map((f) => [f.stage, f.reason.startsWith(HELD_REASON)])).toEqual([["run", true]]);
  });

  it("a run whose agent's command may have started is not taken for a fresh one: the image's own /workspace cannot be put back, masked", async () => {
    const provider = new OwnWorkspaceProvider();
    // The exec was created and started; its stream broke (the daemon answered, so no hold).
    provider.onExec = () => {
      if (provider.agentExecs === 1)
        throw FleetError.retryable("provider_unavailable", "docker exec failed: socket hang up");
      return {};
    };
    fleet = await startInProcessFleet({
      provider,
      deps: execHarness,
      workerOptions: { providerBreaker: { probeMs: 100, callTimeoutMs: 1_000 } },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    const [result] = await fleet.waitForResults([id!], 30_000);
    expect(result).toMatchObject({
      status: "masked",
      reward: null,
      failureKind: "sandbox_lost",
      stage: "run",
    });
    expect(result!.reason).toMatch(/the image has its own \/workspace files/);
    expect(provider.agentExecs).toBe(1);
  });

  it("never holds a final failure: an agent failed for good (the model upstream) is not run again", async () => {
    const provider = new CountingProvider();
    let runs = 0;
    fleet = await startInProcessFleet({
      provider,
      deps: {
        ...NO_OP_AGENT_AND_VERIFIER,
        createHarness: (agent) => ({
          name: agent.harness,
          run: async () => {
            runs++;
            provider.listFails = true; // and the provider stops answering at the same time
            throw FleetError.nonRetryable("provider_unavailable", "the model upstream failed for good");
          },
        }),
      },
      workerOptions: { providerBreaker: { probeMs: 100, callTimeoutMs: 1_000 } },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    const [result] = await fleet.waitForResults([id!], 30_000);
    expect(result).toMatchObject({ status: "masked", failureKind: "provider_unavailable", stage: "run" });
    expect(runs).toBe(1);
    expect(result!.failures.filter((f) => f.reason.startsWith(HELD_REASON))).toEqual([]);
  });

  it("holds one stage of a rollout at most MAX_HOLDS times: a provider that flaps does not rerun an agent until the deadline", async () => {
    const { provider, id, fleet } = await downFleet();
    const job = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 8 } };
    const options = {
      providerDown: async () =>
        await provider.list().then(
          () => false,
          () => true,
        ),
    };
    for (let hold = 1; hold <= MAX_HOLDS; hold++) {
      await expect(runStageJob("seed", job, fleet.deps, options)).rejects.toBeInstanceOf(ProviderHoldError);
    }
    // The next failure is an attempt like any other: retried, not held.
    const err = await runStageJob("seed", job, fleet.deps, options).catch((e: unknown) => e);
    expect(err).not.toBeInstanceOf(ProviderHoldError);
    expect(err).toMatchObject({ kind: "provider_unavailable", retryable: true });
    const log = await fleet.deps.store.failureLog(id!);
    expect(log.filter((f) => f.reason.startsWith(HELD_REASON))).toHaveLength(MAX_HOLDS);
    expect(log.at(-1)!.reason).toBe("docker create failed: ECONNREFUSED");
  });

  it("does not hold a failure whose hold could not end before the rollout's deadline (holdMs): it is a failure like any other", async () => {
    const { id, fleet } = await downFleet();
    const deadlineAt = (await fleet.deps.store.get(id!))!.meta.deadlineAt;
    const job = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 8 } };
    const options = { providerDown: async () => true, holdMs: 2_000 };
    // 3 s before the deadline: a hold (ending 2 s before it) fits.
    const early = { ...fleet.deps, now: () => deadlineAt - 3_000 };
    await expect(runStageJob("seed", job, early, options)).rejects.toBeInstanceOf(ProviderHoldError);
    // 1 s before it: none fits; a final failure (no retry fits either), recorded, close enqueued.
    const late = { ...fleet.deps, now: () => deadlineAt - 1_000 };
    const err = await runStageJob("seed", job, late, options).catch((e: unknown) => e);
    expect(err).not.toBeInstanceOf(ProviderHoldError);
    const log = await fleet.deps.store.failureLog(id!);
    expect(log.filter((f) => f.reason.startsWith(HELD_REASON))).toHaveLength(1);
    expect(log.at(-1)).toMatchObject({ stage: "seed", failureKind: "provider_unavailable" });
  });
});
