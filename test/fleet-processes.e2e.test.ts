import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it, vi } from "vitest";
import { FleetProcesses, runAttached } from "../scripts/lib/fleet-processes.ts";
import { dropPrefix, REDIS_URL, testPrefix } from "./helpers/env.ts";

// A client of the fleet run the way `npm run demo` runs the `fleet` CLI: 1,000 requests, each
// answered within 5 s, else exit 1. The dispatcher logs a line of about 200 bytes for each.
const CLIENT = `
const url = process.argv[1];
for (let i = 0; i < 1000; i++) {
  try {
    const res = await fetch(url, { headers: { authorization: "Bearer fleet-dev-token" }, signal: AbortSignal.timeout(5000) });
    await res.arrayBuffer();
    if (res.status !== 404) throw new Error("status " + res.status);
  } catch (err) {
    console.error("request " + i + " failed: " + err.message);
    process.exit(1);
  }
}
`;

describe("runAttached (the demo's way of running the fleet CLI)", () => {
  const prefix = testPrefix("attached");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-attached-"));
  let fleet: FleetProcesses | null = null;
  afterAll(async () => {
    await fleet?.stop();
    await dropPrefix(REDIS_URL, prefix);
    rmSync(logDir, { recursive: true, force: true });
  });

  it("keeps draining the fleet's log pipes while the command runs, so the dispatcher keeps answering", async () => {
    fleet = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix,
      logDir,
      replicas: { resources: 0, agent: 0, verifier: 0, janitor: 0 },
    });
    // Far more than a pipe holds (64 KiB) of the dispatcher's request log lines: with the CLI run
    // by execFileSync the dispatcher stopped at its pipe's end, and request ~300 timed out.
    const code = await runAttached(
      process.execPath,
      ["--input-type=module", "-e", CLIENT, `${fleet.url}/v1/batches/nope`],
      process.env,
    );
    expect(code).toBe(0);
  });

  it("resolves a command's exit code, and 128 + n for one a signal ended", async () => {
    expect(await runAttached("sh", ["-c", "exit 3"], process.env)).toBe(3);
    expect(await runAttached("sh", ["-c", "kill -TERM $$"], process.env)).toBe(128 + 15);
  });

  it("runWhileUp stops the command and says which process died when one of the fleet's exits while it runs (the demo's CLI would wait for good)", async () => {
    // A fleet of its own (a dispatcher alone), whose process this test kills.
    const ownPrefix = testPrefix("while-up");
    const ownLogs = mkdtempSync(join(tmpdir(), "fleet-while-up-"));
    const own = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix: ownPrefix,
      logDir: ownLogs,
      replicas: { resources: 0, agent: 0, verifier: 0, janitor: 0 },
    });
    try {
      // A command that ends first resolves its code as runAttached does.
      expect(await own.runWhileUp("sh", ["-c", "exit 4"], process.env)).toBe(4);
      const marker = join(ownLogs, "command-started");
      const outcome = own.runWhileUp("sh", ["-c", `touch ${marker}; exec sleep 600`], process.env).then(
        (code) => `exited ${code}`,
        (err: unknown) => (err instanceof Error ? err.message : String(err)),
      );
      await vi.waitFor(() => expect(existsSync(marker)).toBe(true), { timeout: 10_000 });
      await own.kill("dispatcher", 0, "SIGKILL");
      expect(await outcome).toMatch(
        /^dispatcher-0 exited \(SIGKILL\) while the command ran; see .*dispatcher-0\.log$/,
      );
    } finally {
      await own.stop();
      await dropPrefix(REDIS_URL, ownPrefix);
      rmSync(ownLogs, { recursive: true, force: true });
    }
  });
});
