import { randomUUID } from "node:crypto";
import { type RolloutRequestInput, RolloutTrajectory } from "@fleet/contracts";
import { z } from "zod";
import { LineTooLongError, splitLines } from "./lines.ts";
import { formatDuration } from "./progress.ts";
import { UsageError } from "./requests.ts";

/**
 * An id as one path segment. `.` and `..` are refused: a URL's dot segments are resolved away
 * (`fleet cancel ..` would post to `/v1/cancel`), even percent-encoded.
 */
function pathId(id: string): string {
  if (id === "" || id === "." || id === "..")
    throw new UsageError(`${JSON.stringify(id)} is not a rollout or batch id`);
  return encodeURIComponent(id);
}

/**
 * Any failed call to the dispatcher. `status` is the HTTP status, or `0` when no response came
 * back (unreachable, timeout). `code` is the API's error code (`not_found`, `backpressure`, ...)
 * or one of the client's own: `unreachable`, `timeout`, `bad_response`, `http_<status>`.
 */
export class ApiError extends Error {
  override readonly name = "ApiError";
  readonly status: number;
  readonly code: string;
  readonly details: unknown;

  constructor(
    status: number,
    code: string,
    message: string,
    options: { details?: unknown; cause?: unknown } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.status = status;
    this.code = code;
    this.details = options.details ?? null;
  }
}

export function isApiError(err: unknown): err is ApiError {
  return (
    err instanceof ApiError ||
    (typeof err === "object" && err !== null && (err as { name?: unknown }).name === "ApiError")
  );
}

/** `{ error: { code, message, details } }`, the dispatcher's one error body (DESIGN §7). */
const ErrorBody = z.object({
  error: z.object({ code: z.string(), message: z.string(), details: z.unknown().optional() }),
});

export const BatchAccepted = z.object({
  batchId: z.string().min(1),
  rolloutIds: z.array(z.string()),
  count: z.number().int().nonnegative(),
  /** false when the Idempotency-Key replayed an earlier batch (nothing new started). */
  created: z.boolean().default(true),
});
export type BatchAccepted = z.infer<typeof BatchAccepted>;

/** `POST /v1/batches/:id/cancel`'s answer: how many rollouts were asked to stop. */
export const BatchCancelled = z.object({ cancelled: z.number().int().nonnegative() });
export type BatchCancelled = z.infer<typeof BatchCancelled>;

export const RolloutAccepted = z.object({ id: z.string().min(1), status: z.string() });
export type RolloutAccepted = z.infer<typeof RolloutAccepted>;

/** `GET /v1/batches/:id`; `counts` by rollout status, `done` = rollouts in a terminal status. */
export const BatchStatus = z.object({
  id: z.string(),
  total: z.number().int().nonnegative(),
  counts: z.record(z.string(), z.number()),
  done: z.number().int().nonnegative(),
  createdAt: z.union([z.number(), z.string()]).optional(),
});
export type BatchStatus = z.infer<typeof BatchStatus>;

export type BatchFormat = "json" | "ndjson";

/** Above this body size a batch goes as NDJSON (the server can stream it line by line). */
export const NDJSON_THRESHOLD_BYTES = 1024 * 1024;

export interface FleetClientOptions {
  /** Dispatcher base URL, e.g. `http://127.0.0.1:8080`. */
  url: string;
  token?: string | null;
  /**
   * Time to wait for a response (headers; the whole body for non-streaming calls; a streamed
   * body's next chunk). @defaultValue 60000
   */
  timeoutMs?: number;
  /**
   * `timeoutMs` for a batch's status (`getBatch`): a cheap read, polled while following batches,
   * so a dispatcher that hangs without refusing connections shows as an outage this soon rather
   * than after `timeoutMs` of silence. At most `timeoutMs`. @defaultValue 10000
   */
  statusTimeoutMs?: number;
  /**
   * `timeoutMs` for a batch's cancel, which the dispatcher answers once it has asked every
   * rollout of the batch to stop (about 2 s per 5,000 rollouts on a small host): a big batch's
   * must not time out, to be sent again while the first still runs. At least `timeoutMs`.
   * @defaultValue 600000
   */
  batchCancelTimeoutMs?: number;
  /** Extra attempts after a 429/502/503/504 or a connection failure. @defaultValue 5 */
  retries?: number;
  /** First retry delay; doubles each attempt, full jitter, capped at `retryMaxMs`. @defaultValue 250 */
  retryBaseMs?: number;
  /** Cap on one retry delay (before jitter). @defaultValue 10000 */
  retryMaxMs?: number;
  /**
   * Ride out an outage instead of giving up after `retries`: keep retrying (same backoff) until
   * the failures have lasted `maxOutageMs` without a success. For long waits (`submit --wait`).
   */
  patience?: Patience;
  /** Aborts every call (e.g. on Ctrl-C). */
  signal?: AbortSignal;
  /** Told before each retry (the CLI prints it, so a long wait is not silent). */
  onRetry?: (retry: RetryInfo) => void;
}

