import { type ApiErrorCode, capText } from "@fleet/contracts";
import { isRedisUnavailable } from "@fleet/queue";

/**
 * Codes of the API's one error body (DESIGN §7). `unsupported_media_type` (415) is the
 * dispatcher's addition for a body in a format it does not read, `method_not_allowed` (405) for
 * a route asked with a method it does not serve.
 */
export type HttpErrorCode = ApiErrorCode | "unsupported_media_type" | "method_not_allowed";

/** The body of every error answer: `{ "error": { "code", "message", "details" } }`. */
export interface ErrorBody {
  error: { code: HttpErrorCode; message: string; details: unknown };
}

/**
 * The one HTTP error type. Thrown anywhere in a route or hook; rendered by the one error
 * handler (`toHttpError` + `errorBody`). Matched by `instanceof` or `name === "HttpError"`.
 */
export class HttpError extends Error {
  override readonly name = "HttpError";

  constructor(
    readonly status: number,
    readonly code: HttpErrorCode,
    message: string,
    readonly details: unknown = null,
    /** Extra response headers (e.g. `retry-after` on 429/503). */
    readonly headers: Readonly<Record<string, string>> = {},
  ) {
    super(message);
  }

  /** Fastify's name for the status: error handlers not ours (Bull Board's) read this one. */
  get statusCode(): number {
    return this.status;
  }
}

export function isHttpError(err: unknown): err is HttpError {
  return (
    err instanceof HttpError ||
    (typeof err === "object" &&
      err !== null &&
      (err as { name?: unknown }).name === "HttpError" &&
      typeof (err as { status?: unknown }).status === "number")
  );
}

export function errorBody(err: HttpError): ErrorBody {
  return { error: { code: err.code, message: err.message, details: err.details ?? null } };
}

/** Seconds a client should wait after 429/503 before trying again. */
export const RETRY_AFTER_S = 5;

/** 503 `unavailable`: try again after `RETRY_AFTER_S` (said in `Retry-After`). */
export function unavailable(message: string, headers: Readonly<Record<string, string>> = {}): HttpError {
  return new HttpError(503, "unavailable", message, null, {
    "retry-after": String(RETRY_AFTER_S),
    ...headers,
  });
}

const ADMISSION_STATUS = { invalid: 422, payload_too_large: 413, conflict: 409 } as const;

/** Fastify's own errors, by code, where the status alone does not say enough. */
const FASTIFY_CODES: Record<string, [number, HttpErrorCode]> = {
  FST_ERR_CTP_BODY_TOO_LARGE: [413, "payload_too_large"],
  FST_ERR_CTP_INVALID_MEDIA_TYPE: [415, "unsupported_media_type"],
  FST_ERR_CTP_EMPTY_JSON_BODY: [400, "malformed"],
  FST_ERR_CTP_INVALID_JSON_BODY: [400, "malformed"],
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: [400, "malformed"],
  // Raised before routing (see `frameworkErrors` in server.ts): a URL that does not decode, and
  // a path parameter too long to be any id we issued (unknown, like any other bad id).
  FST_ERR_BAD_URL: [400, "malformed"],
  FST_ERR_MAX_PARAM_LENGTH: [404, "not_found"],
};

const STATUS_CODES: Record<number, HttpErrorCode> = {
  400: "malformed",
  401: "unauthorized",
  403: "forbidden",
  404: "not_found",
  405: "method_not_allowed",
  409: "conflict",
  413: "payload_too_large",
  415: "unsupported_media_type",
  422: "invalid",
  429: "backpressure",
  503: "unavailable",
};

/**
 * Normalise anything a route, hook or Fastify itself threw into an `HttpError`. Client errors
 * keep their message; anything else becomes a 500 `internal` whose message says nothing about
 * the server's insides (the original is logged by the error handler).
 */
export function toHttpError(err: unknown): HttpError {
  if (isHttpError(err)) return err;
  const e = (typeof err === "object" && err !== null ? err : {}) as {
    name?: unknown;
    code?: unknown;
    message?: unknown;
    details?: unknown;
    statusCode?: unknown;
    rolloutId?: unknown;
  };
  const message = typeof e.message === "string" ? capText(e.message, 1000) : "request failed";
  // AdmissionError from @fleet/queue (by name: errors may cross a module boundary).
  if (e.name === "AdmissionError" && typeof e.code === "string" && e.code in ADMISSION_STATUS) {
    const code = e.code as keyof typeof ADMISSION_STATUS;
    return new HttpError(ADMISSION_STATUS[code], code, message, e.details ?? null);
  }
  // UnreadableRecordError from @fleet/queue (by name, as above): still a 500 (no retry reads the
  // record, and it is no fault of the request), but one that says which rollout it is, so a client
  // tells a rollout whose stored record is torn from a dispatcher that fails every request. Not
  // why it does not parse: a JSON parse error quotes the stored text. The log has the whole error.
  if (e.name === "UnreadableRecordError" && typeof e.rolloutId === "string") {
    return new HttpError(
      500,
      "internal",
      `the stored record of rollout ${e.rolloutId} cannot be read (torn, or written by a release this one cannot read); the dispatcher's log has why`,
      { rolloutId: e.rolloutId },
    );
  }
  if (isRedisUnavailable(err)) {
    return unavailable("the fleet's Redis cannot serve now (unreachable, full or failing over); try again");
  }
  if (typeof e.code === "string" && e.code in FASTIFY_CODES) {
    const [status, code] = FASTIFY_CODES[e.code]!;
    return new HttpError(status, code, message);
  }
  // The client hung up while its body was still being read (Node's request error: `aborted`,
  // ECONNRESET; not another socket's `read ECONNRESET`): its mistake or its network's, not the
  // server's. Nobody reads the answer; it must not be logged as a 500 (a bug) at error level.
  if (e.message === "aborted" && (e.code === "ECONNRESET" || e.code === undefined)) {
    return new HttpError(
      400,
      "malformed",
      "the client closed the connection before its request body arrived",
    );
  }
  // JSON syntax errors from Fastify's body parser carry statusCode 400 and no FST code.
  if (typeof e.statusCode === "number" && e.statusCode >= 400 && e.statusCode < 500) {
    return new HttpError(e.statusCode, STATUS_CODES[e.statusCode] ?? "malformed", message);
  }
  return new HttpError(500, "internal", "internal error");
}
