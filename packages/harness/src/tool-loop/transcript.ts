import { capText, MAX_FIELD_CHARS, wholeSlice } from "@fleet/contracts";
import { type SecretRedactorOptions, secretRedactor } from "@fleet/telemetry";

/**
 * Cap of the stored transcript (characters): the *last* lines that fit are kept. It is one stored
 * text field, so it gets the field cap of DESIGN §2 rule 13.
 */
export const TRANSCRIPT_MAX_CHARS = MAX_FIELD_CHARS;
/** Cap of one text field inside a transcript line. */
export const TRANSCRIPT_FIELD_CHARS = 1000;

/**
 * The episode as JSON lines (one object per message or event), bounded: the oldest lines are
 * dropped once the total passes `maxChars`, and a leading `{"event":"truncated"}` line says how
 * many. Every line passes through `redact` (the credential never appears in it).
 */
export class Transcript {
  private readonly lines: string[] = [];
  private chars = 0;
  private dropped = 0;

  constructor(
    private readonly redact: (text: string) => string,
    private readonly maxChars = TRANSCRIPT_MAX_CHARS,
  ) {}

  add(entry: Record<string, unknown>): void {
    // Every string capped, at any depth, before the line is written and redacted: a tool call's
    // arguments (inside `toolCalls`) may be an answer's whole 8 MiB.
    const line = this.redact(JSON.stringify(capStrings(entry, TRANSCRIPT_FIELD_CHARS)));
    this.lines.push(line);
    this.chars += line.length + 1;
    // Room for the truncation marker line.
    while (this.chars > this.maxChars - 64 && this.lines.length > 1) {
      this.chars -= this.lines.shift()!.length + 1;
      this.dropped += 1;
    }
  }

  toString(): string {
    const head = this.dropped > 0 ? [JSON.stringify({ event: "truncated", droppedLines: this.dropped })] : [];
    const text = [...head, ...this.lines].join("\n");
    // Its last line alone may be past the cap (one turn of several tool calls): cut between
    // characters (`wholeSlice`), never between a surrogate pair's halves.
    return wholeSlice(text, text.length - this.maxChars, text.length);
  }
}

/** `value` with every string in it (at any depth) capped at `max` characters. */
function capStrings(value: unknown, max: number): unknown {
  if (typeof value === "string") return capText(value, max);
  if (Array.isArray(value)) return value.map((v) => capStrings(v, max));
  if (typeof value === "object" && value !== null) {
    const out: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(value)) out[k] = capStrings(v, max);
    return out;
  }
  return value;
}

/**
 * A function that replaces every occurrence of `secret` (if any) with `[redacted]`; with
 * `fragments`, every long enough part of it too (an endpoint refusing the key may quote a prefix
 * back), for text no agent sees (see `SecretRedactorOptions`).
 */
export function redactor(
  secret: string | null,
  options: SecretRedactorOptions = {},
): (text: string) => string {
  if (!secret) return (text) => text;
  return secretRedactor([secret], "[redacted]", options);
}
