import { AgentSpec, type FileSet, runNeeds, type SandboxHandle } from "@fleet/contracts";
import type { PutOptions } from "@fleet/sandbox";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/** The agent's own budget in these tests (the oracle's `timeoutS`). */
const OWN_S = 3;
const ORACLE = { harness: "oracle", timeoutS: OWN_S } as const;

/**
 * The harness's setup (the instruction file, the oracle's solution: each a `put`) is not the
 * agent's time: its budget counts from when the harness starts it. Counted from the run's start,
 * a slow daemon's setup turned a correct agent into a graded `agent_timeout`.
 */
describe("the run's setup is not the agent's time", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  /** A fleet on `provider` whose every `put` first runs `beforePut`; one oracle rollout seeded. */
  async function seeded(beforePut: () => Promise<void>, deps: Partial<PipelineDeps> = {}) {
    const provider = new InMemorySandboxProvider();
    const put = provider.put.bind(provider);
    provider.put = async (handle: SandboxHandle, dir: string, files: FileSet, options?: PutOptions) => {
      await beforePut();
      return put(handle, dir, files, options);
    };
    fleet = await startInProcessFleet({ provider, startWorkers: false, deps });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === "hello-file")!;
    const [id] = (await fleet.submit([{ task, agent: ORACLE }])) as [string];
    expect(await runStageJob("seed", job(id), fleet.deps)).toBe("ok");
    const agentExecs = () => provider.execCalls.filter((c) => c.argv.includes("/solution/solve.sh"));
    return { id, task, provider, agentExecs };
  }

  it("a slow setup (700 ms a put) leaves the agent its whole budget: it is not cut, nor graded a timeout", async () => {
    let slow = false;
    const { id, agentExecs } = await seeded(async () => {
      if (slow) await new Promise((r) => setTimeout(r, 700));
    });
    slow = true; // the run's puts only (the seed staged the task's files already)
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    const [exec] = agentExecs();
    // Counted from the run's start, two puts of 700 ms would have left it about 1.6 s of its 3.
    expect(exec!.options.deadlineMs).toBeGreaterThan(OWN_S * 1000 - 300);
    const rec = await fleet!.deps.store.get(id);
    expect(rec!.failure).toBeNull();
    // The agent's own time (`timings.agentMs`) leaves the setup's 1.4 s out: the exec is instant.
    const run = rec!.receipts.run!;
    expect(run.stoppedAt - run.startedAt).toBeLessThan(700);
  });

  it("a setup so slow that the agent's budget, the tests' and the margin no longer fit before the rollout's deadline: masked deadline_exceeded before the agent starts, never graded", async () => {
    let offsetMs = 0;
    let bump = 0;
    const { id, task, agentExecs } = await seeded(
      async () => {
        // The run's first put only: it takes (by the fleet's clock) what `bump` says.
        offsetMs += bump;
        bump = 0;
      },
      { now: () => Date.now() + offsetMs },
    );
    // Until a second past the last moment the run's needs fit before the rollout's deadline: the
    // agent's own budget alone still fits (the tests' would not), so only the whole check masks.
    const deadlineAt = (await fleet!.deps.store.get(id))!.meta.deadlineAt;
    const { needMs } = runNeeds(task, AgentSpec.parse(ORACLE));
    bump = deadlineAt - needMs + 1000 - Date.now();
    // Final: the job fails for good (BullMQ's UnrecoverableError), its failure recorded.
    await expect(
      runStageJob("run", job(id), { ...fleet!.deps, now: () => Date.now() + offsetMs }),
    ).rejects.toThrow(/^deadline_exceeded: preparing the agent's run took/);
    expect(deadlineAt - (Date.now() + offsetMs)).toBeGreaterThan(OWN_S * 1000);
    expect(agentExecs()).toEqual([]);
    const rec = await fleet!.deps.store.get(id);
    expect(rec!.failure).toMatchObject({ failureKind: "deadline_exceeded", mask: true, stage: "run" });
    expect(rec!.failure!.reason).toContain("the agent was not started");
  });
});

describe("a run job taken after the rollout's deadline", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  /**
   * The begin claimed the launch (counting one) before the runner skipped the run for its
   * deadline, and never gave it back: the result said the agent was launched once when nothing
   * of it ran.
   */
  it("claims no launch: the result counts none", async () => {
    const provider = new InMemorySandboxProvider();
    fleet = await startInProcessFleet({ provider, startWorkers: false });
    const deps = fleet.deps;
    const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
    const [id] = (await fleet.submit([{ task, agent: ORACLE }])) as [string];
    expect(await runStageJob("seed", job(id), deps)).toBe("ok");
    const late = { ...deps, now: () => Date.now() + 10 * 3600_000 };
    expect(await runStageJob("run", job(id), late)).toBe("skipped");
    expect(await runStageJob("close", job(id), late)).toBe("ok");
    const result = (await deps.store.getResult(id))!;
    expect(result).toMatchObject({ status: "masked", failureKind: "deadline_exceeded", agentLaunches: 0 });
    expect(provider.execCalls.filter((c) => c.argv.includes("/solution/solve.sh"))).toEqual([]);
  });
});
