import { Queue, Worker } from "bullmq";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { STAGE_CATALOG, STAGES } from "./catalog.ts";
import { createRedis } from "./connection.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const prefix = `{t-catalog-${Math.random().toString(36).slice(2, 8)}}`;

describe("stage catalog, with BullMQ", () => {
  let redis: Redis;
  beforeAll(() => {
    redis = createRedis(REDIS_URL);
  });
  afterAll(async () => {
    const left = await redis.keys(`${prefix}*`);
    if (left.length) await redis.del(...left);
    redis.disconnect();
  });

  it("a stage job that failed every attempt keeps only its last failure's stack, not one per attempt (each with a message of up to 4,000 characters)", async () => {
    for (const stage of STAGES) expect(STAGE_CATALOG[stage].options.stackTraceLimit, stage).toBe(1);
    const queue = new Queue("seed", { connection: redis, prefix });
    // The seed's options, its backoff shortened so that the test waits milliseconds, not minutes.
    await queue.add(
      "seed",
      { rolloutId: "r1" },
      { ...STAGE_CATALOG.seed.options, attempts: 4, backoff: { type: "fixed", delay: 10 }, jobId: "r1.seed" },
    );
    let attempt = 0;
    const connection = createRedis(REDIS_URL);
    const worker = new Worker(
      "seed",
      async () => {
        attempt++;
        throw new Error(`attempt ${attempt}: ${"x".repeat(4000)}`);
      },
      { connection, prefix },
    );
    try {
      await vi.waitFor(async () => expect(await queue.getJobState("r1.seed")).toBe("failed"), {
        timeout: 20_000,
        interval: 50,
      });
      const job = (await queue.getJob("r1.seed"))!;
      expect(job.attemptsMade).toBe(4);
      expect(job.stacktrace).toHaveLength(1);
      expect(job.stacktrace?.[0]).toMatch(/^Error: attempt 4: x{4000}/);
      expect(job.failedReason).toMatch(/^attempt 4: /);
    } finally {
      await worker.close();
      await queue.close();
      connection.disconnect();
    }
  });
});
