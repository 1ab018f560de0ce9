import { RolloutId } from "@fleet/contracts";
import { HttpError } from "../http-error.ts";

/**
 * The `:id` of a rollout or batch route. An id that could never have been issued (wrong
 * characters, too long) is simply unknown: 404, like any other unknown id.
 */
export function idParam(params: unknown, what: "rollout" | "batch"): string {
  const raw = (params as { id?: unknown } | null)?.id;
  const parsed = RolloutId.safeParse(raw);
  if (!parsed.success) throw notFound(what, String(raw));
  return parsed.data;
}

export function notFound(what: "rollout" | "batch", id: string): HttpError {
  return new HttpError(404, "not_found", `no ${what} ${JSON.stringify(id.slice(0, 100))}`, {
    [`${what}Id`]: id.slice(0, 100),
  });
}
