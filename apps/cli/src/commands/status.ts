import type { FleetClient } from "../client.ts";
import { type CliContext, writeText } from "../context.ts";
import { percent } from "../progress.ts";

const ORDER = [
  "accepted",
  "seeded",
  "ran",
  "verified",
  "closing",
  "completed",
  "masked",
  "failed",
  "cancelled",
];

/** `fleet status <batchId>`: counts by status, and how many are done. */
export async function statusCommand(
  client: FleetClient,
  batchId: string,
  opts: { json?: boolean },
  ctx: CliContext,
): Promise<number> {
  const status = await client.getBatch(batchId);
  if (opts.json) {
    await writeText(ctx.stdout, `${JSON.stringify(status)}\n`);
    return 0;
  }
  const pct = percent(status.done, status.total);
  const names = [...ORDER, ...Object.keys(status.counts).filter((k) => !ORDER.includes(k))];
  const counts = names.filter((k) => (status.counts[k] ?? 0) > 0).map((k) => `${k} ${status.counts[k]}`);
  const state = status.done >= status.total ? "finished" : "running";
  await writeText(
    ctx.stdout,
    `batch ${status.id}: ${state}, ${status.done}/${status.total} done (${pct}%)\n` +
      `  ${counts.length > 0 ? counts.join("  ") : "(no rollouts)"}\n`,
  );
  return 0;
}
