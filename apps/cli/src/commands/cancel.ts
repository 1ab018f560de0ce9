import { ApiError, type FleetClient, isApiError } from "../client.ts";
import { type CliContext, writeText } from "../context.ts";

/** `fleet cancel <id>`: cancel a rollout, or, if no rollout has that id, a batch. */
export async function cancelCommand(client: FleetClient, id: string, ctx: CliContext): Promise<number> {
  try {
    await client.cancelRollout(id);
    await writeText(ctx.stdout, `cancel requested for rollout ${id}\n`);
    return 0;
  } catch (err) {
    // Cancelled already (a retried cancel, or one a batch cancel reached first): what was asked
    // for holds, as the API says; any other end (completed, masked, closing for a failure) does not.
    if (isApiError(err) && err.status === 409 && alreadyCancelled(err.details)) {
      await writeText(ctx.stdout, `rollout ${id} is already cancelled\n`);
      return 0;
    }
    // Only the dispatcher's own answer that no rollout has this id: a 404 of another kind (a
    // wrong FLEET_URL path, a proxy's page) is said as it is, not as an unknown id.
    if (!unknownId(err, "rollout")) throw err;
  }
  let cancelled: number;
  try {
    ({ cancelled } = await client.cancelBatch(id));
  } catch (err) {
    if (unknownId(err, "batch")) {
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

function alreadyCancelled(details: unknown): boolean {
  return (
    typeof details === "object" &&
    details !== null &&
    (details as { status?: unknown }).status === "cancelled"
  );
}

/** The dispatcher's 404 for an id no rollout (batch) has: it names the id in `details.rolloutId` (`batchId`). */
function unknownId(err: unknown, what: "rollout" | "batch"): boolean {
  if (!isApiError(err) || err.status !== 404) return false;
  const details = err.details;
  return typeof details === "object" && details !== null && `${what}Id` in details;
}
