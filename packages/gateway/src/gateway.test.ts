import { connect } from "node:net";
import { Usage } from "@fleet/contracts";
import { afterEach, describe, expect, it, vi } from "vitest";
import { type ModelGateway, startGateway } from "./gateway.ts";
import { guardedDispatcher, guardedLookup } from "./model-fetch.ts";
import {
  chatReply,
  errorReply,
  type ScriptedUpstream,
  startScriptedUpstream,
} from "./testing/scripted-upstream.ts";

// Gateway and scripted upstream both on 127.0.0.1; the client is plain fetch.
const CREDENTIAL = "sk-upstream-secret-value-1234567890";
const open: Array<{ close(): Promise<void> }> = [];

afterEach(async () => {
  while (open.length > 0) await open.pop()!.close();
});

async function setup(
  options: Partial<Parameters<typeof startGateway>[0]> = {},
): Promise<{ upstream: ScriptedUpstream; gateway: ModelGateway }> {
  const upstream = await startScriptedUpstream();
  open.push(upstream);
  const gateway = await startGateway({
    upstreamBaseUrl: upstream.baseUrl,
    resolveCredential: async () => CREDENTIAL,
    host: "127.0.0.1",
    ...options,
  });
  open.push(gateway);
  return { upstream, gateway };
}

/** What the tests read off a response body (an OpenAI answer or error). */
interface Reply {
  error: { code: string; message: string; type?: string; param?: string | null };
  choices: Array<{ message: { content: string } }>;
}

/** A call the agent gives up on once the upstream has it (its connection closed mid-generation). */
async function abandonCall(baseUrl: string, token: string, upstream: ScriptedUpstream): Promise<void> {
  const before = upstream.requests.length;
  const dropped = new AbortController();
  const call = fetch(`${baseUrl}/chat/completions`, {
    method: "POST",
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: JSON.stringify({ model: "m", messages: [{ role: "user", content: "write a lot" }] }),
    signal: dropped.signal,
  }).catch(() => null);
  await vi.waitFor(() => expect(upstream.requests).toHaveLength(before + 1), { timeout: 10_000 });
  dropped.abort();
  await call;
}

