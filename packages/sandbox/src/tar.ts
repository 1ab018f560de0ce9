import type { FileSet } from "@fleet/contracts";
import tar from "tar-stream";

export interface TarOptions {
  uid: number;
  gid: number;
  /**
   * Modes of single files, by relative path spelled as `normalizeRelativePath` spells it
   * (`a/b`, no `./`); they win over `mode`.
   */
  modes?: Readonly<Record<string, number>>;
  /** File mode of the files `modes` does not name; when unset, files starting with `#!` get 0755 and others 0644. */
  mode?: number;
  /** @defaultValue 0o755 */
  dirMode?: number;
  /**
   * Relative directory (no leading `/`) the files are placed under inside the archive; its
   * components get directory entries too, so they are created with the right owner.
   */
  prefix?: string;
  /** @defaultValue now */
  mtime?: Date;
}

/** The regular-file type bits of a `st_mode`. */
const S_IFREG = 0o100000;

/** Split a relative path into components, refusing absolute paths and `..`. */
export function safeRelativeParts(path: string): string[] {
  if (path.startsWith("/") || path.includes("\0")) throw new RangeError(`not a relative path: ${path}`);
  const parts = path.split("/").filter((p) => p !== "" && p !== ".");
  if (parts.includes("..")) throw new RangeError(`path must not contain '..': ${path}`);
  return parts;
}

/**
 * Build an uncompressed tar of `files` (relative path → UTF-8 text) with explicit ownership,
 * a directory entry for every parent directory, entries in a stable order.
 */
export async function buildTar(files: FileSet, options: TarOptions): Promise<Buffer> {
  const mtime = options.mtime ?? new Date();
  const dirMode = options.dirMode ?? 0o755;
  const prefix = options.prefix ? safeRelativeParts(options.prefix) : [];
  const owner = { uid: options.uid, gid: options.gid, uname: "", gname: "" };

  const dirs = new Set<string>();
  const entries: Array<{ name: string; body: Buffer; mode: number }> = [];
  for (let i = 1; i <= prefix.length; i++) dirs.add(prefix.slice(0, i).join("/"));
  for (const rel of Object.keys(files).sort()) {
    const own = safeRelativeParts(rel);
    const parts = [...prefix, ...own];
    if (parts.length === prefix.length) throw new RangeError(`empty file path: '${rel}'`);
    for (let i = 1; i < parts.length; i++) dirs.add(parts.slice(0, i).join("/"));
    const body = Buffer.from(files[rel]!, "utf8");
    // Its own entry only: a file named `constructor` or `toString` must not find Object's.
    const key = own.join("/");
    const given = options.modes && Object.hasOwn(options.modes, key) ? options.modes[key] : undefined;
    if (given !== undefined && !(Number.isInteger(given) && given >= 0 && given <= 0o777)) {
      throw new RangeError(`file mode of '${rel}' must be permission bits 0..0o777, got ${given}`);
    }
    const mode = given ?? options.mode ?? (body.subarray(0, 2).toString("latin1") === "#!" ? 0o755 : 0o644);
    entries.push({ name: parts.join("/"), body, mode });
  }

  const pack = tar.pack();
  const out: Buffer[] = [];
  const done = new Promise<Buffer>((resolve, reject) => {
    pack.on("data", (chunk: unknown) => out.push(chunk as Buffer));
    pack.on("end", () => resolve(Buffer.concat(out)));
    pack.on("error", reject);
  });
  for (const dir of [...dirs].sort()) {
    pack.entry({ name: `${dir}/`, type: "directory", mode: dirMode, mtime, ...owner });
  }
  for (const e of entries) {
    // With the regular-file type bits: tar-stream takes a mode of 0 for "none given" and writes
    // 0644 instead; the header keeps only the permission bits either way.
    const mode = S_IFREG | e.mode;
    pack.entry({ name: e.name, type: "file", mode, mtime, size: e.body.length, ...owner }, e.body);
  }
  pack.finalize();
  return done;
}

/**
 * Whether a tar stream (Docker's archive of a directory, entries named `<dir>/…`) holds anything
 * below its top directory. Stops reading at the first such entry.
 */
export async function tarHasContent(stream: NodeJS.ReadableStream): Promise<boolean> {
  const extract = tar.extract();
  let found = false;
  return new Promise<boolean>((resolve, reject) => {
    extract.on("entry", (header, body, next) => {
      const below = header.name.replace(/\/+$/, "").split("/").length > 1;
      body.resume();
      if (below) {
        found = true;
        extract.destroy();
        resolve(true);
        return;
      }
      next();
    });
    extract.on("finish", () => resolve(found));
    extract.on("error", (err) => (found ? resolve(true) : reject(err)));
    stream.on("error", (err) => (found ? resolve(true) : reject(err)));
    stream.pipe(extract);
  });
}
