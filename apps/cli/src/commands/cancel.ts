import { ApiError, type FleetClient, isApiError } from "../client.ts";
import { type CliContext, writeText } from "../context.ts";

/** `fleet cancel <id>`: cancel a rollout, or, if no rollout has that id, a batch. */
export async function cancelCommand(client: FleetClient, id: string, ctx: CliContext): Promise<number> {
  try {
    await client.cancelRollout(id);
    await writeText(ctx.stdout, `cancel requested for rollout ${id}\n`);
    return 0;
  } catch (err) {
    if (!isApiError(err) || err.status !== 404) throw err;
  }
  try {
    await client.cancelBatch(id);
  } catch (err) {
    if (isApiError(err) && err.status === 404) {
      throw new ApiError(404, "not_found", `no rollout or batch with id ${id}`, { cause: err });
    }
    throw err;
  }
  await writeText(ctx.stdout, `cancel requested for batch ${id}\n`);
  return 0;
}
