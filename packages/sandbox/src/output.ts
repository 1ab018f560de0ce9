import { decodeUtf8 } from "@fleet/contracts";

/**
 * Collects up to `maxBytes` of a byte stream and counts (but drops) the rest. Memory stays
 * bounded however much a command prints. With `tailBytes`, the last `tailBytes` of the stream
 * are kept too (the first `maxBytes - tailBytes` and the last `tailBytes`): a command's end (a
 * test summary, the last error) is what its reader wants, and the middle is what goes.
 */
export class CappedBuffer {
  readonly maxBytes: number;
  readonly tailBytes: number;
  private readonly chunks: Buffer[] = [];
  private kept = 0;
  /** The newest bytes past the head: a ring of `tailBytes` (allocated on first use). */
  private ring: Buffer | null = null;
  /** Where the ring's next byte goes, and how many of its bytes are filled. */
  private ringPos = 0;
  private ringFill = 0;
  /** Every byte seen, kept or dropped. */
  totalBytes = 0;

  constructor(maxBytes: number, options: { tailBytes?: number } = {}) {
    if (!Number.isInteger(maxBytes) || maxBytes < 0)
      throw new RangeError(`maxBytes must be a non-negative integer`);
    const tailBytes = options.tailBytes ?? 0;
    if (!Number.isInteger(tailBytes) || tailBytes < 0 || tailBytes > maxBytes)
      throw new RangeError(`tailBytes must be an integer in [0, maxBytes]`);
    this.maxBytes = maxBytes;
    this.tailBytes = tailBytes;
  }

  write(chunk: Uint8Array): void {
    this.totalBytes += chunk.length;
    const room = this.maxBytes - this.tailBytes - this.kept;
    let rest = chunk;
    if (room > 0) {
      const part = chunk.length <= room ? chunk : chunk.subarray(0, room);
      // Copy: the caller may reuse its buffer (socket chunks are sliced views).
      this.chunks.push(Buffer.from(part));
      this.kept += part.length;
      rest = chunk.subarray(part.length);
    }
    if (this.tailBytes === 0 || rest.length === 0) return;
    // O(bytes written) whatever the chunking: a byte-at-a-time flood costs no more than a burst.
    this.ring ??= Buffer.allocUnsafe(this.tailBytes);
    const take = rest.length <= this.tailBytes ? rest : rest.subarray(rest.length - this.tailBytes);
    const first = Math.min(take.length, this.tailBytes - this.ringPos);
    this.ring.set(take.subarray(0, first), this.ringPos);
    if (first < take.length) this.ring.set(take.subarray(first), 0);
    this.ringPos = (this.ringPos + take.length) % this.tailBytes;
    this.ringFill = Math.min(this.tailBytes, this.ringFill + take.length);
  }

  get truncated(): boolean {
    return this.totalBytes > this.maxBytes;
  }

  /** The kept head: everything, when no tail is kept and nothing was cut. */
  bytes(): Buffer {
    return Buffer.concat(this.chunks, this.kept);
  }

  /**
   * The kept bytes as UTF-8 with U+FFFD for invalid sequences. When the cap cut a multi-byte
   * character in half, the partial character is dropped rather than shown as U+FFFD. With a tail
   * and bytes cut between head and tail, the two are joined by a line saying how many went.
   */
  text(): string {
    if (this.ringFill === 0) return decodeCapped(this.bytes(), this.truncated);
    if (!this.truncated) return decodeUtf8(Buffer.concat([this.bytes(), this.tailBuffer()]));
    const head = trimPartialUtf8(this.bytes());
    const tail = trimLeadingPartialUtf8(this.tailBuffer());
    const cut = this.totalBytes - head.length - tail.length;
    return `${decodeUtf8(head)}\n[… ${cut} bytes cut …]\n${decodeUtf8(tail)}`;
  }

