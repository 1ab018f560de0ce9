/**
 * The longest line `splitLines` holds by default, in characters (64 Mi): far past any result line,
 * and a bound on what a server (or a proxy) that sends one endless line makes the reader hold.
 */
export const MAX_LINE_CHARS = 64 * 2 ** 20;

/** A line ran past `splitLines`'s cap before its end. */
export class LineTooLongError extends Error {
  override readonly name = "LineTooLongError";
}

/**
 * Split a byte stream into UTF-8 text lines (without `\n`/`\r\n`), dropping blank ones.
 * @throws LineTooLongError once a line passes `maxChars` characters without ending.
 */
export async function* splitLines(
  stream: AsyncIterable<Uint8Array>,
  maxChars: number = MAX_LINE_CHARS,
): AsyncGenerator<string> {
  const decoder = new TextDecoder("utf-8");
  // The line not ended yet, in pieces: one string grown chunk by chunk was split whole again at
  // every chunk (its time the square of its length).
  let pieces: string[] = [];
  let held = 0;
  const line = (end: string) => {
    const text = pieces.join("") + end;
    pieces = [];
    held = 0;
    return text.endsWith("\r") ? text.slice(0, -1) : text;
  };
  for await (const chunk of stream) {
    const parts = decoder.decode(chunk, { stream: true }).split("\n");
    const rest = parts.pop() ?? "";
    for (const part of parts) {
      const text = line(part);
      if (text.length > maxChars) throw tooLong(maxChars);
      if (text.trim() !== "") yield text;
    }
    pieces.push(rest);
    held += rest.length;
    if (held > maxChars) throw tooLong(maxChars);
  }
  const last = line(decoder.decode());
  if (last.length > maxChars) throw tooLong(maxChars);
  if (last.trim() !== "") yield last;
}

function tooLong(maxChars: number): LineTooLongError {
  return new LineTooLongError(`a line runs past ${maxChars} characters without ending`);
}
