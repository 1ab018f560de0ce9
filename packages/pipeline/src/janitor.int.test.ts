import { DockerSandboxProvider, LABEL_ROLLOUT } from "@fleet/sandbox";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { janitorTick, startJanitor } from "./janitor.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";

const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const docker = new DockerSandboxProvider();

describe("janitor", () => {
  let fleet: InProcessFleet;
  beforeAll(async () => {
    fleet = await startInProcessFleet({ provider: docker, startWorkers: false });
  });
  afterAll(async () => fleet.close());

  it("removes a labelled sandbox whose rollout is unknown, but only past the grace period", async () => {
    const orphanId = `orphan${Date.now()}`;
    const handle = await docker.create({
      image: IMAGE,
      rolloutId: orphanId,
      owner: "resources",
      expiresAt: Date.now() + 3_600_000,
    });
    try {
      const fresh = await janitorTick(fleet.deps, { orphanGraceMs: 60_000 });
      expect(fresh.orphansRemoved).toBe(0);
      expect(await docker.alive(handle)).toBe(true);
      const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
      const report = await janitorTick(later, { orphanGraceMs: 60_000 });
      expect(report.orphansRemoved).toBeGreaterThanOrEqual(1);
      expect(await docker.alive(handle)).toBe(false);
    } finally {
      await docker.destroy(handle);
    }
  });

  it("removes a sandbox whose fleet.expires passed, even for a live rollout", async () => {
    const id = `expired${Date.now()}`;
    const handle = await docker.create({
      image: IMAGE,
      rolloutId: id,
      owner: "agent",
      expiresAt: Date.now() + 1000,
    });
    try {
      const later = { ...fleet.deps, now: () => Date.now() + 5000 };
      await janitorTick(later, { orphanGraceMs: 3_600_000 });
      expect((await docker.list()).some((s) => s.labels[LABEL_ROLLOUT] === id)).toBe(false);
    } finally {
      await docker.destroy(handle);
    }
  });

  it("closes a rollout stuck past its deadline as masked deadline_exceeded", async () => {
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE };
    // No workers run: the rollout sits in `accepted` until the watchdog closes it.
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle" }, deadlineS: 1 }]);
    const later = { ...fleet.deps, now: () => Date.now() + 120_000 };
    const report = await janitorTick(later, { orphanGraceMs: 60_000, watchdogGraceMs: 1000 });
    expect(report.watchdogClosed).toBe(1);
    const closeJob = await fleet.deps.queues.queues.close.getJob(`${id}.close`);
    expect(closeJob).toBeTruthy();
  });

  it("replicas share one schedule: two janitors never run a pass at the same time", async () => {
    let active = 0;
    let maxActive = 0;
    let passes = 0;
    const slowDeps = {
      ...fleet.deps,
      ledger: new Proxy(fleet.deps.ledger, {
        get(target, prop, receiver) {
          if (prop === "listSandboxes") {
            return async () => {
              active++;
              maxActive = Math.max(maxActive, active);
              await new Promise((r) => setTimeout(r, 150));
              active--;
              passes++;
              return [];
            };
          }
          const v = Reflect.get(target, prop, receiver);
          return typeof v === "function" ? v.bind(target) : v;
        },
      }),
    };
    const opts = { connection: fleet.redis, prefix: fleet.prefix, intervalMs: 100, orphanGraceMs: 60_000 };
    const a = await startJanitor(slowDeps, opts);
    const b = await startJanitor(slowDeps, opts);
    const end = Date.now() + 30_000;
    while (passes < 5 && Date.now() < end) await new Promise((r) => setTimeout(r, 50));
    await a.close();
    await b.close();
    expect(passes).toBeGreaterThanOrEqual(5);
    expect(maxActive).toBe(1);
  });
});
