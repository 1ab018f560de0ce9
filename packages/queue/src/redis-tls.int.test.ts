import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Queue, Worker } from "bullmq";
import type { Cluster, Redis } from "ioredis";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import {
  assertRedisDurable,
  connectRedis,
  createRedis,
  duplicateRedis,
  logConnectionOutages,
  type RedisConnection,
} from "./connection.ts";
import { freeLoopbackPort, LocalRedisServer } from "./local-redis.ts";
import { readRedisTls, watchRedisTls } from "./redis-tls.ts";
import { waitForRedis } from "./redis-wait.ts";
import {
  FailoverPair,
  fleetTlsFiles,
  LocalSentinel,
  type LoopbackRedisCluster,
  makeTestCertificates,
  replaceFile,
  startLoopbackRedisCluster,
  type TestCertificates,
  tlsServerArgs,
} from "./testing/index.ts";

/** The server port a connection reached (`CLIENT INFO`'s laddr): its TLS one, or its plain one. */
async function serverPort(redis: RedisConnection): Promise<number> {
  const info = String(await (redis as Redis).call("CLIENT", "INFO"));
  return Number(/laddr=[^ ]*:(\d+)/.exec(info)?.[1]);
}

/** One job through BullMQ on `redis` (a queue on it, a worker on a duplicate): what it returned. */
async function oneJob(redis: RedisConnection, prefix: string): Promise<unknown> {
  const queue = new Queue("tls", { connection: redis, prefix });
  const own = duplicateRedis(redis);
  own.on("error", () => undefined);
  const worker = new Worker("tls", async (job) => (job.data as { n: number }).n * 2, {
    connection: own,
    prefix,
  });
  try {
    const done = new Promise((resolve, reject) => {
      worker.once("completed", (_job, value) => resolve(value));
      worker.once("failed", (_job, err) => reject(err));
    });
    await queue.add("double", { n: 21 });
    return await done;
  } finally {
    await worker.close();
    own.disconnect();
    await queue.obliterate({ force: true });
    await queue.close();
  }
}

