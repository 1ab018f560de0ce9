import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { createFleetMetrics, createLogger, createMetricsRegistry } from "@fleet/telemetry";
import { describe, expect, it } from "vitest";
import { ProviderUnreachableError, providerReady, testsTamperCheck, waitForProvider } from "./app.ts";
import type { PipelineDeps } from "./deps.ts";

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

describe("providerReady", () => {
  const gauge = async (metrics: ReturnType<typeof createFleetMetrics>) =>
    (await metrics.sandboxProviderUp.get()).values.map((v) => v.value);

  it("exports the provider down while it waits, and up once it answers (before the breaker takes over)", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "app-test", defaultMetrics: false }));
    const { provider } = flaky(2);
    const seen: number[][] = [];
    const list = provider.list.bind(provider);
    provider.list = async () => {
      seen.push(await gauge(metrics));
      return list();
    };
    const deps = { provider, metrics } as unknown as PipelineDeps;
    const config = { providerWaitMs: 10_000, sandboxProvider: "docker" as const };
    expect(await providerReady(deps, config, logger, async () => {})).toBe(true);
    expect(seen.slice(1).every((v) => v[0] === 0)).toBe(true); // down while it waited
    expect(await gauge(metrics)).toEqual([1]);
  });

  it("leaves the gauge alone when the provider answers at once", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "app-test", defaultMetrics: false }));
    const deps = { provider: flaky(0).provider, metrics } as unknown as PipelineDeps;
    expect(
      await providerReady(deps, { providerWaitMs: 1_000, sandboxProvider: "docker" }, logger, async () => {}),
    ).toBe(true);
    expect(await gauge(metrics)).toEqual([]);
  });
});

describe("testsTamperCheck (a verifier's start)", () => {
  const risk = "kernel.yama.ptrace_scope is 0, not 1 or more";
  it("says nothing of a kernel that keeps the tests' processes to themselves, required or not", () => {
    expect(testsTamperCheck(null, false, null)).toBeNull();
    expect(testsTamperCheck(null, true, null)).toBeNull();
  });

  it("warns of one that does not, and refuses to start with FLEET_REQUIRE_PTRACE_SCOPE, saying what to set", () => {
    const warned = testsTamperCheck(risk, false, null);
    expect(warned).toEqual({
      warn: expect.stringContaining(`the sandboxes' kernel: ${risk}. The agent's code`),
    });
    const refused = testsTamperCheck(risk, true, null);
    expect(refused).toEqual({
      refuse: expect.stringMatching(
        /^FLEET_REQUIRE_PTRACE_SCOPE is set and the sandboxes' kernel: .*set kernel\.yama\.ptrace_scope=1/,
      ),
    });
    // A remote Docker daemon's host is not seen from here: the operator is told to check it.
    expect(testsTamperCheck(risk, true, "tcp://sandboxes:2376")).toEqual({
      refuse: expect.stringContaining("this host's kernel (check the Docker daemon's host too)"),
    });
  });
});
