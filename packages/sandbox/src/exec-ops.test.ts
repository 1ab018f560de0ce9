import { execFile, execFileSync } from "node:child_process";
import { chmodSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { PassThrough, Readable } from "node:stream";
import { type ExecResult, FleetError, isFleetError } from "@fleet/contracts";
import { describe, expect, it, vi } from "vitest";
import { KEEPALIVE_USER } from "./docker/container-config.ts";
import {
  assertIsolated,
  BACKED_UP_SWEEP_MS,
  type ExecCall,
  endWithStdin,
  extractViaExec,
  FENCE_EXEC_MS,
  findSandbox,
  getTarget,
  killProcessesViaExec,
  pid1Starting,
  planPut,
  probeStdout,
  probeWhilePid1Starts,
  ROOT_SELF_SWEEP_SCRIPT,
  readViaExec,
} from "./exec-ops.ts";
import { ROOT_USER, TestsSupersededError } from "./provider.ts";
import { Spool } from "./spool.ts";
import { execResult, fleetError } from "./testing/index.ts";

/** Probe outputs in the script's line order: pid namespace, PID 1's command line, sentinel. */
const output = (pid1: string) => `pid:[4026533275]\n${pid1}\n\n`;

describe("pid1Starting", () => {
  it("recognises the runtime's start shim, and only it", () => {
    expect(pid1Starting("runc init")).toBe(true);
    expect(pid1Starting("/usr/bin/runc init ")).toBe(true);
    expect(pid1Starting("/sbin/docker-init -- sleep infinity")).toBe(false);
    expect(pid1Starting("sleep infinity")).toBe(false);
    expect(pid1Starting("runc-initializer")).toBe(false);
    expect(pid1Starting("")).toBe(false);
  });
});

describe("probeWhilePid1Starts", () => {
  it("probes again while PID 1 is still `runc init`, and returns the settled output", async () => {
    const seen = [output("runc init"), output("runc init"), output("/sbin/docker-init -- sleep infinity")];
    let calls = 0;
    const stdout = await probeWhilePid1Starts(async () => seen[calls++]!, 5_000, 1);
    expect(calls).toBe(3);
    expect(stdout).toBe(seen[2]);
  });

  it("probes again while PID 1's command line reads empty (caught mid-exec), and gives up after the settle window", async () => {
    const seen = [output(""), output("/sbin/docker-init -- sleep infinity")];
    let calls = 0;
    expect(await probeWhilePid1Starts(async () => seen[calls++]!, 5_000, 1)).toBe(seen[1]);
    expect(calls).toBe(2);
    // Never anything but empty: the last output stands, for the checks to judge.
    let tries = 0;
    const stuck = await probeWhilePid1Starts(
      async () => {
        tries++;
        return output("");
      },
      30,
      1,
    );
    expect(stuck).toBe(output(""));
    expect(tries).toBeGreaterThan(1);
  });

  it("probes once when PID 1 is already the sandbox's init (or anything else)", async () => {
    let calls = 0;
    const stdout = await probeWhilePid1Starts(
      async () => {
        calls++;
        return output("bash");
      },
      5_000,
      1,
    );
    expect([calls, stdout]).toEqual([1, output("bash")]);
  });

  it("gives up after the settle window with the last output, for the checks to judge", async () => {
    let calls = 0;
    const stdout = await probeWhilePid1Starts(
      async () => {
        calls++;
        return output("runc init");
      },
      30,
      1,
    );
    expect(pid1Starting(stdout.split("\n")[1]!)).toBe(true);
    expect(calls).toBeGreaterThan(1);
  });

  it("lets a failing probe's error through", async () => {
    await expect(
      probeWhilePid1Starts(async () => {
        throw new Error("probe exited 1");
      }),
    ).rejects.toThrow("probe exited 1");
  });
});

describe("extractViaExec: what a failed staging exec means", () => {
  const ran = (over: Partial<ExecResult>) => async () => execResult({ stderr: "boom", ...over });
  const kindOf = async (p: Promise<unknown>) =>
    p.then(
      () => null,
      (err: unknown) => (isFleetError(err) ? [err.kind, err.retryable] : String(err)),
    );

  const plan = { target: "/tests", files: { "test.sh": "true\n" }, user: "0:0", ids: { uid: 0, gid: 0 } };

  it("the script's own failure (e.g. what replace could not clear) is the task's (final invalid_task)", async () => {
    expect(await kindOf(extractViaExec(ran({ exitCode: 3 }), plan, { replace: true }))).toEqual([
      "invalid_task",
      false,
    ]);
  });

  it.each([
    ["out of time", { exitCode: -1, timedOut: true }],
    ["killed by a signal", { exitCode: 137 }],
    ["cut off by the host", { exitCode: -1 }],
  ])("an exec %s is the infrastructure's (retryable provider_unavailable)", async (_why, over) => {
    expect(await kindOf(extractViaExec(ran(over), plan, { replace: true }))).toEqual([
      "provider_unavailable",
      true,
    ]);
    expect(await kindOf(extractViaExec(ran(over), plan))).toEqual(["provider_unavailable", true]);
  });
});

describe("readViaExec: which user's answer counts", () => {
  /** An exec answering each user with its exit code (0: the content). */
  const answers = (codes: Record<string, number>) => {
    const asked: string[] = [];
    const exec = async (_argv: readonly string[], o: { user?: string }) => {
      asked.push(o.user!);
      const exitCode = codes[o.user!]!;
      return execResult({ exitCode, stdout: exitCode === 0 ? `as ${o.user}` : "" });
    };
    return { exec, asked };
  };
  const read = (codes: Record<string, number>) => {
    const { exec, asked } = answers(codes);
    return readViaExec(exec, "/workspace/p/f", ["0:0", "1000:1000"], 1024).then(
      (v) => ({ v, asked }),
      (err: unknown) => ({ v: isFleetError(err) ? err.kind : String(err), asked }),
    );
  };

  it("a file root cannot see (an agent's 0700 directory) is read as the next user, not taken for missing", async () => {
    expect(await read({ "0:0": 44, "1000:1000": 0 })).toEqual({
      v: "as 1000:1000",
      asked: ["0:0", "1000:1000"],
    });
  });
  it("root's answer is enough when it reads the file", async () => {
    expect(await read({ "0:0": 0, "1000:1000": 0 })).toEqual({ v: "as 0:0", asked: ["0:0"] });
  });
  it("missing for every user is null; not a regular file (a directory, a FIFO) is null at once", async () => {
    expect((await read({ "0:0": 44, "1000:1000": 44 })).v).toBeNull();
    expect(await read({ "0:0": 46, "1000:1000": 0 })).toEqual({ v: null, asked: ["0:0"] });
  });
  it("there but readable by no one is the task's (invalid_task); an exec that failed is retryable", async () => {
    expect((await read({ "0:0": 45, "1000:1000": 44 })).v).toBe("invalid_task");
    expect((await read({ "0:0": 137, "1000:1000": 0 })).v).toBe("provider_unavailable");
  });
});

/** Whether this host can run a command as root without capabilities under busybox's `sh`. */
const caplessBusybox = (() => {
  if (process.getuid?.() !== 0) return false;
  try {
    execFileSync("setpriv", ["--bounding-set", "-all", "--", "busybox", "sh", "-c", "true"], {
      stdio: "ignore",
    });
    return true;
  } catch {
    return false;
  }
})();

describe.skipIf(!caplessBusybox)("readViaExec under busybox's sh (an Alpine image with coreutils)", () => {
  it("a file that root without capabilities cannot open (mode 000) is unreadable (invalid_task), though busybox's test -r says yes to root; not a failed exec (retryable, then masked)", async () => {
    const dir = mkdtempSync(join(tmpdir(), "read-via-exec-"));
    try {
      const file = join(dir, "reward.txt");
      writeFileSync(file, "1\n");
      chmodSync(file, 0o000);
      // The sandbox's root as both providers run it: uid 0, no capability (no DAC override), and
      // the image's /bin/sh busybox's.
      const exec = (argv: readonly string[]) =>
        new Promise<ExecResult>((resolve) => {
          execFile(
            "setpriv",
            ["--bounding-set", "-all", "--inh-caps", "-all", "--", "busybox", "sh", ...argv.slice(1)],
            (err, stdout, stderr) => {
              const exitCode = err ? (typeof err.code === "number" ? err.code : -1) : 0;
              resolve(execResult({ exitCode, stdout, stderr }));
            },
          );
        });
      const err = await readViaExec(exec, file, [ROOT_USER], 1024).catch((e: unknown) => e);
      expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["invalid_task", false]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe("probeStdout", () => {
  it("an image that lacks what the probe runs is the task's (final invalid_task)", () => {
    for (const r of [
      execResult({ exitCode: 127, stderr: "sh: 1: readlink: not found" }),
      execResult({
        exitCode: 126,
        stdout:
          'OCI runtime exec failed: exec: "/usr/bin/timeout": stat /usr/bin/timeout: no such file or directory',
      }),
    ]) {
      const err = (() => {
        try {
          probeStdout(r, 1000);
        } catch (e) {
          return e;
        }
        return null;
      })();
      expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["invalid_task", false]);
    }
  });

  it("a 126 the runtime gave for another reason (a loaded host) is not final", () => {
    const cgroupRace =
      "OCI runtime exec failed: exec failed: unable to start container process: error adding pid 42 to cgroups: failed to write 42: open /sys/fs/cgroup/docker/abc/cgroup.procs: no such file or directory: unknown";
    expect(() => probeStdout(execResult({ exitCode: 126, stdout: cgroupRace }), 1000)).toThrow(
      /probe exited 126/,
    );
    const r = execResult({
      exitCode: 126,
      stdout: "OCI runtime exec failed: exec failed: resource temporarily unavailable",
    });
    expect(() => probeStdout(r, 1000)).toThrow(/probe exited 126/);
    try {
      probeStdout(r, 1000);
    } catch (e) {
      expect(isFleetError(e)).toBe(false); // the provider wraps it as retryable provider_unavailable
    }
  });
});

describe("killProcessesViaExec: what the cleanup receipt may claim", () => {
  /** An exec answering each sweep in turn (a result, or an error thrown), recording its calls. */
  const sweeps = (...answers: Array<Partial<ExecResult> | Error>) => {
    const calls: ExecCall[] = [];
    const exec = async (_argv: readonly string[], o: ExecCall) => {
      calls.push(o);
      const a = answers[Math.min(calls.length, answers.length) - 1]!;
      if (a instanceof Error) throw a;
      return execResult(a);
    };
    return { exec, calls };
  };

  it("confirms only a sweep that counted no process left", async () => {
    const clean = sweeps({ stdout: "remaining=0\n" });
    expect(await killProcessesViaExec(clean.exec, "1000:1000", 5)).toMatchObject({
      confirmed: true,
      alreadyGone: false,
      remaining: 0,
    });
    const resisted = sweeps({ stdout: "remaining=2\n" });
    expect(await killProcessesViaExec(resisted.exec, "1000:1000", 5)).toMatchObject({
      confirmed: false,
      remaining: 2,
    });
  });

  it("never confirms when no sweep reported (three attempts, then an unconfirmed receipt)", async () => {
    const silent = sweeps({ exitCode: 137, stderr: "killed" });
    const receipt = await killProcessesViaExec(silent.exec, "1000:1000", 5);
    expect(receipt).toMatchObject({ confirmed: false, alreadyGone: false });
    expect(receipt.detail).toMatch(/exited 137/);
    expect(silent.calls).toHaveLength(3);
  });

  it("a sweep a reaper backs up tries once, within BACKED_UP_SWEEP_MS (a fork bomb at the pids limit defeats every try: the reaper, not 90 s of them)", async () => {
    const bombed = sweeps({
      exitCode: 125,
      stderr: "/usr/bin/timeout: fork system call failed: Resource temporarily unavailable",
    });
    const receipt = await killProcessesViaExec(bombed.exec, "1000:1000", 5, undefined, { backedUp: true });
    expect(receipt).toMatchObject({ confirmed: false, alreadyGone: false });
    expect(receipt.detail).toMatch(/fork system call failed/);
    expect(bombed.calls).toHaveLength(1);
    expect(bombed.calls[0]!.deadlineMs).toBe(BACKED_UP_SWEEP_MS);
    const unstartable = sweeps(new Error("pids limit reached"), { stdout: "remaining=0\n" });
    expect(
      await killProcessesViaExec(unstartable.exec, "1000:1000", 5, undefined, { backedUp: true }),
    ).toMatchObject({ confirmed: false });
    expect(unstartable.calls).toHaveLength(1);
  });

  it("retries a sweep that could not start, and confirms what a later one counted", async () => {
    const flaky = sweeps(new Error("pids limit reached"), { stdout: "remaining=0\n" });
    expect(await killProcessesViaExec(flaky.exec, "1000:1000", 5)).toMatchObject({ confirmed: true });
    expect(flaky.calls).toHaveLength(2);
  });

  it("a root sweep given a verify epoch raises the fence first, as the fence's owner (nobody), in an exec of its own; says whether it holds", async () => {
    const fencedFirst = sweeps({ stdout: "fenced=1\n" }, { stdout: "fence-seen=1\nremaining=0\n" });
    expect(
      await killProcessesViaExec(fencedFirst.exec, ROOT_USER, 5, undefined, { quickMs: 500, fenceEpoch: 4 }),
    ).toMatchObject({ confirmed: true, fenced: true });
    expect(fencedFirst.calls.map((c) => c.user)).toEqual([KEEPALIVE_USER, ROOT_USER]);
    // The fence's exec is bounded apart (the sweep has the caller's budget).
    expect(fencedFirst.calls.map((c) => c.deadlineMs)).toEqual([500, 500]);
    // Raised, but root (the tests' staging and runner) cannot read it (a strict umask): no fence.
    const unseen = sweeps({ stdout: "fenced=1\n" }, { stdout: "fence-seen=0\nremaining=0\n" });
    const notSeen = await killProcessesViaExec(unseen.exec, ROOT_USER, 5, undefined, {
      quickMs: 500,
      fenceEpoch: 4,
    });
    expect(notSeen).toMatchObject({ confirmed: true, fenced: false });
    expect(notSeen.detail).toMatch(/fence raised but not seen by root$/);
    // A fence it could not raise (no mount: a sandbox older than the fence) is said, and the
    // sweep still runs.
    const unfenced = sweeps({ stdout: "fenced=0\n" }, { stdout: "fence-seen=0\nremaining=0\n" });
    const noMount = await killProcessesViaExec(unfenced.exec, ROOT_USER, 5, undefined, {
      quickMs: 500,
      fenceEpoch: 4,
    });
    expect(noMount).toMatchObject({ confirmed: true, fenced: false });
    expect(noMount.detail).toMatch(/fence not raised: its file could not be written/);
    // Its script ran and could not write it: not tried again.
    expect(unfenced.calls.map((c) => c.user)).toEqual([KEEPALIVE_USER, ROOT_USER]);
    // An exec that failed twice (a second try within the fence's bound): no fence, and why.
    const failed = sweeps(new Error("exec failed"), new Error("exec failed again"), {
      stdout: "fence-seen=1\nremaining=0\n",
    });
    const failedTwice = await killProcessesViaExec(failed.exec, ROOT_USER, 5, undefined, {
      quickMs: 500,
      fenceEpoch: 4,
    });
    expect(failedTwice).toMatchObject({ confirmed: true, fenced: false });
    expect(failedTwice.detail).toMatch(/fence not raised: its exec failed: exec failed again/);
    expect(failed.calls.map((c) => c.user)).toEqual([KEEPALIVE_USER, KEEPALIVE_USER, ROOT_USER]);
    // A sandbox gone: nothing of it can start; confirmed already gone.
    const gone = sweeps(FleetError.nonRetryable("sandbox_lost", "no such container"));
    expect(
      await killProcessesViaExec(gone.exec, ROOT_USER, 5, undefined, { quickMs: 500, fenceEpoch: 4 }),
    ).toMatchObject({ confirmed: true, alreadyGone: true });
    expect(gone.calls).toHaveLength(1);
    // Not asked: one exec, and nothing said of a fence.
    const plain = sweeps({ stdout: "remaining=0\n" });
    expect((await killProcessesViaExec(plain.exec, ROOT_USER, 5)).fenced).toBeUndefined();
    expect(plain.calls).toHaveLength(1);
  });

  it("a fence exec that failed before its end (an exec refused or broken) is tried once more within the fence's bound; one out of time is not", async () => {
    vi.useFakeTimers({ toFake: ["Date"] });
    try {
      /** Answers in turn; the first exec takes `ranMs` of the clock. */
      const slowFirst = (ranMs: number, ...answers: Array<Partial<ExecResult> | Error>) => {
        const s = sweeps(...answers);
        const exec: typeof s.exec = async (argv, o) => {
          if (s.calls.length === 0) vi.setSystemTime(Date.now() + ranMs);
          return s.exec(argv, o);
        };
        return { exec, calls: s.calls };
      };
      const ok = { stdout: "fence-seen=1\nremaining=0\n" };
      // Refused at once, then raised: the second try gets what is left of the fence's bound.
      const refused = slowFirst(300, new Error("container is restarting"), { stdout: "fenced=1\n" }, ok);
      expect(
        await killProcessesViaExec(refused.exec, ROOT_USER, 5, undefined, { quickMs: 5000, fenceEpoch: 4 }),
      ).toMatchObject({ confirmed: true, fenced: true });
      expect(refused.calls.map((c) => [c.user, c.deadlineMs])).toEqual([
        [KEEPALIVE_USER, FENCE_EXEC_MS],
        [KEEPALIVE_USER, FENCE_EXEC_MS - 300],
        [ROOT_USER, 5000],
      ]);
      // Killed before its end (not its deadline), then raised.
      const killed = slowFirst(10, { exitCode: 137 }, { stdout: "fenced=1\n" }, ok);
      expect(
        await killProcessesViaExec(killed.exec, ROOT_USER, 5, undefined, { quickMs: 5000, fenceEpoch: 4 }),
      ).toMatchObject({ confirmed: true, fenced: true });
      expect(killed.calls).toHaveLength(3);
      // Out of time (none of its bound left): no second try; the sweep still runs, and the receipt
      // says why.
      const slow = slowFirst(FENCE_EXEC_MS, { exitCode: 137, timedOut: true }, ok);
      const timedOut = await killProcessesViaExec(slow.exec, ROOT_USER, 5, undefined, {
        quickMs: 5000,
        fenceEpoch: 4,
      });
      expect(timedOut).toMatchObject({ confirmed: true, fenced: false });
      expect(timedOut.detail).toMatch(/fence not raised: its exec timed out/);
      expect(slow.calls.map((c) => c.user)).toEqual([KEEPALIVE_USER, ROOT_USER]);
      // Failed with 250 ms of the bound left: a second try, with those 250 ms.
      const edge = slowFirst(FENCE_EXEC_MS - 250, new Error("exec failed"), { stdout: "fenced=1\n" }, ok);
      expect(
        await killProcessesViaExec(edge.exec, ROOT_USER, 5, undefined, { quickMs: 5000, fenceEpoch: 4 }),
      ).toMatchObject({ confirmed: true, fenced: true });
      expect(edge.calls.map((c) => c.deadlineMs)).toEqual([FENCE_EXEC_MS, 250, 5000]);
      // A caller with less than the fence's bound: that is the fence's whole budget.
      const short = slowFirst(100, new Error("exec failed"), { stdout: "fenced=1\n" }, ok);
      expect(
        await killProcessesViaExec(short.exec, ROOT_USER, 5, undefined, { quickMs: 800, fenceEpoch: 4 }),
      ).toMatchObject({ confirmed: true, fenced: true });
      expect(short.calls.map((c) => c.deadlineMs)).toEqual([800, 700, 800]);
      // Failed with less than 250 ms of the bound left: no second try.
      const late = slowFirst(FENCE_EXEC_MS - 200, new Error("exec failed"), ok);
      expect(
        await killProcessesViaExec(late.exec, ROOT_USER, 5, undefined, { quickMs: 5000, fenceEpoch: 4 }),
      ).toMatchObject({ confirmed: true, fenced: false });
      expect(late.calls.map((c) => c.user)).toEqual([KEEPALIVE_USER, ROOT_USER]);
    } finally {
      vi.useRealTimers();
    }
  });

  it("a quick sweep tries once, within its bound: again only when it was killed as it ran (the reaper of the tests it stops took it for a stray)", async () => {
    for (const answer of [{ exitCode: 1 }, { exitCode: 137, timedOut: true }, new Error("exec failed")]) {
      const once = sweeps(answer);
      const receipt = await killProcessesViaExec(once.exec, "1000:1000", 5, undefined, { quickMs: 500 });
      expect(receipt.confirmed).toBe(false);
      expect(once.calls.map((c) => c.deadlineMs)).toEqual([500]);
    }
    const reaped = sweeps({ exitCode: 137 }, { stdout: "remaining=0\n" });
    expect(await killProcessesViaExec(reaped.exec, ROOT_USER, 5, undefined, { quickMs: 500 })).toMatchObject({
      confirmed: true,
    });
    // The second gets what is left of the one budget (the caller's bound holds), and none is
    // tried with less than 250 ms of it left.
    vi.useFakeTimers({ toFake: ["Date"] });
    try {
      const slowlyReaped = (ranMs: number) => {
        const s = sweeps({ exitCode: 137 }, { stdout: "remaining=0\n" });
        const exec: typeof s.exec = async (argv, o) => {
          const r = await s.exec(argv, o);
          if (s.calls.length === 1) vi.setSystemTime(Date.now() + ranMs);
          return r;
        };
        return { exec, calls: s.calls };
      };
      const retried = slowlyReaped(300);
      expect(
        await killProcessesViaExec(retried.exec, ROOT_USER, 5, undefined, { quickMs: 1000 }),
      ).toMatchObject({
        confirmed: true,
      });
      expect(retried.calls.map((c) => c.deadlineMs)).toEqual([1000, 700]);
      const late = slowlyReaped(800);
      expect(
        (await killProcessesViaExec(late.exec, ROOT_USER, 5, undefined, { quickMs: 1000 })).confirmed,
      ).toBe(false);
      expect(late.calls.map((c) => c.deadlineMs)).toEqual([1000]);
    } finally {
      vi.useRealTimers();
    }
    // With a fence: raised once, then the sweep, and the sweep again.
    const fencedReaped = sweeps(
      { stdout: "fenced=1\n" },
      { exitCode: 137 },
      { stdout: "fence-seen=1\nremaining=0\n" },
    );
    expect(
      await killProcessesViaExec(fencedReaped.exec, ROOT_USER, 5, undefined, { quickMs: 500, fenceEpoch: 4 }),
    ).toMatchObject({ confirmed: true, fenced: true });
    expect(fencedReaped.calls.map((c) => c.user)).toEqual([KEEPALIVE_USER, ROOT_USER, ROOT_USER]);
    const twice = sweeps({ exitCode: 137 });
    expect(
      (await killProcessesViaExec(twice.exec, ROOT_USER, 5, undefined, { quickMs: 500 })).confirmed,
    ).toBe(false);
    expect(twice.calls).toHaveLength(2);
  });

  it("a root sweep given a verify epoch that finds the fence above it (a later attempt's, the sweep landing late) throws TestsSupersededError, never retried", async () => {
    const late = sweeps({ stdout: "fenced=1\n" }, { stdout: "fence-seen=1\nsuperseded=7\n" });
    const err = await killProcessesViaExec(late.exec, ROOT_USER, 5, undefined, {
      quickMs: 500,
      fenceEpoch: 4,
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TestsSupersededError);
    expect(err).toMatchObject({ fence: 7, epoch: 4 });
    expect(late.calls).toHaveLength(2);
    // Asked only to stop at a fence above its epoch (a hand-back's own sweep): nothing raised,
    // one exec, the same refusal.
    const own = sweeps({ stdout: "fence-seen=1\nsuperseded=7\n" });
    const refused = await killProcessesViaExec(own.exec, ROOT_USER, 5, undefined, {
      quickMs: 500,
      refuseAbove: 4,
    }).catch((e: unknown) => e);
    expect(refused).toMatchObject({ name: "TestsSupersededError", fence: 7, epoch: 4 });
    expect(own.calls.map((c) => c.user)).toEqual([ROOT_USER]);
    const ownArgv: string[] = [];
    const clean = sweeps({ stdout: "fence-seen=1\nremaining=0\n" });
    const receipt = await killProcessesViaExec(
      async (argv, o) => {
        ownArgv.push(...argv);
        return clean.exec(argv, o);
      },
      ROOT_USER,
      5,
      undefined,
      { quickMs: 500, refuseAbove: 4 },
    );
    expect(receipt).toMatchObject({ confirmed: true });
    expect(receipt.fenced).toBeUndefined();
    expect(ownArgv.at(-1)).toBe("4");
    // The script checks before every round, from the epoch it was given.
    expect(ROOT_SELF_SWEEP_SCRIPT).toMatch(/superseded=\$f"; exit 0.*sig STOP;.*sig KILL/s);
  });

  it("a sandbox gone is confirmed already gone; an error the caller calls fatal is thrown, not retried", async () => {
    const gone = sweeps(FleetError.nonRetryable("sandbox_lost", "no such container"));
    expect(await killProcessesViaExec(gone.exec, "1000:1000", 5)).toMatchObject({
      confirmed: true,
      alreadyGone: true,
    });
    const down = FleetError.retryable("provider_unavailable", "daemon unreachable");
    const unreachable = sweeps(down);
    await expect(killProcessesViaExec(unreachable.exec, "1000:1000", 5, (e) => e === down)).rejects.toBe(
      down,
    );
    expect(unreachable.calls).toHaveLength(1);
  });
});

describe("assertIsolated", () => {
  it("refuses (final isolation_refused) when any one check fails, naming it", async () => {
    const checks = { pidNamespaceDiffers: true, pidModeNotHost: false, hostSentinelInvisible: true };
    const err = await fleetError(() => assertIsolated("fleet-r1-resources", checks, "detail"));
    expect([err.kind, err.retryable]).toEqual(["isolation_refused", false]);
    expect(err.message).toMatch(/failed: pidModeNotHost\)/);
    expect(assertIsolated("fleet-r1-resources", { ...checks, pidModeNotHost: true }, "detail")).toBe(true);
  });
});

describe("planPut", () => {
  it("stages /tests and /solution as root unless told otherwise (the agent must not plant files there)", () => {
    expect(planPut("/tests", { "test.sh": "x" }, undefined, "1000:1000").user).toBe("0:0");
    expect(planPut("/solution/lib", { "a.sh": "x" }, undefined, "1000:1000").user).toBe("0:0");
    expect(planPut("/testsuite", { a: "x" }, undefined, "1000:1000").user).toBe("1000:1000");
    expect(planPut("/workspace", { a: "x" }, undefined, "1000:1000").user).toBe("1000:1000");
  });
});

describe("getTarget / planPut paths", () => {
  it("refuses '..' in a get or put path as the task's (final invalid_task), never resolving it elsewhere", async () => {
    for (const bad of [
      () => getTarget("/workspace/../etc/shadow"),
      () => planPut("/tests/../workspace", {}, undefined, "1000:1000"),
    ]) {
      const err = await fleetError(bad);
      expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
    }
    expect(getTarget("/workspace//./out.txt")).toBe("/workspace/out.txt");
  });
});

describe("findSandbox", () => {
  it("takes the sandbox of its own name when labels match several (another fleet's on the same daemon)", async () => {
    const info = (name: string) => ({
      handle: {
        provider: "docker" as const,
        endpoint: "unix:///var/run/docker.sock",
        id: `id-${name}`,
        name,
        rolloutId: "r1",
        owner: "resources" as const,
        volumes: [],
      },
      labels: {},
      running: true,
      createdAt: 0,
    });
    const list = async () => [info("fleet-sabcdef01-r1-resources"), info("fleet-r1-resources")];
    expect((await findSandbox(list, {}, "fleet-r1-resources"))?.id).toBe("id-fleet-r1-resources");
    expect(await findSandbox(async () => [], {}, "fleet-r1-resources")).toBeNull();
  });
});

describe("endWithStdin", () => {
  const readAll = async (stream: PassThrough) => {
    const chunks: Buffer[] = [];
    for await (const c of stream) chunks.push(c as Buffer);
    return Buffer.concat(chunks).toString();
  };

  it("writes a buffer, or a source from its start for each command, then ends the stream", async () => {
    const spool = new Spool(4);
    for (const part of ["ab", "", "cdef"]) await spool.write(Buffer.from(part));
    expect(spool.onDisk).toBe(true);
    try {
      for (const stdin of [Buffer.from("abcdef"), spool, spool]) {
        const stream = new PassThrough();
        const read = readAll(stream);
        endWithStdin(stream, stdin);
        expect(await read).toBe("abcdef");
      }
    } finally {
      await spool.dispose();
    }
  });

  it("a source that fails part way cuts the command's input (the stream destroyed), never ends it whole", async () => {
    const stream = new PassThrough();
    const failing = {
      read: () =>
        Readable.from(
          (async function* () {
            yield Buffer.from("half");
            throw new Error("disk read failed");
          })(),
        ),
    };
    const read = readAll(stream);
    endWithStdin(stream, failing);
    await expect(read).rejects.toThrow("disk read failed");
  });
});
