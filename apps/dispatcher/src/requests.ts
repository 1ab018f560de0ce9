import { RolloutRequest, wholeSlice } from "@fleet/contracts";
import { MAX_METADATA_BYTES } from "@fleet/queue";
import secureJson from "secure-json-parse";
import { z } from "zod";
import { HttpError } from "./http-error.ts";
import { capIssues, describeIssues, formatPath, type Issue, MAX_ISSUES } from "./zod-issues.ts";

/**
 * An NDJSON body as its content-type parser hands it over: read line by line as it arrived
 * (`readNdjsonBatch`), `read()` gives the batch or throws what is wrong with it (the route calls
 * it once its headers are checked). On a route that takes no NDJSON it is left unread.
 */
export class NdjsonBody {
  constructor(readonly read: () => ParsedBatch) {}
}

/** Requests of one submission, and for NDJSON the line each came from (for error messages). */
export interface ParsedBatch {
  requests: RolloutRequest[];
  /** `lines[i]` is the 1-based NDJSON line of `requests[i]`; null for a JSON body. */
  lines: number[] | null;
  /** Where the rows are in a JSON body (`["rollouts"]`, or `[]` for a bare array); null for NDJSON. */
  rowsAt: PropertyKey[] | null;
}

/**
 * A rollout request as the API takes it: the contract's `RolloutRequest`, minus what it allows
 * only for the providers' own tests. `sandbox.pidMode: "host"` would share the host's PID
 * namespace; the seed's isolation probe refuses such a sandbox, but only after making it, and the
 * API can tell up front (DESIGN §2 rule 5): 422.
 */
export const ApiRolloutRequest = RolloutRequest.superRefine((req, ctx) => {
  if (req.sandbox?.pidMode === "host") {
    ctx.addIssue({
      code: "custom",
      path: ["sandbox", "pidMode"],
      message: '"host" would share the host\'s PID namespace; rollouts run isolated',
    });
  }
});

/** `POST /v1/batches` JSON body: `{ "rollouts": [...] }`, or a bare array of requests. */
export const BatchBody = z.union([
  z.strictObject({ rollouts: z.array(ApiRolloutRequest).min(1, "a batch needs at least one rollout") }),
  z.array(ApiRolloutRequest).min(1, "a batch needs at least one rollout"),
]);

/**
 * `BatchBody`'s two shapes with their rows unparsed: `parseBatchJson` checks rows one by one.
 * zod hands an array's problems up by spreading them onto the call stack, so a batch whose rows
 * held a million bad items between them overflowed it (a 500, not a 422).
 */
const BatchEnvelope = [
  z.strictObject({ rollouts: z.array(z.unknown()).min(1, "a batch needs at least one rollout") }),
  z.array(z.unknown()).min(1, "a batch needs at least one rollout"),
] as const;

/**
 * Most invalid rows a batch is checked for. Past it the answer says there are more without
 * checking the rest: a 32 MiB array of bad rows would otherwise take seconds of the event loop
 * and gigabytes for problems nobody reads.
 */
export const MAX_BAD_ROWS = 1000;

/**
 * Most problems a batch is checked for, counted over its rows: past it the answer says there
 * are more. zod spends a few microseconds and a few hundred bytes on each bad value, so 32 MiB of
 * them would hold the event loop for seconds and take gigabytes.
 */
export const MAX_CHECKED_ISSUES = 10_000;

/**
 * Most JSON values (array items and object properties, nested included) one rollout request may
 * hold; checked before the schema, in one cheap walk. A real request, a large inline task
 * included, is far below it.
 */
export const MAX_REQUEST_VALUES = 100_000;

/**
 * Most JSON values `metadata` can hold within MAX_METADATA_BYTES: JSON of n values (array items
 * and object properties, nested included) takes at least 2n + 1 bytes.
 */
export const MAX_METADATA_VALUES = Math.floor((MAX_METADATA_BYTES - 1) / 2);

/** The values in `value`, counted until past `limit` (then it stops: a huge object is not walked). */
function countValues(value: unknown, limit: number): number {
  let count = 0;
  const stack: unknown[] = [value];
  while (stack.length > 0) {
    const v = stack.pop();
    if (Array.isArray(v)) {
      count += v.length;
      if (count > limit) return count;
      for (const c of v) if (typeof c === "object" && c !== null) stack.push(c);
    } else if (typeof v === "object" && v !== null) {
      for (const k in v) {
        if (++count > limit) return count;
        const c = (v as Record<string, unknown>)[k];
        if (typeof c === "object" && c !== null) stack.push(c);
      }
    }
  }
  return count;
}