export interface RetryInfo {
  /** The attempt about to be made (2 = first retry). */
  attempt: number;
  maxAttempts: number;
  delayMs: number;
  /** What went wrong: an ApiError's message, or the HTTP status and code. */
  reason: string;
}

/** See `FleetClientOptions.patience`. */
export interface Patience {
  /** Give up once calls have failed for this long without a success in between. */
  maxOutageMs: number;
  /** Told once when an outage starts (instead of `onRetry` on every attempt). */
  /** `unavailable`: the dispatcher answered that the fleet cannot serve now (its Redis). */
  onOutage?: (outage: { since: Date; reason: string; code: string }) => void;
  /** Told once when the dispatcher answers again after an outage. */
  onRecovered?: (outage: { since: Date; downMs: number }) => void;
}

interface RequestOptions {
  body?: string;
  contentType?: string;
  idempotencyKey?: string;
  /** Keep the body unread and return the response (for streams). */
  stream?: boolean;
  /** Instead of the client's `timeoutMs`. */
  timeoutMs?: number;
  /** A 429 goes back to the caller at once, not retried here (it decides how long to wait). */
  returnBusy?: boolean;
  /** A timeout goes back to the caller, not retried here (see `cancelBatch`). */
  timeoutFinal?: boolean;
}

const RETRY_STATUSES = new Set([429, 502, 503, 504]);
const MAX_RETRY_AFTER_MS = 60_000;

/**
 * Typed client for the dispatcher API. Every call retries what is safe to retry: submissions
 * carry an `Idempotency-Key` (the same on every attempt), so a retried POST returns the same
 * rollouts rather than new ones.
 */
export class FleetClient {
  readonly url: string;
  private readonly token: string | null;
  private readonly timeoutMs: number;
  private readonly statusTimeoutMs: number;
  private readonly batchCancelTimeoutMs: number;
  private readonly retries: number;
  private readonly retryBaseMs: number;
  private readonly retryMaxMs: number;
  private readonly patience: Patience | undefined;
  private readonly signal: AbortSignal | undefined;
  private readonly onRetry: ((retry: RetryInfo) => void) | undefined;
  /** When the current outage began (patient clients only); null while calls succeed. */
  private outageSince: number | null = null;

  constructor(private readonly options: FleetClientOptions) {
    this.url = options.url.replace(/\/+$/, "");
    this.token = options.token ?? null;
    this.timeoutMs = options.timeoutMs ?? 60_000;
    this.statusTimeoutMs = Math.min(options.statusTimeoutMs ?? 10_000, this.timeoutMs);
    this.batchCancelTimeoutMs = Math.max(options.batchCancelTimeoutMs ?? 600_000, this.timeoutMs);
    this.retries = options.retries ?? 5;
    this.retryBaseMs = options.retryBaseMs ?? 250;
    this.retryMaxMs = options.retryMaxMs ?? 10_000;
    this.patience = options.patience;
    this.signal = options.signal;
    this.onRetry = options.onRetry;
  }

  /** A client like this one with some options changed (e.g. `patience` for a long wait). */
  with(overrides: Partial<FleetClientOptions>): FleetClient {
    return new FleetClient({ ...this.options, ...overrides });
  }

  /** `POST /v1/rollouts`. */
  async submitRollout(
    request: RolloutRequestInput,
    idempotencyKey: string = randomUUID(),
  ): Promise<RolloutAccepted> {
    const res = await this.request("POST", "/v1/rollouts", {
      body: JSON.stringify(request),
      contentType: "application/json",
      idempotencyKey,
    });
    return parseBody(RolloutAccepted, res);
  }

