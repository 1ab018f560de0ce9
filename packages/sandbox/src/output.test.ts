import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { CappedBuffer, DockerStreamDemuxer, decodeCapped, trimPartialUtf8 } from "./output.ts";

function frame(kind: 1 | 2, payload: Buffer): Buffer {
  const header = Buffer.alloc(8);
  header[0] = kind;
  header.writeUInt32BE(payload.length, 4);
  return Buffer.concat([header, payload]);
}

describe("CappedBuffer", () => {
  it("keeps at most maxBytes and flags the rest", () => {
    const b = new CappedBuffer(5);
    b.write(Buffer.from("abc"));
    b.write(Buffer.from("defgh"));
    expect(b.bytes().toString()).toBe("abcde");
    expect(b.truncated).toBe(true);
    expect(b.totalBytes).toBe(8);
  });

  it("is not truncated at exactly maxBytes", () => {
    const b = new CappedBuffer(3);
    b.write(Buffer.from("abc"));
    expect(b.truncated).toBe(false);
    expect(b.text()).toBe("abc");
  });

  it("copies chunks so a reused input buffer cannot change what was kept", () => {
    const b = new CappedBuffer(10);
    const chunk = Buffer.from("abc");
    b.write(chunk);
    chunk.fill(0x7a);
    expect(b.text()).toBe("abc");
  });

  it("decodes invalid UTF-8 with U+FFFD", () => {
    const b = new CappedBuffer(100);
    b.write(Buffer.from([0x6f, 0x6b, 0x20, 0xff, 0xfe, 0x20, 0x65]));
    expect(b.text()).toBe("ok \uFFFD\uFFFD e");
  });

  it("drops a character the cap cut in half instead of showing U+FFFD", () => {
    const b = new CappedBuffer(4);
    b.write(Buffer.from("ab€", "utf8")); // € is 3 bytes: the cap keeps 2 of them
    expect(b.truncated).toBe(true);
    expect(b.text()).toBe("ab");
  });
});

describe("CappedBuffer with a tail", () => {
  it("keeps the start and the end, and says how much of the middle went", () => {
    const b = new CappedBuffer(8, { tailBytes: 4 });
    for (const c of ["abc", "defgh", "ijklmn", "opqrst"]) b.write(Buffer.from(c));
    expect(b.truncated).toBe(true);
    expect(b.totalBytes).toBe(20);
    expect(b.text()).toBe("abcd\n[… 12 bytes cut …]\nqrst");
  });

  it("is everything, in order, while it fits", () => {
    const b = new CappedBuffer(8, { tailBytes: 4 });
    for (const c of ["abc", "def", "gh"]) b.write(Buffer.from(c));
    expect(b.truncated).toBe(false);
    expect(b.text()).toBe("abcdefgh");
  });

  it("keeps exactly the first and the last halves whatever the chunking (property)", () => {
    const ascii = fc.string({ unit: "grapheme-ascii", maxLength: 30 });
    fc.assert(
      fc.property(fc.array(ascii, { maxLength: 40 }), fc.integer({ min: 1, max: 20 }), (parts, half) => {
        const all = parts.join("");
        const b = new CappedBuffer(2 * half, { tailBytes: half });
        for (const p of parts) b.write(Buffer.from(p));
        const expected =
          all.length <= 2 * half
            ? all
            : `${all.slice(0, half)}\n[… ${all.length - 2 * half} bytes cut …]\n${all.slice(-half)}`;
        expect(b.text()).toBe(expected);
      }),
    );
  });

  it("keeps the exact end of two million one-byte writes (what a byte-at-a-time flood sends)", () => {
    const b = new CappedBuffer(1024 * 1024, { tailBytes: 512 * 1024 });
    const one = Buffer.from("x");
    for (let i = 0; i < 2_000_000; i++) b.write(one);
    const last = Buffer.from("END");
    b.write(last);
    expect(b.totalBytes).toBe(2_000_003);
    expect(b.text().endsWith("xxxEND")).toBe(true);
    expect(b.text()).toContain(`[… ${2_000_003 - 1024 * 1024} bytes cut …]`);
  });

  it("drops a character cut in half at either edge of the cut", () => {
    const b = new CappedBuffer(6, { tailBytes: 3 });
    b.write(Buffer.from("ab€xyz€", "utf8")); // a b [e2 82 ac] x y z [e2 82 ac]
    expect(b.text()).toBe("ab\n[… 6 bytes cut …]\n€");
    const c = new CappedBuffer(6, { tailBytes: 3 });
    c.write(Buffer.from("abcdefgh€", "utf8")); // the tail is the € (3 bytes) exactly
    expect(c.text()).toBe("abc\n[… 5 bytes cut …]\n€");
    const d = new CappedBuffer(6, { tailBytes: 2 });
    d.write(Buffer.from("abcdefgh€", "utf8")); // the tail starts inside the €
    expect(d.text()).toBe("abcd\n[… 7 bytes cut …]\n");
  });
});

