import { randomUUID } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createRedis, LocalRedisServer, RolloutStore, TeardownLedger } from "@fleet/queue";
import { sandboxEntry } from "@fleet/queue/testing";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { Queue, Worker } from "bullmq";
import type { Redis } from "ioredis";
import { afterAll, describe, expect, it, vi } from "vitest";
import { refreshScrapeMetrics } from "./scrape-metrics.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";

describe("fleet_queue_oldest_waiting_age_seconds", () => {
  const redis = createRedis(REDIS_URL);
  const prefix = `{t-scrape-${randomUUID().slice(0, 8)}}`;
  const queue = new Queue("run", { connection: redis, prefix });
  /** A scrape of `queue` alone into fresh metrics, at `now`. */
  const scrape = async (q: Queue = queue, now = Date.now()) => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "scrape-test", defaultMetrics: false }));
    await refreshScrapeMetrics({
      redis,
      queues: [q],
      store: { inflightCount: async () => 0, probeWrite: async () => {}, workersPresent: async () => 0 },
      metrics,
      now,
      timeoutMs: 5_000,
    });
    return metrics;
  };
  const runAge = async (metrics: Awaited<ReturnType<typeof scrape>>) =>
    (await metrics.queueOldestWaitingAge.get()).values.find((v) => v.labels.queue === "run")!.value;
  afterAll(async () => {
    await queue.obliterate({ force: true });
    await queue.close();
    redis.disconnect();
  });

  it("fleet_teardown_ledger_oldest_age_seconds: how long the oldest entry has awaited its teardown", async () => {
    const metrics = createFleetMetrics(createMetricsRegistry({ app: "scrape-test", defaultMetrics: false }));
    const ledger = new TeardownLedger(redis, prefix);
    const now = Date.now();
    const refresh = async () => {
      await refreshScrapeMetrics({
        redis,
        queues: [],
        store: { inflightCount: async () => 0, probeWrite: async () => {}, workersPresent: async () => 0 },
        ledger,
        metrics,
        now,
        timeoutMs: 5_000,
      });
      return (await metrics.teardownLedgerOldestAge.get()).values[0]?.value;
    };
    expect(await refresh()).toBe(0);
    const entry = (id: string) => sandboxEntry(id);
    await ledger.recordFailure(entry("old"), "boom", now - 1_200_000);
    await ledger.recordFailure(entry("new"), "boom", now - 60_000);
    expect(await refresh()).toBe(1_200);
    await ledger.confirm(entry("old"));
    expect(await refresh()).toBe(60);
    await ledger.confirm(entry("new"));
  });

  it("counts from when the job last came back to the queue, not from its creation", async () => {
    const age = async () => runAge(await scrape());
    // Added an hour ago and never taken: it has waited an hour.
    await queue.add("run", { rolloutId: "r" }, { jobId: "r.run", timestamp: Date.now() - 3_600_000 });
    expect(await age()).toBeGreaterThanOrEqual(3_600);
    // Taken by a worker, then handed back (a hold, a shutdown): waiting only since then.
    const worker = new Worker("run", null, { connection: redis.duplicate(), prefix, autorun: false });
    try {
      const token = randomUUID();
      const job = await worker.getNextJob(token);
      expect(job?.id).toBe("r.run");
      await job!.moveToWait(token);
      expect(await age()).toBeLessThan(60);
    } finally {
      await worker.close();
      await queue.obliterate({ force: true });
    }
  });

  it("counts a job given a priority (Bull Board's edit: BullMQ's prioritized state) as waiting", async () => {
    try {
      await queue.add("run", { rolloutId: "p" }, { jobId: "p.run", timestamp: Date.now() - 3_600_000 });
      await (await queue.getJob("p.run"))!.changePriority({ priority: 5 });
      expect(await queue.getJobState("p.run")).toBe("prioritized");
      const metrics = await scrape();
      expect(await runAge(metrics)).toBeGreaterThanOrEqual(3_600);
      const counted = (await metrics.queueJobs.get()).values.find(
        (v) => v.labels.queue === "run" && v.labels.state === "prioritized",
      );
      expect(counted?.value).toBe(1);
    } finally {
      await queue.obliterate({ force: true });
    }
  });

  describe("a retried job", () => {
    const HOUR = 3_600_000;
    const prefix = `{t-scrape-retry-${randomUUID().slice(0, 8)}}`;
    const queue = new Queue("run", { connection: redis, prefix });
    const worker = new Worker("run", null, { connection: redis.duplicate(), prefix, autorun: false });
    afterAll(async () => {
      await worker.close();
      await queue.obliterate({ force: true });
      await queue.close();
    });
    const age = async (now = Date.now()) => runAge(await scrape(queue, now));

    /** `r.run`, added three hours ago, taken, run for two hours and failed: an hour's backoff. */
    const failedAfterTwoHours = async () => {
      await queue.obliterate({ force: true });
      await queue.add(
        "run",
        { rolloutId: "r" },
        {
          jobId: "r.run",
          attempts: 3,
          backoff: { type: "fixed", delay: HOUR },
          timestamp: Date.now() - 3 * HOUR,
        },
      );
      const token = randomUUID();
      const job = (await worker.getNextJob(token))!;
      expect(job.id).toBe("r.run");
      await redis.hset(`${prefix}:run:r.run`, "processedOn", String(Date.now() - 2 * HOUR));
      await job.moveToFailed(new Error("sandbox lost"), token);
      expect(await job.getState()).toBe("delayed");
      return job;
    };

    it("back on the wait list after its backoff: waiting since then, not since its attempt started", async () => {
      const job = await failedAfterTwoHours();
      // Waiting out its backoff: not ready, so not waiting for a worker.
      expect(await age()).toBe(0);
      // Moved to the wait list (as a worker looking for a job does once the backoff is over).
      await job.promote();
      expect(await job.getState()).toBe("waiting");
      expect(await age()).toBeLessThan(60);
    });

    it("past its backoff but not yet moved to the wait list (no free worker): waiting since its backoff ended", async () => {
      await failedAfterTwoHours();
      const now = Date.now() + HOUR + 600_000;
      expect(await age(now)).toBeGreaterThanOrEqual(600);
      expect(await age(now)).toBeLessThan(660);
    });

    it("is not hidden behind a handed-back job put in front of the jobs that waited longer", async () => {
      await queue.obliterate({ force: true });
      await queue.add("run", { rolloutId: "a" }, { jobId: "a.run", timestamp: Date.now() - 2 * HOUR });
      await queue.add("run", { rolloutId: "b" }, { jobId: "b.run", timestamp: Date.now() - HOUR });
      const token = randomUUID();
      const a = (await worker.getNextJob(token))!;
      expect(a.id).toBe("a.run");
      // Handed back (a shutdown): in front of b, which has waited an hour.
      await a.moveToWait(token);
      expect((await queue.getJobs(["waiting"], 0, 0, true))[0]?.id).toBe("a.run");
      expect(await age()).toBeGreaterThanOrEqual(3_600);
    });
  });
});

