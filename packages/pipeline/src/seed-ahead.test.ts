import { createLogger } from "@fleet/telemetry";
import { afterEach, describe, expect, it } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type SeedAhead, seedAheadBound } from "./worker.ts";

/** The gate alone, over a run queue whose counts the test sets and an empty verify queue (a fake of our deps' queues). */
function gate(waiting: { n: number; counts: number }) {
  const deps = {
    logger: createLogger({ name: "seed-ahead-test", level: "silent" }),
    // No other process seeds.
    store: { shareSeeding: async () => 0, saySeeding: async () => {}, forgetSeeding: async () => {} },
    queues: {
      queues: {
        run: {
          getJobCounts: async () => {
            waiting.counts++;
            return { wait: waiting.n, prioritized: 0, delayed: 0, active: 0 };
          },
        },
        verify: { getJobCounts: async () => ({ wait: 0, prioritized: 0, delayed: 0 }) },
      },
    },
  } as unknown as PipelineDeps;
  return seedAheadBound(deps, { min: 1, intervalMs: 10, recountMs: 1, maxWaitMs: 60_000 });
}

describe("seedAheadBound", () => {
  let g: SeedAhead | undefined;
  afterEach(() => g?.stop());

  it("lets waiting seeds through oldest job first, whatever order they came in", async () => {
    const waiting = { n: 1, counts: 0 };
    g = gate(waiting);
    const signal = new AbortController().signal;
    const passed: string[] = [];
    // A later batch's seed waits first; an earlier batch's seed that went back to its queue and
    // came again arrives after it.
    const later = g.enter(signal, 2_000).then(() => passed.push("later"));
    const earlier = g.enter(signal, 1_000).then(() => passed.push("earlier"));
    // A few counts: both still wait (one rollout waits for an agent already).
    while (waiting.counts < 5) await new Promise((r) => setTimeout(r, 1));
    expect(passed).toEqual([]);
    expect(g.state()).toMatchObject({ held: true, inFlight: 0 });
    waiting.n = 0; // the agent took the waiting rollout: room for one
    await earlier;
    expect(passed).toEqual(["earlier"]);
    g.leave(true); // its run is enqueued: full again
    waiting.n = 0;
    await later;
    expect(passed).toEqual(["earlier", "later"]);
  });
});
