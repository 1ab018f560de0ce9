import { randomUUID } from "node:crypto";
import { type FileHandle, open, unlink } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Readable } from "node:stream";

/** Bytes of one read from a spool's file. */
const READ_CHUNK_BYTES = 256 * 1024;

/** Bytes a spool keeps in memory; past them it moves to a file. @defaultValue 8 MiB */
export const SPOOL_IN_MEMORY_BYTES = 8 * 1024 * 1024;

/**
 * Bytes collected to be read back, possibly more than once (an image's /workspace archive, up to
 * the workspace's cap, read before its sandbox starts and staged after): in memory up to
 * `inMemoryBytes`, then in a temporary file in `dir` (`TMPDIR`). The file is unlinked as soon as
 * it is opened: it has no name, so a process killed meanwhile leaves nothing on disk, and it is
 * gone once `dispose` closes it.
 */
export class Spool {
  private chunks: Buffer[] = [];
  private file: FileHandle | null = null;
  /** Bytes written so far. */
  bytes = 0;

  constructor(
    private readonly inMemoryBytes: number = SPOOL_IN_MEMORY_BYTES,
    private readonly dir: string = tmpdir(),
  ) {}

  async write(chunk: Buffer): Promise<void> {
    this.bytes += chunk.length;
    if (this.file === null && this.bytes <= this.inMemoryBytes) {
      this.chunks.push(chunk);
      return;
    }
    if (this.file === null) {
      const path = join(this.dir, `fleet-spool-${randomUUID()}`);
      const file = await open(path, "wx+", 0o600);
      this.file = file; // closed by dispose, whatever follows
      await unlink(path);
      for (const held of this.chunks) await writeAll(file, held);
      this.chunks = [];
    }
    await writeAll(this.file, chunk);
  }

  /** Whether it moved to a file. */
  get onDisk(): boolean {
    return this.file !== null;
  }

  /** A stream of everything written, from the start (each call a new one). */
  read(): Readable {
    if (this.file === null) return Readable.from(this.chunks, { objectMode: false });
    // Positional reads of the shared handle, not a file stream on it: destroying a file stream
    // closes its descriptor (autoClose or not), and a reader that stopped early would leave every
    // later read a closed file.
    const file = this.file;
    return Readable.from(
      (async function* () {
        for (let at = 0; ; ) {
          const chunk = Buffer.allocUnsafe(READ_CHUNK_BYTES);
          const { bytesRead } = await file.read(chunk, 0, chunk.length, at);
          if (bytesRead === 0) return;
          at += bytesRead;
          yield chunk.subarray(0, bytesRead);
        }
      })(),
      { objectMode: false },
    );
  }

  /** Let go of the bytes (closing the file frees its disk). */
  async dispose(): Promise<void> {
    const file = this.file;
    this.file = null;
    this.chunks = [];
    await file?.close();
  }
}

async function writeAll(file: FileHandle, chunk: Buffer): Promise<void> {
  for (let at = 0; at < chunk.length; ) {
    const { bytesWritten } = await file.write(chunk, at, chunk.length - at, null);
    at += bytesWritten;
  }
}