describe("trimPartialUtf8", () => {
  it("keeps complete text", () => {
    for (const s of ["", "a", "é", "€", "😀", "a😀"]) {
      expect(trimPartialUtf8(Buffer.from(s)).toString()).toBe(s);
    }
  });

  it("removes any incomplete tail of a multi-byte character", () => {
    const full = Buffer.from("x😀");
    for (let cut = 2; cut < full.length; cut++) {
      expect(trimPartialUtf8(full.subarray(0, cut)).toString()).toBe("x");
    }
  });

  it("never yields U+FFFD for a cut of valid UTF-8 (property)", () => {
    fc.assert(
      // Inputs that already hold U+FFFD are excluded: the property is about the cut, not the input.
      fc.property(
        fc.string({ unit: "grapheme" }).filter((x) => !x.includes("\uFFFD")),
        fc.nat(),
        (s, n) => {
          const bytes = Buffer.from(s, "utf8");
          const cut = bytes.subarray(0, n % (bytes.length + 1));
          expect(decodeCapped(cut, true)).not.toContain("\uFFFD");
        },
      ),
    );
  });
});

describe("DockerStreamDemuxer", () => {
  it("routes frames to stdout and stderr", () => {
    const out = new CappedBuffer(100);
    const err = new CappedBuffer(100);
    const d = new DockerStreamDemuxer(out, err);
    d.push(
      Buffer.concat([
        frame(1, Buffer.from("out1 ")),
        frame(2, Buffer.from("err")),
        frame(1, Buffer.from("out2")),
      ]),
    );
    expect(out.text()).toBe("out1 out2");
    expect(err.text()).toBe("err");
  });

  it("handles headers and payloads split at any byte (property)", () => {
    fc.assert(
      fc.property(
        fc.array(fc.tuple(fc.constantFrom<1 | 2>(1, 2), fc.uint8Array({ maxLength: 40 }))),
        fc.array(fc.integer({ min: 1, max: 13 }), { minLength: 1 }),
        (frames, cuts) => {
          const wire = Buffer.concat(frames.map(([k, p]) => frame(k, Buffer.from(p))));
          const out = new CappedBuffer(10_000);
          const err = new CappedBuffer(10_000);
          const d = new DockerStreamDemuxer(out, err);
          let offset = 0;
          for (let i = 0; offset < wire.length; i++) {
            const n = cuts[i % cuts.length]!;
            d.push(wire.subarray(offset, offset + n));
            offset += n;
          }
          const expected = (kind: 1 | 2) =>
            Buffer.concat(frames.filter(([k]) => k === kind).map(([, p]) => Buffer.from(p)));
          expect(out.bytes().equals(expected(1))).toBe(true);
          expect(err.bytes().equals(expected(2))).toBe(true);
        },
      ),
    );
  });

  it("caps each stream on its own", () => {
    const out = new CappedBuffer(4);
    const err = new CappedBuffer(100);
    const d = new DockerStreamDemuxer(out, err);
    d.push(frame(1, Buffer.alloc(1000, 0x61)));
    d.push(frame(2, Buffer.from("still here")));
    expect(out.text()).toBe("aaaa");
    expect(out.truncated).toBe(true);
    expect(err.text()).toBe("still here");
    expect(err.truncated).toBe(false);
  });
});
