import { describe, expect, it } from "vitest";
import { formatPath } from "./zod-issues.ts";

describe("formatPath", () => {
  it("writes array indexes in brackets", () => {
    expect(formatPath([])).toBe("");
    expect(formatPath(["rollouts", 3, "task", "id"])).toBe("rollouts[3].task.id");
    expect(formatPath([0, "a"])).toBe("[0].a");
  });
});
