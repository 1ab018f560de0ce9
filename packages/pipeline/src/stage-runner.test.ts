import { FleetError } from "@fleet/contracts";
import { STAGES } from "@fleet/queue";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { describe, expect, it } from "vitest";
import { asFleetError, type StageRunOutcome } from "./stage-runner.ts";

describe("asFleetError", () => {
  it("names the fleet's Redis in the reason when it is what failed (down, or refusing writes)", () => {
    const oom = Object.assign(new Error("OOM command not allowed when used memory > 'maxmemory'."), {
      name: "ReplyError",
    });
    for (const err of [oom, new Error("Connection is closed.")]) {
      const fe = asFleetError(err);
      expect([fe.kind, fe.retryable]).toEqual(["provider_unavailable", true]);
      expect(fe.message).toBe(`the fleet's Redis cannot serve now: ${err.message}`);
      expect(fe.cause).toBe(err);
    }
  });

  it("keeps any other error's words, and a FleetError as it is", () => {
    expect(asFleetError(new Error("docker exec failed: socket hang up")).message).toBe(
      "docker exec failed: socket hang up",
    );
    const fe = FleetError.nonRetryable("sandbox_lost", "gone");
    expect(asFleetError(fe)).toBe(fe);
  });
});

describe("fleet_stage_jobs_total", () => {
  it("starts at 0 for every outcome a stage job can end with (superseded included), so rate() sees its first", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "x", defaultMetrics: false }));
    // Every `StageRunOutcome` (the typecheck fails when one is added and not listed here).
    const outcomes: Record<StageRunOutcome, true> = {
      ok: true,
      replayed: true,
      skipped: true,
      unknown: true,
      superseded: true,
    };
    const series = (await metrics.stageJobs.get()).values;
    for (const stage of STAGES) {
      for (const outcome of Object.keys(outcomes)) {
        expect(series).toContainEqual({ labels: { stage, outcome }, value: 0 });
      }
    }
  });
});
