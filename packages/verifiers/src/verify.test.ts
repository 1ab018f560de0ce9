import {
  classifyFailure,
  type ExecResult,
  FleetError,
  isFleetError,
  type SandboxHandle,
  TaskContent,
  type TaskContentInput,
} from "@fleet/contracts";
import { ROOT_USER } from "@fleet/sandbox";
import { type ExecCall, execResult, type FakeSandbox, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { parseReward } from "./reward-file.ts";
import type { VerifyContext } from "./verdict.ts";
import { REWARD_FILE, verify } from "./verify.ts";

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
/** What happened, in order: "prepare", "put /tests", "tests", "get". */
let log: string[];

type TestsOutcome = Partial<ExecResult> & { reward?: string };

/** Script the sandbox: the prepare step clears /tests and /logs/verifier; test.sh does `outcome`. */
function script(outcome: (call: ExecCall, box: FakeSandbox) => TestsOutcome | Promise<TestsOutcome>): void {
  provider.onExec = async (call, box) => {
    if (call.argv[1] === "-c") {
      log.push("prepare");
      for (const path of [...box.files.keys()]) {
        if (path.startsWith("/tests/") || path.startsWith("/logs/verifier/")) box.files.delete(path);
      }
      return { exitCode: 0 };
    }
    log.push("tests");
    const { reward, ...result } = await outcome(call, box);
    if (reward !== undefined) box.files.set(REWARD_FILE, { content: reward, user: ROOT_USER });
    return result;
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
  it("prepares, stages the tests as root, runs test.sh as root in /workspace: exit 0 → 1.0", async () => {
    script(() => ({ exitCode: 0, stdout: "ok\n" }));
    const verdict = await verify(ctx());
    expect(verdict.reward).toBe(1);
    expect(verdict.details).toMatchObject({
      kind: "tests",
      source: "exit_code",
      exitCode: 0,
      stdoutTail: "ok\n",
    });
    expect(log).toEqual(["prepare", "put /tests", "tests", "get"]);

    const [prepare, tests] = provider.execCalls;
    expect(prepare?.options.user).toBe(ROOT_USER);
    expect(tests?.argv).toEqual(["bash", "/tests/test.sh"]);
    expect(tests?.options).toMatchObject({ cwd: "/workspace", user: ROOT_USER });
    expect(tests?.options.deadlineMs).toBeLessThanOrEqual(20_000);
    expect(tests?.options.deadlineMs).toBeGreaterThan(15_000);
    expect(provider.putCalls).toEqual([{ dir: "/tests", files: TESTS_TASK.tests, user: ROOT_USER }]);
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

  it("the reward file wins over the exit status", async () => {
    script(() => ({ exitCode: 1, reward: "0.75\n" }));
    const partial = await verify(ctx());
    expect(partial.reward).toBe(0.75);
    expect(partial.details).toMatchObject({ source: "reward_file", rewardText: "0.75", exitCode: 1 });

    script(() => ({ exitCode: 0, reward: "0" }));
    expect((await verify(ctx())).reward).toBe(0);
  });

  it("a reward file left before verification does not count", async () => {
    provider.sandbox(handle).files.set(REWARD_FILE, { content: "1", user: "1000:1000" });
    script(() => ({ exitCode: 1 }));
    const verdict = await verify(ctx());
    expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
  });

  it("refuses to grade when /tests or /logs/verifier cannot be cleared (masked)", async () => {
    provider.onExec = (call) =>
      call.argv[1] === "-c"
        ? { exitCode: 3, stderr: "cannot clear /tests, left: conftest.py" }
        : { exitCode: 0 };
    const err = await failure(verify(ctx()));
    expect(err.kind).toBe("verifier_error");
    expect(err.message).toContain("conftest.py");
    expect(provider.execCalls).toHaveLength(1);
  });

  it.each(["abc", "1.5", "-0.1", "NaN", "inf", "", "0x1", "1/2"])(
    "a bad reward file (%j) → verifier_error, never 0",
    async (text) => {
      script(() => ({ exitCode: 0, reward: text }));
      const err = await failure(verify(ctx()));
      expect(err.kind).toBe("verifier_error");
      expect(classifyFailure(err.kind).outcome).toBe("mask");
      expect(err.retryable).toBe(false);
    },
  );

  it("tests that time out → verifier_error, never 0", async () => {
    script(() => ({ exitCode: -1, timedOut: true, reward: "0.5" }));
    const err = await failure(verify(ctx()));
    expect(err.kind).toBe("verifier_error");
    expect(err.message).toContain("did not finish within 20 s");
  });

  it("tests killed for memory → provider_oom_killed (masked)", async () => {
    script(() => ({ exitCode: 137, oomKilled: true }));
    expect((await failure(verify(ctx()))).kind).toBe("provider_oom_killed");
  });

  it("never runs past the rollout deadline", async () => {
    script(() => ({ exitCode: -1, timedOut: true }));
    const err = await failure(verify(ctx({ deadlineMs: Date.now() + 5000 })));
    expect(err.kind).toBe("deadline_exceeded");
    expect(provider.execCalls[1]?.options.deadlineMs).toBeLessThanOrEqual(5000);
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
    script(() => ({ exitCode: 0 }));
    provider.get = async () => {
      throw new FleetError("sandbox_lost", "gone");
    };
    expect((await failure(verify(ctx()))).kind).toBe("sandbox_lost");
  });

  it("a task without tests/test.sh is invalid_task", async () => {
    const err = await failure(verify(ctx({}, { ...TESTS_TASK, tests: {} })));
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

  it("exact: trimmed equality", async () => {
    expect(await grade("4217", "exact", "4217")).toBe(1);
    expect(await grade("4217", "exact", "  4217\n")).toBe(1);
    expect(await grade(" 4217 ", "exact", "4217")).toBe(1);
    expect(await grade("4217", "exact", "4218")).toBe(0);
    expect(await grade("4217", "exact", "the answer is 4217")).toBe(0);
  });

  it("regex: the whole trimmed answer must match", async () => {
    expect(await grade("v?2\\.10\\.0", "regex", "2.10.0")).toBe(1);
    expect(await grade("v?2\\.10\\.0", "regex", "v2.10.0\n")).toBe(1);
    expect(await grade("v?2\\.10\\.0", "regex", "2.10.0 is the highest")).toBe(0);
    expect(await grade("v?2\\.10\\.0", "regex", "2x10y0")).toBe(0);
    // Alternation is anchored as a whole, not just its first and last branch.
    expect(await grade("a|b", "regex", "ab")).toBe(0);
    expect(await grade("a|b", "regex", "b")).toBe(1);
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

  it("an invalid regex is invalid_task", async () => {
    const err = await failure(grade("(", "regex", "x"));
    expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
  });
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
  ])("%j → %d", (text, value) => {
    expect(parseReward(text)).toBe(value);
  });
});
