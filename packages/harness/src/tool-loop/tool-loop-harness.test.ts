import {
  AgentSpec,
  type AgentSpecInput,
  classifyFailure,
  type FleetError,
  isFleetError,
  type SandboxHandle,
  TaskContent,
  Usage,
  WellFormedText,
} from "@fleet/contracts";
import { guardedDispatcher, guardedLookup } from "@fleet/gateway";
import { chatReply, errorReply, type ScriptedUpstream, startScriptedUpstream } from "@fleet/gateway/testing";
import { AGENT_USER } from "@fleet/sandbox";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { agentDeadline } from "../deadline.ts";
import type { HarnessContext } from "../harness.ts";
import { formatToolResult } from "./bash-tool.ts";
import { callChatCompletion, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES } from "./chat-client.ts";
import { MAX_TOOL_CALLS_PER_TURN, refuseLinkLocalHost, ToolLoopHarness } from "./tool-loop-harness.ts";

// The loop against a scripted OpenAI-compatible upstream on 127.0.0.1 and an in-memory sandbox.
const CREDENTIAL = "sk-test-credential-0123456789abcdef";
const TASK = TaskContent.parse({
  id: "t1",
  instruction: "Write 42 into answer.txt and say done.",
  image: "rollout-fleet/base:latest",
  tests: { "test.sh": "exit 0" },
});
const FAST_RETRY = { baseMs: 20, maxMs: 100, random: () => 0.5 };

let provider: InMemorySandboxProvider;
let handle: SandboxHandle;
let upstream: ScriptedUpstream;

beforeEach(async () => {
  provider = new InMemorySandboxProvider((call) => ({ stdout: `ran: ${call.argv[2]}\n` }));
  handle = await provider.create({
    image: TASK.image,
    rolloutId: "r1",
    owner: "resources",
    expiresAt: Date.now() + 60_000,
  });
  upstream = await startScriptedUpstream();
});

afterEach(async () => {
  await upstream.close();
});

function agent(over: Partial<Extract<AgentSpecInput, { harness: "tool-loop" }>> = {}) {
  const spec = AgentSpec.parse({
    harness: "tool-loop",
    model: { baseUrl: upstream.baseUrl, name: "test-model", temperature: 0.2 },
    credential: "MODEL_KEY",
    ...over,
  });
  if (spec.harness !== "tool-loop") throw new Error("unreachable");
  return spec;
}

/**
 * An agent with no credential whose `model.baseUrl` the schema refuses now (a link-local host), as
 * a rollout admitted before it did was stored: the harness refuses to call it all the same.
 */
function storedWithBaseUrl(baseUrl: string) {
  const spec = agent({ credential: undefined });
  return { ...spec, model: { ...spec.model, baseUrl, name: "m" } };
}

function harness(
  a = agent(),
  resolve: (name: string, baseUrl: string) => Promise<string> = async (name) =>
    name === "MODEL_KEY" ? CREDENTIAL : "",
) {
  return new ToolLoopHarness(a, { resolveCredential: resolve }, { retry: FAST_RETRY });
}