/**
 * The JSON values in `text` as `countValues` counts them (array items and object properties,
 * nested included), read off the text without parsing it, until past `limit`. For valid JSON it is
 * exact but for duplicate keys (each counted here; parsed, the last one wins): never fewer. Text
 * that is not JSON gets a count all the same (its parse fails anyway).
 */
export function countJsonTextValues(text: string, limit: number): number {
  let count = 0;
  // For each open container, whether it is an array (a comma in it separates items).
  const inArray: boolean[] = [];
  // Just after a '[': the next token, unless it closes the array, is its first item.
  let arrayOpened = false;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c === 0x20 || c === 0x0a || c === 0x0d || c === 0x09) continue;
    if (arrayOpened) {
      arrayOpened = false;
      if (c !== 0x5d && ++count > limit) return count;
    }
    switch (c) {
      case 0x22: {
        // A string: on to its closing quote (one after an even run of backslashes), found with
        // indexOf, which skips a long string (a large task's file) far faster than a loop.
        let end = i;
        for (;;) {
          end = text.indexOf('"', end + 1);
          if (end === -1) return count; // unterminated: no more values to count
          let b = end - 1;
          while (text.charCodeAt(b) === 0x5c) b--;
          if ((end - 1 - b) % 2 === 0) break;
        }
        i = end;
        break;
      }
      case 0x5b: // [
        inArray.push(true);
        arrayOpened = true;
        break;
      case 0x7b: // {
        inArray.push(false);
        break;
      case 0x5d: // ]
      case 0x7d: // }
        inArray.pop();
        break;
      case 0x3a: // : (a property)
        if (++count > limit) return count;
        break;
      case 0x2c: // , (another item, in an array)
        if (inArray[inArray.length - 1] === true && ++count > limit) return count;
        break;
    }
  }
  return count;
}

/**
 * Whether the text of one rollout request (a `POST /v1/rollouts` body, an NDJSON line) holds more
 * than `MAX_REQUEST_VALUES` values, told from the text before it is parsed: `JSON.parse` cannot be
 * cut into turns of the event loop, and 32 MiB of `{"x":[{},{},…]}` held it for seconds before
 * `parseRequest` could refuse the result. Text under 2 bytes a value cannot hold that many.
 */
export function textHasTooManyValues(text: string): boolean {
  return (
    text.length > 2 * MAX_REQUEST_VALUES && countJsonTextValues(text, MAX_REQUEST_VALUES) > MAX_REQUEST_VALUES
  );
}

const TOO_MANY_VALUES = `holds more than ${MAX_REQUEST_VALUES} JSON values, far more than a rollout request (a large task goes by digest)`;

/** `POST /v1/rollouts`'s 422 for a body `textHasTooManyValues` refused (as `parseRolloutBody` refuses a parsed one). */
export function tooManyValuesError(): HttpError {
  return invalid("rollout request", [{ path: "", message: TOO_MANY_VALUES }]);
}

/** `ApiRolloutRequest.safeParse` as issues, their paths under `prefix`. */
function parseRequest(
  value: unknown,
  prefix: readonly PropertyKey[] = [],
): { ok: true; data: RolloutRequest } | { ok: false; issues: Issue[] } {
  if (countValues(value, MAX_REQUEST_VALUES) > MAX_REQUEST_VALUES) {
    const path = formatPath(prefix);
    return {
      ok: false,
      issues: [
        {
          path,
          message: TOO_MANY_VALUES,
        },
      ],
    };
  }
  // `metadata` is free JSON that the schema walks value by value (about a microsecond each), and
  // admission refuses it over MAX_METADATA_BYTES only after the schema: a 32 MiB batch of rows
  // with large metadata held the event loop for seconds before its 422. One with more values
  // than its bound has room for is refused here, before the schema.
  const metadata = (value as { metadata?: unknown } | null)?.metadata;
  if (
    typeof metadata === "object" &&
    metadata !== null &&
    countValues(metadata, MAX_METADATA_VALUES) > MAX_METADATA_VALUES
  ) {
    return {
      ok: false,
      issues: [
        {
          path: formatPath([...prefix, "metadata"]),
          message: `holds more than ${MAX_METADATA_VALUES} JSON values, so its JSON is over the limit of ${MAX_METADATA_BYTES} bytes; keep bulk data on the client, keyed by the rollout id`,
        },
      ],
    };
  }
  const parsed = ApiRolloutRequest.safeParse(value);
  if (parsed.success) return { ok: true, data: parsed.data };
  const issues = describeIssues(parsed.error.issues, prefix);
  // `"agent": "oracle"`, as the CLI's --agent takes it: say what the API takes instead.
  const agent = (value as { agent?: unknown } | null)?.agent;
  if (typeof agent === "string") {
    // Quoted cut between characters (`wholeSlice`): half an emoji is no text a client can print.
    const path = formatPath([...prefix, "agent"]);
    for (const issue of issues) {
      if (issue.path === path) {
        issue.message = `must be an object, e.g. {"harness":"oracle"} or {"harness":"command","argv":[...]}; a name such as "${wholeSlice(agent, 0, 40)}" is the CLI's shorthand for one`;
      }
    }
  }
  return { ok: false, issues };
}

