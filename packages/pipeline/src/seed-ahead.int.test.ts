import { RolloutRequest, type TaskContent } from "@fleet/contracts";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, beforeAll, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { createStageWorkers, type StageWorkers } from "./worker.ts";

/** Poll a condition (never a fixed sleep). */
async function until(what: string, probe: () => Promise<boolean> | boolean, timeoutMs = 30_000) {
  const end = Date.now() + timeoutMs;
  while (!(await probe())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

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

  it("stops making sandboxes while enough rollouts wait for an agent, and makes the rest once agents take them", async () => {
    const provider = new InMemorySandboxProvider();
    const live = () => [...provider.sandboxes.values()].filter((s) => s.alive).length;
    const deps: Partial<PipelineDeps> = {
      createHarness: (agent) => ({
        name: agent.harness,
        run: async () => ({ exec: execResult(), answer: null, transcript: null, usage: null }),
      }),
      verify: async () => ({ reward: 1, details: { kind: "test" } }),
    };
    fleet = await startInProcessFleet({ provider, startWorkers: false, deps });
    const common = { connection: fleet.redis, prefix: fleet.prefix, concurrency: 2 } as const;
    // Resources workers, no agent yet: without the bound, all twenty would be seeded.
    const resources = createStageWorkers(["seed", "close"], fleet.deps, {
      ...common,
      seedAhead: { min: 3, intervalMs: 50, recountMs: 5 },
    });
    started.push(resources);
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await fleet.submit(Array.from({ length: 20 }, () => request));
    const { seed, run } = fleet.deps.queues.queues;
    await until("seeding to pause with no seed in flight", () => {
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
    const agents = createStageWorkers(["run", "verify"], fleet.deps, common);
    started.push(agents);
    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => r.status)).toEqual(Array(20).fill("completed"));
    expect(resources.seedAhead!.held).toBe(false);
    expect(live()).toBe(0);
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
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await fleet.submit(Array.from({ length: 12 }, () => request));
    await until("four agents busy and seeding paused at four waiting", () => {
      const s = resources.seedAhead!;
      return running === 4 && s.held && s.inFlight === 0 && s.bound === 4 && s.ahead === 4;
    });
    expect((await fleet.deps.queues.queues.run.getJobCounts("wait")).wait).toBe(4);
    release.open();
    const results = await fleet.waitForResults(ids, 60_000);
    expect(results.map((r) => r.status)).toEqual(Array(12).fill("completed"));
  });

  it("keeps seeding without a bound (`seedAhead: false`)", async () => {
    const provider = new InMemorySandboxProvider();
    fleet = await startInProcessFleet({ provider, startWorkers: false });
    const resources = createStageWorkers(["seed", "close"], fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: 2,
      seedAhead: false,
    });
    started.push(resources);
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    await fleet.submit(Array.from({ length: 12 }, () => request));
    const { run } = fleet.deps.queues.queues;
    await until("every rollout seeded", async () => (await run.getJobCounts("wait")).wait === 12);
    expect(resources.seedAhead).toBeNull();
  });
});
