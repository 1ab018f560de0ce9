import { TaskContent } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { describeIssues, formatPath } from "./zod-issues.ts";

describe("formatPath", () => {
  it("writes array indexes in brackets", () => {
    expect(formatPath([])).toBe("");
    expect(formatPath(["rollouts", 3, "task", "id"])).toBe("rollouts[3].task.id");
    expect(formatPath([0, "a"])).toBe("[0].a");
  });
});

describe("describeIssues", () => {
  it("says why a record key was refused, at the key, instead of 'Invalid key in record'", () => {
    const r = TaskContent.safeParse({
      id: "t",
      instruction: "i",
      image: "img",
      tests: { "test.sh": "exit 0" },
      workspace: { ".": "x", "../up": "y" },
    });
    expect(describeIssues(r.error!.issues)).toEqual([
      { path: "workspace..", message: "must name a file, not '.' or the directory itself" },
      { path: "workspace.../up", message: "must be a relative path without '..'" },
    ]);
  });
});
