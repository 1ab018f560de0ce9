import { mkdtemp, rm, utimes, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, describe, expect, it } from "vitest";
import { findCachedRootfsTar } from "./rootfs.ts";

describe("findCachedRootfsTar", () => {
  const dirs: string[] = [];
  afterEach(async () => {
    for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
  });
  async function cache(files: Record<string, number>): Promise<string> {
    const dir = await mkdtemp(join(tmpdir(), "rootfs-cache-"));
    dirs.push(dir);
    for (const [name, ageS] of Object.entries(files)) {
      await writeFile(join(dir, name), "");
      const t = Date.now() / 1000 - ageS;
      await utimes(join(dir, name), t, t);
    }
    return dir;
  }

  it("picks the newest tarball by modification time, not the last by name", async () => {
    // The older recipe's hash sorts last: a lexicographic pick would hand out the stale rootfs.
    const dir = await cache({ "base-rootfs-ffff.tar": 3600, "base-rootfs-0000.tar": 10 });
    expect(await findCachedRootfsTar(dir)).toBe(join(dir, "base-rootfs-0000.tar"));
  });

  it("ignores other files and answers null for an empty or missing cache", async () => {
    const dir = await cache({
      "base-rootfs-docker-export.tar": 0,
      "base-rootfs-abc.tar.tmp": 0,
      "notes.txt": 0,
    });
    expect(await findCachedRootfsTar(dir)).toBeNull();
    expect(await findCachedRootfsTar(join(dir, "missing"))).toBeNull();
    const one = await cache({ "base-rootfs-abc.tar": 100 });
    expect(await findCachedRootfsTar(one)).toBe(join(one, "base-rootfs-abc.tar"));
  });
});
