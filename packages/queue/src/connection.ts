import type { ConnectionOptions } from "node:tls";
import { REDIS_HOST_PORT } from "@fleet/contracts";
import { Cluster, type ClusterNode, Redis, type RedisOptions } from "ioredis";
import { connectionErrorFields, type RedisTls } from "./redis-tls.ts";

/**
 * One connection to the fleet's Redis: a standalone server (`redis://`, `rediss://`) or a Redis
 * Cluster (`redis-cluster://`, `rediss-cluster://`). Every key the fleet owns shares one
 * hash-tagged prefix (see `createKeys`), so on a cluster all of them, BullMQ's included, live in
 * one slot and every multi-key script and pipeline stays legal.
 */
export type RedisConnection = Redis | Cluster;

const CLUSTER_SCHEMES = ["redis-cluster:", "rediss-cluster:"] as const;

/** True for `redis-cluster://…` and `rediss-cluster://…` URLs. */
export function isClusterUrl(url: string): boolean {
  return CLUSTER_SCHEMES.some((s) => url.toLowerCase().startsWith(`${s}//`));
}

/**
 * Parse `redis-cluster://[user:password@]host1:port1,host2:port2[/]` into the startup nodes and
 * the per-node options it implies (credentials, TLS for `rediss-cluster://`).
 */
export function parseClusterUrl(url: string): { nodes: ClusterNode[]; redisOptions: RedisOptions } {
  const scheme = CLUSTER_SCHEMES.find((s) => url.toLowerCase().startsWith(`${s}//`));
  if (!scheme) throw new Error(`not a Redis Cluster URL: ${JSON.stringify(url)}`);
  const { hosts, path, query, redisOptions, shown } = splitMultiHostUrl(
    url,
    scheme,
    "Redis Cluster node",
    6379,
  );
  if (path !== "" || query) {
    throw new Error(`Redis Cluster URL takes no database or query: ${JSON.stringify(shown)}`);
  }
  if (scheme === "rediss-cluster:") redisOptions.tls = {};
  return { nodes: hosts, redisOptions };
}

const SENTINEL_SCHEMES = ["redis-sentinel:", "rediss-sentinel:"] as const;

/** True for `redis-sentinel://…` and `rediss-sentinel://…` URLs. */
export function isSentinelUrl(url: string): boolean {
  return SENTINEL_SCHEMES.some((s) => url.toLowerCase().startsWith(`${s}//`));
}

/** What a Redis Sentinel URL's query may set: the sentinels' own credentials (ioredis's options). */
const SENTINEL_QUERY = ["sentinelUsername", "sentinelPassword"] as const;

/**
 * Parse `redis-sentinel://[user:password@]host1:port1,host2:port2/masterName[/db]` (a sentinel's
 * port defaults to 26379), optionally followed by `?sentinelUsername=…&sentinelPassword=…` (the
 * sentinels' own credentials, %-encoded; a `+` is a `+`), into ioredis's sentinel options: the
 * sentinels to ask and their credentials, the master's name, and the options for the master's
 * connection (its credentials, its database). `rediss-sentinel://` speaks TLS to the sentinels
 * and to the master they name. Errors show the credentials and query as `***`.
 */
export function parseSentinelUrl(url: string): {
  sentinels: { host: string; port: number }[];
  name: string;
  redisOptions: RedisOptions;
  sentinelUsername?: string;
  sentinelPassword?: string;
  /** TLS to the sentinels (`rediss-sentinel://`). */
  sentinelTLS?: ConnectionOptions;
  /** TLS to the master they name, with `redisOptions.tls` (`rediss-sentinel://`). */
  enableTLSForSentinelMode?: boolean;
} {
  const scheme = SENTINEL_SCHEMES.find((s) => url.toLowerCase().startsWith(`${s}//`));
  if (!scheme) throw new Error(`not a Redis Sentinel URL: ${JSON.stringify(url)}`);
  const { hosts, path, query, search, redisOptions, shown } = splitMultiHostUrl(
    url,
    scheme,
    "Redis Sentinel",
    26379,
  );
  const m = /^\/([^/]+)(?:\/(\d+))?\/?$/.exec(path);
  let name: string | undefined;
  try {
    name = m ? decodeURIComponent(m[1]!) : undefined;
  } catch {
    name = undefined;
  }
  if (!m || name === undefined) {
    throw new Error(
      `a Redis Sentinel URL names its master: ${scheme}//host:26379/mymaster[/db][?sentinelPassword=…], got ${JSON.stringify(shown)}`,
    );
  }
  if (m[2] !== undefined) redisOptions.db = Number(m[2]);
  const auth: { sentinelUsername?: string; sentinelPassword?: string } = {};
  if (query) {
    for (const pair of search.split("&")) {
      const eq = pair.indexOf("=");
      const key = eq >= 0 ? pair.slice(0, eq) : pair;
      const known = SENTINEL_QUERY.find((k) => k === key);
      if (known === undefined || auth[known] !== undefined) {
        throw new Error(
          `a Redis Sentinel URL's query sets only ${SENTINEL_QUERY.join(" and ")}, each once (got ${JSON.stringify(key.slice(0, 40))}), in ${JSON.stringify(shown)}`,
        );
      }
      try {
        auth[known] = decodeURIComponent(eq >= 0 ? pair.slice(eq + 1) : "");
      } catch {
        throw new Error(`bad %-encoding in the ${known} of ${JSON.stringify(shown)}`);
      }
    }
  }
  if (scheme === "rediss-sentinel:") {
    redisOptions.tls = {};
    return { sentinels: hosts, name, redisOptions, ...auth, sentinelTLS: {}, enableTLSForSentinelMode: true };
  }
  return { sentinels: hosts, name, redisOptions, ...auth };
}

