import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type InProcessFleet, startInProcessFleet } from "@fleet/pipeline";
import { BubblewrapSandboxProvider } from "@fleet/sandbox";
import { bwrapUnavailable, testRootfs } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const unavailable = bwrapUnavailable();
if (unavailable) console.warn(`skipping the bubblewrap pipeline test: ${unavailable}`);

/** The lifecycle on the Docker-less provider: the same stages, receipts and grading. */
describe.skipIf(unavailable !== null)("the pipeline on bubblewrap sandboxes", () => {
  let fleet: InProcessFleet;
  let provider: BubblewrapSandboxProvider;
  let stateDir = "";

  beforeAll(async () => {
    stateDir = await mkdtemp(join(tmpdir(), "fleet-bwrap-e2e-"));
    provider = new BubblewrapSandboxProvider({ rootfs: await testRootfs(), stateDir, scope: "e2e-bwrap" });
    fleet = await startInProcessFleet({ provider, concurrency: 4 });
  });
  afterAll(async () => {
    await fleet?.close();
    expect(await provider.list()).toHaveLength(0);
    await rm(stateDir, { recursive: true, force: true });
  });

  it("grades oracle rollouts 1.0 and a do-nothing agent 0, and destroys every sandbox", async () => {
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const tasks = suite.filter((t) =>
      ["hello-file", "python-bugfix", "sum-answer", "poem-stats"].includes(t.id),
    );
    expect(tasks).toHaveLength(4);
    const oracle = await fleet.submit(tasks.map((task) => ({ task, agent: { harness: "oracle" as const } })));
    const wrong = await fleet.submit(
      tasks.map((task) => ({ task, agent: { harness: "command" as const, argv: ["true"] } })),
    );
    const results = await fleet.waitForResults([...oracle, ...wrong], 180_000);
    for (const r of results.slice(0, 4))
      expect(r).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
    for (const r of results.slice(4))
      expect(r).toMatchObject({ status: "completed", reward: 0, teardown: "confirmed" });
    const seed = (await fleet.deps.store.get(oracle[0]!))!.receipts.seed!;
    expect(seed.handle.provider).toBe("bubblewrap");
    expect(seed.probe.isolated).toBe(true);
  });

  it.each([
    ["000", "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & "],
    ["700", ""],
  ])(
    "an agent that makes its workspace unenterable to root (chmod %s) is graded 0, not masked nor failed",
    async (mode, leftover) => {
      // Root in a bwrap sandbox has no capability to enter the agent's 0700 workspace: the kill
      // sweep, the tests' staging and their runner start elsewhere, so nothing fails but the tests.
      const [task] = await loadSuite(EXAMPLE_SUITE_DIR, { only: ["hello-file"] }).then((s) =>
        s.filter((t) => t.id === "hello-file"),
      );
      const argv = ["sh", "-c", `echo 'Hello, fleet!' > hello.txt; ${leftover}chmod ${mode} /workspace`];
      const [id] = await fleet.submit([{ task: task!, agent: { harness: "command", argv } }]);
      const [r] = await fleet.waitForResults([id!], 120_000);
      expect(r).toMatchObject({ status: "completed", reward: 0, mask: false, failureKind: null });
    },
  );
});
