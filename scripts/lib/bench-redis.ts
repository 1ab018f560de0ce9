/** Redis helpers shared by the benchmark scripts. */
import type { Redis } from "ioredis";

/** Delete every key matching `pattern` (SCAN, never KEYS); how many were deleted. */
export async function deleteKeys(redis: Pick<Redis, "scan" | "unlink">, pattern: string): Promise<number> {
  let cursor = "0";
  let deleted = 0;
  do {
    const [next, keys] = await redis.scan(cursor, "MATCH", pattern, "COUNT", 1000);
    cursor = next;
    if (keys.length > 0) deleted += await redis.unlink(...keys);
  } while (cursor !== "0");
  return deleted;
}