/**
 * `scheme//[user:password@]host:port,host:port[/path][?query]`: its hosts (ports defaulting to
 * `defaultPort`), its path ('' for none), whether it has a query, the credentials as ioredis
 * options, and the URL as errors show it (`shown`: credentials as `***`). The credentials end at
 * the last `@` (a password may hold `/`, `?` or `@` unencoded).
 */
function splitMultiHostUrl(
  url: string,
  scheme: string,
  what: string,
  defaultPort: number,
): {
  hosts: { host: string; port: number }[];
  path: string;
  query: boolean;
  /** The query, after `?` ('' for none). */
  search: string;
  redisOptions: RedisOptions;
  shown: string;
} {
  let rest = url.slice(scheme.length + 2);
  const redisOptions: RedisOptions = {};
  const at = rest.lastIndexOf("@");
  // A raw `@` in a Sentinel URL's query (its password's) would pass for the end of the
  // credentials: refused, showing nothing of the URL past its scheme.
  if (at >= 0 && /[?&]sentinel(?:Username|Password)=/i.test(rest.slice(0, at))) {
    throw new Error(`write a "@" in a ${what} URL's query as %40: ${JSON.stringify(`${scheme}//***`)}`);
  }
  // Credentials and the query (which may hold the sentinels' password) as `***`.
  const afterAt = at >= 0 ? rest.slice(at + 1) : rest;
  const qAt = afterAt.indexOf("?");
  const shown = `${scheme}//${at >= 0 ? "***@" : ""}${qAt >= 0 ? `${afterAt.slice(0, qAt)}?***` : afterAt}`;
  if (at >= 0) {
    const auth = rest.slice(0, at);
    rest = rest.slice(at + 1);
    const colon = auth.indexOf(":");
    let user: string;
    let password: string;
    try {
      user = decodeURIComponent(colon >= 0 ? auth.slice(0, colon) : "");
      password = decodeURIComponent(colon >= 0 ? auth.slice(colon + 1) : auth);
    } catch {
      throw new Error(`bad %-encoding in the credentials of ${JSON.stringify(shown)}`);
    }
    if (user) redisOptions.username = user;
    if (password) redisOptions.password = password;
  }
  const q = rest.indexOf("?");
  const query = q >= 0;
  const search = query ? rest.slice(q + 1) : "";
  if (query) rest = rest.slice(0, q);
  const end = rest.indexOf("/");
  const path = end >= 0 ? rest.slice(end).replace(/^\/+$/, "") : "";
  const hosts = (end >= 0 ? rest.slice(0, end) : rest).split(",").map((hostPort) => {
    const m = REDIS_HOST_PORT.exec(hostPort.trim());
    if (!m) throw new Error(`bad ${what} ${JSON.stringify(hostPort)} in ${JSON.stringify(shown)}`);
    return { host: m[1]!.replace(/^\[|\]$/g, ""), port: m[2] ? Number(m[2]) : defaultPort };
  });
  return { hosts, path, query, search, redisOptions, shown };
}

/**
 * The URL's TLS options, or none for plain TCP: `tls` itself, not a copy. ioredis reads them at
 * every connect, and a connection's duplicates (BullMQ's, a cluster's nodes) share them, so
 * `watchRedisTls`'s updates to it reach every connection made from it at its next connect.
 */
function tlsOf(enabled: boolean, tls: RedisTls): ConnectionOptions | undefined {
  return enabled ? tls : undefined;
}

/**
 * A connection suitable for BullMQ workers (blocking commands must not time out), to a
 * standalone Redis (`redis://`, `rediss://`), or to the master a Redis Sentinel names
 * (`redis-sentinel://host:26379,host:26379/mymaster`; `rediss-sentinel://` over TLS). Use
 * `connectRedis` where a Redis Cluster URL must also be accepted.
 */
export function createRedis(url: string, options: RedisOptions = {}, tls: RedisTls = {}): Redis {
  if (isClusterUrl(url)) {
    throw new Error("createRedis connects to a standalone Redis; a Redis Cluster URL needs connectRedis");
  }
  const defaults: RedisOptions = {
    maxRetriesPerRequest: null,
    enableReadyCheck: true,
    reconnectOnError: reconnectOnReadOnly,
  };
  if (isSentinelUrl(url)) {
    // The master the sentinels name: asked again at every connection, and at once when they
    // announce a failover (`failoverDetector`), besides at a READONLY.
    const { sentinels, name, redisOptions, ...sentinelAuth } = parseSentinelUrl(url);
    const withTls = sentinelAuth.enableTLSForSentinelMode === true;
    return coalesceWrites(
      new Redis({
        ...defaults,
        sentinels,
        name,
        failoverDetector: true,
        ...sentinelAuth,
        ...redisOptions,
        ...(withTls ? { tls: tlsOf(true, tls), sentinelTLS: tlsOf(true, tls) } : {}),
        ...options,
      }),
    );
  }
  // Set here, not left to ioredis: it turns TLS on only for a lower-case `rediss://`.
  const standaloneTls = tlsOf(url.toLowerCase().startsWith("rediss://"), tls);
  return coalesceWrites(
    new Redis(url, { ...defaults, ...(standaloneTls ? { tls: standaloneTls } : {}), ...options }),
  );
}

/**
 * ioredis's `reconnectOnError` for the fleet's standalone connections: a `READONLY` reply means
 * the connection reached a replica. After a failover that is the old master, which the
 * connection's TCP stream still goes to while the name in the URL (DNS, a managed Redis's
 * endpoint, a proxy) now leads to the new one; nothing else would ever make it look again, so
 * every write of the process would be refused for good. So the connection is made again (1), and
 * the refused command fails as any refusal does (held or retried by its caller), not resent: a
 * Redis that stays read-only costs one reconnect per refusal, never a command waiting forever.
 * Safe to reconnect with commands in flight: a replica ran none of their writes, so ioredis
 * sending them again after the reconnect runs each once. (A Cluster needs none of this: its
 * demoted master answers MOVED, which ioredis follows.)
 */
export function reconnectOnReadOnly(err: Error): 1 | false {
  return err.message.startsWith("READONLY ") ? 1 : false;
}

/**
 * A refusal that came back inside a script's reply (a batched item's error caught by the script's
 * per-item `pcall`: `slotError`), not as the reply itself, so ioredis's `reconnectOnError` never
 * saw it: give it to it now. A connection whose writes all go through batched scripts (the
 * dispatcher's admissions) would otherwise stay on a demoted master for good.
 */
export function reconnectOnSlotError(redis: RedisConnection, err: Error): void {
  if (!(redis instanceof Redis) || redis.status !== "ready") return;
  if (redis.options.reconnectOnError?.(err)) redis.disconnect(true);
}

const coalescing = new WeakSet<Redis>();

/**
 * Every command written to the connection during one tick leaves in one socket write: the socket
 * is corked at the tick's first command and uncorked when the tick's work is done
 * (`process.nextTick`). Same commands, same order, one syscall instead of one per command; unlike
 * ioredis' auto-pipelining there is no extra object per batch and no wait for a later tick.
 * Standalone connections only (a Cluster's node connections are left as they are).
 */
export function coalesceWrites<R extends RedisConnection>(redis: R): R {
  if (!(redis instanceof Redis) || coalescing.has(redis)) return redis;
  coalescing.add(redis);
  const corked = new WeakSet<object>();
  const send = redis.sendCommand;
  redis.sendCommand = function (this: Redis, ...args: Parameters<Redis["sendCommand"]>) {
    const socket = this.stream;
    if (socket && !corked.has(socket) && !socket.destroyed) {
      corked.add(socket);
      socket.cork();
      process.nextTick(() => {
        corked.delete(socket);
        socket.uncork();
      });
    }
    return send.apply(this, args);
  } as Redis["sendCommand"];
  return redis;
}

/**
 * Once `redis` has been ready, a command sent while it is down fails at once ("Stream isn't
 * writeable…" / "Cluster isn't ready…") instead of waiting in ioredis' offline queue through
 * reconnect attempts, seconds each and longer as they back off: BullMQ's "failing fast when Redis
 * is down" for producers. Before the first ready, commands still wait, so a process started
 * before its Redis carries on when Redis comes up. For connections that serve requests and run no
 * blocking commands (the dispatcher's); a worker's waits are meant to ride an outage out.
 */
export function failFastOnceReady(redis: RedisConnection): void {
  const failFast = () => {
    redis.options.enableOfflineQueue = false;
  };
  if (redis.status === "ready") failFast();
  else redis.once("ready", failFast);
}

/** What `logConnectionOutages` logs with (a pino logger fits). */
export interface OutageLogger {
  warn(obj: object, msg: string): void;
  info(msg: string): void;
}

/**
 * Log a Redis outage once when it starts ("redis connection lost; reconnecting", with the first
 * error) and once when the connection is ready again, not once per reconnect attempt: ioredis
 * retries every few hundred milliseconds, and every Queue on the connection re-emits each error
 * (listen to those with a no-op). Also keeps an unheard 'error' event from crashing the process.
 */
export function logConnectionOutages(redis: RedisConnection, logger: OutageLogger): void {
  let down = false;
  // Before the first connection, nothing was lost: a wrong REDIS_URL, or Redis not up yet.
  let connected = false;
  redis.on("error", (err: Error) => {
    if (!down) {
      const fields = connectionErrorFields(err);
      if (connected) logger.warn(fields, "redis connection lost; reconnecting");
      else logger.warn(fields, "redis not reachable yet (check REDIS_URL); still trying");
    }
    down = true;
  });
  redis.on("ready", () => {
    if (down) logger.info(connected ? "redis connection ready again" : "redis reachable now");
    down = false;
    connected = true;
  });
}

/**
 * Like `createRedis`, for any URL the fleet accepts: a `Redis` for `redis://` / `rediss://`, a
 * `Cluster` for `redis-cluster://host:port,host:port` (or `rediss-cluster://`, TLS to every node).
 * `options` apply to every node's connection.
 */
export function connectRedis(url: string, options: RedisOptions = {}, tls: RedisTls = {}): RedisConnection {
  if (!isClusterUrl(url)) return createRedis(url, options, tls);
  const { nodes, redisOptions } = parseClusterUrl(url);
  const nodeTls = tlsOf(redisOptions.tls !== undefined, tls);
  return new Cluster(nodes, {
    enableReadyCheck: true,
    // Over TLS, the seed nodes are connected to by the names the URL gives, not by the addresses
    // they resolve to: the server's certificate is checked against that name.
    ...(nodeTls ? { dnsLookup: keepHostname } : {}),
    redisOptions: {
      maxRetriesPerRequest: null,
      enableReadyCheck: true,
      ...redisOptions,
      ...(nodeTls ? { tls: nodeTls } : {}),
      ...options,
    },
  });
}

/** ioredis's `dnsLookup` that resolves nothing: a host stays the name it was given. */
function keepHostname(address: string, callback: (err: Error | null, address: string) => void): void {
  callback(null, address);
}

/** A new connection with the same settings (BullMQ workers need one of their own each). */
export function duplicateRedis(redis: RedisConnection): RedisConnection {
  // Narrowed per branch: the union's two `duplicate` signatures are not callable as one.
  return redis instanceof Cluster ? redis.duplicate() : coalesceWrites(redis.duplicate());
}

export class RedisDurabilityError extends Error {
  override readonly name = "RedisDurabilityError";
}

/**
 * DESIGN §4: the fleet's state lives in Redis only, so Redis must persist every write (AOF) and
 * must never evict a key. Refuse to start otherwise, saying exactly what to change. On a cluster
 * every master is checked (a slot may move to any of them).
 */
export interface DurabilityOptions {
  /**
   * Accept `appendfsync everysec`/`no` (`FLEET_REDIS_ACCEPT_WRITE_LOSS`): a crash of Redis's host
   * then loses up to about two seconds of acknowledged writes.
   */
  acceptWriteLoss?: boolean;
}

export async function assertRedisDurable(
  redis: RedisConnection,
  options: DurabilityOptions = {},
): Promise<void> {
  if (redis instanceof Cluster) {
    await clusterReady(redis);
    const masters = redis.nodes("master");
    if (masters.length === 0) throw new RedisDurabilityError("Redis Cluster has no master nodes");
    const problems: string[] = [];
    for (const node of masters) {
      try {
        await assertNodeDurable(node, options);
      } catch (err) {
        if (!(err instanceof RedisDurabilityError)) throw err;
        problems.push(`${node.options.host}:${node.options.port}: ${err.message}`);
      }
    }
    if (problems.length > 0) throw new RedisDurabilityError(problems.join(" | "));
    return;
  }
  await assertNodeDurable(redis, options);
}

/** Resolves once the cluster's slots are known (its `nodes()` are filled in). */
async function clusterReady(cluster: Cluster): Promise<void> {
  if (cluster.status === "ready") return;
  await new Promise<void>((resolve, reject) => {
    const done = (err?: Error) => {
      cluster.off("ready", onReady);
      cluster.off("end", onEnd);
      if (err) reject(err);
      else resolve();
    };
    const onReady = () => done();
    const onEnd = () => done(new Error("Redis Cluster connection ended before it was ready"));
    cluster.once("ready", onReady);
    cluster.once("end", onEnd);
  });
}

async function assertNodeDurable(redis: Redis, options: DurabilityOptions): Promise<void> {
  // A database the server does not have (REDIS_URL `.../99`): ioredis' SELECT on connect fails
  // only as an 'error' event, and every command then runs in database 0.
  const db = Number(redis.options.db ?? 0);
  if (db !== 0) {
    try {
      await redis.select(db);
    } catch (err) {
      if ((err as Error).name !== "ReplyError") throw err;
      throw new RedisDurabilityError(
        `REDIS_URL names database ${db}, which this Redis refuses: ${(err as Error).message}. Refusing to start.`,
      );
    }
  }
  const problems: string[] = [];
  let appendonly: string | undefined;
  let policy: string | undefined;
  // Unknown where CONFIG is disabled (INFO does not say): not refused on a guess.
  let fsync: string | undefined;
  try {
    appendonly = ((await redis.config("GET", "appendonly")) as string[])[1];
    policy = ((await redis.config("GET", "maxmemory-policy")) as string[])[1];
    fsync = ((await redis.config("GET", "appendfsync")) as string[])[1];
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
  // An acknowledged write must survive a crash of Redis's host: with `everysec` (Redis's default)
  // a host crash loses the last second or two of them, and the fleet's Docker side effects
  // (sandboxes made, destroyed, tests run) do not roll back with it.
  if (appendonly === "yes" && fsync !== undefined && fsync !== "always" && !options.acceptWriteLoss) {
    problems.push(
      `appendfsync is "${fsync}": a crash of Redis's host loses the last second or two of acknowledged writes (need "always": CONFIG SET appendfsync always; or set FLEET_REDIS_ACCEPT_WRITE_LOSS=true to accept that)`,
    );
  }
  if (problems.length > 0) {
    throw new RedisDurabilityError(
      `Redis is not safe for the fleet's state: ${problems.join("; ")}. Refusing to start.`,
    );
  }
}

/**
 * Redis replies that say it cannot serve now, not that the request is wrong: full under
 * `noeviction` (OOM), a replica after a failover (READONLY), still loading its data, a cluster
 * without a quorum or mid-resharding, a script past its time limit.
 */
const REDIS_BUSY_REPLY = /^(OOM|READONLY|LOADING|MASTERDOWN|CLUSTERDOWN|TRYAGAIN|BUSY|NOREPLICAS) /;

/**
 * ioredis gave up on a command because the connection is down (see `createRedis`'s options), or Redis answered that it cannot serve now (`REDIS_BUSY_REPLY`): the caller should try again later (the dispatcher answers 503).
 */
export function isRedisUnavailable(err: unknown): boolean {
  if (typeof err !== "object" || err === null) return false;
  const { name, message, previousErrors } = err as {
    name?: unknown;
    message?: unknown;
    previousErrors?: unknown;
  };
  // A MULTI whose queued writes Redis refused (full, read-only) ends in EXECABORT; ioredis keeps
  // the refusals in `previousErrors`.
  if (name === "ReplyError" && typeof message === "string" && message.startsWith("EXECABORT")) {
    return Array.isArray(previousErrors) && previousErrors.some((e) => isRedisUnavailable(e));
  }
  return (
    name === "MaxRetriesPerRequestError" ||
    name === "ClusterAllFailedError" ||
    (name === "ReplyError" && typeof message === "string" && REDIS_BUSY_REPLY.test(message)) ||
    // ioredis's own words exactly, not a message that quotes them (a model upstream's body).
    (typeof message === "string" &&
      (message === "Connection is closed." ||
        // Refused at once while down (`failFastOnceReady`): a standalone Redis's words, a cluster's.
        message.endsWith("enableOfflineQueue options is false")))
  );
}
