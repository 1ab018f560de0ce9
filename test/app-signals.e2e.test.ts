import { spawn } from "node:child_process";
import { connect, type Socket } from "node:net";
import { afterAll, describe, expect, it } from "vitest";
import { APP_MAIN, REPO_ROOT } from "../scripts/lib/fleet-processes.ts";
import { dropPrefix, REDIS_URL, testPrefix, waitFor } from "./helpers/env.ts";

/** An app's main.ts as its own process: its output so far, and its exit code once it ends. */
function startApp(kind: keyof typeof APP_MAIN, env: Record<string, string>) {
  const child = spawn(process.execPath, ["--import", "tsx", APP_MAIN[kind]], {
    cwd: REPO_ROOT,
    env: { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: process.env.HOME ?? "/root", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  let exitCode: number | null | undefined;
  child.stdout.on("data", (d: Buffer) => (output += d.toString()));
  child.stderr.on("data", (d: Buffer) => (output += d.toString()));
  const exited = new Promise<number | null>((resolve) =>
    child.on("exit", (code) => {
      exitCode = code;
      resolve(code);
    }),
  );
  return {
    child,
    output: () => output,
    exited,
    /** `undefined` while it runs. */
    exitCode: () => exitCode,
  };
}

describe("the dispatcher's signals", () => {
  const prefix = testPrefix("signals");
  const sockets: Socket[] = [];
  afterAll(async () => {
    for (const s of sockets) s.destroy();
    await dropPrefix(REDIS_URL, prefix);
  });

  it("a second SIGTERM while the graceful shutdown waits on a request exits at once", async () => {
    const app = startApp("dispatcher", {
      REDIS_URL,
      FLEET_PREFIX: prefix,
      FLEET_HTTP_HOST: "127.0.0.1",
      FLEET_HTTP_PORT: "0",
      // Far longer than the test waits: only the second signal can end it in time.
      FLEET_SHUTDOWN_TIMEOUT_MS: "600000",
    });
    try {
      const port = await waitFor(
        "the dispatcher to listen",
        async () => /dispatcher listening on http:\/\/127\.0\.0\.1:(\d+)/.exec(app.output())?.[1],
        60_000,
      );
      // A request whose body never comes: the graceful close waits for it.
      const socket = connect(Number(port), "127.0.0.1");
      sockets.push(socket);
      let answer = "";
      socket.on("data", (d: Buffer) => (answer += d.toString()));
      socket.on("error", () => undefined);
      socket.write(
        "POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n{",
      );
      // Node answers 100 Continue once it has the request's headers: it is in flight.
      await waitFor("the request to be in flight", async () => answer.includes("100 Continue"), 30_000);
      app.child.kill("SIGTERM");
      await waitFor(
        "the shutdown to begin",
        async () => app.output().includes('"msg":"shutting down"'),
        30_000,
      );
      expect(app.exitCode(), app.output()).toBeUndefined();
      // Sent again until it exits: one within a second of the first is the same signal sent twice
      // (`npm start` passes on a Ctrl-C the app had from the terminal already), not a second one.
      await waitFor(
        "the dispatcher to exit",
        async () => {
          if (app.exitCode() === undefined) app.child.kill("SIGTERM");
          return app.exitCode() !== undefined;
        },
        15_000,
      );
      expect(app.exitCode(), app.output()).toBe(1);
      expect(app.output()).not.toContain('"msg":"stopped"');
    } finally {
      app.child.kill("SIGKILL");
      await app.exited;
    }
  });
});
