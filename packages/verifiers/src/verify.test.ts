import {
  classifyFailure,
  type ExecResult,
  FleetError,
  isFleetError,
  keptAnswer,
  MAX_ANSWER_CHARS,
  type SandboxHandle,
  TaskContent,
  type TaskContentInput,
} from "@fleet/contracts";
import { AGENT_USER, ROOT_USER, TestsSupersededError } from "@fleet/sandbox";
import { type ExecCall, execResult, type FakeSandbox, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { beforeEach, describe, expect, it, vi } from "vitest";
import { matchAnswer } from "./match.ts";
import { MAX_REWARD_FIELDS_BYTES, parseReward, parseRewardJson } from "./reward-file.ts";
import type { VerifyContext } from "./verdict.ts";
import { parseRunReport, REWARD_FILE, REWARD_JSON_FILE, RUN_TESTS_ARGV, verify } from "./verify.ts";

const TESTS_TASK = TaskContent.parse({
  id: "t1",
  instruction: "Do it.",
  image: "rollout-fleet/base:latest",
  tests: { "test.sh": "exit 0\n", "helper.py": "x = 1\n" },
  timeouts: { verifierS: 20 },
});

const AGENT_EXEC: ExecResult = execResult({ durationMs: 5 });

let provider: InMemorySandboxProvider;
let handle: SandboxHandle;
/** What happened, in order: "put /tests", "tests", "get". */
let log: string[];

/** `report: false`: the runner sends no closing report (killed before it, or one the test writes itself). */
type TestsOutcome = Partial<ExecResult> & { reward?: string; report?: boolean };

/** The nonce the verifier handed the runner on stdin. */
const nonceOf = (call: ExecCall) => String(call.options.stdin ?? "").split("\n")[0]!;

/**
 * Script the sandbox's side of `RUN_TESTS_SCRIPT`: clear /logs/verifier, write the `ready` line,
 * let test.sh do `outcome`, then report the reward file on stderr as the script does.
 */
function script(outcome: (call: ExecCall, box: FakeSandbox) => TestsOutcome | Promise<TestsOutcome>): void {
  provider.onExec = async (call, box) => {
    expect(call.argv).toEqual(RUN_TESTS_ARGV);
    log.push("tests");
    const nonce = nonceOf(call);
    for (const path of [...box.files.keys()]) if (path.startsWith("/logs/verifier/")) box.files.delete(path);
    const { reward, report = true, ...result } = await outcome(call, box);
    if (reward !== undefined) box.files.set(REWARD_FILE, { content: reward, user: ROOT_USER });
    const file = box.files.get(REWARD_FILE);
    const closing = !report
      ? ""
      : file === undefined
        ? `\n${nonce} none\n`
        : `\n${nonce} reward ${Buffer.byteLength(file.content)}\n${file.content}`;
    return { ...result, stderr: `${nonce} ready\n${result.stderr ?? ""}${closing}` };
  };
}

beforeEach(async () => {
  log = [];
  provider = new InMemorySandboxProvider();
  handle = await provider.create({
    image: "i",
    rolloutId: "r1",
    owner: "resources",
    expiresAt: Date.now() + 60_000,
  });
  const put = provider.put.bind(provider);
  provider.put = async (h, dir, files, options) => {
    log.push(`put ${dir}`);
    return put(h, dir, files, options);
  };
  const get = provider.get.bind(provider);
  provider.get = async (h, path, options) => {
    log.push("get");
    return get(h, path, options);
  };
});

function ctx(overrides: Partial<VerifyContext> = {}, task: TaskContentInput = TESTS_TASK): VerifyContext {
  return {
    provider,
    handle,
    task: TaskContent.parse(task),
    run: { answer: null, exec: AGENT_EXEC },
    ...overrides,
  };
}

async function failure(promise: Promise<unknown>): Promise<FleetError> {
  const err = await promise.then(
    () => null,
    (e: unknown) => e,
  );
  if (!isFleetError(err)) throw new Error(`expected a FleetError, got ${String(err)}`);
  return err;
}

describe("tests verifier", () => {
  it("stages exactly the tests as root, runs them as root in /workspace: exit 0 → 1.0", async () => {
    script(() => ({ exitCode: 0, stdout: "ok\n" }));
    const verdict = await verify(ctx());
    expect(verdict.reward).toBe(1);
    expect(verdict.details).toMatchObject({
      kind: "tests",
      source: "exit_code",
      exitCode: 0,
      stdoutTail: "ok\n",
    });
    // Two sandbox calls: the reward file's absence came back with the tests' exec.
    expect(log).toEqual(["put /tests", "tests"]);

    const [tests] = provider.execCalls;
    expect(provider.execCalls).toHaveLength(1);
    // The runner starts in / and enters the workspace itself (an agent's 0700 workspace is no
    // runner that cannot start).
    expect(tests?.options).toMatchObject({ cwd: "/", user: ROOT_USER });
    // The nonce, then an empty line: no verify epoch to check the sandbox's fence against.
    expect(tests?.options.stdin).toMatch(/^[0-9a-f]{32}\n\n$/);
    expect(tests?.options.deadlineMs).toBeLessThanOrEqual(20_000);
    expect(tests?.options.deadlineMs).toBeGreaterThan(15_000);
    // Whatever a previous attempt left in /tests is replaced in the same put.
    expect(provider.putCalls).toEqual([
      { dir: "/tests", files: TESTS_TASK.tests, user: ROOT_USER, replace: true },
    ]);
  });

  it("stages the tests at the modes the task gives them", async () => {
    script(() => ({ exitCode: 0 }));
    expect((await verify(ctx({}, { ...TESTS_TASK, modes: { "tests/helper.py": "600" } }))).reward).toBe(1);
    expect(provider.putCalls).toEqual([
      {
        dir: "/tests",
        files: TESTS_TASK.tests,
        user: ROOT_USER,
        replace: true,
        modes: { "helper.py": 0o600 },
      },
    ]);
  });

  it("hands the runner the attempt's verify epoch after the nonce, and a runner that finds the sandbox fenced by a later attempt is TestsSupersededError: nothing graded, nothing read", async () => {
    script(() => ({ exitCode: 0 }));
    expect((await verify(ctx({ fenceEpoch: 3 }))).reward).toBe(1);
    expect(provider.execCalls[0]!.options.stdin).toMatch(/^[0-9a-f]{32}\n3\n$/);
    // Its staging is fenced too (the put's own check: see exec-ops' extractViaExec).
    expect(provider.putCalls[0]).toMatchObject({ dir: "/tests", fenceEpoch: 3 });

    // The runner's report when the fence holds a higher epoch: no `ready` line, exit 5.
    provider.onExec = async (call) => {
      log.push("tests");
      return execResult({ exitCode: 5, stderr: `\n${nonceOf(call)} superseded 4\n` });
    };
    log = [];
    const err = await verify(ctx({ fenceEpoch: 3 })).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TestsSupersededError);
    expect(err).toMatchObject({ fence: 4, epoch: 3 });
    // Not run again (the `prepare` retry), and no reward file read.
    expect(log).toEqual(["put /tests", "tests"]);
  });

  it("a new nonce each time, kept out of argv and the environment", async () => {
    script(() => ({ exitCode: 0 }));
    await verify(ctx());
    await verify(ctx());
    const [a, b] = provider.execCalls.map(nonceOf);
    expect(a).not.toBe(b);
    for (const call of provider.execCalls) {
      expect(JSON.stringify([call.argv, call.options.env ?? {}])).not.toContain(nonceOf(call));
    }
  });

  it("non-zero exit → 0.0, with bounded output tails", async () => {
    script(() => ({ exitCode: 1, stdout: `${"x".repeat(5000)}FAILED`, stderr: "boom" }));
    const verdict = await verify(ctx());
    expect(verdict.reward).toBe(0);
    expect(verdict.details.exitCode).toBe(1);
    const tail = verdict.details.stdoutTail as string;
    expect(tail.length).toBe(2000);
    expect(tail.endsWith("FAILED")).toBe(true);
    expect(verdict.details.stderrTail).toBe("boom");
  });

  it("cuts the output tails between characters: an emoji cut in half left a lone surrogate in the verdict", async () => {
    // 2,000 characters less the mark's 12 is an odd count: a tail of emoji (two UTF-16 units
    // each) cut there starts with the second half of one.
    script(() => ({ exitCode: 1, stdout: "😀".repeat(3000), stderr: `${"😀".repeat(3000)}!` }));
    const verdict = await verify(ctx());
    for (const key of ["stdoutTail", "stderrTail"]) {
      const tail = verdict.details[key] as string;
      expect(tail.startsWith("[truncated]…"), key).toBe(true);
      expect(tail.length, key).toBeLessThanOrEqual(2000);
      expect((tail as string & { isWellFormed(): boolean }).isWellFormed(), key).toBe(true);
    }
  });

  it("tests that left processes running grade 0 whatever their reward file and exit status say", async () => {
    provider.onExec = async (call) => {
      const nonce = nonceOf(call);
      return execResult({ exitCode: 0, stderr: `${nonce} ready\n\n${nonce} strays 2\n` });
    };
    const v = await verify(ctx());
    expect(v).toMatchObject({ reward: 0, details: { source: "stray_processes", strays: 2 } });
    expect(String(v.details.reason)).toMatch(/2 process\(es\) the tests started were still running/);
    expect(log).not.toContain("get");
  });

  it("the reward file wins over the exit status", async () => {
    script(() => ({ exitCode: 1, reward: "0.75\n", stderr: "1 failed" }));
    const partial = await verify(ctx());
    expect(partial.reward).toBe(0.75);
    expect(partial.details).toMatchObject({
      source: "reward_file",
      rewardText: "0.75",
      exitCode: 1,
      stderrTail: "1 failed",
    });
    expect(log).toEqual(["put /tests", "tests"]); // read with the tests' exec, not apart

    script(() => ({ exitCode: 0, reward: "0" }));
    expect((await verify(ctx())).reward).toBe(0);
  });

  it("a reward file left before verification does not count", async () => {
    provider.sandbox(handle).files.set(REWARD_FILE, { content: "1", user: "1000:1000" });
    script(() => ({ exitCode: 1 }));
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
  });

  it("a /logs/verifier the agent planted is cleared as the agent, then the tests run and grade", async () => {
    let planted = true;
    provider.onExec = (call) => {
      if (call.argv !== RUN_TESTS_ARGV && call.options.user === AGENT_USER) {
        planted = false; // the scrub, as the agent: its directory goes
        return {};
      }
      const nonce = nonceOf(call);
      if (planted)
        return {
          exitCode: 3,
          stderr: `\n${nonce} prepare cannot clear /logs/verifier (owned by uid 1000)\n`,
        };
      return { exitCode: 1, stderr: `${nonce} ready\n\n${nonce} none\n` };
    };
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code", exitCode: 1 } });
    expect(provider.execCalls.map((c) => c.options.user)).toEqual([ROOT_USER, AGENT_USER, ROOT_USER]);
  });

  it("refuses to grade when /logs/verifier cannot be cleared even then (masked)", async () => {
    provider.onExec = (call) =>
      call.options.user === AGENT_USER
        ? {}
        : {
            exitCode: 3,
            stderr: `\n${nonceOf(call)} prepare cannot clear /logs/verifier (owned by uid 0)\n`,
          };
    const err = await failure(verify(ctx()));
    expect([err.kind, err.retryable]).toEqual(["verifier_error", false]);
    expect(err.message).toContain("cannot clear /logs/verifier (owned by uid 0)");
    expect(provider.execCalls).toHaveLength(3);
  });

  it("refuses to grade when /tests cannot be cleared (masked)", async () => {
    provider.put = async () => {
      throw FleetError.nonRetryable("invalid_task", "cannot clear /tests, left: conftest.py");
    };
    script(() => ({ exitCode: 0 }));
    const err = await failure(verify(ctx()));
    expect([err.kind, err.retryable]).toEqual(["verifier_error", false]);
    expect(err.message).toContain("conftest.py");
    expect(provider.execCalls).toHaveLength(0);
  });

  it("never grades when the runner did not say it started the tests (exit 0 or not): retried, then masked", async () => {
    for (const exitCode of [0, 1, 4]) {
      provider.onExec = () => ({ exitCode, stdout: "looks fine" });
      const err = await failure(verify(ctx()));
      expect([err.kind, err.retryable]).toEqual(["verifier_error", true]);
      expect(classifyFailure(err.kind).outcome).toBe("mask");
      expect(err.message).toContain("did not start");
    }
  });

  it("a shell warning before the ready line stays in the tests' stderr; the grade stands", async () => {
    const warning = "bash: warning: setlocale: LC_ALL: cannot change locale (en_US.UTF-8)\n";
    script(() => ({ exitCode: 0, reward: "0.5" }));
    const scripted = provider.onExec;
    provider.onExec = async (call, box) => {
      const r = await scripted(call, box);
      return { ...r, stderr: `${warning}${r.stderr}` };
    };
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({ reward: 0.5, details: { source: "reward_file", stderrTail: warning } });
  });

  it("a report line with another nonce is the tests' own output, not a reward", async () => {
    script(() => ({ exitCode: 1, stderr: `\n${"0".repeat(32)} reward 1\n1` }));
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
    expect(verdict.details.stderrTail).toBe(`\n${"0".repeat(32)} reward 1\n1`);
  });

  it.each([0, 1])(
    "no report in a cut output (exit %i): what wrote past the report outlived the tests, so neither their exit status nor the reward file is their verdict: 0 as stray processes",
    async (exitCode) => {
      // test.sh writes its reward last (0 here) and exits 0 whatever it found; the agent's code it
      // ran left a writer that outlived the runner's reap and flooded stderr past the report.
      script(() => ({ exitCode, reward: "0", report: false, stderrTruncated: true }));
      const verdict = await verify(ctx());
      expect(verdict).toMatchObject({ reward: 0, details: { source: "stray_processes" } });
      expect(verdict.details.reason).toMatch(/wrote past the runner's report/);
      expect(log).toEqual(["put /tests", "tests"]);
    },
  );

  it("a runner killed before it reported (nothing cut its output): its exit status grades, never the reward file the killer left", async () => {
    // Agent code the tests ran writes 1 to the reward file, then kills test.sh and the runner.
    script(() => ({ exitCode: 137, reward: "1", report: false, stderrTruncated: false }));
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code", exitCode: 137 } });
    expect(verdict.details.reason).toMatch(
      /ended with a signal's status \(exit 137: killed by signal 9, or a command of theirs/,
    );
    expect(log).toEqual(["put /tests", "tests"]);
    // Flooding the output past the cap before the kill changes nothing: the runner died by a signal.
    log = [];
    script(() => ({ exitCode: 137, reward: "1", report: false, stderrTruncated: true }));
    expect(await verify(ctx())).toMatchObject({ reward: 0, details: { source: "exit_code" } });
    expect(log).toEqual(["put /tests", "tests"]);
    // Only test.sh killed, the runner reporting the file it left: still not the tests' verdict.
    script(() => ({ exitCode: 137, reward: "1" }));
    expect(await verify(ctx())).toMatchObject({ reward: 0, details: { source: "exit_code" } });
    // A runner that exited by itself yet never reported, nothing cutting its output.
    script(() => ({ exitCode: 1, reward: "1", report: false, stderrTruncated: false }));
    const silent = await verify(ctx());
    expect(silent).toMatchObject({ reward: 0, details: { source: "exit_code" } });
    expect(silent.details.reason).toMatch(/killed before it reported/);
  });

  it.each(["abc", "1.5", "-0.1", "NaN", "inf", "", "0x1", "1/2"])(
    "tests that failed and a bad reward file (%j) → 0 by the exit status, never a mask the agent's code could choose",
    async (text) => {
      script(() => ({ exitCode: 1, reward: text }));
      const verdict = await verify(ctx());
      expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
      expect(verdict.details.reason).toMatch(/not a number/);
    },
  );

  it.each(["abc", "1.5", "-0.1", "NaN", "inf", "", "0x1", "1/2"])(
    "tests that passed and a bad reward file (%j) → verifier_error, never 0",
    async (text) => {
      script(() => ({ exitCode: 0, reward: text }));
      const err = await failure(verify(ctx()));
      expect(err.kind).toBe("verifier_error");
      expect(classifyFailure(err.kind).outcome).toBe("mask");
      expect(err.retryable).toBe(false);
    },
  );

  it("tests that time out on their own budget grade the agent's work 0, whatever reward they wrote", async () => {
    script(() => ({ exitCode: -1, timedOut: true, reward: "0.5" }));
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({
      reward: 0,
      details: { kind: "tests", source: "timeout", timedOut: true, reason: expect.stringContaining("20 s") },
    });
  });

  it("a timeout before the runner said it started grades nothing (retryable verifier_error)", async () => {
    provider.onExec = async () => ({ ...execResult({ exitCode: -1, timedOut: true }), stderr: "" });
    const err = await failure(verify(ctx()));
    expect([err.kind, err.retryable]).toEqual(["verifier_error", true]);
    expect(err.message).toContain("did not start");
  });

  it("a runner the image cannot start (no bash: exit 127) fails the task for good (invalid_task), not masked after retries", async () => {
    provider.onExec = async () => ({
      ...execResult({ exitCode: 127 }),
      stderr: "timeout: failed to run command 'bash': No such file or directory\n",
    });
    const err = await failure(verify(ctx()));
    expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
    expect(err.message).toMatch(
      /cannot run the tests' runner \(exit 127; .*bash\): timeout: failed to run command 'bash'/,
    );
  });

  it("the tests' budget starts when they are staged: copying them in takes none of it", async () => {
    vi.useFakeTimers({ toFake: ["Date"] });
    try {
      const put = provider.put.bind(provider);
      provider.put = async (...args) => {
        await put(...args);
        vi.setSystemTime(Date.now() + 15_000); // a large tests/ on a loaded host
      };
      script(() => ({ exitCode: 0 }));
      expect((await verify(ctx())).reward).toBe(1);
      expect(provider.execCalls[0]?.options.deadlineMs).toBe(20_000);
    } finally {
      vi.useRealTimers();
    }
  });

  it("exit 255 (a test's `exit -1`) is its own code, not a signal: its reward file stands", async () => {
    script(() => ({ exitCode: 255, reward: "0.5" }));
    expect(await verify(ctx())).toMatchObject({
      reward: 0.5,
      details: { source: "reward_file", exitCode: 255 },
    });
  });

  it("a reward.json without a reward.txt grades by its reward, its other numbers kept; a malformed one masks beside passing tests, and the exit status grades failing ones", async () => {
    const json = (content: string, exitCode = 0) => {
      provider.onExec = async (call) => {
        const nonce = nonceOf(call);
        const closing = `\n${nonce} reward ${Buffer.byteLength(content)} json\n${content}`;
        return { ...execResult({ exitCode }), stderr: `${nonce} ready\n${closing}` };
      };
    };
    json('{"reward": 0.3, "accuracy": 0.5, "passed": true, "note": "x"}');
    expect(await verify(ctx())).toMatchObject({
      reward: 0.3,
      details: { source: "reward_file", rewardFile: "reward.json", rewards: { accuracy: 0.5 } },
    });
    for (const bad of [
      '{"score": 1}',
      '{"reward": "1"}',
      '{"reward": 2}',
      "[1]",
      "1",
      "not json",
      '{"reward": true}',
    ]) {
      json(bad);
      const err = await failure(verify(ctx()));
      expect([err.kind, err.retryable], bad).toEqual(["verifier_error", false]);
      expect(err.message, bad).toMatch(
        /^reward\.json must be a JSON object with a "reward" number in \[0, 1\]/,
      );
      json(bad, 1);
      expect(await verify(ctx()), bad).toMatchObject({
        reward: 0,
        details: {
          source: "exit_code",
          rewardFile: "reward.json",
          reason: expect.stringContaining("reward.json"),
        },
      });
    }
  });

  it("a reward.json too large to come back with the tests is read apart", async () => {
    const content = `{"reward": 1, "pad": "${"x".repeat(2000)}"}`;
    provider.onExec = async (call, box) => {
      box.files.set(REWARD_JSON_FILE, { content, user: ROOT_USER });
      const nonce = nonceOf(call);
      return { ...execResult({ exitCode: 0 }), stderr: `${nonce} ready\n\n${nonce} unreadable json\n` };
    };
    expect(await verify(ctx())).toMatchObject({ reward: 1, details: { rewardFile: "reward.json" } });
    expect(log).toEqual(["put /tests", "get"]);
  });

  it("tests killed for memory grade as they exited (0), noted in details, not masked", async () => {
    script(() => ({ exitCode: 137, oomKilled: true }));
    expect(await verify(ctx())).toMatchObject({ reward: 0, details: { exitCode: 137, oomKilled: true } });
  });

  it("never runs past the rollout deadline", async () => {
    script(() => ({ exitCode: -1, timedOut: true }));
    const err = await failure(verify(ctx({ deadlineMs: Date.now() + 5000 })));
    expect(err.kind).toBe("deadline_exceeded");
    expect(provider.execCalls[0]?.options.deadlineMs).toBeLessThanOrEqual(5000);
  });

  it("does nothing when the rollout deadline has already passed", async () => {
    script(() => ({ exitCode: 0 }));
    const err = await failure(verify(ctx({ deadlineMs: Date.now() - 1 })));
    expect(err.kind).toBe("deadline_exceeded");
    expect(provider.execCalls).toHaveLength(0);
  });

  it("a provider failure keeps its kind and retryability; any other failure → verifier_error", async () => {
    const blip = new FleetError("provider_unavailable", "daemon restarting");
    script(() => {
      throw blip;
    });
    const err = await failure(verify(ctx()));
    expect(err).toBe(blip);
    expect(err.retryable).toBe(true);

    provider.put = async () => {
      throw new Error("tar stream broke");
    };
    const plain = await failure(verify(ctx()));
    expect([plain.kind, plain.retryable]).toEqual(["verifier_error", false]);
  });

  it("a lost sandbox while reading the reward → sandbox_lost (masked), not a verifier crash", async () => {
    // The runner could not inline the file (unreadable by it, or over 1 KiB): read apart.
    script((call) => ({ exitCode: 0, report: false, stderr: `\n${nonceOf(call)} unreadable\n` }));
    provider.get = async () => {
      throw new FleetError("sandbox_lost", "gone");
    };
    expect((await failure(verify(ctx()))).kind).toBe("sandbox_lost");
  });

  it.each([
    // Over 1 KiB, read apart: graded whole, never by its first bytes.
    ["a number, then padding", `1${" ".repeat(2000)}`, 1, 1, "reward_file"],
    ["a number, then more after 1 KiB", `1${" ".repeat(2000)}0`, 1, 0, "exit_code"],
    ["over 64 KiB", `1${" ".repeat(70_000)}`, 1, 0, "exit_code"],
  ] as const)(
    "a reward file over 1 KiB (%s) is read whole, up to 64 KiB",
    async (_what, content, exitCode, reward, source) => {
      script((call, box) => {
        box.files.set(REWARD_FILE, { content, user: ROOT_USER });
        // What the runner reports for a file over 1 KiB: read it apart.
        return { exitCode, report: false, stderr: `\n${nonceOf(call)} unreadable\n` };
      });
      expect(await verify(ctx())).toMatchObject({ reward, details: { source } });
    },
  );

  it("a task without tests/test.sh is invalid_task", async () => {
    // TaskContent refuses it now; a task stored by an older version can still lack the file.
    expect(TaskContent.safeParse({ ...TESTS_TASK, tests: {} }).success).toBe(false);
    const err = await failure(verify(ctx({ task: { ...TESTS_TASK, tests: {} } })));
    expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
  });

  it("stops waiting when aborted", async () => {
    let started!: () => void;
    const running = new Promise<void>((resolve) => {
      started = resolve;
    });
    script(() => {
      started();
      return new Promise(() => {});
    });
    const controller = new AbortController();
    const result = failure(verify(ctx({ signal: controller.signal })));
    await running;
    controller.abort();
    expect((await result).kind).toBe("cancelled");
  });
});

describe("parseRunReport", () => {
  const nonce = "ab".repeat(16);
  it("takes the ready line and the last report off the tests' stderr", () => {
    expect(parseRunReport(`${nonce} ready\nwarn\n${nonce} x\n\n${nonce} reward 4\n0.5\n`, nonce)).toEqual({
      stderr: `warn\n${nonce} x\n`,
      ready: true,
      report: { kind: "reward", text: "0.5\n", json: false },
    });
    // No reward.txt, a reward.json: said so.
    expect(
      parseRunReport(`${nonce} ready\n\n${nonce} reward 15 json\n{"reward": 0.3}`, nonce).report,
    ).toEqual({
      kind: "reward",
      text: '{"reward": 0.3}',
      json: true,
    });
    expect(parseRunReport(`${nonce} ready\n\n${nonce} none\n`, nonce)).toEqual({
      stderr: "",
      ready: true,
      report: { kind: "none" },
    });
  });

  it("a strays report says how many processes outlived the tests", () => {
    expect(parseRunReport(`${nonce} ready\nout\n${nonce} strays 3\n`, nonce)).toEqual({
      stderr: "out",
      ready: true,
      report: { kind: "strays", count: 3 },
    });
  });

  it("reads the reward apart when the report is unreadable or its size does not match; says when there is none", () => {
    expect(parseRunReport(`${nonce} ready\nlots of output`, nonce).report).toEqual({ kind: "missing" });
    for (const raw of [
      `${nonce} ready\n\n${nonce} unreadable\n`,
      `${nonce} ready\n\n${nonce} reward 9\n0.5\n`,
      // Sizes count bytes: "é" is 2 (what a decoding with replacement changed no longer matches).
      `${nonce} ready\n\n${nonce} reward 1\né`,
    ]) {
      expect(parseRunReport(raw, nonce).report).toEqual({ kind: "read", json: false });
    }
    for (const raw of [
      `${nonce} ready\n\n${nonce} unreadable json\n`,
      `${nonce} ready\n\n${nonce} reward 9 json\n{}`,
    ]) {
      expect(parseRunReport(raw, nonce).report).toEqual({ kind: "read", json: true });
    }
    expect(parseRunReport(`${nonce} ready\n\n${nonce} reward 2\né`, nonce).report).toEqual({
      kind: "reward",
      text: "é",
      json: false,
    });
    expect(parseRunReport(`${nonce} ready\n\n${nonce} none\n`, "x".repeat(32)).ready).toBe(false);
  });

  it("not ready without the first line; a prepare report says why", () => {
    expect(parseRunReport(`\n${nonce} prepare cannot clear it\n`, nonce)).toEqual({
      stderr: "",
      ready: false,
      report: { kind: "prepare", reason: "cannot clear it" },
    });
    // A line before it (a shell warning) is the tests' stderr; the ready line must start a line.
    expect(parseRunReport(`oops\n${nonce} ready\n\n${nonce} none\n`, nonce)).toEqual({
      stderr: "oops\n",
      ready: true,
      report: { kind: "none" },
    });
    expect(parseRunReport(`oops ${nonce} ready\n`, nonce).ready).toBe(false);
  });
});

describe("match verifier", () => {
  const matchTask = (expected: string, mode: "exact" | "regex"): TaskContentInput => ({
    id: "m",
    instruction: "Answer.",
    image: "i",
    verifier: { kind: "match", expected, mode },
  });

  async function grade(expected: string, mode: "exact" | "regex", answer: string | null): Promise<number> {
    const verdict = await verify(ctx({ run: { answer, exec: AGENT_EXEC } }, matchTask(expected, mode)));
    return verdict.reward;
  }

  it("exact: an expected answer near the limit is measured as compared (a CRLF is one character), and graded", async () => {
    const crlf = "a\r\n".repeat(1400);
    expect(TaskContent.safeParse(matchTask(crlf, "exact")).success).toBe(true);
    expect(await grade(crlf, "exact", crlf)).toBe(1);
  });

  it("exact: trimmed equality", async () => {
    expect(await grade("4217", "exact", "4217")).toBe(1);
    expect(await grade("4217", "exact", "  4217\n")).toBe(1);
    expect(await grade(" 4217 ", "exact", "4217")).toBe(1);
    expect(await grade("4217", "exact", "4218")).toBe(0);
    expect(await grade("4217", "exact", "the answer is 4217")).toBe(0);
  });

  it("exact and regex compare text, not its encoding: NFC, LF line ends, zero-width characters at the ends", async () => {
    const nfc = "caf\u00e9";
    const nfd = "cafe\u0301";
    expect(await grade(nfc, "exact", nfd)).toBe(1);
    expect(await grade(nfd, "exact", nfc)).toBe(1);
    expect(await grade("line one\nline two", "exact", "line one\r\nline two\r\n")).toBe(1);
    expect(await grade("4217", "exact", "4217\u200b")).toBe(1);
    expect(await grade("caf\u00e9", "regex", nfd)).toBe(1);
    // Still text: other letters, or a zero-width character inside, are another answer.
    expect(await grade("4217", "exact", "42\u200b17")).toBe(0);
    expect(await grade(nfc, "exact", "cafe")).toBe(0);
  });

  it("regex: the whole trimmed answer must match", async () => {
    expect(await grade("v?2\\.10\\.0", "regex", "2.10.0")).toBe(1);
    expect(await grade("v?2\\.10\\.0", "regex", "v2.10.0\n")).toBe(1);
    expect(await grade("v?2\\.10\\.0", "regex", "2.10.0 is the highest")).toBe(0);
    expect(await grade("v?2\\.10\\.0", "regex", "2x10y0")).toBe(0);
    // Alternation is anchored as a whole, not just its first and last branch.
    expect(await grade("a|b", "regex", "ab")).toBe(0);
    expect(await grade("a|b", "regex", "b")).toBe(1);
    // A pattern that backtracks catastrophically on the agent's answer: the match goes on in the
    // linear-time engine and finishes, with the right answer, even when a later alternative matches.
    expect(await grade("(a+)+b", "regex", "a".repeat(40))).toBe(0);
    expect(await grade("(a+)+b|a+c", "regex", `${"a".repeat(40)}c`)).toBe(1);
    // A pattern from a TOML multi-line string ends in a newline: trimmed like the answer.
    expect(await grade("v?2\\.10\\.0\n", "regex", "2.10.0")).toBe(1);
  });

  it("regex: a pattern only the backtracking engine runs (a backreference) that runs out of its time on the answer → 0, and details say so", async () => {
    const verdict = await verify(
      ctx({ run: { answer: "a".repeat(30), exec: AGENT_EXEC } }, matchTask("(a*)*\\1b", "regex")),
    );
    expect(verdict).toEqual({
      reward: 0,
      details: expect.objectContaining({ kind: "match", matched: false, regexTimedOut: true }),
    });
  });

  it("an answer kept cut (longer than MAX_ANSWER_CHARS) → 0 whatever its kept part matches, and details say so", async () => {
    // What the harness keeps of a long answer: its head, cut; the whole matched in neither case.
    const long = keptAnswer(`${"step\n".repeat(1000)}ANSWER: 42`);
    const noBang = keptAnswer(`${"a".repeat(5000)}!`);
    expect([long.truncated, noBang.truncated]).toEqual([true, true]);
    const gradeKept = (expected: string, kept: { answer: string; truncated: boolean }) =>
      verify(
        ctx(
          { run: { answer: kept.answer, answerTruncated: kept.truncated, exec: AGENT_EXEC } },
          matchTask(expected, "regex"),
        ),
      );
    // The head alone matches a pattern the whole fails, and fails one the whole meets.
    expect(await grade("[^!]+", "regex", noBang.answer)).toBe(1);
    expect(await gradeKept("[^!]+", noBang)).toEqual({
      reward: 0,
      details: expect.objectContaining({ matched: false, answerTruncated: true }),
    });
    expect(await grade("[\\s\\S]*ANSWER: 42", "regex", `${"step\n".repeat(1000)}ANSWER: 42`)).toBe(1);
    expect((await gradeKept("[\\s\\S]*ANSWER: 42", long)).reward).toBe(0);
    // Kept whole (at the limit, once compared: NFC, trimmed), it is graded.
    const nfd = keptAnswer(` ${"e\u0301".repeat(MAX_ANSWER_CHARS)}\u200b\n`);
    expect(nfd).toEqual({ answer: "\u00e9".repeat(MAX_ANSWER_CHARS), truncated: false });
    expect((await gradeKept("\u00e9+", nfd)).reward).toBe(1);
  });

  it("no answer → 0, and details say why", async () => {
    const verdict = await verify(
      ctx(
        { run: { answer: null, exec: { ...AGENT_EXEC, exitCode: -1, timedOut: true } } },
        matchTask("1", "exact"),
      ),
    );
    expect(verdict).toEqual({
      reward: 0,
      details: expect.objectContaining({
        kind: "match",
        matched: false,
        answer: null,
        agentExitCode: -1,
        agentTimedOut: true,
      }),
    });
  });

  it("never touches the sandbox", async () => {
    await grade("x", "exact", "x");
    expect(provider.execCalls).toHaveLength(0);
    expect(log).toEqual([]);
  });

  it.each([
    ["(", "regex"],
    // Valid as written; trimmed, as graded, it ends in a lone backslash.
    ["2\\.10\\.0\\ ", "regex"],
    ["", "exact"],
    [" \n", "exact"],
    ["\\d*", "regex"],
    // Longer, once compared (NFC), than any kept answer: U+FB2C is three code points in NFC.
    ["\ufb2c".repeat(2000), "exact"],
    // Never matched: answers are compared in NFC with LF line ends.
    ["cafe\u0301", "regex"],
    ["a\r\nb", "regex"],
  ] as const)(
    "expected %j (%s) cannot grade: invalid_task, never 1.0 for an empty answer; the schema refuses it too",
    async (expected, mode) => {
      // As a stored task parsed under an older, looser schema would reach the grader.
      const spec = { kind: "match", expected, mode } as const;
      const err = await failure(
        Promise.resolve().then(() => matchAnswer(spec, { answer: "", exec: AGENT_EXEC })),
      );
      expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
      expect(TaskContent.safeParse(matchTask(expected, mode)).success).toBe(false);
    },
  );
});

describe("parseRewardJson", () => {
  it("takes the reward and the other finite numbers (not booleans)", () => {
    expect(parseRewardJson('{"reward": 1.0000000000000002, "f1": 0.5, "ok": true, "n": null}')).toEqual({
      reward: 1,
      fields: { f1: 0.5 },
    });
  });

  it("keeps the fields within MAX_REWARD_FIELDS_BYTES as JSON: names of control characters (six bytes each) took a result past its record cap", () => {
    const name = (i: number) => `k${String(i).padStart(2, "0")}${"\\u0001".repeat(200)}`;
    const text = `{"reward": 0.5, ${Array.from({ length: 40 }, (_, i) => `"${name(i)}": 0`).join(", ")}}`;
    const { reward, fields } = parseRewardJson(text);
    expect(reward).toBe(0.5);
    expect(Object.keys(fields).length).toBeGreaterThan(0);
    expect(Buffer.byteLength(JSON.stringify(fields))).toBeLessThanOrEqual(MAX_REWARD_FIELDS_BYTES);
    // Plain names are all kept, as before.
    const plain = parseRewardJson(
      `{"reward": 1, ${Array.from({ length: 32 }, (_, i) => `"f${i}": ${i}`).join(", ")}}`,
    );
    expect(Object.keys(plain.fields)).toHaveLength(32);
  });

  it("takes a reward.json that starts with a byte order mark (Python's utf-8-sig), as parseReward takes a reward.txt", () => {
    expect(parseRewardJson('\ufeff{"reward": 0.5, "f1": 1}')).toEqual({ reward: 0.5, fields: { f1: 1 } });
    expect(parseReward("\ufeff0.5\n")).toBe(0.5);
    // Only one, first: anywhere else it is no JSON.
    expect(() => parseRewardJson('{"reward": \ufeff0.5}')).toThrow(/it is not JSON/);
  });

  it("names a reward that is not finite as it reads, not as null", () => {
    expect(() => parseRewardJson('{"reward": 1e309}')).toThrow(/its "reward" is Infinity/);
  });

  it.each(["", "{", "null", "[]", '{"reward": null}', '{"reward": -0.5}', '{"Reward": 1}'])(
    "%j is no reward (masked verifier_error)",
    (text) => {
      expect(() => parseRewardJson(text)).toThrow(
        /reward\.json must be a JSON object with a "reward" number in \[0, 1\]/,
      );
    },
  );
});

describe("parseReward", () => {
  it.each([
    ["1", 1],
    ["0", 0],
    [" 0.75\n", 0.75],
    [".5", 0.5],
    ["1e-1", 0.1],
    ["1.0", 1],
    ["-0", 0],
    // A sum of float weights, a hair past a bound: that bound, not a mask.
    ["1.0000000000000002", 1],
    ["-1e-12", 0],
    ["0.30000000000000004", 0.30000000000000004],
  ])("%j → %d", (text, value) => {
    expect(parseReward(text)).toBe(value);
  });

  it.each(["1.000001", "-0.001", "2", "NaN", "0x1", ""])(
    "%j is no reward (masked verifier_error)",
    (text) => {
      expect(() => parseReward(text)).toThrow(/number in \[0, 1\]/);
    },
  );
});
