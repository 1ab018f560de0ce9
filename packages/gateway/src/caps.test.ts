import { describe, expect, it } from "vitest";
import { capRefusal } from "./caps.ts";

describe("capRefusal", () => {
  it("allows anything without limits", () => {
    expect(capRefusal({ calls: 1000, tokens: null }, {})).toBeNull();
  });

  it("refuses call maxCalls + 1", () => {
    expect(capRefusal({ calls: 2, tokens: 0 }, { maxCalls: 3 })).toBeNull();
    expect(capRefusal({ calls: 3, tokens: 0 }, { maxCalls: 3 })?.code).toBe("call_cap_exceeded");
  });

  it("refuses once the recorded total reached or crossed the token cap", () => {
    expect(capRefusal({ calls: 1, tokens: 99 }, { maxTokens: 100 })).toBeNull();
    expect(capRefusal({ calls: 1, tokens: 100 }, { maxTokens: 100 })?.code).toBe("token_cap_exceeded");
    const crossed = capRefusal({ calls: 2, tokens: 130 }, { maxTokens: 100 });
    expect(crossed).toEqual({
      code: "token_cap_exceeded",
      message: "this rollout's token cap is reached (130 of 100 tokens used)",
    });
  });

  it("fails closed when the total is unknown under a token cap: the upstream's doing, or the agent's abandoned call", () => {
    expect(capRefusal({ calls: 1, tokens: null }, { maxTokens: 100 })?.code).toBe("usage_unreported");
    expect(capRefusal({ calls: 1, tokens: null, abandoned: true }, { maxTokens: 100 })?.code).toBe(
      "token_total_unknown",
    );
    expect(capRefusal({ calls: 1, tokens: null }, { maxCalls: 5 })).toBeNull();
  });

  it("checks the call cap first", () => {
    expect(capRefusal({ calls: 5, tokens: 500 }, { maxCalls: 5, maxTokens: 100 })?.code).toBe(
      "call_cap_exceeded",
    );
  });
});
