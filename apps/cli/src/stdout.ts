import { Writable } from "node:stream";

function isEpipe(err: unknown): boolean {
  return (err as NodeJS.ErrnoException | null)?.code === "EPIPE";
}

/**
 * stdout for `fleet ... | head`: once the reader has gone away (EPIPE), later writes are dropped
 * instead of failing or waiting for a drain that never comes, and `onReaderGone` is called once.
 * Any other write error stays an error.
 */
export class PipeOutput extends Writable {
  private gone = false;

  constructor(
    private readonly target: Writable,
    private readonly onReaderGone: () => void,
  ) {
    super({ decodeStrings: false });
    target.on("error", (err) => {
      if (isEpipe(err)) this.readerGone();
    });
  }

  /** True once the reader has gone away. */
  get readerHasGone(): boolean {
    return this.gone;
  }

  override _write(chunk: Buffer | string, encoding: BufferEncoding, cb: (err?: Error | null) => void): void {
    if (this.gone) {
      cb();
      return;
    }
    this.target.write(chunk, encoding, (err) => {
      // Writes queued when the pipe broke fail as "destroyed"; they went to the same reader.
      if (err && (isEpipe(err) || isEpipe(this.target.errored))) this.readerGone();
      cb(this.gone ? null : err);
    });
  }

  private readerGone(): void {
    if (this.gone) return;
    this.gone = true;
    this.onReaderGone();
  }
}
