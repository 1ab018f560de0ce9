import { type Cluster, ReplyError } from "ioredis";
import { describe, expect, it } from "vitest";
import {
  connectRedis,
  createRedis,
  parseClusterUrl,
  parseSentinelUrl,
  reconnectOnReadOnly,
} from "./connection.ts";

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

describe("parseSentinelUrl", () => {
  it("takes the sentinels (26379 by default), the master's name, its database and credentials", () => {
    expect(parseSentinelUrl("redis-sentinel://s1,s2:26380/mymaster")).toEqual({
      sentinels: [
        { host: "s1", port: 26379 },
        { host: "s2", port: 26380 },
      ],
      name: "mymaster",
      redisOptions: {},
    });
    expect(parseSentinelUrl("redis-sentinel://u:p%40ss@[::1]:5000/m%20x/3/")).toEqual({
      sentinels: [{ host: "::1", port: 5000 }],
      name: "m x",
      redisOptions: { username: "u", password: "p@ss", db: 3 },
    });
  });

  it("takes a password's `?`, `/` and `@` as they are (the credentials end at the last @), as the cluster URL's parser always did", () => {
    expect(parseSentinelUrl("redis-sentinel://:p?a/s@s@s1/m").redisOptions).toEqual({ password: "p?a/s@s" });
    expect(parseClusterUrl("redis-cluster://:pa?ss@h:1").redisOptions).toEqual({ password: "pa?ss" });
  });

  it.each([
    ["redis-sentinel://u:s3cret@s1/m%zz", /names its master/],
    ["redis-sentinel://u:s3%zzcret@s1/m", /bad %-encoding in the credentials/],
    ["redis-sentinel://u:s3cret@s1:x/m", /bad Redis Sentinel "s1:x"/],
    ["redis-cluster://u:s3cret@a:1?x=1", /takes no database or query/],
  ])("refuses %s, showing no password", (url, why) => {
    const err = (() => {
      try {
        return url.startsWith("redis-cluster") ? parseClusterUrl(url) : parseSentinelUrl(url);
      } catch (e) {
        return e as Error;
      }
    })() as Error;
    expect(err.message).toMatch(why);
    expect(err.message).not.toContain("s3");
    expect(err.message).toContain("***@");
  });

  it.each(["redis-sentinel://s1:26379", "redis-sentinel://s1:26379/", "redis-sentinel://s1:26379/m/x"])(
    "refuses %s: no master named",
    (url) => {
      expect(() => parseSentinelUrl(url)).toThrow(/names its master/);
    },
  );

  it("takes the sentinels' own credentials from the query, %-decoded (a `+` stays a `+`)", () => {
    expect(
      parseSentinelUrl("redis-sentinel://u:p@s1/m/2?sentinelUsername=watch%20er&sentinelPassword=s%26p+x="),
    ).toEqual({
      sentinels: [{ host: "s1", port: 26379 }],
      name: "m",
      redisOptions: { username: "u", password: "p", db: 2 },
      sentinelUsername: "watch er",
      sentinelPassword: "s&p+x=",
    });
    expect(parseSentinelUrl("redis-sentinel://s1/m?sentinelPassword=").sentinelPassword).toBe("");
  });

  it.each([
    ["redis-sentinel://s1/m?db=1", /sets only sentinelUsername and sentinelPassword, each once \(got "db"\)/],
    ["redis-sentinel://s1/m?sentinelPassword=s3cret&sentinelPassword=s3", /each once/],
    ["redis-sentinel://s1/m?sentinelPassword=s3%zz", /bad %-encoding in the sentinelPassword/],
    ["redis-sentinel://s1:x/m?sentinelPassword=s3cret", /bad Redis Sentinel "s1:x"/],
  ])("refuses the query of %s, showing no password", (url, why) => {
    let err: Error | undefined;
    try {
      parseSentinelUrl(url);
    } catch (e) {
      err = e as Error;
    }
    expect(err?.message).toMatch(why);
    expect(err?.message).not.toContain("s3");
    expect(err?.message).toContain("/m?***");
  });

  it.each([
    "redis-sentinel://s1/m?sentinelPassword=p@ss3",
    "redis-sentinel://u:pw@s1/m?sentinelPassword=x@h2:1/m2s3",
    "redis-sentinel://s1/m?sentinelUsername=a@b&sentinelPassword=s3",
  ])(
    "refuses a raw @ in the query of %s (it would pass for the credentials' end), showing nothing past the scheme",
    (url) => {
      let err: Error | undefined;
      try {
        parseSentinelUrl(url);
      } catch (e) {
        err = e as Error;
      }
      expect(err?.message).toBe(
        'write a "@" in a Redis Sentinel URL\'s query as %40: "redis-sentinel://***"',
      );
      expect(parseSentinelUrl(url.replace(/@(?=[^@]*$)/, "%40")).sentinels).toHaveLength(1);
    },
  );

  it("createRedis connects through the sentinels, ready for BullMQ (no retry limit, READONLY reconnects)", () => {
    const redis = createRedis("redis-sentinel://127.0.0.1:1/m", { lazyConnect: true });
    expect(redis.options).toMatchObject({
      sentinels: [{ host: "127.0.0.1", port: 1 }],
      name: "m",
      failoverDetector: true,
      maxRetriesPerRequest: null,
      reconnectOnError: reconnectOnReadOnly,
    });
    expect(redis.duplicate().options).toMatchObject({ name: "m", failoverDetector: true });
    redis.disconnect();
    const authed = createRedis("redis-sentinel://127.0.0.1:1/m?sentinelPassword=sp", { lazyConnect: true });
    expect(authed.options).toMatchObject({ sentinelPassword: "sp" });
    expect(authed.options.password ?? null).toBeNull();
    authed.disconnect();
  });

  it("rediss-sentinel:// speaks TLS to the sentinels and to the master they name; redis-sentinel:// to neither", () => {
    expect(parseSentinelUrl("rediss-sentinel://u:p@s1/m/1?sentinelPassword=sp")).toEqual({
      sentinels: [{ host: "s1", port: 26379 }],
      name: "m",
      redisOptions: { username: "u", password: "p", db: 1, tls: {} },
      sentinelPassword: "sp",
      sentinelTLS: {},
      enableTLSForSentinelMode: true,
    });
    const plain = parseSentinelUrl("redis-sentinel://s1/m");
    expect(plain).not.toHaveProperty("sentinelTLS");
    expect(plain.redisOptions).not.toHaveProperty("tls");
    expect(() => parseSentinelUrl("rediss-sentinel://s1")).toThrow(
      /rediss-sentinel:\/\/host:26379\/mymaster/,
    );
    // A CA given: both sides check against it; a duplicate (a BullMQ worker's) keeps it.
    const redis = createRedis("rediss-sentinel://127.0.0.1:1/m", { lazyConnect: true }, { ca: "PEM" });
    expect(redis.options).toMatchObject({
      tls: { ca: "PEM" },
      sentinelTLS: { ca: "PEM" },
      enableTLSForSentinelMode: true,
    });
    expect(redis.duplicate().options).toMatchObject({ tls: { ca: "PEM" }, sentinelTLS: { ca: "PEM" } });
    redis.disconnect();
    // A client certificate goes to both sides too.
    const mtls = createRedis(
      "rediss-sentinel://127.0.0.1:1/m",
      { lazyConnect: true },
      { cert: "C", key: "K" },
    );
    expect(mtls.options).toMatchObject({
      tls: { cert: "C", key: "K" },
      sentinelTLS: { cert: "C", key: "K" },
    });
    mtls.disconnect();
    // Ignored for a URL without TLS.
    const noTls = createRedis("redis-sentinel://127.0.0.1:1/m", { lazyConnect: true }, { ca: "PEM" });
    expect(noTls.options.tls).toBeUndefined();
    expect(noTls.options.sentinelTLS).toBeUndefined();
    noTls.disconnect();
  });
});

