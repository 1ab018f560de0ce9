import { describe, expect, it } from "vitest";
import { maxBackoffMs, STAGE_CATALOG, STAGES } from "./catalog.ts";

/** The longest a stage's job can spend in backoff over all its attempts (jitter only shortens it). */
function totalBackoffMs(stage: (typeof STAGES)[number]): number {
  const attempts = STAGE_CATALOG[stage].options.attempts ?? 1;
  let total = 0;
  for (let made = 1; made < attempts; made++) total += maxBackoffMs(stage, made);
  return total;
}

describe("stage catalog", () => {
  it("every stage's backoff rides out a half-minute outage", () => {
    for (const stage of STAGES) expect(totalBackoffMs(stage), stage).toBeGreaterThanOrEqual(30_000);
  });

  it("every stage's retries are jittered exponential backoff (DESIGN §2 rule 5: a fleet-wide outage must not retry in lockstep)", () => {
    for (const stage of STAGES) {
      const backoff = STAGE_CATALOG[stage].options.backoff;
      expect(backoff, stage).toMatchObject({ type: "exponential" });
      expect((backoff as { jitter?: number }).jitter, stage).toBeGreaterThan(0);
    }
  });

  it("close retries for about half an hour, never for days", () => {
    expect(totalBackoffMs("close")).toBeLessThanOrEqual(3_600_000);
    expect(maxBackoffMs("close", (STAGE_CATALOG.close.options.attempts ?? 1) - 1)).toBeLessThanOrEqual(
      20 * 60_000,
    );
  });
});
