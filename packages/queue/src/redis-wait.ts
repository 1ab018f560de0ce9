import { setTimeout as sleep } from "node:timers/promises";
import {
  assertRedisDurable,
  type DurabilityOptions,
  isRedisUnavailable,
  type RedisConnection,
  RedisDurabilityError,
} from "./connection.ts";
import { connectionCause, connectionErrorFields } from "./redis-tls.ts";

/** What `waitForRedis` logs with (a pino logger fits). */
export interface RedisWaitLogger extends DurabilityWatchLogger {
  warn(obj: object, msg: string): void;
}

export interface RedisWaitOptions extends DurabilityOptions {
  logger: RedisWaitLogger;
  /**
   * Told true once the start's check passed, then after every reconnect whether the Redis
   * reached passes it again (`watchRedisDurability`).
   */
  durable?: (ok: boolean) => void;
  /** While that check fails, how often it runs again. @defaultValue 60000 */
  recheckMs?: number;
  /** The first wait between attempts, doubled after each. @defaultValue 1000 */
  firstDelayMs?: number;
  /** The longest wait between attempts. @defaultValue 30000 */
  maxDelayMs?: number;
}

/**
 * An app's start against its Redis: wait, however long it takes, until `redis` is reachable and
 * passes `assertRedisDurable`, as a production operator expects of a service started beside (or
 * before) its Redis: a compose file, a Kubernetes Deployment, a Redis restarting. While it is not,
 * a warning names REDIS_URL, the connection's last error and how long it has waited, at most once
 * per wait (1 s, 2 s, 4 s … then every 30 s). A Redis that answers but refuses the fleet (AOF off,
 * an evicting `maxmemory-policy`, a database it does not have: `RedisDurabilityError`), one that
 * refuses REDIS_URL's credentials (`RedisCredentialsError`) and any other error end the wait at
 * once, thrown. Every app (dispatcher, workers, janitor) starts
 * through this, whatever its connection's `maxRetriesPerRequest`: no command is sent before the
 * connection is ready. Throws when the connection ends meanwhile: its retries given up, or
 * `disconnect` while it connects (ioredis ends no connection disconnected while it waits between
 * two attempts; the apps install their signal handlers after this, so a signal ends the wait).
 * A warning about a failed TLS handshake carries a `hint` of what to check (`tlsFailureHint`).
 */
export async function waitForRedis(redis: RedisConnection, options: RedisWaitOptions): Promise<void> {
  const { logger } = options;
  const started = Date.now();
  let lastError: { err: string; hint?: string } | null = null;
  let refused: Error | null = null;
  const noteError = (err: Error) => {
    lastError = connectionErrorFields(err);
    // A cluster wraps it (its slots could not be read): the node's refusal is the answer.
    const cause = connectionCause(err);
    if (isCredentialRefusal(cause)) refused = cause;
  };
  redis.on("error", noteError);
  let delayMs = options.firstDelayMs ?? 1_000;
  const maxDelayMs = options.maxDelayMs ?? 30_000;
  try {
    for (;;) {
      const ready = await readyWithin(redis, delayMs, () => refused !== null);
      // Redis answered, and refused the credentials: no wait makes them right.
      if (refused !== null) throw new RedisCredentialsError(refused);
      if (ready) {
        try {
          await assertRedisDurable(redis, options);
          const { durable } = options;
          if (durable) {
            durable(true);
            watchRedisDurability(redis, { ...options, durable });
          }
          return;
        } catch (err) {
          // Down again before the check was through, or busy (LOADING its data, a failover):
          // the check again after a wait. A refusal is not retried.
          if (!isRedisUnavailable(err)) throw err;
          lastError = connectionErrorFields(err as Error);
          await sleep(delayMs);
        }
      }
      logger.warn(
        { ...(lastError ?? { err: "no answer yet" }), waitedS: Math.round((Date.now() - started) / 1000) },
        "cannot reach Redis (REDIS_URL) yet; waiting for it, no request or job is served until it answers",
      );
      delayMs = Math.min(delayMs * 2, maxDelayMs);
    }
  } finally {
    redis.off("error", noteError);
  }
}

