import { setTimeout as sleep } from "node:timers/promises";
import { capText, FleetError, readBodyCapped, wholeSlice } from "@fleet/contracts";
import {
  CONTEXT_LENGTH_WORDING,
  isChatCompletion,
  isSlowGatewayTimeout,
  linkLocalRefusal,
  type ModelDispatcher,
  modelFetch,
  probeKey,
} from "@fleet/gateway";
import { abortError } from "../run-command.ts";

/** Jittered exponential backoff between attempts of one model call. */
export interface RetryPolicy {
  /** First backoff ceiling. @defaultValue 500 */
  baseMs: number;
  /** Largest backoff ceiling. @defaultValue 30_000 */
  maxMs: number;
  /** Source of jitter in [0, 1). @defaultValue Math.random */
  random: () => number;
}

export const DEFAULT_RETRY_POLICY: Readonly<RetryPolicy> = Object.freeze({
  baseMs: 500,
  maxMs: 30_000,
  random: Math.random,
});

/** "Full jitter": a uniform wait in [0, min(maxMs, baseMs·2^(attempt-1))]. Pure given `random`. */
export function backoffMs(attempt: number, policy: RetryPolicy): number {
  const ceiling = Math.min(policy.maxMs, policy.baseMs * 2 ** Math.max(0, attempt - 1));
  return Math.floor(policy.random() * ceiling);
}

/** `Retry-After` (seconds or an HTTP date) or `retry-after-ms`, in ms; `null` when absent/invalid. */
export function retryAfterMs(headers: Headers, now = Date.now()): number | null {
  const ms = headers.get("retry-after-ms");
  if (ms !== null && /^\d+(\.\d+)?$/.test(ms.trim())) return Math.ceil(Number(ms));
  const value = headers.get("retry-after");
  if (value === null) return null;
  if (/^\d+(\.\d+)?$/.test(value.trim())) return Math.ceil(Number(value) * 1000);
  const at = Date.parse(value);
  return Number.isNaN(at) ? null : Math.max(0, at - now);
}

/** Whether an error response says the conversation no longer fits the model's context. */
export function isContextLengthError(status: number, body: unknown): boolean {
  if (status < 400 || status >= 500 || status === 429) return false;
  const e = errorFields(body);
  if (e.code === "context_length_exceeded") return true;
  return CONTEXT_LENGTH_WORDING.test(e.message ?? "");
}

/** An error body's `error` (an object with string fields, or a bare string: its message). */
function errorFields(body: unknown): { message?: string; code?: string; type?: string } {
  const error = typeof body === "object" && body !== null ? (body as { error?: unknown }).error : undefined;
  if (typeof error === "string") return { message: error };
  if (typeof error !== "object" || error === null) return {};
  const { message, code, type } = error as Record<string, unknown>;
  const str = (x: unknown) => (typeof x === "string" ? x : undefined);
  return { message: str(message), code: str(code), type: str(type) };
}

/** Statuses worth another attempt: timeouts, conflicts, rate limits and server errors. */
export function isRetryableStatus(status: number): boolean {
  return status === 408 || status === 409 || status === 425 || status === 429 || status >= 500;
}

export type ChatCallResult =
  /** A 2xx JSON answer. `failedAttempts` were retried before it. */
  | { kind: "ok"; body: unknown; failedAttempts: number }
  /** The model refused the conversation as too long for its context. */
  | { kind: "context_length"; message: string; failedAttempts: number }
  /**
   * The endpoint, which answered this episode before, refused the conversation itself (400, 413,
   * 422): something the policy wrote it will not take (e.g. tool-call arguments it re-parses).
   */
  /** (`unread`: a 2xx over the size bound, billed likely, its usage unread.) */
  | { kind: "refused"; message: string; failedAttempts: number; unread?: true }
  /**
   * The agent's deadline came: while the model was still answering (`inFlight`: a call sent and
   * cut, which the endpoint may finish and bill), or before another attempt could be sent.
   */
  | { kind: "deadline"; failedAttempts: number; inFlight: boolean }
  /** The request is over `MAX_REQUEST_BYTES` (the conversation grew past it): never sent. */
  | { kind: "too_large"; bytes: number; failedAttempts: 0 };

