import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { createRedis, type RedisConnection } from "./connection.ts";
import { startRedisClock } from "./redis-clock.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";

describe("the fleet's clock (Redis's)", () => {
  let redis: RedisConnection;
  beforeAll(() => {
    redis = createRedis(REDIS_URL);
  });
  afterAll(async () => {
    vi.restoreAllMocks();
    await redis.quit();
  });

  async function redisNow(): Promise<number> {
    const [s, us] = await redis.time();
    return Number(s) * 1000 + Math.floor(Number(us) / 1000);
  }

  it("reads Redis's time on a host whose clock is 90 s ahead, and says so once", async () => {
    const realNow = Date.now.bind(Date);
    vi.spyOn(Date, "now").mockImplementation(() => realNow() + 90_000);
    const warnings: Array<{ obj: object; msg: string }> = [];
    const clock = await startRedisClock(redis, {
      resyncMs: 20,
      logger: { warn: (obj, msg) => warnings.push({ obj, msg }) },
    });
    try {
      const before = await redisNow();
      const now = clock.now();
      const after = await redisNow();
      expect(now).toBeGreaterThanOrEqual(before - 50);
      expect(now).toBeLessThanOrEqual(after + 50);
      expect(clock.offsetMs()).toBeGreaterThan(-90_100);
      expect(clock.offsetMs()).toBeLessThan(-89_900);
      expect(warnings).toHaveLength(1);
      expect(warnings[0]!.msg).toMatch(/90\.0 s ahead of Redis's/);

      // The host's clock stepped back to the truth (NTP): followed at the next measure.
      vi.mocked(Date.now).mockImplementation(realNow);
      const start = realNow();
      while (Math.abs(clock.offsetMs()) > 100) {
        if (realNow() - start > 10_000) throw new Error("the offset was not measured again");
        await new Promise((r) => setTimeout(r, 10));
      }
      expect(Math.abs(clock.now() - (await redisNow()))).toBeLessThan(100);
      // It moved by 90 s, but to within bounds: nothing more to say.
      expect(warnings).toHaveLength(1);
    } finally {
      clock.stop();
      vi.restoreAllMocks();
    }
  });

  it("on a host whose clock agrees, reads the same as the host and says nothing", async () => {
    const warnings: string[] = [];
    const clock = await startRedisClock(redis, { logger: { warn: (_o, msg) => warnings.push(msg) } });
    clock.stop();
    expect(Math.abs(clock.offsetMs())).toBeLessThan(100);
    expect(warnings).toEqual([]);
  });
});
