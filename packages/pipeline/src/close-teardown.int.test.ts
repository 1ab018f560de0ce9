import type { SandboxHandle } from "@fleet/contracts";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it } from "vitest";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/**
 * DESIGN §2 rule 3 without Docker (pipeline.int's teardown test injects a destroy that throws):
 * a provider may also answer a destroy it could not confirm, and that is no teardown either.
 */
describe("a close whose destroy is not confirmed", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  it("persists the teardown on the ledger and reports the result all the same, with teardown pending (rule 3)", async () => {
    const provider = new InMemorySandboxProvider();
    fleet = await startInProcessFleet({ provider, startWorkers: false });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === "sum-answer")!;
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    for (const stage of ["seed", "run", "verify"] as const)
      expect(await runStageJob(stage, job(id), fleet.deps)).toBe("ok");
    // The daemon answers the remove, but the sandbox is still there.
    provider.destroy = async (h: SandboxHandle) => ({
      confirmed: false,
      scope: "sandbox",
      at: Date.now(),
      alreadyGone: false,
      remaining: 1,
      detail: `${h.name} still running`,
    });
    expect(await runStageJob("close", job(id), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(id)).toMatchObject({
      status: "completed",
      teardown: "pending",
      failureKind: "teardown_failed",
    });
    expect(await fleet.deps.ledger.size()).toBe(1);
  });
});
