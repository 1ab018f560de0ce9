import { z } from "zod";

/** Cap for one stored diagnostic text field (DESIGN §2 rule 13). */
export const MAX_FIELD_CHARS = 4000;
/** Cap for one stored failure/diagnostic record, serialised. */
export const MAX_RECORD_BYTES = 16 * 1024;

const MARK = "…[truncated]";

/** Cap a text to `max` characters, marking the cut. Non-strings are stringified first. */
export function capText(value: unknown, max = MAX_FIELD_CHARS): string {
  const text = typeof value === "string" ? value : value instanceof Error ? value.message : String(value);
  if (text.length <= max) return text;
  return wholeSlice(text, 0, Math.max(0, max - MARK.length)) + MARK;
}

/**
 * `text.slice(start, end)`, less a surrogate pair's half left at either cut: a cut between the
 * two halves of a character beyond the BMP (an emoji) left a lone surrogate, text that is not
 * well-formed, which an endpoint given it back (a tool result in a model's history) may refuse
 * (`\udf89` in JSON). At most `end - start` characters.
 */
export function wholeSlice(text: string, start: number, end: number): string {
  let s = Math.max(0, start);
  let e = Math.min(text.length, end);
  if (e > s && e < text.length && isHighSurrogate(text.charCodeAt(e - 1))) e--;
  if (s > 0 && s < e && isLowSurrogate(text.charCodeAt(s))) s++;
  return text.slice(s, e);
}

/**
 * The last `max` characters of `text`, marked `[truncated]…` at the front when cut, cut between
 * characters (`wholeSlice`): the harnesses' and the verifiers' output tails (`capTail`).
 */
export function tailWithin(text: string, max: number): string {
  const mark = "[truncated]…";
  if (text.length <= max) return text;
  return mark + wholeSlice(text, text.length - Math.max(0, max - mark.length), text.length);
}

const isHighSurrogate = (unit: number) => unit >= 0xd800 && unit <= 0xdbff;
const isLowSurrogate = (unit: number) => unit >= 0xdc00 && unit <= 0xdfff;

/**
 * A stored record within `maxBytes` of UTF-8 JSON (DESIGN §2 rule 13): each field's 4,000
 * characters can still be 24 KB once serialised (escaped control characters, multi-byte text),
 * and a record holds several. While it is too big, its longest string that `keep` does not name
 * (a dotted path, e.g. "answer", which a verifier grades) is cut to half, marked as cut. Returns
 * the value itself when it fits, else a shrunk copy; a record whose protected fields alone are
 * too big is returned with the rest cut as far as it goes.
 */
export function fitRecord<T>(
  value: T,
  maxBytes = MAX_RECORD_BYTES,
  keep: ReadonlySet<string> = new Set(),
): T {
  const json = JSON.stringify(value);
  if (fits(json, maxBytes)) return value;
  return JSON.parse(fitRecordJson(value, maxBytes, keep)) as T;
}

/** Whether JSON text is within `maxBytes` of UTF-8 (at most 3 bytes a UTF-16 unit: short text needs no count). */
function fits(json: string, maxBytes: number): boolean {
  return json.length * 3 <= maxBytes || Buffer.byteLength(json) <= maxBytes;
}

/** `fitRecord`, serialised: the JSON to store (one serialisation when the record fits). */
export function fitRecordJson(
  value: unknown,
  maxBytes = MAX_RECORD_BYTES,
  keep: ReadonlySet<string> = new Set(),
): string {
  let json = JSON.stringify(value);
  if (fits(json, maxBytes)) return json;
  const copy = JSON.parse(json) as unknown;
  for (let round = 0; round < 200; round++) {
    let longest: { holder: Record<string, unknown> | unknown[]; key: string | number; len: number } | null =
      null;
    const walk = (node: unknown, path: string) => {
      if (Array.isArray(node)) {
        for (let i = 0; i < node.length; i++) visit(node, i, node[i], path);
      } else if (node !== null && typeof node === "object") {
        for (const [k, v] of Object.entries(node))
          visit(node as Record<string, unknown>, k, v, path ? `${path}.${k}` : k);
      }
    };
    const visit = (
      holder: Record<string, unknown> | unknown[],
      key: string | number,
      v: unknown,
      path: string,
    ) => {
      if (typeof v === "string") {
        const len = Buffer.byteLength(JSON.stringify(v));
        if (!keep.has(path) && len > MARK.length + 8 && (longest === null || len > longest.len)) {
          longest = { holder, key, len };
        }
      } else walk(v, path);
    };
    walk(copy, "");
    if (longest === null) break;
    const { holder, key } = longest as { holder: Record<string, unknown>; key: string };
    const text = holder[key] as string;
    holder[key] = capText(text, Math.max(MARK.length + 1, Math.floor(text.length / 2)));
    json = JSON.stringify(copy);
    if (Buffer.byteLength(json) <= maxBytes) break;
  }
  return json;
}

