import { execFile } from "node:child_process";
import { existsSync } from "node:fs";
import { chmod, mkdir, mkdtemp, readdir, rename, rm, stat } from "node:fs/promises";
import { basename, join } from "node:path";
import { promisify } from "node:util";
import { FleetError } from "@fleet/contracts";

const run = promisify(execFile);

/**
 * Unpack a rootfs tarball (e.g. `.fleet/cache/base-rootfs-<hash>.tar` written by
 * `scripts/build-base-image.sh`, or `docker export` of the base image) once into
 * `<cacheDir>/bwrap-<name of the tar>/` and return that directory. Idempotent and safe against a
 * concurrent unpack (it extracts into a temporary directory and renames it into place).
 */
export async function unpackRootfs(tarPath: string, cacheDir: string): Promise<string> {
  const dir = join(cacheDir, `bwrap-${basename(tarPath).replace(/\.tar$/, "")}`);
  if (existsSync(join(dir, "bin")) || existsSync(join(dir, "usr"))) return dir;
  if (!existsSync(tarPath))
    throw FleetError.nonRetryable("invalid_task", `rootfs tarball ${tarPath} does not exist`);
  await mkdir(cacheDir, { recursive: true });
  const tmp = await mkdtemp(join(cacheDir, ".bwrap-rootfs-"));
  try {
    await run("tar", ["-x", "-p", "-f", tarPath, "-C", tmp], { maxBuffer: 16 * 1024 * 1024 });
    // mkdtemp made the directory 0700 and a tarball without a "./" entry (docker export) leaves
    // it so: the sandbox's `/` must be traversable by the agent user.
    await chmod(tmp, 0o755);
    await rename(tmp, dir);
  } catch (err) {
    await rm(tmp, { recursive: true, force: true });
    if (existsSync(join(dir, "usr"))) return dir; // another process won the race
    throw FleetError.nonRetryable("invalid_task", `unpacking rootfs ${tarPath} failed: ${String(err)}`, err);
  }
  return dir;
}

/**
 * The newest `base-rootfs-*.tar` in `cacheDir` (what `scripts/build-base-image.sh` caches), by
 * modification time, or null. Not the last by name: the name holds the recipe's hash, and a
 * cache that kept an older recipe's tarball must not hand that one out (an older rootfs may lack
 * what the sandbox now expects, e.g. `/run/fleet`, the verify fence's mount point).
 */
export async function findCachedRootfsTar(cacheDir: string): Promise<string | null> {
  let names: string[];
  try {
    names = await readdir(cacheDir);
  } catch {
    return null;
  }
  let newest: { path: string; mtimeMs: number } | null = null;
  for (const name of names.filter((n) => /^base-rootfs-[0-9a-f]+\.tar$/.test(n)).sort()) {
    const path = join(cacheDir, name);
    const mtimeMs = await stat(path).then(
      (s) => s.mtimeMs,
      () => null, // removed meanwhile (a rebuild deleting older recipes' tarballs)
    );
    if (mtimeMs !== null && (newest === null || mtimeMs >= newest.mtimeMs)) newest = { path, mtimeMs };
  }
  return newest?.path ?? null;
}
