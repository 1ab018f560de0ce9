import type { BatchStatus, FleetClient } from "../client.ts";
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
    const before = await statusBefore(client, batchId);
    let lines = 0;
    for await (const line of client.batchResultLines(batchId)) {
      await writeText(ctx.stdout, `${line}\n`);
      lines++;
    }
    return noteUnfinished(client, batchId, before, lines, ctx);
  }
  // Opened before fetching: a path that cannot be written is a usage error, not a crash.
  const file = (await openOut(opts.out))!;
  let before: BatchStatus | null;
  try {
    before = await statusBefore(client, batchId);
    for await (const line of client.batchResultLines(batchId)) await file.writeLine(line);
    await file.commit();
  } catch (err) {
    await file.discard();
    throw err;
  }
  await writeText(ctx.stderr, `wrote ${file.lines} results to ${opts.out}\n`);
  return noteUnfinished(client, batchId, before, file.lines, ctx);
}

/**
 * The batch's status before its results are read, or null when it cannot be read: asked once (no
 * retries), so a dispatcher that does not answer fails the results call as before, not later.
 */
function statusBefore(client: FleetClient, batchId: string): Promise<BatchStatus | null> {
  return client
    .with({ retries: 0 })
    .getBatch(batchId)
    .catch(() => null);
}

/**
 * A note on stderr when the lines are not all of the batch: it has rollouts still running, or it
 * was running when its results were read (`before`, its status read first: a rollout that finished
 * after its part of the stream was sent is not in it). Nothing when it cannot tell. The exit code:
 * 1 when a batch finished before its results were read has fewer of them than rollouts (the rest
 * gone from the dispatcher, past their retention: each rollout's runs from when it finished), as
 * `fleet watch` says; else 0.
 */
async function noteUnfinished(
  client: FleetClient,
  batchId: string,
  before: BatchStatus | null,
  /** Result lines written. */
  lines: number,
  ctx: CliContext,
): Promise<number> {
  if (before !== null && before.done >= before.total) {
    if (lines >= before.total) return 0;
    await writeText(
      ctx.stderr,
      `error: batch ${batchId} has ${before.total} rollouts but ${lines} results were returned; the rest are gone from the dispatcher (past its result retention?)\n`,
    );
    return 1;
  }
  const batch = await client.getBatch(batchId).catch(() => null);
  if (batch === null) return 0;
  if (batch.done >= batch.total) {
    if (before === null || lines >= batch.total) return 0;
    await writeText(
      ctx.stderr,
      `note: batch ${batchId} finished while its results were being read: ${lines} of its ${batch.total} results are here; \`fleet results ${batchId}\` again gives them all\n`,
    );
    return 0;
  }
  await writeText(
    ctx.stderr,
    `note: ${batch.done} of ${batch.total} rollouts of batch ${batchId} have finished; it is still running (\`fleet watch ${batchId}\` follows it to the end)\n`,
  );
  return 0;
}