/** 422 with the first issues; `total` counts all of them when the caller kept fewer. */
function invalid(
  what: string,
  issues: Issue[],
  extra: Record<string, unknown> = {},
  total?: number,
): HttpError {
  const first = issues[0];
  const where = first ? `${first.path === "" ? "body" : first.path}: ${first.message}` : "invalid";
  const capped = capIssues(issues);
  return new HttpError(422, "invalid", `${what} is invalid (${where})`, {
    ...extra,
    issues: capped.issues,
    total: total ?? capped.total,
  });
}

/** `POST /v1/rollouts`: one RolloutRequest (strict: unknown fields, e.g. an `apiKey`, are refused). */
export function parseRolloutBody(body: unknown): RolloutRequest {
  // No body at all is malformed; a JSON `null` is a body of the wrong shape (422, as `"x"` is).
  if (body === undefined) {
    throw new HttpError(400, "malformed", "expected a JSON body (content-type: application/json)");
  }
  const parsed = parseRequest(body);
  if (!parsed.ok) throw invalid("rollout request", parsed.issues);
  return parsed.data;
}

/**
 * `POST /v1/batches` with `application/json`, checked whole. (The server reads one with
 * `readBatchJson`, which checks the same rows the same way, handing the event loop on.)
 */
export function parseBatchJson(body: unknown): ParsedBatch {
  const batch = new JsonBatchChecker(body);
  for (let i = 0; i < batch.rows.length; i++) batch.row(i);
  return batch.finish();
}

/**
 * `parseBatchJson`, handing the event loop on every `sliceMs` between rows: checked in one go, the
 * rows of a JSON batch at its 2 MiB bound (15,000 small ones) held it for 0.37-0.5 s, far longer
 * than its `JSON.parse`.
 */
export async function readBatchJson(body: unknown, sliceMs = NDJSON_SLICE_MS): Promise<ParsedBatch> {
  const batch = new JsonBatchChecker(body);
  let sliceStart = performance.now();
  for (let i = 0; i < batch.rows.length; i++) {
    if (performance.now() - sliceStart >= sliceMs) {
      await new Promise<void>((resolve) => setImmediate(resolve));
      sliceStart = performance.now();
    }
    batch.row(i);
  }
  return batch.finish();
}

/**
 * A JSON batch body's envelope checked when it is made (`BatchEnvelope`), then its rows one by
 * one (`row`), up to `MAX_BAD_ROWS` bad rows or `MAX_CHECKED_ISSUES` problems; `finish` gives the
 * batch or throws its 422.
 */
class JsonBatchChecker {
  readonly rows: unknown[];
  private readonly prefix: PropertyKey[];
  private readonly requests: RolloutRequest[] = [];
  private readonly issues: Issue[] = [];
  private total = 0;
  private badRows = 0;

  constructor(body: unknown) {
    if (body === undefined) {
      throw new HttpError(400, "malformed", 'expected a JSON body { "rollouts": [...] } or NDJSON');
    }
    // Pick the shape the client meant, so errors name `rollouts[3].task` rather than both shapes.
    const envelope = Array.isArray(body) ? BatchEnvelope[1] : BatchEnvelope[0];
    const parsed = envelope.safeParse(body);
    if (!parsed.success) throw invalid("batch", describeIssues(parsed.error.issues));
    this.rows = Array.isArray(parsed.data) ? parsed.data : parsed.data.rollouts;
    this.prefix = Array.isArray(parsed.data) ? [] : ["rollouts"];
  }

  /** Row `i` checked; throws the batch's 422 once the caps are reached with rows left. */
  row(i: number): void {
    const { rows, issues } = this;
    const row = parseRequest(rows[i], [...this.prefix, i]);
    if (row.ok) {
      this.requests.push(row.data);
      return;
    }
    this.total += row.issues.length;
    if (issues.length < MAX_ISSUES) issues.push(...row.issues.slice(0, MAX_ISSUES - issues.length));
    if ((++this.badRows >= MAX_BAD_ROWS || this.total >= MAX_CHECKED_ISSUES) && i + 1 < rows.length) {
      throw invalid("batch", issues, { checkedRows: i + 1, rows: rows.length, truncated: true }, this.total);
    }
  }

