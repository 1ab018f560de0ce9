import { Writable } from "node:stream";

/** A Writable that keeps what is written (stands in for stdout/stderr in tests). */
export class Collector extends Writable {
  private readonly chunks: string[] = [];
  isTTY = false;
  columns = 100;

  override _write(chunk: Buffer | string, _enc: BufferEncoding, cb: (err?: Error | null) => void): void {
    this.chunks.push(chunk.toString());
    cb();
  }

  text(): string {
    return this.chunks.join("");
  }
}
