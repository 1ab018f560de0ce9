import {
  AgentSpec,
  type AgentSpecInput,
  FleetError,
  isFleetError,
  type SandboxHandle,
  TaskContent,
} from "@fleet/contracts";
import { AGENT_USER, ROOT_USER } from "@fleet/sandbox";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { beforeEach, describe, expect, it } from "vitest";
import { createHarness } from "./create-harness.ts";
import { agentDeadline } from "./deadline.ts";
import type { HarnessContext } from "./harness.ts";
import { stageWorkspace } from "./stage-workspace.ts";

const TASK = TaskContent.parse({
  id: "t1",
  instruction: "Print the answer.",
  image: "rollout-fleet/base:latest",
  workspace: { "data/in.txt": "1\n" },
  solution: { "solve.sh": "echo 42\n", "helper.py": "print(1)\n" },
  tests: { "test.sh": "exit 0\n" },
});

let provider: InMemorySandboxProvider;
let handle: SandboxHandle;

beforeEach(async () => {
  provider = new InMemorySandboxProvider();
  handle = await provider.create({
    image: TASK.image,
    rolloutId: "r1",
    owner: "resources",
    expiresAt: Date.now() + 60_000,
  });
});

function ctx(agent: AgentSpecInput, overrides: Partial<HarnessContext> = {}): HarnessContext {
  return {
    provider,
    handle,
    task: TASK,
    agent: AgentSpec.parse(agent),
    deadlineMs: Date.now() + 30_000,
    signal: new AbortController().signal,
    ...overrides,
  };
}

async function rejection(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    () => {
      throw new Error("expected a rejection");
    },
    (err: unknown) => err,
  );
}

describe("OracleHarness", () => {
  it("stages the solution and the instruction, runs solve.sh as the agent in /workspace", async () => {
    provider.onExec = () => ({ stdout: "  42\n" });
    const spec = { harness: "oracle" } as const;
    const outcome = await createHarness(AgentSpec.parse(spec)).run(ctx(spec));

    const box = provider.sandbox(handle);
    expect(box.files.get("/solution/solve.sh")).toEqual({ content: "echo 42\n", user: ROOT_USER });
    expect(box.files.get("/solution/helper.py")?.content).toBe("print(1)\n");
    expect(box.files.get("/tmp/fleet/instruction.md")).toEqual({
      content: "Print the answer.",
      user: AGENT_USER,
    });

    expect(provider.execCalls).toHaveLength(1);
    const call = provider.execCalls[0]!;
    expect(call.argv).toEqual(["bash", "/solution/solve.sh"]);
    expect(call.options).toMatchObject({
      cwd: "/workspace",
      user: AGENT_USER,
      env: { FLEET_INSTRUCTION_FILE: "/tmp/fleet/instruction.md" },
    });
    expect(call.options.deadlineMs).toBeGreaterThan(25_000);
    expect(call.options.deadlineMs).toBeLessThanOrEqual(30_000);

    expect(outcome).toEqual({
      exec: expect.objectContaining({ exitCode: 0, timedOut: false, stdout: "  42\n" }),
      answer: "42",
      transcript: null,
      usage: null,
    });
  });

  it("refuses a task without solve.sh as invalid_task, before touching the sandbox", async () => {
    const spec = { harness: "oracle" } as const;
    const err = await rejection(
      createHarness(AgentSpec.parse(spec)).run(ctx(spec, { task: { ...TASK, solution: {} } })),
    );
    expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["invalid_task", false]);
    expect(provider.execCalls).toHaveLength(0);
    expect(provider.putCalls).toHaveLength(0);
  });
});

