import type { FleetClient } from "../client.ts";
import { type CliContext, openOut, writeText } from "../context.ts";

/**
 * `fleet results <batchId>`: the batch's finished results as JSONL, to stdout or `--out`; says on
 * stderr when the batch is still running (the lines are then not all of it).
 */
export async function resultsCommand(
  client: FleetClient,
  batchId: string,
  opts: { out?: string },
  ctx: CliContext,
): Promise<number> {
  if (opts.out === undefined) {
    for await (const line of client.batchResultLines(batchId)) await writeText(ctx.stdout, `${line}\n`);
    await noteUnfinished(client, batchId, ctx);
    return 0;
  }
  // Opened before fetching: a path that cannot be written is a usage error, not a crash.
  const file = (await openOut(opts.out))!;
  try {
    for await (const line of client.batchResultLines(batchId)) await file.writeLine(line);
    await file.commit();
  } catch (err) {
    await file.discard();
    throw err;
  }
  await writeText(ctx.stderr, `wrote ${file.lines} results to ${opts.out}\n`);
  await noteUnfinished(client, batchId, ctx);
  return 0;
}

/** A note on stderr when the batch has rollouts still running; nothing when it cannot tell. */
async function noteUnfinished(client: FleetClient, batchId: string, ctx: CliContext): Promise<void> {
  const batch = await client.getBatch(batchId).catch(() => null);
  if (batch === null || batch.done >= batch.total) return;
  await writeText(
    ctx.stderr,
    `note: ${batch.done} of ${batch.total} rollouts of batch ${batchId} have finished; it is still running (\`fleet watch ${batchId}\` follows it to the end)\n`,
  );
}
