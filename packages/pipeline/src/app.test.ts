import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { createLogger } from "@fleet/telemetry";
import { describe, expect, it } from "vitest";
import { ProviderUnreachableError, waitForProvider } from "./app.ts";

const logger = createLogger({ name: "app-test", level: "silent" });

/** A provider whose `list` fails `failures` times (or hangs, with `hang`), then answers. */
function flaky(failures: number, hang = false) {
  const provider = new InMemorySandboxProvider();
  let calls = 0;
  provider.list = async () => {
    calls++;
    if (calls <= failures) {
      if (hang) return new Promise(() => {});
      throw new Error("connect ECONNREFUSED 127.0.0.1:2375");
    }
    return [];
  };
  return { provider, calls: () => calls };
}

describe("waitForProvider", () => {
  it("waits through failures until the provider answers, telling onDown once", async () => {
    const { provider, calls } = flaky(2);
    let downs = 0;
    await waitForProvider(provider, logger, 10_000, { onDown: () => downs++ });
    expect(calls()).toBe(3);
    expect(downs).toBe(1);
    // Reachable at once: never down.
    await waitForProvider(flaky(0).provider, logger, 10_000, { onDown: () => downs++ });
    expect(downs).toBe(1);
  });

  it("gives up after the wait with what failed, where, and what to check", async () => {
    const { provider, calls } = flaky(Number.POSITIVE_INFINITY);
    const started = Date.now();
    const err = await waitForProvider(provider, logger, 600, { hint: "Set DOCKER_HOST" }).catch((e) => e);
    expect(err).toBeInstanceOf(ProviderUnreachableError);
    expect(err.message).toMatch(/cannot reach the docker sandbox provider at .+: connect ECONNREFUSED/);
    expect(err.message).toContain("Set DOCKER_HOST");
    expect(calls()).toBeGreaterThan(1);
    expect(Date.now() - started).toBeLessThan(5_000);
  });

  it("a provider that never answers counts as unreachable, not as a hang", async () => {
    const { provider } = flaky(Number.POSITIVE_INFINITY, true);
    const err = await waitForProvider(provider, logger, 300, { callTimeoutMs: 100 }).catch((e) => e);
    expect(err).toBeInstanceOf(ProviderUnreachableError);
    expect(err.message).toContain("no answer within 100 ms");
  });
});
