import { capText } from "./bounded.ts";
import { classifyFailure, FailureKind } from "./failure.ts";

export interface FleetErrorOptions {
  /** Overrides the kind's default retryability (see `classifyFailure`). */
  retryable?: boolean;
  cause?: unknown;
}

/**
 * The error every package throws for a classified failure. Matched by `instanceof` or by
 * `err.name === "FleetError"` (errors crossing a process boundary lose their class).
 */
export class FleetError extends Error {
  override readonly name = "FleetError";
  readonly kind: FailureKind;
  readonly retryable: boolean;

  constructor(kind: FailureKind, message: string, options: FleetErrorOptions = {}) {
    super(capText(message), options.cause === undefined ? undefined : { cause: options.cause });
    this.kind = kind;
    this.retryable = options.retryable ?? classifyFailure(kind).retryable;
  }

  static retryable(kind: FailureKind, message: string, cause?: unknown): FleetError {
    return new FleetError(kind, message, { retryable: true, cause });
  }

  static nonRetryable(kind: FailureKind, message: string, cause?: unknown): FleetError {
    return new FleetError(kind, message, { retryable: false, cause });
  }
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
