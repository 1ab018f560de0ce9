import { AgentSpec, type SandboxHandle, TaskContent } from "@fleet/contracts";
import { chatReply, errorReply, type ScriptedUpstream, startScriptedUpstream } from "@fleet/gateway/testing";
import { DockerSandboxProvider } from "@fleet/sandbox";
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from "vitest";
import { ToolLoopHarness } from "./tool-loop-harness.ts";

// The tool loop against a scripted upstream on 127.0.0.1, its bash tool in a real Docker sandbox.
const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const RUN = `tl${process.pid}${Date.now().toString(36)}`;
const CREDENTIAL = "sk-int-credential-9876543210fedcba";
const provider = new DockerSandboxProvider({ docker: { socketPath: "/var/run/docker.sock" } });
const TASK = TaskContent.parse({
  id: "t1",
  instruction: "Put 42 in answer.txt.",
  image: IMAGE,
  tests: { "test.sh": "test -f answer.txt" },
});

let upstream: ScriptedUpstream;
let handle: SandboxHandle;
let n = 0;

beforeAll(async () => {
  upstream = await startScriptedUpstream();
});
afterAll(async () => {
  await upstream.close();
});
beforeEach(async () => {
  handle = await provider.create({
    image: IMAGE,
    rolloutId: `${RUN}-${++n}`,
    owner: "resources",
    expiresAt: Date.now() + 600_000,
  });
});
afterEach(async () => {
  await provider.destroy(handle);
});

function toolLoop(over: Record<string, unknown> = {}) {
  const agent = AgentSpec.parse({
    harness: "tool-loop",
    model: { baseUrl: upstream.baseUrl, name: "scripted" },
    credential: "KEY",
    ...over,
  });
  if (agent.harness !== "tool-loop") throw new Error("unreachable");
  const harness = new ToolLoopHarness(agent, { resolveCredential: async () => CREDENTIAL });
  return harness.run({
    provider,
    handle,
    task: TASK,
    agent,
    deadlineMs: Date.now() + 60_000,
    signal: new AbortController().signal,
  });
}

type Msg = { role: string; content: string };
const toolResults = (i: number) =>
  (upstream.requests[i]!.body as { messages: Msg[] }).messages
    .filter((m) => m.role === "tool")
    .map((m) => m.content);

describe("ToolLoopHarness on a real sandbox", () => {
  it("runs the model's bash calls in the sandbox as the agent user, under the tool timeout", async () => {
    const first = upstream.requests.length;
    upstream.push(
      chatReply({
        content: "On it.",
        bash: ['echo 42 > answer.txt; id -u; pwd; cat "$FLEET_INSTRUCTION_FILE"'],
        usage: { prompt: 50, completion: 10, cached: 0 },
      }),
      chatReply({ bash: ["sleep 30; echo never"], usage: { prompt: 80, completion: 6, cached: 32 } }),
      chatReply({ content: "done: 42", usage: { prompt: 120, completion: 4, cached: 64 } }),
    );
    const started = Date.now();
    const out = await toolLoop({ toolTimeoutS: 1 });
    expect(Date.now() - started).toBeLessThan(20_000); // the sleep was cut at ~1 s, not 30

    expect(await provider.get(handle, "/workspace/answer.txt")).toBe("42\n");
    expect(toolResults(first + 1)[0]).toMatch(
      /^exit_code: 0\nstdout:\n1000\n\/workspace\nPut 42 in answer.txt\./,
    );
    expect(toolResults(first + 2)[1]).toMatch(
      /exit_code: -1 \(killed: the command did not finish within 1 s\)/,
    );
    expect(toolResults(first + 2)[1]).not.toContain("never");

    expect(out.answer).toBe("done: 42");
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.usage).toEqual({
      calls: 3,
      promptTokens: 250,
      completionTokens: 20,
      cachedTokens: 96,
      gaps: [],
    });
    expect(out.transcript).toContain('"reason":"answer"');
    expect(JSON.stringify(out)).not.toContain(CREDENTIAL);
  });

  it("ends normally at a context-length error, graded on what the agent left", async () => {
    upstream.push(
      chatReply({ content: "Writing partial work.", bash: ["echo partial > answer.txt"] }),
      errorReply(400, "context_length_exceeded", "maximum context length exceeded"),
    );
    const out = await toolLoop();
    expect(out.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(out.answer).toBe("Writing partial work.");
    expect(await provider.get(handle, "/workspace/answer.txt")).toBe("partial\n");
  });
});
