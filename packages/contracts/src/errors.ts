import { capText } from "./bounded.ts";
import { classifyFailure, FailureKind, type Usage } from "./failure.ts";

export interface FleetErrorOptions {
  /** Overrides the kind's default retryability (see `classifyFailure`). */
  retryable?: boolean;
  cause?: unknown;
  /** See `FleetError.nothingStarted`. @defaultValue false */
  nothingStarted?: boolean;
  /** See `FleetError.usage`. @defaultValue null */
  usage?: Usage | null;
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
  /**
   * The model usage spent before the failure (an agent's calls, then an upstream that stopped
   * answering): kept in the failure record, so a masked run still reports what it cost.
   */
  readonly usage: Usage | null;

  constructor(kind: FailureKind, message: string, options: FleetErrorOptions = {}) {
    super(capText(message), options.cause === undefined ? undefined : { cause: options.cause });
    this.kind = kind;
    this.retryable = options.retryable ?? classifyFailure(kind).retryable;
    this.nothingStarted = options.nothingStarted ?? false;
    this.usage = options.usage ?? null;
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
    usage: err.usage,
  });
  if (err.stack !== undefined) marked.stack = err.stack;
  return marked;
}

/** The model usage an error carries (`FleetError.usage`), or null (any other error too). */
export function usageOf(err: unknown): Usage | null {
  return isFleetError(err) ? (err.usage ?? null) : null;
}

/**
 * `err` carrying the model usage spent before it (`FleetError.usage`). Anything but a
 * FleetError, one that already carries usage (unless `replace`), and a null `usage` leave `err`
 * as it is.
 */
export function withUsage<E>(err: E, usage: Usage | null, replace = false): E | FleetError {
  if (usage === null || !isFleetError(err) || (!replace && usageOf(err) !== null)) return err;
  const carried = new FleetError(err.kind, err.message, {
    retryable: err.retryable,
    cause: err.cause,
    nothingStarted: err.nothingStarted,
    usage,
  });
  if (err.stack !== undefined) carried.stack = err.stack;
  return carried;
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
