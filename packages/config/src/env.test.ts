import { describe, expect, it } from "vitest";
import { parseApiTokens, warnFetchBlockedPort } from "./env.ts";

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

describe("warnFetchBlockedPort", () => {
  it("warns, naming the variable and the port, only for a port fetch and browsers refuse", () => {
    const lines: { obj: object; msg: string }[] = [];
    const logger = { warn: (obj: object, msg: string) => lines.push({ obj, msg }) };
    for (const port of [8080, 0, 5999, 6001, 443])
      expect(warnFetchBlockedPort("FLEET_HTTP_PORT", port, logger)).toBe(false);
    expect(lines).toEqual([]);
    expect(warnFetchBlockedPort("FLEET_HTTP_PORT", 6000, logger)).toBe(true);
    expect(warnFetchBlockedPort("FLEET_HTTP_PORT", 10080, logger)).toBe(true);
    expect(lines.map((l) => l.obj)).toEqual([
      { variable: "FLEET_HTTP_PORT", port: 6000 },
      { variable: "FLEET_HTTP_PORT", port: 10080 },
    ]);
    expect(lines[0]?.msg).toMatch(/^FLEET_HTTP_PORT=6000 is a port fetch and browsers refuse to connect to/);
    expect(lines[0]?.msg).toContain("the fleet CLI and Bull Board in a browser cannot reach this server");
  });
});
