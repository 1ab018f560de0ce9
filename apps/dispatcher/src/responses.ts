import { RolloutStatus } from "@fleet/contracts";
import { z } from "zod";

/** 202 (new) / 200 (idempotent replay) of `POST /v1/rollouts`. */
export const RolloutAccepted = z.object({
  id: z.string(),
  status: RolloutStatus,
  /** False when the Idempotency-Key named a rollout that already existed. */
  created: z.boolean(),
});
export type RolloutAccepted = z.infer<typeof RolloutAccepted>;

/** 202 (new) / 200 (idempotent replay) of `POST /v1/batches`. */
export const BatchAccepted = z.object({
  batchId: z.string(),
  /** In request order (NDJSON: line order, blank lines skipped). */
  rolloutIds: z.array(z.string()),
  count: z.number().int().nonnegative(),
  created: z.boolean(),
});
export type BatchAccepted = z.infer<typeof BatchAccepted>;

/** `GET /v1/batches/:id`; `done` = rollouts in a terminal status. */
export const BatchView = z.object({
  id: z.string(),
  total: z.number().int().nonnegative(),
  done: z.number().int().nonnegative(),
  counts: z.record(RolloutStatus, z.number().int()),
  createdAt: z.number().int(),
});
export type BatchView = z.infer<typeof BatchView>;

export const RolloutCancelAccepted = z.object({ id: z.string(), status: z.literal("cancelling") });
export const BatchCancelAccepted = z.object({
  batchId: z.string(),
  /** Non-terminal rollouts asked to stop. */
  cancelled: z.number().int().nonnegative(),
});

export const ErrorResponse = z.object({
  error: z.object({
    code: z.string(),
    message: z.string(),
    details: z.unknown(),
  }),
});