/** `fleet_queue_workers{queue="run"}` of one scrape of `queue` (`undefined`: left out), at `now`. */
async function scrapedRunWorkers(
  redis: Redis,
  queue: Queue,
  store: RolloutStore,
  now = Date.now(),
): Promise<number | undefined> {
  const metrics = createFleetMetrics(createMetricsRegistry({ app: "scrape-test", defaultMetrics: false }));
  await refreshScrapeMetrics({ redis, queues: [queue], store, metrics, now, timeoutMs: 5_000 });
  const waiting = (await metrics.queueJobs.get()).values.find(
    (v) => v.labels.queue === "run" && v.labels.state === "waiting",
  );
  // The other queue gauges are there all the same.
  expect(waiting?.value).toBe(1);
  return (await metrics.queueWorkers.get()).values.find((v) => v.labels.queue === "run")?.value;
}

/**
 * Where Redis answers CLIENT LIST, the BullMQ workers connected are counted, exactly: a worker
 * process's presence entry is not what the gauge says then.
 */
describe("fleet_queue_workers on a Redis that answers CLIENT LIST", () => {
  const redis = createRedis(REDIS_URL);
  const prefix = `{t-scrape-workers-${randomUUID().slice(0, 8)}}`;
  const queue = new Queue("run", { connection: redis, prefix });
  const store = new RolloutStore(redis, prefix);
  afterAll(async () => {
    await queue.obliterate({ force: true });
    await queue.close();
    await redis.del(store.keys.workers("run"));
    redis.disconnect();
  });

  it("counts the BullMQ workers connected to the queue, not the presence entries", async () => {
    await queue.add("run", { rolloutId: "r" }, { jobId: "r.run" });
    // Said by a process (its entry not yet expired), and no BullMQ worker connected.
    await store.sayWorkerPresent("run", "gone-quiet", Date.now(), Date.now() + 30_000);
    expect(await scrapedRunWorkers(redis, queue, store)).toBe(0);
    const worker = new Worker("run", null, { connection: redis.duplicate(), prefix, autorun: false });
    try {
      await worker.waitUntilReady();
      await vi.waitFor(async () => expect(await scrapedRunWorkers(redis, queue, store)).toBe(1));
    } finally {
      await worker.close();
    }
  });
});

