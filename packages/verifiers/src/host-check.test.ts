import { describe, expect, it } from "vitest";
import { testsTamperRisk } from "./host-check.ts";

describe("testsTamperRisk", () => {
  it("names a kernel without Yama, or with ptrace_scope 0, and none with 1 to 3", () => {
    const missing = () => {
      throw Object.assign(new Error("ENOENT"), { code: "ENOENT" });
    };
    expect(testsTamperRisk(missing)).toMatch(/no Yama ptrace restriction/);
    expect(testsTamperRisk(() => "0\n")).toBe("kernel.yama.ptrace_scope is 0, not 1 or more");
    expect(testsTamperRisk(() => "")).toMatch(/is empty/);
    for (const scope of ["1\n", "2", "3\n"]) expect(testsTamperRisk(() => scope)).toBeNull();
  });
});
