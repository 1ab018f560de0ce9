import type { FleetClient } from "../client.ts";
import type { CliContext } from "../context.ts";
import { openOut, writeText } from "../context.ts";
import { type FollowOptions, followBatches, patientClient } from "./submit.ts";

/**
 * `fleet watch <batchId...>`: what `submit --wait` does after submitting, for batches already
 * submitted (by another shell, or a `submit` without `--wait`): the progress bar until every
 * rollout is finished, then the summary, and with `--out` the results as JSONL.
 */
export async function watchCommand(
  client: FleetClient,
  batchIds: readonly string[],
  opts: FollowOptions,
  ctx: CliContext,
): Promise<number> {
  const file = await openOut(opts.out);
  try {
    // A batch named twice is followed once (its results written once).
    const ids = [...new Set(batchIds)];
    // Each batch's size, up front: an unknown batch id is an error now, not after the wait. Asked
    // as patiently as the wait itself (--outage-wait): a dispatcher restarting when the watch
    // starts is the same outage as one in the middle of it.
    const patient = patientClient(client, opts.outageWait * 1000, (text) => void writeText(ctx.stderr, text));
    const totals = await Promise.all(ids.map(async (id) => (await patient.getBatch(id)).total));
    const expected = totals.reduce((a, b) => a + b, 0);
    return await followBatches(client, ids, expected, opts, ctx, file);
  } finally {
    await file?.discard();
  }
}
