import { chatReply, errorReply, type ScriptedUpstream, startScriptedUpstream } from "@fleet/gateway/testing";
import { DockerGatewayNetworks, DockerSandboxProvider } from "@fleet/sandbox";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createCredentialResolver } from "./credentials.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { until } from "./testing/no-op-stages.ts";

const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const SECRET = `sk-upstream-${Math.random().toString(36).slice(2)}`;

/** An agent CLI inside the sandbox: one chat-completions call through OPENAI_BASE_URL, prints the reply. */
const CLIENT = `
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
  data=json.dumps({"model": "ignored", "messages": [{"role": "user", "content": open(os.environ["FLEET_INSTRUCTION_FILE"]).read()}]}).encode(),
  headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=20))["choices"][0]["message"]["content"])
`;

/** CLIENT as many agent CLIs behave: an API error is printed, and it exits 0 with $FALLBACK as its answer. */
const CLIENT_EXIT_0 = `
import os, sys
try:
${CLIENT.trim()
  .split("\n")
  .map((l) => `  ${l}`)
  .join("\n")}
except Exception as e:
  print("API error:", e, file=sys.stderr)
  print(os.environ.get("FALLBACK", ""))
`;

/** A python prelude: \`call()\` makes one chat-completions call, returning its answer or "<status> <error code>". */
const CALLER = `
import json, os, sys, urllib.request, urllib.error
def call():
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    try:
        return json.load(urllib.request.urlopen(req, timeout=20))["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return "%d %s" % (e.code, json.load(e)["error"]["code"])`;

/** Docker, noting the network each owner's sandbox was created on (rollout → owner → network). */
class NetworkNotingProvider extends DockerSandboxProvider {
  readonly networks = new Map<string, Record<string, string>>();
  override async create(spec: Parameters<DockerSandboxProvider["create"]>[0]) {
    const seen = this.networks.get(spec.rolloutId) ?? {};
    seen[spec.owner] = spec.network ?? "none";
    this.networks.set(spec.rolloutId, seen);
    return super.create(spec);
  }
}

