import { describe, expect, it } from "vitest";
import {
  etaMs,
  formatDuration,
  ProgressReporter,
  type ProgressSnapshot,
  RateMeter,
  renderProgress,
} from "./progress.ts";

const snap = (over: Partial<ProgressSnapshot> = {}): ProgressSnapshot => ({
  done: 35,
  total: 100,
  masked: 1,
  failed: 2,
  elapsedMs: 14_000,
  ratePerS: 2.5,
  ...over,
});

describe("formatDuration", () => {
  it("formats seconds, minutes, hours and days", () => {
    expect(formatDuration(0)).toBe("0s");
    expect(formatDuration(42_400)).toBe("42s");
    expect(formatDuration(185_000)).toBe("3m05s");
    expect(formatDuration(3_720_000)).toBe("1h02m");
    expect(formatDuration(200 * 3_600_000)).toBe("8d08h");
    expect(formatDuration(null)).toBe("--");
    expect(formatDuration(Number.POSITIVE_INFINITY)).toBe("--");
  });
});

describe("renderProgress", () => {
  it("draws a bar with counts, rate, ETA, masked and failed", () => {
    expect(renderProgress(snap(), { width: 120 })).toBe(
      `[${"#".repeat(14)}${".".repeat(26)}]   35/100   35%  2.5/s  ETA 26s  masked 1  failed 2  elapsed 14s`,
    );
  });

  it("shrinks the bar to fit, and drops it on a narrow terminal", () => {
    for (const width of [80, 90, 100]) expect(renderProgress(snap(), { width }).length).toBe(width - 1);
    const line = renderProgress(snap(), { width: 80 });
    expect(line).toMatch(/^\[#+\.+\] +35\/100/);
    const narrow = renderProgress(snap(), { width: 50 });
    expect(narrow.startsWith("[")).toBe(false);
    expect(narrow.length).toBeLessThan(50);
  });

  it("renders a plain line for logs", () => {
    expect(renderProgress(snap(), { bar: false })).toBe(
      "progress 35/100 (35.0%) rate 2.5/s eta 26s masked 1 failed 2 elapsed 14s",
    );
  });

  it("shows unknown rate and ETA before there is history, and slow rates per minute", () => {
    expect(renderProgress(snap({ ratePerS: null }), { bar: false })).toContain("rate --/s eta --");
    expect(renderProgress(snap({ ratePerS: 0.05 }), { bar: false })).toContain("rate 3.0/min eta 21m40s");
    expect(renderProgress(snap({ ratePerS: 0 }), { bar: false })).toContain("rate 0/s eta --");
  });

  it("shows a full bar and zero ETA when done, and copes with an empty batch", () => {
    expect(renderProgress(snap({ done: 100 }), { width: 120 })).toContain(
      `[${"#".repeat(40)}]  100/100  100%`,
    );
    expect(etaMs(snap({ done: 100, ratePerS: null }))).toBe(0);
    expect(renderProgress(snap({ done: 0, total: 0 }), { bar: false })).toContain("progress 0/0 (100.0%)");
    // Rounded down: a batch one short of done is never shown at 100.0%.
    expect(renderProgress(snap({ done: 1999, total: 2000 }), { bar: false })).toContain("(99.9%)");
    expect(renderProgress(snap({ done: 999_999, total: 1_000_000 }), { bar: false })).toContain("(99.9%)");
    expect(renderProgress(snap({ done: 2000, total: 2000 }), { bar: false })).toContain("(100.0%)");
  });
});

describe("RateMeter", () => {
  it("needs a second of history, then measures over its window", () => {
    const m = new RateMeter(10_000);
    m.add(0, 0);
    expect(m.rate()).toBeNull();
    m.add(500, 5);
    expect(m.rate()).toBeNull();
    m.add(2_000, 10);
    expect(m.rate()).toBe(5);
    m.add(20_000, 10); // stalled: the window now starts at 2 s
    m.add(22_000, 10);
    expect(m.rate()).toBeCloseTo(0, 5);
  });
});

/** A stream that records writes. */
function recorder(isTTY: boolean) {
  const writes: string[] = [];
  return { writes, stream: { isTTY, columns: 100, write: (s: string) => writes.push(s) } };
}

describe("ProgressReporter", () => {
  it("rewrites one line in place on a TTY and ends it on finish", () => {
    let now = 0;
    const { writes, stream } = recorder(true);
    const r = new ProgressReporter(stream, { now: () => now });
    r.update({ done: 0, total: 10, masked: 0, failed: 0 });
    now = 1_000;
    r.update({ done: 0, total: 10, masked: 0, failed: 0 }); // same text apart from elapsed
    now = 2_000;
    r.update({ done: 4, total: 10, masked: 1, failed: 0 });
    r.finish({ done: 10, total: 10, masked: 1, failed: 0 });
    r.finish({ done: 10, total: 10, masked: 1, failed: 0 });
    expect(writes.every((w) => w.startsWith("\r") && w.includes("\x1b[K"))).toBe(true);
    expect(writes.slice(0, -1).some((w) => w.includes("\n"))).toBe(false);
    expect(writes.at(-1)).toMatch(/10\/10 {2}100%.*\n$/);
    expect(writes).toHaveLength(4);
  });

  it("prints plain lines at most once per interval without a TTY, plus the final one", () => {
    let now = 0;
    const { writes, stream } = recorder(false);
    const r = new ProgressReporter(stream, { now: () => now, plainIntervalMs: 10_000 });
    for (let t = 0; t <= 25_000; t += 1_000) {
      now = t;
      r.update({ done: t / 1000, total: 30, masked: 0, failed: 0 });
    }
    now = 26_000;
    r.finish({ done: 30, total: 30, masked: 0, failed: 0 });
    expect(writes).toHaveLength(4); // at 0 s, 10 s, 20 s, and the final line
    expect(writes.every((w) => w.startsWith("progress ") && w.endsWith("\n"))).toBe(true);
    expect(writes[1]).toContain("progress 10/30");
    expect(writes.at(-1)).toContain("progress 30/30 (100.0%)");
  });

  it("draws at 80 columns on a TTY that reports a width of 0 (its size never set)", () => {
    const writes: string[] = [];
    const r = new ProgressReporter({ isTTY: true, columns: 0, write: (s: string) => writes.push(s) });
    r.update({ done: 1, total: 4, masked: 0, failed: 0 });
    r.finish({ done: 4, total: 4, masked: 0, failed: 0 });
    expect(writes[0]).toMatch(/^\r\[#+\.+\] {2}1\/4 {3}25%.*elapsed 0s/);
    expect(writes[0]?.endsWith("\x1b[K")).toBe(true);
    expect(writes[1]).toMatch(/^\r\[#+\] {2}4\/4 {2}100%/);
    expect(writes.every((w) => w.length <= 80 + "\r\x1b[K\n".length)).toBe(true);
  });

  it("clears the TTY line for output to another stream (stdout on the same terminal) and redraws it after", async () => {
    const { writes, stream } = recorder(true);
    const r = new ProgressReporter(stream);
    r.update({ done: 1, total: 2, masked: 0, failed: 0 });
    const line = writes[0]?.slice(1, -"\x1b[K".length);
    await r.aside(async () => void writes.push("b-2\n"));
    expect(writes.slice(1)).toEqual(["\r\x1b[K", "b-2\n", line]);
    // Without a TTY, or with no line drawn, nothing but the output itself.
    const plain = recorder(false);
    const p = new ProgressReporter(plain.stream, { plainIntervalMs: 0 });
    p.update({ done: 1, total: 2, masked: 0, failed: 0 });
    await p.aside(async () => void plain.writes.push("b-2\n"));
    expect(plain.writes.slice(1)).toEqual(["b-2\n"]);
  });

  it("ends the TTY line when interrupted", () => {
    const { writes, stream } = recorder(true);
    const r = new ProgressReporter(stream);
    r.update({ done: 1, total: 2, masked: 0, failed: 0 });
    r.interrupt();
    expect(writes.at(-1)).toBe("\n");
  });
});