describe("TLS to a standalone Redis or a cluster (a CA of FLEET_REDIS_TLS_CA_FILE)", () => {
  it("every kind of URL over TLS is given the caller's TLS object itself, and so are its duplicates and a cluster's nodes: an update to it in place (watchRedisTls) reaches them all", () => {
    const tls = { ca: "PEM" };
    const standalone = createRedis("rediss://127.0.0.1:1", { lazyConnect: true }, tls);
    const dup = standalone.duplicate();
    const sentinel = createRedis("rediss-sentinel://127.0.0.1:1/m", { lazyConnect: true }, tls);
    const cluster = connectRedis("rediss-cluster://127.0.0.1:1", { lazyConnect: true }, tls) as Cluster;
    const clusterDup = cluster.duplicate();
    try {
      expect(standalone.options.tls).toBe(tls);
      expect(dup.options.tls).toBe(tls);
      expect(sentinel.options.tls).toBe(tls);
      expect(sentinel.options.sentinelTLS).toBe(tls);
      expect(cluster.options.redisOptions?.tls).toBe(tls);
      expect(clusterDup.options.redisOptions?.tls).toBe(tls);
    } finally {
      for (const c of [standalone, dup, sentinel, cluster, clusterDup]) c.disconnect();
    }
  });

  it("rediss:// checks against the CA given, else Node's roots; redis:// never speaks TLS", async () => {
    const withCa = createRedis("rediss://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect(withCa.options.tls).toEqual({ ca: "PEM" });
    withCa.disconnect();
    const roots = createRedis("rediss://127.0.0.1:1", { lazyConnect: true });
    expect(roots.options.tls).toEqual({});
    roots.disconnect();
    // The scheme in capitals is TLS all the same (ioredis alone would speak plain TCP to it).
    const upper = createRedis("REDISS://127.0.0.1:1", { lazyConnect: true });
    expect(upper.options.tls).toEqual({});
    upper.disconnect();
    // A caller's own TLS options win.
    const own = createRedis(
      "rediss://127.0.0.1:1",
      { lazyConnect: true, tls: { servername: "r" } },
      { ca: "PEM" },
    );
    expect(own.options.tls).toEqual({ servername: "r" });
    own.disconnect();
    const plain = createRedis("redis://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect(plain.options.tls).toBeUndefined();
    plain.disconnect();
    const cluster = connectRedis("rediss-cluster://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect((cluster as Cluster).options.redisOptions?.tls).toEqual({ ca: "PEM" });
    // Seed nodes kept by name over TLS (the certificate names them), and so are a duplicate's.
    const lookup = (cluster as Cluster).options.dnsLookup;
    expect(lookup).toBeTypeOf("function");
    const looked = await new Promise((resolve) => lookup!("redis-0.example", (_err, a) => resolve(a)));
    expect(looked).toBe("redis-0.example");
    const dup = (cluster as Cluster).duplicate();
    expect(dup.options.redisOptions?.tls).toEqual({ ca: "PEM" });
    expect(dup.options.dnsLookup).toBe(lookup);
    dup.disconnect();
    cluster.disconnect();
    const plainCluster = connectRedis("redis-cluster://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect((plainCluster as Cluster).options.redisOptions?.tls).toBeUndefined();
    expect((plainCluster as Cluster).options.dnsLookup).not.toBe(lookup);
    plainCluster.disconnect();
  });
});
