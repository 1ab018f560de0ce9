import { createLogger } from "@fleet/telemetry";
import { afterEach, describe, expect, it, vi } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type SeedAhead, seedAheadBound } from "./worker.ts";

/**
 * The gate alone, over a run queue whose counts the test sets (or that refuses them: `down`) and
 * an empty verify queue, and a store where no other process seeds (whose writes Redis refuses:
 * `full`), fakes of our deps' queues and store.
 */
function gate(
  waiting: {
    n: number;
    counts: number;
    down?: boolean;
    full?: boolean;
    at?: number[];
    /** Calls of the store's seeding methods. */
    said?: { shares: number; forgets: number };
    /** The rollouts whose seeds make no sandbox (`seedsSkipped`), and its calls (when, for which). */
    skipped?: { ids: Set<string>; looks: Array<{ at: number; ids: string[] }> };
  },
  options: { intervalMs: number; recountMs: number } = { intervalMs: 10, recountMs: 1 },
) {
  const refused = async () => {
    throw new Error("OOM command not allowed when used memory > 'maxmemory'.");
  };
  const deps = {
    logger: createLogger({ name: "seed-ahead-test", level: "silent" }),
    store: {
      shareSeeding: async () => {
        if (waiting.said) waiting.said.shares++;
        return waiting.full ? refused() : 0;
      },
      saySeeding: async () => (waiting.full ? refused() : undefined),
      seedsSkipped: async (ids: string[]) => {
        waiting.skipped?.looks.push({ at: Date.now(), ids: [...ids] });
        return ids.map((id) => waiting.skipped?.ids.has(id) ?? false);
      },
      forgetSeeding: async () => {
        if (waiting.said) waiting.said.forgets++;
      },
    },
    queues: {
      queues: {
        run: {
          getJobCounts: async () => {
            waiting.counts++;
            waiting.at?.push(Date.now());
            if (waiting.down) throw new Error("Connection is closed.");
            return { wait: waiting.n, prioritized: 0, delayed: 0, active: 0 };
          },
        },
        verify: { getJobCounts: async () => ({ wait: 0, prioritized: 0, delayed: 0 }) },
      },
    },
  } as unknown as PipelineDeps;
  return seedAheadBound(deps, { min: 1, ...options, maxWaitMs: 60_000 });
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

  it("counts again after a failed count later and later, not at once", async () => {
    const waiting = { n: 0, counts: 0, down: true, at: [] as number[] };
    g = gate(waiting, { intervalMs: 60_000, recountMs: 2 });
    const entered = g.enter(new AbortController().signal, 1);
    entered.catch(() => undefined);
    while (waiting.at.length < 7) await new Promise((r) => setTimeout(r, 5));
    // After each failure twice as long as after the one before: 8 + 16 + 32 + 64 + 128 = 248 ms
    // at least between the second count and the seventh (half of it asserted), all at once
    // without the backoff.
    expect(waiting.at[6]! - waiting.at[1]!).toBeGreaterThanOrEqual(124);
  });

  it("while it shuts down with seeds in flight, says them again until the last ends, then no more (stopped twice too)", async () => {
    vi.useFakeTimers();
    try {
      const said = { shares: 0, forgets: 0 };
      g = gate({ n: 0, counts: 0, said }, { intervalMs: 20, recountMs: 1 });
      await g.enter(new AbortController().signal, 1);
      g.stop();
      g.stop();
      const atStop = said.shares;
      await vi.advanceTimersByTimeAsync(100);
      expect(said.shares).toBeGreaterThanOrEqual(atStop + 4);
      expect(said.forgets).toBe(0);
      g.leave(true);
      expect(said.forgets).toBe(1);
      const atLast = said.shares;
      await vi.advanceTimersByTimeAsync(200);
      expect(said.shares).toBe(atLast);
    } finally {
      vi.useRealTimers();
    }
  });

  it("lets a seed whose rollout was cancelled while it waited go on uncounted, looking at it once an interval, not at every count", async () => {
    const skipped = { ids: new Set<string>(), looks: [] as Array<{ at: number; ids: string[] }> };
    const waiting = { n: 1, counts: 0, skipped };
    g = gate(waiting, { intervalMs: 40, recountMs: 1 });
    const signal = new AbortController().signal;
    const came = Date.now();
    const cancelled = g.enter(signal, 1, "r1");
    const other = g.enter(signal, 2, "r2");
    // Handed back by the stop after the test, should an assertion end it before they settle.
    for (const p of [cancelled, other]) p.catch(() => undefined);
    // Each waiter on its own interval: on a loaded host the two may come a millisecond apart and
    // be looked at in two counts close together, each still an interval after its last look.
    const looksAt = (id: string) => skipped.looks.filter((l) => l.ids.includes(id)).map((l) => l.at);
    // Counted more often while they wait (the bound is full), looked at once an interval.
    while (looksAt("r1").length < 3) await new Promise((r) => setTimeout(r, 5));
    expect(waiting.counts).toBeGreaterThan(looksAt("r1").length);
    // An interval after they came, then an interval apart (less a few ms of timer slack): looked
    // at every count, the first looks would be 1-2 ms apart (the recount's backoff starts at 1 ms).
    for (const id of ["r1", "r2"]) {
      for (const [i, at] of looksAt(id).entries()) {
        expect(at - (i === 0 ? came : looksAt(id)[i - 1]!), id).toBeGreaterThanOrEqual(35);
      }
    }
    skipped.ids.add("r1");
    expect(await cancelled).toBe(false);
    // Not in flight: the other seed still waits for room, and a seed's `leave` is not owed.
    expect(g.state()).toMatchObject({ held: true, inFlight: 0 });
    waiting.n = 0;
    expect(await other).toBe(true);
    expect(g.state()).toMatchObject({ inFlight: 1 });
  });

  it("counts a bound that stays full later and later, up to intervalMs, and soon again once a seed got through", async () => {
    const waiting = { n: 1, counts: 0, at: [] as number[] };
    g = gate(waiting, { intervalMs: 200, recountMs: 1 });
    const signal = new AbortController().signal;
    const first = g.enter(signal, 1);
    const second = g.enter(signal, 2);
    second.catch(() => undefined);
    while (waiting.at.length < 12) await new Promise((r) => setTimeout(r, 5));
    // 1, 2, 4, ... 128 ms apart, then 200 (with the interval's own counts in between): ~1 ms apart
    // all along without the backoff (2,500 Redis commands/s from one idle resources worker).
    expect(waiting.at[11]! - waiting.at[7]!).toBeGreaterThanOrEqual(150);
    waiting.n = 0;
    await first;
    // Let through: the next count soon, not an interval later (the second waits, the bound full
    // with the first in flight).
    const through = Date.now();
    const seen = waiting.at.length;
    while (waiting.at.length < seen + 2) await new Promise((r) => setTimeout(r, 1));
    expect(waiting.at[seen + 1]! - through).toBeLessThan(100);
    expect(g.state()).toMatchObject({ held: true, inFlight: 1 });
  });

  it("a seed let through by the interval's count (not the backed-off recount's) brings the next count forward: the seeds behind it are counted for again soon, not up to an interval later", async () => {
    vi.useFakeTimers({ now: 0 });
    try {
      const waiting = { n: 1, counts: 0, at: [] as number[] };
      g = gate(waiting, { intervalMs: 200, recountMs: 1 });
      const signal = new AbortController().signal;
      // Entered 150 ms into an interval: the backed-off recounts fall ~140 ms after the interval's.
      await vi.advanceTimersByTimeAsync(150);
      const first = g.enter(signal, 1);
      const second = g.enter(signal, 2);
      second.catch(() => undefined);
      // Full for seconds: counted every interval, and ~as often by the recounts, backed off.
      await vi.advanceTimersByTimeAsync(3_049); // just before the interval's count at 3,200
      expect(waiting.at.filter((t) => t > 2_200).length).toBeLessThanOrEqual(10);
      waiting.n = 0;
      await vi.advanceTimersByTimeAsync(1);
      await first;
      expect(Date.now()).toBe(3_200);
      const seen = waiting.at.length;
      await vi.advanceTimersByTimeAsync(10);
      // Without bringing it forward: the recount set while the bound was full, 140 ms later.
      expect(waiting.at.length).toBeGreaterThan(seen);
      expect(g.state()).toMatchObject({ held: true, inFlight: 1 });
      // So does one let through at a seed's `leave` (the first ended without a run: room), with
      // the bound full again behind it for long.
      const third = g.enter(signal, 3);
      third.catch(() => undefined);
      await vi.advanceTimersByTimeAsync(2_000); // 10 ms past an interval's count, 45 ms before a recount
      g.leave(false);
      await second;
      const left = waiting.at.length;
      await vi.advanceTimersByTimeAsync(10);
      // Without it: the recount set while the bound was full, up to an interval later.
      expect(waiting.at.length).toBeGreaterThan(left);
    } finally {
      vi.useRealTimers();
    }
  });

  it("a Redis that refuses writes (full) does not fail a count: the seeds this process says are not what it counts by", async () => {
    const waiting = { n: 0, counts: 0, full: true };
    g = gate(waiting);
    await g.enter(new AbortController().signal, 1);
    expect(g.state()).toMatchObject({ inFlight: 1 });
  });
});
