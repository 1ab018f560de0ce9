import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import type { RolloutResult, TaskContent } from "@fleet/contracts";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, describe, expect, it } from "vitest";
import { FleetProcesses } from "../scripts/lib/fleet-processes.ts";
import { callApi } from "./helpers/api.ts";
import { containersOf, dropPrefix, IMAGE, REDIS_URL, testPrefix, waitFor } from "./helpers/env.ts";

const SKEW = resolve(import.meta.dirname, "helpers/clock-skew.mjs");
/** A process whose host's clock is `ms` ahead (negative: behind). */
const skewed = (ms: number) => ({ NODE_OPTIONS: `--import ${SKEW}`, TEST_CLOCK_SKEW_MS: String(ms) });

describe("a fleet whose hosts' clocks disagree", () => {
  const prefix = testPrefix("skew");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-skew-"));
  let fleet: FleetProcesses | null = null;
  afterAll(async () => {
    await fleet?.stop();
    await dropPrefix(REDIS_URL, prefix);
    rmSync(logDir, { recursive: true, force: true });
  });

  it("grades a rollout with time to spare although the janitor's clock is 5 minutes ahead, the agent worker's 30 s ahead and the dispatcher's 30 s behind: every process decides on Redis's clock", async () => {
    fleet = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix,
      logDir,
      env: { FLEET_JANITOR_INTERVAL_MS: "500" },
      envOf: { janitor: skewed(300_000), agent: skewed(30_000), dispatcher: skewed(-30_000) },
    });
    const suite: TaskContent[] = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE };
    // 120 s for an agent of about 5 s. On the hosts' own clocks this rollout was past its
    // deadline to the janitor at once (masked, its sandbox destroyed under the agent), and short
    // of time to the agent worker (masked before its launch).
    const submitted = await callApi(fleet, "POST", "/v1/rollouts", {
      task,
      deadlineS: 120,
      agent: { harness: "command", argv: ["sh", "-c", "sleep 5; printf 'Hello, fleet!\\n' > hello.txt"] },
    });
    expect(submitted.status).toBe(202);
    const id = String(submitted.body!.id);
    const result = await waitFor(`result of ${id}`, async () => {
      const r = await callApi(fleet!, "GET", `/v1/rollouts/${id}`);
      return ["completed", "masked", "failed", "cancelled"].includes(String(r.body?.status))
        ? (r.body as unknown as RolloutResult)
        : null;
    });
    expect(result, JSON.stringify(result)).toMatchObject({ status: "completed", reward: 1 });
    // Its timings are spans of one clock: the whole rollout took well under a minute, not the
    // 30 s the dispatcher's clock is behind added to it.
    expect(result.timings.totalMs).not.toBeNull();
    expect(result.timings.totalMs!).toBeLessThan(30_000);
    expect(result.timings.queuedMs!).toBeLessThan(30_000);
    await waitFor("its sandbox gone", async () => (await containersOf([id])) === 0);
  });
});
