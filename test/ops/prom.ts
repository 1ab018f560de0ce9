import { spawnSync } from "node:child_process";

/** One sample of the Prometheus text format. */
export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** Parse the Prometheus text exposition format (the subset prom-client writes). */
export function parseMetrics(text: string): Sample[] {
  const samples: Sample[] = [];
  for (const line of text.split("\n")) {
    if (line === "" || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: \d+)?$/.exec(line);
    if (!m) throw new Error(`unparsable metrics line: ${line}`);
    const labels: Record<string, string> = {};
    for (const l of (m[2] ?? "").matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
      labels[l[1]!] = l[2]!.replace(/\\n/g, "\n").replace(/\\"/g, '"').replace(/\\\\/g, "\\");
    }
    samples.push({ name: m[1]!, labels, value: Number(m[3]) });
  }
  return samples;
}

/**
 * The value of the one sample named `name` whose labels include `labels`; throws when none or
 * several match (a test must not pass on an absent series).
 */
export function sampleValue(
  samples: readonly Sample[],
  name: string,
  labels: Record<string, string> = {},
): number {
  const hits = samples.filter(
    (s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v),
  );
  if (hits.length !== 1) {
    throw new Error(`expected one ${name}${JSON.stringify(labels)}, found ${hits.length}`);
  }
  return hits[0]!.value;
}

/** Whether `promtool` is on the PATH (CI installs it: `.ci/run`). */
export function hasPromtool(): boolean {
  return spawnSync("promtool", ["--version"], { stdio: "ignore" }).status === 0;
}

/** Run promtool; returns its exit status and combined output. */
export function promtool(args: readonly string[], input?: string): { status: number | null; output: string } {
  const r = spawnSync("promtool", args, { input, encoding: "utf8", timeout: 60_000 });
  return { status: r.status, output: `${r.stdout ?? ""}${r.stderr ?? ""}` };
}

/** `promtool check metrics` on a scrape: its lint findings ("" when clean). */
export function lintMetrics(text: string): string {
  const r = promtool(["check", "metrics"], text);
  return r.status === 0 ? r.output.trim() : `exit ${r.status}: ${r.output.trim()}`;
}

export const PROMTOOL_MISSING =
  "SKIPPED: promtool is not installed (apt-get install -y prometheus); .ci/run installs it, so CI never skips these";
