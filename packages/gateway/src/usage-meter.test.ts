import { Usage } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { describeCalls, readCallUsage, UsageMeter } from "./usage-meter.ts";

const full = (prompt: number, completion: number, cached?: number) =>
  readCallUsage({
    usage: {
      prompt_tokens: prompt,
      completion_tokens: completion,
      total_tokens: prompt + completion,
      ...(cached === undefined ? {} : { prompt_tokens_details: { cached_tokens: cached } }),
    },
  });

describe("readCallUsage", () => {
  it("reads prompt, completion, cached and total tokens", () => {
    expect(full(12, 3, 4)).toEqual({
      usageMissing: false,
      promptTokens: 12,
      completionTokens: 3,
      cachedTokens: 4,
      totalTokens: 15,
    });
  });

  it("reports a response without usage as missing, not as zeros", () => {
    for (const body of [{}, null, "text", { usage: null }, { usage: 5 }]) {
      expect(readCallUsage(body)).toEqual({
        usageMissing: true,
        promptTokens: null,
        completionTokens: null,
        cachedTokens: null,
        totalTokens: null,
      });
    }
  });

  it("derives the total from prompt + completion and ignores invalid counts", () => {
    expect(readCallUsage({ usage: { prompt_tokens: 2, completion_tokens: 3 } }).totalTokens).toBe(5);
    const bad = readCallUsage({ usage: { prompt_tokens: -1, completion_tokens: 1.5 } });
    expect(bad).toMatchObject({ promptTokens: null, completionTokens: null, totalTokens: null });
  });
});

describe("UsageMeter", () => {
  it("does not believe a count no call can have (1e300, past 2^53): a gap, never a sum that breaks the receipt or a metric", () => {
    const u = readCallUsage({ usage: { prompt_tokens: 1e300, completion_tokens: 2 ** 60, total_tokens: 5 } });
    expect([u.promptTokens, u.completionTokens]).toEqual([null, null]);
    const meter = new UsageMeter();
    meter.record(u);
    expect(Usage.parse(meter.summary())).toMatchObject({ promptTokens: null, completionTokens: null });
  });

  it("sums calls and tokens", () => {
    const m = new UsageMeter();
    m.record(full(10, 5, 2));
    m.record(full(20, 7, 0));
    const s = m.summary();
    expect(Usage.parse(s)).toEqual({
      calls: 2,
      promptTokens: 30,
      completionTokens: 12,
      cachedTokens: 2,
      gaps: [],
    });
    expect(m.totalTokens).toBe(42);
  });

  it("nulls every count and names the call when a response lacked usage", () => {
    const m = new UsageMeter();
    m.record(full(10, 5, 0));
    m.record(full(10, 5, 0));
    m.record(readCallUsage({}));
    expect(m.summary()).toEqual({
      calls: 3,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      gaps: ["usage missing on call 3"],
    });
    expect(m.totalTokens).toBeNull();
  });

  it("nulls only cachedTokens when cached tokens were not reported", () => {
    const m = new UsageMeter();
    m.record(full(10, 5, 1));
    m.record(full(10, 5));
    m.record(full(10, 5));
    const s = m.summary();
    expect(s).toMatchObject({ calls: 3, promptTokens: 30, completionTokens: 15, cachedTokens: null });
    expect(s.gaps).toEqual(["cached_tokens (prompt_tokens_details) missing on calls 2-3"]);
  });

  it("notes failed attempts without counting them as calls", () => {
    const m = new UsageMeter();
    m.recordFailure();
    m.recordFailure();
    m.record(full(1, 1, 0));
    expect(m.summary()).toMatchObject({
      calls: 1,
      promptTokens: 1,
      gaps: ["2 failed upstream attempts not counted (usage unknown)"],
    });
  });

  it("a call the agent abandoned leaves the token totals unknown (null), not an undercount", () => {
    const m = new UsageMeter();
    m.record(full(10, 5, 0));
    m.recordAbandoned();
    expect(m.summary()).toEqual({
      calls: 1,
      promptTokens: null,
      completionTokens: null,
      cachedTokens: null,
      gaps: [
        "1 failed upstream attempt not counted (usage unknown)",
        "1 call abandoned by the agent mid-generation: token totals unknown",
      ],
    });
  });

  it("zero calls is a fact: zeros and no gaps", () => {
    expect(new UsageMeter().summary()).toEqual({
      calls: 0,
      promptTokens: 0,
      completionTokens: 0,
      cachedTokens: 0,
      gaps: [],
    });
  });
});

describe("describeCalls", () => {
  it("collapses ranges and stays bounded", () => {
    expect(describeCalls([3])).toBe("call 3");
    expect(describeCalls([1, 2, 3, 5])).toBe("calls 1-3, 5");
    const many = Array.from({ length: 100 }, (_, i) => i * 2 + 1);
    const text = describeCalls(many);
    expect(text).toBe("calls 1, 3, 5, 7, 9, 11, 13, 15, … (+92 more)");
  });
});
