import { Redis, type RedisOptions } from "ioredis";

/** A connection suitable for BullMQ workers (blocking commands must not time out). */
export function createRedis(url: string, options: RedisOptions = {}): Redis {
  return new Redis(url, { maxRetriesPerRequest: null, enableReadyCheck: true, ...options });
}

export class RedisDurabilityError extends Error {
  override readonly name = "RedisDurabilityError";
}

/**
 * DESIGN §4: the fleet's state lives in Redis only, so Redis must persist every write (AOF) and
 * must never evict a key. Refuse to start otherwise, saying exactly what to change.
 */
export async function assertRedisDurable(redis: Redis): Promise<void> {
  const problems: string[] = [];
  let appendonly: string | undefined;
  let policy: string | undefined;
  try {
    appendonly = ((await redis.config("GET", "appendonly")) as string[])[1];
    policy = ((await redis.config("GET", "maxmemory-policy")) as string[])[1];
  } catch (err) {
    // Managed Redis often disables CONFIG; fall back to INFO persistence.
    const info = await redis.info("persistence");
    appendonly = /aof_enabled:1/.test(info) ? "yes" : "no";
    const mem = await redis.info("memory");
    policy = /maxmemory_policy:(\S+)/.exec(mem)?.[1];
    if (policy === undefined) throw new RedisDurabilityError(`cannot read Redis settings: ${String(err)}`);
  }
  if (appendonly !== "yes")
    problems.push(`appendonly is "${appendonly}" (need "yes": CONFIG SET appendonly yes)`);
  if (policy !== "noeviction") {
    problems.push(
      `maxmemory-policy is "${policy}" (need "noeviction": CONFIG SET maxmemory-policy noeviction)`,
    );
  }
  if (problems.length > 0) {
    throw new RedisDurabilityError(
      `Redis is not safe for the fleet's state: ${problems.join("; ")}. Refusing to start.`,
    );
  }
}