describe("CommandHarness", () => {
  const spec: AgentSpecInput = {
    harness: "command",
    argv: ["my-agent", "--fast"],
    env: { MODE: "agent", SHARED: "from-agent", FLEET_INSTRUCTION_FILE: "/elsewhere" },
  };

  it("runs argv with the instruction file named in the environment; ctx.env wins over agent env", async () => {
    provider.onExec = () => ({ stdout: "done\n", exitCode: 3 });
    const outcome = await createHarness(AgentSpec.parse(spec)).run(
      ctx(spec, { env: { SHARED: "from-worker", GATEWAY: "http://gw" } }),
    );
    const call = provider.execCalls[0]!;
    expect(call.argv).toEqual(["my-agent", "--fast"]);
    expect(call.options).toMatchObject({ cwd: "/workspace", user: AGENT_USER });
    expect(call.options.env).toEqual({
      MODE: "agent",
      SHARED: "from-worker",
      GATEWAY: "http://gw",
      FLEET_INSTRUCTION_FILE: "/tmp/fleet/instruction.md",
    });
    expect(provider.sandbox(handle).files.get("/tmp/fleet/instruction.md")?.content).toBe(
      "Print the answer.",
    );
    // The solution is never staged for a non-oracle agent.
    expect([...provider.sandbox(handle).files.keys()].some((p) => p.startsWith("/solution"))).toBe(false);
    expect(outcome.exec.exitCode).toBe(3);
    expect(outcome.answer).toBe("done");
    expect(outcome.usage).toBeNull();
  });

  it("caps the answer and keeps bounded tails of stdout/stderr", async () => {
    provider.onExec = () => ({ stdout: `${"a".repeat(10_000)}END`, stderr: `${"e".repeat(9000)}LAST` });
    const outcome = await createHarness(AgentSpec.parse(spec)).run(ctx(spec));
    expect(outcome.answer?.length).toBe(4000);
    expect(outcome.answer?.endsWith("…[truncated]")).toBe(true);
    expect(outcome.answerTruncated).toBe(true);
    expect(outcome.exec.stdout.length).toBe(4000);
    expect(outcome.exec.stdout.endsWith("END")).toBe(true);
    expect(outcome.exec.stderr.endsWith("LAST")).toBe(true);
    expect(outcome.exec.stdoutTruncated).toBe(true);
    expect(outcome.exec.stderrTruncated).toBe(true);
  });

  it("keeps the answer as compared (NFC, LF line ends, trimmed) before cutting it: one whole once compared is not cut", async () => {
    provider.onExec = () => ({ stdout: `\r\n${"e\u0301\r\n".repeat(1900)}\u200b\n` });
    const outcome = await createHarness(AgentSpec.parse(spec)).run(ctx(spec));
    expect(outcome.answer).toBe("\u00e9\n".repeat(1900).trimEnd());
    expect(outcome.answerTruncated).toBeUndefined();
  });

  it("an answer the sandbox already cut (its output past the exec's cap: head and tail kept) is cut, however short what is left", async () => {
    provider.onExec = () => ({ stdout: "head\n[… 9872 bytes cut …]\nANSWER: 42\n", stdoutTruncated: true });
    const outcome = await createHarness(AgentSpec.parse(spec)).run(ctx(spec));
    expect(outcome.answerTruncated).toBe(true);
  });

  it("passes the provider's timeout envelope through (exit -1, partial output kept)", async () => {
    provider.onExec = () => ({ exitCode: -1, timedOut: true, stdout: "partial" });
    const outcome = await createHarness(AgentSpec.parse(spec)).run(ctx(spec));
    expect(outcome.exec).toMatchObject({ exitCode: -1, timedOut: true });
    expect(outcome.answer).toBe("partial");
  });

  it("takes the agent's deadline from agentStarts once its setup is done (its instruction written), not from the run's start", async () => {
    let putsBefore = -1;
    const run = createHarness(AgentSpec.parse(spec)).run(
      ctx(spec, {
        deadlineMs: Date.now() + 1_000,
        agentStarts: () => {
          putsBefore = provider.putCalls.length;
          return Date.now() + 60_000;
        },
      }),
    );
    await run;
    expect(putsBefore).toBe(1); // the instruction file, before
    expect(provider.execCalls[0]!.options.deadlineMs).toBeGreaterThan(55_000);
  });

  it("does not start a command whose time went on preparing its sandbox: masked (provider_unavailable, retryable), never a graded timeout", async () => {
    const run = createHarness(AgentSpec.parse(spec)).run(ctx(spec, { deadlineMs: Date.now() - 1 }));
    await expect(run).rejects.toMatchObject({ kind: "provider_unavailable", retryable: true });
    await expect(run).rejects.toThrow(/nothing of the agent ran/);
    expect(provider.execCalls).toHaveLength(0);
  });

  it("lets a provider FleetError propagate unchanged (the caller maps it to exit -2)", async () => {
    const lost = new FleetError("sandbox_lost", "container vanished");
    provider.onExec = () => {
      throw lost;
    };
    expect(await rejection(createHarness(AgentSpec.parse(spec)).run(ctx(spec)))).toBe(lost);
  });

  it("turns any other provider failure into provider_unavailable, keeping the cause", async () => {
    const boom = new Error("socket hang up");
    provider.onExec = () => {
      throw boom;
    };
    const err = await rejection(createHarness(AgentSpec.parse(spec)).run(ctx(spec)));
    expect(isFleetError(err) && err.kind).toBe("provider_unavailable");
    expect((err as Error).cause).toBe(boom);
  });

  it("stops waiting when aborted, with the abort reason", async () => {
    let started!: () => void;
    const running = new Promise<void>((resolve) => {
      started = resolve;
    });
    provider.onExec = () => {
      started();
      return new Promise(() => {}); // never finishes: a stuck agent
    };
    const controller = new AbortController();
    const result = rejection(
      createHarness(AgentSpec.parse(spec)).run(ctx(spec, { signal: controller.signal })),
    );
    await running;
    const reason = new FleetError("deadline_exceeded", "rollout deadline");
    controller.abort(reason);
    expect(await result).toBe(reason);
  });

  it("maps a plain abort to cancelled and does nothing when already aborted", async () => {
    const controller = new AbortController();
    controller.abort();
    const err = await rejection(
      createHarness(AgentSpec.parse(spec)).run(ctx(spec, { signal: controller.signal })),
    );
    expect(isFleetError(err) && err.kind).toBe("cancelled");
    expect(provider.putCalls).toHaveLength(0);
    expect(provider.execCalls).toHaveLength(0);
  });
});

