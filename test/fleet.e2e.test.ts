import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { RolloutResult, TaskContent } from "@fleet/contracts";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runFleet } from "../apps/cli/src/testing/run-bin.ts";
import { FleetProcesses } from "../scripts/lib/fleet-processes.ts";
import { callApi } from "./helpers/api.ts";
import { containersOf, dropPrefix, IMAGE, REDIS_URL, testPrefix, waitFor } from "./helpers/env.ts";

/** A value that must never be stored anywhere (DESIGN §2 rule 8). */
const SENTINEL = `sk-sentinel-${Math.random().toString(36).slice(2)}-do-not-leak`;

describe("the whole fleet as separate processes", () => {
  const prefix = testPrefix("fleet");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-e2e-"));
  let fleet: FleetProcesses;
  let suite: TaskContent[];
  const ids: string[] = [];

  const api = (method: string, path: string, body?: unknown, headers?: Record<string, string>) =>
    callApi(fleet!, method, path, body, headers);
  const task = (id: string) => ({ ...suite.find((t) => t.id === id)!, image: IMAGE });
  const result = async (id: string) =>
    waitFor(`result of ${id}`, async () => {
      const r = await api("GET", `/v1/rollouts/${id}`);
      return ["completed", "masked", "failed", "cancelled"].includes(String(r.body?.status))
        ? (r.body as unknown as RolloutResult)
        : null;
    });

  beforeAll(async () => {
    suite = await loadSuite(EXAMPLE_SUITE_DIR);
    fleet = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix,
      logDir,
      // Fast failover for the SIGKILL test; a secret in every worker's environment that must not leak.
      env: {
        FLEET_LOCK_DURATION_MS: "4000",
        FLEET_STALLED_INTERVAL_MS: "2000",
        FLEET_JANITOR_INTERVAL_MS: "2000",
        FLEET_CREDENTIAL_DEFAULT: SENTINEL,
        OPENAI_API_KEY: SENTINEL,
      },
    });
  });

  afterAll(async () => {
    await fleet?.stop();
    await dropPrefix(REDIS_URL, prefix);
    expect(await containersOf(ids)).toBe(0);
  });

  it("runs a rollout through the API and answers 422 for an invalid task up front", async () => {
    const ok = await api("POST", "/v1/rollouts", { task: task("hello-file"), agent: { harness: "oracle" } });
    expect(ok.status).toBe(202);
    const id = String(ok.body?.id);
    ids.push(id);
    expect(await result(id)).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });

    const bad = await api("POST", "/v1/rollouts", {
      task: { ...task("hello-file"), timeouts: { agentS: -5, verifierS: 10 } },
      agent: { harness: "oracle" },
    });
    expect(bad.status).toBe(422);
    expect(bad.body).toMatchObject({ error: { code: "invalid" } });
  });

  it("same Idempotency-Key and body → same rollout; another body → 409", async () => {
    const body = { task: task("sum-answer"), agent: { harness: "oracle" } };
    const a = await api("POST", "/v1/rollouts", body, { "idempotency-key": `k-${prefix}` });
    const b = await api("POST", "/v1/rollouts", body, { "idempotency-key": `k-${prefix}` });
    expect(a.status).toBe(202);
    expect(b.body?.id).toBe(a.body?.id);
    ids.push(String(a.body?.id));
    const c = await api(
      "POST",
      "/v1/rollouts",
      { ...body, metadata: { other: true } },
      { "idempotency-key": `k-${prefix}` },
    );
    expect(c.status).toBe(409);
    expect(c.body).toMatchObject({ error: { code: "conflict" } });
    await result(String(a.body?.id));
  });

  it("an agent worker SIGKILLed mid-run: the stage is re-delivered and the rollout ends exactly once", async () => {
    // The agent writes its marker, then works for 6 s; the worker dies in the middle.
    const agent = {
      harness: "command",
      argv: [
        "sh",
        "-c",
        "echo run >> /workspace/attempts.log; sleep 6; echo 'Hello, fleet!' > /workspace/hello.txt",
      ],
    };
    const res = await api("POST", "/v1/rollouts", { task: task("hello-file"), agent });
    const id = String(res.body?.id);
    ids.push(id);
    const redis = new Redis(REDIS_URL);
    try {
      await waitFor("the harness to launch", async () =>
        (await redis.hget(`${prefix}:x:rollout:${id}`, "fence"))?.startsWith("launched:"),
      );
      await fleet.killAndRestart("agent", 0);
      const r = await result(id);
      // Graded on the re-delivered run (the hello-file task's tests read hello.txt).
      expect(r).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
      const raw = await redis.hgetall(`${prefix}:x:rollout:${id}`);
      const run = JSON.parse(raw["r:run"]!) as { attempts: number };
      expect(run.attempts).toBeGreaterThanOrEqual(2);
      // Exactly once: one terminal result, and the batch-less rollout left the in-flight set once.
      expect(await redis.zscore(`${prefix}:x:inflight`, id)).toBeNull();
      expect(Number(raw.launches)).toBe(run.attempts);
      // The result says it was rerun, and how long the launch it was graded on took.
      expect(r.agentLaunches).toBe(run.attempts);
      expect(r.timings.agentMs).toBeLessThan(r.timings.runMs!);
      // The stall is in the log of the worker that found it, naming the job (so the rollout).
      const stalled = readFileSync(join(logDir, "agent-0.log"), "utf8")
        .split("\n")
        .filter((l) => l.includes("a stage job stalled"));
      expect(stalled.some((l) => l.includes(`"jobId":"${id}.run"`))).toBe(true);
    } finally {
      redis.disconnect();
    }
    await waitFor("no container left for the rollout", async () => (await containersOf([id])) === 0, 30_000);
  });

  it("cancel mid-run → cancelled, close ran, no sandbox left", async () => {
    const res = await api("POST", "/v1/rollouts", {
      task: task("hello-file"),
      agent: { harness: "command", argv: ["sleep", "120"] },
    });
    const id = String(res.body?.id);
    ids.push(id);
    const redis = new Redis(REDIS_URL);
    await waitFor("the harness to launch", async () =>
      (await redis.hget(`${prefix}:x:rollout:${id}`, "fence"))?.startsWith("launched:"),
    );
    redis.disconnect();
    const c = await api("POST", `/v1/rollouts/${id}/cancel`);
    expect(c.status).toBe(202);
    expect(await result(id)).toMatchObject({ status: "cancelled", failureKind: "cancelled", reward: null });
    expect(await containersOf([id])).toBe(0);
  });

  it("fleet submit --rerun submits again the masked lines of a results file `fleet submit --out` wrote: their tasks and agent line up with it", async () => {
    const env = { FLEET_URL: fleet.url, FLEET_TOKEN: fleet.token };
    const first = join(logDir, "first.jsonl");
    const pick = ["--task", "hello-file", "--task", "sum-answer"];
    const submit = ["submit", "--suite", EXAMPLE_SUITE_DIR, "--agent", "oracle", ...pick];
    const ran = await runFleet(
      [...submit, "--repeat", "2", "--wait", "--out", first, "--poll-interval", "200"],
      env,
    );
    expect(ran.code, ran.stderr).toBe(0);
    const lines = readFileSync(first, "utf8")
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l) as RolloutResult);
    ids.push(...lines.map((l) => l.id));
    expect(lines.map((l) => l.status)).toEqual(["completed", "completed", "completed", "completed"]);
    // Masking one for real takes a fault; what is under test is that the results file the CLI
    // wrote lines up with the suite and the agent as it reads them again (task digests, names).
    const picked = lines.find((l) => l.taskId === "sum-answer" && l.metadata?.repeat === 1)!;
    const edited = join(logDir, "edited.jsonl");
    writeFileSync(
      edited,
      lines
        .map(
          (l) =>
            `${JSON.stringify(l === picked ? { ...l, status: "masked", reward: null, mask: true } : l)}\n`,
        )
        .join(""),
    );
    const again = join(logDir, "again.jsonl");
    const rerun = await runFleet(
      [...submit, "--rerun", edited, "--wait", "--out", again, "--poll-interval", "200"],
      env,
    );
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(rerun.stderr).toContain(`submitted 1 rollout (the masked of ${edited}, 1 task)`);
    const redone = readFileSync(again, "utf8")
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l) as RolloutResult);
    ids.push(...redone.map((l) => l.id));
    expect(redone.map((l) => [l.taskId, l.taskDigest, l.agent, l.metadata, l.status, l.reward])).toEqual([
      ["sum-answer", picked.taskDigest, "oracle", { repeat: 1 }, "completed", 1],
    ]);
    expect(redone[0]!.id).not.toBe(picked.id);
  });

  it("no credential value anywhere in Redis, the logs or the results after a batch", async () => {
    const rows = suite
      .slice(0, 4)
      .map((t) => ({ task: { ...t, image: IMAGE }, agent: { harness: "oracle" } }));
    const b = await api("POST", "/v1/batches", { rollouts: rows });
    expect(b.status).toBe(202);
    const batchId = String(b.body?.batchId);
    ids.push(...((b.body?.rolloutIds ?? []) as string[]));
    await waitFor("the batch to finish", async () => {
      const s = await api("GET", `/v1/batches/${batchId}`);
      return Number(s.body?.done) === rows.length;
    });
    const results = await fetch(`${fleet.url}/v1/batches/${batchId}/results`, {
      headers: { authorization: `Bearer ${fleet.token}` },
    }).then((r) => r.text());
    expect(results.split("\n").filter(Boolean)).toHaveLength(rows.length);
    expect(results).not.toContain(SENTINEL);

    const redis = new Redis(REDIS_URL);
    let scanned = 0;
    try {
      let cursor = "0";
      do {
        const [next, keys] = await redis.scan(cursor, "MATCH", `${prefix}*`, "COUNT", 500);
        cursor = next;
        for (const key of keys) {
          const type = await redis.type(key);
          const dump =
            type === "hash"
              ? JSON.stringify(await redis.hgetall(key))
              : type === "string"
                ? String(await redis.get(key))
                : type === "list"
                  ? JSON.stringify(await redis.lrange(key, 0, -1))
                  : type === "zset"
                    ? JSON.stringify(await redis.zrange(key, "0", "-1"))
                    : type === "set"
                      ? JSON.stringify(await redis.smembers(key))
                      : type === "stream"
                        ? JSON.stringify(await redis.xrange(key, "-", "+"))
                        : "";
          scanned++;
          expect(dump.includes(SENTINEL), `secret found in ${key}`).toBe(false);
        }
      } while (cursor !== "0");
    } finally {
      redis.disconnect();
    }
    expect(scanned).toBeGreaterThan(10);
    for (const f of readdirSync(logDir)) {
      expect(readFileSync(join(logDir, f), "utf8").includes(SENTINEL), `secret in log ${f}`).toBe(false);
    }
  });
});
