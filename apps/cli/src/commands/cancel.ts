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
  let cancelled: number;
  try {
    ({ cancelled } = await client.cancelBatch(id));
  } catch (err) {
    if (isApiError(err) && err.status === 404) {
      throw new ApiError(404, "not_found", `no rollout or batch with id ${id}`, { cause: err });
    }
    throw err;
  }
  const what =
    cancelled === 0
      ? "no rollout of it was left to stop (all finished or closing)"
      : `${cancelled} rollout${cancelled === 1 ? "" : "s"} will end cancelled`;
  await writeText(ctx.stdout, `cancel requested for batch ${id}: ${what}\n`);
  return 0;
}
