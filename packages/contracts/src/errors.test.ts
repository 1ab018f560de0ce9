import { describe, expect, it } from "vitest";
import { beforeStart, FleetError, isFleetError } from "./errors.ts";

describe("FleetError.nothingStarted", () => {
  it("is false unless a provider says so: a failure is not taken for one before anything started", () => {
    expect(
      FleetError.retryable("provider_unavailable", "docker exec failed: socket hang up").nothingStarted,
    ).toBe(false);
    expect(new FleetError("sandbox_lost", "gone").nothingStarted).toBe(false);
  });

  it("beforeStart marks an error, keeping its kind, retryability, message and cause", () => {
    const cause = new Error("connect ECONNREFUSED /var/run/docker.sock");
    const err = FleetError.nonRetryable("provider_unavailable", "docker exec failed", cause);
    const marked = beforeStart(err);
    expect(isFleetError(marked)).toBe(true);
    expect(marked).toMatchObject({
      kind: "provider_unavailable",
      retryable: false,
      message: "docker exec failed",
      nothingStarted: true,
    });
    expect(marked.cause).toBe(cause);
    expect(err.nothingStarted).toBe(false);
    expect(beforeStart(marked)).toBe(marked);
  });
});