export interface ChatCallInput {
  /** `<baseUrl>/chat/completions` */
  url: string;
  /** Sent only as `Authorization: Bearer`; `null` sends none. */
  apiKey: string | null;
  body: unknown;
  /** Absolute epoch ms: no attempt or wait goes past it. */
  deadlineMs: number;
  signal: AbortSignal;
  retry: RetryPolicy;
  /** Removes the credential from any text before it is kept (errors, transcript). */
  redact: (text: string) => string;
  /** Called after each probe request (`probeKey`), whose usage is not metered. */
  onProbe?: () => void;
  /** Called before each backoff wait. */
  onRetry?: (info: { attempt: number; status: number | null; reason: string; waitMs: number }) => void;
  /** Called for each attempt that failed (before a retry's wait, or before giving up). */
  onFailedAttempt?: () => void;
  /**
   * Called as each attempt is sent, before its answer: the endpoint may bill it whatever comes of
   * it (an answer, an error, no answer, the signal cutting it off).
   */
  onAttempt?: () => void;
  /**
   * Whether the endpoint has answered an earlier call of this episode: only then is a 400, 413 or
   * 422 a refusal of the conversation the policy wrote (`refused`, graded) rather than of the
   * request as configured (final `agent_error`). (A first call the deadline cuts is the agent's
   * timeout either way: without streaming a hung endpoint looks like a slow generation, and
   * masking those would let a policy trade slow answers for masks.) @defaultValue false
   */
  answeredBefore?: boolean;
  /**
   * Longest wait for one attempt's answer; past it the attempt counts as failed and is retried
   * (within the deadline). The only timeout of an attempt: `modelFetch` sets none of its own.
   * @defaultValue `ATTEMPT_TIMEOUT_MS`
   */
  attemptTimeoutMs?: number;
  /** The connections' dispatcher. @defaultValue `modelFetch`'s, which never connects to a link-local address */
  dispatcher?: ModelDispatcher;
  /** How long a proxy's gateway timeout must have taken to be no sure failure. @defaultValue `GATEWAY_TIMEOUT_MIN_MS` */
  gatewayTimeoutMinMs?: number;
}

/** Default per-attempt wait for a model answer: an attempt unanswered after it is taken for a hung connection. */
export const ATTEMPT_TIMEOUT_MS = 300_000;

/**
 * One model call: POST until a usable answer, retrying 429/5xx/connection errors and malformed
 * answers with jittered backoff (honouring `Retry-After`), all inside the one deadline.
 *
 * @throws FleetError `provider_unavailable` (final: the deadline is spent) when the endpoint did
 *   not give a usable answer before the deadline after at least one failed attempt.
 * @throws FleetError `agent_error` (final) for any other 4xx (bad credential, unknown model, …).
 * @throws the abort error when `signal` aborts.
 */
