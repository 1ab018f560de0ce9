import { execFile, spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import {
  chmodSync,
  closeSync,
  constants,
  existsSync,
  lstatSync,
  mkdirSync,
  openSync,
  readdirSync,
  readFileSync,
  readlinkSync,
  rmdirSync,
  rmSync,
  utimesSync,
  writeFileSync,
} from "node:fs";
import { mkdir, mkdtemp, readFile, rename, rm, symlink, writeFile } from "node:fs/promises";
import { createServer, type Server } from "node:net";
import { tmpdir, totalmem } from "node:os";
import { dirname, join } from "node:path";
import { promisify } from "node:util";
import { FleetError, isFleetError, type SandboxHandle, type SandboxSpecInput } from "@fleet/contracts";
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import { sandboxName } from "../docker/container-config.ts";
import { AGENT_USER, ROOT_USER, VERIFY_FENCE_FILE } from "../provider.ts";
import { SCRATCH_PROBE_LINE, scrubScratch } from "../scratch.ts";
import {
  fleetError,
  KILL_EVERY_SWEEP_ARGV,
  startRootSweepForgers,
  sweepReforkingChain,
} from "../testing/index.ts";
import { BubblewrapSandboxProvider } from "./bubblewrap-sandbox-provider.ts";
import { sandboxExecArgv } from "./cgroup.ts";
import { bwrapUnavailable, testRootfs } from "./test-rootfs.ts";

const run = promisify(execFile);
const unavailable = bwrapUnavailable();
if (unavailable) console.warn(`skipping the bubblewrap integration tests: ${unavailable}`);

const RUN = `bw${process.pid}${Date.now().toString(36)}`;
const live: SandboxHandle[] = [];
let stateDir = "";
let provider: BubblewrapSandboxProvider;
let counter = 0;

function spec(over: Partial<SandboxSpecInput> = {}): SandboxSpecInput {
  return {
    image: "base",
    rolloutId: `${RUN}-${++counter}`,
    owner: "resources",
    expiresAt: Date.now() + 600_000,
    ...over,
  };
}

async function create(over: Partial<SandboxSpecInput> = {}): Promise<SandboxHandle> {
  const h = await provider.create(spec(over));
  live.push(h);
  return h;
}

/** Non-zombie processes of a uid inside the sandbox (listed by root, which is never the agent). */
async function processesOf(h: SandboxHandle, uid: number): Promise<string[]> {
  const r = await provider.exec(h, ["ps", "-eo", "uid=,stat=,pid=,args="], {
    deadlineMs: 10_000,
    user: ROOT_USER,
  });
  expect(r.exitCode).toBe(0);
  return r.stdout
    .split("\n")
    .map((l) => l.trim().split(/\s+/))
    .filter(
      (f) => f[0] === String(uid) && !f[1]?.startsWith("Z") && !f.slice(3).join(" ").startsWith("ps -eo"),
    )
    .map((f) => f.join(" "));
}

/** Host pids of every process whose command line mentions this run's state directory. */
function hostProcessesOfRun(): number[] {
  const out: number[] = [];
  for (const pid of readdirNumeric("/proc")) {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
      if (stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z")) continue;
      if (readFileSync(`/proc/${pid}/cmdline`, "latin1").includes(stateDir)) out.push(pid);
    } catch {}
  }
  return out;
}

function cmdline(pid: number): string {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, "latin1");
  } catch {
    return "";
  }
}

/** Running (not a zombie). */
function alive(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
    return !/^[ZX]/.test(stat.slice(stat.lastIndexOf(")") + 2));
  } catch {
    return false;
  }
}

async function waitUntil(cond: () => boolean, timeoutMs = 30_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!cond()) {
    if (Date.now() > end) throw new Error("timed out waiting for a condition");
    await new Promise((r) => setTimeout(r, 20));
  }
}

function readdirNumeric(dir: string): number[] {
  return readdirSync(dir)
    .filter((n) => /^\d+$/.test(n))
    .map(Number);
}

