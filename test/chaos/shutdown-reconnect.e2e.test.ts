import { mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { TaskContent } from "@fleet/contracts";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FleetProcesses } from "../../scripts/lib/fleet-processes.ts";
import { containersOf, IMAGE, testPrefix, waitFor } from "../helpers/env.ts";
import { FleetClient } from "./lib/fleet-client.ts";
import { PrivateRedis } from "./lib/private-redis.ts";

/**
 * Worker lifecycle under operations: a SIGTERM during a long agent run ends the process within
 * FLEET_SHUTDOWN_TIMEOUT_MS and hands the run back, so it completes on another replica exactly
 * once; a Redis restart under running workers does not stop them from taking new jobs; a
 * dispatcher stopped while Redis is down exits cleanly.
 */
const SHUTDOWN_TIMEOUT_MS = 6_000;

describe("graceful shutdown and Redis reconnection (whole processes)", () => {
  const prefix = testPrefix("lifecycle");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-lifecycle-"));
  let redis: PrivateRedis;
  let fleet: FleetProcesses;
  let client: FleetClient;
  let suite: TaskContent[];
  const ids: string[] = [];
  const task = (id: string) => suite.find((t) => t.id === id)!;

  beforeAll(async () => {
    suite = (await loadSuite(EXAMPLE_SUITE_DIR)).map((t) => ({ ...t, image: IMAGE }));
    redis = await PrivateRedis.start();
    fleet = await FleetProcesses.start({
      redisUrl: redis.url,
      prefix,
      logDir,
      replicas: { agent: 2 },
      env: {
        FLEET_SHUTDOWN_TIMEOUT_MS: String(SHUTDOWN_TIMEOUT_MS),
        // Long locks: a job that was merely abandoned would sit for 30 s before another worker
        // took it as stalled; a handed-back one is taken at once.
        FLEET_LOCK_DURATION_MS: "30000",
        FLEET_STALLED_INTERVAL_MS: "15000",
        FLEET_JANITOR_INTERVAL_MS: "2000",
      },
    });
    client = new FleetClient(fleet.url, fleet.token);
  });

  afterAll(async () => {
    await fleet?.stop();
    await redis?.stop();
    expect(await containersOf(ids)).toBe(0);
  });

  it("SIGTERM during a long agent run: the worker exits within the bound and the rollout completes once elsewhere", async () => {
    const id = await client.submit(
      {
        task: task("hello-file"),
        agent: {
          harness: "command",
          argv: [
            "sh",
            "-c",
            "echo run >> /workspace/attempts.log; sleep 20; echo 'Hello, fleet!' > hello.txt",
          ],
        },
      },
      `${prefix}-sigterm`,
    );
    ids.push(id);
    const conn = new Redis(redis.url);
    try {
      const key = `${prefix}:x:rollout:${id}`;
      const fence = await waitFor("the harness to launch", async () => {
        const f = await conn.hget(key, "fence");
        return f?.startsWith("launched:") ? f : null;
      });
      // The fence names the worker that launched it (FLEET_WORKER_ID = agent-<index>).
      const index = Number(/^launched:agent-(\d+):/.exec(fence)?.[1]);
      expect([0, 1]).toContain(index);
      const started = Date.now();
      const code = await fleet.kill("agent", index, "SIGTERM");
      const tookMs = Date.now() - started;
      expect(code).toBe(0);
      // Within its bound, far short of the 20 s run it hands back; 2 s of room for a loaded host
      // to deliver the signal and reap the process.
      expect(tookMs).toBeLessThan(SHUTDOWN_TIMEOUT_MS + 2_000);
      const log = readFileSync(join(logDir, `agent-${index}.log`), "utf8");
      expect(log).toContain("handed the job back");

      // The other replica takes it at once (no 30 s stalled-lock wait) and the rollout completes.
      await waitFor(
        "the run to start again on the other replica",
        async () => (await conn.hget(key, "fence"))?.startsWith(`launched:agent-${1 - index}:`),
        15_000,
      );
      const result = await waitFor("the result", () => client.terminal(id), 120_000);
      expect(result).toMatchObject({
        status: "completed",
        reward: 1,
        teardown: "confirmed",
        failureKind: null,
      });
      // Exactly once: two launches (the handed-back one and the one that finished), one result,
      // and the hand-back was not a failure (no retry spent, nothing in the failure log).
      expect(Number(await conn.hget(key, "launches"))).toBe(2);
      expect(await conn.lrange(`${key}:failures`, 0, -1)).toEqual([]);
      expect(result?.failures).toEqual([]);
      expect(await conn.zscore(`${prefix}:x:inflight`, id)).toBeNull();
    } finally {
      conn.disconnect();
    }
  });

  it("a Redis restart under running workers: new rollouts are still processed, no worker restarted", async () => {
    const pids = () =>
      fleet.procs
        .filter((p) => p.child.exitCode === null && p.child.signalCode === null)
        .map((p) => `${p.kind}-${p.index}:${p.child.pid}`)
        .sort();
    const before = pids();
    const first = await client.submit(
      { task: task("sum-answer"), agent: { harness: "oracle" } },
      `${prefix}-r1`,
    );
    ids.push(first);
    expect(await waitFor("the first result", () => client.terminal(first))).toMatchObject({
      status: "completed",
    });

    // A crash (SIGKILL), down for 3 s, then back on the same port with its AOF.
    await redis.restart({ signal: "SIGKILL", downMs: 3_000 });

    const second = await client.submit(
      { task: task("hello-file"), agent: { harness: "oracle" } },
      `${prefix}-r2`,
    );
    ids.push(second);
    expect(await waitFor("the second result", () => client.terminal(second), 90_000)).toMatchObject({
      status: "completed",
      reward: 1,
    });
    // The first rollout's result survived the crash (AOF), and every process is the same one.
    expect(await client.terminal(first)).toMatchObject({ status: "completed" });
    expect(pids()).toEqual(before);
    for (const kind of ["resources", "agent", "verifier"] as const) {
      const live = fleet.of(kind)[0]!;
      const log = readFileSync(join(logDir, `${kind}-${live.index}.log`), "utf8");
      expect(log, `${kind}-${live.index} reconnected`).toContain("redis connection ready again");
    }
  });

  // Last: it stops the dispatcher.
  it("a dispatcher stopped while Redis is down answers 503 until then and exits cleanly (0)", async () => {
    await redis.crash();
    try {
      await waitFor("the dispatcher to see Redis gone", async () => {
        const res = await fetch(`${fleet.url}/v1/rollouts/none`, {
          headers: { authorization: `Bearer ${fleet.token}` },
        });
        return res.status === 503;
      });
      // Its shutdown does not wait on, nor fail for, a QUIT that Redis cannot answer.
      expect(await fleet.kill("dispatcher", 0, "SIGTERM")).toBe(0);
      const log = readFileSync(join(logDir, "dispatcher-0.log"), "utf8");
      expect(log).toContain('"msg":"stopped"');
      expect(log).not.toContain("error while shutting down");
    } finally {
      await redis.relaunch();
    }
  });
});