  /**
   * `POST /v1/batches` from pre-serialized request lines (one JSON object each). Sent as
   * `{ "rollouts": [...] }`, or as NDJSON when `format` says so or the body passes
   * `NDJSON_THRESHOLD_BYTES`.
   */
  async submitBatchLines(
    lines: readonly string[],
    options: { format?: BatchFormat; idempotencyKey?: string; returnBusy?: boolean } = {},
  ): Promise<BatchAccepted> {
    const ndjsonBytes = lines.reduce((n, line) => n + Buffer.byteLength(line) + 1, 0);
    const format = options.format ?? (ndjsonBytes > NDJSON_THRESHOLD_BYTES ? "ndjson" : "json");
    const body = format === "ndjson" ? `${lines.join("\n")}\n` : `{"rollouts":[${lines.join(",")}]}`;
    const res = await this.request("POST", "/v1/batches", {
      body,
      contentType: format === "ndjson" ? "application/x-ndjson" : "application/json",
      idempotencyKey: options.idempotencyKey ?? randomUUID(),
      ...(options.returnBusy ? { returnBusy: true } : {}),
    });
    return parseBody(BatchAccepted, res);
  }

  /** `POST /v1/batches` from request objects. */
  submitBatch(
    rollouts: readonly RolloutRequestInput[],
    options: { format?: BatchFormat; idempotencyKey?: string } = {},
  ): Promise<BatchAccepted> {
    return this.submitBatchLines(
      rollouts.map((r) => JSON.stringify(r)),
      options,
    );
  }

  /** `GET /v1/batches/:id`. */
  async getBatch(batchId: string): Promise<BatchStatus> {
    const path = `/v1/batches/${pathId(batchId)}`;
    return parseBody(BatchStatus, await this.request("GET", path, { timeoutMs: this.statusTimeoutMs }));
  }

  /** `GET /v1/rollouts/:id` (a RolloutResult; not validated here, the server owns its shape). */
  async getRollout(rolloutId: string): Promise<unknown> {
    return parseBody(z.unknown(), await this.request("GET", `/v1/rollouts/${pathId(rolloutId)}`));
  }

  /** `GET /v1/rollouts/:id/trajectory`. */
  async getTrajectory(rolloutId: string): Promise<RolloutTrajectory> {
    const path = `/v1/rollouts/${pathId(rolloutId)}/trajectory`;
    return parseBody(RolloutTrajectory, await this.request("GET", path));
  }

  /**
   * `GET /v1/batches/:id/results`: the raw NDJSON body of the terminal rollouts' results. A body
   * cut short (the connection dropped mid-stream, or a body that ends inside a line) errors the
   * stream with an ApiError of code `stream_broken`.
   */
  async batchResultsStream(batchId: string): Promise<ReadableStream<Uint8Array>> {
    const res = await this.request("GET", `/v1/batches/${pathId(batchId)}/results`, {
      stream: true,
    });
    // Not the dispatcher's results (a proxy's login page, a FLEET_URL that is some other server):
    // refused, not printed or written to --out as results.
    const type = res.headers.get("content-type") ?? "";
    if (!/^application\/x-ndjson\s*(;|$)/i.test(type)) {
      await res.body?.cancel().catch(() => {});
      throw new ApiError(
        res.status,
        "bad_response",
        `the results of batch ${batchId} came as ${type === "" ? "a body without a content type" : type}, not NDJSON: is ${this.url} the dispatcher?`,
      );
    }
    if (res.body === null) return new ReadableStream({ start: (c) => c.close() });
    const reader = res.body.getReader();
    /** The body's last byte so far (-1 before any): every line the dispatcher sends ends in `\n`. */
    let last = -1;
    // A dispatcher that stops sending mid-body without closing the connection (stopped, its host
    // paused, a half-open connection after a partition) would hold a bare read for good: no chunk
    // within the client's timeout breaks the stream (`stream_broken`), which is read again.
    const idleMs = this.timeoutMs;
    const nextChunk = () => {
      let timer: NodeJS.Timeout | undefined;
      const idle = new Promise<never>((_, reject) => {
        timer = setTimeout(() => {
          const err = new Error(`no data for ${idleMs} ms`);
          // Rejected first: the cancel ends the pending read as done, which would win the race.
          reject(err);
          reader.cancel(err).catch(() => undefined);
        }, idleMs);
      });
      return Promise.race([reader.read(), idle]).finally(() => clearTimeout(timer));
    };
    return new ReadableStream<Uint8Array>({
      pull: async (controller) => {
        try {
          const { done, value } = await nextChunk();
          if (!done) {
            if (value.length > 0) last = value[value.length - 1]!;
            controller.enqueue(value);
          } else if (last === -1 || last === 0x0a) controller.close();
          // A body without a length nor chunks ends where the connection closes: cut inside a
          // line, it ends as if whole. Its last line is half a result, not one.
          else controller.error(this.streamError(batchId, new Error("it ended inside a line")));
        } catch (err) {
          controller.error(this.streamError(batchId, err));
        }
      },
      cancel: (reason) => reader.cancel(reason),
    });
  }