/** Decode bytes as UTF-8, replacing invalid sequences with U+FFFD (never throws). */
export function decodeUtf8(bytes: Uint8Array): string {
  return new TextDecoder("utf-8", { fatal: false }).decode(bytes);
}

/**
 * The longest duration anything in the fleet accepts: a week. Beyond it a deadline is no
 * deadline, and timers overflow (Node's `setTimeout` fires at once past about 24.8 days).
 */
export const MAX_DURATION_S = 7 * 24 * 3600;

/** The shortest duration (agent, verifier, tool timeouts, deadlines) a rollout may ask for. */
export const MIN_DURATION_S = 1;

/** A duration in seconds: finite, strictly positive, at most a week (DESIGN §2 rule 5/13). */
export const Seconds = z
  .number({
    error: (iss) => (typeof iss.input === "number" ? "must be finite" : "must be a number of seconds"),
  })
  .refine((n) => Number.isFinite(n), { message: "must be finite" })
  .refine((n) => n > 0, { message: "must be positive" })
  // Less leaves nothing once a sandbox is prepared: every attempt would end the same way, as an
  // infrastructure failure (masked, retried), never the request's own fault.
  .refine((n) => n <= 0 || n >= MIN_DURATION_S, { message: `must be at least ${MIN_DURATION_S} second` })
  .refine((n) => n <= MAX_DURATION_S, { message: `must be at most ${MAX_DURATION_S} (a week)` });

/** A duration in milliseconds: finite, strictly positive, at most a week. */
export const Millis = z
  .number({
    error: (iss) => (typeof iss.input === "number" ? "must be finite" : "must be a number of milliseconds"),
  })
  .refine((n) => Number.isFinite(n), { message: "must be finite" })
  .refine((n) => n > 0, { message: "must be positive" })
  .refine((n) => n <= MAX_DURATION_S * 1000, {
    message: `must be at most ${MAX_DURATION_S * 1000} (a week)`,
  });

/** A text field capped on parse rather than rejected: diagnostics must never be lost for being long. */
export const CappedText = z.string().transform((s) => capText(s));

/**
 * A fetch response's body as UTF-8 text, read up to `max` bytes: `null` (and the rest of the
 * body cancelled) when it is longer, so a caller never holds an unbounded answer in memory.
 * Decoded as fetch's `text()` decodes it: a leading byte order mark is dropped (some proxies
 * write one before their JSON, which JSON.parse refuses), invalid sequences become U+FFFD.
 */
export async function readBodyCapped(response: Response, max: number): Promise<string | null> {
  if (response.body === null) return "";
  const chunks: Uint8Array[] = [];
  let size = 0;
  const reader = response.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.byteLength;
    if (size > max) {
      await reader.cancel().catch(() => {});
      return null;
    }
    chunks.push(value);
  }
  return decodeUtf8(Buffer.concat(chunks));
}

/**
 * `work`, or a rejection with `message` once `ms` pass first (a call that may hang rather than
 * fail: a daemon, Redis). The losing promise's outcome is ignored, never an unhandled rejection.
 */
export function withTimeout<T>(work: Promise<T>, ms: number, message: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(message)), ms);
  });
  work.catch(() => undefined);
  return Promise.race([work, timeout]).finally(() => clearTimeout(timer));
}
