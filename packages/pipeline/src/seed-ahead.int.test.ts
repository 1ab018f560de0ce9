import { RolloutRequest, type StageName, type TaskContent } from "@fleet/contracts";
import { cancelRollout } from "@fleet/queue";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import type { Job } from "bullmq";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { NO_OP_AGENT_AND_VERIFIER, until } from "./testing/no-op-stages.ts";
import { createStageWorkers, handBacksOf, type SeedAheadOptions, type StageWorkers } from "./worker.ts";

describe("the seed-ahead bound", () => {
  let fleet: InProcessFleet | undefined;
  const started: StageWorkers[] = [];
  let task: TaskContent;
  beforeAll(async () => {
    task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
  });
  afterEach(async () => {
    for (const w of started.splice(0)) await w.close(5_000);
    await fleet?.close();
  });
  const submit = (n: number) =>
    fleet!.submit(
      Array.from({ length: n }, () => RolloutRequest.parse({ task, agent: { harness: "oracle" } })),
    );

  /** A fleet with no workers but resources workers (seed, close) under `seedAhead`. */
  async function resourcesOnly(
    seedAhead: SeedAheadOptions | false,
    options: { concurrency?: number; deps?: Partial<PipelineDeps>; createMs?: number } = {},
  ) {
    const provider = new InMemorySandboxProvider();
    if (options.createMs) {
      const create = provider.create.bind(provider);
      provider.create = async (spec) => {
        await new Promise((r) => setTimeout(r, options.createMs));
        return create(spec);
      };
    }
    fleet = await startInProcessFleet({ provider, startWorkers: false, deps: options.deps });
    const resources = createStageWorkers(["seed", "close"], fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: options.concurrency ?? 2,
      seedAhead,
    });
    started.push(resources);
    const live = () => [...provider.sandboxes.values()].filter((box) => box.alive).length;
    return { fleet, resources, live };
  }

  /** Workers for `stages` (without the bound), stopped after the test. */
  function startWorkers(stages: StageName[]): void {
    started.push(
      createStageWorkers(stages, fleet!.deps, {
        connection: fleet!.redis,
        prefix: fleet!.prefix,
        concurrency: 2,
      }),
    );
  }

  /**
   * Count the answers to the bound's counts from now on, each arriving `lagMs` late (the count
   * itself runs in Redis at once). Returns the run queue's own `getJobCounts` and how many
   * answers arrived so far. `used`, if given, is called once the bound has used an answer.
   */
  function watchCounts(lagMs = 0, used?: () => void) {
    const run = fleet!.deps.queues.queues.run;
    const getJobCounts = run.getJobCounts.bind(run);
    const state = { answered: 0, getJobCounts };
    run.getJobCounts = async (...types) => {
      const counts = await getJobCounts(...types);
      if (lagMs > 0) await new Promise((r) => setTimeout(r, lagMs));
      state.answered++;
      // The bound uses the answer in the microtasks that follow (it sets the bound, then lets
      // seeds through): over by the next macrotask.
      if (used) setImmediate(used);
      return counts;
    };
    return state;
  }

  /**
   * Wait until `holds` stays true over three answers to the bound's counts in a row: a state the
   * counts confirm, not a moment between two (a seed that ended while a count was on its way is
   * counted twice until the next).
   */
  async function settled(what: string, counts: { answered: number }, holds: () => boolean) {
    let since = -1;
    await until(what, () => {
      if (!holds()) {
        since = -1;
        return false;
      }
      if (since < 0) since = counts.answered;
      return counts.answered >= since + 3;
    });
  }

  it("stops making sandboxes while enough rollouts wait for an agent, and makes the rest once agents take them", async () => {
    // Resources workers, no agent yet: without the bound, all twenty would be seeded.
    const { fleet, resources, live } = await resourcesOnly(
      { min: 3, intervalMs: 50, recountMs: 5 },
      { deps: NO_OP_AGENT_AND_VERIFIER },
    );
    const counts = watchCounts();
    const ids = await submit(20);
    const { seed, run } = fleet.deps.queues.queues;
    await settled("seeding to pause with no seed in flight", counts, () => {
      const s = resources.seedAhead!;
      return s.held && s.inFlight === 0;
    });
    // Exactly at the bound: this process counts its seeds in flight. Its two worker slots hold a
    // seed job each, waiting for the bound before it begins (no sandbox for them yet).
    expect((await run.getJobCounts("wait")).wait).toBe(3);
    expect(live()).toBe(3);
    expect(await seed.getJobCounts("wait", "active")).toEqual({ wait: 15, active: 2 });

    // Agents (and verifiers) come: seeding resumes as they take the waiting rollouts, and every
    // rollout ends graded.
    startWorkers(["run", "verify"]);
    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => r.status)).toEqual(Array(20).fill("completed"));
    expect(resources.seedAhead!.held).toBe(false);
    expect(live()).toBe(0);
  });

  it("counts the rollouts waiting for a verifier too: agents faster than the verifiers do not pile sandboxes up", async () => {
    const { fleet, resources, live } = await resourcesOnly(
      { min: 3, intervalMs: 50, recountMs: 5 },
      { deps: NO_OP_AGENT_AND_VERIFIER },
    );
    // Agents that take every run at once, and no verifier yet.
    startWorkers(["run"]);
    // The bound follows how fast the agents take rollouts as well as `min`: the largest any
    // count set is what the seeds were held to.
    let maxBound = 0;
    const counts = watchCounts(0, () => {
      maxBound = Math.max(maxBound, resources.seedAhead!.bound);
    });
    const ids = await submit(20);
    const { verify } = fleet.deps.queues.queues;
    await settled("seeding to pause with no seed in flight", counts, () => {
      const s = resources.seedAhead!;
      return s.held && s.inFlight === 0 && s.bound === 3;
    });
    // The agents take every run: read the queues once they have (on a loaded machine a run can
    // still wait or be in progress after the counts settled, its sandbox in no verify queue yet).
    await until("the agents to take and end every run", async () => {
      const { wait, active } = await counts.getJobCounts("wait", "active");
      return wait === 0 && active === 0;
    });
    // At the bound, plus the runs that were in progress when it was counted (not waiting then,
    // they joined the verify queue after): at most one per agent slot. The bound is `min` (3)
    // unless a count found the agents taking more than that per interval (4 was seen on a loaded
    // machine). Twenty without the bound.
    const waitingForVerifier = (await verify.getJobCounts("wait")).wait!;
    expect(waitingForVerifier).toBeGreaterThanOrEqual(3);
    expect(waitingForVerifier).toBeLessThanOrEqual(maxBound + 2);
    expect(waitingForVerifier).toBeLessThanOrEqual(10);
    expect(live()).toBe(waitingForVerifier);
    // Verifiers come: every rollout ends graded.
    startWorkers(["verify"]);
    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => r.status)).toEqual(Array(20).fill("completed"));
    expect(live()).toBe(0);
  });

  it("keeps to the bound when a count's answer comes back after seeds that ended meanwhile", async () => {
    // Counted again as soon as a seed waits, while the first seeds still make their sandboxes
    // (10 ms each): they end while the answer is on its way (50 ms), and this process has counted
    // them too.
    const { resources } = await resourcesOnly(
      { min: 3, intervalMs: 50, recountMs: 0 },
      { concurrency: 4, createMs: 10 },
    );
    const counts = watchCounts(50);
    await submit(16);
    // Counts keep landing while it is paused (the one that was on its way too): none lets
    // another seed through.
    await settled("seeding to pause with no seed in flight", counts, () => {
      const s = resources.seedAhead!;
      return s.held && s.inFlight === 0;
    });
    expect((await counts.getJobCounts("wait")).wait).toBe(3);
  });

  it("lets no seed through before its first count has landed (a backlog already waits)", async () => {
    const provider = new InMemorySandboxProvider();
    fleet = await startInProcessFleet({ provider, startWorkers: false });
    const common = { connection: fleet.redis, prefix: fleet.prefix, concurrency: 2 } as const;
    const first = createStageWorkers(["seed"], fleet.deps, {
      ...common,
      seedAhead: { min: 4, intervalMs: 50, recountMs: 5 },
    });
    const firstCounts = watchCounts();
    await submit(10);
    await settled("four rollouts seeded", firstCounts, () => {
      const s = first.seedAhead!;
      return s.held && s.inFlight === 0;
    });
    await first.close(5_000);
    // A new process, whose counts answer late: until one has, it does not know of the four.
    const counts = watchCounts(300);
    const second = createStageWorkers(["seed"], fleet.deps, {
      ...common,
      seedAhead: { min: 3, intervalMs: 50, recountMs: 5 },
    });
    started.push(second);
    await until("the new process to count the backlog and hold", () => {
      const s = second.seedAhead!;
      return s.held && s.ahead === 4 && s.inFlight === 0;
    });
    expect((await counts.getJobCounts("wait")).wait).toBe(4);
  });

  it("sends a seed that waited its time back to the queue, no attempt spent, and keeps the bound", async () => {
    const registry = createMetricsRegistry({ app: "resources-test", defaultMetrics: false });
    const { fleet, resources } = await resourcesOnly(
      { min: 2, intervalMs: 50, recountMs: 5, maxWaitMs: 100 },
      { deps: { metrics: createFleetMetrics(registry) } },
    );
    await submit(8);
    await until(
      "waiting seeds to go back to the queue a few times",
      () => resources.seedAhead!.requeued >= 6,
    );
    const { seed, run } = fleet.deps.queues.queues;
    expect((await run.getJobCounts("wait")).wait).toBe(2);
    const jobs = await seed.getJobs(["wait", "active"]);
    expect(jobs).toHaveLength(6);
    expect(jobs.map((j) => j.attemptsMade)).toEqual(Array(6).fill(0));
    // Each hand-back counted on its job (so its deliveries are not taken for Redis holds).
    const handBacks = jobs.map((j) => handBacksOf(j));
    expect(handBacks.reduce((a, b) => a + b, 0)).toBeGreaterThanOrEqual(3);
    for (const j of jobs) expect(j.attemptsStarted - j.attemptsMade).toBeGreaterThanOrEqual(handBacksOf(j));
    // Counted as such (not as a stage's outcome, and not without a trace).
    const counted = await registry.getSingleMetricAsString("fleet_stage_jobs_total");
    expect(Number(counted.match(/stage="seed",outcome="requeued"[^}]*\} (\d+)/)?.[1])).toBeGreaterThanOrEqual(
      6,
    );
  });

  it("times a seed held at the bound from when it passed it: the wait is no work of the stage", async () => {
    const registry = createMetricsRegistry({ app: "resources-test", defaultMetrics: false });
    const { fleet, resources } = await resourcesOnly(
      { min: 1, intervalMs: 50, recountMs: 5 },
      { deps: { ...NO_OP_AGENT_AND_VERIFIER, metrics: createFleetMetrics(registry) } },
    );
    const counts = watchCounts();
    const ids = await submit(3);
    await settled("seeding to pause with no seed in flight", counts, () => {
      const s = resources.seedAhead!;
      return s.held && s.inFlight === 0;
    });
    // Two seeds wait at the bound a second (the length of the wait is what is measured), then pass it.
    const heldAt = Date.now();
    await until("the seeds to have waited a second at the bound", () => Date.now() - heldAt >= 1_000);
    startWorkers(["run", "verify"]);
    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => r.status)).toEqual(Array(3).fill("completed"));
    const text = await registry.getSingleMetricAsString("fleet_stage_duration_seconds");
    const seeds = (le: string) =>
      Number(
        text
          .split("\n")
          .find((l) => l.includes(`le="${le}"`) && l.includes('stage="seed",outcome="ok"'))
          ?.split(" ")
          .at(-1),
      );
    // Every seed's own work (an in-memory sandbox) takes milliseconds; two of them waited a second.
    expect(seeds("+Inf")).toBe(3);
    expect(seeds("0.5")).toBe(3);
  });

  it("lets as many rollouts wait as agents are busy, when that is more than the minimum", async () => {
    const provider = new InMemorySandboxProvider();
    const release = latch();
    let running = 0;
    fleet = await startInProcessFleet({
      provider,
      startWorkers: false,
      deps: {
        // Four agents that stay busy until released.
        createHarness: (agent) => ({
          name: agent.harness,
          run: async () => {
            running++;
            await release.opened;
            return { exec: execResult(), answer: null, transcript: null, usage: null };
          },
        }),
        verify: async () => ({ reward: 1, details: { kind: "test" } }),
      },
    });
    const common = { connection: fleet.redis, prefix: fleet.prefix } as const;
    const resources = createStageWorkers(["seed", "close"], fleet.deps, {
      ...common,
      concurrency: 2,
      seedAhead: { min: 1, intervalMs: 50, recountMs: 5 },
    });
    started.push(resources);
    started.push(createStageWorkers(["run", "verify"], fleet.deps, { ...common, concurrency: 4 }));
    const counts = watchCounts();
    const ids = await submit(12);
    await settled("four agents busy and seeding paused at a bound of four", counts, () => {
      const s = resources.seedAhead!;
      return running === 4 && s.held && s.inFlight === 0 && s.bound === 4;
    });
    // At least the four (more if the rate of the agents' first takes raised the bound for a moment:
    // a sandbox made is not taken back).
    expect((await fleet.deps.queues.queues.run.getJobCounts("wait")).wait).toBeGreaterThanOrEqual(4);
    release.open();
    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => r.status)).toEqual(Array(12).fill("completed"));
  });

  it("counts the seeds another process is making: a second resources worker makes none while the first's fill the bound", async () => {
    const provider = new InMemorySandboxProvider();
    const made = latch();
    let creating = 0;
    const create = provider.create.bind(provider);
    provider.create = async (spec) => {
      creating++;
      await made.opened;
      return create(spec);
    };
    fleet = await startInProcessFleet({ provider, startWorkers: false });
    const common = { connection: fleet.redis, prefix: fleet.prefix, concurrency: 3 } as const;
    // The first counts once, at its start, before it lets its seeds in: the others learn of them
    // from what it says as it lets them in, not from a later count of its own.
    const first = createStageWorkers(["seed"], fleet.deps, {
      ...common,
      seedAhead: { min: 2, intervalMs: 600_000, recountMs: 600_000 },
    });
    started.push(first);
    const counts = watchCounts();
    await submit(8);
    await until("the first process's two seeds making their sandboxes, its third held", () => {
      const s = first.seedAhead!;
      return creating === 2 && s.held && s.inFlight === 2;
    });
    // A second replica: by its own count nothing waits for an agent yet (the first's two are still
    // being made), so it would let two more in.
    const second = createStageWorkers(["seed"], fleet.deps, {
      ...common,
      seedAhead: { min: 2, intervalMs: 50, recountMs: 5 },
    });
    started.push(second);
    await settled("the second process to count and hold its seeds", counts, () => second.seedAhead!.held);
    expect(second.seedAhead!.inFlight).toBe(0);
    expect(creating).toBe(2);
    // The first shuts down (a rolling restart) while its two still make their sandboxes: they
    // are still counted.
    const closing = first.close(30_000);
    await settled("the second process to count a few times more", counts, () => second.seedAhead!.held);
    expect(second.seedAhead!.inFlight).toBe(0);
    expect(creating).toBe(2);
    // Made, the two wait for an agent (counted in the run queue now): still two in all.
    made.open();
    await closing;
    await settled("the second process held with no seed in flight", counts, () => {
      const s = second.seedAhead!;
      return s.held && s.inFlight === 0;
    });
    expect((await fleet.deps.queues.queues.run.getJobCounts("wait")).wait).toBe(2);
    expect(creating).toBe(2);
    // Its last seed ended: its entry is gone.
    expect(Object.keys(await fleet.redis.hgetall(fleet.deps.store.keys.seeding()))).toHaveLength(1);
  });

  it("does not count a seed of a finished rollout as seeded: no rollout waits for an agent after it", async () => {
    const provider = new InMemorySandboxProvider();
    fleet = await startInProcessFleet({ provider, startWorkers: false });
    const [id] = await submit(1);
    // Finished before a worker takes its seed: cancelled and closed.
    await cancelRollout(fleet.deps.store, fleet.deps.queues, id!, Date.now());
    const close = { data: { rolloutId: id! }, attemptsMade: 0, opts: { attempts: 3 } } as unknown as Job;
    expect(await runStageJob("close", close, fleet.deps)).toBe("ok");
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("cancelled");
    // One count, at the start (none again within the test): what the bound adds after it is its own.
    const counts = watchCounts();
    const resources = createStageWorkers(["seed"], fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: 2,
      seedAhead: { min: 3, intervalMs: 600_000, recountMs: 600_000 },
    });
    started.push(resources);
    const { seed, run } = fleet.deps.queues.queues;
    await until(
      "the seed to be replayed",
      async () => (await seed.getJobCounts("completed")).completed === 1,
    );
    expect(counts.answered).toBe(1);
    expect((await run.getJobCounts("wait", "delayed")).wait).toBe(0);
    expect(resources.seedAhead!.ahead).toBe(0);
    expect(provider.sandboxes.size).toBe(0);
  });

  it("lets the seeds of cancelled rollouts past a full bound, uncounted: they make no sandbox and hold no worker slot", async () => {
    // No agent: the first two rollouts fill the bound for good.
    const { fleet, resources, live } = await resourcesOnly(
      { min: 2, intervalMs: 50, recountMs: 5, maxWaitMs: 600_000 },
      { deps: NO_OP_AGENT_AND_VERIFIER },
    );
    const counts = watchCounts();
    await submit(2);
    const { seed } = fleet.deps.queues.queues;
    await until("the bound to fill", () => live() === 2);
    // Three more, cancelled while their seeds wait at the bound (two in the worker's slots).
    const ids = await submit(3);
    await settled("two seeds to wait at the bound", counts, () => {
      const s = resources.seedAhead!;
      return s.held && s.inFlight === 0;
    });
    expect(await seed.getJobCounts("wait", "active")).toEqual({ wait: 1, active: 2 });
    for (const id of ids) await cancelRollout(fleet.deps.store, fleet.deps.queues, id, Date.now());
    // Their seeds go on to be skipped, the bound still full, instead of waiting (here for ten
    // minutes) for agents to free it; the slots are free for the seeds behind them.
    await until(
      "the cancelled rollouts' seeds to end",
      async () => Object.values(await seed.getJobCounts("wait", "active", "delayed")).every((n) => n === 0),
      10_000,
    );
    const results = await fleet.waitForResults(ids, 10_000);
    expect(results.map((r) => r.status)).toEqual(["cancelled", "cancelled", "cancelled"]);
    expect(live()).toBe(2);
    expect(resources.seedAhead).toMatchObject({ held: false, inFlight: 0, ahead: 2 });
  });

  it("keeps seeding without a bound (`seedAhead: false`), its gauge at 0", async () => {
    const registry = createMetricsRegistry({ app: "resources-test", defaultMetrics: false });
    const { fleet, resources } = await resourcesOnly(false, {
      deps: { metrics: createFleetMetrics(registry) },
    });
    await submit(12);
    const { run } = fleet.deps.queues.queues;
    await until("every rollout seeded", async () => (await run.getJobCounts("wait")).wait === 12);
    expect(resources.seedAhead).toBeNull();
    expect(await registry.getSingleMetricAsString("fleet_seeding_held")).toMatch(
      /^fleet_seeding_held({[^}]*})? 0$/m,
    );
  });
});
