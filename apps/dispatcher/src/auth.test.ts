import { describe, expect, it } from "vitest";
import { createTokenChecker } from "./auth.ts";

describe("createTokenChecker", () => {
  const checker = createTokenChecker(["user-token", "boss-token"], ["boss-token"]);

  it("accepts configured bearer tokens and tells admins apart", () => {
    expect(checker.enabled).toBe(true);
    expect(checker.check("Bearer user-token")).toBe("user");
    expect(checker.check("bearer boss-token")).toBe("admin");
  });

  it("refuses missing, wrong, prefixed and non-bearer credentials", () => {
    for (const header of [
      undefined,
      "",
      "Bearer",
      "Bearer wrong",
      "Bearer user-token2",
      "Basic user-token",
      "user-token",
    ]) {
      expect(checker.check(header), String(header)).toBe("none");
    }
  });

  it("lets everything in when no token is configured", () => {
    const open = createTokenChecker([]);
    expect(open.enabled).toBe(false);
    expect(open.check(undefined)).toBe("admin");
  });
});
