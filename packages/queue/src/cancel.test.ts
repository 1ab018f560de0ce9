import { describe, expect, it } from "vitest";
import { currentStage } from "./cancel.ts";

describe("the stage a cancel is recorded in", () => {
  it.each([
    ["queued for its seed", { stage: "admission", times: { accepted: 1 } }, "admission"],
    ["seeding", { stage: "admission", times: { "seed:start": 2 } }, "seed"],
    ["seeded, its run queued", { stage: "seed", times: { "seed:start": 2, "seed:end": 3 } }, "seed"],
    ["its agent running", { stage: "seed", times: { "seed:end": 3, "run:start": 4 } }, "run"],
    ["its tests running", { stage: "run", times: { "run:end": 5, "verify:start": 6 } }, "verify"],
    ["closing", { stage: "verify", times: { "verify:end": 7, "close:start": 8 } }, "close"],
    ["unknown", null, "admission"],
  ] as const)("%s: %s", (_what, record, stage) => {
    expect(currentStage(record as { stage: string; times: Record<string, number> } | null)).toBe(stage);
  });
});
