import { randomUUID } from "node:crypto";
import { DockerSandboxProvider, LABEL_ROLLOUT } from "@fleet/sandbox";
import { Redis } from "ioredis";

export const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
export const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";

export function testPrefix(name: string): string {
  return `{e2e-${name}-${randomUUID().slice(0, 6)}}`;
}

/** Wait on a condition (never a fixed sleep). */
export async function waitFor<T>(
  what: string,
  probe: () => Promise<T | null | undefined | false>,
  timeoutMs = 120_000,
  everyMs = 200,
): Promise<T> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const v = await probe();
    if (v !== null && v !== undefined && v !== false) return v;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, everyMs));
  }
}

/** Delete every key under a prefix. */
export async function dropPrefix(redisUrl: string, prefix: string): Promise<void> {
  const redis = new Redis(redisUrl);
  let cursor = "0";
  do {
    const [next, keys] = await redis.scan(cursor, "MATCH", `${prefix}*`, "COUNT", 1000);
    cursor = next;
    if (keys.length > 0) await redis.del(...keys);
  } while (cursor !== "0");
  redis.disconnect();
}

/** Containers of the given rollouts still present. */
export async function containersOf(ids: readonly string[]): Promise<number> {
  const all = await new DockerSandboxProvider().list();
  return all.filter((s) => ids.includes(s.labels[LABEL_ROLLOUT] ?? "")).length;
}
