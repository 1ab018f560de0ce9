import { describe, expect, it } from "vitest";
import { beforeStart, FleetError, isFleetError, withUsage } from "./errors.ts";

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

describe("FleetError.usage", () => {
  const usage = { calls: 3, promptTokens: 30, completionTokens: 9, cachedTokens: null, gaps: ["x"] };

  it("withUsage carries the usage on a copy that keeps kind, retryability, message, cause and nothingStarted", () => {
    const cause = new Error("ECONNRESET");
    const err = beforeStart(FleetError.nonRetryable("provider_unavailable", "upstream gone", cause));
    const carried = withUsage(err, usage);
    expect(carried).toMatchObject({
      kind: "provider_unavailable",
      retryable: false,
      message: "upstream gone",
      nothingStarted: true,
      usage,
    });
    expect((carried as FleetError).cause).toBe(cause);
    expect(err.usage).toBe(null);
    // beforeStart keeps it too.
    expect(beforeStart(FleetError.retryable("sandbox_lost", "gone")).usage).toBe(null);
    expect(
      beforeStart(withUsage(FleetError.retryable("sandbox_lost", "gone"), usage) as FleetError).usage,
    ).toEqual(usage);
  });

  it("withUsage keeps the usage an error already carries, and leaves other errors and a null usage alone", () => {
    const first = withUsage(FleetError.retryable("sandbox_lost", "gone"), usage);
    expect(withUsage(first, { ...usage, calls: 99 })).toBe(first);
    const plain = new Error("plain");
    expect(withUsage(plain, usage)).toBe(plain);
    const bare = FleetError.retryable("sandbox_lost", "gone");
    expect(withUsage(bare, null)).toBe(bare);
  });
});