/**
 * A Redis that refuses CLIENT LIST, as some managed services do: the command renamed away
 * (BullMQ then answers `getWorkers` with one made-up entry rather than an error), or an ACL user
 * without it (an error). The worker processes that said they consume the queue
 * (`RolloutStore.sayWorkerPresent`, which the stage workers and the janitor do on a timer) are
 * counted instead. Their own private redis-servers: the shared one must keep CLIENT.
 */
describe("fleet_queue_workers on a Redis that refuses CLIENT LIST", () => {
  const dirs: string[] = [];
  const servers: LocalRedisServer[] = [];
  afterAll(async () => {
    for (const server of servers) await server.kill();
    for (const dir of dirs) rmSync(dir, { recursive: true, force: true });
  });
  const startServer = async (args: string[] = []) => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-no-client-"));
    dirs.push(dir);
    const server = await LocalRedisServer.start({ dir, args });
    servers.push(server);
    return server;
  };

  it("without the CLIENT command: the workers present (not a made-up 1 worker), 0 with none", async () => {
    const server = await startServer(["--rename-command", "CLIENT", ""]);
    const redis = createRedis(server.url);
    const queue = new Queue("run", { connection: redis, prefix: "{t-no-client}" });
    const store = new RolloutStore(redis, "{t-no-client}");
    try {
      await queue.add("run", { rolloutId: "r" }, { jobId: "r.run" });
      expect(await scrapedRunWorkers(redis, queue, store)).toBe(0);
      await store.sayWorkerPresent("run", "w1", Date.now(), Date.now() + 30_000);
      expect(await scrapedRunWorkers(redis, queue, store)).toBe(1);
    } finally {
      await queue.close();
      redis.disconnect();
    }
  });

  it("on a read-only replica (a failover's, not yet synced): the expired entries it cannot remove are not counted, and the scrape goes on", async () => {
    const server = await startServer(["--rename-command", "CLIENT", ""]);
    const redis = createRedis(server.url);
    const prefix = "{t-no-client-replica}";
    const queue = new Queue("run", { connection: redis, prefix });
    const store = new RolloutStore(redis, prefix);
    try {
      await queue.add("run", { rolloutId: "r" }, { jobId: "r.run" });
      const now = Date.now();
      await store.sayWorkerPresent("run", "live", now, now + 30_000);
      await store.sayWorkerPresent("run", "died", now - 40_000, now - 10_000);
      // A replica of a master that does not answer (port 1): it keeps its data, and refuses writes.
      await redis.call("REPLICAOF", "127.0.0.1", "1");
      await expect(redis.set("probe", "1")).rejects.toThrow(/READONLY/);
      expect(await scrapedRunWorkers(redis, queue, store, now)).toBe(1);
      expect(await redis.hlen(store.keys.workers("run"))).toBe(2);
    } finally {
      await queue.close();
      redis.disconnect();
    }
  });

  it("for an ACL user without CLIENT: a live worker is counted; one that closed, or whose presence expired (its process died), is not", async () => {
    const server = await startServer();
    const admin = createRedis(server.url);
    await admin.call("ACL", "SETUSER", "fleet", "on", ">fleet-pw", "~*", "&*", "+@all", "-client");
    const url = `redis://fleet:fleet-pw@127.0.0.1:${server.port}`;
    const redis = createRedis(url);
    const prefix = "{t-acl-no-client}";
    const queue = new Queue("run", { connection: redis, prefix });
    const store = new RolloutStore(redis, prefix);
    // A worker connected under the same user (its CLIENT SETNAME refused too).
    const worker = new Worker("run", null, { connection: createRedis(url), prefix, autorun: false });
    try {
      await expect(redis.call("CLIENT", "LIST")).rejects.toThrow(/NOPERM/);
      await worker.waitUntilReady();
      await queue.add("run", { rolloutId: "r" }, { jobId: "r.run" });
      const now = Date.now();
      // Nobody said they consume the queue: 0 (FleetQueueNoConsumer's case), not left out.
      expect(await scrapedRunWorkers(redis, queue, store, now)).toBe(0);
      await store.sayWorkerPresent("run", "live", now, now + 30_000);
      await store.sayWorkerPresent("run", "closed", now, now + 30_000);
      await store.forgetWorkerPresent("run", "closed");
      // Said last 40 s ago, due to be said again 10 s ago: its process died.
      await store.sayWorkerPresent("run", "died", now - 40_000, now - 10_000);
      expect(await scrapedRunWorkers(redis, queue, store, now)).toBe(1);
      // The live one stops saying too (its process dies): gone once its entry expires.
      expect(await scrapedRunWorkers(redis, queue, store, now + 30_000)).toBe(0);
    } finally {
      await worker.close();
      await queue.close();
      redis.disconnect();
      admin.disconnect();
    }
  });
});

