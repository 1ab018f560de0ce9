import { randomBytes } from "node:crypto";
import { mkdtempSync, readdirSync, readlinkSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Readable } from "node:stream";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { Spool } from "./spool.ts";

async function bytesOf(stream: Readable): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const c of stream) chunks.push(c as Buffer);
  return Buffer.concat(chunks);
}

/** The file descriptors of this process that point at `dir`. */
function fdsInto(dir: string): string[] {
  const targets: string[] = [];
  for (const fd of readdirSync("/proc/self/fd")) {
    try {
      const target = readlinkSync(`/proc/self/fd/${fd}`);
      if (target.startsWith(dir)) targets.push(target);
    } catch {
      // closed between the listing and the read
    }
  }
  return targets;
}

describe("Spool", () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), "spool-test-"));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it("keeps up to its limit in memory and reads it back, as often as asked", async () => {
    const spool = new Spool(10, dir);
    await spool.write(Buffer.from("hello"));
    await spool.write(Buffer.from("world"));
    expect([spool.bytes, spool.onDisk]).toEqual([10, false]);
    expect(fdsInto(dir)).toEqual([]);
    expect((await bytesOf(spool.read())).toString()).toBe("helloworld");
    expect((await bytesOf(spool.read())).toString()).toBe("helloworld");
    await spool.dispose();
  });

  it("past its limit moves to a file with no name (nothing left in its directory even while open), reads every byte back in order, and closes it on dispose", async () => {
    const spool = new Spool(1024, dir);
    const parts = [randomBytes(1000), randomBytes(0), randomBytes(300_000), randomBytes(77)];
    for (const p of parts) await spool.write(p);
    expect([spool.bytes, spool.onDisk]).toEqual([301_077, true]);
    expect(readdirSync(dir)).toEqual([]);
    expect(fdsInto(dir)).toEqual([expect.stringMatching(/fleet-spool-.* \(deleted\)$/)]);
    const whole = Buffer.concat(parts);
    expect((await bytesOf(spool.read())).equals(whole)).toBe(true);
    expect((await bytesOf(spool.read())).equals(whole)).toBe(true); // from the start again
    // A reader that stops early (its stream destroyed) leaves the file to the next one.
    const early = spool.read();
    for await (const _ of early) break;
    expect((await bytesOf(spool.read())).equals(whole)).toBe(true);
    await spool.dispose();
    expect(fdsInto(dir)).toEqual([]);
    await spool.dispose(); // twice is fine
  });

  it("a directory it cannot write to fails the write that would move it there", async () => {
    const spool = new Spool(4, join(dir, "missing"));
    await spool.write(Buffer.from("1234"));
    await expect(spool.write(Buffer.from("5"))).rejects.toMatchObject({ code: "ENOENT" });
    await spool.dispose();
  });
});