  /**
   * The batch's result lines (raw JSON text, one per result, blank lines dropped). When the
   * stream breaks off, it is fetched again from the start (the plain stream has no offset) and the
   * results already yielded (by rollout id) are skipped, so each result comes once. Gives up
   * after `retries` breaks in a row without a new result, or, with `patience`, after breaking
   * for `maxOutageMs` without one.
   */
  async *batchResultLines(batchId: string): AsyncGenerator<string> {
    const seen = new Set<string>();
    let fetches = 0;
    let stalls = 0;
    let stalledSince: number | null = null;
    for (;;) {
      const stream = await this.batchResultsStream(batchId);
      const refetch = fetches++ > 0;
      let fresh = 0;
      try {
        for await (const line of splitLines(stream)) {
          const key = resultKey(line);
          if (refetch && seen.has(key)) continue;
          seen.add(key);
          fresh++;
          yield line;
        }
        return;
      } catch (err) {
        // No result is that long: a server (or a proxy) sending one endless line, not a dispatcher.
        if (err instanceof LineTooLongError) {
          throw new ApiError(
            0,
            "bad_response",
            `the results of batch ${batchId} hold ${err.message}, which no result does: is ${this.url} the dispatcher?`,
            { cause: err },
          );
        }
        if (!isApiError(err) || err.code !== "stream_broken") throw err;
        if (fresh > 0) {
          stalls = 0;
          stalledSince = null;
        }
        stalledSince ??= Date.now();
        const spent =
          this.patience === undefined
            ? stalls >= this.retries
            : Date.now() - stalledSince >= this.patience.maxOutageMs;
        if (spent) throw err;
        const delay = this.delayFor(stalls, null);
        this.onRetry?.({
          attempt: stalls + 2,
          maxAttempts: this.patience === undefined ? this.retries + 1 : Number.POSITIVE_INFINITY,
          delayMs: delay,
          reason: `${err.message} after ${seen.size} results; fetching it again, skipping those`,
        });
        stalls++;
        await this.pause(delay);
      }
    }
  }

  /** `POST /v1/rollouts/:id/cancel`. */
  async cancelRollout(rolloutId: string): Promise<unknown> {
    const res = await this.request("POST", `/v1/rollouts/${pathId(rolloutId)}/cancel`);
    return parseBody(z.unknown(), res);
  }

  /** `POST /v1/batches/:id/cancel`. */
  async cancelBatch(batchId: string): Promise<BatchCancelled> {
    // Its timeout is not retried: the dispatcher may still be asking the rollouts to stop, and a
    // second cancel would ask them all again beside it; and the wait is batchCancelTimeoutMs, not
    // that many times over (an hour, with the default retries, on a dispatcher that never answers).
    const res = await this.request("POST", `/v1/batches/${pathId(batchId)}/cancel`, {
      timeoutMs: this.batchCancelTimeoutMs,
      timeoutFinal: true,
    });
    return parseBody(BatchCancelled, res);
  }

