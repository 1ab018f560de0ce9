import { RolloutRequest } from "@fleet/contracts";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

describe("stage workers at a concurrency above ten", () => {
  let fleet: InProcessFleet | undefined;
  const warnings: Error[] = [];
  const onWarning = (w: Error) => warnings.push(w);
  afterEach(async () => {
    process.off("warning", onWarning);
    await fleet?.close();
  });

  it("run twelve agents at once with no listener-leak warning (each run listens for the worker's shutdown)", async () => {
    process.on("warning", onWarning);
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === "hello-file")!;
    const n = 12;
    let running = 0;
    let release!: () => void;
    const allRunning = new Promise<void>((resolve) => {
      release = resolve;
    });
    const createHarness: NonNullable<PipelineDeps["createHarness"]> = (agent) => ({
      name: agent.harness,
      async run() {
        // Every run stays in flight until all twelve are: twelve listeners at once.
        if (++running === n) release();
        await allRunning;
        return { exec: execResult(), answer: null, transcript: null, usage: null };
      },
    });
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      concurrency: n,
      deps: { createHarness, verify: async () => ({ reward: 1, details: { kind: "test" } }) },
    });
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await fleet.submit(Array.from({ length: n }, () => request));
    const results = await fleet.waitForResults(ids, 60_000);
    expect(running).toBe(n);
    expect(results.map((r) => r.status)).toEqual(Array(n).fill("completed"));
    expect(warnings.map((w) => `${w.name}: ${w.message}`)).toEqual([]);
  });
});
