import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { freeLoopbackPort } from "@fleet/queue";
import { afterAll, describe, expect, it } from "vitest";
import { dropPrefix, REDIS_URL, testPrefix, waitFor } from "./helpers/env.ts";
import { npmStart } from "./helpers/npm-app.ts";

/** Every process under `pid` (children first found, then theirs). */
function descendants(pid: number): number[] {
  const out: number[] = [];
  const queue = [pid];
  while (queue.length > 0) {
    const parent = queue.shift()!;
    let children: number[] = [];
    try {
      children = execFileSync("pgrep", ["-P", String(parent)], { encoding: "utf8" })
        .split("\n")
        .filter((l) => l.trim() !== "")
        .map(Number);
    } catch {
      // pgrep exits 1 when there is none.
    }
    out.push(...children);
    queue.push(...children);
  }
  return out;
}

/** Whether this host's kernel lets a process trace its ancestors (no Yama, or ptrace_scope 0). */
function ancestorsTraceable(): boolean {
  try {
    return readFileSync("/proc/sys/kernel/yama/ptrace_scope", "utf8").trim() === "0";
  } catch {
    return true;
  }
}

const alive = (pid: number) => {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
};

const APPS = [
  { workspace: "@fleet/dispatcher", ready: /listening/ },
  { workspace: "@fleet/resources-worker", ready: /worker started/ },
  { workspace: "@fleet/agent-worker", ready: /worker started/ },
  { workspace: "@fleet/verifier-worker", ready: /worker started/ },
  { workspace: "@fleet/janitor", ready: /janitor started/ },
] as const;

describe("apps started the README's way (npm start -w <app>)", () => {
  const prefix = testPrefix("npm-start");
  afterAll(() => dropPrefix(REDIS_URL, prefix));

  it("each shuts down gracefully when npm is sent SIGTERM, leaving no process behind", async () => {
    const port = await freeLoopbackPort();
    const results = await Promise.all(
      APPS.map(async ({ workspace, ready }) => {
        const { npm, output } = npmStart(workspace, {
          REDIS_URL,
          FLEET_PREFIX: prefix,
          FLEET_HTTP_HOST: "127.0.0.1",
          FLEET_HTTP_PORT: String(port),
          FLEET_API_TOKENS: "npm-start-test",
        });
        const npmExited = new Promise<void>((r) => npm.once("exit", () => r()));
        // Its output read to the end: "exit" can come before the last lines written to the pipe.
        const npmClosed = new Promise<void>((r) => npm.once("close", () => r()));
        let tree: number[] = [];
        try {
          await waitFor(`${workspace} to start`, async () => ready.test(output()), 90_000);
          tree = descendants(npm.pid!);
          expect(tree.length).toBeGreaterThan(0);
          npm.kill("SIGTERM");
          await npmExited;
          // The app itself got the signal (not only npm and its shell): it shut down and exited.
          await waitFor(`${workspace}'s processes to exit`, async () => tree.every((p) => !alive(p)), 60_000);
          await npmClosed;
          return { workspace, output: output() };
        } finally {
          // Whatever is left (a failed run's orphans) goes.
          for (const p of [...descendants(npm.pid!), ...tree]) if (alive(p)) process.kill(p, "SIGKILL");
          npm.kill("SIGKILL");
        }
      }),
    );
    for (const { workspace, output } of results) {
      expect(output, workspace).toMatch(/"msg":"shutting down"/);
      // The verifier worker, and it alone, says when this host's kernel lets the agent's code the
      // tests run tamper with the tests' processes (no Yama, or ptrace_scope 0: as on CI's hosts).
      const warned = /can then trace or write the memory of the tests' own processes/.test(output);
      expect(warned, workspace).toBe(workspace === "@fleet/verifier-worker" && ancestorsTraceable());
    }
  }, 240_000);

  it("each stops gracefully on Ctrl-C (SIGINT to the terminal's whole process group: npm, its shell, the app)", async () => {
    const port = await freeLoopbackPort();
    const results = await Promise.all(
      APPS.map(async ({ workspace, ready }) => {
        const { npm, output } = npmStart(
          workspace,
          {
            REDIS_URL,
            FLEET_PREFIX: prefix,
            FLEET_HTTP_HOST: "127.0.0.1",
            FLEET_HTTP_PORT: String(port),
            FLEET_API_TOKENS: "npm-start-test",
          },
          { group: true },
        );
        const npmExited = new Promise<number | null>((r) => npm.once("exit", (code) => r(code)));
        // Its output read to the end: "exit" can come before the last lines written to the pipe.
        const npmClosed = new Promise<void>((r) => npm.once("close", () => r()));
        try {
          await waitFor(`${workspace} to start`, async () => ready.test(output()), 90_000);
          // npm passes the SIGINT on to its child, which had it from the terminal already: the app
          // is sent it twice, and a tsx CLI in between killed an app slow to answer it.
          process.kill(-npm.pid!, "SIGINT");
          const code = await npmExited;
          await npmClosed;
          return { workspace, code, output: output() };
        } finally {
          try {
            process.kill(-npm.pid!, "SIGKILL");
          } catch {
            // gone already
          }
        }
      }),
    );
    for (const { workspace, code, output } of results) {
      expect(output, workspace).toMatch(/"msg":"stopped"/);
      expect(output, workspace).not.toMatch(/npm error/);
      expect(code, workspace).toBe(0);
    }
  }, 240_000);
});