  /** The batch, once every row was checked; throws its 422 if any was bad. */
  finish(): ParsedBatch {
    if (this.issues.length > 0) throw invalid("batch", this.issues, {}, this.total);
    return { requests: this.requests, lines: null, rowsAt: this.prefix };
  }
}

/**
 * JSON text as the API reads it, a body or an NDJSON line: a `__proto__` or
 * `constructor.prototype` key is refused, not silently dropped.
 *
 * @throws HttpError 400 `malformed` saying what is wrong with `what` ("the body", "line 3").
 */
export function parseJsonText(text: string, what: string, details: unknown = null): unknown {
  try {
    return secureJson.parse(text, undefined, { protoAction: "error", constructorAction: "error" });
  } catch (err) {
    const message = err instanceof Error ? err.message : String(err);
    const why = message.includes("forbidden prototype property")
      ? 'has a "__proto__" or "constructor.prototype" key, which no request may carry'
      : `is not valid JSON (${message})`;
    throw new HttpError(400, "malformed", `${what} ${why}`, details);
  }
}

/** A JSON batch's body (`{"rollouts": [...]}`), as an NDJSON line. */
function isJsonBatchBody(value: unknown): boolean {
  return (
    typeof value === "object" && value !== null && Array.isArray((value as { rollouts?: unknown }).rollouts)
  );
}

/**
 * `POST /v1/batches` with `application/x-ndjson`: one RolloutRequest per line, blank lines
 * ignored. A line that is not JSON → 400 `malformed`; a line that is not a valid request → 422
 * `invalid`; both name the (1-based) line. (The server reads a body line by line as it arrives,
 * with `NdjsonBatchReader`; this is the same for a whole text.)
 */
export function parseBatchNdjson(text: string): ParsedBatch {
  const reader = new NdjsonBatchReader();
  for (const line of text.split("\n")) reader.line(line);
  return reader.finish();
}

/**
 * An NDJSON batch read one line at a time, as its body arrives: each line is parsed and checked
 * when it is handed over, so the body is never held whole, nor parsed in one go once it has all
 * arrived (which held the event loop for as long as the whole batch took). What is wrong is
 * answered by `finish`, as `parseBatchNdjson` answers it: the first line that is not JSON (400;
 * the lines after it are not parsed), else the invalid lines (422; checked up to `MAX_BAD_ROWS`
 * lines or `MAX_CHECKED_ISSUES` problems).
 */
export class NdjsonBatchReader {
  private readonly requests: RolloutRequest[] = [];
  private readonly lines: number[] = [];
  private readonly issues: (Issue & { line: number })[] = [];
  private badLines = 0;
  private checkedIssues = 0;
  private truncated = false;
  private checkedLines = 0;
  private firstBad: number | null = null;
  /** The first bad line is a JSON batch's body (`{"rollouts": [...]}`): NDJSON sent for JSON. */
  private firstBadIsJsonBatch = false;
  private malformed: HttpError | null = null;
  private lineNo = 0;

  /** Whether lines are still parsed: false once a line was not JSON or the checks' caps were reached. */
  get parsing(): boolean {
    return this.malformed === null && this.checkedLines === 0;
  }

  /** The next line of the body (without its `\n`). */
  line(raw: string): void {
    const lineNo = ++this.lineNo;
    if (this.malformed !== null) return;
    if (this.checkedLines > 0) {
      // Past the caps: the rest is not checked, only noted (see MAX_BAD_ROWS, MAX_CHECKED_ISSUES).
      if (!this.truncated && raw.trim() !== "") this.truncated = true;
      return;
    }
    const line = raw.trim();
    if (line === "") return;
    let parsed: ReturnType<typeof parseRequest>;
    let value: unknown;
    if (textHasTooManyValues(line)) {
      // Refused as `parseRequest` would refuse it parsed, without the parse (see the function).
      parsed = { ok: false, issues: [{ path: "", message: TOO_MANY_VALUES }] };
    } else {
      try {
        value = parseJsonText(line, `line ${lineNo}`, { line: lineNo });
      } catch (err) {
        this.malformed = err as HttpError;
        return;
      }
      parsed = parseRequest(value);
    }
    if (parsed.ok) {
      this.requests.push(parsed.data);
      this.lines.push(lineNo);
      return;
    }
    this.badLines++;
    this.checkedIssues += parsed.issues.length;
    if (this.firstBad === null) {
      this.firstBad = lineNo;
      this.firstBadIsJsonBatch = isJsonBatchBody(value);
    }
    for (const issue of parsed.issues) {
      if (this.issues.length < MAX_ISSUES) this.issues.push({ line: lineNo, ...issue });
    }
    if (this.badLines >= MAX_BAD_ROWS || this.checkedIssues >= MAX_CHECKED_ISSUES) this.checkedLines = lineNo;
  }

