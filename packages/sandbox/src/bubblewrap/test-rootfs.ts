import { execFile, execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdir } from "node:fs/promises";
import { join } from "node:path";
import { promisify } from "node:util";
import { findCachedRootfsTar, unpackRootfs } from "./rootfs.ts";

const run = promisify(execFile);

/** The repo's `.fleet/cache` (where `scripts/build-base-image.sh` caches the base rootfs tarball). */
export const REPO_CACHE_DIR = join(import.meta.dirname, "../../../../.fleet/cache");

/**
 * For tests: an unpacked base rootfs, from the cached debootstrap tarball or, failing that, a
 * `docker export` of `image` (done once; later runs reuse the unpacked directory).
 */
export async function testRootfs(
  image = "rollout-fleet/base:latest",
  cacheDir = REPO_CACHE_DIR,
): Promise<string> {
  let tar = await findCachedRootfsTar(cacheDir);
  if (tar === null) {
    await mkdir(cacheDir, { recursive: true });
    tar = join(cacheDir, "base-rootfs-docker-export.tar");
    if (!existsSync(tar)) {
      const { stdout } = await run("docker", ["create", image, "sleep", "infinity"]);
      const id = stdout.trim();
      try {
        await run("docker", ["export", "-o", `${tar}.tmp`, id]);
        await run("mv", [`${tar}.tmp`, tar]);
      } finally {
        await run("docker", ["rm", "-f", id]).catch(() => undefined);
      }
    }
  }
  return unpackRootfs(tar, cacheDir);
}

/** Why bwrap cannot make a sandbox on this host, or null when it can. */
export function bwrapUnavailable(): string | null {
  if (process.getuid?.() !== 0) return "the bubblewrap provider needs root";
  try {
    execFileSync(
      "bwrap",
      ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--ro-bind", "/", "/", "true"],
      {
        stdio: "pipe",
        timeout: 10_000,
      },
    );
    return null;
  } catch (err) {
    const stderr = (err as { stderr?: Buffer }).stderr?.toString().trim();
    return `bwrap cannot create namespaces here: ${stderr || String(err)}`;
  }
}
