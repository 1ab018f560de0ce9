import type { RolloutTrajectory } from "@fleet/contracts";
import type { FleetClient } from "../client.ts";
import { type CliContext, writeText } from "../context.ts";

/** `fleet trajectory <rolloutId>`: what the agent did (its output, answer, transcript, usage). */
export async function trajectoryCommand(
  client: FleetClient,
  rolloutId: string,
  opts: { json?: boolean },
  ctx: CliContext,
): Promise<number> {
  const trajectory = await client.getTrajectory(rolloutId);
  await writeText(ctx.stdout, opts.json ? `${JSON.stringify(trajectory)}\n` : formatTrajectory(trajectory));
  return 0;
}

/**
 * The characters of agent text a terminal would act on rather than show: C0 controls but newline
 * and tab (escape sequences, carriage return, backspace, bell), DEL, C1 controls, and the
 * bidirectional overrides and isolates (text that reads otherwise than it is).
 */
// biome-ignore lint/suspicious/noControlCharactersInRegex: these controls are what it finds.
const UNPRINTABLE = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/g;

/**
 * `text` with each character a terminal would act on shown as its `\xNN` / `\uNNNN` escape:
 * an agent's output is untrusted, and printed as it is it could move the cursor, rewrite earlier
 * lines, retitle the window or hide text. `--json` keeps it as stored.
 */
export function printable(text: string): string {
  return text.replace(UNPRINTABLE, (c) => {
    const code = c.charCodeAt(0);
    return code <= 0xff
      ? `\\x${code.toString(16).padStart(2, "0")}`
      : `\\u${code.toString(16).padStart(4, "0")}`;
  });
}

/**
 * The trajectory for a reader: a summary, then the agent's output and transcript, each headed;
 * what a terminal would act on shown escaped (`printable`).
 */
export function formatTrajectory(t: RolloutTrajectory): string {
  return printable(trajectoryText(t));
}

function trajectoryText(t: RolloutTrajectory): string {
  const head = `rollout ${t.id}: ${t.status}, agent ${t.agent} (harness ${t.harness})\n`;
  const run = t.run;
  if (run === null) {
    return `${head}no run stored: the agent has not finished its run, or the rollout ended before it did\n`;
  }
  const facts = [
    `exit ${run.exitCode}`,
    `in ${(run.durationMs / 1000).toFixed(1)} s`,
    `${run.attempts} launch${run.attempts === 1 ? "" : "es"}`,
    ...(run.timedOut ? ["killed at its deadline"] : []),
    ...(run.oomKilled ? ["out of memory"] : []),
  ];
  let out = `${head}run: ${facts.join(", ")}\n`;
  if (run.answer !== null) out += `answer: ${JSON.stringify(run.answer)}\n`;
  if (run.usage !== null) {
    const u = run.usage;
    const tokens = (n: number | null) => (n === null ? "?" : String(n));
    out += `usage: ${u.calls} model call${u.calls === 1 ? "" : "s"}, ${tokens(u.promptTokens)} prompt + ${tokens(u.completionTokens)} completion tokens`;
    out += u.gaps.length > 0 ? ` (gaps: ${u.gaps.join("; ")})\n` : "\n";
  }
  const section = (name: string, text: string, truncated = false) =>
    text === ""
      ? ""
      : `--- ${name}${truncated ? " (its last part only)" : ""} ---\n${text.endsWith("\n") ? text : `${text}\n`}`;
  out += section("stdout", run.stdout, run.stdoutTruncated);
  out += section("stderr", run.stderr, run.stderrTruncated);
  out += section("transcript (JSON lines)", run.transcript ?? "");
  return out;
}