// A Redis of the test's own serving TLS (beside its plain port, which only the harness uses) with
// a certificate a CA of the test's own signed: what FLEET_REDIS_TLS_CA_FILE is for.
describe("Redis over TLS, checked against FLEET_REDIS_TLS_CA_FILE's CA", () => {
  let dir = "";
  let certs: TestCertificates;
  let server: LocalRedisServer | null = null;
  let sentinel: LocalSentinel | null = null;
  const conns: RedisConnection[] = [];
  let tlsPort = 0;
  beforeEach(async () => {
    dir = mkdtempSync(join(tmpdir(), "fleet-tls-"));
    certs = makeTestCertificates(dir);
    tlsPort = await freeLoopbackPort();
    server = await LocalRedisServer.start({ dir, args: tlsServerArgs(certs, tlsPort) });
  });
  afterEach(async () => {
    for (const c of conns.splice(0)) c.disconnect();
    await sentinel?.stop();
    await server?.kill();
    [sentinel, server] = [null, null];
    rmSync(dir, { recursive: true, force: true });
  });
  const keep = <T extends RedisConnection>(c: T): T => {
    conns.push(c);
    c.on("error", () => undefined);
    return c;
  };

  it("rediss://: refused on Node's public roots; with the CA, it passes the durability check and BullMQ runs a job over it", async () => {
    const url = `rediss://127.0.0.1:${tlsPort}`;
    const untrusted = keep(
      createRedis(url, { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null }),
    );
    const said: string[] = [];
    untrusted.on("error", (err: Error) => said.push(err.message));
    await expect(untrusted.connect()).rejects.toThrow();
    expect(said.join("\n")).toMatch(/self.signed|unable to (get|verify)|certificate/i);
    const redis = keep(connectRedis(url, {}, readRedisTls(fleetTlsFiles(certs))));
    await assertRedisDurable(redis);
    expect(await serverPort(redis)).toBe(tlsPort);
    expect(await oneJob(redis, "{tls-test}")).toBe(42);
  });

  it("rediss:// to a Redis that asks every client for a certificate (tls-auth-clients yes, Redis's default): refused without one; with FLEET_REDIS_TLS_CERT_FILE/KEY_FILE's it works", async () => {
    await server?.kill();
    tlsPort = await freeLoopbackPort();
    server = await LocalRedisServer.start({
      dir,
      args: tlsServerArgs(certs, tlsPort, { authClients: true }),
    });
    const url = `rediss://127.0.0.1:${tlsPort}`;
    const anonymous = keep(
      createRedis(
        url,
        { lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null },
        readRedisTls(fleetTlsFiles(certs)),
      ),
    );
    await expect(
      (async () => {
        await anonymous.connect();
        await anonymous.ping();
      })(),
    ).rejects.toThrow();
    // An app started so says what to check, in its outage line and while it waits.
    const warned: { obj: object; msg: string }[] = [];
    const logger = {
      warn: (obj: object, msg: string) => warned.push({ obj, msg }),
      info: () => undefined,
      error: () => undefined,
    };
    // Its retries given up after a while: the wait then ends (ioredis ends no connection
    // disconnected between two attempts).
    const app = keep(
      createRedis(
        url,
        { retryStrategy: (times) => (times < 100 ? 20 : null) },
        readRedisTls(fleetTlsFiles(certs)),
      ),
    );
    logConnectionOutages(app, logger);
    const waited = waitForRedis(app, { logger, firstDelayMs: 20 }).catch((err: unknown) => err);
    await vi.waitFor(() => expect(warned.length).toBeGreaterThanOrEqual(2), { timeout: 10_000 });
    const hint = expect.stringMatching(/^the TLS handshake with Redis failed: .*FLEET_REDIS_TLS_CERT_FILE/);
    expect(warned[0]).toEqual({
      obj: { err: expect.stringMatching(/certificate required/), hint },
      msg: "redis not reachable yet (check REDIS_URL); still trying",
    });
    expect(warned[1]).toMatchObject({ obj: { hint }, msg: expect.stringMatching(/^cannot reach Redis/) });
    expect(await waited).toEqual(new Error("the Redis connection was closed before Redis was reached"));
    const redis = keep(connectRedis(url, {}, readRedisTls(fleetTlsFiles(certs, { client: true }))));
    await assertRedisDurable(redis);
    expect(await serverPort(redis)).toBe(tlsPort);
    expect(await oneJob(redis, "{tls-mtls-test}")).toBe(42);
  });

  it("rediss-sentinel://: TLS to the sentinel and to the master it names; the durability check, writes and a BullMQ job go through", async () => {
    // The sentinel watches the master at its TLS port, and hands that out.
    sentinel = await LocalSentinel.start(dir, tlsPort, "fleetmaster", { tls: certs });
    expect(sentinel.url).toBe(`rediss-sentinel://127.0.0.1:${sentinel.tlsPort}/fleetmaster`);
    const redis = keep(createRedis(sentinel.url, {}, readRedisTls(fleetTlsFiles(certs))));
    await assertRedisDurable(redis);
    expect(await serverPort(redis)).toBe(tlsPort);
    await redis.set("k", "over TLS");
    const admin = keep(createRedis(server!.url));
    expect(await admin.get("k")).toBe("over TLS");
    expect(await oneJob(redis, "{tls-sentinel-test}")).toBe(42);
    // The same URL without TLS (redis-sentinel://, to the sentinel's TLS port) gets nowhere.
    const plain = keep(
      createRedis(sentinel.url.replace("rediss-sentinel:", "redis-sentinel:"), {
        lazyConnect: true,
        maxRetriesPerRequest: 0,
        retryStrategy: () => null,
        sentinelRetryStrategy: () => null,
        connectTimeout: 2_000,
      }),
    );
    await expect(plain.connect()).rejects.toThrow();
  });

  it("rediss-sentinel:// through a failover: the connection, over TLS to the first master, moves to the promoted replica's TLS port and its writes land there", async () => {
    const pair = await FailoverPair.start({ tls: certs });
    try {
      const tlsPorts = pair.tlsPorts!;
      sentinel = await LocalSentinel.start(dir, tlsPorts.a, "fleetmaster", { tls: certs });
      const redis = keep(createRedis(sentinel.url, {}, readRedisTls(fleetTlsFiles(certs))));
      await assertRedisDurable(redis);
      expect(await serverPort(redis)).toBe(tlsPorts.a);
      await redis.set("k", "before");
      expect(await pair.adminA.get("k")).toBe("before");

      expect(await sentinel.failOver()).toBe(tlsPorts.b);
      // As over plain TCP (sentinel.int.test.ts): at the sentinel's notice, or at A's READONLY.
      await expect.poll(() => serverPort(redis), { timeout: 30_000 }).toBe(tlsPorts.b);
      await redis.set("k", "after");
      expect(await pair.adminB.get("k")).toBe("after");
      expect(/^role:master/m.test(await pair.adminB.info("replication"))).toBe(true);
      await assertRedisDurable(redis);
    } finally {
      await sentinel?.stop();
      sentinel = null;
      await pair.stop();
    }
  });
});

