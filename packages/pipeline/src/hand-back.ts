/**
 * Thrown by a stage handler that stopped its work because its worker is shutting down: the
 * job goes back to the queue for another worker (no attempt spent, no failure recorded).
 * Matched by `instanceof` or by `name` (errors may cross a module boundary).
 */
export class HandBackError extends Error {
  override readonly name = "HandBackError";
  constructor(message = "the worker is shutting down; the job is handed back") {
    super(message);
  }
}

export function isHandBack(err: unknown): err is HandBackError {
  return err instanceof HandBackError || named(err, "HandBackError");
}

/**
 * A hand-back until a time (epoch ms, `until`): thrown by a stage that can do nothing before it
 * (a verify delivered again, waiting out the tests an earlier attempt may still run). The job
 * goes back to the queue delayed until then, no attempt spent, rather than hold one of the
 * worker's slots asleep for it (a tests' budget can be half an hour).
 */
export class DeferralError extends HandBackError {
  constructor(
    readonly until: number,
    message = "the job can do nothing before a later time; it is handed back until then",
  ) {
    super(message);
  }
}

export function isDeferral(err: unknown): err is DeferralError {
  return (
    err instanceof DeferralError ||
    (named(err, "HandBackError") && typeof (err as { until?: unknown }).until === "number")
  );
}

/**
 * Thrown by the stage runner when a stage failed because the sandbox provider does not answer
 * at all (a Docker daemon restarting, a hung daemon): the worker puts the job back in the queue,
 * delayed, without spending an attempt, and stops taking jobs of the provider's stages until the
 * provider answers again. A short daemon restart then delays rollouts rather than masking them
 * after their attempts ran out within seconds. The failure is logged (not terminal).
 */
export class ProviderHoldError extends Error {
  override readonly name = "ProviderHoldError";
}

export function isProviderHold(err: unknown): err is ProviderHoldError {
  return err instanceof ProviderHoldError || named(err, "ProviderHoldError");
}

/**
 * Thrown by the stage runner when a stage failed because the fleet's Redis refused it: full
 * under `noeviction` (OOM), a read-only replica after a failover, still loading, or out of
 * reach. The worker puts the job back in the queue, delayed, without spending an attempt (a
 * Redis full for a minute would otherwise spend a stage's attempts within that minute and mask
 * its rollouts). Nothing is logged in Redis: it is what refuses.
 */
export class RedisHoldError extends Error {
  override readonly name = "RedisHoldError";
}

export function isRedisHold(err: unknown): err is RedisHoldError {
  return err instanceof RedisHoldError || named(err, "RedisHoldError");
}

/** An error of this name: one that crossed a module boundary fails `instanceof`. */
function named(err: unknown, name: string): boolean {
  return typeof err === "object" && err !== null && (err as { name?: unknown }).name === name;
}