  private async request(method: string, path: string, options: RequestOptions = {}): Promise<Response> {
    for (let attempt = 0; ; attempt++) {
      let res: Response;
      try {
        res = await this.fetchOnce(method, path, options);
      } catch (err) {
        if (!isApiError(err) || err.status !== 0 || err.code === "aborted") throw err;
        if (err.code === "timeout" && options.timeoutFinal) throw err;
        await this.afterFailure(attempt, err, null, err.message);
        continue;
      }
      if (RETRY_STATUSES.has(res.status)) {
        const reason = `${method} ${path}: HTTP ${res.status} ${res.statusText}`.trim();
        // A submission's 429 is the fleet's backlog answering, full (or a rate limit): the
        // dispatcher is up, and the caller decides (`submit` splits the chunk or offers it
        // again). Retried on the short budget, never ridden out as an outage.
        const answered = res.status === 429 && method === "POST";
        if (answered) this.recovered();
        if (answered && options.returnBusy) throw await errorFromResponse(res);
        await this.afterFailure(
          attempt,
          await errorFromResponse(res),
          res.headers.get("retry-after"),
          reason,
          !answered,
        );
        continue;
      }
      this.recovered();
      if (res.ok) return res;
      throw await errorFromResponse(res);
    }
  }

  /**
   * After a retryable failure: wait before the next attempt, or throw `err` when the budget is
   * spent (`retries` attempts; with `patience`, for an `outage`, `maxOutageMs` of failures
   * without a success).
   */
  private async afterFailure(
    attempt: number,
    err: ApiError,
    retryAfter: string | null,
    reason: string,
    outage = true,
  ): Promise<void> {
    const delay = this.delayFor(attempt, retryAfter);
    if (this.patience === undefined || !outage) {
      if (attempt >= this.retries) throw err;
      this.onRetry?.({ attempt: attempt + 2, maxAttempts: this.retries + 1, delayMs: delay, reason });
      return this.pause(delay);
    }
    const now = Date.now();
    if (this.outageSince === null) {
      this.outageSince = now;
      this.patience.onOutage?.({ since: new Date(now), reason, code: err.code });
    }
    const downMs = now - this.outageSince;
    if (downMs >= this.patience.maxOutageMs) {
      throw new ApiError(
        err.status,
        err.code,
        `${err.message} (still failing after ${formatDuration(downMs)}; gave up)`,
        { details: err.details, cause: err },
      );
    }
    return this.pause(Math.min(delay, this.patience.maxOutageMs - downMs));
  }

  /** The dispatcher answered: end an outage, if one was going on. */
  private recovered(): void {
    if (this.outageSince === null) return;
    const since = this.outageSince;
    this.outageSince = null;
    this.patience?.onRecovered?.({ since: new Date(since), downMs: Date.now() - since });
  }

  private streamError(batchId: string, err: unknown): ApiError {
    if (isApiError(err)) return err;
    if (this.signal?.aborted)
      return new ApiError(0, "aborted", "aborted while reading results", { cause: err });
    const cause = (err as { cause?: { code?: string; message?: string } }).cause;
    const why = cause?.code ?? cause?.message ?? (err as Error).message;
    return new ApiError(
      0,
      "stream_broken",
      `the results stream of batch ${batchId} from ${this.url} broke off (${why})`,
      { cause: err },
    );
  }