  /** The batch, once every line was handed over; throws what is wrong with it. */
  finish(): ParsedBatch {
    if (this.malformed !== null) throw this.malformed;
    const { issues, badLines, firstBad, truncated } = this;
    if (firstBad !== null) {
      const first = issues[0]!;
      const more = badLines - 1;
      throw new HttpError(
        422,
        "invalid",
        `line ${firstBad}: ${first.path === "" ? "" : `${first.path}: `}${first.message}` +
          (more > 0 ? ` (and ${truncated ? "at least " : ""}${more} more invalid lines)` : "") +
          (this.firstBadIsJsonBatch
            ? ': a {"rollouts": [...]} body is a JSON batch, which takes Content-Type: application/json'
            : ""),
        {
          line: firstBad,
          badLines,
          issues,
          ...(truncated ? { truncated, checkedLines: this.checkedLines } : {}),
        },
      );
    }
    if (this.requests.length === 0) {
      throw invalid("batch", [{ path: "", message: "a batch needs at least one rollout" }]);
    }
    return { requests: this.requests, lines: this.lines, rowsAt: null };
  }
}

/**
 * Longest stretch of the event loop that reading one NDJSON body keeps: past it, the lines left
 * wait for the loop's next turn, so other requests (`/healthz`, results, a small submit) are
 * answered while a large batch is read.
 */
export const NDJSON_SLICE_MS = 10;

/**
 * An NDJSON batch body read as it arrives: decoded (strict UTF-8), split into lines, each line
 * parsed and checked at once (`NdjsonBatchReader`), the event loop handed on every
 * `NDJSON_SLICE_MS`. Resolves once the body has ended, to what `NdjsonBatchReader.finish` answers
 * (the batch, or its 400/422, thrown when called). Throws at once, the rest unread, for a body
 * that is no UTF-8 (400) or passes `maxBytes` (`tooLarge()`).
 */
export async function readNdjsonBatch(
  payload: AsyncIterable<Buffer | string>,
  options: { maxBytes: number; tooLarge: () => Error; sliceMs?: number },
): Promise<() => ParsedBatch> {
  const sliceMs = options.sliceMs ?? NDJSON_SLICE_MS;
  const reader = new NdjsonBatchReader();
  const decoder = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });
  const decode = (bytes?: Buffer) => {
    try {
      return bytes === undefined ? decoder.decode() : decoder.decode(bytes, { stream: true });
    } catch {
      throw notUtf8();
    }
  };
  let received = 0;
  let partial = "";
  let sliceStart = performance.now();
  for await (const chunk of payload) {
    const bytes = typeof chunk === "string" ? Buffer.from(chunk) : chunk;
    received += bytes.length;
    if (received > options.maxBytes) throw options.tooLarge();
    const text = decode(bytes);
    let from = 0;
    for (let nl = text.indexOf("\n"); nl !== -1; nl = text.indexOf("\n", from)) {
      reader.line(partial === "" ? text.slice(from, nl) : partial + text.slice(from, nl));
      partial = "";
      from = nl + 1;
      if (reader.parsing && performance.now() - sliceStart >= sliceMs) {
        await new Promise<void>((resolve) => setImmediate(resolve));
        sliceStart = performance.now();
      }
    }
    partial += text.slice(from);
  }
  reader.line(partial + decode());
  return () => reader.finish();
}

/** A body whose bytes are no UTF-8: refused, never read with U+FFFD in their place (see `utf8Body`). */
export function notUtf8(): HttpError {
  return new HttpError(400, "malformed", "the body is not valid UTF-8");
}

/** Longest `Idempotency-Key` accepted. */
export const MAX_IDEMPOTENCY_KEY_CHARS = 200;

/** The optional `Idempotency-Key` header: printable ASCII, 1–200 characters. */
export function parseIdempotencyKey(header: string | string[] | undefined): string | null {
  if (header === undefined) return null;
  const value = Array.isArray(header) ? header : [header];
  if (value.length !== 1 || !/^[\x21-\x7e]{1,200}$/.test(value[0]!)) {
    throw new HttpError(
      400,
      "malformed",
      `Idempotency-Key must be one value of 1 to ${MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters`,
    );
  }
  return value[0]!;
}
