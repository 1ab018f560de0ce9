import { mkdtempSync, readdirSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { RolloutResult, RolloutTrajectory } from "@fleet/contracts";
import { chatReply, type ScriptedUpstream, startScriptedUpstream } from "@fleet/gateway/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runFleet } from "../apps/cli/src/testing/run-bin.ts";
import { FleetProcesses } from "../scripts/lib/fleet-processes.ts";
import { containersOf, dropPrefix, IMAGE, REDIS_URL, testPrefix, waitFor } from "./helpers/env.ts";

/** The credential value: it must reach the upstream and nothing else (DESIGN §2 rule 8). */
const SENTINEL = `sk-sentinel-${Math.random().toString(36).slice(2)}-${Date.now()}`;

/** An agent CLI in the sandbox: dumps its environment and files to stdout, then asks its model. */
const CLI = `
import json, os, subprocess, urllib.request
print(subprocess.run(["sh", "-c", "env; cat /proc/1/environ 2>/dev/null; ls -la /workspace /tmp"], capture_output=True, text=True).stdout)
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
  data=json.dumps({"model": "x", "messages": [{"role": "user", "content": "sum?"}]}).encode(),
  headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=20))["choices"][0]["message"]["content"])
`;

describe("sentinel: a credential value never leaves the worker", () => {
  const prefix = testPrefix("secrets");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-secrets-"));
  let fleet: FleetProcesses;
  let upstream: ScriptedUpstream;
  const ids: string[] = [];

  beforeAll(async () => {
    upstream = await startScriptedUpstream();
    fleet = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix,
      logDir,
      env: {
        FLEET_CREDENTIAL_DEFAULT: SENTINEL,
        FLEET_CREDENTIAL_DEFAULT_BASE_URL: upstream.baseUrl,
        FLEET_LOG_LEVEL: "debug",
      },
    });
  });
  afterAll(async () => {
    await fleet?.stop();
    await upstream?.close();
    await dropPrefix(REDIS_URL, prefix);
    expect(await containersOf(ids)).toBe(0);
  });

  it("tool-loop and gateway-backed command agents use it; Redis, logs, results and sandboxes never hold it", async () => {
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = { ...suite.find((t) => t.id === "sum-answer")!, image: IMAGE };
    // tool-loop: one bash call that dumps the sandbox's environment and files, then the answer.
    upstream.push(
      chatReply({ bash: ["env; ls -la /workspace /tmp; cat /proc/1/environ 2>/dev/null; true"] }),
      chatReply({ content: "4217" }),
      // command agent with a model, through the gateway:
      chatReply({ content: "4217" }),
    );
    const headers = { authorization: `Bearer ${fleet.token}`, "content-type": "application/json" };
    const post = async (body: unknown) => {
      const res = await fetch(`${fleet.url}/v1/rollouts`, {
        method: "POST",
        headers,
        body: JSON.stringify(body),
      });
      expect(res.status).toBe(202);
      return String(((await res.json()) as { id: string }).id);
    };
    const toolLoop = await post({
      task,
      agent: { harness: "tool-loop", model: { baseUrl: upstream.baseUrl, name: "m" }, credential: "default" },
    });
    ids.push(toolLoop);
    await waitFor("tool-loop result", async () => {
      const r = (await (
        await fetch(`${fleet.url}/v1/rollouts/${toolLoop}`, { headers })
      ).json()) as RolloutResult;
      return r.finishedAt ? r : null;
    });
    const command = await post({
      task,
      agent: {
        harness: "command",
        argv: ["python3", "-c", CLI],
        model: { name: "m", baseUrl: upstream.baseUrl, credential: "default" },
      },
    });
    ids.push(command);
    const results = await Promise.all(
      [toolLoop, command].map((id) =>
        waitFor(`result of ${id}`, async () => {
          const r = (await (
            await fetch(`${fleet.url}/v1/rollouts/${id}`, { headers })
          ).json()) as RolloutResult;
          return r.finishedAt ? r : null;
        }),
      ),
    );
    for (const r of results) expect(r).toMatchObject({ status: "completed", teardown: "confirmed" });
    expect(results[0]!.usage).toMatchObject({ calls: 2 });
    expect(results[1]!.usage).toMatchObject({ calls: 1 });

    // A submitter who names the credential but points the agent elsewhere gets it nowhere: the
    // worker binds it to its upstream (FLEET_CREDENTIAL_DEFAULT_BASE_URL).
    const attacker = await startScriptedUpstream();
    try {
      const diverted = await post({
        task,
        agent: {
          harness: "tool-loop",
          model: { baseUrl: attacker.baseUrl, name: "m" },
          credential: "default",
        },
      });
      ids.push(diverted);
      const r = await waitFor(`result of ${diverted}`, async () => {
        const res = (await (
          await fetch(`${fleet.url}/v1/rollouts/${diverted}`, { headers })
        ).json()) as RolloutResult;
        return res.finishedAt ? res : null;
      });
      expect(r).toMatchObject({ status: "failed", failureKind: "agent_error" });
      expect(r.reason).toContain("is not bound to");
      expect(attacker.requests).toHaveLength(0);
      results.push(r);
    } finally {
      await attacker.close();
    }

    // It was used: every upstream call carried it.
    expect(upstream.requests).toHaveLength(3);
    for (const req of upstream.requests) expect(req.headers.authorization).toBe(`Bearer ${SENTINEL}`);
    // The sandbox's environment and files (dumped to the model in the tool result) never held it.
    const toolResult = JSON.stringify(upstream.requests[1]!.body);
    expect(toolResult).toContain("PATH=");
    expect(toolResult).not.toContain(SENTINEL);
    // Not in the results (the command agent's stdout carries its environment dump).
    expect(JSON.stringify(results)).not.toContain(SENTINEL);

    // What each agent did, as the API gives it (GET /v1/rollouts/:id/trajectory): the tool loop's
    // transcript (its bash call, the tool's output, its answer), the command agent's output (its
    // environment dump and the model's answer); the credential in neither.
    const trajectory = async (id: string) => {
      const res = await fetch(`${fleet.url}/v1/rollouts/${id}/trajectory`, { headers });
      expect(res.status).toBe(200);
      return (await res.json()) as RolloutTrajectory;
    };
    const [loopRun, commandRun] = [await trajectory(toolLoop), await trajectory(command)];
    expect(loopRun).toMatchObject({ id: toolLoop, status: "completed", harness: "tool-loop" });
    expect(loopRun.run).toMatchObject({ exitCode: 0, answer: "4217", usage: { calls: 2 }, attempts: 1 });
    const lines = loopRun.run!.transcript!.split("\n").map((l) => JSON.parse(l) as Record<string, unknown>);
    expect(JSON.stringify(lines)).toContain("ls -la /workspace /tmp");
    expect(JSON.stringify(lines)).toContain("PATH=");
    expect(lines.at(-1)).toMatchObject({ event: "stop" });
    expect(commandRun).toMatchObject({
      id: command,
      status: "completed",
      harness: "command",
      run: { exitCode: 0 },
    });
    expect(commandRun.run!.stdout).toContain("PATH=");
    expect(commandRun.run!.stdout).toContain("4217");
    expect(commandRun.run!.transcript).toBeNull();
    expect(JSON.stringify([loopRun, commandRun])).not.toContain(SENTINEL);
    // The CLI shows them: `fleet trajectory <id>`.
    const cli = await runFleet(["trajectory", toolLoop], { FLEET_URL: fleet.url, FLEET_TOKEN: fleet.token });
    expect(cli).toMatchObject({ code: 0, stderr: "" });
    expect(cli.stdout).toContain(`rollout ${toolLoop}: completed, agent`);
    expect(cli.stdout).toContain('answer: "4217"');
    expect(cli.stdout).toContain("--- transcript (JSON lines) ---");
    expect(cli.stdout).toContain("ls -la /workspace /tmp");
    expect(cli.stdout).not.toContain(SENTINEL);
    const unknown = await fetch(`${fleet.url}/v1/rollouts/no-such-rollout/trajectory`, { headers });
    expect(unknown.status).toBe(404);
    expect(await unknown.json()).toMatchObject({ error: { code: "not_found" } });

    // Not in Redis: every key, every field.
    const redis = new Redis(REDIS_URL);
    let keys = 0;
    try {
      let cursor = "0";
      do {
        const [next, batch] = await redis.scan(cursor, "MATCH", `${prefix}*`, "COUNT", 500);
        cursor = next;
        for (const key of batch) {
          keys++;
          const type = await redis.type(key);
          const dump =
            type === "hash"
              ? await redis.hgetall(key)
              : type === "string"
                ? await redis.get(key)
                : type === "list"
                  ? await redis.lrange(key, 0, -1)
                  : type === "zset"
                    ? await redis.zrange(key, "0", "-1")
                    : type === "set"
                      ? await redis.smembers(key)
                      : type === "stream"
                        ? await redis.xrange(key, "-", "+")
                        : null;
          expect(JSON.stringify(dump).includes(SENTINEL), `secret in Redis key ${key}`).toBe(false);
        }
      } while (cursor !== "0");
    } finally {
      redis.disconnect();
    }
    expect(keys).toBeGreaterThan(5);
    // Not in any log line (the workers logged at debug), of logs that are there to look in.
    const logs = readdirSync(logDir).map((f) => [f, readFileSync(join(logDir, f), "utf8")] as const);
    expect(logs.filter(([, text]) => text.length > 0).length).toBeGreaterThan(0);
    for (const [f, text] of logs) expect(text.includes(SENTINEL), `secret in log ${f}`).toBe(false);
  });
});