  private async fetchOnce(method: string, path: string, options: RequestOptions): Promise<Response> {
    const headers: Record<string, string> = {
      accept: options.stream ? "application/x-ndjson" : "application/json",
    };
    if (this.token !== null) headers.authorization = `Bearer ${this.token}`;
    if (options.contentType !== undefined) headers["content-type"] = options.contentType;
    if (options.idempotencyKey !== undefined) headers["idempotency-key"] = options.idempotencyKey;
    const timeoutMs = options.timeoutMs ?? this.timeoutMs;
    const timeout = new AbortController();
    const timer = setTimeout(() => timeout.abort(), timeoutMs);
    const signal =
      this.signal === undefined ? timeout.signal : AbortSignal.any([timeout.signal, this.signal]);
    const target = `${this.url}${path}`;
    try {
      const res = await fetch(target, { method, headers, body: options.body, signal });
      if (!options.stream || !res.ok) {
        // Read the body under the same timeout, so a stalled server cannot hang the CLI.
        const text = await res.text();
        return new Response(text, { status: res.status, statusText: res.statusText, headers: res.headers });
      }
      return res;
    } catch (err) {
      if (this.signal?.aborted)
        throw new ApiError(0, "aborted", `${method} ${target}: aborted`, { cause: err });
      if (timeout.signal.aborted) {
        throw new ApiError(0, "timeout", `${method} ${target}: no response within ${timeoutMs} ms`, {
          cause: err,
        });
      }
      const cause = (err as { cause?: { code?: string; message?: string } }).cause;
      const why = cause?.code ?? cause?.message ?? (err as Error).message;
      throw new ApiError(0, "unreachable", `cannot reach the dispatcher at ${this.url} (${why})`, {
        cause: err,
      });
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * Full-jitter exponential delay, or the server's `Retry-After` (seconds or a date; capped) when
   * that is longer: a `Retry-After: 0` (a proxy's) is no reason to retry at once, which for a
   * patient client was a request a millisecond for all of `maxOutageMs`, the backoff never growing.
   */
  private delayFor(attempt: number, retryAfter: string | null): number {
    const backoff = Math.random() * Math.min(this.retryMaxMs, this.retryBaseMs * 2 ** Math.min(attempt, 30));
    const seconds = retryAfter === null ? Number.NaN : Number(retryAfter);
    if (Number.isFinite(seconds) && seconds >= 0)
      return Math.min(Math.max(seconds * 1000, backoff), MAX_RETRY_AFTER_MS);
    // Or an HTTP date (RFC 9110 §10.2.3), as proxies and load balancers send it: read as a
    // number it was none, and the client retried on its own short backoff.
    const at = retryAfter === null ? Number.NaN : Date.parse(retryAfter);
    if (Number.isFinite(at)) return Math.min(Math.max(at - Date.now(), backoff), MAX_RETRY_AFTER_MS);
    return backoff;
  }

  private pause(delay: number): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const onAbort = () => {
        clearTimeout(timer);
        reject(new ApiError(0, "aborted", "aborted while waiting to retry"));
      };
      const timer = setTimeout(() => {
        this.signal?.removeEventListener("abort", onAbort);
        resolve();
      }, delay);
      if (this.signal?.aborted) onAbort();
      else this.signal?.addEventListener("abort", onAbort, { once: true });
    });
  }
}

/**
 * What identifies a result line across two fetches: its rollout id (the raw line if it has none).
 * A copy, not a slice: V8 keeps a regex capture of 13 characters or more as a slice of its line
 * (and the line of its chunk), so the set of keys `batchResultLines` keeps would hold every
 * result read (300 MiB for 20,000 results of 15 KiB), not only their ids.
 */
function resultKey(line: string): string {
  const fast = /^\{"id":"([^"\\]*)"/.exec(line);
  if (fast !== null) return copied(`id:${fast[1]}`);
  try {
    const id = (JSON.parse(line) as { id?: unknown } | null)?.id;
    if (typeof id === "string") return copied(`id:${id}`);
  } catch {
    // not JSON: the line itself
  }
  return `line:${line}`;
}

/** A string of its own, sharing no memory with the one it came from (see `resultKey`). */
function copied(s: string): string {
  return Buffer.from(s).toString();
}

async function parseBody<T>(schema: z.ZodType<T>, res: Response): Promise<T> {
  const text = await res.text();
  let json: unknown = null;
  if (text.trim() !== "") {
    try {
      json = JSON.parse(text);
    } catch (err) {
      throw new ApiError(
        res.status,
        "bad_response",
        `dispatcher answered ${res.status} with non-JSON: ${snippet(text)}`,
        {
          cause: err,
        },
      );
    }
  }
  const parsed = schema.safeParse(json);
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    throw new ApiError(
      res.status,
      "bad_response",
      `unexpected response from the dispatcher (${issue?.path.join(".") || "body"}: ${issue?.message}): ${snippet(text)}`,
      { details: json },
    );
  }
  return parsed.data;
}

async function errorFromResponse(res: Response): Promise<ApiError> {
  const text = await res.text().catch(() => "");
  try {
    const body = ErrorBody.safeParse(JSON.parse(text));
    if (body.success) {
      const { code, message, details } = body.data.error;
      return new ApiError(res.status, code, message, { details });
    }
  } catch {
    // not JSON: fall through
  }
  const what = `${res.status} ${res.statusText}`.trim();
  return new ApiError(
    res.status,
    `http_${res.status}`,
    text.trim() === "" ? what : `${what}: ${snippet(text)}`,
  );
}

function snippet(text: string, max = 300): string {
  const flat = text.replace(/\s+/g, " ").trim();
  return flat.length > max ? `${flat.slice(0, max)}…` : flat;
}