function ctx(a = agent(), over: Partial<HarnessContext> = {}): HarnessContext {
  return {
    provider,
    handle,
    task: TASK,
    agent: a,
    deadlineMs: Date.now() + 30_000,
    signal: new AbortController().signal,
    ...over,
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

type Body = {
  messages: Array<{ role: string; content: string | null; tool_call_id?: string }>;
  max_tokens?: number;
};
const bodyOf = (i: number) => upstream.requests[i]!.body as Body;

describe("ToolLoopHarness", () => {
  it("runs bash tool calls in the sandbox, feeds results back, and ends on the final answer", async () => {
    upstream.push(
      chatReply({
        content: "Writing it.",
        bash: ["echo 42 > answer.txt"],
        usage: { prompt: 100, completion: 20, cached: 0 },
      }),
      chatReply({ content: "done", usage: { prompt: 150, completion: 5, cached: 64 } }),
    );
    const a = agent({ toolTimeoutS: 7 });
    const out = await harness(a).run(ctx(a, { env: { GATEWAY: "x" } }));

    expect(out.answer).toBe("done");
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false, stdout: "done", stderr: "" });
    expect(Usage.parse(out.usage)).toEqual({
      calls: 2,
      promptTokens: 250,
      completionTokens: 25,
      cachedTokens: 64,
      gaps: [],
    });

    const exec = provider.execCalls.find((c) => c.argv[0] === "bash")!;
    expect(exec.argv).toEqual(["bash", "-c", "echo 42 > answer.txt"]);
    expect(exec.options).toMatchObject({ user: AGENT_USER, cwd: "/workspace" });
    expect(exec.options.deadlineMs).toBeLessThanOrEqual(7000);
    expect(exec.options.env).toMatchObject({
      GATEWAY: "x",
      FLEET_INSTRUCTION_FILE: "/tmp/fleet/instruction.md",
    });

    // The request: model, tools, sampling; the second carries the tool result.
    expect(upstream.requests[0]!.headers.authorization).toBe(`Bearer ${CREDENTIAL}`);
    expect(upstream.requests[0]!.body).toMatchObject({
      model: "test-model",
      temperature: 0.2,
      stream: false,
    });
    const toolMsg = bodyOf(1).messages.find((m) => m.role === "tool")!;
    expect(toolMsg.content).toContain("exit_code: 0");
    expect(toolMsg.content).toContain("ran: echo 42 > answer.txt");

    // Transcript: JSON lines, ends with the stop event.
    const lines = out.transcript!.split("\n").map((l) => JSON.parse(l));
    expect(lines.map((l) => l.role ?? l.event)).toEqual(["user", "assistant", "tool", "assistant", "stop"]);
    expect(lines.at(-1)).toMatchObject({ event: "stop", reason: "answer" });
    expect(JSON.stringify(out)).not.toContain(CREDENTIAL);
  });

  it("retries a 429 after its Retry-After and a 503, then succeeds", async () => {
    upstream.push(
      errorReply(429, "rate_limit", "slow down", { "retry-after": "1" }),
      errorReply(503, "overloaded", "try later"),
      chatReply({ content: "ok" }),
    );
    const started = Date.now();
    const out = await harness().run(ctx());
    expect(Date.now() - started).toBeGreaterThanOrEqual(1000);
    expect(out.answer).toBe("ok");
    expect(upstream.requests).toHaveLength(3);
    expect(out.usage).toMatchObject({ calls: 1, promptTokens: 10, completionTokens: 5 });
    expect(out.usage!.gaps).toContain("2 failed upstream attempts not counted (usage unknown)");
    const retries = out
      .transcript!.split("\n")
      .map((l) => JSON.parse(l))
      .filter((l) => l.event === "retry");
    expect(retries.map((r) => r.status)).toEqual([429, 503]);
    expect(retries[0].waitMs).toBeGreaterThanOrEqual(1000);
  });

  it("throws final provider_unavailable when the upstream is down until the deadline", async () => {
    await upstream.close();
    const started = Date.now();
    const err = await rejection(harness().run(ctx(agent(), { deadlineMs: Date.now() + 1500 })));
    expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["provider_unavailable", false]);
    expect((err as Error).message).toMatch(/connection failed/);
    expect((err as Error).message).not.toContain(CREDENTIAL);
    expect(Date.now() - started).toBeLessThan(10_000); // at its deadline, not retrying on
  });

  it("a failure mid-episode carries what the episode's calls spent (a masked run still reports its cost)", async () => {
    upstream.push(
      chatReply({ content: "looking", bash: ["echo hi"], usage: { prompt: 12, completion: 4, cached: 2 } }),
    );
    upstream.push(
      errorReply(403, "key_revoked", "key revoked"),
      errorReply(403, "key_revoked", "key revoked"),
    );
    const err = await rejection(harness().run(ctx()));
    expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["provider_unavailable", false]);
    expect((err as FleetError).usage).toEqual({
      calls: 1,
      promptTokens: 12,
      completionTokens: 4,
      cachedTokens: 2,
      gaps: [expect.stringMatching(/^a one-token probe request after a 403 at model call 2/)],
    });
  });

  it("tool-call arguments nested too deep to write back are the model's bad arguments (the tool says so), not a crash that reruns the episode", async () => {
    const deep = `${"[".repeat(100_000)}${"]".repeat(100_000)}`;
    upstream.push(
      {
        rawBody: `{"choices":[{"index":0,"finish_reason":"tool_calls","message":{"role":"assistant","content":"deep","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":${deep}}}]}}],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`,
        headers: { "content-type": "application/json" },
      },
      chatReply({ content: "done" }),
    );
    const out = await harness().run(ctx());
    expect(out.answer).toBe("done");
    expect(provider.execCalls).toEqual([]);
    expect(bodyOf(1).messages.find((m) => m.role === "tool")!.content).toMatch(
      /arguments must be a JSON object/,
    );
  });

  it("an error of no kind mid-episode (a library's, a bug's) still carries what the episode's calls spent", async () => {
    upstream.push(
      chatReply({ content: "looking", bash: ["echo hi"], usage: { prompt: 12, completion: 4, cached: 0 } }),
    );
    // A provider answering what no provider should (its output not text): the harness's own code
    // trips on it, with a TypeError (the provider's own errors come as FleetErrors).
    provider.onExec = () => ({ stdout: Symbol("not text") as unknown as string });
    const err = await rejection(harness().run(ctx()));
    expect(err).toMatchObject({ name: "FleetError", kind: "provider_unavailable", retryable: true });
    expect((err as FleetError).cause).toBeInstanceOf(TypeError);
    expect((err as FleetError).usage).toMatchObject({ calls: 1, promptTokens: 12, completionTokens: 4 });
  });

  it("a conversation grown past MAX_REQUEST_BYTES (dozens of long tool calls a step) ends the episode as too long, graded, and is never sent", async () => {
    // Each answer: 64 commands of 100 KB (a 6.5 MB answer), all of which go back in the history.
    const long = Array.from({ length: MAX_TOOL_CALLS_PER_TURN }, (_, i) => `: ${i} ${"x".repeat(100_000)}`);
    for (let i = 0; i < 5; i++) upstream.push(chatReply({ content: `step ${i + 1}`, bash: long }));
    const out = await harness().run(ctx());
    const sent = upstream.requests.map((r) => Buffer.byteLength(JSON.stringify(r.body)));
    expect(sent.length).toBeGreaterThan(1);
    expect(sent.length).toBeLessThan(5);
    expect(Math.max(...sent)).toBeLessThanOrEqual(MAX_REQUEST_BYTES);
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.exec.stderr).toMatch(
      /tool-loop stopped \(context_length\): the conversation grew too long: the request is \d+ bytes, more than the 16777216/,
    );
    expect(out.answer).toBe(`step ${sent.length}`);
  }, 60_000);

  it("an endpoint down from the first call reports its failed attempts as a gap on the error", async () => {
    await upstream.close();
    const err = await rejection(harness().run(ctx(agent(), { deadlineMs: Date.now() + 1500 })));
    expect(isFleetError(err) && err.kind).toBe("provider_unavailable");
    expect((err as FleetError).usage).toMatchObject({
      calls: 0,
      gaps: [expect.stringMatching(/failed upstream attempt/)],
    });
    // Every attempt the reason counts is in the gap, the last one (no retry after it) too.
    const attempts = /\((\d+) attempts?; last/.exec((err as Error).message)?.[1];
    expect((err as FleetError).usage!.gaps).toEqual([
      `${attempts} failed upstream attempts not counted (usage unknown)`,
    ]);
  });

  it("never runs a tool call that carries the credential (an upstream echoing the Authorization header): the sandbox never gets it", async () => {
    upstream.push(
      chatReply({ bash: [`echo 'Bearer ${CREDENTIAL}' > /workspace/leak; rev /workspace/leak`] }),
      chatReply({ content: "done" }),
    );
    const out = await harness().run(ctx());
    expect(out.answer).toBe("done");
    expect(provider.execCalls.filter((c) => JSON.stringify(c).includes(CREDENTIAL))).toEqual([]);
    expect(bodyOf(1).messages.find((m) => m.role === "tool")!.content).toMatch(
      /not run: it contains the model endpoint's credential/,
    );
  });

  it("records a gap, never a zero, when a response has no usage", async () => {
    upstream.push(
      chatReply({ bash: ["true"], usage: { prompt: 10, completion: 5, cached: 0 } }),
      chatReply({ content: "x", usage: null }),
    );
    const out = await harness().run(ctx());
    expect(out.usage).toEqual({
      calls: 2,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      gaps: ["usage missing on call 2"],
    });
  });

  it("ends the episode normally when the model's context is exceeded", async () => {
    upstream.push(
      chatReply({ content: "Looking around.", bash: ["ls"] }),
      errorReply(400, "context_length_exceeded", "This model's maximum context length is 4096 tokens."),
    );
    const out = await harness().run(ctx());
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.exec.stderr).toMatch(/context_length/);
    expect(out.answer).toBe("Looking around.");
    expect(out.usage?.calls).toBe(1);
  });

  it("also recognises a context-length error by its message alone; on the first call it is the spec's mismatch (agent_error), not graded", async () => {
    upstream.push(errorReply(400, "bad_request", "prompt exceeds the maximum context length of 2048"));
    const err = await harness()
      .run(ctx())
      .catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: "agent_error", retryable: false });
    expect((err as Error).message).toMatch(
      /cannot take the episode's first request: .*maximum context length/,
    );
  });

  it("stops after maxSteps steps, graded", async () => {
    upstream.push(
      chatReply({ bash: ["echo 1"] }),
      chatReply({ content: "still going", bash: ["echo 2"] }),
      chatReply({ content: "never" }),
    );
    const a = agent({ maxSteps: 2 });
    const out = await harness(a).run(ctx(a));
    expect(upstream.requests).toHaveLength(2);
    expect(provider.execCalls.filter((c) => c.argv[0] === "bash")).toHaveLength(2);
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.exec.stderr).toMatch(/max_steps/);
    expect(out.answer).toBe("still going");
  });

  it("calls a model with no credential only at the operator's endpoints when listed, and never a link-local host", async () => {
    const open = agent({ credential: undefined });
    const listed = (endpoints: string[]) =>
      new ToolLoopHarness(open, { modelEndpoints: endpoints }, { retry: FAST_RETRY });
    const refused = await rejection(listed(["http://127.0.0.1:9/v1"]).run(ctx(open)));
    expect(isFleetError(refused) && [refused.kind, refused.retryable]).toEqual(["agent_error", false]);
    expect((refused as Error).message).toMatch(
      /not one of this worker's model endpoints \(FLEET_MODEL_BASE_URLS\)/,
    );
    expect(upstream.requests).toHaveLength(0);
    upstream.push(chatReply({ content: "done" }));
    expect((await listed([`${upstream.baseUrl}/`]).run(ctx(open))).answer).toBe("done");
    // A cloud's metadata service, with or without a list.
    const metadata = storedWithBaseUrl("http://169.254.169.254/latest");
    const err = await rejection(new ToolLoopHarness(metadata, {}, { retry: FAST_RETRY }).run(ctx(metadata)));
    expect((err as Error).message).toMatch(/link-local/);
    expect(upstream.requests).toHaveLength(1);
  });

  it.each([
    "http://[::ffff:169.254.169.254]/v1",
    "http://[fe80::1]/v1",
    "http://[fd00:ec2::254]/latest",
    "http://100.100.100.200/latest",
    "http://192.0.0.192/opc/v2",
    "http://metadata.google.internal/computeMetadata/v1",
    "http://METADATA.GOOGLE.INTERNAL./v1",
  ])("never calls %s (a metadata service however written)", async (baseUrl) => {
    const a = storedWithBaseUrl(baseUrl);
    const err = await rejection(new ToolLoopHarness(a, {}, { retry: FAST_RETRY }).run(ctx(a)));
    expect([isFleetError(err) && err.kind, (err as Error).message]).toEqual([
      "agent_error",
      expect.stringMatching(/link-local/),
    ]);
  });

  it("refuses a host name that resolves to a link-local address; leaves other names, and addresses, alone", async () => {
    const resolvesTo = (address: string) => async () => [{ address }];
    await expect(
      refuseLinkLocalHost("http://169.254.169.254.nip.io/v1", resolvesTo("169.254.169.254")),
    ).rejects.toThrow(/resolves to a link-local address \(169\.254\.169\.254\); refused/);
    await expect(
      refuseLinkLocalHost("http://evil.example/v1", resolvesTo("::ffff:a9fe:a9fe")),
    ).rejects.toThrow(/link-local/);
    await expect(
      refuseLinkLocalHost("http://vllm.internal/v1", resolvesTo("10.0.0.7")),
    ).resolves.toBeUndefined();
    const unresolvable = async () => {
      throw new Error("ENOTFOUND");
    };
    await expect(refuseLinkLocalHost("http://nowhere.invalid/v1", unresolvable)).resolves.toBeUndefined();
    let asked = false;
    await expect(
      refuseLinkLocalHost("http://127.0.0.1:8000/v1", async () => {
        asked = true;
        return [];
      }),
    ).resolves.toBeUndefined();
    expect(asked).toBe(false);
  });

  it("sends no per-call limit without the model's own, however much the rollout's cap has left", async () => {
    upstream.push(chatReply({ content: "done", usage: { prompt: 10, completion: 5 } }));
    const a = agent({ maxTokens: 100_000 });
    await harness(a).run(ctx(a));
    expect(bodyOf(0)).not.toHaveProperty("max_tokens");
  });

  it("with a token cap and an endpoint that reports no usage, the cap cannot hold: masked, not graded", async () => {
    upstream.push(chatReply({ bash: ["true"], usage: null }), chatReply({ content: "never" }));
    const a = agent({ maxTokens: 1000 });
    const err = await harness(a)
      .run(ctx(a))
      .catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: "provider_unavailable", retryable: false });
    expect(upstream.requests).toHaveLength(1);
  });

  it("stops at the rollout's token cap and never asks for more completion tokens than are left", async () => {
    upstream.push(
      chatReply({ bash: ["echo 1"], usage: { prompt: 10, completion: 5 } }),
      chatReply({ bash: ["echo 2"], usage: { prompt: 12, completion: 5 } }),
      chatReply({ content: "never" }),
    );
    const a = agent({ maxTokens: 20, model: { baseUrl: upstream.baseUrl, name: "m", maxTokens: 100 } });
    const out = await harness(a).run(ctx(a));
    expect(bodyOf(0).max_tokens).toBe(20);
    expect(bodyOf(1).max_tokens).toBe(5);
    expect(upstream.requests).toHaveLength(2);
    expect(out.exec.stderr).toMatch(/token_cap/);
    expect(out.exec.exitCode).toBe(0);
  });

  it("ends with exit -1 (timedOut, graded) when the deadline comes during a later model call, and notes the abandoned call", async () => {
    upstream.push(chatReply({ bash: ["true"] }), { ...chatReply({ content: "too late" }), delayMs: 5000 });
    // (3 s: room for call 1 and its tool call on a loaded host; call 2 answers after 5 s.)
    const out = await harness().run(ctx(agent(), { deadlineMs: Date.now() + 3_000 }));
    expect(out.exec).toMatchObject({ exitCode: -1, timedOut: true });
    expect(out.answer).toBeNull();
    expect(out.usage!.gaps).toContain("model call 2 abandoned at the deadline (usage unknown)");
    // The endpoint may finish and bill it: the totals are unknown, not call 1's alone.
    expect(out.usage).toMatchObject({ calls: 1, promptTokens: null, completionTokens: null });
  });

  it("a first call the deadline cuts is the agent's timeout (graded): without streaming it cannot be told from a slow generation", async () => {
    upstream.push({ ...chatReply({ content: "too late" }), delayMs: 5000 });
    const out = await harness().run(ctx(agent(), { deadlineMs: Date.now() + 500 }));
    expect(out.exec).toMatchObject({ exitCode: -1, timedOut: true });
    expect(out.usage!.gaps).toContain("model call 1 abandoned at the deadline (usage unknown)");
  });

  it("counts the agent's deadline from agentStarts once the episode is prepared: a deadline of the run's start already past does not cut it", async () => {
    upstream.push(chatReply({ bash: ["true"] }), chatReply({ content: "done" }));
    let putsBefore = -1;
    const out = await harness().run(
      ctx(agent(), {
        deadlineMs: Date.now() - 1,
        agentStarts: () => {
          putsBefore = provider.putCalls.length;
          return Date.now() + 30_000;
        },
      }),
    );
    expect(putsBefore).toBe(1); // the instruction file, before
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.answer).toBe("done");
  });

  it("does not start an episode whose time went on preparing it (the instruction file's write): masked (provider_unavailable, retryable), never a graded timeout", async () => {
    upstream.push(chatReply({ content: "done" }));
    const a = agent();
    // The daemon is slow: writing the instruction file takes the agent's whole budget.
    const deadlineMs = Date.now() + 200;
    const put = provider.put.bind(provider);
    provider.put = async (...args: Parameters<typeof provider.put>) => {
      await vi.waitFor(() => expect(Date.now()).toBeGreaterThan(deadlineMs), { timeout: 5000, interval: 20 });
      return put(...args);
    };
    const err = await rejection(harness(a).run(ctx(a, { deadlineMs })));
    expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
    expect((err as Error).message).toMatch(/nothing of the agent ran/);
    expect(upstream.requests).toHaveLength(0);
    expect(provider.execCalls).toHaveLength(0);
  });

  it("sends a tool call whose arguments were cut off back in the history as {} (the tool result says why), not as it came", async () => {
    const cut = chatReply({ bash: ["true"] });
    const call = (
      cut.body as {
        choices: [{ message: { tool_calls: [{ function: { name: string; arguments: string } }] } }];
      }
    ).choices[0].message.tool_calls[0];
    call.function = { name: "", arguments: '{"command": "ech' };
    upstream.push(cut, chatReply({ content: "done" }));
    const out = await harness().run(ctx(agent()));
    expect(out.answer).toBe("done");
    const history = (
      upstream.requests[1]!.body as { messages: Array<{ role: string; tool_calls?: unknown[] }> }
    ).messages;
    const sent = history.find((m) => m.role === "assistant")!.tool_calls as Array<{ function: unknown }>;
    expect(sent[0]!.function).toEqual({ name: "unknown", arguments: "{}" });
  });

  it("runs at most MAX_TOOL_CALLS_PER_TURN calls of one answer, keeps only those in the history, and tells the model of the rest", async () => {
    upstream.push(
      chatReply({ bash: Array.from({ length: 70 }, (_, i) => `echo ${i}`) }),
      chatReply({ content: "done" }),
    );
    const out = await harness().run(ctx(agent()));
    expect(out.answer).toBe("done");
    expect(provider.execCalls.filter((c) => c.argv[0] === "bash")).toHaveLength(MAX_TOOL_CALLS_PER_TURN);
    const history = (
      upstream.requests[1]!.body as {
        messages: Array<{ role: string; tool_calls?: unknown[]; content: string }>;
      }
    ).messages;
    expect(history.find((m) => m.role === "assistant")!.tool_calls).toHaveLength(MAX_TOOL_CALLS_PER_TURN);
    const tools = history.filter((m) => m.role === "tool");
    expect(tools).toHaveLength(MAX_TOOL_CALLS_PER_TURN);
    expect(tools.at(-1)!.content).toMatch(/6 more tool call\(s\) in this answer were not run/);
  });

  it("keeps the history small whatever one answer holds: huge arguments as {}, names and ids capped", async () => {
    const huge = chatReply({ bash: ["true", "true"] });
    const calls = (
      huge.body as {
        choices: [
          { message: { tool_calls: Array<{ id: string; function: { name: string; arguments: string } }> } },
        ];
      }
    ).choices[0].message.tool_calls;
    calls[0]!.function.arguments = JSON.stringify({ command: `echo ${"x".repeat(512 * 1024)}` });
    calls[1]!.id = "i".repeat(1000);
    calls[1]!.function.name = "n".repeat(10_000);
    upstream.push(huge, chatReply({ content: "done" }));
    await harness().run(ctx(agent()));
    const history = (
      upstream.requests[1]!.body as {
        messages: Array<{ role: string; tool_calls?: unknown[]; content: string; tool_call_id?: string }>;
      }
    ).messages;
    const sent = history.find((m) => m.role === "assistant")!.tool_calls as Array<{
      id: string;
      function: { name: string; arguments: string };
    }>;
    expect(sent[0]!.function.arguments).toBe("{}");
    expect(sent[1]!.id).toBe("call_1_2");
    expect(sent[1]!.function.name).toHaveLength(256);
    const tools = history.filter((m) => m.role === "tool");
    expect(tools.map((t) => t.tool_call_id)).toEqual([sent[0]!.id, "call_1_2"]);
    expect(JSON.stringify(upstream.requests[1]!.body).length).toBeLessThan(64 * 1024);
  });

  it("caps a tool call's name in the history between characters: an emoji cut in half left a lone surrogate, which an endpoint given the history back may refuse", async () => {
    const reply = chatReply({ bash: ["true"] });
    const [call] = (
      reply.body as { choices: [{ message: { tool_calls: Array<{ function: { name: string } }> } }] }
    ).choices[0].message.tool_calls;
    // 401 UTF-16 units: cut at 256, the last one kept is the first half of an emoji.
    call!.function.name = `x${"😀".repeat(200)}`;
    upstream.push(reply, chatReply({ content: "done" }));
    await harness().run(ctx(agent()));
    const history = (
      upstream.requests[1]!.body as {
        messages: Array<{ role: string; tool_calls?: Array<{ function: { name: string } }> }>;
      }
    ).messages;
    const name = history.find((m) => m.role === "assistant")!.tool_calls![0]!.function.name;
    expect(name.length).toBeLessThanOrEqual(256);
    expect(name.startsWith("x😀")).toBe(true);
    expect(WellFormedText.safeParse(name).success).toBe(true);
  });

  it.each([
    ["400 about the conversation", 400, "bad_request", "invalid tool arguments"],
    [
      "403 about the conversation: a moderation refusal of what the policy wrote",
      403,
      "moderation",
      "Your input was flagged by our moderation",
    ],
  ] as const)(
    "a later call the endpoint refuses (%s) ends the episode graded, not failed or masked",
    async (_why, status, code, message) => {
      upstream.push(chatReply({ bash: ["true"], content: "working" }), errorReply(status, code, message));
      const out = await harness().run(ctx(agent()));
      expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
      expect(out.exec.stderr).toMatch(new RegExp(`stopped \\(refused\\).*HTTP ${status}: ${message}`));
    },
  );

  it("a later bare 403 (a proxy's Forbidden) is masked when the endpoint refuses a plain request too (the key)", async () => {
    upstream.push(
      chatReply({ bash: ["true"], content: "working" }),
      errorReply(403, "forbidden", "Forbidden"),
      errorReply(403, "forbidden", "Forbidden"),
    );
    const err = await rejection(harness().run(ctx()));
    expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["provider_unavailable", false]);
    // The probe: one short message, one token, the same key and model.
    expect(upstream.requests).toHaveLength(3);
    expect(bodyOf(2)).toMatchObject({ model: "test-model", max_tokens: 1 });
    expect(upstream.requests[2]!.headers.authorization).toBe(`Bearer ${CREDENTIAL}`);
  });

  it("a later bare 403 while the endpoint answers a plain request is the conversation's (a firewall's rule on what the policy wrote): graded", async () => {
    upstream.push(
      chatReply({ bash: ["echo '<script>x</script>'"], content: "working" }),
      errorReply(403, "forbidden", "Forbidden"),
      chatReply({ content: "OK" }),
    );
    const out = await harness().run(ctx());
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.exec.stderr).toMatch(/stopped \(refused\).*HTTP 403/);
  });

  it("a later 402 while the endpoint answers a plain request is the conversation's (a max_tokens the balance cannot cover): graded", async () => {
    upstream.push(
      chatReply({ content: "looking", bash: ["echo hi"] }),
      errorReply(402, "payment_required", "This request requires more credits, or fewer max_tokens"),
      chatReply({ content: "pong" }),
    );
    const out = await harness().run(ctx());
    expect(out.exec.stderr).toMatch(/stopped \(refused\).*HTTP 402/);
  });

  it("a later bare 403 whose probe gets a 4xx about itself (a model wanting max_completion_tokens) is the conversation's: graded", async () => {
    upstream.push(
      chatReply({ bash: ["true"], content: "working" }),
      errorReply(403, "forbidden", "Forbidden"),
      errorReply(400, "unsupported_parameter", "use max_completion_tokens"),
    );
    const out = await harness().run(ctx());
    expect(out.exec.stderr).toMatch(/stopped \(refused\).*HTTP 403/);
  });

  it("a later bare 403 whose probe the deadline cuts is the agent's timeout (graded), not a mask", async () => {
    upstream.push(
      chatReply({ bash: ["true"], content: "working" }),
      errorReply(403, "forbidden", "Forbidden"),
      { ...chatReply({ content: "OK" }), delayMs: 5_000 },
    );
    const out = await harness().run(ctx(agent(), { deadlineMs: Date.now() + 1_500 }));
    expect(out.exec).toMatchObject({ exitCode: -1, timedOut: true });
  });

  it("a proxy's gateway timeout (504) after a proxy's time, until the deadline, is the agent's timeout (graded): a long generation looks the same", async () => {
    for (let i = 0; i < 30; i++) upstream.push({ status: 504, rawBody: "<html>504 Gateway Time-out</html>" });
    // (Any answer counts as taking a proxy's time here.)
    const slow = new ToolLoopHarness(
      agent(),
      { resolveCredential: async () => CREDENTIAL },
      { retry: FAST_RETRY, gatewayTimeoutMinMs: 0 },
    );
    const out = await slow.run(ctx(agent(), { deadlineMs: Date.now() + 1_000 }));
    expect(out.exec).toMatchObject({ exitCode: -1, timedOut: true });
  });

  it("gateway timeouts (504) that come at once timed nothing out: the endpoint failing until the deadline is masked, never graded 0", async () => {
    for (let i = 0; i < 30; i++) upstream.push({ status: 504, rawBody: "<html>504 Gateway Time-out</html>" });
    const err = await harness()
      .run(ctx(agent(), { deadlineMs: Date.now() + 1_000 }))
      .catch((e: unknown) => e);
    expect(err).toMatchObject({ name: "FleetError", kind: "provider_unavailable", retryable: false });
    expect((err as Error).message).toMatch(/last: HTTP 504/);
  });

  it("retries a 200 whose first choice has no message (malformed), then goes on", async () => {
    upstream.push({ body: { choices: [{ text: "legacy completion" }] } }, chatReply({ content: "done" }));
    const out = await harness().run(ctx(agent()));
    expect(upstream.requests).toHaveLength(2);
    expect(out.answer).toBe("done");
  });

  it("one attempt that gets no answer within the attempt timeout is a failed attempt, retried within the deadline", async () => {
    upstream.push({ ...chatReply({ content: "slow" }), delayMs: 3000 }, chatReply({ content: "fast" }));
    const result = await callChatCompletion({
      url: `${upstream.baseUrl}/chat/completions`,
      apiKey: null,
      body: { model: "m", messages: [] },
      deadlineMs: Date.now() + 10_000,
      signal: new AbortController().signal,
      retry: FAST_RETRY,
      redact: (t) => t,
      // Under the slow answer's 3 s, and room for the retry's answer on a loaded host.
      attemptTimeoutMs: 1_000,
    });
    expect(result).toMatchObject({ kind: "ok", failedAttempts: 1 });
  });

  it("never connects to a model endpoint whose name resolves to a link-local address when called (DNS rebinding): the agent spec's error at once, not retried into a mask", async () => {
    const port = new URL(upstream.url).port;
    const dispatcher = guardedDispatcher(
      guardedLookup((_host, options, callback) =>
        options.all
          ? callback(null, [{ address: "169.254.169.254", family: 4 }])
          : callback(null, "169.254.169.254", 4),
      ),
    );
    upstream.push(chatReply({ content: "never" }));
    const retries: string[] = [];
    const err = await callChatCompletion({
      url: `http://model.test:${port}/v1/chat/completions`,
      apiKey: CREDENTIAL,
      body: { model: "m", messages: [] },
      deadlineMs: Date.now() + 10_000,
      signal: new AbortController().signal,
      retry: FAST_RETRY,
      redact: (t) => t,
      onRetry: ({ reason }) => retries.push(reason),
      dispatcher,
    }).catch((e: unknown) => e);
    await dispatcher.close();
    expect(isFleetError(err)).toBe(true);
    expect(err).toMatchObject({
      kind: "agent_error",
      retryable: false,
      message:
        "the model endpoint's host model.test resolves to a link-local address (169.254.169.254); refused",
    });
    expect(retries).toEqual([]);
    expect(upstream.requests).toHaveLength(0);
  });

  it("answers slower than the attempt timeout until the deadline are the agent's timeout (graded), not a mask: a long generation looks the same", async () => {
    const slow = () => {
      for (let i = 0; i < 10; i++) upstream.push({ ...chatReply({ content: "slow" }), delayMs: 3000 });
    };
    slow();
    const call = () =>
      callChatCompletion({
        url: `${upstream.baseUrl}/chat/completions`,
        apiKey: null,
        body: { model: "m", messages: [] },
        deadlineMs: Date.now() + 1_000,
        signal: new AbortController().signal,
        retry: FAST_RETRY,
        redact: (t) => t,
        attemptTimeoutMs: 300,
      });
    // Cut by the deadline mid-attempt, after an attempt that timed out...
    expect(await call()).toMatchObject({ kind: "deadline" });
    // ...and out of time for the retry's backoff: the same.
    slow();
    expect(
      await callChatCompletion({
        url: `${upstream.baseUrl}/chat/completions`,
        apiKey: null,
        body: { model: "m", messages: [] },
        deadlineMs: Date.now() + 400,
        signal: new AbortController().signal,
        retry: { ...FAST_RETRY, baseMs: 5_000, maxMs: 5_000 },
        redact: (t) => t,
        attemptTimeoutMs: 300,
      }),
    ).toMatchObject({ kind: "deadline" });
  });

  it("bounds a tool call by the time left and ends timed out when it was the deadline that stopped it", async () => {
    provider.onExec = async (call) => {
      await new Promise((r) => setTimeout(r, call.options.deadlineMs));
      return { exitCode: -1, timedOut: true };
    };
    upstream.push(chatReply({ bash: ["sleep 100"] }), chatReply({ content: "never" }));
    const a = agent({ toolTimeoutS: 60 });
    const out = await harness(a).run(ctx(a, { deadlineMs: Date.now() + 3_000 }));
    const exec = provider.execCalls.find((c) => c.argv[0] === "bash")!;
    expect(exec.options.deadlineMs).toBeLessThanOrEqual(3_000);
    expect(out.exec).toMatchObject({ exitCode: -1, timedOut: true });
    expect(upstream.requests).toHaveLength(1);
    // The episode ended with the tool call: no model call was started, so none was abandoned.
    expect(out.exec.stderr).toMatch(/deadline came during tool call/);
    expect(out.usage?.gaps.filter((g) => /abandoned/.test(g))).toEqual([]);
  });

  it("ends timed out when a tool call the deadline bounded timed out, even if the clock is a millisecond short of the deadline", async () => {
    // The exec reports its limit reached at once: the clock says time is left, the exec's limit
    // (the time left, under the tool's 60 s) says it is over.
    provider.onExec = (call) => (call.argv[0] === "bash" ? { exitCode: -1, timedOut: true } : {});
    upstream.push(chatReply({ bash: ["sleep 100"] }), chatReply({ content: "never" }));
    const a = agent({ toolTimeoutS: 60 });
    const out = await harness(a).run(ctx(a, { deadlineMs: Date.now() + 30_000 }));
    expect(upstream.requests).toHaveLength(1);
    expect(out.exec).toMatchObject({ exitCode: -1, timedOut: true });
    expect(out.exec.stderr).toMatch(/deadline came during tool call/);
  });

  it("gives a timed-out tool call back to the model when the agent still has time", async () => {
    provider.onExec = (call) => (call.argv[0] === "bash" ? { exitCode: -1, timedOut: true } : {});
    upstream.push(chatReply({ bash: ["sleep 100"] }), chatReply({ content: "gave up" }));
    const a = agent({ toolTimeoutS: 2 });
    const out = await harness(a).run(ctx(a));
    expect(bodyOf(1).messages.find((m) => m.role === "tool")!.content).toMatch(
      /killed: the command did not finish within 2 s/,
    );
    expect(out.answer).toBe("gave up");
  });

  it("answers an unknown tool or bad arguments with an error message to the model", async () => {
    upstream.push(
      {
        status: 200,
        body: {
          choices: [
            {
              message: {
                role: "assistant",
                content: null,
                tool_calls: [
                  { id: "a", type: "function", function: { name: "python", arguments: "{}" } },
                  { id: "b", type: "function", function: { name: "bash", arguments: "not json" } },
                  {
                    id: "c",
                    type: "function",
                    function: { name: "bash", arguments: JSON.stringify({ command: "echo a\0b" }) },
                  },
                  {
                    id: "d",
                    type: "function",
                    // Over Linux's 128 KiB per argument: the exec would fail before the command ran.
                    function: {
                      name: "bash",
                      arguments: JSON.stringify({ command: `echo ${"x".repeat(140_000)}` }),
                    },
                  },
                  {
                    id: "e",
                    type: "function",
                    // Megabytes: refused by their length, never parsed.
                    function: { name: "bash", arguments: `{"command": "${"y".repeat(2_000_000)}"}` },
                  },
                ],
              },
            },
          ],
          usage: { prompt_tokens: 1, completion_tokens: 1 },
        },
      },
      chatReply({ content: "ok" }),
    );
    await harness().run(ctx());
    const tools = bodyOf(1).messages.filter((m) => m.role === "tool");
    expect(tools.map((m) => m.tool_call_id)).toEqual(["a", "b", "c", "d", "e"]);
    expect(tools[0]!.content).toMatch(/unknown tool "python"/);
    expect(tools[1]!.content).toMatch(/must be a JSON object/);
    expect(tools[2]!.content).toMatch(/NUL byte/);
    expect(tools[3]!.content).toMatch(/over the 102400 a command line can hold/);
    expect(tools[4]!.content).toMatch(
      /arguments are 2000015 characters, more than a command of at most 102400 bytes needs/,
    );
    expect(provider.execCalls.filter((c) => c.argv[0] === "bash")).toHaveLength(0);
  });

  it("runs under a deadline of a fraction of a millisecond, as agentDeadline gives for a timeout of 8.0305 s: each attempt's and the probe's timeouts are whole milliseconds", async () => {
    const a = agent({ timeoutS: 8.0305 });
    const { deadlineMs } = agentDeadline({ task: TASK, agent: a, startedAt: Date.now() });
    expect(Number.isInteger(deadlineMs)).toBe(false);
    upstream.push(
      chatReply({ content: "working", bash: ["true"] }),
      // A bare 403 after an answered call: the key is probed (its timeout from the deadline too).
      errorReply(403, "forbidden", "Forbidden"),
      chatReply({ content: "OK" }),
    );
    const out = await harness(a).run(ctx(a, { deadlineMs }));
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.exec.stderr).toMatch(/stopped \(refused\).*HTTP 403/);
    expect(upstream.requests).toHaveLength(3);
  });

  it("reads an answer that starts with a UTF-8 byte order mark (as fetch's text() and the OpenAI SDKs do), not as an unreadable one retried until the deadline", async () => {
    // Some proxies (.NET, PHP) write one before the JSON.
    const bom = (reply: { body: unknown }) => ({
      status: 200,
      rawBody: `\ufeff${JSON.stringify(reply.body)}`,
    });
    upstream.push(
      bom(chatReply({ content: "working", bash: ["true"] })),
      bom(chatReply({ content: "done" })),
    );
    const out = await harness().run(ctx(agent(), { deadlineMs: Date.now() + 5_000 }));
    expect(out.answer).toBe("done");
    expect(upstream.requests).toHaveLength(2);
  });

  it("gives tool calls that share an id (in one answer, or an earlier answer's) ids of their own, each result after its call", async () => {
    const call = (id: string, command: string) => ({
      id,
      type: "function",
      function: { name: "bash", arguments: JSON.stringify({ command }) },
    });
    const answer = (calls: unknown[]) => ({
      status: 200,
      body: {
        choices: [
          { finish_reason: "tool_calls", message: { role: "assistant", content: null, tool_calls: calls } },
        ],
        usage: { prompt_tokens: 1, completion_tokens: 1, total_tokens: 2 },
      },
    });
    // Servers that number their calls per answer ("call_0", ...) repeat ids; "call_1_3" is the
    // name an id-less third call would get.
    upstream.push(
      answer([
        call("dup", "echo one"),
        call("dup", "echo two"),
        call("", "echo three"),
        call("call_1_3", "echo four"),
      ]),
      answer([call("dup", "echo five")]),
      chatReply({ content: "done" }),
    );
    const out = await harness().run(ctx());
    expect(out.answer).toBe("done");
    type Sent = { role: string; tool_calls?: Array<{ id: string }>; tool_call_id?: string; content: string };
    const history = (upstream.requests[2]!.body as { messages: Sent[] }).messages;
    const callIds = history.flatMap((m) => (m.tool_calls ?? []).map((c) => c.id));
    expect(callIds).toHaveLength(5);
    expect(new Set(callIds).size).toBe(5);
    // Each result answers its own call, in order: an endpoint (or the model) reading the history
    // by id would otherwise find two results for one call and none for another.
    const results = history.filter((m) => m.role === "tool");
    expect(results.map((m) => m.tool_call_id)).toEqual(callIds);
    expect(results.map((m) => m.content.match(/ran: echo (\w+)/)?.[1])).toEqual([
      "one",
      "two",
      "three",
      "four",
      "five",
    ]);
  });

  it("the graded answer loses the credential whole only; the stop reason and transcript any long part of it", async () => {
    const prefix = CREDENTIAL.slice(0, 14);
    upstream.push(
      chatReply({ content: "checking", bash: ["true"] }),
      errorReply(400, "bad_request", `conversation refused for key ${prefix}...`),
    );
    const stopped = await harness().run(ctx());
    expect(stopped.exec.stderr).toMatch(/refused/);
    expect(stopped.exec.stderr).not.toContain(prefix);
    expect(JSON.stringify(stopped.transcript)).not.toContain(prefix);
    // Cutting parts of the key from what is graded would tell the policy which are the key's.
    upstream.push(chatReply({ content: `${prefix} | ${CREDENTIAL}` }));
    expect((await harness().run(ctx())).answer).toBe(`${prefix} | [redacted]`);
  });

  it("an answer over MAX_RESPONSE_BYTES (the model's own runaway generation) ends the episode graded, never retried into a mask", async () => {
    upstream.push(chatReply({ content: "working", bash: ["true"] }), {
      status: 200,
      rawBody: `{"choices":[{"message":{"content":"${"a".repeat(MAX_RESPONSE_BYTES)}"}}]}`,
    });
    const out = await harness().run(ctx(agent()));
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.exec.stderr).toMatch(/stopped \(refused\).*the model's answer was over 8388608 bytes/);
    expect(upstream.requests).toHaveLength(2);
    // Generated, and likely billed, unread: the totals are unknown, not call 1's alone.
    expect(out.usage).toMatchObject({ calls: 1, promptTokens: null, completionTokens: null });
    expect(out.usage!.gaps).toContain(
      "1 call answered over the size bound the fleet reads, unread: token totals unknown",
    );
  });

  it("fails with a final agent_error on a 401 from the endpoint, without the credential in the message", async () => {
    const partial = CREDENTIAL.slice(0, 18);
    upstream.push(
      errorReply(401, "invalid_api_key", `Incorrect API key provided: ${CREDENTIAL}. Partial: ${partial}`),
    );
    const err = await rejection(harness().run(ctx()));
    expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["agent_error", false]);
    expect((err as Error).message).toContain("HTTP 401");
    expect((err as Error).message).not.toContain(CREDENTIAL);
    // Nor the part of it the endpoint quoted back.
    expect((err as Error).message).not.toContain(partial);
    expect((err as Error).message).toMatch(/provided: \[redacted\]\. Partial: \[redacted\]/);
  });

  it.each([401, 402, 403, 404, 302, 307, 405, 410])(
    "a %i after the endpoint answered earlier calls is the infrastructure's (masked provider_unavailable), not the agent's",
    async (status) => {
      upstream.push(chatReply({ content: "looking", bash: ["echo hi"] }));
      upstream.push(errorReply(status, "gone", `key revoked: ${CREDENTIAL}`));
      // A 403 or a 402 is asked again with a plain request: refused as well (the key, the account).
      if (status === 403 || status === 402) upstream.push(errorReply(status, "gone", "key revoked"));
      const err = await rejection(harness().run(ctx()));
      expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["provider_unavailable", false]);
      expect(classifyFailure((err as FleetError).kind).outcome).toBe("mask");
      expect((err as Error).message).toContain(`HTTP ${status}`);
      expect((err as Error).message).not.toContain(CREDENTIAL);
      expect(upstream.requests).toHaveLength(status === 403 || status === 402 ? 3 : 2);
    },
  );

  it("asks for the credential for its own base URL, and never follows a redirect with it (final agent_error)", async () => {
    const elsewhere = await startScriptedUpstream();
    try {
      upstream.push({
        status: 303,
        body: {},
        headers: { location: `${elsewhere.baseUrl}/latest/meta-data` },
      });
      const asked: string[] = [];
      const resolve = async (name: string, baseUrl: string) => {
        asked.push(`${name} ${baseUrl}`);
        return CREDENTIAL;
      };
      const err = await rejection(harness(agent(), resolve).run(ctx()));
      expect(asked).toEqual([`MODEL_KEY ${upstream.baseUrl}`]);
      expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["agent_error", false]);
      expect((err as Error).message).toContain("HTTP 303");
      expect(elsewhere.requests).toHaveLength(0);
    } finally {
      await elsewhere.close();
    }
  });

  it("refuses a credential name it cannot resolve", async () => {
    const a = agent();
    const noResolver = new ToolLoopHarness(a, {});
    const err = await rejection(noResolver.run(ctx(a)));
    expect(isFleetError(err) && err.kind).toBe("agent_error");
    expect(upstream.requests).toHaveLength(0);
  });

  it("sends no Authorization header when the agent names no credential", async () => {
    upstream.push(chatReply({ content: "ok" }));
    const a = agent({ credential: undefined });
    await new ToolLoopHarness(a).run(ctx(a));
    expect(upstream.requests[0]!.headers.authorization).toBeUndefined();
  });

  it("stops waiting and throws the abort reason when the signal aborts", async () => {
    upstream.push({ ...chatReply({ content: "slow" }), delayMs: 5000 });
    const controller = new AbortController();
    const running = harness().run(ctx(agent(), { signal: controller.signal }));
    // Aborted while the model call is in flight (the upstream has it, and holds its reply).
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(1), { timeout: 5_000, interval: 10 });
    controller.abort();
    const err = await rejection(running);
    expect(isFleetError(err) && err.kind).toBe("cancelled");
  });

  it("keeps the transcript bounded and the credential out of it", async () => {
    const long = "y".repeat(3000);
    for (let i = 0; i < 30; i++)
      upstream.push(chatReply({ content: `${long} ${CREDENTIAL}`, bash: ["echo"] }));
    const a = agent({ maxSteps: 30 });
    const out = await harness(a).run(ctx(a));
    expect(out.transcript!.length).toBeLessThanOrEqual(4000);
    const lines = out.transcript!.split("\n").map((l) => JSON.parse(l));
    expect(lines[0]).toMatchObject({ event: "truncated" });
    expect(lines.at(-1)).toMatchObject({ event: "stop", reason: "max_steps" });
    expect(out.transcript).not.toContain(CREDENTIAL);
    expect(out.answer).not.toContain(CREDENTIAL);
  });
});

describe("formatToolResult", () => {
  it("cuts a command's output between characters: an emoji cut in half left a lone surrogate, which an endpoint given the history back may refuse", () => {
    for (const pad of ["", "x"]) {
      const stdout = `${pad}${"🎉".repeat(5000)}\n`;
      const text = formatToolResult(execResult({ stdout }), 60);
      expect(text).toContain("(truncated: last part shown)");
      expect(WellFormedText.safeParse(text).success).toBe(true);
    }
  });
});
