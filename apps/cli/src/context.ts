import { once } from "node:events";
import { createWriteStream } from "node:fs";
import { lstat, rename, rm, stat } from "node:fs/promises";
import { dirname } from "node:path";
import type { Writable } from "node:stream";
import { finished } from "node:stream/promises";
import type { TaskContent } from "@fleet/contracts";
import type { FleetClientOptions } from "./client.ts";
import type { ProgressStream } from "./progress.ts";
import { UsageError } from "./requests.ts";

/** Everything a command touches outside itself; `main.ts` fills it from the process. */
export interface CliContext {
  stdout: Writable;
  stderr: Writable & ProgressStream;
  /** Defaults for `--url` / `--token` (from `FLEET_URL` / `FLEET_TOKEN`). */
  defaults: {
    url: string;
    token: string | null;
    /**
     * A bad FLEET_URL (FLEET_TOKEN) let go because the command line seemed to give `--url`
     * (`--token`), which overrides it: the error to give if the command did not get that option
     * after all (the word was another option's value, or an argument after `--`).
     */
    unless?: { url?: string; token?: string };
  };
  readFile: (path: string) => Promise<string>;
  /** `loadSuite` from `@fleet/tasks`. */
  loadSuite: (dir: string, options: { maxBytes: number; only: readonly string[] }) => Promise<TaskContent[]>;
  /** `taskDigest` from `@fleet/tasks`: lets later chunks reference tasks by digest. */
  digestOf?: (task: TaskContent) => string;
  /** Aborted on Ctrl-C. */
  signal: AbortSignal;
  /** Overrides for the API client (tests use short retry delays). */
  client?: Partial<FleetClientOptions>;
  /** Progress reporter settings (tests). */
  progress?: { tty?: boolean; plainIntervalMs?: number };
}

/**
 * Write, waiting for the stream to drain when it asks to (large result sets, slow pipes).
 * @throws OutputError once the stream has failed (stdout on a full disk, an I/O error; a closed
 * pipe is no failure, see `PipeOutput`): a write to it would return without a word, the output lost.
 */
export async function writeText(stream: Writable, text: string): Promise<void> {
  if (stream.errored) throw new OutputError(`cannot write the output: ${stream.errored.message}`);
  if (!stream.write(text)) await once(stream, "drain");
}

/**
 * Once every write so far went out or failed: a write's failure (a full disk) comes after
 * `writeText` returned, so the last one's shows only here. @throws OutputError as `writeText` does.
 */
export async function flushText(stream: Writable): Promise<void> {
  if (!stream.errored) await new Promise<void>((resolve) => stream.write("", () => resolve()));
  if (stream.errored) throw new OutputError(`cannot write the output: ${stream.errored.message}`);
}

/** A results file could not be written (a full disk, an I/O error): exit 1 with this message. */
export class OutputError extends Error {}

/**
 * A results file written to `<path>.partial.<pid>.<n>` and renamed into place only when complete.
 * The temporary name is this file's own: two commands given one `--out` at once each write their
 * own file (the last to finish wins whole), never one file through two handles.
 */
export class ResultsFile {
  private readonly stream: Writable;
  private readonly partial: string;
  /** The stream's first error (open, write or close), thrown by the next call. */
  private failure: Error | null = null;
  lines = 0;

  private constructor(readonly path: string) {
    this.partial = partialPath(path);
    partials++;
    openPartials.add(this.partial);
    this.stream = createWriteStream(this.partial, { flags: "w" });
    // Without a listener an error the stream meets between two calls (ENOSPC, EIO) would be an
    // uncaught 'error' event that kills the process.
    this.stream.on("error", (err) => {
      this.failure ??= err;
    });
  }

  /** Open the partial file now, so a path that cannot be written fails before any work starts. */
  static async open(path: string): Promise<ResultsFile> {
    // Only the rename at the end would find out (after the whole batch ran): `<dir>.partial`, or
    // `<dir>/.partial`, opens fine.
    if (path === "") throw new Error("an empty path; name a file");
    if (path.endsWith("/") || (await stat(path).catch(() => null))?.isDirectory()) {
      throw new Error(`EISDIR: ${path} is a directory; name a file`);
    }
    // The finished file is renamed over the path: whatever else is there (a link, a device such
    // as /dev/stdout or /dev/null, a FIFO) would be replaced by it, not written to.
    const there = await lstat(path).catch(() => null);
    if (there !== null && !there.isFile()) {
      throw new Error(
        `${path} is ${there.isSymbolicLink() ? "a symbolic link" : "not a regular file (a device, a FIFO or a socket)"}, which the results file would replace; name a regular file (a pipe: fleet results writes to stdout)`,
      );
    }
    // A sticky directory (/tmp, a shared drop) lets only a file's owner, or the directory's,
    // replace it: the rename at the end failed with EPERM, after all the work (root may).
    const uid = process.getuid?.() ?? 0;
    if (there !== null && there.uid !== uid && uid !== 0) {
      const parent = await stat(dirname(path));
      if ((parent.mode & 0o1000) !== 0 && parent.uid !== uid) {
        throw new Error(
          `EPERM: ${path} belongs to another user, in a sticky directory (as /tmp is) where only its owner may replace it; name another file`,
        );
      }
    }
    const file = new ResultsFile(path);
    const opened = once(file.stream, "open");
    try {
      await opened;
    } catch (err) {
      await rm(file.partial, { force: true });
      throw err;
    }
    return file;
  }

  /** @throws OutputError when the file cannot be written. */
  async writeLine(line: string): Promise<void> {
    if (this.failure !== null) throw this.cannotWrite(this.failure);
    this.lines++;
    try {
      await writeText(this.stream, `${line}\n`);
    } catch (err) {
      throw this.cannotWrite(err);
    }
  }

  private committed = false;

  /** Flush, close and move into place. @throws OutputError when any of that fails. */
  async commit(): Promise<void> {
    try {
      if (this.failure !== null) throw this.failure;
      this.stream.end();
      await finished(this.stream);
      await rename(this.partial, this.path);
    } catch (err) {
      throw this.cannotWrite(err);
    }
    openPartials.delete(this.partial);
    this.committed = true;
  }

  /** Close and delete the partial file (after a failure; nothing once committed). */
  async discard(): Promise<void> {
    if (this.committed) return;
    if (!this.stream.destroyed) {
      this.stream.destroy();
      await once(this.stream, "close").catch(() => {});
    }
    await rm(this.partial, { force: true });
    openPartials.delete(this.partial);
  }

  private cannotWrite(err: unknown): OutputError {
    return new OutputError(`cannot write ${this.path}: ${(err as Error).message}`, { cause: err });
  }
}

/** Results files this process has opened: each one's partial file is named apart. */
let partials = 0;

/**
 * The partial files of results files neither committed nor discarded yet: what a process made to
 * stop at once (a second Ctrl-C, main.ts) removes before it goes, the discard never to come.
 */
export const openPartials = new Set<string>();

/** Where the next results file opened for `path` is written until it is complete (`ResultsFile`). */
export function partialPath(path: string): string {
  return `${path}.partial.${process.pid}.${partials}`;
}

/** The `--out` results file, opened; a path that cannot be written is a usage error (exit 2). */
export async function openOut(out: string | undefined): Promise<ResultsFile | null> {
  if (out === undefined) return null;
  try {
    return await ResultsFile.open(out);
  } catch (err) {
    throw new UsageError(`cannot write --out ${out}: ${(err as Error).message}`);
  }
}
