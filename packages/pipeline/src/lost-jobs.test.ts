import { describe, expect, it } from "vitest";
import { expectedStage } from "./lost-jobs.ts";

const receipt = {} as never;

describe("the stage job an open rollout waits on", () => {
  it.each([
    ["admitted", { closed: false, failure: null, receipts: {} }, "seed"],
    ["seeded", { closed: false, failure: null, receipts: { seed: receipt } }, "run"],
    ["its agent done", { closed: false, failure: null, receipts: { seed: receipt, run: receipt } }, "verify"],
    [
      "graded",
      { closed: false, failure: null, receipts: { seed: receipt, run: receipt, verify: receipt } },
      "close",
    ],
    [
      "a terminal failure recorded",
      { closed: false, failure: receipt, receipts: { seed: receipt } },
      "close",
    ],
    ["closing", { closed: true, failure: null, receipts: {} }, "close"],
  ] as const)("%s: %s", (_what, rec, stage) => {
    expect(expectedStage(rec as Parameters<typeof expectedStage>[0])).toBe(stage);
  });
});
