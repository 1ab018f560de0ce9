import type { RedisConnection } from "./connection.ts";
import { createKeys } from "./keys.ts";

/**
 * The fleet's clock: Redis's (`TIME`), read through this process's own clock and the offset
 * between the two, measured at start and again every `resyncMs`.
 *
 * Every process of a fleet compares times another process wrote: a rollout's deadline is the
 * dispatcher's acceptance time plus its budget, and the workers, the janitor's watchdog and the
 * verifier decide by it; a result's timings subtract one process's stamps from another's. Hosts'
 * clocks differ (NTP drift, a VM resumed from suspend): a janitor 90 s ahead masked a rollout
 * with a minute left and destroyed its sandbox under the agent. Against one clock, Redis's, they
 * agree to within a round trip, whatever each host's own says.
 */
export interface FleetClock {
  /** Now, on Redis's clock (epoch ms). */
  now(): number;
  /** Redis's clock minus this process's, as last measured (ms). */
  offsetMs(): number;
  /** Stop measuring again (the offset stays as it was). */
  stop(): void;
}

/** How often the offset is measured again (a host's clock stepped by NTP is followed within this). */
export const CLOCK_RESYNC_MS = 30_000;
/** An offset this large is said (once, and again whenever it moves by as much). */
export const CLOCK_WARN_MS = 2_000;
/** Samples per measure; the one with the shortest round trip is kept. */
const SAMPLES = 3;

/**
 * One measure: Redis's clock minus this process's, and the round trip it was read in. Read on
 * the node that holds `key`'s slot (in a Cluster each node has its host's clock: the fleet's is
 * the one its keys, and so its scripts, live on).
 */
async function sample(redis: RedisConnection, key: string): Promise<{ offsetMs: number; rttMs: number }> {
  const sent = Date.now();
  const [seconds, micros] = (await redis.eval("return redis.call('TIME')", 1, key)) as [
    string | number,
    string | number,
  ];
  const received = Date.now();
  const redisMs = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
  return { offsetMs: redisMs - (sent + received) / 2, rttMs: received - sent };
}

async function measure(redis: RedisConnection, key: string): Promise<number> {
  let best: { offsetMs: number; rttMs: number } | null = null;
  for (let i = 0; i < SAMPLES; i++) {
    const s = await sample(redis, key);
    if (best === null || s.rttMs < best.rttMs) best = s;
  }
  return Math.round(best!.offsetMs);
}

/**
 * Measure this process's offset from Redis's clock (call it once Redis is up: without an answer
 * the offset is 0 until a measure succeeds), and keep measuring every `resyncMs`; a measure that
 * fails keeps the last offset.
 */
export async function startRedisClock(
  redis: RedisConnection,
  options: {
    /** The fleet's key prefix: TIME is read on the node that holds its slot. @defaultValue `{fleet}` */
    prefix?: string;
    resyncMs?: number;
    logger?: { warn(obj: object, msg: string): void };
  } = {},
): Promise<FleetClock> {
  const key = createKeys(options.prefix).clock();
  // Redis gone again since the app saw it up: this host's clock until the next measure.
  let offset = await measure(redis, key).catch(() => 0);
  let said: number | null = null;
  const say = () => {
    if (Math.abs(offset) < CLOCK_WARN_MS) return;
    if (said !== null && Math.abs(offset - said) < CLOCK_WARN_MS) return;
    said = offset;
    options.logger?.warn(
      { offsetMs: offset },
      `this host's clock is ${Math.abs(offset / 1000).toFixed(1)} s ${offset > 0 ? "behind" : "ahead of"} Redis's: the fleet times deadlines and timings on Redis's clock (check NTP on this host)`,
    );
  };
  say();
  let measuring = false;
  const timer = setInterval(() => {
    if (measuring) return;
    measuring = true;
    measure(redis, key)
      .then((o) => {
        offset = o;
        say();
      })
      .catch(() => undefined) // Redis away: the last offset stands
      .finally(() => {
        measuring = false;
      });
  }, options.resyncMs ?? CLOCK_RESYNC_MS);
  timer.unref();
  return {
    now: () => Date.now() + offset,
    offsetMs: () => offset,
    stop: () => clearInterval(timer),
  };
}
