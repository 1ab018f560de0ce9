/** What the progress line shows; `ratePerS` null until there is enough history. */
export interface ProgressSnapshot {
  done: number;
  total: number;
  masked: number;
  failed: number;
  elapsedMs: number;
  ratePerS: number | null;
}

/** `1h02m`, `3m05s`, `42s`; `--` for unknown. */
export function formatDuration(ms: number | null): string {
  if (ms === null || !Number.isFinite(ms) || ms < 0) return "--";
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${String(s % 60).padStart(2, "0")}s`;
  const h = Math.floor(m / 60);
  if (h < 100) return `${h}h${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(h / 24)}d${String(h % 24).padStart(2, "0")}h`;
}

function formatRate(rate: number | null): string {
  if (rate === null) return "--/s";
  if (rate >= 100) return `${Math.round(rate)}/s`;
  if (rate >= 1) return `${rate.toFixed(1)}/s`;
  if (rate > 0) return `${(rate * 60).toFixed(1)}/min`;
  return "0/s";
}

/** Seconds until done at the current rate; null when unknown (no rate yet, or stalled). */
export function etaMs(s: ProgressSnapshot): number | null {
  const left = Math.max(0, s.total - s.done);
  if (left === 0) return 0;
  if (s.ratePerS === null || s.ratePerS <= 0) return null;
  return (left / s.ratePerS) * 1000;
}

export interface RenderOptions {
  /** Terminal width; the bar shrinks or disappears to fit. @defaultValue 80 */
  width?: number;
  /** Draw a bar (TTY) or write a plain, greppable line (logs). @defaultValue true */
  bar?: boolean;
}

/**
 * One progress line, e.g.
 * `[#######.............]  35/100  35%  2.5/s  ETA 26s  masked 1  failed 0  elapsed 14s`
 * (bar) or `progress 35/100 (35.0%) rate 2.5/s eta 26s masked 1 failed 0 elapsed 14s` (plain).
 * Pure: the same snapshot always renders the same text.
 */
/**
 * `done` of `total` as a percentage with one decimal, rounded down: 1999 of 2000 is 99.9, never
 * the 100.0 `toFixed` rounds it to while the batch still runs. 100.0 for an empty total.
 */
export function percent(done: number, total: number): string {
  if (total <= 0) return "100.0";
  return (Math.floor((Math.min(done, total) / total) * 1000) / 10).toFixed(1);
}

export function renderProgress(s: ProgressSnapshot, options: RenderOptions = {}): string {
  const fraction = s.total > 0 ? Math.min(1, s.done / s.total) : 1;
  const eta = formatDuration(etaMs(s));
  const rate = formatRate(s.ratePerS);
  const elapsed = formatDuration(s.elapsedMs);
  if (options.bar === false) {
    return (
      `progress ${s.done}/${s.total} (${percent(s.done, s.total)}%) rate ${rate} eta ${eta} ` +
      `masked ${s.masked} failed ${s.failed} elapsed ${elapsed}`
    );
  }
  const text =
    `${String(s.done).padStart(String(s.total).length)}/${s.total}  ${String(Math.floor(fraction * 100)).padStart(3)}%` +
    `  ${rate}  ETA ${eta}  masked ${s.masked}  failed ${s.failed}  elapsed ${elapsed}`;
  const width = options.width ?? 80;
  const room = width - text.length - 5; // "[", "]", two spaces, and never the last column (no wrap)
  if (room < 10) return text.slice(0, Math.max(0, width - 1));
  const barWidth = Math.min(40, room);
  const filled = Math.floor(fraction * barWidth);
  return `[${"#".repeat(filled)}${".".repeat(barWidth - filled)}]  ${text}`;
}

/** Completions per second over a sliding window of recent samples. */
export class RateMeter {
  private readonly samples: { at: number; done: number }[] = [];

  /** @param windowMs how much history the rate looks at. */
  constructor(private readonly windowMs = 30_000) {}

  add(atMs: number, done: number): void {
    this.samples.push({ at: atMs, done });
    while (this.samples.length > 2 && atMs - this.samples[1]!.at >= this.windowMs) this.samples.shift();
  }

  /** Null until two samples at least a second apart. */
  rate(): number | null {
    const first = this.samples[0];
    const last = this.samples[this.samples.length - 1];
    if (first === undefined || last === undefined || last.at - first.at < 1000) return null;
    return Math.max(0, last.done - first.done) / ((last.at - first.at) / 1000);
  }
}

/** Where progress goes: stderr, or anything with `write` (tests). */
export interface ProgressStream {
  write(text: string): unknown;
  isTTY?: boolean;
  columns?: number;
}

export interface ProgressReporterOptions {
  /** Overrides `stream.isTTY`. */
  tty?: boolean;
  /** Without a TTY, print a line at most this often (and at the end). @defaultValue 10000 */
  plainIntervalMs?: number;
  now?: () => number;
}

/**
 * Writes progress: on a TTY one line rewritten in place; otherwise a plain line every
 * `plainIntervalMs` (so CI logs stay readable), plus a final line.
 */
export class ProgressReporter {
  private readonly tty: boolean;
  private readonly plainIntervalMs: number;
  private readonly now: () => number;
  private readonly startedAt: number;
  private readonly meter = new RateMeter();
  private lastPlainAt: number | null = null;
  private lastLine = "";
  private finished = false;

  constructor(
    private readonly stream: ProgressStream,
    options: ProgressReporterOptions = {},
  ) {
    this.tty = options.tty ?? stream.isTTY === true;
    this.plainIntervalMs = options.plainIntervalMs ?? 10_000;
    this.now = options.now ?? Date.now;
    this.startedAt = this.now();
  }

  /** Record new counts and redraw if due. */
  update(counts: { done: number; total: number; masked: number; failed: number }): void {
    if (this.finished) return;
    const now = this.now();
    const snapshot = this.snapshot(now, counts);
    if (this.tty) {
      const line = renderProgress(snapshot, { width: this.width() });
      if (line !== this.lastLine) this.stream.write(`\r${line}\x1b[K`);
      this.lastLine = line;
      return;
    }
    if (this.lastPlainAt === null || now - this.lastPlainAt >= this.plainIntervalMs) {
      this.stream.write(`${renderProgress(snapshot, { bar: false })}\n`);
      this.lastPlainAt = now;
    }
  }

  /**
   * The terminal's width, 80 when it says none: a terminal whose size was never set (a serial
   * console, `script` or `docker exec -t` without a size) reports 0 columns, which drew an empty line.
   */
  private width(): number {
    const columns = this.stream.columns;
    return columns !== undefined && columns > 0 ? columns : 80;
  }

  private snapshot(
    now: number,
    counts: { done: number; total: number; masked: number; failed: number },
  ): ProgressSnapshot {
    this.meter.add(now, counts.done);
    return { ...counts, elapsedMs: now - this.startedAt, ratePerS: this.meter.rate() };
  }

  /** Draw the final state and end the line. Idempotent. */
  finish(counts: { done: number; total: number; masked: number; failed: number }): void {
    if (this.finished) return;
    const now = this.now();
    const snapshot = this.snapshot(now, counts);
    this.finished = true;
    if (this.tty) this.stream.write(`\r${renderProgress(snapshot, { width: this.width() })}\x1b[K\n`);
    else this.stream.write(`${renderProgress(snapshot, { bar: false })}\n`);
  }

  /** Print a note (a line ending in `\n`) without garbling a TTY progress line: it is redrawn below. */
  note(text: string): void {
    if (this.tty && !this.finished && this.lastLine !== "") {
      this.stream.write(`\r\x1b[K${text}${this.lastLine}`);
    } else this.stream.write(text);
  }

  /**
   * Run `write`, output to another stream that may share the terminal (stdout), with the TTY
   * progress line cleared first and redrawn after: a batch id printed on stdout would otherwise
   * run on from the end of the progress line.
   */
  async aside(write: () => Promise<void>): Promise<void> {
    const drawn = this.tty && !this.finished && this.lastLine !== "";
    if (drawn) this.stream.write("\r\x1b[K");
    try {
      await write();
    } finally {
      if (drawn) this.stream.write(this.lastLine);
    }
  }

  /** End a TTY line early (e.g. on Ctrl-C) so later output starts on a fresh line. */
  interrupt(): void {
    if (this.finished) return;
    this.finished = true;
    if (this.tty && this.lastLine !== "") this.stream.write("\n");
  }
}
