import type { FleetClient } from "../client.ts";
import { type CliContext, openOut, writeText } from "../context.ts";

/** `fleet results <batchId>`: the batch's finished results as JSONL, to stdout or `--out`. */
export async function resultsCommand(
  client: FleetClient,
  batchId: string,
  opts: { out?: string },
  ctx: CliContext,
): Promise<number> {
  if (opts.out === undefined) {
    for await (const line of client.batchResultLines(batchId)) await writeText(ctx.stdout, `${line}\n`);
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
  return 0;
}