async function chat(
  baseUrl: string,
  token: string | null,
  body: Record<string, unknown> = { model: "whatever", messages: [{ role: "user", content: "hi" }] },
): Promise<{ status: number; json: Reply; text: string; headers: Headers }> {
  const res = await fetch(`${baseUrl}/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", ...(token ? { authorization: `Bearer ${token}` } : {}) },
    body: JSON.stringify(body),
  });
  const text = await res.text();
  let json: unknown = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, json: json as Reply, text, headers: res.headers };
}

describe("model gateway", () => {
  it("forwards with the real credential and the registered model, and records usage", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "qwen-7b" });
    expect(baseUrl).toBe(`${gateway.url}/v1`);
    upstream.push(chatReply({ content: "hello", usage: { prompt: 11, completion: 4, cached: 3 } }));

    const r = await chat(baseUrl, token);
    expect(r.status).toBe(200);
    expect(r.json.choices[0]!.message.content).toBe("hello");
    expect(r.text).not.toContain(CREDENTIAL);
    expect(upstream.requests).toHaveLength(1);
    expect(upstream.requests[0]!.headers.authorization).toBe(`Bearer ${CREDENTIAL}`);
    expect((upstream.requests[0]!.body as { model: string }).model).toBe("qwen-7b");
    expect(JSON.stringify(upstream.requests[0]!.headers)).not.toContain(token);
    expect(Usage.parse(gateway.usage(token))).toEqual({
      calls: 1,
      promptTokens: 11,
      completionTokens: 4,
      cachedTokens: 3,
      gaps: [],
    });
  });

  it("reads an upstream answer that starts with a UTF-8 byte order mark as the chat completion it is: passed on, its usage counted", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 1000 });
    const reply = chatReply({ content: "hello", usage: { prompt: 11, completion: 4, cached: 0 } });
    // Some proxies (.NET, PHP) write one before the JSON; fetch's text() and the SDKs drop it.
    upstream.push({ status: 200, rawBody: `\ufeff${JSON.stringify(reply.body)}` });
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(200);
    expect(r.json.choices?.[0]?.message.content).toBe("hello");
    expect(gateway.usage(token)).toMatchObject({ calls: 1, promptTokens: 11, completionTokens: 4, gaps: [] });
    expect(gateway.health(token)).toMatchObject({ answered: 1, infraFailures: 0, lastInfraFailure: null });
  });

  it("answers 401 to a missing, unknown or forged token", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const forged = `${token.slice(0, -4)}AAAA`;
    for (const t of [null, "nope", forged, CREDENTIAL]) {
      const r = await chat(baseUrl, t);
      expect(r.status).toBe(401);
      expect(r.json.error.code).toBe("invalid_api_key");
    }
    expect(upstream.requests).toHaveLength(0);
  });

  it("refuses the call started after the running total crossed the token cap", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 25 });
    upstream.push(
      chatReply({ content: "a", usage: { prompt: 10, completion: 5 } }),
      chatReply({ content: "b", usage: { prompt: 10, completion: 5 } }),
      chatReply({ content: "never sent" }),
    );
    expect((await chat(baseUrl, token)).status).toBe(200); // 15 of 25
    expect((await chat(baseUrl, token)).status).toBe(200); // 30: crosses the cap, still answered
    const refused = await chat(baseUrl, token);
    expect(refused.status).toBe(429);
    expect(refused.json.error.code).toBe("token_cap_exceeded");
    expect(upstream.requests).toHaveLength(2);
    expect(gateway.usage(token)).toMatchObject({ calls: 2, promptTokens: 20, completionTokens: 10 });
  });

  it("with a token cap, lowers the completion limit a call asks for to what the cap has left after the calls answered and in flight", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 100 });
    const ask = (field: string, n: number) => ({
      model: "m",
      messages: [{ role: "user", content: "hi" }],
      [field]: n,
    });
    upstream.push(chatReply({ content: "a", usage: { prompt: 20, completion: 10 } }));
    expect((await chat(baseUrl, token, ask("max_tokens", 100_000))).status).toBe(200);
    expect(upstream.requests[0]!.body).toMatchObject({ max_tokens: 100 });
    upstream.push(chatReply({ content: "b", usage: { prompt: 5, completion: 5 } }));
    await chat(baseUrl, token, ask("max_completion_tokens", 100_000));
    expect(upstream.requests[1]!.body).toMatchObject({ max_completion_tokens: 70 });
    expect(upstream.requests[1]!.body).not.toHaveProperty("max_tokens");
    // Asked for less than is left: as asked. Asked for none: sent as it came.
    upstream.push(
      chatReply({ content: "c", usage: { prompt: 1, completion: 1 } }),
      chatReply({ content: "d" }),
    );
    await chat(baseUrl, token, ask("max_tokens", 7));
    expect(upstream.requests[2]!.body).toMatchObject({ max_tokens: 7 });
    await chat(baseUrl, token);
    expect(upstream.requests[3]!.body).not.toHaveProperty("max_tokens");
    // Two at once: the first takes what is left (all 40); the second finds nothing left for it.
    const { token: t2, baseUrl: b2 } = gateway.register("r2", { model: "m", maxTokens: 40 });
    // (Answered after 3 s: the second call is refused inside that, beside other unit files.)
    upstream.push({ ...chatReply({ content: "slow", usage: { prompt: 1, completion: 1 } }), delayMs: 3_000 });
    const first = chat(b2, t2, ask("max_tokens", 100_000));
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(5), { timeout: 10_000 });
    const second = await chat(b2, t2, ask("max_tokens", 100_000));
    // It passes once the first is answered: no failure of the agent's, and it may retry.
    expect([second.status, second.json.error.code]).toEqual([429, "token_cap_reserved"]);
    expect(second.headers.get("retry-after")).toBe("1");
    expect((await first).status).toBe(200);
    expect(upstream.requests[4]!.body).toMatchObject({ max_tokens: 40 });
  });

  it("the token cap's clamp takes a limit from either field, numbers or numeric strings, times n; a call asking for none holds all that is left", async () => {
    const { upstream, gateway } = await setup();
    const base = { model: "m", messages: [{ role: "user", content: "hi" }] };
    const one = gateway.register("r1", { model: "m", maxTokens: 40 });
    upstream.push(chatReply({ content: "a", usage: { prompt: 1, completion: 1 } }));
    await chat(one.baseUrl, one.token, { ...base, n: 8, max_completion_tokens: 0, max_tokens: 100_000 });
    expect(upstream.requests[0]!.body).toMatchObject({ n: 8, max_completion_tokens: 5, max_tokens: 5 });
    const two = gateway.register("r2", { model: "m", maxTokens: 40 });
    upstream.push(chatReply({ content: "b", usage: { prompt: 1, completion: 1 } }));
    await chat(two.baseUrl, two.token, { ...base, max_tokens: "100000" });
    expect(upstream.requests[1]!.body).toMatchObject({ max_tokens: 40 });
    // No limit asked: sent as it came, holding what is left while it runs.
    const three = gateway.register("r3", { model: "m", maxTokens: 40 });
    upstream.push(errorReply(503, "overloaded", "busy"), {
      ...chatReply({ content: "c", usage: { prompt: 1, completion: 1 } }),
      delayMs: 3_000,
    });
    await chat(three.baseUrl, three.token, base);
    const first = chat(three.baseUrl, three.token, base);
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(4), { timeout: 10_000 });
    expect(upstream.requests[3]!.body).not.toHaveProperty("max_tokens");
    const second = await chat(three.baseUrl, three.token, base);
    expect([second.status, second.json.error.code]).toEqual([429, "token_cap_reserved"]);
    // A refusal that passes: the upstream's failure before it still stands.
    expect(gateway.health(three.token)?.lastInfraFailure).toBe("HTTP 503");
    expect((await first).status).toBe(200);
  });

  it("the token cap's clamp reads an `n` sent as a numeric string too (an upstream coerces it): one call cannot take n times what is left", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 40 });
    upstream.push(chatReply({ content: "a", usage: { prompt: 1, completion: 1 } }));
    const base = { model: "m", messages: [{ role: "user", content: "hi" }] };
    expect((await chat(baseUrl, token, { ...base, n: "8", max_tokens: 100_000 })).status).toBe(200);
    expect(upstream.requests[0]!.body).toMatchObject({ n: "8", max_tokens: 5 });
  });

  it("a call asking for more choices than the token cap has left, with nothing in flight, gets a 400 no retry passes, not token_cap_reserved", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 40 });
    const res = await chat(baseUrl, token, {
      model: "m",
      messages: [{ role: "user", content: "hi" }],
      n: 100,
      max_tokens: 10,
    });
    expect([res.status, res.json.error.code]).toEqual([400, "token_cap_too_small"]);
    expect(res.json.error.message).toMatch(/40 tokens/);
    expect(upstream.requests).toHaveLength(0);
  });

  it("the rate window slides: a minute after a call, its slot is free again; a refused call takes none", async () => {
    vi.useFakeTimers({ toFake: ["performance"] });
    try {
      const { upstream, gateway } = await setup({ maxCallsPerMinute: 2 });
      const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 1000 });
      upstream.push(chatReply({ content: "a" }), chatReply({ content: "b" }), chatReply({ content: "c" }));
      await chat(baseUrl, token);
      vi.advanceTimersByTime(30_000);
      await chat(baseUrl, token);
      const limited = await chat(baseUrl, token);
      expect([limited.status, limited.json.error.code]).toEqual([429, "rate_limited"]);
      expect(limited.headers.get("retry-after")).toBe("30");
      vi.advanceTimersByTime(29_999);
      expect((await chat(baseUrl, token)).status).toBe(429);
      vi.advanceTimersByTime(1);
      expect((await chat(baseUrl, token)).status).toBe(200);
      expect(upstream.requests).toHaveLength(3);
    } finally {
      vi.useRealTimers();
    }
  });

  it("refuses call maxCalls + 1", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxCalls: 1 });
    upstream.push(chatReply({ content: "a" }));
    expect((await chat(baseUrl, token)).status).toBe(200);
    const refused = await chat(baseUrl, token);
    expect(refused.status).toBe(429);
    expect(refused.json.error.code).toBe("call_cap_exceeded");
    expect(upstream.requests).toHaveLength(1);
  });

  it("the call cap counts calls the upstream refused or failed, and its refusal leaves the upstream's health as it was", async () => {
    const { upstream, gateway } = await setup();
    // Requests the upstream refuses (400) are no way past the cap.
    const bogus = gateway.register("r1", { model: "m", maxCalls: 2 });
    upstream.push(
      errorReply(400, "invalid_request", "bad role"),
      errorReply(400, "invalid_request", "bad role"),
    );
    for (let i = 0; i < 5; i++) await chat(bogus.baseUrl, bogus.token);
    expect(upstream.requests).toHaveLength(2);
    expect(gateway.health(bogus.token)).toEqual({ answered: 2, infraFailures: 0, lastInfraFailure: null });
    // An agent retrying a failing upstream up to its cap: still the upstream's failure.
    const retrying = gateway.register("r2", { model: "m", maxCalls: 2 });
    upstream.push(errorReply(503, "overloaded", "busy"), errorReply(503, "overloaded", "busy"));
    for (let i = 0; i < 2; i++) expect((await chat(retrying.baseUrl, retrying.token)).status).toBe(503);
    const refused = await chat(retrying.baseUrl, retrying.token);
    expect([refused.status, refused.json.error.code]).toEqual([429, "call_cap_exceeded"]);
    expect(gateway.health(retrying.token)?.lastInfraFailure).toBe("HTTP 503");
    expect(upstream.requests).toHaveLength(4);
  });

  it("forwards at most maxCallsPerMinute calls of a rollout a minute; past it, its own 429, health as it was", async () => {
    const { upstream, gateway } = await setup({ maxCallsPerMinute: 3 });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(
      errorReply(400, "invalid_request", "bad"),
      errorReply(400, "invalid_request", "bad"),
      errorReply(503, "overloaded", "busy"),
    );
    for (let i = 0; i < 3; i++) await chat(baseUrl, token);
    const limited = await chat(baseUrl, token);
    expect([limited.status, limited.json.error.code]).toEqual([429, "rate_limited"]);
    expect(upstream.requests).toHaveLength(3);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 503");
    // Another rollout's calls are its own.
    const other = gateway.register("r2", { model: "m" });
    upstream.push(chatReply({ content: "ok" }));
    expect((await chat(other.baseUrl, other.token)).status).toBe(200);
  });

  it("a call with no answer within the upstream timeout is no upstream failure (a long generation looks the same)", async () => {
    const { upstream, gateway } = await setup({ upstreamTimeoutMs: 200 });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push({ ...chatReply({ content: "late" }), delayMs: 2_000 });
    const r = await chat(baseUrl, token);
    expect([r.status, r.json.error.code]).toEqual([504, "upstream_timeout"]);
    expect(gateway.health(token)).toEqual({ answered: 0, infraFailures: 0, lastInfraFailure: null });
  });

  it("records a response without usage as a gap, and then fails a token cap closed, as the upstream's failure", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 1000 });
    upstream.push(chatReply({ content: "a", usage: null }));
    expect((await chat(baseUrl, token)).status).toBe(200);
    expect(gateway.usage(token)).toEqual({
      calls: 1,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      gaps: ["usage missing on call 1"],
    });
    const refused = await chat(baseUrl, token);
    expect(refused.status).toBe(429);
    expect(refused.json.error.code).toBe("usage_unreported");
    expect(refused.json.error.message).toMatch(/cannot be enforced: the upstream did not report usage/);
    // An agent that stops on it failed for the upstream (masked), not on its own.
    expect(gateway.health(token)?.lastInfraFailure).toBe("the upstream reports no usage");
  });

  it("a call the agent abandons mid-generation counts toward the caps: the call cap, and a token total now unknown", async () => {
    for (const [limits, code] of [
      [{ maxTokens: 1_000_000 }, "token_total_unknown"],
      [{ maxCalls: 1 }, "call_cap_exceeded"],
    ] as const) {
      const { upstream, gateway } = await setup();
      const { token, baseUrl } = gateway.register("r1", { model: "m", ...limits });
      upstream.push({ ...chatReply({ content: "long" }), delayMs: 30_000 });
      await abandonCall(baseUrl, token, upstream);
      await vi.waitFor(
        () =>
          expect(gateway.usage(token)?.gaps).toEqual([
            "1 failed upstream attempt not counted (usage unknown)",
            "1 call abandoned by the agent mid-generation: token totals unknown",
          ]),
        { timeout: 10_000 },
      );
      const refused = await chat(baseUrl, token);
      expect(refused.status, code).toBe(429);
      expect(refused.json.error.code).toBe(code);
      expect(upstream.requests).toHaveLength(1);
    }
  });

  it("a token cap refused for a total an abandoned call left unknown leaves the upstream's last failure standing", async () => {
    // An SDK gives up on an overloaded upstream (a 503, then a call it abandons), then retries.
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxTokens: 1_000_000 });
    upstream.push(errorReply(503, "overloaded", "try later"), {
      ...chatReply({ content: "slow" }),
      delayMs: 30_000,
    });
    expect((await chat(baseUrl, token)).status).toBe(503);
    await abandonCall(baseUrl, token, upstream);
    await vi.waitFor(() => expect(gateway.usage(token)?.gaps.join()).toMatch(/2 failed upstream attempts/), {
      timeout: 10_000,
    });
    const refused = await chat(baseUrl, token);
    expect(refused.json.error.code).toBe("token_total_unknown");
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 503");
  });

  it("refuses stream: true with 400 and a malformed body with 400", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    // Also values an upstream might coerce to true: a streamed answer would carry no usage.
    for (const stream of [true, "true", 1]) {
      const streamed = await chat(baseUrl, token, { messages: [], stream });
      expect(streamed.status, String(stream)).toBe(400);
      expect(streamed.json.error.code).toBe("stream_unsupported");
    }
    const malformed = await chat(baseUrl, token, { prompt: "no messages" });
    expect(malformed.status).toBe(400);
    expect(upstream.requests).toHaveLength(0);
  });

  it("a body too deep to send on is the request's own 400, not an upstream unreachable (which would mask the agent)", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(errorReply(503, "overloaded", "later"));
    expect((await chat(baseUrl, token)).status).toBe(503);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 503");
    // 50,000 levels: JSON.parse takes it, JSON.stringify runs out of stack.
    const deep = `{"messages":[],"metadata":${"[".repeat(50_000)}${"]".repeat(50_000)}}`;
    const res = await fetch(`${baseUrl}/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${token}` },
      body: deep,
    });
    const json = (await res.json()) as Reply;
    expect([res.status, json.error.code, json.error.message]).toEqual([
      400,
      "malformed",
      "request body is nested too deep to forward",
    ]);
    // The agent's own request: the upstream's last failure no longer stands, and it was never called.
    expect(gateway.health(token)).toEqual({ answered: 0, infraFailures: 1, lastInfraFailure: null });
    expect(upstream.requests).toHaveLength(1);
  });

  it("an upstream 402 is the upstream's failure when the key cannot make a one-token call either (out of credit), the request's when it can (a max_tokens the balance cannot cover)", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const broke = () => errorReply(402, "payment_required", "Insufficient credits");
    // Out of credit: the probe is refused as well.
    upstream.push(chatReply({ content: "ok" }), broke(), broke());
    expect((await chat(baseUrl, token)).status).toBe(200);
    expect((await chat(baseUrl, token)).status).toBe(402);
    expect(gateway.health(token)).toEqual({ answered: 1, infraFailures: 1, lastInfraFailure: "HTTP 402" });
    // A request asking for more than the balance covers: the probe is answered, the agent's doing.
    upstream.push(broke(), chatReply({ content: "ok" }));
    expect(
      (await chat(baseUrl, token, { messages: [{ role: "user", content: "hi" }], max_tokens: 10_000_000 }))
        .status,
    ).toBe(402);
    expect(gateway.health(token)?.lastInfraFailure).toBeNull();
    expect(upstream.requests).toHaveLength(5);
  });

  it("a call the upstream billed unread (a 2xx over the size bound) makes a token cap's total unknown; one timed out does not (a hung upstream looks the same)", async () => {
    const big = await setup({ maxResponseBytes: 1024 });
    const capped = big.gateway.register("r1", { model: "m", maxTokens: 1_000 });
    big.upstream.push(chatReply({ content: "y".repeat(4096) }));
    expect((await chat(capped.baseUrl, capped.token)).json.error.code).toBe("upstream_response_too_large");
    expect(big.gateway.usage(capped.token)).toEqual({
      calls: 0,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      gaps: [
        "1 failed upstream attempt not counted (usage unknown)",
        "1 call answered over the size bound the fleet reads, unread: token totals unknown",
      ],
    });
    // The cap cannot be checked any more: the next call is refused, not sent, the upstream's
    // health as it was (the request's doing: no failure of the upstream's).
    const refused = await chat(capped.baseUrl, capped.token);
    expect([refused.status, refused.json.error.code]).toEqual([429, "token_total_unknown"]);
    expect(big.upstream.requests).toHaveLength(1);
    expect(big.gateway.health(capped.token)?.lastInfraFailure).toBeNull();
    // A call given up on at the gateway's timeout leaves the total as it was: the next is sent.
    const slow = await setup({ upstreamTimeoutMs: 200 });
    const timed = slow.gateway.register("r1", { model: "m", maxTokens: 1_000 });
    slow.upstream.push({ ...chatReply({ content: "late" }), delayMs: 2_000 }, chatReply({ content: "ok" }));
    expect((await chat(timed.baseUrl, timed.token)).json.error.code).toBe("upstream_timeout");
    expect((await chat(timed.baseUrl, timed.token)).status).toBe(200);
  });

  it("passes upstream errors through (with Retry-After) and notes them as gaps", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(errorReply(429, "rate_limited", "slow down", { "retry-after": "2" }));
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(429);
    expect(r.headers.get("retry-after")).toBe("2");
    expect(r.json.error.code).toBe("rate_limited");
    expect(gateway.usage(token)).toMatchObject({
      calls: 0,
      gaps: ["1 failed upstream attempt not counted (usage unknown)"],
    });
  });

  it("never lets the real credential reach the client: an answer echoing it is redacted, an error's own words are not passed on", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(chatReply({ content: `you sent authorization=Bearer ${CREDENTIAL}` }));
    const answer = await chat(baseUrl, token);
    expect(answer.text).not.toContain(CREDENTIAL);
    expect(answer.json.choices?.[0]?.message?.content).toBe("you sent authorization=Bearer [redacted]");
    upstream.push(errorReply(400, "bad_request", `bad header authorization=Bearer ${CREDENTIAL}`));
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(400);
    expect(r.text).not.toContain(CREDENTIAL);
    expect(r.json.error.code).toBe("bad_request");
  });

  it("redacts the credential also as an upstream echoes it escaped in JSON or URL-encoded", async () => {
    const odd = 'sk-live/ab+c"d\\e';
    const { upstream, gateway } = await setup({ resolveCredential: async () => odd });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const escaped = JSON.stringify(odd).slice(1, -1);
    for (const echo of [
      `authorization=Bearer ${odd}`, // JSON-escaped in the error body
      `auth=${encodeURIComponent(odd)}`,
    ]) {
      upstream.push(chatReply({ content: echo }));
      const r = await chat(baseUrl, token);
      expect(r.status).toBe(200);
      expect(r.text, echo).not.toContain(escaped);
      expect(r.text, echo).not.toContain(encodeURIComponent(odd));
      expect(r.text, echo).toContain("[redacted]");
    }
    // A body an encoder wrote with `/` escaped as `\/`.
    upstream.push({
      status: 200,
      rawBody: `{"choices":[{"index":0,"message":{"role":"assistant","content":"key ${escaped.replaceAll("/", "\\/")}"}}]}`,
    });
    const slashed = await chat(baseUrl, token);
    expect(slashed.text).not.toContain("ab+c");
    expect(slashed.text).toContain("[redacted]");
  });

  it("never quotes the credential in its own error: fetch refusing a header value that holds it", async () => {
    const bad = `${CREDENTIAL}\r\nx-injected: 1`;
    const { gateway } = await setup({ resolveCredential: async () => bad });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(502);
    expect(r.text).not.toContain(CREDENTIAL);
  });

  it("does not follow an upstream's redirect: the credential goes to the configured upstream only", async () => {
    const { upstream, gateway } = await setup();
    const elsewhere = await startScriptedUpstream();
    open.push(elsewhere);
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push({ status: 307, body: {}, headers: { location: `${elsewhere.baseUrl}/chat/completions` } });
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(307);
    expect(r.headers.get("location")).toBeNull();
    expect(elsewhere.requests).toHaveLength(0);
    // Every call then fails, through no fault of the agent's: the upstream's failure (a run
    // that fails on it is masked), not an answer.
    expect(gateway.health(token)).toEqual({ answered: 0, infraFailures: 1, lastInfraFailure: "HTTP 307" });
  });

  it("answers 429 past a token's concurrent-call limit, without forwarding", async () => {
    const { upstream, gateway } = await setup({ maxConcurrentCalls: 2 });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(
      { ...chatReply({ content: "slow 1" }), delayMs: 30_000 },
      { ...chatReply({ content: "slow 2" }), delayMs: 30_000 },
    );
    const held = [chat(baseUrl, token), chat(baseUrl, token)];
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(2), { timeout: 10_000 });
    const third = await chat(baseUrl, token);
    expect(third.status).toBe(429);
    expect(third.json.error.code).toBe("too_many_concurrent_calls");
    expect(upstream.requests).toHaveLength(2);
    gateway.revoke(token);
    await Promise.all(held);
  });

  it("tells an upstream failing (5xx, 429, key refused, unreachable) from one answering (2xx, a 4xx about the request)", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    expect(gateway.health(token)).toEqual({ answered: 0, infraFailures: 0, lastInfraFailure: null });
    upstream.push(errorReply(503, "overloaded", "try later"));
    await chat(baseUrl, token);
    expect(gateway.health(token)).toEqual({ answered: 0, infraFailures: 1, lastInfraFailure: "HTTP 503" });
    upstream.push(errorReply(400, "bad_request", "your messages are malformed"));
    await chat(baseUrl, token);
    expect(gateway.health(token)).toEqual({ answered: 1, infraFailures: 1, lastInfraFailure: null });
    upstream.push(errorReply(401, "invalid_api_key", "bad key"));
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 401");
    upstream.push(chatReply({ content: "ok" }));
    await chat(baseUrl, token);
    expect(gateway.health(token)).toEqual({ answered: 2, infraFailures: 2, lastInfraFailure: null });
    // A call the gateway refuses itself (here: not JSON) is the agent's own: the last call failed
    // on its request, not on the upstream.
    upstream.push(errorReply(502, "bad_gateway", "down"));
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 502");
    const malformed = await fetch(`${baseUrl}/chat/completions`, {
      method: "POST",
      headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
      body: "not json",
    });
    expect(malformed.status).toBe(400);
    expect(gateway.health(token)?.lastInfraFailure).toBeNull();
    await upstream.close();
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toMatch(/^unreachable: /);
    expect(gateway.health("not-a-token")).toBeNull();
  });

  it("a 404 is the upstream failing (no such model or route: the gateway sets both), not an answer about the agent's request", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(
      chatReply({ content: "ok" }),
      errorReply(404, "model_not_found", "The model `m` does not exist."),
    );
    expect((await chat(baseUrl, token)).status).toBe(200);
    expect((await chat(baseUrl, token)).status).toBe(404);
    expect(gateway.health(token)).toEqual({ answered: 1, infraFailures: 1, lastInfraFailure: "HTTP 404" });
  });

  it("a 2xx that is no chat completion is the upstream failing; an answer over the size bound is the request's (n, logprobs)", async () => {
    const { upstream, gateway } = await setup({ maxResponseBytes: 1024 });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const health = () => gateway.health(token);
    upstream.push({ status: 200, rawBody: '{"choices": [ this is not json' });
    expect((await chat(baseUrl, token)).status).toBe(200); // passed on as it came
    expect(health()).toEqual({
      answered: 0,
      infraFailures: 1,
      lastInfraFailure: "HTTP 200 with no readable chat completion",
    });
    upstream.push({
      status: 200,
      rawBody: "<html>gateway ok</html>",
      headers: { "content-type": "text/html" },
    });
    await chat(baseUrl, token);
    expect(health()?.infraFailures).toBe(2);
    // JSON with no usable choice: none, a null message, an error object under a 200.
    for (const rawBody of [
      '{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}}',
      '{"choices": [{"message": null}]}',
      '{"error": {"message": "upstream overloaded"}, "choices": []}',
    ]) {
      upstream.push({ status: 200, rawBody });
      await chat(baseUrl, token);
      expect(health()?.lastInfraFailure, rawBody).toBe("HTTP 200 with no readable chat completion");
    }
    expect(health()?.infraFailures).toBe(5);
    upstream.push(chatReply({ content: "ok" }));
    await chat(baseUrl, token);
    expect(health()).toEqual({ answered: 1, infraFailures: 5, lastInfraFailure: null });
    upstream.push(errorReply(503, "overloaded", "later"), chatReply({ content: "x".repeat(4096) }));
    await chat(baseUrl, token);
    expect(health()?.lastInfraFailure).toBe("HTTP 503");
    // The agent sets how much comes back (several choices, logprobs, prompt_logprobs, a prompt
    // an error quotes back): an answer or refusal that large is its own failure, not a mask.
    const big = await chat(baseUrl, token, { messages: [{ role: "user", content: "hi" }], n: 2 });
    expect([big.status, big.json.error.code]).toEqual([502, "upstream_response_too_large"]);
    expect(health()).toEqual({ answered: 1, infraFailures: 6, lastInfraFailure: null });
    // A failure's status (5xx, 429) that large is the upstream's.
    upstream.push({ status: 503, rawBody: "x".repeat(4096) });
    expect((await chat(baseUrl, token)).json.error.code).toBe("upstream_response_too_large");
    expect(health()).toEqual({
      answered: 1,
      infraFailures: 7,
      lastInfraFailure: "HTTP 503 with a body over 1024 bytes",
    });
    // One choice, no logprobs (vLLM's prompt_logprobs, say), or a 400 quoting the request back:
    // the request's, and the upstream's last failure no longer stands.
    upstream.push(chatReply({ content: "y".repeat(4096) }));
    await chat(baseUrl, token, { messages: [{ role: "user", content: "hi" }], prompt_logprobs: 20 });
    expect(health()).toEqual({ answered: 1, infraFailures: 7, lastInfraFailure: null });
    upstream.push(errorReply(503, "overloaded", "later"), { status: 400, rawBody: "z".repeat(4096) });
    await chat(baseUrl, token);
    await chat(baseUrl, token);
    expect(health()).toEqual({ answered: 1, infraFailures: 8, lastInfraFailure: null });
  });

  it("passes on Retry-After and Content-Type only in forms that carry nothing else (a proxy echoing the credential)", async () => {
    const shared = await setup();
    const replies: Array<[Record<string, string>, string | null, string]> = [
      [{ "retry-after": "7" }, "7", "application/json"],
      [{ "retry-after": "1.5" }, "1.5", "application/json"],
      [
        { "retry-after": "Wed, 21 Oct 2026 07:28:00 GMT" },
        "Wed, 21 Oct 2026 07:28:00 GMT",
        "application/json",
      ],
      [{ "retry-after": `5 ${CREDENTIAL}` }, null, "application/json"],
      [{ "content-type": `application/json; key=${CREDENTIAL}` }, null, "application/json"],
      [{ "content-type": `text/${CREDENTIAL}` }, null, "application/json"],
      [{ "content-type": "Text/Plain; charset=latin1" }, null, "text/plain"],
    ];
    for (const [headers, retryAfter, contentType] of replies) {
      // An error's body is the gateway's own (JSON) with a credential configured: the
      // upstream's own content type is seen with none.
      const { upstream, gateway } =
        contentType === "text/plain" ? await setup({ resolveCredential: async () => null }) : shared;
      const { token, baseUrl } = gateway.register(`r-${upstream.requests.length}`, { model: "m" });
      upstream.push(errorReply(429, "rate_limited", "slow down", headers));
      const r = await chat(baseUrl, token);
      expect(r.status).toBe(429);
      expect([r.headers.get("retry-after"), r.headers.get("content-type")], JSON.stringify(headers)).toEqual([
        retryAfter,
        contentType,
      ]);
    }
  });

  it("a 403 while the upstream answers a plain request with the same key is the request's (a firewall's rule): answered, not a failure", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "served" });
    upstream.push(errorReply(403, "forbidden", "Forbidden"), chatReply({ content: "OK" }));
    expect((await chat(baseUrl, token)).status).toBe(403);
    expect(gateway.health(token)).toEqual({ answered: 1, infraFailures: 0, lastInfraFailure: null });
    // The probe: the rollout's model, the operator's key, one token.
    expect(upstream.requests[1]!.body).toMatchObject({ model: "served", max_tokens: 1 });
    expect(upstream.requests[1]!.headers.authorization).toBe(`Bearer ${CREDENTIAL}`);
    // Refused as well: the key, the upstream's failure.
    upstream.push(errorReply(403, "forbidden", "Forbidden"), errorReply(403, "forbidden", "Forbidden"));
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 403");
  });

  it("a probe answered with a 4xx about itself (a model that wants max_completion_tokens) still shows the key works; a 5xx shows nothing", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "o-reasoning" });
    upstream.push(
      errorReply(403, "forbidden", "Forbidden"),
      errorReply(400, "unsupported_parameter", "use max_completion_tokens"),
    );
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toBeNull();
    upstream.push(errorReply(403, "forbidden", "Forbidden"), errorReply(503, "overloaded", "busy"));
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 403");
    // The probes are a gap in the usage, never tokens silently left out.
    const probes =
      "2 one-token probe request(s) the gateway sent after a 403 or a 402, to tell a refused key from a refused request (not counted)";
    expect(gateway.usage(token)?.gaps).toContain(probes);
    // ...and in the usage the run keeps: the summary at revocation.
    expect(gateway.revoke(token).gaps).toContain(probes);
    expect(gateway.usage(token)?.gaps).toContain(probes);
  });

  it("a call waiting on its 403's probe still counts toward the call cap", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m", maxCalls: 1 });
    upstream.push(errorReply(403, "forbidden", "Forbidden"), {
      ...chatReply({ content: "OK" }),
      delayMs: 500,
    });
    const first = chat(baseUrl, token);
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(2), { timeout: 10_000 }); // the probe is out
    const second = await chat(baseUrl, token);
    expect([second.status, second.json.error.code]).toEqual([429, "call_cap_exceeded"]);
    await first;
    expect(upstream.requests).toHaveLength(2);
  });

  it("a proxy's gateway timeout (504, 524, 408) after a proxy's time leaves the upstream's health as it was: a long generation looks the same", async () => {
    // (Any answer counts as taking a proxy's time here.)
    const { upstream, gateway } = await setup({ gatewayTimeoutMinMs: 0 });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(chatReply({ content: "a" }));
    await chat(baseUrl, token);
    for (const status of [504, 524, 408]) {
      upstream.push({
        status,
        rawBody: "<html>Gateway Time-out</html>",
        headers: { "content-type": "text/html" },
      });
      await chat(baseUrl, token);
    }
    expect(gateway.health(token)).toEqual({ answered: 1, infraFailures: 0, lastInfraFailure: null });
    // Not answered either: an upstream failing before stays failing.
    upstream.push(errorReply(503, "overloaded", "busy"), { status: 504, rawBody: "timeout" });
    await chat(baseUrl, token);
    await chat(baseUrl, token);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 503");
  });

  it("a gateway timeout (504, 524, 408) that came at once timed nothing out: an infrastructure failure, so an agent failing on it is masked", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    for (const status of [504, 524, 408]) {
      upstream.push({
        status,
        rawBody: "<html>Gateway Time-out</html>",
        headers: { "content-type": "text/html" },
      });
      expect((await chat(baseUrl, token)).status).toBe(status);
      expect(gateway.health(token)).toMatchObject({
        answered: 0,
        lastInfraFailure: expect.stringMatching(new RegExp(`^HTTP ${status} after \\d+ ms$`)),
      });
    }
    expect(gateway.health(token)?.infraFailures).toBe(3);
  });

  it("a refusal (401/403) or a redirect: the agent gets the gateway's words, not the upstream's (which may quote part of the key)", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    for (const [status, code] of [
      [401, "upstream_refused"],
      [403, "upstream_refused"],
      [302, "upstream_redirected"],
    ] as const) {
      const partial = `Incorrect API key provided. Partial: ${CREDENTIAL.slice(0, 16)}`;
      upstream.push(errorReply(status, "invalid_api_key", partial));
      const r = await chat(baseUrl, token);
      expect(r.status).toBe(status);
      expect(r.text).not.toContain(CREDENTIAL.slice(0, 16));
      expect(r.json.error.code).toBe(code);
      expect(gateway.health(token)?.lastInfraFailure).toBe(`HTTP ${status}`);
    }
  });

  it("an upstream error's own words never reach the agent (they may quote part of the key): its status and short identifiers do", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    for (const [status, quoted] of [
      [400, `invalid request for key ${CREDENTIAL.slice(0, -1)}`],
      [422, `unprocessable; key prefix ${CREDENTIAL.slice(0, 16)}`],
      [500, `internal error handling ${CREDENTIAL.slice(4, 20)}`],
      [400, "max_tokens is too large"],
    ] as const) {
      upstream.push({
        status,
        body: {
          error: { message: quoted, type: "invalid_request_error", code: "bad_value", param: "max_tokens" },
        },
      });
      const r = await chat(baseUrl, token);
      expect(r.status).toBe(status);
      expect(r.text).not.toContain(CREDENTIAL.slice(4, 14));
      expect(r.text).not.toContain(quoted);
      expect(r.json.error).toMatchObject({
        type: "invalid_request_error",
        code: "bad_value",
        param: "max_tokens",
      });
    }
    // An error object under a 200 (no chat completion) is an error all the same.
    upstream.push({
      status: 200,
      body: {
        error: {
          message: `Incorrect API key provided: ${CREDENTIAL.slice(0, 20)}...`,
          code: "invalid_api_key",
        },
      },
    });
    const under200 = await chat(baseUrl, token);
    expect(under200.status).toBe(200);
    expect(under200.text).not.toContain(CREDENTIAL.slice(4, 14));
    expect(under200.json.error.code).toBe("invalid_api_key");
    // Identifiers in a form a key takes (digits, capitals, `-`) are not passed on.
    upstream.push({
      status: 400,
      body: {
        error: {
          message: "x",
          code: CREDENTIAL.slice(0, 30),
          param: CREDENTIAL.slice(5),
          type: "Bad-Type-1",
        },
      },
    });
    const keyLike = await chat(baseUrl, token);
    expect(keyLike.text).not.toContain(CREDENTIAL.slice(5, 15));
    expect(keyLike.json.error).toMatchObject({
      code: "upstream_error",
      type: "invalid_request_error",
      param: null,
    });
    // A field that is no short identifier is not passed on either (the gateway's own code instead).
    upstream.push({
      status: 400,
      body: { error: { message: "x", code: `key ${CREDENTIAL.slice(0, 12)} refused` } },
    });
    const odd = await chat(baseUrl, token);
    expect([odd.status, odd.json.error.code, odd.json.error.type]).toEqual([
      400,
      "upstream_error",
      "invalid_request_error",
    ]);
  });

  it.each([
    [
      "OpenAI's",
      {
        error: {
          message: "This model's maximum context length is 8192 tokens",
          code: "context_length_exceeded",
        },
      },
    ],
    [
      "vLLM's",
      {
        object: "error",
        message: "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
        code: 400,
      },
    ],
    ["a bare string", { error: "prompt is too long: 210000 tokens > 200000 maximum" }],
  ] as const)(
    "an upstream's context length exceeded (%s form) reaches the agent as such, in the gateway's own words",
    async (_, body) => {
      const { upstream, gateway } = await setup();
      const { token, baseUrl } = gateway.register("r1", { model: "m" });
      upstream.push({ status: 400, body });
      const r = await chat(baseUrl, token);
      expect(r.status).toBe(400);
      expect(r.json.error.code).toBe("context_length_exceeded");
      expect(r.json.error.message).toMatch(/maximum context length/);
    },
  );

  it("an error that echoes what the agent sent comes back the same for a right guess at the key as for a wrong one: no oracle, one character at a time", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    // The key's first 9 characters and a guess at the 10th, right and wrong, sent in capitals to
    // an upstream that quotes a bad value lowercased: the key's run is only in its answer.
    const right = CREDENTIAL.slice(0, 10);
    const wrong = `${CREDENTIAL.slice(0, 9)}#`;
    const answers = [];
    for (const guess of [right, wrong]) {
      upstream.push(
        errorReply(400, "invalid_value", `Invalid value '${guess}': supported values are 'user', 'system'`),
      );
      const r = await chat(baseUrl, token, { messages: [{ role: guess.toUpperCase(), content: "hi" }] });
      answers.push([r.status, r.json.error.code, r.json.error.message]);
    }
    expect(answers[0]?.slice(0, 2)).toEqual([400, "invalid_value"]);
    expect(answers[1]).toEqual(answers[0]);
  });

  it("what the agent gets back is redacted of the credential whole, never of parts of it (which would tell it which runs are the key's)", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    // A model told to repeat the prompt, given guesses at the key.
    const guess = CREDENTIAL.slice(0, 14);
    upstream.push(chatReply({ content: `${guess} | ${CREDENTIAL}` }));
    const r = await chat(baseUrl, token);
    expect(r.json.choices?.[0]?.message?.content).toBe(`${guess} | [redacted]`);
  });

  it("a concurrency refusal, unlike a malformed request, leaves the upstream's last failure as it was", async () => {
    const { upstream, gateway } = await setup({ maxConcurrentCalls: 1 });
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(errorReply(503, "overloaded", "try later"));
    await chat(baseUrl, token);
    upstream.push({ ...chatReply({ content: "slow" }), delayMs: 500 });
    const inFlight = chat(baseUrl, token);
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(2), { timeout: 10_000 });
    expect((await chat(baseUrl, token)).status).toBe(429);
    expect(gateway.health(token)?.lastInfraFailure).toBe("HTTP 503");
    await inFlight;
    expect(gateway.health(token)?.lastInfraFailure).toBeNull();
  });

  it("answers 502 when the upstream is unreachable", async () => {
    const upstream = await startScriptedUpstream();
    const deadUrl = upstream.baseUrl;
    await upstream.close();
    const gateway = await startGateway({ upstreamBaseUrl: deadUrl, host: "127.0.0.1" });
    open.push(gateway);
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(502);
    expect(r.json.error.code).toBe("upstream_unavailable");
  });

  it("never forwards to an upstream whose name resolves to a link-local address when called (DNS rebinding): 502, nothing sent", async () => {
    const upstream = await startScriptedUpstream();
    open.push(upstream);
    const dispatcher = guardedDispatcher(
      guardedLookup((_host, options, callback) =>
        options.all
          ? callback(null, [{ address: "169.254.169.254", family: 4 }])
          : callback(null, "169.254.169.254", 4),
      ),
    );
    open.push(dispatcher);
    const gateway = await startGateway({
      upstreamBaseUrl: `http://model.test:${new URL(upstream.url).port}/v1`,
      resolveCredential: async () => CREDENTIAL,
      host: "127.0.0.1",
      dispatcher,
    });
    open.push(gateway);
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(chatReply({ content: "never" }));
    const r = await chat(baseUrl, token);
    expect(r.status).toBe(502);
    expect(r.json.error).toMatchObject({ code: "upstream_unavailable" });
    expect(r.json.error.message).toMatch(
      /model\.test resolves to a link-local address \(169\.254\.169\.254\); refused/,
    );
    expect(upstream.requests).toHaveLength(0);
    // Not the upstream failing (no mask for the run): the spec's endpoint, which the run fails on.
    expect(gateway.health(token)).toMatchObject({
      infraFailures: 0,
      lastInfraFailure: null,
      refusedEndpoint: expect.stringMatching(/link-local/),
    });
  });

  it("revoke: later calls get 401; an in-flight call is aborted and noted", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    upstream.push(chatReply({ content: "a" }), { ...chatReply({ content: "slow" }), delayMs: 30_000 });
    expect((await chat(baseUrl, token)).status).toBe(200);
    const slow = chat(baseUrl, token);
    await vi.waitFor(() => expect(upstream.requests).toHaveLength(2), { timeout: 10_000 });
    const summary = gateway.revoke(token);
    expect(summary).toMatchObject({ calls: 1, promptTokens: 10, completionTokens: 5 });
    expect(summary.gaps).toContain("1 call in flight at revocation aborted (usage unknown)");
    expect((await slow).status).toBe(503);
    expect(gateway.revoke(token)).toEqual(summary);
    const after = await chat(baseUrl, token);
    expect(after.status).toBe(401);
    expect(() => gateway.revoke("fgw_0000000000000000_x")).toThrow(/never issued|not a token/);
  });

  it("answers a request target no URL parser reads with 400, not a gateway error", async () => {
    const { gateway } = await setup();
    for (const target of ["//[", "//:99999/v1/chat/completions"]) {
      const statusLine = await new Promise<string>((resolve, reject) => {
        const socket = connect(gateway.port, "127.0.0.1", () =>
          socket.write(
            `POST ${target} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n`,
          ),
        );
        let got = "";
        socket.on("data", (d: Buffer) => {
          got += d.toString("latin1");
        });
        socket.on("end", () => resolve(got.split("\r\n")[0]!));
        socket.on("error", reject);
      });
      expect(statusLine).toBe("HTTP/1.1 400 Bad Request");
    }
  });

  it("answers an unknown path 404 not_found and a route's wrong method 405 method_not_allowed with the Allow header, token or not, in the README's error shape; nothing forwarded", async () => {
    const { upstream, gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "m" });
    const root = baseUrl.replace(/\/v1$/, "");
    const error = (code: string, message: string) => ({
      error: { message, type: "invalid_request_error", code, param: null },
    });
    const cases: Array<
      [method: string, path: string, status: number, body: ReturnType<typeof error>, allow: string | null]
    > = [
      ["POST", "/v1/completions", 404, error("not_found", "no route POST /v1/completions"), null],
      ["POST", "/v1/embeddings", 404, error("not_found", "no route POST /v1/embeddings"), null],
      // The base URL without its /v1; the query is no part of the path named.
      ["POST", "/chat/completions?x=1", 404, error("not_found", "no route POST /chat/completions"), null],
      ["GET", "/", 404, error("not_found", "no route GET /"), null],
      ["GET", "/v1/", 404, error("not_found", "no route GET /v1"), null],
      ["GET", "/v1/chat/completions", 405, error("method_not_allowed", "use POST"), "POST"],
      ["PUT", "/v1/chat/completions/", 405, error("method_not_allowed", "use POST"), "POST"],
      ["POST", "/v1/models", 405, error("method_not_allowed", "use GET"), "GET"],
      ["DELETE", "/v1/models", 405, error("method_not_allowed", "use GET"), "GET"],
    ];
    for (const [method, path, status, body, allow] of cases) {
      // No token, this rollout's, and one the gateway never issued: the route is judged first.
      const tokens: Array<Record<string, string>> = [
        {},
        { authorization: `Bearer ${token}` },
        { authorization: "Bearer fgw_forged" },
      ];
      for (const headers of tokens) {
        const res = await fetch(`${root}${path}`, { method, headers });
        expect({
          method,
          path,
          status: res.status,
          type: res.headers.get("content-type"),
          allow: res.headers.get("allow"),
        }).toEqual({ method, path, status, type: "application/json", allow });
        expect(await res.json()).toEqual(body);
      }
    }
    expect(upstream.requests).toHaveLength(0);
  });

  it("lists the registered model", async () => {
    const { gateway } = await setup();
    const { token, baseUrl } = gateway.register("r1", { model: "qwen-7b" });
    const res = await fetch(`${baseUrl}/models`, { headers: { authorization: `Bearer ${token}` } });
    expect(res.status).toBe(200);
    expect(((await res.json()) as { data: Array<{ id: string }> }).data.map((d) => d.id)).toEqual([
      "qwen-7b",
    ]);
  });

  it("rejects invalid caps at registration", async () => {
    const { gateway } = await setup();
    expect(() => gateway.register("r1", { model: "m", maxTokens: 0 })).toThrow(/positive integer/);
  });

  it("refuses to start with a limit or timeout that is not a positive whole number, as registration refuses a cap: none silently unbounded, nor every call a 500", async () => {
    const upstream = await startScriptedUpstream();
    open.push(upstream);
    const start = (options: Partial<Parameters<typeof startGateway>[0]>) =>
      startGateway({ upstreamBaseUrl: upstream.baseUrl, host: "127.0.0.1", ...options });
    for (const [name, value] of [
      // AbortSignal.timeout refuses a fraction: every forwarded call failed with a 500.
      ["upstreamTimeoutMs", 1500.5],
      ["upstreamTimeoutMs", -1],
      // NaN compares false: no bound at all on the bodies, the calls open, the rate.
      ["maxRequestBytes", Number.NaN],
      ["maxResponseBytes", Number.NaN],
      ["maxConcurrentCalls", Number.NaN],
      ["maxCallsPerMinute", Number.NaN],
      ["maxConnections", 0],
    ] as const) {
      await expect(start({ [name]: value }), `${name} ${value}`).rejects.toThrow(
        new RegExp(`gateway option ${name} must be a positive integer, got ${value}`),
      );
    }
    // Whole, but past a timer's range: AbortSignal.timeout refuses one over 2^32 - 1 ms (every
    // call a 500), and fires one over 2^31 - 1 after 1 ms (every call an upstream_timeout 504).
    for (const value of [2 ** 31, 2 ** 32]) {
      await expect(start({ upstreamTimeoutMs: value }), `upstreamTimeoutMs ${value}`).rejects.toThrow(
        `gateway option upstreamTimeoutMs must be at most 2147483647 (a timer's range), got ${value}`,
      );
    }
    const gateway = await start({ upstreamTimeoutMs: 1000, maxConcurrentCalls: 1 });
    open.push(gateway);
    open.push(await start({ upstreamTimeoutMs: 2 ** 31 - 1 }));
  });
});
