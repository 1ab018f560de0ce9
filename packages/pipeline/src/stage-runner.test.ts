import { FleetError } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { asFleetError } from "./stage-runner.ts";

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
