import { describe, expect, it } from "vitest";
import { backoffMs, isContextLengthError, isRetryableStatus, retryAfterMs, snippet } from "./chat-client.ts";
import { readAssistantTurn } from "./chat-types.ts";
import { redactor, TRANSCRIPT_FIELD_CHARS, TRANSCRIPT_MAX_CHARS, Transcript } from "./transcript.ts";

describe("backoffMs", () => {
  it("is full jitter under an exponential ceiling capped at maxMs", () => {
    const policy = (r: number) => ({ baseMs: 100, maxMs: 1000, random: () => r });
    expect(backoffMs(1, policy(0.999))).toBe(99);
    expect(backoffMs(3, policy(0.5))).toBe(200);
    expect(backoffMs(10, policy(0.999))).toBe(999);
    expect(backoffMs(1, policy(0))).toBe(0);
  });
});

describe("retryAfterMs", () => {
  it("reads seconds, an HTTP date and retry-after-ms", () => {
    expect(retryAfterMs(new Headers({ "retry-after": "2" }))).toBe(2000);
    expect(retryAfterMs(new Headers({ "retry-after": "0.5" }))).toBe(500);
    expect(retryAfterMs(new Headers({ "retry-after-ms": "250" }))).toBe(250);
    const now = Date.parse("2030-01-01T00:00:00Z");
    expect(retryAfterMs(new Headers({ "retry-after": "Tue, 01 Jan 2030 00:00:03 GMT" }), now)).toBe(3000);
    expect(retryAfterMs(new Headers({ "retry-after": "soon" }))).toBeNull();
    expect(retryAfterMs(new Headers())).toBeNull();
  });
});

describe("isContextLengthError", () => {
  it("matches the code or a context-length message on a 4xx, never a 429 or 5xx", () => {
    expect(isContextLengthError(400, { error: { code: "context_length_exceeded", message: "x" } })).toBe(
      true,
    );
    expect(
      isContextLengthError(400, {
        error: {
          message: "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
        },
      }),
    ).toBe(true);
    expect(isContextLengthError(400, { error: "prompt is too long" })).toBe(true);
    expect(isContextLengthError(400, { error: { message: "invalid temperature" } })).toBe(false);
    expect(isContextLengthError(429, { error: { code: "context_length_exceeded" } })).toBe(false);
    expect(isContextLengthError(500, { error: { message: "context length" } })).toBe(false);
  });

  it("retries only transient statuses", () => {
    expect([408, 409, 425, 429, 500, 502, 503, 504].every(isRetryableStatus)).toBe(true);
    expect([400, 401, 403, 404, 422].some(isRetryableStatus)).toBe(false);
  });
});

describe("readAssistantTurn", () => {
  it("reads content parts and fills in missing tool-call ids", () => {
    const turn = readAssistantTurn(
      {
        choices: [
          {
            finish_reason: "tool_calls",
            message: {
              content: [
                { type: "text", text: "a" },
                { type: "text", text: "b" },
              ],
              tool_calls: [{ function: { name: "bash", arguments: { command: "ls" } } }],
            },
          },
        ],
      },
      4,
    );
    expect(turn).toEqual({
      content: "ab",
      finishReason: "tool_calls",
      toolCalls: [
        { id: "call_4_1", type: "function", function: { name: "bash", arguments: '{"command":"ls"}' } },
      ],
      totalToolCalls: 1,
    });
    expect(readAssistantTurn({ choices: [] }, 1)).toBeNull();
  });

  it("reads only the first maxCalls tool calls of an answer that lists millions, and counts them all", () => {
    const calls = new Array<unknown>(2_000_000).fill({});
    calls[1] = { id: "second", function: { name: "bash", arguments: "{}" } };
    const turn = readAssistantTurn({ choices: [{ message: { content: null, tool_calls: calls } }] }, 2, 3);
    expect(turn?.totalToolCalls).toBe(2_000_000);
    expect(turn?.toolCalls.map((c) => c.id)).toEqual(["call_2_1", "second", "call_2_3"]);
  });
});

describe("Transcript", () => {
  it("keeps the last lines within the cap, marks the cut, and redacts", () => {
    const t = new Transcript(redactor("SECRET"), 1000);
    for (let i = 0; i < 50; i++) t.add({ i, content: `line ${i} SECRET ${"x".repeat(50)}` });
    const text = t.toString();
    expect(text.length).toBeLessThanOrEqual(1000);
    const lines = text.split("\n").map((l) => JSON.parse(l));
    expect(lines[0].event).toBe("truncated");
    expect(lines.at(-1).i).toBe(49);
    expect(lines[0].droppedLines + lines.length - 1).toBe(50);
    expect(text).not.toContain("SECRET");
  });

  it("caps one long field", () => {
    const t = new Transcript(redactor(null));
    t.add({ content: "z".repeat(10_000) });
    expect(JSON.parse(t.toString()).content.length).toBe(TRANSCRIPT_FIELD_CHARS);
  });

  it("caps strings at any depth (a tool call's arguments) before the line is redacted: the redactor never gets megabytes", () => {
    const seen: number[] = [];
    const t = new Transcript((text) => {
      seen.push(text.length);
      return redactor("SECRET", { fragments: true })(text);
    });
    t.add({ role: "assistant", toolCalls: [{ id: "c1", arguments: `SECRET${"a".repeat(4_000_000)}` }] });
    expect(Math.max(...seen)).toBeLessThan(2 * TRANSCRIPT_FIELD_CHARS);
    const line = JSON.parse(t.toString());
    // Capped, then "SECRET" became "[redacted]".
    expect(line.toolCalls[0].arguments).toHaveLength(TRANSCRIPT_FIELD_CHARS + 4);
    expect(line.toolCalls[0].arguments).toMatch(/^\[redacted\]a/);
  });

  it("keeps the end of a line longer than the cap between characters: an emoji cut in half at its front left a lone surrogate in the stored transcript", () => {
    // One assistant turn of several tool calls is one line, each string capped but the line past
    // the cap; its front is cut. Either parity of the cut, by a last key one character longer.
    for (const key of ["a", "ab"]) {
      const t = new Transcript(redactor(null));
      const emoji = "\u{1F600}".repeat(500);
      t.add({ content: emoji, toolCalls: [1, 2, 3, 4].map((id) => ({ id, arguments: emoji })), [key]: 1 });
      const text = t.toString();
      expect(text.length).toBeGreaterThan(TRANSCRIPT_MAX_CHARS - 2);
      expect((text as string & { isWellFormed(): boolean }).isWellFormed(), key).toBe(true);
    }
  });
});

describe("snippet", () => {
  it("redacts at most the first 2,000 characters of an error body and keeps 500", () => {
    const seen: number[] = [];
    const redact = (text: string) => {
      seen.push(text.length);
      return text.replaceAll("SECRET", "[redacted]");
    };
    const out = snippet(`error SECRET ${"b".repeat(8_000_000)}`, redact);
    expect(seen).toEqual([2000]);
    expect(out).toMatch(/^error \[redacted\] b+/);
    expect(out.length).toBeLessThanOrEqual(500);
  });

  it("cuts the error body at 2,000 characters between characters: an emoji cut in half there, its padding trimmed, left a lone surrogate in the reason", () => {
    const out = snippet(`${" ".repeat(1999)}\u{1F600} upstream failed`, (text) => text);
    expect((out as string & { isWellFormed(): boolean }).isWellFormed()).toBe(true);
  });
});