export async function callChatCompletion(input: ChatCallInput): Promise<ChatCallResult> {
  const { redact } = input;
  let attempt = 0;
  let lastFailure: string | null = null;
  // Whether the last failure was the endpoint failing for sure (an error status, a refused
  // connection, an unusable answer). An attempt cut by its own timeout is not: a long generation
  // looks the same, and a deadline after it is the agent's timeout (graded), never a mask a policy
  // could buy with answers that take long.
  let definite = false;
  const failedForSure = (): boolean => lastFailure !== null && definite;
  const unavailable = (): FleetError =>
    FleetError.nonRetryable(
      "provider_unavailable",
      `model endpoint gave no usable answer before the agent's deadline (${attempt} attempt${attempt === 1 ? "" : "s"}; last: ${lastFailure})`,
    );
  const attemptMs = input.attemptTimeoutMs ?? ATTEMPT_TIMEOUT_MS;
  // Written once for all attempts; a conversation past the bound is not sent at all.
  const payload = JSON.stringify(input.body);
  const bytes = Buffer.byteLength(payload);
  if (bytes > MAX_REQUEST_BYTES) return { kind: "too_large", bytes, failedAttempts: 0 };

  for (;;) {
    if (input.signal.aborted) throw abortError(input.signal);
    const remaining = input.deadlineMs - Date.now();
    if (remaining <= 0) {
      if (failedForSure()) throw unavailable();
      return { kind: "deadline", failedAttempts: attempt, inFlight: false };
    }
    attempt += 1;
    const cutByDeadline = remaining <= attemptMs;
    // Whole milliseconds: a deadline of a fraction of one (a timeout of 8.0305 s) made
    // AbortSignal.timeout throw a RangeError before any attempt, every model call of the episode.
    const timeout = AbortSignal.timeout(Math.ceil(Math.min(remaining, attemptMs)));
    const headers: Record<string, string> = {
      "content-type": "application/json",
      accept: "application/json",
    };
    if (input.apiKey) headers.authorization = `Bearer ${input.apiKey}`;

    let status: number | null = null;
    let waitAtLeast: number | null = null;
    const sentAt = Date.now();
    try {
      input.onAttempt?.();
      const res = await modelFetch(
        input.url,
        {
          method: "POST",
          headers,
          body: payload,
          signal: AbortSignal.any([input.signal, timeout]),
          // The credential goes to the agent's base URL only, never where a redirect points: a
          // 3xx is a refusal (final), like any other non-retryable status.
          redirect: "manual",
        },
        input.dispatcher,
      );
      status = res.status;
      const capped = await readBodyCapped(res, MAX_RESPONSE_BYTES);
      if (capped === null && res.ok) {
        // An answer that large is the model's own generation (no maxTokens, a runaway tool call):
        // the episode ends on it, graded, as on a refusal; retried until the deadline it would
        // have been masked, a mask the policy bought with its own output.
        return {
          kind: "refused",
          message: `HTTP ${status}: the model's answer was over ${MAX_RESPONSE_BYTES} bytes (set model.maxTokens to bound it)`,
          failedAttempts: attempt - 1,
          unread: true,
        };
      }
      if (capped === null) throw new Error(`model response over ${MAX_RESPONSE_BYTES} bytes`);
      const text = capped;
      let body: unknown = null;
      try {
        body = JSON.parse(text);
      } catch {
        // handled below: a 2xx we cannot read is retried; an error body is described as text
      }
      if (res.ok) {
        if (isChatCompletion(body)) return { kind: "ok", body, failedAttempts: attempt - 1 };
        lastFailure = `HTTP ${status} with an unreadable chat completion: ${snippet(text, redact)}`;
        definite = true;
      } else if (isContextLengthError(status, body)) {
        return {
          kind: "context_length",
          message: snippet(errorMessage(body, text), redact),
          failedAttempts: attempt - 1,
        };
      } else {
        // A bare 403 after answered calls (no word about the content) is a key refused or a
        // firewall's rule on what the policy wrote: a plain request with the same key tells them
        // apart. Answered (any answer but 401/403/3xx): the key works, the 403 was the request's.
        const bare403 =
          status === 403 &&
          input.answeredBefore === true &&
          !CONTENT_REFUSAL.test(`${errorMessage(body, text)} ${errorFields(body).type ?? ""}`);
        // A 402 after answered calls: an account out of credit (the key refused a plain request
        // too), or one that cannot cover the `max_tokens` this request asked for (answered).
        const asked402 = status === 402 && input.answeredBefore === true;
        const probe =
          bare403 || asked402
            ? await probeKey({
                url: input.url,
                apiKey: input.apiKey,
                model: (input.body as { model?: unknown } | null)?.model,
                timeoutMs: Math.min(30_000, input.deadlineMs - Date.now()),
                signal: input.signal,
              })
            : null;
        if (input.signal.aborted) throw abortError(input.signal);
        if (probe !== null) input.onProbe?.();
        if (probe === "silent" && Date.now() >= input.deadlineMs) {
          // The deadline came while the endpoint was asked: nothing showed the key refused.
          return { kind: "deadline", failedAttempts: attempt - 1, inFlight: false };
        }
        if (
          input.answeredBefore === true &&
          (status === 401 ||
            status === 404 ||
            status === 405 ||
            status === 410 ||
            (status >= 300 && status < 400) ||
            ((bare403 || asked402) && probe !== "works"))
        ) {
          // The same endpoint, key and model answered this episode's earlier calls: a key rotated
          // or revoked, an account out of credit (a 402 a plain request gets too), a server
          // restarted without the model, or one now redirecting (a proxy's expired sign-in, a move
          // to https) or refusing the method, is the infrastructure's (masked, as the command
          // harness's gateway counts it), never the agent's. On a first call it is the agent
          // spec's (below). A 403 that says it refused the content (a moderation flag on what the
          // policy wrote), or a 403 or 402 beside a key that still works (a `max_tokens` the
          // balance cannot cover), is the conversation's: graded, as a 400 is (below).
          throw FleetError.nonRetryable(
            "provider_unavailable",
            `model endpoint stopped accepting the episode's requests: HTTP ${status}: ${snippet(errorMessage(body, text), redact)}`,
          );
        }
        if (
          (status === 400 || status === 402 || status === 403 || status === 413 || status === 422) &&
          input.answeredBefore === true
        ) {
          return {
            kind: "refused",
            message: `HTTP ${status}: ${snippet(errorMessage(body, text), redact)}`,
            failedAttempts: attempt - 1,
          };
        }
        if (!isRetryableStatus(status)) {
          throw FleetError.nonRetryable(
            "agent_error",
            `model endpoint refused the request: HTTP ${status}: ${snippet(errorMessage(body, text), redact)}`,
          );
        }
        lastFailure = `HTTP ${status}: ${snippet(errorMessage(body, text), redact)}`;
        // A proxy's gateway timeout: as the attempt's own timeout, no sure failure (unless it came
        // at once: then it timed nothing out, and the upstream behind the proxy is down).
        definite = !isSlowGatewayTimeout(status, Date.now() - sentAt, input.gatewayTimeoutMinMs);
        waitAtLeast = retryAfterMs(res.headers);
      }
    } catch (err) {
      if (err instanceof FleetError) throw err;
      if (input.signal.aborted) throw abortError(input.signal);
      // The base URL's name resolves to a link-local or metadata address now (it did not when
      // the episode started): the agent spec's endpoint, never called, and no retry.
      const linkLocal = linkLocalRefusal(err);
      if (linkLocal) throw FleetError.nonRetryable("agent_error", linkLocal.message);
      if (timeout.aborted && cutByDeadline) {
        // The deadline came mid-attempt: still the endpoint's fault if it had already failed us
        // (this attempt, which the reason counts, in the usage gap too: it may have been billed).
        if (failedForSure()) {
          input.onFailedAttempt?.();
          throw unavailable();
        }
        return { kind: "deadline", failedAttempts: attempt - 1, inFlight: true };
      }
      if (timeout.aborted) {
        lastFailure = `no answer within ${attemptMs} ms`;
        definite = false;
      } else {
        lastFailure = `${status === null ? "connection failed" : `HTTP ${status}, body unreadable`}: ${snippet(describe(err), redact)}`;
        definite = true;
      }
    }

    // This attempt failed (an error status, no answer in time, a broken connection, an unusable
    // answer): counted whether a retry follows or not.
    input.onFailedAttempt?.();
    const waitMs = Math.max(backoffMs(attempt, input.retry), waitAtLeast ?? 0);
    if (Date.now() + waitMs >= input.deadlineMs) {
      if (failedForSure()) throw unavailable();
      return { kind: "deadline", failedAttempts: attempt, inFlight: false };
    }
    input.onRetry?.({ attempt, status, reason: lastFailure ?? "", waitMs });
    try {
      await sleep(waitMs, undefined, { signal: input.signal });
    } catch {
      throw abortError(input.signal);
    }
  }
}

