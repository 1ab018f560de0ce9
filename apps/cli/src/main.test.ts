import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { json, startTestServer, type TestServer } from "./testing/http-server.ts";

const BIN = fileURLToPath(new URL("../bin/fleet.js", import.meta.url));

function run(
  args: string[],
  env: Record<string, string>,
): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [BIN, ...args],
      { env: { PATH: process.env.PATH ?? "", ...env } },
      (err, stdout, stderr) =>
        resolve({ code: err === null ? 0 : typeof err.code === "number" ? err.code : -1, stdout, stderr }),
    );
  });
}

let server: TestServer;
beforeEach(async () => {
  server = await startTestServer();
});
afterEach(async () => {
  await server.close();
});

describe("bin/fleet.js", () => {
  it("runs the TypeScript CLI, reading FLEET_URL and FLEET_TOKEN from the environment", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 2, done: 2, counts: { completed: 2 } }),
    );
    const r = await run(["status", "b-1"], { FLEET_URL: server.url, FLEET_TOKEN: "t0k" });
    expect(r.stderr).toBe("");
    expect(r).toMatchObject({ code: 0, stdout: "batch b-1: finished, 2/2 done (100.0%)\n  completed 2\n" });
    expect(server.requests[0]?.headers.authorization).toBe("Bearer t0k");
  });

  it("refuses a bad FLEET_URL with exit 2, naming the variable", async () => {
    const r = await run(["status", "b-1"], { FLEET_URL: "ftp://nowhere" });
    expect(r.code).toBe(2);
    expect(r.stderr).toContain("FLEET_URL: must be a URL starting with http:// or https://");
  });
});
