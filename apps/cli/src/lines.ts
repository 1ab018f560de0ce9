/** Split a byte stream into UTF-8 text lines (without `\n`/`\r\n`), dropping blank ones. */
export async function* splitLines(stream: AsyncIterable<Uint8Array>): AsyncGenerator<string> {
  const decoder = new TextDecoder("utf-8");
  let partial = "";
  for await (const chunk of stream) {
    const parts = (partial + decoder.decode(chunk, { stream: true })).split("\n");
    partial = parts.pop() ?? "";
    for (const part of parts) {
      const line = part.endsWith("\r") ? part.slice(0, -1) : part;
      if (line.trim() !== "") yield line;
    }
  }
  const last = (partial + decoder.decode()).replace(/\r$/, "");
  if (last.trim() !== "") yield last;
}
