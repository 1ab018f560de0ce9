import { ReplyError } from "ioredis";
import { describe, expect, it } from "vitest";
import { createRedis, reconnectOnReadOnly } from "./connection.ts";

describe("reconnectOnReadOnly", () => {
  it.each([
    ["READONLY You can't write against a read only replica.", 1],
    // Full, loading, a script's error that quotes the word: the same server will answer again.
    ["OOM command not allowed when used memory > 'maxmemory'.", false],
    ["LOADING Redis is loading the dataset in memory", false],
    ["ERR user_script:1: READONLY quoted by a script", false],
  ] as const)("%s → %s", (message, expected) => {
    expect(reconnectOnReadOnly(new ReplyError(message))).toBe(expected);
  });

  it("is createRedis's unless the caller says otherwise", () => {
    const redis = createRedis("redis://127.0.0.1:1", { lazyConnect: true });
    const own = () => 2 as const;
    const overridden = createRedis("redis://127.0.0.1:1", { lazyConnect: true, reconnectOnError: own });
    expect(redis.options.reconnectOnError).toBe(reconnectOnReadOnly);
    // A duplicate (a BullMQ worker's blocking connection) keeps it.
    expect(redis.duplicate().options.reconnectOnError).toBe(reconnectOnReadOnly);
    expect(overridden.options.reconnectOnError).toBe(own);
    redis.disconnect();
    overridden.disconnect();
  });
});