/** A refusal of the content itself (moderation), by its message or error code. */
const CONTENT_REFUSAL = /moderation|flagged|content[ _-]?(policy|filter|management)|safety|violat/i;

/** A chat completion whose first choice carries a message (else the answer is malformed: retried). */
function errorMessage(body: unknown, text: string): string {
  const { message, code } = errorFields(body);
  if (message === undefined) return text;
  return code === undefined ? message : `${message} (${code})`;
}

/**
 * At most 500 characters of an error body, the credential redacted. Cut to 2,000 first: redacting
 * all of a 8 MiB body took seconds of the worker's event loop, and a key the first cut splits
 * leaves at most a few characters before it that fragment redaction has not caught.
 */
export function snippet(text: string, redact: (t: string) => string): string {
  // Between characters (`wholeSlice`): half an emoji at the cut outlives the 500 once trimmed.
  return capText(redact(wholeSlice(text, 0, 2000)).trim(), 500);
}

function describe(err: unknown): string {
  if (!(err instanceof Error)) return String(err);
  const cause = err.cause instanceof Error ? ` (${err.cause.message})` : "";
  return `${err.message}${cause}`;
}

/**
 * Largest model response read; a bigger one is an error (it would otherwise fill the worker's
 * memory). The tool loop asks for one choice, no logprobs: 8 MiB is far more than any model's
 * longest answer, and parsing a hostile body of that size stalls the worker for a second or two,
 * not the ten of 32 MiB.
 */
export const MAX_RESPONSE_BYTES = 8 * 1024 * 1024;

/**
 * Largest request one model call sends: the whole conversation goes back each step, and an
 * endpoint answering each step with dozens of long tool calls grew it by megabytes a step (181 MB
 * bodies, a 1.5 GB worker, at 30 steps). Several times any model's context; past it the episode
 * ends as on the model's own context-length refusal (graded).
 */
export const MAX_REQUEST_BYTES = 16 * 1024 * 1024;