describe("certificates rotated in place (watchRedisTls)", () => {
  it("a Redis moved to a new CA and a new client certificate is reached again without a restart: the files rewritten, every connection (a duplicate, BullMQ's) reconnects with them; unusable files are warned of and leave the old ones", async () => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-tls-rotate-"));
    const conns: RedisConnection[] = [];
    let server: LocalRedisServer | null = null;
    let stop: () => void = () => undefined;
    try {
      // Two CAs of their own, each with a server and a client certificate.
      mkdirSync(join(dir, "old"));
      mkdirSync(join(dir, "new"));
      const before = makeTestCertificates(join(dir, "old"));
      const after = makeTestCertificates(join(dir, "new"));
      const files = {
        redisTlsCaFile: join(dir, "ca.pem"),
        redisTlsCertFile: join(dir, "client.pem"),
        redisTlsKeyFile: join(dir, "client.key"),
      };
      const install = (certs: TestCertificates) => {
        replaceFile(certs.caFile, files.redisTlsCaFile);
        replaceFile(certs.clientCertFile, files.redisTlsCertFile);
        replaceFile(certs.clientKeyFile, files.redisTlsKeyFile);
      };
      install(before);
      const tlsPort = await freeLoopbackPort();
      const serve = (certs: TestCertificates) =>
        LocalRedisServer.start({ dir, args: tlsServerArgs(certs, tlsPort, { authClients: true }) });
      server = await serve(before);
      const tls = readRedisTls(files);
      const said: { level: string; obj: object; msg: string }[] = [];
      const secrets = new Set<string>();
      stop = watchRedisTls(files, tls, {
        intervalMs: 50,
        secrets,
        logger: {
          info: (obj, msg) => said.push({ level: "info", obj, msg }),
          warn: (obj, msg) => said.push({ level: "warn", obj, msg }),
        },
      });
      const url = `rediss://127.0.0.1:${tlsPort}`;
      const redis = createRedis(url, {}, tls);
      const dup = duplicateRedis(redis);
      for (const c of [redis, dup]) {
        conns.push(c);
        c.on("error", () => undefined);
      }
      expect(await redis.ping()).toBe("PONG");
      expect(await dup.ping()).toBe("PONG");

      // Half a rotation (the new key beside the old certificate): not taken, said once.
      replaceFile(after.clientKeyFile, files.redisTlsKeyFile);
      await vi.waitFor(() => expect(said.filter((s) => s.level === "warn")).toHaveLength(1), {
        timeout: 10_000,
      });
      expect(said[0]!.obj).toEqual({ err: expect.stringMatching(/is not the key of the certificate/) });
      expect(tls.key).toBe(readFileSync(before.clientKeyFile, "utf8"));
      // A certificate file cut short (a chain read mid-write), the old key back: not taken either
      // (Node's TLS would throw at the next connect, and ioredis end that connection for good).
      replaceFile(before.clientKeyFile, files.redisTlsKeyFile);
      writeFileSync(
        join(dir, "cut.pem"),
        readFileSync(before.clientCertFile, "utf8") + before.ca.slice(0, 300),
      );
      replaceFile(join(dir, "cut.pem"), files.redisTlsCertFile);
      await vi.waitFor(() => expect(said.filter((s) => s.level === "warn")).toHaveLength(2), {
        timeout: 10_000,
      });
      expect(said[1]!.obj).toEqual({ err: expect.stringMatching(/holds a certificate cut short/) });
      expect(tls.cert).toBe(readFileSync(before.clientCertFile, "utf8"));
      // The connections still reconnect with what they had.
      let readies = 0;
      redis.on("ready", () => readies++);
      const admin = createRedis(server.url);
      try {
        expect(Number(await admin.call("CLIENT", "KILL", "TYPE", "normal"))).toBeGreaterThanOrEqual(2);
      } finally {
        admin.disconnect();
      }
      await vi.waitFor(() => expect(readies).toBe(1), { timeout: 30_000 });
      expect(await redis.ping()).toBe("PONG");
      expect(await dup.ping()).toBe("PONG");

      // The Redis moves to the new CA (restarted: every connection drops), the files follow.
      await server.kill();
      server = await serve(after);
      install(after);
      await vi.waitFor(() => expect(redis.status).toBe("ready"), { timeout: 30_000 });
      await vi.waitFor(() => expect(dup.status).toBe("ready"), { timeout: 30_000 });
      expect(await redis.ping()).toBe("PONG");
      expect(await dup.ping()).toBe("PONG");
      expect(await serverPort(redis)).toBe(tlsPort);
      expect(tls).toEqual({
        ca: after.ca,
        cert: readFileSync(after.clientCertFile, "utf8"),
        key: readFileSync(after.clientKeyFile, "utf8"),
      });
      expect([...secrets]).toEqual([tls.key]);
      expect(said.filter((s) => s.level === "info")).toEqual([
        {
          level: "info",
          obj: { changed: ["ca", "cert", "key"] },
          msg: "the Redis TLS files changed; connections present and trust the new ones from their next connect",
        },
      ]);
      expect(said.filter((s) => s.level === "warn")).toHaveLength(2);
      // A BullMQ queue and worker (its own duplicates) made from it work on the new files.
      expect(await oneJob(redis, "{tls-rotate-test}")).toBe(42);
    } finally {
      stop();
      for (const c of conns) c.disconnect();
      await server?.kill();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe("a Redis Cluster over TLS (rediss-cluster://), checked against FLEET_REDIS_TLS_CA_FILE's CA", () => {
  let dir = "";
  let cluster: LoopbackRedisCluster | null = null;
  let conn: RedisConnection | null = null;
  afterEach(async () => {
    conn?.disconnect();
    await cluster?.stop();
    [conn, cluster] = [null, null];
    rmSync(dir, { recursive: true, force: true });
  });

  it("reaches every master on its TLS port (the ones the cluster hands out too), passes the durability check on each, and BullMQ runs a job", async () => {
    dir = mkdtempSync(join(tmpdir(), "fleet-tls-cluster-"));
    const certs = makeTestCertificates(dir);
    cluster = await startLoopbackRedisCluster({ tls: certs });
    expect(cluster.url).toBe(`rediss-cluster://${cluster.tlsPorts.map((p) => `127.0.0.1:${p}`).join(",")}`);
    const redis = connectRedis(cluster.url, {}, readRedisTls(fleetTlsFiles(certs))) as Cluster;
    conn = redis;
    redis.on("error", () => undefined);
    await assertRedisDurable(redis);
    const masters = redis.nodes("master");
    expect(masters).toHaveLength(3);
    expect((await Promise.all(masters.map(serverPort))).sort()).toEqual([...cluster.tlsPorts].sort());
    expect(await oneJob(redis, "{tls-cluster-test}")).toBe(42);
  });

  it("one whose certificate names its nodes by hostname only (as a managed Redis's does) is reached by those names, not their addresses", async () => {
    dir = mkdtempSync(join(tmpdir(), "fleet-tls-cluster-"));
    const certs = makeTestCertificates(dir, { subjectAltName: "DNS:localhost" });
    cluster = await startLoopbackRedisCluster({ tls: certs, announceHostname: "localhost" });
    expect(cluster.url).toMatch(/^rediss-cluster:\/\/localhost:\d+,localhost:/);
    const redis = connectRedis(cluster.url, {}, readRedisTls(fleetTlsFiles(certs))) as Cluster;
    conn = redis;
    redis.on("error", () => undefined);
    await assertRedisDurable(redis);
    expect(await oneJob(redis, "{tls-cluster-named}")).toBe(42);
  });
});
