import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { createFleetMetrics, createLogger, createMetricsRegistry } from "@fleet/telemetry";
import { describe, expect, it, vi } from "vitest";
import { watchProvider } from "./provider-gate.ts";

const logger = createLogger({ name: "provider-gate-test", level: "silent" });

describe("watchProvider", () => {
  it("down at once is told (gauge 0) and probed with backoff until it answers (gauge 1); a later failure trips it again", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "gate-test", defaultMetrics: false }));
    const gauge = async () => (await metrics.sandboxProviderUp.get()).values.map((v) => v.value);
    const provider = new InMemorySandboxProvider();
    let failing = 3;
    let calls = 0;
    const list = provider.list.bind(provider);
    provider.list = async () => {
      calls++;
      if (failing > 0) {
        failing--;
        throw new Error("connect ENOENT /tmp/nonexistent.sock");
      }
      return list();
    };
    const gate = await watchProvider({ provider, logger, metrics }, { firstDelayMs: 10 });
    try {
      expect(gate.up).toBe(false);
      expect(await gauge()).toEqual([0]);
      await vi.waitFor(() => expect(gate.up).toBe(true), { timeout: 5_000, interval: 10 });
      expect(calls).toBe(4);
      expect(await gauge()).toEqual([1]);
      failing = 1;
      gate.trip("docker list failed");
      expect(gate.up).toBe(false);
      expect(await gauge()).toEqual([0]);
      await vi.waitFor(() => expect(gate.up).toBe(true), { timeout: 5_000, interval: 10 });
    } finally {
      gate.stop();
    }
  });

  it("up at once says so (gauge 1), and stops probing once stopped", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "gate-test", defaultMetrics: false }));
    const provider = new InMemorySandboxProvider();
    const gate = await watchProvider({ provider, logger, metrics });
    expect(gate.up).toBe(true);
    expect((await metrics.sandboxProviderUp.get()).values.map((v) => v.value)).toEqual([1]);
    gate.stop();
    gate.trip("after stop");
    expect(gate.up).toBe(true);
  });
});