describe("createHarness", () => {
  it("maps each harness name", () => {
    expect(createHarness(AgentSpec.parse({ harness: "oracle" })).name).toBe("oracle");
    expect(createHarness(AgentSpec.parse({ harness: "command", argv: ["x"] })).name).toBe("command");
  });

  it("maps tool-loop to the ToolLoopHarness", () => {
    const agent = AgentSpec.parse({
      harness: "tool-loop",
      model: { baseUrl: "http://m.local/v1", name: "m" },
    });
    expect(createHarness(agent).name).toBe("tool-loop");
  });

  it("maps a command agent with a model to the CommandHarness (the run stage adds the gateway env)", () => {
    const agent = AgentSpec.parse({
      harness: "command",
      argv: ["x"],
      model: { name: "m", baseUrl: "http://m.local/v1", credential: "KEY" },
    });
    expect(createHarness(agent).name).toBe("command");
  });
});

describe("agentDeadline", () => {
  const oracle = AgentSpec.parse({ harness: "oracle" });

  it("uses the task's agent budget, or the agent's override", () => {
    expect(agentDeadline({ task: TASK, agent: oracle, startedAt: 1000 })).toEqual({
      deadlineMs: 1000 + 120_000,
      limitedBy: "agent",
    });
    const quick = AgentSpec.parse({ harness: "oracle", timeoutS: 5 });
    expect(agentDeadline({ task: TASK, agent: quick, startedAt: 1000 }).deadlineMs).toBe(6000);
  });

  it("never runs past the rollout's deadline", () => {
    expect(agentDeadline({ task: TASK, agent: oracle, startedAt: 1000, rolloutDeadlineMs: 50_000 })).toEqual({
      deadlineMs: 50_000,
      limitedBy: "rollout",
    });
  });
});

describe("stageWorkspace", () => {
  it("puts the task's workspace files into /workspace as the agent user", async () => {
    await stageWorkspace(provider, handle, TASK);
    expect(provider.sandbox(handle).files.get("/workspace/data/in.txt")).toEqual({
      content: "1\n",
      user: AGENT_USER,
    });
  });

  it("does nothing for an empty workspace", async () => {
    await stageWorkspace(provider, handle, { ...TASK, workspace: {} });
    expect(provider.putCalls).toHaveLength(0);
  });
});