  /** The last bytes written past the head, oldest first (at most `tailBytes`). */
  private tailBuffer(): Buffer {
    if (!this.ring || this.ringFill === 0) return Buffer.alloc(0);
    if (this.ringFill < this.tailBytes) return Buffer.from(this.ring.subarray(0, this.ringFill));
    return Buffer.concat([this.ring.subarray(this.ringPos), this.ring.subarray(0, this.ringPos)]);
  }
}

/**
 * An exec's stdout and stderr buffers under `maxBytes` each; `keepTail` (a command's own output,
 * not the provider's reads) keeps the last half of the cap as well as the first.
 */
export function execOutputBuffers(
  maxBytes: number,
  keepTail = false,
): { stdout: CappedBuffer; stderr: CappedBuffer } {
  const tailBytes = keepTail ? Math.floor(maxBytes / 2) : 0;
  return {
    stdout: new CappedBuffer(maxBytes, { tailBytes }),
    stderr: new CappedBuffer(maxBytes, { tailBytes }),
  };
}

/** Drop the continuation bytes of a character cut in half at the very start of `bytes`. */
export function trimLeadingPartialUtf8(bytes: Buffer): Buffer {
  let i = 0;
  while (i < Math.min(3, bytes.length) && (bytes[i]! & 0xc0) === 0x80) i++;
  return bytes.subarray(i);
}

/** Decode capped output: UTF-8 with U+FFFD, minus a character the cap cut in half. */
export function decodeCapped(bytes: Buffer, truncated: boolean): string {
  return decodeUtf8(truncated ? trimPartialUtf8(bytes) : bytes);
}

/** Drop an incomplete UTF-8 sequence at the very end of `bytes` (at most 3 bytes). */
export function trimPartialUtf8(bytes: Buffer): Buffer {
  const n = bytes.length;
  // Walk back over at most 3 continuation bytes to the lead byte of the last character.
  for (let back = 1; back <= Math.min(4, n); back++) {
    const b = bytes[n - back]!;
    if ((b & 0xc0) === 0x80) continue; // continuation byte
    const need = b >= 0xf0 && b <= 0xf4 ? 4 : b >= 0xe0 && b < 0xf0 ? 3 : b >= 0xc2 && b < 0xe0 ? 2 : 1;
    return need > back ? bytes.subarray(0, n - back) : bytes;
  }
  return bytes;
}

/** Docker's multiplexed attach stream: frames of an 8-byte header (stream, 0, 0, 0, size BE32) + payload. */
const HEADER_BYTES = 8;

/**
 * Streaming demultiplexer for Docker's non-TTY attach protocol. Payload bytes are routed to
 * `stdout`/`stderr` as they arrive (a frame is never buffered whole); only a split header is
 * held back. Pure: feed it chunks, unit-testable without a daemon.
 */
export class DockerStreamDemuxer {
  private header = Buffer.alloc(HEADER_BYTES);
  private headerFill = 0;
  private remaining = 0;
  private target: CappedBuffer | null = null;

  constructor(
    private readonly stdout: CappedBuffer,
    private readonly stderr: CappedBuffer,
  ) {}

  push(chunk: Buffer): void {
    let offset = 0;
    while (offset < chunk.length) {
      if (this.remaining === 0) {
        const take = Math.min(HEADER_BYTES - this.headerFill, chunk.length - offset);
        chunk.copy(this.header, this.headerFill, offset, offset + take);
        this.headerFill += take;
        offset += take;
        if (this.headerFill < HEADER_BYTES) return;
        this.headerFill = 0;
        const kind = this.header[0];
        this.remaining = this.header.readUInt32BE(4);
        // 0 = stdin echo (never with AttachStdin off), 1 = stdout, 2 = stderr.
        this.target = kind === 2 ? this.stderr : kind === 1 ? this.stdout : null;
        continue;
      }
      const take = Math.min(this.remaining, chunk.length - offset);
      this.target?.write(chunk.subarray(offset, offset + take));
      this.remaining -= take;
      offset += take;
    }
  }
}
