import type { RedisConnection } from "./connection.ts";
import { BATCHED, type BatchedScript, type ScriptedRedis, slotError, withScripts } from "./scripts.ts";

interface Item {
  keys: readonly string[];
  args: readonly string[];
  resolve(reply: unknown): void;
  reject(err: unknown): void;
  after?: () => Promise<unknown>;
}

/**
 * Coalesces the hot-path scripts that many rollouts call at about the same time: every call of
 * a `BATCHED` script made during one tick goes to Redis as one `<name>Many` call at the end of
 * the tick (a single call goes as itself). Each item runs the same script body as before,
 * atomically on its own, and gets its own reply or error. (That a flush leaves in one socket
 * write is the connection's business: `coalesceWrites`.)
 *
 * An item's `after` runs right after the flush has sent the script, in the same tick, on the same
 * connection: Redis runs one connection's commands in order, so what `after` sends (e.g. the
 * next stage's job) executes after the item's script.
 *
 * One batcher per connection (`batcherFor`), shared by everything that uses the connection.
 */
export class ScriptBatcher {
  private readonly redis: ScriptedRedis;
  private readonly pending = new Map<BatchedScript, Item[]>();
  private scheduled = false;
  /** Calls made, and Redis calls they went out as (for tests and benchmarks). */
  readonly stats = { calls: 0, sent: 0 };

  constructor(redis: RedisConnection) {
    this.redis = withScripts(redis);
  }

  call(
    script: BatchedScript,
    keys: readonly string[],
    args: readonly string[],
    after?: () => Promise<unknown>,
  ): Promise<unknown> {
    if (args.length !== BATCHED[script].args) {
      throw new Error(`${script} takes ${BATCHED[script].args} arguments, got ${args.length}`);
    }
    this.stats.calls++;
    return new Promise((resolve, reject) => {
      let items = this.pending.get(script);
      if (!items) {
        items = [];
        this.pending.set(script, items);
      }
      items.push({ keys, args, resolve, reject, after });
      if (!this.scheduled) {
        this.scheduled = true;
        process.nextTick(() => this.flush());
      }
    });
  }

  private flush(): void {
    this.scheduled = false;
    for (const [script, items] of this.pending) {
      this.pending.delete(script);
      for (let i = 0; i < items.length; i += MAX_BATCH) {
        const chunk = items.slice(i, i + MAX_BATCH);
        try {
          this.send(script, chunk);
        } catch (err) {
          // Whatever failed before the command was sent fails its items, not the process.
          for (const item of chunk) item.reject(err);
        }
      }
    }
  }

  private send(script: BatchedScript, items: Item[]): void {
    let replies: Promise<unknown[]>;
    if (items.length === 1) {
      const [only] = items as [Item];
      replies = this.redis[script](...only.keys, ...only.args).then((r) => [r]);
    } else {
      // The key count, every item's keys, then every item's args, in plain loops: `flatMap` runs
      // on V8's slow path (Node 20: about 13 µs for 8 items, the loops 0.5 µs).
      const argv: (string | number)[] = [0];
      for (const it of items) for (const k of it.keys) argv.push(k);
      argv[0] = argv.length - 1;
      for (const it of items) for (const a of it.args) argv.push(a);
      replies = this.redis[`${script}Many`](...argv) as Promise<unknown[]>;
    }
    this.stats.sent++;
    // `after` is called now, in this tick: what it sends follows the script on the wire.
    const afters = items.map((item) => {
      if (!item.after) return undefined;
      let after: Promise<unknown>;
      try {
        after = item.after();
      } catch (err) {
        after = Promise.reject(err);
      }
      // Handled below once the script replied; never an unhandled rejection meanwhile.
      after.catch(() => undefined);
      return after;
    });
    const settle = (item: Item, after: Promise<unknown> | undefined, row: unknown) => {
      const err = slotError(row, this.redis);
      if (err) item.reject(err);
      else if (after) after.then(() => item.resolve(row), item.reject);
      else item.resolve(row);
    };
    replies.then(
      (rows) => {
        for (let i = 0; i < items.length; i++) settle(items[i]!, afters[i], rows[i]);
      },
      (err: unknown) => {
        for (const item of items) item.reject(err);
      },
    );
  }
}

/** Items per Redis call at most (a tick can hold thousands: an admission of a big batch). */
export const MAX_BATCH = 256;

const batchers = new WeakMap<RedisConnection, ScriptBatcher>();

/** The connection's one batcher. */
export function batcherFor(redis: RedisConnection): ScriptBatcher {
  let batcher = batchers.get(redis);
  if (!batcher) {
    batcher = new ScriptBatcher(redis);
    batchers.set(redis, batcher);
  }
  return batcher;
}
