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

/** The trajectory for a reader: a summary, then the agent's output and transcript, each headed. */
export function formatTrajectory(t: RolloutTrajectory): string {
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
