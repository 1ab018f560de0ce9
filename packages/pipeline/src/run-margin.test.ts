import { AGENT_OVERRUN_MS, RUN_MARGIN_MS } from "@fleet/contracts";
import { KILL_GRACE_S } from "@fleet/sandbox";
import { describe, expect, it } from "vitest";
import { DEADLINE_SWEEP_AFTER_MS } from "./stages.ts";

describe("the run's margin", () => {
  it("holds the most an agent's command outlives its deadline by (its kill grace, then the run stage's own sweep) apart from the fleet's own 5 s", () => {
    expect(KILL_GRACE_S * 1000 + DEADLINE_SWEEP_AFTER_MS).toBeLessThan(AGENT_OVERRUN_MS);
    expect(RUN_MARGIN_MS - AGENT_OVERRUN_MS).toBe(5_000);
  });
});
