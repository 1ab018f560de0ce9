import { describe, expect, it } from "vitest";
import { parseApiTokens } from "./env.ts";

describe("parseApiTokens", () => {
  it("splits, trims, de-duplicates and marks admin tokens", () => {
    expect(parseApiTokens("a, b ,admin:c,,a,admin:b")).toEqual({
      tokens: ["a", "b", "c"],
      adminTokens: ["c", "b"],
    });
  });

  it("gives empty lists for an empty value", () => {
    expect(parseApiTokens(" , ")).toEqual({ tokens: [], adminTokens: [] });
  });
});
