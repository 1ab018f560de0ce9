import { randomUUID } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createRedis, LocalRedisServer, RolloutStore, TeardownLedger } from "@fleet/queue";
import { sandboxEntry } from "@fleet/queue/testing";
import { createFleetMetrics, createMetricsRegistry } from "@fleet/telemetry";
import { Queue, Worker } from "bullmq";
import { afterAll, describe, expect, it } from "vitest";
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
      store: { inflightCount: async () => 0, probeWrite: async () => {} },
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
        store: { inflightCount: async () => 0, probeWrite: async () => {} },
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

/**
 * A Redis without the CLIENT command (renamed away, as some managed services do): BullMQ then
 * answers `getWorkers` with one made-up entry rather than an error. Its own private
 * redis-server: the shared one must keep CLIENT.
 */
describe("fleet_queue_workers on a Redis without CLIENT", () => {
  const dir = mkdtempSync(join(tmpdir(), "fleet-no-client-"));
  let server: LocalRedisServer;
  afterAll(async () => {
    await server?.kill();
    rmSync(dir, { recursive: true, force: true });
  });

  it("is left out (not a made-up 1 worker), the other queue gauges still there", async () => {
    server = await LocalRedisServer.start({ dir, args: ["--rename-command", "CLIENT", ""] });
    const redis = createRedis(server.url);
    const queue = new Queue("run", { connection: redis, prefix: "{t-no-client}" });
    try {
      await queue.add("run", { rolloutId: "r" }, { jobId: "r.run" });
      const metrics = createFleetMetrics(
        createMetricsRegistry({ app: "scrape-test", defaultMetrics: false }),
      );
      await refreshScrapeMetrics({
        redis,
        queues: [queue],
        store: { inflightCount: async () => 0, probeWrite: async () => {} },
        metrics,
        now: Date.now(),
        timeoutMs: 5_000,
      });
      const waiting = (await metrics.queueJobs.get()).values.find(
        (v) => v.labels.queue === "run" && v.labels.state === "waiting",
      );
      expect(waiting?.value).toBe(1);
      expect((await metrics.queueWorkers.get()).values).toEqual([]);
    } finally {
      await queue.close();
      redis.disconnect();
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
