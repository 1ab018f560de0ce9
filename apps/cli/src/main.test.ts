import { execFile, spawn } from "node:child_process";
import { closeSync, existsSync, openSync } from "node:fs";
import { chmod, mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { json, startTestServer, type TestServer } from "./testing/http-server.ts";
import { FLEET_BIN, runFleet } from "./testing/run-bin.ts";

const SUITE = fileURLToPath(new URL("../../../packages/tasks/suites/example", import.meta.url));
const BIN = FLEET_BIN;
const run = runFleet;

/**
 * Run `fleet` like `fleet ... | head -n1`: read its first stdout line, then close the pipe.
 * `readerGone` resolves once the pipe is closed, so writes after it meet EPIPE.
 */
function runReadingOneLine(
  args: string[],
  env: Record<string, string>,
  /** stderr into the same pipe as stdout (`2>&1 | head -n1`): it goes away with the reader too. */
  stderrToo = false,
): {
  readerGone: Promise<string>;
  exited: Promise<{ code: number | null; stderr: string }>;
  kill: () => void;
} {
  const quoted = [process.execPath, BIN, ...args].map((a) => `'${a.replaceAll("'", "'\\''")}'`).join(" ");
  const child = stderrToo
    ? spawn("/bin/sh", ["-c", `exec ${quoted} 2>&1`], {
        env: { PATH: process.env.PATH ?? "", ...env },
        stdio: ["ignore", "pipe", "ignore"],
      })
    : spawn(process.execPath, [BIN, ...args], {
        env: { PATH: process.env.PATH ?? "", ...env },
        stdio: ["ignore", "pipe", "pipe"],
      });
  let stderr = "";
  child.stderr?.setEncoding("utf8").on("data", (s: string) => {
    stderr += s;
  });
  let out = "";
  const readerGone = new Promise<string>((resolve) => {
    child.stdout.setEncoding("utf8").on("data", (s: string) => {
      out += s;
      if (out.includes("\n")) child.stdout.destroy();
    });
    child.stdout.on("close", () => resolve(out.split("\n")[0]!));
  });
  const exited = new Promise<{ code: number | null; stderr: string }>((resolve) =>
    child.on("close", (code) => resolve({ code, stderr })),
  );
  return { readerGone, exited, kill: () => child.kill("SIGKILL") };
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

  it("warns of a misspelt FLEET_ variable (ignored otherwise), naming the closest known one, and goes on", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 1, done: 1, counts: { completed: 1 } }),
    );
    const r = await run(["status", "b-1"], { FLEET_URL: server.url, FLEET_TOKN: "t0k" });
    expect(r.stderr).toBe(
      "warning: FLEET_TOKN is not a variable of the fleet: it is ignored (did you mean FLEET_TOKEN?)\n",
    );
    expect(r.code).toBe(0);
    expect(server.requests[0]?.headers.authorization).toBeUndefined();
  });

  it("refuses a whole number past 2^53 (--repeat 99999999999999999999) with exit 2, not one it rounded", async () => {
    const r = await run(["submit", "--suite", "s", "--agent", "oracle", "--repeat", "99999999999999999999"], {
      FLEET_URL: server.url,
    });
    expect(r.code).toBe(2);
    expect(r.stderr).toContain(
      `--repeat <n>' argument '99999999999999999999' is invalid. must be at most ${Number.MAX_SAFE_INTEGER}`,
    );
    expect(server.requests).toEqual([]);
  });

  it("refuses a bad FLEET_URL with exit 2, naming the variable", async () => {
    const r = await run(["status", "b-1"], { FLEET_URL: "ftp://nowhere" });
    expect(r.code).toBe(2);
    expect(r.stderr).toContain("FLEET_URL: must be a URL starting with http:// or https://");
  });

  it("a bad FLEET_URL (or FLEET_TOKEN) refuses nothing when --url (--token) overrides it; a bad --url still does", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 1, done: 1, counts: { completed: 1 } }),
    );
    const bad = { FLEET_URL: "ftp://nowhere", FLEET_TOKEN: "a b" };
    const r = await run(["--url", server.url, "status", "--token=t0k", "b-1"], bad);
    expect(r).toMatchObject({
      code: 0,
      stderr: "",
      stdout: "batch b-1: finished, 1/1 done (100.0%)\n  completed 1\n",
    });
    expect(server.requests[0]?.headers.authorization).toBe("Bearer t0k");
    // Only the variable the flag overrides is let go.
    const token = await run(["--url", server.url, "status", "b-1"], bad);
    expect(token.code).toBe(2);
    expect(token.stderr).toContain("FLEET_TOKEN");
    expect((await run(["--url", "ftp://x", "status", "b-1"], { FLEET_URL: server.url })).code).toBe(2);
    // A "--url" that is no option (another option's value, an argument after --) overrides nothing.
    for (const args of [
      ["status", "--token", "--url", "b-1"],
      ["trajectory", "--", "--url"],
    ]) {
      const notOption = await run(args, { FLEET_URL: "ftp://nowhere", FLEET_TOKEN: "t0k" });
      expect(notOption.code, args.join(" ")).toBe(2);
      expect(notOption.stderr).toContain("FLEET_URL: must be a URL starting with http:// or https://");
    }
    expect(server.requests).toHaveLength(1);
  });

  it("an unwritable `results --out` is a usage error (exit 2), not an uncaught exception", async () => {
    const r = await run(["results", "b-1", "--out", "/nonexistent-dir/r.jsonl"], { FLEET_URL: server.url });
    expect(r.stderr).toMatch(
      /^error: cannot write --out \/nonexistent-dir\/r\.jsonl: ENOENT: no such file or directory, open '\/nonexistent-dir\/r\.jsonl\.partial\.\d+\.0'\n$/,
    );
    expect(r.code).toBe(2);
  });

  it.each(["", "/"])(
    "an `--out` that is a directory (%j after its name) is a usage error up front, not found out at the end",
    async (slash) => {
      const dir = await mkdtemp(join(tmpdir(), "fleet-out-dir-"));
      try {
        const r = await run(["results", "b-1", "--out", `${dir}${slash}`], { FLEET_URL: server.url });
        expect(r.stderr).toBe(
          `error: cannot write --out ${dir}${slash}: EISDIR: ${dir}${slash} is a directory; name a file\n`,
        );
        expect(r.code).toBe(2);
        expect(server.requests).toHaveLength(0);
      } finally {
        await rm(dir, { recursive: true, force: true });
      }
    },
  );

  it.skipIf(process.getuid?.() !== 0 || !existsSync("/usr/sbin/runuser"))(
    "an `--out` another user's file in a sticky directory (/tmp), which the rename at the end could not replace, is a usage error up front",
    async () => {
      const dir = await mkdtemp(join(tmpdir(), "fleet-sticky-"));
      try {
        await chmod(dir, 0o1777);
        const out = join(dir, "r.jsonl");
        await writeFile(out, "root's\n"); // root's file; the command runs as nobody
        server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
          res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n');
        });
        server.on("GET", "/v1/batches/b-1", (_req, res) =>
          json(res, 200, { id: "b-1", total: 1, done: 1, counts: { completed: 1 } }),
        );
        const r = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
          execFile(
            "/usr/sbin/runuser",
            ["-u", "nobody", "--", process.execPath, BIN, "results", "b-1", "--out", out],
            { env: { PATH: process.env.PATH ?? "", FLEET_URL: server.url } },
            (err, _stdout, stderr) => resolve({ code: err === null ? 0 : (err.code as number), stderr }),
          );
        });
        expect(r.stderr).toContain(`error: cannot write --out ${out}: EPERM: ${out} belongs to another user`);
        expect(r.code).toBe(2);
        expect(server.requests).toHaveLength(0);
        expect(await readFile(out, "utf8")).toBe("root's\n");
        expect(await readdir(dir)).toEqual(["r.jsonl"]);
      } finally {
        await rm(dir, { recursive: true, force: true });
      }
    },
  );

  it.each([
    ["SIGINT", 130],
    ["SIGTERM", 143],
  ] as const)(
    "a command interrupted by %s exits %i (128 + the signal), saying nothing was cancelled",
    async (signal, code) => {
      let asked: () => void = () => undefined;
      const askedNow = new Promise<void>((resolve) => {
        asked = resolve;
      });
      // A dispatcher that never answers: the command waits until it is interrupted.
      server.on("GET", "/v1/batches/b-9", () => {
        asked();
        return new Promise(() => undefined);
      });
      const child = spawn(process.execPath, [BIN, "status", "b-9"], {
        env: { PATH: process.env.PATH ?? "", FLEET_URL: server.url },
        stdio: ["ignore", "ignore", "pipe"],
      });
      let stderr = "";
      child.stderr.setEncoding("utf8").on("data", (s: string) => {
        stderr += s;
      });
      const exited = new Promise<number | null>((resolve) => child.on("close", resolve));
      await askedNow;
      child.kill(signal);
      expect(await exited).toBe(code);
      expect(stderr).toContain("interrupted; nothing was cancelled");
    },
  );

  it("a Ctrl-C that comes twice (`npx fleet`: npm passes it on to the CLI, which had it already) stops as one does: exit 130, its note, no partial file left", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-twice-"));
    try {
      // One result, then the stream stays open: `results --out` is writing its partial file.
      let streamGone: Promise<void> = new Promise(() => undefined);
      server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
        streamGone = new Promise((resolve) => res.on("close", () => resolve()));
        res.writeHead(200, { "content-type": "application/x-ndjson" }).write('{"id":"r1"}\n');
        return new Promise(() => undefined);
      });
      server.on("GET", "/v1/batches/b-1", (_req, res) =>
        json(res, 200, { id: "b-1", total: 2, done: 1, counts: { completed: 1, running: 1 } }),
      );
      const child = spawn(process.execPath, [BIN, "results", "b-1", "--out", join(dir, "r.jsonl")], {
        env: { PATH: process.env.PATH ?? "", FLEET_URL: server.url },
        stdio: ["ignore", "ignore", "pipe"],
      });
      let stderr = "";
      child.stderr.setEncoding("utf8").on("data", (s: string) => {
        stderr += s;
      });
      const exited = new Promise<number | null>((resolve) => child.on("close", resolve));
      while (
        (await readdir(dir)).length === 0 ||
        server.requests.every((r) => !r.path.endsWith("/results"))
      ) {
        await new Promise((r) => setTimeout(r, 20));
      }
      child.kill("SIGINT");
      // The second comes once the first is acted on (the stream dropped), the command stopping.
      await streamGone;
      child.kill("SIGINT");
      expect(await exited).toBe(130);
      expect(stderr).toContain("interrupted; nothing was cancelled");
      expect(await readdir(dir)).toEqual([]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("stdout on a full disk (/dev/full) is an error, exit 1, not an uncaught 'error' event: a submit stops naming what it admitted", async () => {
    /** Run `fleet` with its stdout on /dev/full, where every write fails with ENOSPC. */
    const runOnFullDisk = (args: string[]) => {
      const full = openSync("/dev/full", "w");
      try {
        const child = spawn(process.execPath, [BIN, ...args], {
          env: { PATH: process.env.PATH ?? "", FLEET_URL: server.url },
          stdio: ["ignore", full, "pipe"],
        });
        let stderr = "";
        child.stderr?.setEncoding("utf8").on("data", (s: string) => {
          stderr += s;
        });
        return new Promise<{ code: number | null; stderr: string }>((resolve) =>
          child.on("close", (code) => resolve({ code, stderr })),
        );
      } finally {
        closeSync(full);
      }
    };
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 1, done: 1, counts: { completed: 1 }, createdAt: 1 }),
    );
    // Its one line is the last write: its failure comes after the command is done.
    const status = await runOnFullDisk(["status", "b-1"]);
    expect(status.stderr).not.toContain("Unhandled");
    expect(status).toEqual({ code: 1, stderr: expect.stringMatching(/^error: cannot write .*ENOSPC/) });

    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      n++;
      const rows = (JSON.parse(req.body) as { rollouts: unknown[] }).rollouts.length;
      json(res, 202, { batchId: `b-${n}`, rolloutIds: [], count: rows });
    });
    const args = ["submit", "--suite", SUITE, "--task", "hello-file", "--agent", "oracle", "--repeat", "60"];
    const submit = await runOnFullDisk([...args, "--max-request-bytes", "2048"]);
    expect(submit.stderr).not.toContain("Unhandled");
    expect(submit.code).toBe(1);
    // What it admitted before stdout failed (the batch ids stdout did not take).
    expect(submit.stderr).toMatch(/submitted \d+ of 60 rollouts in \d+ batch(es)? before the error: b-1/);
    expect(submit.stderr).toMatch(/error: cannot write .*ENOSPC/);

    // One chunk: the write of its one batch id is the last, failing after the submission is done.
    // The id is on no stdout, so the error names it, as a chunk's does.
    const single = await runOnFullDisk([
      "submit",
      "--suite",
      SUITE,
      "--task",
      "hello-file",
      "--agent",
      "oracle",
    ]);
    expect(single.stderr).not.toContain("Unhandled");
    expect(single.code).toBe(1);
    expect(single.stderr).toMatch(/submitted 1 of 1 rollouts in 1 batch before the error: b-\d+ /);
    expect(single.stderr).toMatch(/error: cannot write .*ENOSPC/);
  });

  it("`fleet results | head -n1` stops quietly with exit 0 when the reader goes away", async () => {
    let readerGone: Promise<string> = new Promise(() => {});
    server.on("GET", "/v1/batches/b-1/results", async (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write('{"id":"r0"}\n');
      await readerGone;
      for (let i = 1; i < 1000; i++) res.write(`{"id":"r${i}"}\n`);
      res.end();
    });
    const child = runReadingOneLine(["results", "b-1"], { FLEET_URL: server.url });
    readerGone = child.readerGone;
    expect(await child.readerGone).toBe('{"id":"r0"}');
    expect(await child.exited).toEqual({ code: 0, stderr: "" });
  });

  it("`fleet submit 2>&1 | head -n1` (stderr gone with the reader too) still submits every chunk, and exits 0", async () => {
    let readerGone: Promise<string> = new Promise(() => {});
    const rows: number[] = [];
    server.on("POST", "/v1/batches", async (req, res) => {
      const n = rows.push(0);
      if (n === 2) await readerGone; // the rest, and the notes on stderr, after `head` has gone
      rows[n - 1] = (JSON.parse(req.body) as { rollouts: unknown[] }).rollouts.length;
      json(res, 202, { batchId: `b-${n}`, rolloutIds: [], count: rows[n - 1] });
    });
    const args = ["submit", "--suite", SUITE, "--task", "hello-file", "--agent", "oracle", "--repeat", "60"];
    const child = runReadingOneLine(
      [...args, "--max-request-bytes", "2048"],
      { FLEET_URL: server.url },
      true,
    );
    readerGone = child.readerGone;
    expect(await child.readerGone).toBe("b-1");
    const { code } = await child.exited;
    expect(code).toBe(0);
    expect(rows.length).toBeGreaterThanOrEqual(3);
    expect(rows.reduce((a, b) => a + b, 0)).toBe(60);
  });

  it("`fleet --url <url> results | head -n1` (the option before the command) stops too, not reading the rest", async () => {
    let readerGone: Promise<string> = new Promise(() => {});
    server.on("GET", "/v1/batches/b-1/results", async (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write('{"id":"r0"}\n');
      await readerGone;
      // A batch far larger than anyone reads through `head`: its lines keep coming.
      const more = setInterval(() => res.write('{"id":"rn"}\n'), 20);
      res.on("close", () => clearInterval(more));
    });
    const child = runReadingOneLine(["--url", server.url, "results", "b-1"], {});
    readerGone = child.readerGone;
    try {
      expect(await child.readerGone).toBe('{"id":"r0"}');
      const ended = await Promise.race([
        child.exited,
        new Promise<"still reading">((resolve) => setTimeout(() => resolve("still reading"), 5000)),
      ]);
      expect(ended).toEqual({ code: 0, stderr: "" });
    } finally {
      child.kill();
    }
  }, 20_000);

  it("`fleet submit | head -n1` still submits every chunk, and exits 0 when it has", async () => {
    let readerGone: Promise<string> = new Promise(() => {});
    const rows: number[] = [];
    server.on("POST", "/v1/batches", async (req, res) => {
      const n = rows.push(0);
      if (n === 2) await readerGone; // b-2 is printed after `head` has gone
      rows[n - 1] = (JSON.parse(req.body) as { rollouts: unknown[] }).rollouts.length;
      json(res, 202, { batchId: `b-${n}`, rolloutIds: [], count: rows[n - 1] });
    });
    const args = ["submit", "--suite", SUITE, "--task", "hello-file", "--agent", "oracle", "--repeat", "60"];
    const child = runReadingOneLine([...args, "--max-request-bytes", "2048"], { FLEET_URL: server.url });
    readerGone = child.readerGone;
    expect(await child.readerGone).toBe("b-1");
    const { code, stderr } = await child.exited;
    expect(stderr).not.toContain("error");
    expect(code).toBe(0);
    expect(rows.length).toBeGreaterThanOrEqual(3);
    expect(rows.reduce((a, b) => a + b, 0)).toBe(60);
    expect(stderr).toMatch(new RegExp(`submitted 60 rollouts .* in ${rows.length} batches`));
  });
});