describe.skipIf(unavailable !== null)("BubblewrapSandboxProvider (real bwrap)", () => {
  beforeAll(async () => {
    const rootfs = await testRootfs();
    stateDir = await mkdtemp(join(tmpdir(), "fleet-bwrap-it-"));
    provider = new BubblewrapSandboxProvider({ rootfs, stateDir, scope: RUN });
  });

  afterEach(async () => {
    while (live.length > 0) await provider.destroy(live.pop()!);
  });

  afterAll(async () => {
    if (!provider) return;
    const left = await provider.list();
    for (const s of left) await provider.destroy(s.handle);
    expect(left.map((s) => s.handle.name)).toEqual([]);
    expect(hostProcessesOfRun()).toEqual([]);
    await rm(stateDir, { recursive: true, force: true });
  });

  it("creates a labelled sandbox, runs a command as the agent with env, cwd and stdin, and destroys it", async () => {
    const h = await create();
    expect(h).toMatchObject({
      provider: "bubblewrap",
      endpoint: expect.stringMatching(/^bwrap:\/\//),
      name: sandboxName(h.rolloutId, "resources", RUN),
    });
    expect(await provider.alive(h)).toBe(true);
    const [info] = await provider.list({ "fleet.rollout": h.rolloutId });
    expect(info?.labels).toMatchObject({
      "fleet.managed": "true",
      "fleet.owner": "resources",
      "fleet.scope": RUN,
    });
    expect(info?.running).toBe(true);
    expect(await provider.find(h.rolloutId, "resources")).toEqual(h);
    expect(await provider.find(h.rolloutId, "agent")).toBeNull();

    const r = await provider.exec(
      h,
      ["sh", "-c", 'id -u; id -g; pwd; echo "$GREETING"; cat; echo oops >&2; exit 7'],
      {
        deadlineMs: 10_000,
        env: { GREETING: "hello" },
        cwd: "/tmp",
        stdin: "from stdin\n",
      },
    );
    expect(r).toMatchObject({
      exitCode: 7,
      timedOut: false,
      stdout: "1000\n1000\n/tmp\nhello\nfrom stdin\n",
      stderr: "oops\n",
      stdoutTruncated: false,
      stderrTruncated: false,
    });
    const caps = await provider.exec(h, ["sh", "-c", "grep -E '^Cap(Eff|Bnd|Prm)' /proc/self/status"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    expect(caps.stdout).toMatch(/CapPrm:\s+0+\nCapEff:\s+0+\nCapBnd:\s+0+/);

    const receipt = await provider.destroy(live.pop()!);
    expect(receipt).toMatchObject({ confirmed: true, scope: "sandbox", alreadyGone: false });
    expect(await provider.alive(h)).toBe(false);
    expect(existsSync(join(stateDir, `${h.name}.json`))).toBe(false);
    expect(readdirSync(stateDir).filter((e) => e.startsWith(h.name))).toEqual([]);
  });

  it("a create told to stop once bwrap runs (its worker shutting down) fails retryable and removes what it made: no process, no state", async () => {
    const stop = new AbortController();
    // Told to stop just after bwrap reported its child, before the sandbox is ready: its own
    // `spawnBwrap` shadowed on the instance, the class's left as it is.
    const own = provider as unknown as {
      spawnBwrap?: (...args: unknown[]) => Promise<{ bwrapPid: number }>;
    };
    const spawnBwrap = own.spawnBwrap!;
    let bwrapPid = 0;
    own.spawnBwrap = async (...args) => {
      const started = await spawnBwrap.apply(provider, args);
      bwrapPid = started.bwrapPid;
      stop.abort();
      return started;
    };
    try {
      const s = spec();
      const err = await fleetError(provider.create(s, { signal: stop.signal }));
      expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
      expect(bwrapPid).toBeGreaterThan(0);
      await waitUntil(() => !alive(bwrapPid), 10_000);
      const name = sandboxName(s.rolloutId, "resources", RUN);
      expect(readdirSync(stateDir).filter((e) => e.startsWith(name))).toEqual([]);
      expect(await provider.find(s.rolloutId, "resources")).toBeNull();
    } finally {
      delete own.spawnBwrap;
    }
  });

  it("list clears up the state writes a killed worker left (its writer gone, a minute old): a temporary file removed, a state file moved aside put back where none is; no other", async () => {
    // A pid that ran and is gone: the writer SIGKILLed between writing and renaming.
    const gone = spawn("true");
    const deadPid = gone.pid!;
    await new Promise((resolve) => gone.on("exit", resolve));
    const [name, taken] = [`fleet-${RUN}-stray`, `fleet-${RUN}-taken`];
    const old = new Date(Date.now() - 120_000);
    const files = {
      stale: `${name}.json.${deadPid}.0a1b2c3d.tmp`,
      // Moved aside by a removal its worker did not finish: it may be a newer sandbox's state.
      aside: `${name}.json.${deadPid}.4e5f6a7b.removing`,
      // One whose name has a state file again (written since): that one stands.
      asideTaken: `${taken}.json.${deadPid}.5f6a7b8c.removing`,
      fresh: `${name}.json.${deadPid}.11111111.tmp`, // its writer may have just died: kept a minute
      live: `${name}.json.${process.pid}.22222222.tmp`, // a write under way (this process)
      other: `${name}.notes.${deadPid}.33333333.tmp`, // not a state write
    };
    for (const [key, file] of Object.entries(files)) {
      writeFileSync(join(stateDir, file), `{"was":"${key}"}`);
      if (key !== "fresh") utimesSync(join(stateDir, file), old, old);
    }
    writeFileSync(join(stateDir, `${taken}.json`), '{"was":"newer"}');
    await provider.list();
    const left = readdirSync(stateDir)
      .filter((f) => f.startsWith(name) || f.startsWith(taken))
      .sort();
    expect(left).toEqual([files.fresh, files.live, files.other, `${name}.json`, `${taken}.json`].sort());
    expect(readFileSync(join(stateDir, `${name}.json`), "utf8")).toBe('{"was":"aside"}');
    expect(readFileSync(join(stateDir, `${taken}.json`), "utf8")).toBe('{"was":"newer"}');
    for (const file of left) rmSync(join(stateDir, file));
  });

  it("list skips an entry of the state directory that is no state file (a directory, a FIFO, named *.json), never failing or hanging on it: every sandbox stays listed", async () => {
    const h = await create();
    const [dir, fifo] = [join(stateDir, `fleet-${RUN}-dir.json`), join(stateDir, `fleet-${RUN}-fifo.json`)];
    mkdirSync(dir);
    await run("mkfifo", [fifo]);
    try {
      // A FIFO no one writes: a plain read of it never answers.
      const listed = await Promise.race([
        provider.list({ "fleet.rollout": h.rolloutId }).then(
          (infos) => infos.map((i) => i.handle.name),
          (e: unknown) => e,
        ),
        new Promise((resolve) => setTimeout(() => resolve("no answer in 5 s"), 5_000)),
      ]);
      expect(listed).toEqual([h.name]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
      rmSync(fifo, { force: true });
    }
  });

  it("a FIFO named as a sandbox's state file (<name>.json) is no state: that sandbox's destroy and create answer at once, never blocking on it", async () => {
    const s = spec();
    const name = sandboxName(s.rolloutId, "resources", RUN);
    const fifo = join(stateDir, `${name}.json`);
    await run("mkfifo", [fifo]);
    const handle: SandboxHandle = {
      provider: "bubblewrap",
      endpoint: provider.endpoint,
      id: "",
      name,
      rolloutId: s.rolloutId,
      owner: "resources",
      volumes: [],
    };
    const within5s = <T>(p: Promise<T>) =>
      Promise.race([
        p.then(
          (v) => v,
          (e: unknown) => e,
        ),
        new Promise((resolve) => setTimeout(() => resolve("no answer in 5 s"), 5_000)),
      ]);
    let created: Promise<SandboxHandle> | undefined;
    try {
      // A FIFO no one writes: a plain read of it never answers.
      expect(await within5s(provider.destroy(handle))).toMatchObject({ confirmed: true, alreadyGone: true });
      created = provider.create(s);
      const h = await within5s(created);
      expect(h).toMatchObject({ name });
      expect((await provider.exec(h as SandboxHandle, ["echo", "ok"], { deadlineMs: 10_000 })).stdout).toBe(
        "ok\n",
      );
    } finally {
      // A read still blocked on the FIFO (a thread of the pool) ends at a writer's close.
      try {
        closeSync(openSync(fifo, constants.O_WRONLY | constants.O_NONBLOCK));
      } catch {}
      const h = await created?.catch(() => undefined);
      if (h) live.push(h);
      // The create's state file took its place (renamed over it) unless the create failed.
      if (lstatSync(fifo, { throwIfNoEntry: false })?.isFIFO()) rmSync(fifo);
    }
  });

  it("list on a state directory whose filesystem gives no entry types (ext2 without filetype, XFS with ftype=0) keeps every sandbox listed while another worker writes its state: never an empty list", async (ctx) => {
    const base = await mkdtemp(join(tmpdir(), "fleet-bwrap-notypes-"));
    const [img, mnt] = [join(base, "fs.img"), join(base, "mnt")];
    mkdirSync(mnt);
    try {
      await run("mke2fs", ["-q", "-F", "-t", "ext2", "-O", "^filetype", img, "32M"]);
      await run("mount", ["-o", "loop", img, mnt]);
    } catch (err) {
      console.warn(`skipped: cannot mount an ext2 without filetype here: ${String(err)}`);
      rmSync(base, { recursive: true, force: true });
      ctx.skip();
    }
    const notypes = new BubblewrapSandboxProvider({
      rootfs: await testRootfs(),
      stateDir: join(mnt, "bwrap"),
      scope: RUN,
    });
    let h: SandboxHandle | undefined;
    let stop = false;
    let churn: Promise<void> = Promise.resolve();
    try {
      h = await notypes.create(spec());
      // Another worker's state writes (`writeState`): a temporary file, renamed into place.
      const other = join(mnt, "bwrap", `${RUN}-other.json`);
      churn = (async () => {
        for (let i = 0; !stop; i++) {
          const tmp = `${other}.${process.pid}.${(i % 0x10000).toString(16).padStart(8, "0")}.tmp`;
          await writeFile(tmp, "{}");
          await rename(tmp, other);
        }
      })();
      const missed: unknown[] = [];
      for (let i = 0; i < 200; i++) {
        const listed = await notypes.list({ "fleet.rollout": h.rolloutId }).then(
          (infos) => infos.map((info) => info.handle.name),
          (e: unknown) => String(e),
        );
        if (!(Array.isArray(listed) && listed.length === 1 && listed[0] === h.name)) missed.push(listed);
      }
      expect(missed).toEqual([]);
    } finally {
      stop = true;
      await churn;
      if (h) await notypes.destroy(h);
      await run("umount", [mnt]);
      rmSync(base, { recursive: true, force: true });
    }
  });

  it("a program the tests' root makes setuid in the workspace (the agent opened it to them) is out of every host user's reach, whatever the state directory's mode (an operator's mkdir -p: 0755): the sandbox's own directory is root's alone", async () => {
    const h = await create();
    chmodSync(stateDir, 0o755);
    try {
      await provider.exec(h, ["chmod", "777", "/workspace"], { deadlineMs: 10_000 });
      const planted = await provider.exec(
        h,
        ["sh", "-c", "cp /usr/bin/id /workspace/id && chmod 4755 /workspace/id"],
        { deadlineMs: 10_000, user: ROOT_USER },
      );
      expect(planted.exitCode).toBe(0);
      // A host user (nobody) runs it by its host path: as root, were it reachable.
      const hostPath = join(stateDir, `${h.name}-${h.id.slice(0, 8)}`, "workspace", "id");
      const ran = await run("setpriv", [
        ...["--reuid", "65534", "--regid", "65534", "--clear-groups"],
        ...["/bin/sh", "-c", '"$0" -u', hostPath],
      ]).then(
        (o) => `ran as uid ${o.stdout.trim()}`,
        (e: { stderr?: string }) => `refused: ${e.stderr?.trim()}`,
      );
      expect(ran).toMatch(/^refused: .*Permission denied/);
    } finally {
      chmodSync(stateDir, 0o700);
    }
  });

  it("a command's PATH and LD_PRELOAD reach the command only, never the privileged nsenter/setpriv before it", async () => {
    const h = await create();
    const marker = join(tmpdir(), `fleet-pwned-${RUN}`);
    // Look-alikes of the helpers, where the command's PATH points first: inside the sandbox
    // (/workspace) and on the host (the sandbox's workspace directory, a predictable path).
    const fake = `#!/bin/sh\n/usr/bin/touch ${marker} /workspace/pwned\n`;
    await provider.put(h, "/workspace", { nsenter: fake, setpriv: fake, env: fake });
    const hostWorkspace = join(stateDir, `${h.name}-${h.id.slice(0, 8)}`, "workspace");
    expect(existsSync(hostWorkspace)).toBe(true);
    const r = await provider.exec(h, ["/bin/sh", "-c", 'echo "$PATH|$LD_PRELOAD"'], {
      deadlineMs: 10_000,
      env: { PATH: `/workspace:${hostWorkspace}`, LD_PRELOAD: "/workspace/nope.so" },
      user: ROOT_USER,
    });
    expect(r.stdout).toBe(`/workspace:${hostWorkspace}|/workspace/nope.so\n`);
    expect(existsSync(marker)).toBe(false);
    expect(existsSync(join(hostWorkspace, "pwned"))).toBe(false);
  });

  it("a command whose arguments together are more than an exec takes (E2BIG, each one under 128 KiB) is a final invalid_task, nothing started, not the spawn's own error (taken for provider_unavailable, retried, masked)", async () => {
    const h = await create();
    const args = Array.from({ length: 24 }, () => "y".repeat(120 * 1024));
    const err = await provider.exec(h, ["true", ...args], { deadlineMs: 10_000 }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(FleetError);
    expect([(err as FleetError).kind, (err as FleetError).retryable]).toEqual(["invalid_task", false]);
    expect((err as FleetError).message).toMatch(/E2BIG/);
    expect((await provider.exec(h, ["true"], { deadlineMs: 10_000 })).exitCode).toBe(0);
  });

  it("kills the whole process tree at the deadline, leaving no agent process", async () => {
    const h = await create();
    const started = Date.now();
    const r = await provider.exec(h, ["sh", "-c", "sleep 1000 & sleep 1000"], { deadlineMs: 1_000 });
    expect(r).toMatchObject({ exitCode: -1, timedOut: true });
    expect(Date.now() - started).toBeLessThan(30_000); // at its deadline, far from the sleeps' 1000 s
    expect(await processesOf(h, 1000)).toEqual([]);
  });

  it("at the deadline, keeps what a command prints in its kill grace (SIGTERM handled before the SIGKILL)", async () => {
    // A kill grace far longer than the handler's 1 s, so a loaded host (CI once took 2 s past the
    // deadline here with the default 2 s grace) cannot SIGKILL it first; it still ends at the handler's exit.
    const graceful = new BubblewrapSandboxProvider({
      rootfs: provider.rootfs,
      stateDir,
      scope: RUN,
      defaults: { killGraceS: 15 },
    });
    const h = await create();
    const r = await graceful.exec(
      h,
      ["sh", "-c", "trap 'sleep 1; echo saved; exit 3' TERM; echo working; sleep 1000 & wait"],
      { deadlineMs: 1_000 },
    );
    expect(r).toMatchObject({ exitCode: -1, timedOut: true, stdout: "working\nsaved\n" });
  });

  it("caps 10 MB of output at maxOutputBytes and says so", async () => {
    const h = await create();
    const r = await provider.exec(
      h,
      ["sh", "-c", "head -c 10000000 /dev/zero | tr '\\000' a; head -c 3000 /dev/zero | tr '\\000' b >&2"],
      {
        deadlineMs: 60_000,
        maxOutputBytes: 64 * 1024,
      },
    );
    expect(r.exitCode).toBe(0);
    // Its first and its last half-cap (the end is what a reader wants), the middle said to be cut.
    const half = (64 * 1024) / 2;
    expect(r.stdout).toBe(
      `${"a".repeat(half)}\n[… ${10_000_000 - 2 * half} bytes cut …]\n${"a".repeat(half)}`,
    );
    expect(r.stdoutTruncated).toBe(true);
    expect(r.stderr).toBe("b".repeat(3000));
    expect(r.stderrTruncated).toBe(false);
  });

  it("has a read-only root, a writable workspace and root-only staging mounts", async () => {
    const h = await create();
    const root = await provider.exec(h, ["sh", "-c", "echo x > /pwned"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    expect(root.exitCode).not.toBe(0);
    expect(root.stderr).toMatch(/Read-only file system/);
    const tests = await provider.exec(h, ["sh", "-c", "echo x > /tests/planted"], { deadlineMs: 10_000 });
    expect(tests.exitCode).not.toBe(0);
    const ws = await provider.exec(
      h,
      ["sh", "-c", "echo made > /workspace/out.txt && cat /workspace/out.txt"],
      { deadlineMs: 10_000 },
    );
    expect(ws).toMatchObject({ exitCode: 0, stdout: "made\n" });

    await provider.put(h, "/tests", { "test.sh": "#!/bin/sh\nexit 0\n", "data/x.txt": "x" });
    await provider.put(h, "/workspace/src", { "main.py": "print(1)\n" });
    const ls = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "stat -c '%u %a %n' /tests/test.sh /tests/data/x.txt /workspace/src /workspace/src/main.py",
      ],
      {
        deadlineMs: 10_000,
      },
    );
    expect(ls.stdout).toBe(
      "0 755 /tests/test.sh\n0 644 /tests/data/x.txt\n1000 755 /workspace/src\n1000 644 /workspace/src/main.py\n",
    );
    expect(await provider.get(h, "/workspace/src/main.py")).toBe("print(1)\n");
    await provider.put(
      h,
      "/workspace/moded",
      { "deploy.sh": "#!/bin/sh\n", "key.pem": "k", locked: "l", tool: "echo t\n" },
      { modes: { "deploy.sh": 0o644, "key.pem": 0o600, locked: 0, tool: 0o755 } },
    );
    const moded = await provider.exec(h, ["sh", "-c", "cd /workspace/moded && stat -c '%a %n' *"], {
      deadlineMs: 10_000,
    });
    expect(moded.stdout).toBe("644 deploy.sh\n600 key.pem\n0 locked\n755 tool\n");
    expect(await provider.get(h, "/tests/data/x.txt")).toBe("x");
    expect(await provider.get(h, "/workspace/missing")).toBeNull();
    expect(await provider.get(h, "/workspace")).toBeNull();

    await provider.put(h, "/tests", { "other.sh": "y" }, { replace: true });
    const left = await provider.exec(h, ["sh", "-c", "cd /tests && find . -mindepth 1 | sort"], {
      deadlineMs: 10_000,
    });
    expect(left.stdout).toBe("./other.sh\n");
    await provider.put(h, "/workspace", {}, { replace: true });
    const none = await provider.exec(h, ["sh", "-c", "ls -A /workspace"], { deadlineMs: 10_000 });
    expect(none).toMatchObject({ exitCode: 0, stdout: "" });
  });

  it("root in the sandbox cannot set host kernel settings, nor kill the keepalive; the agent has a /dev/shm", async () => {
    const h = await create();
    // Asked without writing anything: `test -w` says what a write would meet (EROFS when read-only).
    const sys = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "for f in /proc/sys/kernel/core_pattern /proc/sys/vm/swappiness; do test -w $f && echo $f writable; done; grep -c ' /proc/sys ro,' /proc/self/mountinfo",
      ],
      { deadlineMs: 10_000, user: ROOT_USER },
    );
    expect(sys).toMatchObject({ exitCode: 0, stdout: "1\n" });
    // The keepalive is nobody's: root without capabilities (the tests, and the agent's code they
    // run) cannot signal it, so cannot end the sandbox to turn a grade into a mask.
    const keepalive = await provider.exec(
      h,
      ["sh", "-c", "ps -o uid=,comm= -p 2; kill -9 2 || echo refused; kill -9 -1; echo swept"],
      { deadlineMs: 10_000, user: ROOT_USER },
    );
    expect(keepalive.stdout).toMatch(/^\s*65534 sleep\nrefused\n/);
    expect(await provider.alive(h)).toBe(true);
    const again = await provider.exec(h, ["true"], { deadlineMs: 10_000 });
    expect(again.exitCode).toBe(0);
    const shm = await provider.exec(
      h,
      ["sh", "-c", "stat -c '%a %U' /dev/shm && touch /dev/shm/x && echo ok"],
      { deadlineMs: 10_000 },
    );
    expect(shm).toMatchObject({ exitCode: 0, stdout: "1777 root\nok\n" });
  });

  it("masks the host kernel's /proc files as Docker does: root inside reads nothing from /proc/keys or /proc/timer_list, and cannot write /proc/sysrq-trigger", async () => {
    // This kernel's own: a host without them has nothing there to leak (and the test nothing to show).
    expect(existsSync("/proc/keys") && existsSync("/proc/timer_list")).toBe(true);
    const h = await create();
    const read = await provider.exec(
      h,
      ["sh", "-c", 'for f in /proc/keys /proc/timer_list; do echo "$f $(cat $f 2>&1 | wc -c)"; done'],
      { deadlineMs: 10_000, user: ROOT_USER, cwd: "/" },
    );
    expect(read).toMatchObject({ exitCode: 0, stdout: "/proc/keys 0\n/proc/timer_list 0\n" });
    const readOnly = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sysrq-trigger"].filter((p) =>
      existsSync(p),
    );
    const writes = await provider.exec(
      h,
      [
        "sh",
        "-c",
        // Opened for writing and nothing written (a write to sysrq-trigger would act on the host).
        'for p in "$@"; do if [ -d "$p" ]; then grep -q " $p ro," /proc/self/mountinfo && echo "$p ro" || echo "$p rw"; ' +
          'else (exec 3>>"$p") 2>/dev/null && echo "$p rw" || echo "$p ro"; fi; done; ls -A /proc/acpi | wc -l',
        "sh",
        ...readOnly,
      ],
      { deadlineMs: 10_000, user: ROOT_USER, cwd: "/" },
    );
    expect(writes.stdout).toBe(`${readOnly.map((p) => `${p} ro\n`).join("")}0\n`);
  });

  it("an agent's unenterable workspace (chmod 000) does not stop the kill sweep, nor reads, staging and scrubs as root", async () => {
    const h = await create();
    const start = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "echo hi > hello.txt; setsid sleep 1000 >/dev/null 2>&1 & chmod 000 /workspace; echo started",
      ],
      { deadlineMs: 10_000 },
    );
    expect(start.stdout).toBe("started\n");
    const receipt = await provider.killProcesses(h, AGENT_USER);
    expect(receipt).toMatchObject({ confirmed: true, remaining: 0 });
    await provider.put(h, "/tests", { "test.sh": "exit 0\n" }, { user: ROOT_USER, replace: true });
    expect(await provider.get(h, "/tests/test.sh")).toBe("exit 0\n");
    await scrubScratch(provider, h, AGENT_USER);
  });

  it("a kill sweep by a worker out of file descriptors (EMFILE) never confirms the agent stopped: its sandbox is not taken for gone (rule 2)", async () => {
    const h = await create();
    const start = await provider.exec(h, ["sh", "-c", "setsid sleep 1000 >/dev/null 2>&1 & echo started"], {
      deadlineMs: 10_000,
    });
    expect(start.stdout).toBe("started\n");
    // This process's descriptors used up but for 4, with a soft limit above every one it holds
    // (pinning the sandbox for nsenter takes 7).
    const limits = (
      await run("prlimit", [
        "--pid",
        String(process.pid),
        "--nofile",
        "-o",
        "SOFT,HARD",
        "--raw",
        "--noheadings",
      ])
    ).stdout
      .trim()
      .split(/\s+/);
    const [soft, hard] = [limits[0]!, limits[1]!];
    const highest = Math.max(...readdirSync("/proc/self/fd").map(Number));
    const cap = highest + 256;
    await run("prlimit", ["--pid", String(process.pid), `--nofile=${cap}:${hard}`]);
    const fillers: number[] = [];
    let receipt: Awaited<ReturnType<typeof provider.killProcesses>>;
    try {
      for (;;) {
        try {
          fillers.push(openSync("/dev/null", "r"));
        } catch (err) {
          expect((err as NodeJS.ErrnoException).code).toBe("EMFILE");
          break;
        }
      }
      for (const fd of fillers.splice(0, 4)) closeSync(fd);
      receipt = await provider.killProcesses(h, AGENT_USER);
    } finally {
      for (const fd of fillers) closeSync(fd);
      await run("prlimit", ["--pid", String(process.pid), `--nofile=${soft}:${hard}`]);
    }
    expect(receipt).toMatchObject({ confirmed: false, alreadyGone: false });
    const left = await provider.exec(h, ["sh", "-c", "ps -o comm= -u 1000"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    expect(left.stdout).toContain("sleep");
    expect(await provider.killProcesses(h, AGENT_USER)).toMatchObject({ confirmed: true, remaining: 0 });
  });

  it("a sandbox command gets no descriptor of the worker's beyond the standard three: one the worker inherited (not close-on-exec) is closed on the host side", async () => {
    // The host side of every exec (`sandboxExecArgv`), with a descriptor at 5 as a worker's
    // launcher may leave one: a host file the command could otherwise write.
    const hostFile = join(await mkdtemp(join(tmpdir(), "bwrap-fd-")), "host.txt");
    const fd = openSync(hostFile, "a");
    try {
      const [file, ...args] = sandboxExecArgv([], ["/bin/sh", "-c", "ls /proc/$$/fd; echo leaked >&5"]);
      const child = spawn(file!, args, { stdio: ["ignore", "pipe", "pipe", "ignore", "ignore", fd] });
      let out = "";
      child.stdout!.on("data", (c: Buffer) => {
        out += c.toString();
      });
      const code = await new Promise<number | null>((resolve) => child.once("close", resolve));
      expect(out.trim().split("\n").sort()).toEqual(["0", "1", "2"]);
      expect(code).not.toBe(0); // its write to descriptor 5 failed
      expect(readFileSync(hostFile, "utf8")).toBe("");
    } finally {
      closeSync(fd);
      await rm(dirname(hostFile), { recursive: true, force: true });
    }
  });

  it("root in the sandbox cannot write to a host file through PID 1's output (bwrap's log): the write fails, the log stays as it was", async () => {
    const h = await create();
    const log = readdirSync(stateDir)
      .filter((f) => f.startsWith(`${h.name}-`))
      .map((f) => join(stateDir, f, "bwrap.log"))
      .find((f) => existsSync(f));
    expect(log).toBeDefined();
    const before = readFileSync(log!).length;
    const r = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "head -c 1048576 /dev/zero > /proc/1/fd/1; echo exit=$?; head -c 1000 /dev/zero > /proc/1/fd/2; echo exit=$?",
      ],
      { deadlineMs: 10_000, user: ROOT_USER },
    );
    expect(r.stdout).not.toContain("exit=0");
    expect(readFileSync(log!).length).toBe(before);
    expect(await provider.alive(h)).toBe(true);
  });

  it("has no network: a TCP server on the host's 127.0.0.1 is unreachable", async () => {
    const h = await create();
    let connections = 0;
    const server: Server = createServer((s) => {
      connections++;
      s.destroy();
    });
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    const port = (server.address() as { port: number }).port;
    try {
      const r = await provider.exec(h, ["bash", "-c", `echo hi > /dev/tcp/127.0.0.1/${port}`], {
        deadlineMs: 10_000,
      });
      expect(r.exitCode).not.toBe(0);
      expect(r.stderr).toMatch(/Connection refused|Network is unreachable/);
      expect(connections).toBe(0);
      const ifaces = await provider.exec(
        h,
        ["sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"],
        { deadlineMs: 10_000 },
      );
      expect(ifaces.stdout).toBe("lo\n");
    } finally {
      server.close();
    }
  });

  it("the scratch probe reads the root's read-only flag from its mount, under dash and under busybox (whose test -w says yes to root)", async () => {
    const shells = [["sh"], ["busybox", "sh"]];
    for (const shell of shells) {
      const probe = async (root: "--ro-bind" | "--bind", before = "") =>
        (
          await run("bwrap", [
            "--unshare-ipc",
            root,
            "/",
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--tmpfs",
            "/tmp",
            ...shell,
            "-c",
            `${before}${SCRATCH_PROBE_LINE}`,
          ])
        ).stdout.trim();
      expect(await probe("--ro-bind"), shell.join(" ")).toBe("clean");
      expect(await probe("--bind"), shell.join(" ")).toBe("dirty");
      // A SysV semaphore set of the agent's uid (created by it), then a root-owned one.
      const [uid, gid] = AGENT_USER.split(":");
      const agentSem = `/usr/bin/setpriv --reuid ${uid} --regid ${gid} --clear-groups /usr/bin/ipcmk -S 1 >/dev/null; `;
      expect(await probe("--ro-bind", agentSem), shell.join(" ")).toBe("dirty");
      expect(await probe("--ro-bind", "/usr/bin/ipcmk -S 1 >/dev/null; "), shell.join(" ")).toBe("clean");
    }
  });

  it("hides host processes and passes the isolation probe", async () => {
    const h = await create();
    const report = await provider.probe(h);
    expect(report.isolated).toBe(true);
    expect(report.checks).toEqual({
      pidNamespaceDiffers: true,
      netNamespaceDiffers: true,
      onlyLoopback: true,
      hostSentinelInvisible: true,
    });
    expect(report.detail).toMatch(/not enforced/);
    expect(report.workspaceEmpty).toBe(true);
    expect(report.scratchClean).toBe(true);
    await provider.put(h, "/workspace", { "x.txt": "x" });
    expect((await provider.probe(h)).workspaceEmpty).toBe(false);
    // The agent's scratch files: the probe sees them, and scrubScratch removes them.
    await provider.put(h, "/tmp/notes", { "plan.txt": "x" }, { user: AGENT_USER });
    expect((await provider.probe(h)).scratchClean).toBe(false);
    await scrubScratch(provider, h);
    expect((await provider.probe(h)).scratchClean).toBe(true);
    expect(await provider.get(h, "/tmp/notes/plan.txt")).toBeNull();
    // A POSIX message queue the agent made (its IPC namespace's, mounted where Docker has it):
    // seen and removed as its files are, not carried to a rerun unseen.
    const queue = await provider.exec(
      h,
      ["python3", "-c", "import os; os.close(os.open('/dev/mqueue/notes', os.O_CREAT | os.O_WRONLY, 0o600))"],
      { deadlineMs: 10_000 },
    );
    expect(queue.exitCode, queue.stderr).toBe(0);
    expect((await provider.probe(h)).scratchClean).toBe(false);
    await scrubScratch(provider, h);
    expect((await provider.probe(h)).scratchClean).toBe(true);
    const ps = await provider.exec(h, ["ps", "-eo", "pid=,args="], { deadlineMs: 10_000, user: ROOT_USER });
    const pids = ps.stdout
      .trim()
      .split("\n")
      .map((l) => Number(l.trim().split(/\s+/)[0]));
    // Its own namespace's pids: as many as this test's execs made there (a few dozen probes and
    // scrubs), never the host's (thousands by the time the suite runs), nor its processes.
    expect(Math.max(...pids)).toBeLessThan(1000);
    expect(ps.stdout).not.toMatch(/vitest|node /);
  });

  it("refuses a sandbox sharing the host's PID namespace (final isolation_refused)", async () => {
    const h = await create({ options: { pidMode: "host" } });
    const err = await fleetError(provider.probe(h));
    expect(err.kind).toBe("isolation_refused");
    expect(err.retryable).toBe(false);
    expect(err.message).toMatch(/pidNamespaceDiffers/);
  });

  it("enforces memory and pids limits through cgroups where the host has them", async (ctx) => {
    // Small tmpfs caps: the memory limit adds them to memoryMb.
    const h = await create({ options: { memoryMb: 64, pidsLimit: 32, tmpfsMb: 8 } });
    const report = await provider.probe(h);
    if (!/limits enforced: memory, pids/.test(report.detail)) ctx.skip();
    const hog = await provider.exec(h, ["sh", "-c", "tail /dev/zero"], { deadlineMs: 60_000 });
    expect(hog).toMatchObject({ exitCode: 137, timedOut: false, oomKilled: true });
    // A later plain SIGKILL is no OOM kill, though the sandbox had one before it.
    const killed = await provider.exec(h, ["sh", "-c", "kill -9 $$"], { deadlineMs: 10_000 });
    expect(killed).toMatchObject({ exitCode: 137, timedOut: false, oomKilled: false });
    const forks = await provider.exec(
      h,
      [
        "sh",
        "-c",
        'i=0; while [ $i -lt 64 ]; do sleep 100 & i=$((i+1)); done; echo "$i"; ps -e --no-headers | wc -l',
      ],
      { deadlineMs: 10_000 },
    );
    expect(Number(forks.stdout.trim().split("\n").pop())).toBeLessThanOrEqual(32);
    expect(forks.stderr).toMatch(/fork|Resource temporarily unavailable/i);
    // The kill sweep runs outside the pids cgroup, so a full one does not stop it.
    expect(await provider.killProcesses(h)).toMatchObject({ confirmed: true, remaining: 0 });
  });

  it("a tmpfs filled to a cap as large as the memory is ENOSPC, not an OOM kill: commands still run", async (ctx) => {
    const h = await create({ options: { memoryMb: 64, tmpfsMb: 64 } });
    const report = await provider.probe(h);
    if (!/limits enforced: memory/.test(report.detail)) ctx.skip();
    const fill = await provider.exec(
      h,
      [
        "sh",
        "-c",
        'dd if=/dev/zero of=/tmp/fill bs=1M count=128 2>&1 | grep -o "No space left on device"; echo filled',
      ],
      { deadlineMs: 60_000 },
    );
    expect(fill).toMatchObject({
      exitCode: 0,
      oomKilled: false,
      stdout: "No space left on device\nfilled\n",
    });
    const after = await provider.exec(h, ["python3", "-c", "b = bytearray(32 * 1024 * 1024); print('ok')"], {
      deadlineMs: 60_000,
    });
    expect(after).toMatchObject({ exitCode: 0, oomKilled: false, stdout: "ok\n" });
  });

  it("a sandbox whose cgroups something still lives in is not reported torn down until they are gone", async (ctx) => {
    const h = await create({ options: { memoryMb: 256, pidsLimit: 64 } });
    const report = await provider.probe(h);
    if (!/limits enforced: memory, pids/.test(report.detail)) ctx.skip();
    const state = JSON.parse(await readFile(join(stateDir, `${h.name}.json`), "utf8")) as {
      cgroups: { dir: string }[];
    };
    expect(state.cgroups.length).toBeGreaterThan(0);
    // A process outside the sandbox's namespaces, put into its cgroup: killing the sandbox's
    // PID 1 does not take it, and its cgroup cannot be removed while it lives.
    const squatter = spawn("sleep", ["1000"], { stdio: "ignore" });
    try {
      await writeFile(join(state.cgroups[0]!.dir, "cgroup.procs"), String(squatter.pid));
      const err = await fleetError(provider.destroy(h));
      expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
      expect(err.message).toMatch(/cgroups still in use/);
      expect((await provider.list()).map((s) => s.handle.name)).toContain(h.name); // left to retry
    } finally {
      squatter.kill("SIGKILL");
    }
    await waitUntil(() => squatter.exitCode !== null || squatter.signalCode !== null);
    live.pop();
    expect(await provider.destroy(h)).toMatchObject({ confirmed: true });
    expect((await provider.list()).map((s) => s.handle.name)).not.toContain(h.name);
  });

  it("refuses what it cannot give: a network, a writable root, more memory than the host has (none left made)", async () => {
    expect((await fleetError(provider.create(spec({ network: "fleet-gw-x" })))).kind).toBe("invalid_task");
    expect((await fleetError(provider.create(spec({ options: { readOnlyRoot: false } })))).kind).toBe(
      "invalid_task",
    );
    // A MiB more than the host has, for its processes alone (or, on a host of over 64 GiB, the
    // most a task may ask for, with tmpfs mounts of the most too: about 320 GiB).
    const hostMb = Math.ceil(totalmem() / 2 ** 20);
    const huge = spec({
      options:
        hostMb < 65_536 ? { memoryMb: hostMb + 1, tmpfsMb: 16 } : { memoryMb: 65_536, tmpfsMb: 65_536 },
    });
    const err = await fleetError(provider.create(huge));
    expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
    expect(err.message).toMatch(/memory limit .* is more than the sandbox host has/);
    expect((await provider.list()).filter((s) => s.handle.rolloutId === huge.rolloutId)).toEqual([]);
  });

  it("a sweep of root's own processes (the tests') kills them all, sparing bwrap's PID 1 and the sweep's own exec", async () => {
    const h = await create();
    const start = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "setsid sleep 1000 >/dev/null 2>&1 </dev/null & sleep 1001 >/dev/null 2>&1 </dev/null & echo started",
      ],
      { deadlineMs: 10_000, user: ROOT_USER },
    );
    expect(start.stdout).toBe("started\n");
    const sleeps = async () => (await processesOf(h, 0)).filter((l) => /sleep 100[01]/.test(l));
    expect(await sleeps()).toHaveLength(2);
    const receipt = await provider.killProcesses(h, ROOT_USER);
    expect(receipt).toMatchObject({ scope: "processes", confirmed: true, remaining: 0, alreadyGone: false });
    expect(await sleeps()).toEqual([]);
    expect(await provider.alive(h)).toBe(true);
    expect((await provider.exec(h, ["true"], { deadlineMs: 10_000 })).exitCode).toBe(0);
  });

  it("a sweep of root's own processes is never confirmed by what the tests' root processes write into its output (its stdout taken with pidfd_getfd or through /proc/<pid>/fd, the sweep then killed)", async () => {
    const h = await create();
    // The tests' code watching for the sweep, to forge its output (`startRootSweepForgers`).
    const forgers = await startRootSweepForgers(provider, h);
    expect(await forgers()).toBe(8);
    const receipt = await provider.killProcesses(h, ROOT_USER, { quickMs: 5_000 });
    const left = await forgers();
    expect({ confirmed: receipt.confirmed, left: left > 0 ? "some" : "none" }).not.toEqual({
      confirmed: true,
      left: "some",
    });
  });

  it("a worker under a strict umask (077) makes the same sandbox and runs its commands under Docker's umask (022): staged directories and the agent's files are readable by the tests (root, no DAC override)", async () => {
    // For the whole test, as a worker started under it would be: its execs inherit it.
    const umask = process.umask(0o077);
    try {
      const h = await create();
      await provider.put(h, "/workspace", { "task.txt": "seeded\n", "src/main.py": "print(1)\n" });
      const agent = await provider.exec(
        h,
        [
          "sh",
          "-c",
          "stat -c '%U %a' . src src/main.py; cat task.txt; mkdir out; echo made > out/answer.txt; umask",
        ],
        { deadlineMs: 10_000 },
      );
      expect(agent).toMatchObject({
        exitCode: 0,
        stdout: "agent 755\nagent 755\nagent 644\nseeded\n0022\n",
      });
      const root = await provider.exec(h, ["sh", "-c", "pwd; cat out/answer.txt src/main.py"], {
        deadlineMs: 10_000,
        user: ROOT_USER,
      });
      expect(root).toMatchObject({ exitCode: 0, stdout: "/workspace\nmade\nprint(1)\n" });
    } finally {
      process.umask(umask);
    }
  });

  it("a root sweep given a verify epoch raises the sandbox's fence to it, never lowering it, readable to root whatever the worker's umask; neither the tests (root) nor the agent can write the fence", async () => {
    const h = await create();
    // A worker under a strict umask (its execs inherit it): the fence must still be root's to read.
    const umask = process.umask(0o077);
    try {
      expect(await provider.killProcesses(h, ROOT_USER, { fenceEpoch: 2 })).toMatchObject({ fenced: true });
    } finally {
      process.umask(umask);
    }
    const fence = async () =>
      (await provider.exec(h, ["cat", VERIFY_FENCE_FILE], { deadlineMs: 10_000, user: ROOT_USER })).stdout;
    expect(await provider.killProcesses(h, ROOT_USER, { fenceEpoch: 5 })).toMatchObject({
      confirmed: true,
      fenced: true,
    });
    expect(await fence()).toBe("5\n");
    // A sweep of an older attempt, landing late, kills nothing once the fence is above it.
    await provider.exec(h, ["sh", "-c", "sleep 1001 >/dev/null 2>&1 </dev/null & echo started"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    const late = await provider.killProcesses(h, ROOT_USER, { fenceEpoch: 4 }).catch((e: unknown) => e);
    expect(late).toMatchObject({ name: "TestsSupersededError", fence: 5, epoch: 4 });
    expect((await processesOf(h, 0)).filter((l) => /sleep 1001/.test(l))).toHaveLength(1);
    expect(await fence()).toBe("5\n");
    for (const user of [ROOT_USER, AGENT_USER]) {
      const tamper = await provider.exec(
        h,
        ["sh", "-c", `echo 99 > ${VERIFY_FENCE_FILE}; rm -f ${VERIFY_FENCE_FILE}; cat ${VERIFY_FENCE_FILE}`],
        { deadlineMs: 10_000, user },
      );
      expect(tamper.stdout).toBe("5\n");
    }
    expect(await fence()).toBe("5\n");
  });

  it("a host without bwrap, or a rootfs that is not one, is provider_unavailable saying what (never an invalid task)", async () => {
    const empty = await mkdtemp(join(tmpdir(), "fleet-bwrap-empty-"));
    try {
      const noRootfs = new BubblewrapSandboxProvider({ rootfs: empty, stateDir, scope: RUN });
      expect(await fleetError(noRootfs.list())).toMatchObject({
        kind: "provider_unavailable",
        retryable: true,
        message: expect.stringContaining(`the rootfs ${empty} has no usr/bin/setpriv`),
      });
      const noBwrap = new BubblewrapSandboxProvider({
        rootfs: provider.rootfs,
        stateDir,
        scope: RUN,
        bwrapPath: "/nonexistent/bwrap",
      });
      expect(await fleetError(noBwrap.list())).toMatchObject({
        kind: "provider_unavailable",
        message: expect.stringContaining("bwrap (/nonexistent/bwrap) is not installed"),
      });
      expect(await fleetError(noBwrap.create(spec()))).toMatchObject({
        kind: "provider_unavailable",
        retryable: true,
        message: expect.stringContaining("bwrap (/nonexistent/bwrap) is not installed"),
      });
      expect(await provider.hostProblem()).toBeNull();
    } finally {
      await rm(empty, { recursive: true, force: true });
    }
  });

  it("a create on a host the preflight refuses fails with the preflight's own retryable error, starting nothing", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-bwrap-preflight-"));
    try {
      const hostRootLink = join(dir, "rootfs");
      await symlink("/", hostRootLink);
      const cases = [
        // Without the preflight these two started a sandbox: one nothing could ever exec in, one
        // whose root was the host's own.
        [{ nsenterPath: "/nonexistent/nsenter" }, "nsenter (/nonexistent/nsenter) is not installed"],
        [
          { rootfs: hostRootLink },
          `FLEET_BWRAP_ROOTFS is / (the host's own root), not a rootfs: ${hostRootLink} leads there`,
        ],
        [{ rootfs: join(dir, "missing") }, `the rootfs ${join(dir, "missing")} has no usr/bin/setpriv`],
        // A state directory no sandbox can be written to (here: under a file; a read-only mount
        // alike), and one under /proc, where Node's mkdir never answers. Before, the worker started
        // healthy (nothing to list) and failed every seed until the deadlines.
        [
          { stateDir: join(dir, "a-file", "bwrap") },
          `the state directory ${join(dir, "a-file", "bwrap")} (FLEET_STATE_DIR/bwrap) cannot be written: ENOTDIR`,
        ],
        [
          { stateDir: "/proc/fleet-nope/bwrap" },
          "the state directory /proc/fleet-nope/bwrap (FLEET_STATE_DIR/bwrap) cannot be written",
        ],
      ] as const;
      await writeFile(join(dir, "a-file"), "");
      for (const [options, message] of cases) {
        const refused = new BubblewrapSandboxProvider({
          rootfs: provider.rootfs,
          stateDir,
          scope: RUN,
          ...options,
        });
        const s = spec();
        const err = await fleetError(refused.create(s));
        expect(err).toMatchObject({ kind: "provider_unavailable", retryable: true });
        expect(err.message).toBe(await refused.hostProblem());
        expect(err.message).toContain(message);
        expect(await provider.list({ "fleet.rollout": s.rolloutId })).toEqual([]);
        expect(
          readdirSync(stateDir).filter((f) => f.startsWith(sandboxName(s.rolloutId, "resources", RUN))),
        ).toEqual([]);
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("a create on a rootfs the preflight passes but bwrap cannot use says why in bwrap's words (its log goes with the failed start)", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-bwrap-notrootfs-"));
    try {
      // What the preflight looks for, and nothing else: no mount point for /proc in a read-only root.
      for (const tool of ["usr/bin/setpriv", "usr/bin/env", "usr/bin/timeout", "bin/sh"]) {
        await mkdir(join(dir, tool, ".."), { recursive: true });
        await writeFile(join(dir, tool), "");
      }
      const notRootfs = new BubblewrapSandboxProvider({ rootfs: dir, stateDir, scope: RUN });
      expect(await notRootfs.hostProblem()).toBeNull();
      expect(await fleetError(notRootfs.create(spec()))).toMatchObject({
        kind: "provider_unavailable",
        retryable: true,
        message: expect.stringMatching(/exited before its keepalive started: bwrap: .*\/proc/),
      });
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("a rootfs that is the host's own root by another name (a symlink to /) is refused like / itself", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-bwrap-hostroot-"));
    try {
      const link = join(dir, "rootfs");
      await symlink("/", link);
      const hostRoot = new BubblewrapSandboxProvider({ rootfs: link, stateDir, scope: RUN });
      expect(await hostRoot.hostProblem()).toBe(
        `FLEET_BWRAP_ROOTFS is / (the host's own root), not a rootfs: ${link} leads there`,
      );
      expect(await fleetError(hostRoot.list())).toMatchObject({
        kind: "provider_unavailable",
        retryable: true,
      });
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("killProcesses kills the agent's processes, even ones in their own session", async () => {
    const h = await create();
    const start = await provider.exec(
      h,
      ["sh", "-c", "setsid sleep 1000 >/dev/null 2>&1 & nohup sleep 1000 >/dev/null 2>&1 & echo started"],
      {
        deadlineMs: 10_000,
      },
    );
    expect(start.stdout).toBe("started\n");
    expect((await processesOf(h, 1000)).length).toBeGreaterThanOrEqual(1);
    const receipt = await provider.killProcesses(h, AGENT_USER);
    expect(receipt).toMatchObject({ confirmed: true, scope: "processes", remaining: 0 });
    expect(await processesOf(h, 1000)).toEqual([]);
    expect(await provider.alive(h)).toBe(true);
  });

  it("killProcesses reaches the agent's processes in PID namespaces it nested inside the sandbox", async (ctx) => {
    const h = await create();
    const nested = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "unshare -Urpf sleep 1000 >/dev/null 2>&1 < /dev/null & sleep 0.3; cat /proc/$!/status | grep -c NSpid",
      ],
      { deadlineMs: 10_000 },
    );
    // Hosts that refuse unprivileged user namespaces cannot nest one: nothing to reach then.
    const ps = await provider.exec(h, ["sh", "-c", "ps -eo pid,user,args | grep -c '[s]leep 1000'"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    if (ps.stdout.trim() === "0") ctx.skip();
    expect(nested.exitCode).toBe(0);
    const receipt = await provider.killProcesses(h, AGENT_USER);
    expect(receipt).toMatchObject({ confirmed: true, remaining: 0 });
    const after = await provider.exec(h, ["sh", "-c", "ps -eo pid,user,args | grep -c '[s]leep 1000'"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    expect(after.stdout.trim()).toBe("0");
  });

  it("killProcesses stops an agent that kills every sweep of its own uid (the sweep holds CAP_KILL as root)", async () => {
    const h = await create();
    const start = await provider.exec(h, KILL_EVERY_SWEEP_ARGV, { deadlineMs: 10_000 });
    expect(start.stdout).toContain("started");
    expect((await processesOf(h, 1000)).length).toBeGreaterThanOrEqual(1);
    const receipt = await provider.killProcesses(h, AGENT_USER);
    expect(receipt).toMatchObject({ confirmed: true, remaining: 0, alreadyGone: false });
    expect(await processesOf(h, 1000)).toEqual([]);
    expect(await provider.alive(h)).toBe(true);
  });

  it("killProcesses stops an agent whose every process kills the sweeps of its uid and hands over to a new pid: nothing of it runs once the receipt is confirmed", async () => {
    const h = await create();
    const swept = await sweepReforkingChain(provider, h);
    expect([swept.started, swept.grew]).toEqual([true, true]);
    expect(swept.receipt).toMatchObject({ confirmed: true, remaining: 0, alreadyGone: false });
    // The chain added a link every few milliseconds while it ran: none in the second after.
    expect(new Set(swept.after).size).toBe(1);
    expect(await provider.alive(h)).toBe(true);
  });

  /**
   * nsenter, on the host, waits for its command with WUNTRACED: the command stopped (the sweep's
   * SIGSTOP before its SIGKILL, or the agent stopping its own `timeout`), it stopped itself, out
   * of the sandbox's sight. The command killed by the sweep was then never reaped: the exec
   * returned only at the provider's own timer (deadline + grace + slack) and, until then, the
   * sandbox's PID 1 could not exit (its destroy failed after 10 s).
   */
  it("a kill sweep while the agent's command runs ends that command's exec at once, and the sandbox's destroy is confirmed", async () => {
    const h = await create();
    const running = provider.exec(h, ["sleep", "1000"], { deadlineMs: 120_000 }).then(
      (r) => r,
      (e: unknown) => e,
    );
    await waitUntil(() => sandboxProcesses(h).some((pid) => cmdline(pid) === "sleep\x001000\x00"));
    expect(await provider.killProcesses(h, AGENT_USER)).toMatchObject({ confirmed: true, remaining: 0 });
    const pending = Symbol("still running");
    let bound: NodeJS.Timeout | undefined;
    const outcome = await Promise.race([
      running,
      new Promise((resolve) => {
        bound = setTimeout(() => resolve(pending), 20_000);
      }),
    ]);
    clearTimeout(bound);
    expect(outcome).toMatchObject({ exitCode: 137, timedOut: false });
    live.pop();
    expect(await provider.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: false });
    expect(hostProcessesOfRun()).toEqual([]);
  });

  it("an agent that stops its own timeout ends at its deadline and kill grace, not at the provider's own timer (its overrun budget)", async () => {
    const h = await create();
    const r = await provider.exec(h, ["sh", "-c", "kill -STOP $PPID; sleep 100"], { deadlineMs: 1_000 });
    expect(r).toMatchObject({ exitCode: -1, timedOut: true });
    // The timer is at 1 s + the 2 s grace + 5 s of slack; `timeout` ends it at 1 s (SIGTERM).
    expect(r.durationMs).toBeLessThan(1_000 + 2_000 + 2_000);
  });

  it.each([
    ["in its cgroups", true],
    ["on a host without cgroups (by the PID namespace it enters)", false],
  ] as const)(
    "a destroy kills the host side of an exec whose worker is gone, left stopped (it held the command's exit, and PID 1 with it), found %s",
    async (_, cgroups) => {
      const h = await create();
      const script = join(stateDir, "stopped-nsenter.mts");
      const modulePath = join(import.meta.dirname, "bubblewrap-sandbox-provider.ts");
      // A worker whose exec's nsenter is stopped as it exits (as a sweep leaves it, before anything
      // resumes it): nothing of this worker is left to resume it.
      await writeFile(
        script,
        [
          `import { readdirSync, readFileSync } from "node:fs";`,
          `import { BubblewrapSandboxProvider } from ${JSON.stringify(modulePath)};`,
          `const p = new BubblewrapSandboxProvider(${JSON.stringify({ rootfs: provider.rootfs, stateDir, scope: RUN })});`,
          `void p.exec(${JSON.stringify(h)}, ["sleep", "1000"], { deadlineMs: 600000 }).catch(() => undefined);`,
          "const nsenter = () => readdirSync('/proc').filter((d) => /^\\d+$/.test(d)).find((d) => { try { const st = readFileSync('/proc/' + d + '/stat', 'latin1'); return st.includes('(nsenter)') && st.slice(st.lastIndexOf(')') + 2).split(' ')[1] === String(process.pid); } catch { return false; } });",
          "let pid; while (!(pid = nsenter())) await new Promise((r) => setTimeout(r, 20));",
          "while (!readdirSync('/proc').some((d) => { try { return readFileSync('/proc/' + d + '/cmdline', 'latin1') === 'sleep\\x001000\\x00'; } catch { return false; } })) await new Promise((r) => setTimeout(r, 20));",
          "process.kill(Number(pid), 'SIGSTOP');",
          "console.log(pid);",
          "process.exit(0);",
        ].join("\n"),
      );
      const tsx = join(import.meta.dirname, "../../../../node_modules/.bin/tsx");
      const { stdout } = await run(tsx, [script], { timeout: 60_000 });
      const nsenterPid = Number(stdout.trim().split("\n").pop());
      // (A stop takes effect once its target next runs: on a loaded host, a moment after the kill.)
      await waitUntil(() => /\(nsenter\) T /.test(readFileSync(`/proc/${nsenterPid}/stat`, "latin1")));
      // A sandbox made where the host gives no cgroups: its state names none (its cgroups here
      // are removed by the test once empty).
      const statePath = join(stateDir, `${h.name}.json`);
      const state = JSON.parse(readFileSync(statePath, "utf8")) as { cgroups?: { dir: string }[] };
      const dirs = (state.cgroups ?? []).map((cg) => cg.dir);
      if (!cgroups) {
        delete state.cgroups;
        writeFileSync(statePath, JSON.stringify(state));
      }
      live.pop();
      expect(await provider.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: false });
      expect(alive(nsenterPid)).toBe(false);
      expect(hostProcessesOfRun()).toEqual([]);
      for (const dir of cgroups ? [] : dirs) rmdirSync(dir);
    },
  );

  it("destroy is idempotent; a destroyed sandbox is lost", async () => {
    const h = await create();
    await provider.exec(h, ["sh", "-c", "sleep 1000 &"], { deadlineMs: 10_000 });
    const first = await provider.destroy(h);
    const second = await provider.destroy(h);
    live.pop();
    expect(first).toMatchObject({ confirmed: true, alreadyGone: false });
    expect(second).toMatchObject({ confirmed: true, alreadyGone: true });
    expect((await fleetError(provider.exec(h, ["true"], { deadlineMs: 5_000 }))).kind).toBe("sandbox_lost");
    expect(await provider.killProcesses(h)).toMatchObject({ confirmed: true, alreadyGone: true });
    expect(hostProcessesOfRun()).toEqual([]);
  });

  it("a command running when its sandbox is destroyed is sandbox_lost, never its own SIGKILL (137) while the sandbox's PID 1 is still exiting", async () => {
    const h = await create();
    // A process whose exit takes a while (hundreds of MiB to free): the sandbox's PID 1, killed,
    // waits for it before it is gone itself, and the command below ends first.
    const big = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "setsid -f python3 -c \"b = b'x' * (600 << 20); open('/tmp/big', 'w').close(); import time; time.sleep(1000)\" >/dev/null 2>&1 </dev/null; until [ -e /tmp/big ]; do sleep 0.05; done; echo ready",
      ],
      { deadlineMs: 30_000 },
    );
    expect(big.stdout).toBe("ready\n");
    const running = provider.exec(h, ["sh", "-c", "touch /tmp/running; exec sleep 1000"], {
      deadlineMs: 60_000,
    });
    const settled = running.then(
      (r) => `exit ${r.exitCode}`,
      (err: unknown) => (isFleetError(err) ? err.kind : String(err)),
    );
    for (;;) {
      const r = await provider.exec(h, ["test", "-e", "/tmp/running"], { deadlineMs: 5_000 });
      if (r.exitCode === 0) break;
    }
    await provider.destroy(h);
    live.pop();
    expect(await settled).toBe("sandbox_lost");
  });

  it("destroy removes a workspace tree deeper than PATH_MAX (an agent's mkdir-and-cd loop), confirmed", async () => {
    const h = await create();
    // 2 × 1,100 levels of `d/`, each made from the one before by a relative path: the host path
    // of the innermost is over PATH_MAX (4096), which a removal walking by full paths cannot
    // name (ENAMETOOLONG).
    const deep = await provider.exec(
      h,
      [
        "bash",
        "-c",
        'p=$(printf "d/%.0s" {1..1100}); for i in 1 2; do mkdir -p "$p" && cd "$p" || exit 1; done; echo deep',
      ],
      { deadlineMs: 60_000 },
    );
    expect(deep.stdout).toBe("deep\n");
    live.pop();
    expect(await provider.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: false });
    expect((await provider.list()).map((s) => s.handle.name)).not.toContain(h.name);
    expect(readdirSync(stateDir).filter((n) => n.startsWith(h.name))).toEqual([]);
  });

  it("a command runs in the sandbox's own IPC, UTS and cgroup namespaces, never the host's", async () => {
    const h = await create();
    const r = await provider.exec(
      h,
      ["sh", "-c", "readlink /proc/self/ns/ipc /proc/self/ns/uts /proc/self/ns/cgroup; hostname"],
      { deadlineMs: 10_000 },
    );
    expect(r.exitCode, r.stderr).toBe(0);
    const [ipc, uts, cgroup, name] = r.stdout.trim().split("\n");
    // Its cgroup paths are the sandbox's own view (bwrap's --unshare-cgroup-try), not the host's tree.
    if (existsSync("/proc/self/ns/cgroup")) expect(cgroup).not.toBe(readlinkSync("/proc/self/ns/cgroup"));
    // The host's SysV IPC objects and hostname are out of the agent's reach.
    expect(ipc).toMatch(/^ipc:\[\d+\]$/);
    expect(ipc).not.toBe(readlinkSync("/proc/self/ns/ipc"));
    expect(uts).not.toBe(readlinkSync("/proc/self/ns/uts"));
    expect(name).toBe("sandbox");
  });

  it("a destroy with the handle of an earlier sandbox of the name leaves the newer one running", async () => {
    // A stale close (its sandbox already replaced by a re-delivered seed's) must not take the new one.
    const s = spec();
    const old = await provider.create(s);
    expect(await provider.destroy(old)).toMatchObject({ confirmed: true, alreadyGone: false });
    const newer = await provider.create(s);
    live.push(newer);
    expect(newer.name).toBe(old.name);
    expect(newer.id).not.toBe(old.id);
    expect(await provider.destroy(old)).toMatchObject({ confirmed: true, alreadyGone: true });
    expect((await provider.exec(newer, ["echo", "alive"], { deadlineMs: 10_000 })).stdout).toBe("alive\n");
  });

  it("a probe of a destroyed sandbox is sandbox_lost (final), never retried as an unreachable provider", async () => {
    const h = await provider.create(spec());
    await provider.destroy(h);
    const err = await fleetError(provider.probe(h));
    expect([err.kind, err.retryable]).toEqual(["sandbox_lost", false]);
  });

  it("a re-delivered create adopts the running sandbox", async () => {
    const s = spec();
    const h = await provider.create(s);
    live.push(h);
    expect(await provider.create(s)).toEqual(h);
  });

  it("two fleets sharing a state directory never take each other's sandbox for a rollout id they share", async () => {
    // Rollout ids derive from idempotency keys, so two fleets given the same key share them.
    const fleetA = new BubblewrapSandboxProvider({ rootfs: provider.rootfs, stateDir, scope: `${RUN}-a` });
    const fleetB = new BubblewrapSandboxProvider({ rootfs: provider.rootfs, stateDir, scope: `${RUN}-b` });
    const s = spec();
    const a = await fleetA.create(s);
    let b: SandboxHandle | null = null;
    try {
      b = await fleetB.create(s);
      expect(b.name).not.toBe(a.name);
      expect(b.id).not.toBe(a.id);
      expect((await fleetA.find(s.rolloutId, "resources"))?.id).toBe(a.id);
      expect((await fleetB.find(s.rolloutId, "resources"))?.id).toBe(b.id);
      // One fleet closing its rollout leaves the other's sandbox running.
      expect(await fleetB.destroy(b)).toMatchObject({ confirmed: true, alreadyGone: false });
      expect(await fleetA.alive(a)).toBe(true);
      // Another fleet's sandbox under this fleet's name is refused, and neither taken nor removed.
      const bName = sandboxName(s.rolloutId, "resources", `${RUN}-b`);
      const taken = join(stateDir, `${bName}.json`);
      const stateA = JSON.parse(await readFile(join(stateDir, `${a.name}.json`), "utf8"));
      await writeFile(taken, JSON.stringify({ ...stateA, name: bName }));
      try {
        const err = await fleetError(fleetB.create(s));
        expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
        expect(await fleetA.alive(a)).toBe(true);
      } finally {
        await rm(taken, { force: true });
      }
    } finally {
      await fleetA.destroy(a);
      if (b) await fleetB.destroy(b);
    }
  });

  /**
   * Start a create in another process with a bwrap that starts the real sandbox but never reports
   * its PID 1, so that create waits (up to 120 s) with the sandbox half-started; resolves once
   * bwrap and its PID 1 run. `pids`: those two and the wrapper (the recorded bwrap pid).
   * `killCreator` SIGKILLs the creator and resolves once no process of it is left: tsx runs the
   * script in a child node process, so killing tsx's own pid alone would leave the create running.
   */
  async function halfStartedCreate(s: SandboxSpecInput) {
    const wrapper = join(stateDir, "bwrap-mute.sh");
    await writeFile(wrapper, '#!/bin/sh\n/usr/bin/bwrap "$@" 3>/dev/null &\nexec sleep 1000\n', {
      mode: 0o755,
    });
    const script = join(stateDir, `creator-${s.rolloutId}.mts`);
    const modulePath = join(import.meta.dirname, "bubblewrap-sandbox-provider.ts");
    await writeFile(
      script,
      [
        `import { BubblewrapSandboxProvider } from ${JSON.stringify(modulePath)};`,
        `const p = new BubblewrapSandboxProvider(${JSON.stringify({ rootfs: provider.rootfs, stateDir, scope: RUN, bwrapPath: wrapper, defaults: { startTimeoutMs: 120_000 } })});`,
        `await p.create(${JSON.stringify(s)});`,
      ].join("\n"),
    );
    const tsx = join(import.meta.dirname, "../../../../node_modules/.bin/tsx");
    // A process group of its own: tsx and the node process it runs the script in.
    const creator = spawn(tsx, [script], { stdio: "ignore", detached: true });
    const exited = new Promise<number | null>((resolve) => creator.once("exit", resolve));
    const killCreator = async () => {
      process.kill(-creator.pid!, "SIGKILL");
      await exited;
      await waitUntil(
        () => !readdirNumeric("/proc").some((pid) => alive(pid) && cmdline(pid).includes(script)),
      );
    };
    const name = sandboxName(s.rolloutId, s.owner, RUN);
    let pids: number[] = [];
    // bwrap and its PID 1 run, and the creator has recorded bwrap's pid (its write right after
    // the spawn may come a moment after the processes appear).
    const recordedPid = () => {
      try {
        return JSON.parse(readFileSync(join(stateDir, `${name}.json`), "utf8")).bwrapPid as number;
      } catch {
        return 0;
      }
    };
    await waitUntil(() => {
      pids = hostProcessesOfRun().filter((pid) => cmdline(pid).includes(`/${name}-`));
      return pids.length >= 2 && recordedPid() > 0;
    });
    pids.push(recordedPid());
    expect(pids.every(alive)).toBe(true);
    return { exited, killCreator, name, pids };
  }

  it("a sandbox whose creator died before it was ready is listed, and the next create kills it before starting afresh", async () => {
    const s = spec();
    // The creator is killed meanwhile (a worker SIGKILLed during the up-to-10 s start).
    const { killCreator, name, pids } = await halfStartedCreate(s);
    await killCreator();
    expect(pids.every(alive)).toBe(true);

    expect(
      (await provider.list({ "fleet.rollout": s.rolloutId })).map((i) => [i.handle.name, i.running]),
    ).toEqual([[name, false]]);
    const h = await provider.create(s);
    live.push(h);
    expect(pids.filter(alive)).toEqual([]);
    expect((await provider.exec(h, ["echo", "fresh"], { deadlineMs: 10_000 })).stdout).toBe("fresh\n");
  });

  it("a destroy of a sandbox whose creator died before it was ready (the janitor's orphan sweep) kills its processes and says it did: not alreadyGone, which the janitor does not count as removed", async () => {
    const s = spec();
    const { killCreator, pids } = await halfStartedCreate(s);
    await killCreator();
    expect(pids.every(alive)).toBe(true);
    const [found] = await provider.list({ "fleet.rollout": s.rolloutId });
    expect(await provider.destroy(found!.handle)).toMatchObject({ confirmed: true, alreadyGone: false });
    expect(pids.filter(alive)).toEqual([]);
    expect(await provider.destroy(found!.handle)).toMatchObject({ confirmed: true, alreadyGone: true });
  });

  it("a destroy of a sandbox whose PID 1 died but cannot finish exiting (an exec's host side, stopped, holds a command it never reaps) kills what holds it and says it did: not alreadyGone", async () => {
    const h = await create();
    const running = provider.exec(h, ["sleep", "1000"], { deadlineMs: 120_000 }).then(
      (r) => r,
      (e: unknown) => e,
    );
    await waitUntil(() => sandboxProcesses(h).some((pid) => cmdline(pid) === "sleep\x001000\x00"));
    const { initPid } = JSON.parse(readFileSync(join(stateDir, `${h.name}.json`), "utf8")) as {
      initPid: number;
    };
    // The exec's nsenter, on the host, stopped (as a sweep leaves it); then PID 1 killed (the
    // OOM killer): it stays, exiting, until the command the nsenter holds is reaped.
    const nsenterPid = readdirNumeric("/proc").find((pid) => {
      try {
        const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
        return (
          stat.includes("(nsenter)") &&
          stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1] === String(process.pid)
        );
      } catch {
        return false;
      }
    })!;
    process.kill(nsenterPid, "SIGSTOP");
    await waitUntil(() => /\(nsenter\) T /.test(readFileSync(`/proc/${nsenterPid}/stat`, "latin1")));
    process.kill(initPid, "SIGKILL");
    // Gone to the provider (its PID 1 exiting), yet there: the command the nsenter holds unreaped.
    for (let end = Date.now() + 10_000; await provider.alive(h); ) {
      if (Date.now() > end) throw new Error("PID 1 still alive 10 s after its SIGKILL");
      await new Promise((r) => setTimeout(r, 20));
    }
    expect(existsSync(`/proc/${initPid}`)).toBe(true);
    expect(alive(nsenterPid)).toBe(true);
    live.pop();
    expect(await provider.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: false });
    expect(alive(nsenterPid)).toBe(false);
    expect(await running).toMatchObject({ kind: "sandbox_lost" });
    expect(hostProcessesOfRun()).toEqual([]);
  });

  it("a creator that dies between making the sandbox's cgroups and its next state write leaves them to the next destroy, not behind for good", async () => {
    const s = spec();
    const name = sandboxName(s.rolloutId, s.owner, RUN);
    // The creator "dies" at its second state write (the one after the cgroups are made): the
    // write never happens, and nothing of the create runs after it.
    const internals = provider as unknown as { writeState(state: { name: string }): Promise<void> };
    const writeState = internals.writeState.bind(provider);
    let writes = 0;
    let died!: () => void;
    const dying = new Promise<void>((r) => {
      died = r;
    });
    internals.writeState = async (state) => {
      if (state.name === name && ++writes === 2) {
        died();
        await new Promise(() => undefined);
      }
      return writeState(state);
    };
    const creating = provider.create(s);
    try {
      await dying;
      const recorded = JSON.parse(readFileSync(join(stateDir, `${name}.json`), "utf8")) as {
        cgroups: Array<{ dir: string }>;
      };
      // This host has cgroup v1 hierarchies (else there is nothing to leak): they are made, and recorded.
      expect(recorded.cgroups.length).toBeGreaterThan(0);
      expect(recorded.cgroups.every((cg) => existsSync(cg.dir))).toBe(true);
      const [found] = await provider.list({ "fleet.rollout": s.rolloutId });
      expect(found?.handle.name).toBe(name);
      expect(await provider.destroy(found!.handle)).toMatchObject({ confirmed: true });
      expect(recorded.cgroups.filter((cg) => existsSync(cg.dir))).toEqual([]);
    } finally {
      internals.writeState = writeState;
    }
    void creating.catch(() => undefined);
  });

  it("a destroy that read the state as its own before a newer create of the name wrote its own leaves the newer state in place", async () => {
    const h = await create();
    const path = join(stateDir, `${h.name}.json`);
    const own = JSON.parse(readFileSync(path, "utf8")) as { id: string };
    const newer = { ...own, id: randomUUID(), bwrapPid: 0, initPid: 0, cgroups: [] };
    // The interleaving: destroy's last read sees its own state, then (another process) a newer
    // create of the same name writes its state, then destroy removes the file.
    const internals = provider as unknown as { readState(name: string): Promise<unknown> };
    const readState = internals.readState.bind(provider);
    let reads = 0;
    internals.readState = async (name: string) => {
      const state = await readState(name);
      if (name === h.name && ++reads === 2) writeFileSync(path, JSON.stringify(newer));
      return state;
    };
    try {
      expect(await provider.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: false });
    } finally {
      internals.readState = readState;
    }
    expect(reads).toBe(2);
    // The newer sandbox's state is still there to find it by; nothing was left aside.
    expect(JSON.parse(readFileSync(path, "utf8")).id).toBe(newer.id);
    expect(readdirSync(stateDir).filter((f) => f.startsWith(h.name) && f.endsWith(".removing"))).toEqual([]);
    rmSync(path);
  });

  it("a destroy that found no state while a newer create of the name made its sandbox leaves the newer one's directory (its workspace) alone", async () => {
    const s = spec();
    const old = await provider.create(s);
    await provider.destroy(old);
    // The interleaving: a retried destroy of the old sandbox reads no state, then (another
    // process) a create of the same name writes its state and makes its directory, then the
    // destroy clears the name's leftover directories.
    // A leftover of the name (a creator that died with its state gone) still goes.
    const leftover = join(stateDir, `${old.name}-0badc0de`);
    mkdirSync(join(leftover, "workspace"), { recursive: true });
    const internals = provider as unknown as { readState(name: string): Promise<unknown> };
    const readState = internals.readState.bind(provider);
    let newer: SandboxHandle | undefined;
    let staged = false;
    internals.readState = async (name: string) => {
      const state = await readState(name);
      if (name === old.name && !staged) {
        staged = true;
        newer = await provider.create(s);
        live.push(newer);
        await provider.put(newer, "/workspace", { "task.txt": "staged\n" });
      }
      return state;
    };
    try {
      expect(await provider.destroy(old)).toMatchObject({ confirmed: true, alreadyGone: true });
    } finally {
      internals.readState = readState;
    }
    expect(newer?.name).toBe(old.name);
    const r = await provider.exec(newer!, ["cat", "/workspace/task.txt"], { deadlineMs: 10_000 });
    expect([r.exitCode, r.stdout]).toEqual([0, "staged\n"]);
    expect(existsSync(leftover)).toBe(false);
  });

  it("a create still starting whose name a newer create took over fails, and leaves the newer sandbox alone", async () => {
    const s = spec();
    const { exited, pids } = await halfStartedCreate(s);
    // A redelivered seed on the same host: it kills the half-started one and starts its own.
    const h = await provider.create(s);
    live.push(h);
    expect(pids.filter(alive)).toEqual([]);
    // The first create saw its bwrap die and cleaned up after itself: not the newer one's files.
    expect(await exited).not.toBe(0);
    expect(await provider.alive(h)).toBe(true);
    expect(
      (
        await provider.exec(h, ["sh", "-c", "echo kept > /workspace/f && cat /workspace/f"], {
          deadlineMs: 10_000,
        })
      ).stdout,
    ).toBe("kept\n");
    expect(
      (await provider.list({ "fleet.rollout": s.rolloutId })).map((i) => [i.handle.id, i.running]),
    ).toEqual([[h.id, true]]);
  });

  it("two creates of one rollout at once in one process: one sandbox stands, the other create fails as taken over (never on a state file the other wrote)", async () => {
    // Before each create wrote its state through its own temporary file, both wrote through one
    // (`<name>.json.<pid>.tmp`): one's rename took the other's file, the other's then found
    // nothing (ENOENT), and most often both creates failed.
    for (let round = 0; round < 5; round++) {
      const s = spec();
      const outcomes = await Promise.allSettled([provider.create(s), provider.create(s)]);
      const made = outcomes.flatMap((o) => (o.status === "fulfilled" ? [o.value] : []));
      live.push(...made);
      for (const o of outcomes) {
        if (o.status === "rejected") {
          // Taken over at its next state write, or its bwrap killed by the other while it started.
          expect(o.reason).toMatchObject({ kind: "provider_unavailable", retryable: true });
          expect((o.reason as Error).message).not.toMatch(/ENOENT|\.tmp/);
        }
      }
      expect(made.length).toBeGreaterThan(0);
      expect(new Set(made.map((h) => h.id)).size).toBe(1);
      expect(await provider.alive(made[0]!)).toBe(true);
      expect(
        (await provider.list({ "fleet.rollout": s.rolloutId })).map((i) => [i.handle.id, i.running]),
      ).toEqual([[made[0]!.id, true]]);
      expect(readdirSync(stateDir).filter((f) => f.endsWith(".tmp"))).toEqual([]);
    }
  });

  it("a create whose directory a newer create removed between its ownership check and its bwrap's start fails as taken over, not on its missing log", async () => {
    // The interleaving CI once hit with two creates at once: the loser writes its state as its
    // own, the winner then takes the name and removes the loser's directory as a dead leftover,
    // and the loser opens its bwrap log in a directory that is gone.
    const s = spec();
    const name = sandboxName(s.rolloutId, s.owner, RUN);
    const path = join(stateDir, `${name}.json`);
    type State = { id: string; name: string; workspaceDir: string };
    const internals = provider as unknown as { writeState(state: State): Promise<void> };
    const writeState = internals.writeState.bind(provider);
    let writes = 0;
    let dir = "";
    internals.writeState = async (state: State) => {
      await writeState(state);
      // Its second write (the one just before bwrap starts), then the newer create's.
      if (state.name === name && ++writes === 2) {
        dir = dirname(state.workspaceDir);
        rmSync(dir, { recursive: true, force: true });
        writeFileSync(path, JSON.stringify({ ...state, id: randomUUID(), cgroups: [] }));
      }
    };
    let failure: unknown;
    try {
      await provider.create(s).then(
        (h) => live.push(h),
        (err: unknown) => {
          failure = err;
        },
      );
    } finally {
      internals.writeState = writeState;
    }
    expect(writes).toBe(2);
    expect(failure).toMatchObject({ kind: "provider_unavailable", retryable: true });
    expect((failure as Error).message).toBe(`sandbox ${name} was taken over while it started`);
    // The newer create's state is left in place; nothing of the loser's is left behind.
    expect(existsSync(path)).toBe(true);
    expect(existsSync(dir)).toBe(false);
    rmSync(path);
  });

  it("a destroy that ran between a create's last ownership check and its last state write (a worker closing the rollout, a newer create of the name) fails the create, retryable: never a handle of the sandbox it killed (whose first exec is a final sandbox_lost), nor its state put back", async () => {
    const s = spec();
    const name = sandboxName(s.rolloutId, s.owner, RUN);
    type State = { id: string; name: string; rolloutId: string; owner: "resources" | "agent" };
    const internals = provider as unknown as { writeState(state: State): Promise<void> };
    const writeState = internals.writeState.bind(provider);
    let writes = 0;
    let receipt: unknown;
    internals.writeState = async (state: State) => {
      // Before its last write (the sandbox ready), after its check of the name.
      if (state.name === name && ++writes === 3) {
        receipt = await provider.destroy({
          provider: "bubblewrap",
          endpoint: provider.endpoint,
          id: state.id,
          name,
          rolloutId: state.rolloutId,
          owner: state.owner,
          volumes: [],
        });
      }
      await writeState(state);
    };
    let outcome: unknown;
    try {
      outcome = await provider.create(s).then(
        async (h) => {
          live.push(h);
          return `created (alive: ${await provider.alive(h)})`;
        },
        (err: unknown) => err,
      );
    } finally {
      internals.writeState = writeState;
    }
    expect(writes).toBe(3);
    expect(receipt).toMatchObject({ confirmed: true });
    expect(outcome).toMatchObject({ kind: "provider_unavailable", retryable: true });
    expect(await provider.list({ "fleet.rollout": s.rolloutId })).toEqual([]);
    expect(hostProcessesOfRun()).toEqual([]);
  });

  it("a create whose own first state write fails (a full disk) says why, not that it was taken over", async () => {
    const s = spec();
    const internals = provider as unknown as { writeState(state: unknown): Promise<void> };
    const writeState = internals.writeState.bind(provider);
    internals.writeState = async () => {
      throw Object.assign(new Error("ENOSPC: no space left on device, write"), { code: "ENOSPC" });
    };
    let failure: unknown;
    try {
      failure = await provider.create(s).then(
        (h) => {
          live.push(h);
          return null;
        },
        (err: unknown) => err,
      );
    } finally {
      internals.writeState = writeState;
    }
    expect(failure).toMatchObject({ kind: "provider_unavailable", retryable: true });
    expect((failure as Error).message).toBe(
      `sandbox ${sandboxName(s.rolloutId, s.owner, RUN)} failed to start: Error: ENOSPC: no space left on device, write`,
    );
  });

  /** Host pids of every process in a sandbox's PID namespace (its PID 1's, read from its state). */
  function sandboxProcesses(h: SandboxHandle): number[] {
    const { initPid } = JSON.parse(readFileSync(join(stateDir, `${h.name}.json`), "utf8")) as {
      initPid: number;
    };
    const ns = readlinkSync(`/proc/${initPid}/ns/pid`);
    return readdirNumeric("/proc").filter((pid) => {
      try {
        return readlinkSync(`/proc/${pid}/ns/pid`) === ns;
      } catch {
        return false;
      }
    });
  }

  it("a command's processes are the OOM killer's first pick in the sandbox, before its PID 1 and keepalive (whose loss would mask the rollout)", async () => {
    const h = await create();
    const adj = (pid: number) => readFileSync(`/proc/${pid}/oom_score_adj`, "utf8").trim();
    const own = sandboxProcesses(h);
    expect(own.length).toBeGreaterThanOrEqual(2);
    const running = (await sleepingExec(provider, h)).outcome;
    const command = sandboxProcesses(h).filter((pid) => cmdline(pid) === "sleep\x0060\x00");
    expect(command).toHaveLength(1);
    expect(adj(command[0]!)).toBe("1000");
    for (const pid of own) expect(Number(adj(pid))).toBeLessThan(1000);
    await running;
  });

  /** A provider whose host-side exec timer fires soon after a command's deadline and kill grace. */
  const quickTimer = () =>
    new BubblewrapSandboxProvider({
      rootfs: provider.rootfs,
      stateDir,
      scope: RUN,
      defaults: { execSlackMs: 500 },
    });

  /**
   * `sleep 60` with a 4 s deadline, and a wait until it runs in the sandbox: time for a test to
   * find it and act on it (stop or freeze the sandbox, read its OOM score) on a loaded host
   * before its own `timeout` ends it.
   */
  async function sleepingExec(
    p: BubblewrapSandboxProvider,
    h: SandboxHandle,
  ): Promise<{ outcome: Promise<unknown> }> {
    const running = p.exec(h, ["sleep", "60"], { deadlineMs: 4_000 }).then(
      (r) => r,
      (e: unknown) => e,
    );
    await waitUntil(() => sandboxProcesses(h).some((pid) => cmdline(pid) === "sleep\x0060\x00"));
    return { outcome: running };
  }

  it("a command in a sandbox stopped from outside (SIGSTOP) is sandbox_lost once the host's timer fires, not a timeout; one that stops its own timeout is a timeout", async () => {
    const quick = quickTimer();
    const h = await create();
    const running = (await sleepingExec(quick, h)).outcome;
    const signalAll = (signal: NodeJS.Signals) => {
      for (const pid of sandboxProcesses(h)) {
        try {
          process.kill(pid, signal);
        } catch {}
      }
    };
    signalAll("SIGSTOP");
    try {
      expect(await running).toMatchObject({
        kind: "sandbox_lost",
        retryable: false,
        message: expect.stringMatching(/was stopped from outside .* while a command ran/),
      });
    } finally {
      signalAll("SIGCONT");
    }
    // The command's own code stopping its `timeout` (it may: same uid) is no infrastructure
    // failure: the host timer fires, the sandbox's PID 1 runs, a timeout it is.
    expect(
      await quick.exec(h, ["sh", "-c", "kill -STOP $PPID; sleep 60"], { deadlineMs: 1_000 }),
    ).toMatchObject({ exitCode: -1, timedOut: true });
  });

  it("a sandbox stopped from outside whose stop reached the command's timeout first (resumed with its nsenter) is sandbox_lost, not a timeout", async () => {
    const quick = quickTimer();
    const h = await create();
    const running = (await sleepingExec(quick, h)).outcome;
    const state = (pid: number) => {
      try {
        const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
        return stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3);
      } catch {
        return "";
      }
    };
    const timeoutPid = sandboxProcesses(h).find((pid) =>
      /(^|\/)timeout$/.test(cmdline(pid).split("\0")[0] ?? ""),
    )!;
    expect(timeoutPid).toBeDefined();
    // The outside stop reaches the `timeout` first; its nsenter stops with it, and is resumed
    // (the poller's SIGCONT, heard here: the `timeout`'s stopped state may last less than a look
    // at it), which resumes the `timeout`; then the stop reaches everything else.
    const kill = process.kill.bind(process);
    let resumed = 0;
    const spy = vi.spyOn(process, "kill").mockImplementation((pid, signal) => {
      if (signal === "SIGCONT") resumed++;
      return kill(pid, signal);
    });
    try {
      kill(timeoutPid, "SIGSTOP");
      await waitUntil(() => resumed > 0);
    } finally {
      spy.mockRestore();
    }
    await waitUntil(() => state(timeoutPid) !== "T");
    const rest = sandboxProcesses(h).filter((pid) => pid !== timeoutPid);
    for (const pid of rest) process.kill(pid, "SIGSTOP");
    try {
      // The `timeout` fires at its deadline on a command that could not run: no timeout of its own.
      expect(await running).toMatchObject({ kind: "sandbox_lost", retryable: false });
    } finally {
      for (const pid of sandboxProcesses(h)) {
        try {
          process.kill(pid, "SIGCONT");
        } catch {}
      }
    }
  });

  it("root in the sandbox that stops its PID 1 itself (a ptrace attach, then a detach with SIGSTOP) and its own timeout gets a timeout, never sandbox_lost (masked)", async () => {
    const quick = quickTimer();
    const h = await create();
    const { initPid } = JSON.parse(readFileSync(join(stateDir, `${h.name}.json`), "utf8")) as {
      initPid: number;
    };
    // What the tests (root), or the agent's code they run, can do: PID 1 is root's and holds no
    // capability, so root without capabilities may trace it; the detach leaves it stopped (T).
    const script = [
      "import ctypes, os, signal, time",
      "libc = ctypes.CDLL(None, use_errno=True)",
      "assert libc.ptrace(16, 1, 0, 0) == 0",
      "os.waitpid(1, 0x40000000)",
      "assert libc.ptrace(17, 1, 0, signal.SIGSTOP) == 0",
      "os.kill(os.getppid(), signal.SIGSTOP)",
      "time.sleep(60)",
    ].join("\n");
    const stateOf = (pid: number) => {
      const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
      return stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3);
    };
    try {
      const outcome = await quick
        .exec(h, ["python3", "-c", script], { deadlineMs: 1_000, user: ROOT_USER })
        .then(
          (r) => r,
          (e: unknown) => e,
        );
      expect(stateOf(initPid)).toBe("T");
      expect(outcome).toMatchObject({ exitCode: -1, timedOut: true });
    } finally {
      process.kill(initPid, "SIGCONT");
    }
  });

  it("a command in a sandbox frozen from outside (cgroup v1 freezer) is sandbox_lost once the host's timer fires, not a timeout", async (ctx) => {
    const own = /^\d+:(?:[^:]*,)?freezer(?:,[^:]*)?:(.*)$/m.exec(
      readFileSync("/proc/self/cgroup", "utf8"),
    )?.[1];
    if (own === undefined || !existsSync("/sys/fs/cgroup/freezer/cgroup.procs")) ctx.skip();
    const parent = join("/sys/fs/cgroup/freezer", own!);
    const dir = join(parent, `fleet-it-${RUN}`);
    /** Into a freezer cgroup; one that exited meanwhile (ESRCH, a zombie too) needs no moving. */
    const moveTo = (cgroup: string, pid: number) => {
      try {
        writeFileSync(join(cgroup, "cgroup.procs"), String(pid));
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== "ESRCH") throw err;
      }
    };
    const quick = quickTimer();
    const h = await create();
    const running = (await sleepingExec(quick, h)).outcome;
    mkdirSync(dir);
    try {
      for (const pid of sandboxProcesses(h)) moveTo(dir, pid);
      writeFileSync(join(dir, "freezer.state"), "FROZEN");
      expect(await running).toMatchObject({
        kind: "sandbox_lost",
        retryable: false,
        message: expect.stringMatching(/was frozen from outside .* while a command ran/),
      });
    } finally {
      writeFileSync(join(dir, "freezer.state"), "THAWED");
      for (const pid of readFileSync(join(dir, "cgroup.procs"), "utf8").split("\n").filter(Boolean)) {
        moveTo(parent, Number(pid));
      }
      // Busy while a process that exited in it is not yet reaped.
      await waitUntil(() => {
        try {
          rmdirSync(dir);
          return true;
        } catch (err) {
          if ((err as NodeJS.ErrnoException).code !== "EBUSY") throw err;
          return false;
        }
      });
    }
    expect(await quick.exec(h, ["echo", "thawed"], { deadlineMs: 10_000 })).toMatchObject({
      stdout: "thawed\n",
    });
  });

  /** A host process (`sleep`) given `pid` (free), by setting the kernel's last pid just below it. */
  async function hostProcessWithPid(pid: number): Promise<ReturnType<typeof spawn>> {
    for (let attempt = 0; attempt < 50; attempt++) {
      writeFileSync("/proc/sys/kernel/ns_last_pid", String(pid - 1));
      const child = spawn("sleep", ["60"], { stdio: "ignore" });
      if (child.pid === pid) return child;
      child.kill("SIGKILL"); // another process took it first: again
      await new Promise((resolve) => child.once("exit", resolve));
    }
    throw new Error(`could not start a host process with pid ${pid}`);
  }

  it("a sandbox whose PID 1 died, its pid reused by a host process, between the liveness check and the exec is sandbox_lost; the command never runs in the host's namespaces", async () => {
    const h = await create();
    const hostPidNs = readlinkSync("/proc/self/ns/pid");
    const internals = provider as unknown as {
      liveState(handle: SandboxHandle): Promise<{ initPid: number }>;
    };
    const liveState = internals.liveState.bind(provider);
    let impostor: ReturnType<typeof spawn> | undefined;
    // The interleaving: the exec finds the sandbox alive, then (a destroy elsewhere) its PID 1 dies
    // and the pid is recycled for a host process before the exec enters it.
    internals.liveState = async (handle) => {
      const state = await liveState(handle);
      process.kill(state.initPid, "SIGKILL");
      await waitUntil(() => !existsSync(`/proc/${state.initPid}`));
      impostor = await hostProcessWithPid(state.initPid);
      return state;
    };
    try {
      const outcome = await provider
        .exec(h, ["readlink", "/proc/self/ns/pid"], { deadlineMs: 10_000, cwd: "/" })
        .then(
          (r) => r,
          (e: unknown) => e,
        );
      expect(impostor?.pid).toBeGreaterThan(0);
      expect(outcome).not.toMatchObject({ stdout: `${hostPidNs}\n` });
      expect(outcome).toMatchObject({ kind: "sandbox_lost", retryable: false, nothingStarted: true });
    } finally {
      internals.liveState = liveState;
      impostor?.kill("SIGKILL");
    }
  });

  it("outlives the process that created it", async () => {
    const script = join(stateDir, "creator.mts");
    const modulePath = join(import.meta.dirname, "bubblewrap-sandbox-provider.ts");
    await writeFile(
      script,
      [
        `import { BubblewrapSandboxProvider } from ${JSON.stringify(modulePath)};`,
        `const p = new BubblewrapSandboxProvider(${JSON.stringify({ rootfs: provider.rootfs, stateDir, scope: RUN })});`,
        `const h = await p.create(${JSON.stringify(spec())});`,
        "console.log(JSON.stringify(h));",
      ].join("\n"),
    );
    const tsx = join(import.meta.dirname, "../../../../node_modules/.bin/tsx");
    const { stdout } = await run(tsx, [script], { timeout: 60_000 });
    const h = JSON.parse(stdout.trim().split("\n").pop()!) as SandboxHandle;
    live.push(h);
    // The creator has exited (execFile resolved); the sandbox still runs and answers.
    expect(await provider.alive(h)).toBe(true);
    const r = await provider.exec(h, ["echo", "still here"], { deadlineMs: 10_000 });
    expect(r).toMatchObject({ exitCode: 0, stdout: "still here\n" });
  });

  it("an exec is not hit by a signal to the worker's process group (Ctrl-C in the worker's terminal)", async () => {
    const h = await create();
    const script = join(stateDir, "group-signal.mts");
    const modulePath = join(import.meta.dirname, "bubblewrap-sandbox-provider.ts");
    await writeFile(
      script,
      [
        `import { BubblewrapSandboxProvider } from ${JSON.stringify(modulePath)};`,
        // A worker that shuts down gracefully on SIGINT: it does not die of it.
        `process.on("SIGINT", () => undefined);`,
        `const p = new BubblewrapSandboxProvider(${JSON.stringify({ rootfs: provider.rootfs, stateDir, scope: RUN })});`,
        `const r = await p.exec(${JSON.stringify(h)}, ["sh", "-c", "sleep 2; echo done"], { deadlineMs: 30000 });`,
        "console.log(JSON.stringify(r));",
      ].join("\n"),
    );
    const tsx = join(import.meta.dirname, "../../../../node_modules/.bin/tsx");
    // The worker in a process group of its own, as a shell gives a foreground job.
    const worker = spawn(tsx, [script], { detached: true, stdio: ["ignore", "pipe", "inherit"] });
    let out = "";
    worker.stdout!.on("data", (c: Buffer) => (out += c.toString()));
    const exited = new Promise<number | null>((resolve) => worker.once("exit", resolve));
    // Once the command runs in the sandbox, the terminal's Ctrl-C: SIGINT to the whole group.
    const end = Date.now() + 30_000;
    while (!(await processesOf(h, 1000)).some((p) => p.includes("sleep 2")) && Date.now() < end) {
      await new Promise((r) => setTimeout(r, 20));
    }
    process.kill(-worker.pid!, "SIGINT");
    expect(await exited).toBe(0);
    const result = JSON.parse(out.trim().split("\n").pop()!) as { exitCode: number; stdout: string };
    expect(result).toMatchObject({ exitCode: 0, stdout: "done\n" });
  });
});
