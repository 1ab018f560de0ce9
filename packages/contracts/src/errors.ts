import { capText } from "./bounded.ts";
import { classifyFailure, FailureKind } from "./failure.ts";

export interface FleetErrorOptions {
  /** Overrides the kind's default retryability (see `classifyFailure`). */
  retryable?: boolean;
  cause?: unknown;
  /** See `FleetError.nothingStarted`. @defaultValue false */
  nothingStarted?: boolean;
}

/**
 * The error every package throws for a classified failure. Matched by `instanceof` or by
 * `err.name === "FleetError"` (errors crossing a process boundary lose their class).
 */
export class FleetError extends Error {
  override readonly name = "FleetError";
  readonly kind: FailureKind;
  readonly retryable: boolean;
  /**
   * The call failed before it started anything in the sandbox (a provider call refused before
   * its command was created: the daemon did not answer). False when that is not known: a command
   * may have started before its stream or its daemon broke.
   */
  readonly nothingStarted: boolean;

  constructor(kind: FailureKind, message: string, options: FleetErrorOptions = {}) {
    super(capText(message), options.cause === undefined ? undefined : { cause: options.cause });
    this.kind = kind;
    this.retryable = options.retryable ?? classifyFailure(kind).retryable;
    this.nothingStarted = options.nothingStarted ?? false;
  }

  static retryable(kind: FailureKind, message: string, cause?: unknown): FleetError {
    return new FleetError(kind, message, { retryable: true, cause });
  }

  static nonRetryable(kind: FailureKind, message: string, cause?: unknown): FleetError {
    return new FleetError(kind, message, { retryable: false, cause });
  }
}

/**
 * `err`, marked as failing before anything started in the sandbox (`FleetError.nothingStarted`):
 * for a provider to say so where it knows. Anything but a FleetError is returned as it is.
 */
export function beforeStart<E>(err: E): E | FleetError {
  if (!isFleetError(err) || err.nothingStarted) return err;
  const marked = new FleetError(err.kind, err.message, {
    retryable: err.retryable,
    cause: err.cause,
    nothingStarted: true,
  });
  if (err.stack !== undefined) marked.stack = err.stack;
  return marked;
}

export function isFleetError(err: unknown): err is FleetError {
  return (
    err instanceof FleetError ||
    (typeof err === "object" &&
      err !== null &&
      (err as { name?: unknown }).name === "FleetError" &&
      FailureKind.safeParse((err as { kind?: unknown }).kind).success)
  );
}

/** Normalise anything thrown into an Error, keeping the original as `cause`. */
export function toError(value: unknown): Error {
  if (value instanceof Error) return value;
  return new Error(typeof value === "string" ? value : safeJson(value), { cause: value });
}

function safeJson(value: unknown): string {
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return String(value);
  }
}

/** HTTP API error codes (DESIGN §7). */
export const ApiErrorCode = {
  malformed: 400,
  unauthorized: 401,
  forbidden: 403,
  not_found: 404,
  conflict: 409,
  payload_too_large: 413,
  unsupported_media_type: 415,
  invalid: 422,
  backpressure: 429,
  internal: 500,
  unavailable: 503,
} as const;
export type ApiErrorCode = keyof typeof ApiErrorCode;
