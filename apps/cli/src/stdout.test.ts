import { Writable } from "node:stream";
import { finished } from "node:stream/promises";
import { describe, expect, it } from "vitest";
import { writeText } from "./context.ts";
import { PipeOutput } from "./stdout.ts";

function errno(code: string): NodeJS.ErrnoException {
  return Object.assign(new Error(`${code}: write failed`), { code });
}

/** A stdout stand-in that takes `ok` writes, then fails every write with `code`. */
function failingAfter(ok: number, code: string): { target: Writable; written: string[] } {
  const written: string[] = [];
  const target = new Writable({
    write(chunk, _enc, cb) {
      if (written.length >= ok) return cb(errno(code));
      written.push(String(chunk));
      cb();
    },
  });
  return { target, written };
}

describe("PipeOutput", () => {
  it("drops writes once the reader has gone away (EPIPE), telling onReaderGone once", async () => {
    const { target, written } = failingAfter(1, "EPIPE");
    let gone = 0;
    const out = new PipeOutput(target, () => gone++);
    for (const id of ["b-1", "b-2", "b-3", "b-4"]) await writeText(out, `${id}\n`);
    await finished(out.end());
    expect(written).toEqual(["b-1\n"]);
    expect(gone).toBe(1);
    expect(out.readerHasGone).toBe(true);
  });

  it("keeps any other write error an error", async () => {
    const { target } = failingAfter(0, "EIO");
    const out = new PipeOutput(target, () => {
      throw new Error("not a closed pipe");
    });
    out.on("error", () => {});
    await expect(
      new Promise<void>((resolve, reject) => out.write("x\n", (err) => (err ? reject(err) : resolve()))),
    ).rejects.toThrow("EIO");
    expect(out.readerHasGone).toBe(false);
  });
});
