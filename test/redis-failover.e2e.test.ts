import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { RolloutResult, TaskContent } from "@fleet/contracts";
import { RolloutStore } from "@fleet/queue";
import { FailoverPair } from "@fleet/queue/testing";
import { DockerSandboxProvider, LABEL_ROLLOUT } from "@fleet/sandbox";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FleetProcesses } from "../scripts/lib/fleet-processes.ts";
import { callApi } from "./helpers/api.ts";
import { containersOf, IMAGE, testPrefix, waitFor } from "./helpers/env.ts";
import { parseMetrics, sampleValue } from "./ops/prom.ts";

const TERMINAL = ["completed", "masked", "failed", "cancelled"];

/**
 * A managed Redis's failover, as the apps meet it: two Redis servers of the test's own (B a
 * replica of A) behind one name (a TCP forwarder standing for a DNS name or a provider's
 * endpoint), the dispatcher, the three stage workers and the janitor as separate processes on
 * that name. Mid-run the name moves to B and A becomes B's replica; every connection the apps
 * hold stays on A, where each write is refused (READONLY).
 */
describe("the fleet's processes through a failover of their Redis", () => {
  const logDir = mkdtempSync(join(tmpdir(), "fleet-failover-e2e-"));
  const prefix = testPrefix("failover");
  const ids: string[] = [];
  let pair: FailoverPair | null = null;
  let fleet: FleetProcesses | null = null;
  let suite: TaskContent[];

  beforeAll(async () => {
    suite = await loadSuite(EXAMPLE_SUITE_DIR);
    pair = await FailoverPair.start();
    fleet = await FleetProcesses.start({
      redisUrl: pair.url,
      prefix,
      logDir,
      env: { FLEET_JANITOR_INTERVAL_MS: "2000" },
    });
  }, 180_000);

  afterAll(async () => {
    await fleet?.stop();
    await pair?.stop();
    const left = await containersOf(ids);
    // Counted, then swept: a failed run must not leave its sandboxes to the next.
    const docker = new DockerSandboxProvider();
    for (const s of await docker.list()) {
      if (ids.includes(s.labels[LABEL_ROLLOUT] ?? "")) await docker.destroy(s.handle).catch(() => undefined);
    }
    rmSync(logDir, { recursive: true, force: true });
    expect(left).toBe(0);
  });

  const api = (method: string, path: string, body?: unknown, headers?: Record<string, string>) =>
    callApi(fleet!, method, path, body, headers);
  const request = () => ({
    task: { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE },
    agent: { harness: "oracle" },
  });

  it("rollouts in flight at the failover complete once, on the new master; the dispatcher admits again after a 503 or so, and says the new master evicts", async () => {
    const { adminA, adminB } = pair!;
    // The replica to be promoted evicts keys when full, as replicas kept for reads sometimes do:
    // the apps, checking it again once they reconnect, say so (and run on).
    await adminB.config("SET", "maxmemory-policy", "allkeys-lru");
    const batch = await api("POST", "/v1/batches", { rollouts: Array.from({ length: 6 }, request) });
    expect(batch.status).toBe(202);
    ids.push(...(batch.body!.rolloutIds as string[]));
    // Some have begun (a seed's receipt stored): the master is demoted mid-run.
    await waitFor("a rollout past admission", async () => {
      for (const id of ids) {
        const r = await api("GET", `/v1/rollouts/${id}`);
        if (r.body?.status !== "accepted") return true;
      }
      return false;
    });
    await pair!.failOver();
    const failedOverAt = Date.now();

    // A new rollout: refused while the dispatcher's connection is still on A (503, try again),
    // then admitted on B.
    const statuses: number[] = [];
    const late = await waitFor(
      "the dispatcher to admit a rollout again",
      async () => {
        const r = await api("POST", "/v1/rollouts", request());
        statuses.push(r.status);
        if (r.status === 202) return r.body!.id as string;
        expect(r.status).toBe(503);
        return null;
      },
      30_000,
      100,
    );
    ids.push(late);

    const results = await Promise.all(
      ids.map((id) =>
        waitFor(
          `the result of ${id}`,
          async () => {
            const r = await api("GET", `/v1/rollouts/${id}`);
            return TERMINAL.includes(String(r.body?.status)) ? (r.body as unknown as RolloutResult) : null;
          },
          120_000,
        ),
      ),
    );
    expect(results.map((r) => [r.status, r.reward, r.teardown])).toEqual(
      ids.map(() => ["completed", 1, "confirmed"]),
    );
    // On B, the master now, each ended once with no failure noted; A still answers as its replica.
    const onB = new RolloutStore(adminB, prefix);
    for (const id of ids) {
      const record = await onB.get(id);
      expect(record?.status).toBe("completed");
      expect(record?.failure).toBeNull();
    }
    expect(/^role:slave/m.test(await adminA.info("replication"))).toBe(true);
    const dispatcherMetrics = async () => parseMetrics(await (await fetch(`${fleet!.url}/metrics`)).text());
    expect(sampleValue(await dispatcherMetrics(), "fleet_redis_durable")).toBe(0);
    const said = readFileSync(join(logDir, "dispatcher-0.log"), "utf8")
      .split("\n")
      .filter((line) => line.includes("not safe for its state"));
    expect(said).toHaveLength(1);
    expect(said[0]).toContain('maxmemory-policy is \\"allkeys-lru\\"');
    // The janitor, which no rollout needed meanwhile, ticks on B too (its job scheduler's ticks,
    // each a job its worker completes).
    await waitFor(
      "a janitor tick completed on the new master",
      async () =>
        (await adminB.zrangebyscore(`${prefix}:janitor:completed`, failedOverAt, "+inf")).length > 0,
      30_000,
    );
    console.log(
      `[failover] ${ids.length} rollouts completed; dispatcher answers before its first 202: ${statuses.join(",")}; last result ${((Date.now() - failedOverAt) / 1000).toFixed(1)} s after the failover`,
    );
  }, 240_000);
});