/**
 * A Redis that answers PING and reads but refuses writes (full under noeviction): its own private
 * redis-server with a maxmemory below what it holds.
 */
describe("fleet_redis_writable", () => {
  const dir = mkdtempSync(join(tmpdir(), "fleet-full-redis-"));
  let server: LocalRedisServer;
  afterAll(async () => {
    await server?.kill();
    rmSync(dir, { recursive: true, force: true });
  });

  it("is 1 while Redis takes writes, 0 while it answers PING and refuses them (FleetRedisDown says nothing then)", async () => {
    server = await LocalRedisServer.start({ dir });
    const redis = createRedis(server.url);
    const store = new RolloutStore(redis, "{t-full}");
    try {
      const sample = async () => {
        const metrics = createFleetMetrics(
          createMetricsRegistry({ app: "scrape-test", defaultMetrics: false }),
        );
        await refreshScrapeMetrics({ redis, queues: [], store, metrics, now: Date.now(), timeoutMs: 5_000 });
        return [
          (await metrics.redisUp.get()).values[0]?.value,
          (await metrics.redisWritable.get()).values[0]?.value,
        ];
      };
      expect(await sample()).toEqual([1, 1]);
      await redis.config("SET", "maxmemory", "1");
      expect(await sample()).toEqual([1, 0]);
      await redis.config("SET", "maxmemory", "0");
      expect(await sample()).toEqual([1, 1]);
    } finally {
      redis.disconnect();
    }
  });
});
