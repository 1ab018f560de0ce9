import { FleetError } from "@fleet/contracts";
import { STAGES } from "@fleet/queue";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { describe, expect, it } from "vitest";
import { asFleetError, isRedisRefusal, type StageRunOutcome } from "./stage-runner.ts";

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

describe("isRedisRefusal", () => {
  const oom = () =>
    Object.assign(new Error("OOM command not allowed when used memory > 'maxmemory'."), {
      name: "ReplyError",
    });
  it("is what ioredis throws when Redis refuses or is out of reach, as it is or as a retryable stage error's cause", () => {
    const readOnly = Object.assign(new Error("READONLY You can't write against a read only replica."), {
      name: "ReplyError",
    });
    const maxRetries = Object.assign(new Error("Reached the max retries per request limit"), {
      name: "MaxRetriesPerRequestError",
    });
    for (const err of [oom(), readOnly, maxRetries, new Error("Connection is closed.")]) {
      expect(isRedisRefusal(err)).toBe(true);
      expect(isRedisRefusal(FleetError.retryable("provider_unavailable", "could not note it", err))).toBe(
        true,
      );
    }
  });

  it("is never a final failure, nor an error that only quotes Redis's words (a model upstream's body, a test's output)", () => {
    expect(isRedisRefusal(FleetError.nonRetryable("provider_unavailable", "upstream gave up", oom()))).toBe(
      false,
    );
    // The words, in a stage's own message or an error of someone else's: not Redis's.
    const quoted = "the model upstream failed: HTTP 502: Connection is closed.";
    expect(isRedisRefusal(FleetError.retryable("provider_unavailable", quoted))).toBe(false);
    expect(isRedisRefusal(FleetError.nonRetryable("agent_error", quoted))).toBe(false);
    expect(isRedisRefusal(new Error(quoted))).toBe(false);
    expect(isRedisRefusal(new Error("OOM command not allowed when used memory > 'maxmemory'."))).toBe(false);
    expect(isRedisRefusal(FleetError.retryable("sandbox_lost", "gone", new Error("socket hang up")))).toBe(
      false,
    );
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
      stray: true,
    };
    const series = (await metrics.stageJobs.get()).values;
    for (const stage of STAGES) {
      for (const outcome of Object.keys(outcomes)) {
        expect(series).toContainEqual({ labels: { stage, outcome }, value: 0 });
      }
    }
  });
});
