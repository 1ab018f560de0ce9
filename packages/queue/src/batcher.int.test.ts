import { mkdtempSync, rmSync } from "node:fs";
import type { Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { MAX_BATCH, ScriptBatcher } from "./batcher.ts";
import { coalesceWrites, createRedis, isRedisUnavailable } from "./connection.ts";
import { createKeys } from "./keys.ts";
import { LocalRedisServer } from "./local-redis.ts";
import { FailoverPair, REPLICATION_ARGS } from "./testing/index.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const prefix = `{t-batch-${Math.random().toString(36).slice(2, 8)}}`;
const keys = createKeys(prefix);

/** fleetReceipt's keys and arguments for a seed receipt `json` on rollout `id`. */
function receiptCall(id: string, json: string): [string[], string[]] {
  const rollout = keys.rollout(id);
  return [
    [rollout, rollout, keys.sandboxes()],
    ["r:seed", json, "seeded", "seed", "t:seed:end", "5", "0", "0", "", "", "", ""],
  ];
}

describe("ScriptBatcher", () => {
  let redis: Redis;
  beforeAll(() => {
    redis = createRedis(REDIS_URL);
  });
  afterAll(async () => {
    const left = await redis.keys(`${prefix}*`);
    if (left.length) await redis.del(...left);
    redis.disconnect();
  });

  const accepted = async (id: string) =>
    redis.hset(keys.rollout(id), "meta", "{}", "status", "accepted", "stage", "admission");

  it("sends one tick's calls as one Redis call and gives each its own reply", async () => {
    const batcher = new ScriptBatcher(redis);
    const ids = ["a1", "a2", "a3", "a4", "a5"];
    for (const id of ids) await accepted(id);
    await redis.hset(keys.rollout("a3"), "status", "completed"); // terminal: its receipt is refused
    const replies = await Promise.all(
      ids.map((id) => batcher.call("fleetReceipt", ...receiptCall(id, `{"for":"${id}"}`))),
    );
    expect(batcher.stats).toEqual({ calls: 5, sent: 1 });
    expect(replies).toEqual([1, 1, 0, 1, 1]);
    for (const id of ["a1", "a2", "a4", "a5"]) {
      expect(await redis.hget(keys.rollout(id), "r:seed")).toBe(`{"for":"${id}"}`);
    }
    expect(await redis.hget(keys.rollout("a3"), "r:seed")).toBeNull();
    // Calls in later ticks are separate sends; a single call goes as the plain script.
    await batcher.call("fleetReceipt", ...receiptCall("a1", "{}"));
    expect(batcher.stats).toEqual({ calls: 6, sent: 2 });
  });

  it("an item whose script fails rejects alone; the others in its batch succeed", async () => {
    const batcher = new ScriptBatcher(redis);
    await accepted("b1");
    await redis.set(keys.rollout("b2"), "not a hash");
    const [ok, bad] = await Promise.allSettled([
      batcher.call("fleetReceipt", ...receiptCall("b1", "{}")),
      batcher.call("fleetReceipt", ...receiptCall("b2", "{}")),
    ]);
    expect(batcher.stats.sent).toBe(1);
    expect(ok).toEqual({ status: "fulfilled", value: 1 });
    expect(bad.status).toBe("rejected");
    expect(String((bad as PromiseRejectedResult).reason)).toMatch(/WRONGTYPE/);
  });

  it("an item a Redis that cannot serve now refuses (a demoted master: READONLY) rejects with Redis's own ReplyError, batched as alone, so callers know to wait it out", async () => {
    // A replica of its own primary: every script write there fails with READONLY, inside the
    // batched form's per-item pcall as in the plain script's call.
    const dirs = [0, 1].map(() => mkdtempSync(join(tmpdir(), "redis-")));
    const primary = await LocalRedisServer.start({ dir: dirs[0]!, args: REPLICATION_ARGS });
    const replica = await LocalRedisServer.start({ dir: dirs[1]! });
    const p = createRedis(primary.url);
    const r = createRedis(replica.url);
    try {
      const ids = ["d1", "d2", "d3"];
      for (const id of ids) {
        await p.hset(keys.rollout(id), "meta", "{}", "status", "accepted", "stage", "admission");
      }
      const { hostname, port } = new URL(primary.url);
      await r.call("REPLICAOF", hostname, port);
      await expect.poll(() => r.exists(keys.rollout("d3")), { timeout: 30_000 }).toBe(1);
      const batcher = new ScriptBatcher(r);
      const alone = await batcher.call("fleetReceipt", ...receiptCall("d1", "{}")).catch((e: unknown) => e);
      const batched = await Promise.allSettled(
        ["d2", "d3"].map((id) => batcher.call("fleetReceipt", ...receiptCall(id, "{}"))),
      );
      expect(batcher.stats).toEqual({ calls: 3, sent: 2 });
      for (const err of [alone, ...batched.map((b) => (b as PromiseRejectedResult).reason)]) {
        expect(err).toBeInstanceOf(Error);
        expect((err as Error).name).toBe("ReplyError");
        expect((err as Error).message).toMatch(/^READONLY /);
        expect(isRedisUnavailable(err)).toBe(true);
      }
      expect(await p.hget(keys.rollout("d2"), "r:seed")).toBeNull();
    } finally {
      p.disconnect();
      r.disconnect();
      await replica.kill();
      await primary.kill();
      for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
    }
  });

  it("a batched item's READONLY makes its connection reconnect, as the plain script's reply does: a connection left on a demoted master finds the new one behind the URL's name", async () => {
    const pair = await FailoverPair.start();
    const { adminA, adminB } = pair;
    const c = createRedis(pair.url);
    try {
      const ids = ["f1", "f2"];
      for (const id of ids) {
        await adminA.hset(keys.rollout(id), "meta", "{}", "status", "accepted", "stage", "admission");
      }
      const batcher = new ScriptBatcher(c);
      const both = () =>
        Promise.allSettled(ids.map((id) => batcher.call("fleetReceipt", ...receiptCall(id, "{}"))));
      await c.ping();
      await pair.failOver();
      const reconnected = new Promise((resolve) => c.once("reconnecting", resolve));
      // Refused inside the batched script's pcall, never as a reply ioredis sees.
      const refused = await both();
      expect(batcher.stats.sent).toBe(1);
      for (const r of refused) expect(String((r as PromiseRejectedResult).reason)).toMatch(/READONLY /);
      await Promise.race([
        reconnected,
        new Promise((_, reject) => setTimeout(() => reject(new Error("no reconnect within 10 s")), 10_000)),
      ]);
      expect(await both()).toEqual(ids.map(() => ({ status: "fulfilled", value: 1 })));
      for (const id of ids) expect(await adminB.hget(keys.rollout(id), "r:seed")).toBe("{}");
    } finally {
      c.disconnect();
      await pair.stop();
    }
  });

  it("what `after` sends goes out before the script's reply is back, and runs after the script", async () => {
    const batcher = new ScriptBatcher(redis);
    await accepted("c1");
    // Bytes Redis sent back on the batcher's connection, counted at the socket.
    const socket = (redis as unknown as { stream: NodeJS.EventEmitter }).stream;
    let received = 0;
    const onData = () => received++;
    socket.on("data", onData);
    let receivedWhenAfterRan: number | null = null;
    let seen: string | null = "unset";
    try {
      await batcher.call("fleetReceipt", ...receiptCall("c1", '{"x":1}'), async () => {
        receivedWhenAfterRan = received;
        seen = await redis.hget(keys.rollout("c1"), "r:seed");
      });
    } finally {
      socket.off("data", onData);
    }
    // One round trip for both: `after` ran before any reply came back...
    expect(receivedWhenAfterRan).toBe(0);
    expect(received).toBeGreaterThan(0);
    // ...and Redis ran what it sent after the script.
    expect(seen).toBe('{"x":1}');
  });

  it("an item whose `after` fails rejects with that error once its script replied; the script's write stands", async () => {
    const batcher = new ScriptBatcher(redis);
    await accepted("f1");
    await expect(
      batcher.call("fleetReceipt", ...receiptCall("f1", '{"y":1}'), async () => {
        throw new Error("the next stage's enqueue failed");
      }),
    ).rejects.toThrow("the next stage's enqueue failed");
    expect(await redis.hget(keys.rollout("f1"), "r:seed")).toBe('{"y":1}');
  });

  it("splits a large tick into calls of at most MAX_BATCH items", async () => {
    const batcher = new ScriptBatcher(redis);
    const ids = Array.from({ length: MAX_BATCH + 10 }, (_, i) => `e${i}`);
    for (const id of ids) await accepted(id);
    const replies = await Promise.all(
      ids.map((id) => batcher.call("fleetReceipt", ...receiptCall(id, "{}"))),
    );
    expect(replies.every((r) => r === 1)).toBe(true);
    expect(batcher.stats).toEqual({ calls: ids.length, sent: 2 });
  });

  it("refuses a call with the wrong number of arguments", () => {
    const batcher = new ScriptBatcher(redis);
    expect(() => batcher.call("fleetReceipt", [keys.rollout("d")], ["only one"])).toThrow(
      /takes 12 arguments/,
    );
  });
});

describe("coalesceWrites", () => {
  it("sends one tick's commands in one socket write, in order, with the right replies", async () => {
    const redis = coalesceWrites(new Redis(REDIS_URL, { maxRetriesPerRequest: null }));
    const plain = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    const counter = `${prefix}:counter`;
    try {
      await Promise.all([redis.ping(), plain.ping()]);
      const writes = (r: Redis) => {
        const socket = r.stream as Socket & { _write: unknown; _writev: unknown };
        const count = { n: 0 };
        for (const m of ["_write", "_writev"] as const) {
          const original = socket[m] as (...a: unknown[]) => unknown;
          socket[m] = function (this: Socket, ...a: unknown[]) {
            count.n++;
            return original.apply(this, a);
          };
        }
        return count;
      };
      const coalesced = writes(redis);
      const separate = writes(plain);
      const replies = await Promise.all(Array.from({ length: 10 }, () => redis.incr(counter)));
      expect(replies).toEqual([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
      expect(coalesced.n).toBe(1);
      // The baseline this is measured against: a plain connection writes once per command.
      await Promise.all(Array.from({ length: 10 }, () => plain.incr(counter)));
      expect(separate.n).toBe(10);
      // Later ticks are written on their own: nothing waits for a batch to fill.
      expect(await redis.get(counter)).toBe("20");
      expect(coalesced.n).toBe(2);
    } finally {
      await redis.del(counter);
      redis.disconnect();
      plain.disconnect();
    }
  });
});
