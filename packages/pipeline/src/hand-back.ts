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
  return (
    err instanceof HandBackError ||
    (typeof err === "object" && err !== null && (err as { name?: unknown }).name === "HandBackError")
  );
}