/**
 * A connection error that is Redis refusing the credentials REDIS_URL gives (a wrong password or
 * user, none where one is required, a user without the commands the fleet needs): an answer, not
 * an outage.
 */
function isCredentialRefusal(err: Error): boolean {
  return /^(?:WRONGPASS|NOAUTH|NOPERM)\b/.test(err.message);
}

/** Redis refused REDIS_URL's credentials while an app started: a configuration to fix, not a wait. */
export class RedisCredentialsError extends Error {
  override readonly name = "RedisCredentialsError";
  constructor(cause: Error) {
    super(`Redis refuses REDIS_URL's credentials (check its user and password): ${cause.message}`, { cause });
  }
}

/**
 * Whether `redis` is ready now or becomes ready within `ms` (false at once on an error after which
 * `stop()` holds); throws once its connection ended.
 */
async function readyWithin(redis: RedisConnection, ms: number, stop: () => boolean): Promise<boolean> {
  if (redis.status === "ready") return true;
  if (redis.status === "end") throw new Error("the Redis connection was closed before Redis was reached");
  if (stop()) return false;
  return new Promise<boolean>((resolve, reject) => {
    const done = (ready: boolean, err?: Error) => {
      clearTimeout(timer);
      redis.off("ready", onReady);
      redis.off("end", onEnd);
      redis.off("error", onError);
      if (err) reject(err);
      else resolve(ready);
    };
    const onReady = () => done(true);
    const onEnd = () => done(false, new Error("the Redis connection was closed before Redis was reached"));
    // After the wait's own listener (registered first) has noted it.
    const onError = () => {
      if (stop()) done(false);
    };
    const timer = setTimeout(() => done(false), ms);
    redis.once("ready", onReady);
    redis.once("end", onEnd);
    redis.on("error", onError);
  });
}

/** What `watchRedisDurability` logs with (a pino logger fits). */
export interface DurabilityWatchLogger {
  error(obj: object, msg: string): void;
  info(obj: object, msg: string): void;
}

/**
 * After the start, each time `redis` is ready again (a reconnect: to the same Redis, or after a
 * failover to the replica promoted in its place), check again what `waitForRedis` checked at the
 * start: a promoted replica often runs without AOF, or with an evicting `maxmemory-policy`, and
 * the fleet's state would then be lost or evicted silently. The app runs on (refusing at this
 * point would stop the whole fleet at once): an error line says what to change, and `durable`
 * (an app's `fleet_redis_durable` gauge; alert `FleetRedisNotDurable`) is told false; true when a
 * check passes. While it fails, it is checked again every `recheckMs` (default a minute), so the
 * fix is seen without a restart. A check Redis could not answer (gone again) waits for the next
 * ready. Returns a function that stops watching.
 */
export function watchRedisDurability(
  redis: RedisConnection,
  options: DurabilityOptions & {
    logger: DurabilityWatchLogger;
    durable: (ok: boolean) => void;
    recheckMs?: number;
  },
): () => void {
  let checking: Promise<void> = Promise.resolve();
  let failing = false;
  let recheck: NodeJS.Timeout | undefined;
  const check = () => {
    // One check at a time, in the order of the readies.
    checking = checking.then(async () => {
      try {
        await assertRedisDurable(redis, options);
      } catch (err) {
        if (!(err instanceof RedisDurabilityError)) return; // not answered: the next ready checks
        options.durable(false);
        if (!failing) {
          options.logger.error(
            { err: err.message },
            "the Redis the fleet reconnected to is not safe for its state (a replica promoted in a failover?); the fleet runs on, at risk",
          );
        }
        failing = true;
        recheck ??= setInterval(check, options.recheckMs ?? 60_000).unref();
        return;
      }
      options.durable(true);
      if (failing) options.logger.info({}, "the fleet's Redis is safe for its state again");
      failing = false;
      clearInterval(recheck);
      recheck = undefined;
    });
  };
  redis.on("ready", check);
  return () => {
    redis.off("ready", check);
    clearInterval(recheck);
  };
}
