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
 * after its part of the stream was sent is not in it: said from that read when the one after the
 * results does not answer); a note that it cannot tell when neither status read answered. The
 * exit code: 1 when a batch finished before its results were read (or whose status then could not
 * be read) has fewer of them than rollouts (the rest gone from the
 * dispatcher, past their retention: each rollout's runs from when it finished), as `fleet watch`
 * says; else 0.
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
  let unread: unknown = null;
  const batch = await client.getBatch(batchId).catch((err: unknown) => {
    unread = err;
    return null;
  });
  if (batch === null) {
    if (ctx.signal.aborted) return 0;
    // Running when the results were read (its status before them), unread now: the lines are
    // not all of it all the same, which an exit 0 without a word would claim they are.
    if (before !== null) {
      if (lines >= before.total) return 0; // all of them came: it finished meanwhile
      await writeText(
        ctx.stderr,
        `note: ${before.done} of ${before.total} rollouts of batch ${batchId} had finished when its results were read; it was still running (\`fleet watch ${batchId}\` follows it to the end)\n`,
      );
      return 0;
    }
    // Read neither before nor now: the lines may be all of the batch or not, which an exit 0
    // without a word would claim they are.
    await writeText(
      ctx.stderr,
      `note: the status of batch ${batchId} could not be read (${(unread as Error).message}): whether these ${lines} results are all of it is not known (\`fleet status ${batchId}\`)\n`,
    );
    return 0;
  }
  if (batch.done >= batch.total) {
    if (lines >= batch.total) return 0;
    if (before === null) {
      // Its status before the results was not read: the rest may have finished while they were
      // read, or be gone past the retention; either way the lines are not all of it (exit 1, as
      // for fewer results than rollouts), not an exit 0 without a word.
      await writeText(
        ctx.stderr,
        `error: batch ${batchId} has ${batch.total} rollouts but ${lines} results were returned; its status could not be read before them, so the rest may have finished while they were read (\`fleet results ${batchId}\` again gives them) or be gone from the dispatcher (past its result retention)\n`,
      );
      return 1;
    }
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