describe("command agent with a model, through the per-rollout gateway", () => {
  let fleet: InProcessFleet;
  let upstream: ScriptedUpstream;
  // Scoped, sandboxes and networks alike: a janitor test sweeping unscoped (pre-scope)
  // networks must never take this one.
  const scope = `model-access-test-${process.pid}`;
  const networks = new DockerGatewayNetworks({ scope });
  const provider = new NetworkNotingProvider({ scope });

  beforeAll(async () => {
    upstream = await startScriptedUpstream();
    fleet = await startInProcessFleet({
      provider,
      deps: {
        networks,
        gatewayMaxCallsPerMinute: 3,
        harnessDeps: {
          resolveCredential: createCredentialResolver({
            env: { FLEET_CREDENTIAL_UPSTREAM: SECRET, FLEET_CREDENTIAL_UPSTREAM_BASE_URL: upstream.baseUrl },
          }),
        },
      },
    });
  });
  afterAll(async () => {
    await fleet.close();
    await upstream.close();
  });

  /** sum-answer with the CLIENT command agent on the served model, in the task's sandbox or its own. */
  async function submitClient(
    sandbox: "borrow" | "own",
    client = CLIENT,
    env: Record<string, string> = {},
    caps: { maxCalls?: number } = {},
  ): Promise<string> {
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = { ...suite.find((t) => t.id === "sum-answer")!, image: IMAGE };
    const [id] = await fleet.submit([
      {
        task,
        agent: {
          harness: "command",
          sandbox,
          argv: ["python3", "-c", client],
          env,
          model: { name: "served-model", baseUrl: upstream.baseUrl, credential: "upstream", ...caps },
        },
      },
    ]);
    return id!;
  }

  it("the agent gets its answer from the model, usage is recorded, and the credential stays out", async () => {
    upstream.push(chatReply({ content: "4217", usage: { prompt: 21, completion: 3, cached: 5 } }));
    const id = await submitClient("borrow");
    const [r] = await fleet.waitForResults([id], 120_000);
    expect(r).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
    expect(r!.usage).toMatchObject({
      calls: 1,
      promptTokens: 21,
      completionTokens: 3,
      cachedTokens: 5,
      gaps: [],
    });
    // The upstream saw the real credential and the rollout's model; the sandbox never did.
    expect(upstream.requests).toHaveLength(1);
    expect(upstream.requests[0]!.headers.authorization).toBe(`Bearer ${SECRET}`);
    expect((upstream.requests[0]!.body as { model: string }).model).toBe("served-model");
    const raw = await fleet.redis.hgetall(`${fleet.prefix}:x:rollout:${id}`);
    expect(JSON.stringify(raw)).not.toContain(SECRET);
    // The network went with the sandbox.
    expect((await networks.list()).some((n) => n.rolloutId === id)).toBe(false);
  });

  // The gateway sets the model and the path: a 404 (the model gone from the server) is never the
  // agent's request, so it masks like an overloaded upstream.
  it.each([
    [503, "overloaded", "the model is overloaded"],
    [404, "model_not_found", "The model `served-model` does not exist."],
  ] as const)(
    "an agent that fails while its model upstream answers %i is masked provider_unavailable, never graded 0",
    async (httpStatus, code, message) => {
      upstream.push(errorReply(httpStatus, code, message));
      const id = await submitClient("borrow");
      const [r] = await fleet.waitForResults([id], 120_000);
      // At the run: its work is never put to the tests (rule 6).
      expect(r).toMatchObject({
        status: "masked",
        mask: true,
        reward: null,
        failureKind: "provider_unavailable",
        stage: "run",
      });
      expect(r!.reason).toMatch(
        new RegExp(`model upstream was failing when the agent stopped .*HTTP ${httpStatus}`),
      );
      expect((await fleet.deps.store.get(id))!.times["verify:start"]).toBeUndefined();
    },
  );

  it("a masked run still reports what its answered calls spent", async () => {
    upstream.push(chatReply({ content: "thinking", usage: { prompt: 17, completion: 2, cached: 0 } }));
    upstream.push(errorReply(503, "overloaded", "the model is overloaded"));
    // Two calls in a row; the second's HTTP error ends the agent with a non-zero exit.
    const id = await submitClient("borrow", `${CLIENT}\n${CLIENT.trim()}`);
    const [r] = await fleet.waitForResults([id], 120_000);
    expect(r).toMatchObject({ status: "masked", failureKind: "provider_unavailable", stage: "run" });
    expect(r!.usage).toMatchObject({ calls: 1, promptTokens: 17, completionTokens: 2, cachedTokens: 0 });
    expect(r!.usage!.gaps).toEqual([expect.stringMatching(/1 failed upstream attempt/)]);
  });

  it("a run whose sandbox is lost after the agent's model calls is masked and keeps their usage", async () => {
    upstream.push(chatReply({ content: "thinking", usage: { prompt: 23, completion: 5, cached: 1 } }));
    const before = upstream.requests.length;
    const id = await submitClient("borrow", `${CLIENT}\nimport time\ntime.sleep(120)`);
    await until("the agent's model call", () => upstream.requests.length > before, 60_000);
    const rec = await fleet.deps.store.get(id);
    await provider.destroy(rec!.receipts.seed!.handle);
    const [r] = await fleet.waitForResults([id], 120_000);
    expect(r).toMatchObject({ status: "masked", failureKind: "sandbox_lost", stage: "run" });
    expect(r!.usage).toMatchObject({ calls: 1, promptTokens: 23, completionTokens: 5, cachedTokens: 1 });
  });

  it("an agent that exits 0 while its model upstream fails is masked unless its work earns a full reward", async () => {
    upstream.push(errorReply(503, "overloaded", "the model is overloaded"));
    upstream.push(errorReply(503, "overloaded", "the model is overloaded"));
    const empty = await submitClient("borrow", CLIENT_EXIT_0);
    const solved = await submitClient("borrow", CLIENT_EXIT_0, { FALLBACK: "4217" });
    const [r, full] = await fleet.waitForResults([empty, solved], 120_000);
    expect(r).toMatchObject({
      status: "masked",
      reward: null,
      failureKind: "provider_unavailable",
      stage: "verify",
    });
    expect(r!.reason).toMatch(
      /model upstream was failing when the agent stopped .*HTTP 503.*graded 0, so not scored/,
    );
    // Its work stands: the upstream failing could not have made it better.
    expect(full).toMatchObject({ status: "completed", reward: 1 });
  });

  it("the agent's model caps hold: past maxCalls a call gets 429 and never reaches the upstream", async () => {
    // Two calls; the answer is the first's. The second must be refused at the gateway.
    const twice = `${CALLER}
first = call()
print(call(), file=sys.stderr)
print(first)
`;
    // One reply scripted: a second call that got through would reach the upstream all the same.
    upstream.push(chatReply({ content: "4217" }));
    const before = upstream.requests.length;
    const id = await submitClient("borrow", twice, {}, { maxCalls: 1 });
    const [r] = await fleet.waitForResults([id], 120_000);
    expect(r).toMatchObject({ status: "completed", reward: 1 });
    expect(r!.usage).toMatchObject({ calls: 1 });
    expect(upstream.requests.length - before).toBe(1);
  });

  it("the gateway forwards at most FLEET_GATEWAY_MAX_CALLS_PER_MINUTE calls a minute per rollout (here 3): the next is its own 429", async () => {
    const four = `${CALLER}
answers = [call() for _ in range(4)]
print(" | ".join(answers[1:]), file=sys.stderr)
print(answers[0])
`;
    upstream.push(chatReply({ content: "4217" }), chatReply({ content: "b" }), chatReply({ content: "c" }));
    const before = upstream.requests.length;
    const id = await submitClient("borrow", four);
    const [r] = await fleet.waitForResults([id], 120_000);
    expect(r).toMatchObject({ status: "completed", reward: 1 });
    expect(upstream.requests.length - before).toBe(3);
    const rec = await fleet.deps.store.get(id);
    expect(rec!.receipts.run!.exec.stderr).toContain("b | c | 429 rate_limited");
  });

  it("with its own sandbox, only the agent's sandbox joins the gateway network; the task's has none", async () => {
    upstream.push(chatReply({ content: "4217" }));
    const id = await submitClient("own");
    const [r] = await fleet.waitForResults([id], 120_000);
    expect(r).toMatchObject({ status: "completed", reward: 1 });
    const seen = provider.networks.get(id)!;
    expect(seen.resources).toBe("none");
    expect(seen.agent).not.toBe("none");
  });
});
