import type { FleetClient } from "../client.ts";
import { type CliContext, ResultsFile, writeText } from "../context.ts";
import { UsageError } from "../requests.ts";

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
  let file: ResultsFile;
  try {
    file = await ResultsFile.open(opts.out);
  } catch (err) {
    throw new UsageError(`cannot write --out ${opts.out}: ${(err as Error).message}`);
  }
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
