import type { FleetClient } from "../client.ts";
import type { CliContext } from "../context.ts";
import { openOut } from "../context.ts";
import { type FollowOptions, followBatches } from "./submit.ts";

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
    // Each batch's size, up front: an unknown batch id is an error now, not after the wait.
    const totals = await Promise.all(ids.map(async (id) => (await client.getBatch(id)).total));
    const expected = totals.reduce((a, b) => a + b, 0);
    return await followBatches(client, ids, expected, opts, ctx, file);
  } finally {
    await file?.discard();
  }
}
