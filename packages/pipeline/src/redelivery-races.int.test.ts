import type { SandboxHandle } from "@fleet/contracts";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { runStageJob } from "./stage-runner.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";

const job = (id: string, processedOn?: number, attemptsMade = 0) => ({
  data: { rolloutId: id },
  attemptsMade,
  opts: { attempts: 3 },
  ...(processedOn === undefined ? {} : { processedOn }),
});

/** `provider` with some methods replaced; the others are the provider's own, called on it. */
function patched(
  provider: InMemorySandboxProvider,
  methods: Partial<InMemorySandboxProvider>,
): InMemorySandboxProvider {
  return new Proxy(provider, {
    get(target, prop) {
      if (Object.hasOwn(methods, prop)) return methods[prop as keyof typeof methods];
      const value: unknown = Reflect.get(target, prop, target);
      return typeof value === "function" ? value.bind(target) : value;
    },
  });
}

describe("stage jobs delivered twice (a stalled job taken over while its first worker goes on)", () => {
  let fleet: InProcessFleet | undefined;
  afterEach(async () => fleet?.close());

  async function start(provider: InMemorySandboxProvider, deps: Partial<PipelineDeps> = {}) {
    fleet = await startInProcessFleet({ provider, startWorkers: false, deps });
    const suite = await loadSuite(EXAMPLE_SUITE_DIR);
    const task = suite.find((t) => t.id === "hello-file")!;
    const [id] = (await fleet.submit([{ task, agent: { harness: "oracle" } }])) as [string];
    return id;
  }

  /**
   * Before the seed fence, the first delivery stored its sandbox in the receipt (and enqueued
   * run) after the second began; the second then found that sandbox by its labels and replaced
   * it, and stored nothing ("taken"), destroying its own too: the run met no sandbox (masked).
   */
  it("a seed taken over keeps the sandbox the first delivery stored in its receipt (the takeover never destroys it)", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    // The first delivery: its lock lapsed (it was paused) while it probed its sandbox.
    const probing = latch();
    const goOn = latch();
    const first = runStageJob("seed", job(id, Date.now() - 60_000), {
      ...deps,
      provider: patched(provider, {
        probe: async (h: SandboxHandle) => {
          probing.open();
          await goOn.opened;
          return provider.probe(h);
        },
      }),
    });
    await probing.opened;
    // The second delivery begins (no receipt yet); the first goes on to store its receipt before
    // the second looks for an earlier attempt's sandbox (which it replaces: it may be unstaged).
    let runJobAfterFirst: unknown = null;
    const second = runStageJob("seed", job(id), {
      ...deps,
      provider: patched(provider, {
        find: async (rolloutId: string, owner: SandboxHandle["owner"]) => {
          goOn.open();
          await first;
          runJobAfterFirst = await deps.queues.queues.run.getJob(`${id}.run`);
          return provider.find(rolloutId, owner);
        },
      }),
    });
    await second;
    await first;
    // The first stored nothing, so it enqueued no run (one would spend its attempts waiting).
    expect(runJobAfterFirst).toBeFalsy();
    const rec = await deps.store.get(id);
    const handle = rec!.receipts.seed!.handle;
    // The rollout's sandbox (the one its run job works in) is there.
    expect(await provider.alive(handle)).toBe(true);
    // And no other sandbox of the rollout is left behind.
    expect((await provider.list()).map((s) => s.handle.id)).toEqual([handle.id]);
    // Its agent runs there (not masked as a lost sandbox).
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
    expect((await deps.store.get(id))!.receipts.run?.cleanup.confirmed).toBe(true);
  });

  /**
   * The earlier delivery, on the job's last attempt, fails because the later one replaced its
   * sandbox under it (an earlier attempt's sandbox, as far as the later one can tell): its failure
   * is not the rollout's. Recorded, it masked a rollout the later delivery seeded.
   */
  it("a seed taken over records no failure of its own once a later delivery began", async () => {
    const provider = new InMemorySandboxProvider();
    const id = await start(provider);
    const deps = fleet!.deps;
    const probing = latch();
    const goOn = latch();
    // Its last attempt (3 of 3), its lock lapsed while it probed its sandbox.
    const first = runStageJob("seed", job(id, Date.now() - 60_000, 2), {
      ...deps,
      provider: patched(provider, {
        probe: async (h: SandboxHandle) => {
          probing.open();
          await goOn.opened;
          return provider.probe(h);
        },
      }),
    }).catch((err: unknown) => err);
    await probing.opened;
    // The later delivery replaces that sandbox and seeds the rollout.
    expect(await runStageJob("seed", job(id, undefined, 2), deps)).toBe("ok");
    goOn.open();
    // The earlier one's probe meets its sandbox gone.
    expect(await first).toBe("superseded");
    const rec = (await deps.store.get(id))!;
    expect(rec.failure).toBeNull();
    expect(await provider.alive(rec.receipts.seed!.handle)).toBe(true);
    expect(await runStageJob("run", job(id), deps)).toBe("ok");
  });
});
