import type { TaskContent } from "@fleet/contracts";
import { DockerSandboxProvider } from "@fleet/sandbox";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
// Scoped to this file's run (test files share the one daemon).
const docker = new DockerSandboxProvider({ scope: `stage-runner-test-${process.pid}` });
const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/**
 * The stage runner around real handlers, jobs delivered by hand (no workers): what a re-delivered
 * job does once its stage's receipt is stored.
 */
describe("stage runner: a stage whose receipt is stored stays done", () => {
  let fleet: InProcessFleet;
  let task: TaskContent;
  beforeAll(async () => {
    fleet = await startInProcessFleet({ provider: docker, startWorkers: false });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    task = { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE };
  });
  afterAll(async () => fleet.close());

  /** A rollout graded 1.0 by real seed, run and verify stages, its close not yet run. */
  async function graded(): Promise<string> {
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    for (const stage of ["seed", "run", "verify"] as const) {
      expect(await runStageJob(stage, job(id), fleet.deps)).toBe("ok");
    }
    expect((await fleet.deps.store.get(id))?.receipts.verify?.reward).toBe(1);
    return id;
  }

  async function closeAndResult(id: string) {
    expect(await runStageJob("close", job(id), fleet.deps)).toBe("ok");
    return fleet.deps.store.getResult(id);
  }

  it("a stage job whose id is not the fleet's own (Bull Board's duplicate, a script's add) is dropped untouched: no agent launched, no receipt", async () => {
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    expect(await runStageJob("seed", { ...job(id), id: `${id}.seed` }, fleet.deps)).toBe("ok");
    const before = await fleet.deps.store.get(id);
    for (const stray of ["24", `${id}.seed`, `${id}.run.copy`]) {
      expect(await runStageJob("run", { ...job(id), id: stray }, fleet.deps)).toBe("stray");
    }
    expect(await fleet.deps.store.get(id)).toEqual(before);
    // The fleet's own job runs it.
    expect(await runStageJob("run", { ...job(id), id: `${id}.run` }, fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.get(id)).toMatchObject({
      launches: 1,
      receipts: { run: expect.anything() },
    });
    // Its sandbox goes with its close.
    expect(await runStageJob("close", job(id), fleet.deps)).toBe("ok");
    expect(await docker.list({ "fleet.rollout": id })).toEqual([]);
  });

  it("a verify delivered again after its deadline passed keeps its reward", async () => {
    const id = await graded();
    // Its worker died before completing the job; BullMQ hands it out again hours later.
    const later = { ...fleet.deps, now: () => Date.now() + 7 * 24 * 3_600_000 };
    expect(await runStageJob("verify", job(id), later)).toBe("replayed");
    expect((await fleet.deps.store.get(id))?.failure).toBeNull();
    expect(await fleet.deps.queues.queues.close.getJob(`${id}.close`)).toBeTruthy();
    expect(await closeAndResult(id)).toMatchObject({
      status: "completed",
      reward: 1,
      failureKind: null,
      teardown: "confirmed",
    });
  });

  it("a verify delivered again after a cancel that came too late keeps its reward", async () => {
    const id = await graded();
    // The cancel's flag lands (the API answers that the rollout is graded and ends as it would).
    await fleet.deps.store.requestCancel(id);
    expect(await runStageJob("verify", job(id), fleet.deps)).toBe("replayed");
    expect((await fleet.deps.store.get(id))?.failure).toBeNull();
    expect(await closeAndResult(id)).toMatchObject({ status: "completed", reward: 1 });
  });

  it("a verify whose close cannot be enqueued on its last attempt keeps its reward for the watchdog's close", async () => {
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    for (const stage of ["seed", "run"] as const) {
      expect(await runStageJob(stage, job(id), fleet.deps)).toBe("ok");
    }
    // The receipt (the reward) is stored, and the close job sent with it is lost; sending it
    // again fails too, for good.
    const real = fleet.deps.queues;
    const queues = Object.assign(Object.create(real) as typeof real, {
      enqueue: async () => {
        throw new Error("connection reset");
      },
      enqueueAfter: async (...args: Parameters<typeof real.enqueueAfter>) => {
        await real.enqueueAfter(...args);
        await (await real.queues.close.getJob(`${id}.close`))?.remove();
        throw new Error("connection reset");
      },
    });
    const last = { data: { rolloutId: id }, attemptsMade: 2, opts: { attempts: 3 } };
    await expect(runStageJob("verify", last, { ...fleet.deps, queues })).rejects.toThrow();
    const rec = await fleet.deps.store.get(id);
    expect(rec?.receipts.verify?.reward).toBe(1);
    expect(rec?.failure).toBeNull();
    expect(await real.queues.close.getJob(`${id}.close`)).toBeUndefined();
    expect(await closeAndResult(id)).toMatchObject({ status: "completed", reward: 1 });
  });
});

/**
 * DESIGN §2 rule 12: a failed or masked result says why. A verifier or harness that throws an
 * error without a message (`throw new Error()`) still leaves a reason, never `""`.
 */
describe("stage runner: a failure thrown without a message", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  async function seeded(deps: Parameters<typeof startInProcessFleet>[0]["deps"]): Promise<string> {
    fleet = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false, deps });
    const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    expect(await runStageJob("seed", job(id), fleet.deps)).toBe("ok");
    return id;
  }

  it("a verifier that crashes with an empty message is masked with a reason naming what was thrown", async () => {
    const id = await seeded({
      verify: async () => {
        throw new TypeError();
      },
    });
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    await expect(runStageJob("verify", job(id), fleet!.deps)).rejects.toThrow();
    expect(await runStageJob("close", job(id), fleet!.deps)).toBe("ok");
    const result = await fleet!.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "masked", failureKind: "verifier_error", stage: "verify" });
    expect(result?.reason).toBe("verifier_error: the error thrown (TypeError) carried no message");
    expect(result?.failures.map((f) => f.reason)).toEqual([result?.reason]);
  });

  it("a harness whose last attempt throws an empty message is masked with a reason, as is each retry's log entry", async () => {
    const id = await seeded({
      createHarness: () => ({
        name: "oracle" as const,
        run: async () => {
          throw new Error("");
        },
      }),
    });
    for (const attemptsMade of [0, 1, 2]) {
      await expect(runStageJob("run", { ...job(id), attemptsMade }, fleet!.deps)).rejects.toThrow();
    }
    expect(await runStageJob("close", job(id), fleet!.deps)).toBe("ok");
    const result = await fleet!.deps.store.getResult(id);
    expect(result).toMatchObject({ status: "masked", failureKind: "provider_unavailable", stage: "run" });
    expect(result?.reason).toBe("provider_unavailable: the error thrown (Error) carried no message");
    expect(result?.failures).toHaveLength(3);
    for (const f of result!.failures) expect(f.reason).not.toBe("");
  });
});
