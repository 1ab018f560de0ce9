import type { CleanupReceipt, SandboxHandle } from "@fleet/contracts";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/**
 * A cancel's close destroys the sandbox while a stage still works in it (before the run's stop
 * poll sees the cancel): the stage ends quietly, for the close to report `cancelled`, not as a
 * lost sandbox (a false `sandbox_lost` in the logs, a failed job on the board and in the metrics).
 */
describe("a stage whose sandbox a cancel's close destroyed", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  async function start(deps: Partial<PipelineDeps>, killOnGone: "throws" | "alreadyGone" = "throws") {
    const provider = new InMemorySandboxProvider();
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
    const task = suite.find((t) => t.id === "hello-file")!;
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    return { id, provider };
  }

  /** What the dispatcher's cancel does, then the close it enqueues. */
  async function cancelAndClose(id: string) {
    await fleet!.deps.store.requestCancel(id);
    await fleet!.deps.store.recordFailure(
      id,
      {
        stage: "run",
        terminal: true,
        failureKind: "cancelled",
        mask: false,
        reason: "cancelled",
        at: Date.now(),
      },
      { beforeDecided: true },
    );
    expect(await runStageJob("close", job(id), fleet!.deps)).toBe("ok");
  }

  it.each(["throws", "alreadyGone"] as const)(
    "the run (a kill in the gone sandbox %s): the agent's exec ends (killed with its sandbox); the run stage ends, the rollout is cancelled",
    async (killOnGone) => {
      let running!: () => void;
      const started = new Promise<void>((r) => {
        running = r;
      });
      let finish!: () => void;
      const killed = new Promise<void>((r) => {
        finish = r;
      });
      const { id } = await start(
        {
          createHarness: (agent) => ({
            name: agent.harness,
            run: async () => {
              running();
              await killed;
              return { exec: execResult({ exitCode: 137 }), answer: null, transcript: null, usage: null };
            },
          }),
        },
        killOnGone,
      );
      expect(await runStageJob("seed", job(id), fleet!.deps)).toBe("ok");
      const run = runStageJob("run", job(id), fleet!.deps);
      await started;
      await cancelAndClose(id);
      finish();
      expect(await run).toBe("ok");
      expect(await fleet!.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
      const result = await fleet!.deps.store.getResult(id);
      expect(result).toMatchObject({ status: "cancelled", failureKind: "cancelled" });
      expect(result!.failures.map((f) => f.failureKind)).toEqual(["cancelled"]);
    },
  );

  it("the verify: the tests' exec fails with the sandbox gone; the verify stage ends, the rollout is cancelled", async () => {
    let grading!: () => void;
    const started = new Promise<void>((r) => {
      grading = r;
    });
    let finish!: () => void;
    const killed = new Promise<void>((r) => {
      finish = r;
    });
    const { id } = await start({
      verify: async () => {
        grading();
        await killed;
        throw new Error("exec failed: no such container");
      },
    });
    for (const stage of ["seed", "run"] as const)
      expect(await runStageJob(stage, job(id), fleet!.deps)).toBe("ok");
    const verify = runStageJob("verify", job(id), fleet!.deps);
    await started;
    await cancelAndClose(id);
    finish();
    expect(await verify).toBe("ok");
    // It enqueues close itself: a cancel whose dispatcher died before enqueueing it still closes.
    expect(await fleet!.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
    const result = await fleet!.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "cancelled", failureKind: "cancelled" });
    expect(result!.failures.map((f) => f.failureKind)).toEqual(["cancelled"]);
  });
});
