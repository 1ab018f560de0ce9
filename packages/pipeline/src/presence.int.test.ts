import { JANITOR_QUEUE } from "@fleet/queue";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { afterEach, describe, expect, it } from "vitest";
import { startJanitor } from "./janitor.ts";
import { keepWorkerPresence } from "./presence.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { until } from "./testing/no-op-stages.ts";

const STAGES = ["seed", "run", "verify", "close"] as const;

/**
 * The worker presence `fleet_queue_workers` counts where Redis refuses CLIENT LIST: each worker
 * process says, on a timer, that it consumes its queues, and takes that back when it closes.
 */
describe("worker presence", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => {
    await fleet?.close();
    fleet = undefined;
  });

  it("stage workers are counted on each of their queues while they run, said again on their interval, and not once closed", async () => {
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      workerOptions: { presence: { intervalMs: 200 } },
    });
    const { store } = fleet.deps;
    const present = () => Promise.all(STAGES.map((s) => store.workersPresent(s, Date.now())));
    await until("the stage workers' presence", async () => (await present()).every((n) => n === 1));
    // Said again: its entry's expiry moves on (a process that stopped saying would drop out).
    const expiry = async () => Object.values(await fleet!.redis.hgetall(store.keys.workers("run")))[0];
    const first = await expiry();
    await until("the presence said again", async () => (await expiry()) !== first);
    await fleet.workers!.close(10_000);
    expect(await present()).toEqual([0, 0, 0, 0]);
    expect(await fleet.redis.hlen(store.keys.workers("run"))).toBe(0);
  });

  it("a saying still unanswered when its process closes does not bring its entry back", async () => {
    fleet = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    const { store } = fleet.deps;
    // The script sent once on the store's connection (ioredis sends a script's first call there
    // as EVAL, the later ones as EVALSHA) ...
    const earlier = keepWorkerPresence(fleet.deps, ["seed"]);
    await until("the earlier presence", async () => (await store.workersPresent("seed", Date.now())) === 1);
    // ... then gone from Redis (a restart, a SCRIPT FLUSH): a saying's EVALSHA is answered
    // NOSCRIPT, and ioredis sends it again only then, behind whatever was sent after it.
    await fleet.redis.script("FLUSH");
    const presence = keepWorkerPresence(fleet.deps, ["run"]);
    await presence.stop();
    await earlier.stop();
    expect(await store.workersPresent("run", Date.now())).toBe(0);
    expect(await fleet.redis.exists(store.keys.workers("run"))).toBe(0);
  });

  it("a janitor is counted on the janitor queue while it runs, and not once closed", async () => {
    fleet = await startInProcessFleet({ provider: new InMemorySandboxProvider(), startWorkers: false });
    const { store } = fleet.deps;
    const janitor = await startJanitor(fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      intervalMs: 60_000,
      orphanGraceMs: 60_000,
    });
    try {
      await until(
        "the janitor's presence",
        async () => (await store.workersPresent(JANITOR_QUEUE, Date.now())) === 1,
      );
    } finally {
      await janitor.close();
    }
    expect(await store.workersPresent(JANITOR_QUEUE, Date.now())).toBe(0);
  });
});
