import type { StageName } from "@fleet/contracts";
import { type Job, Worker } from "bullmq";
import type { Redis } from "ioredis";
import type { PipelineDeps } from "./deps.ts";
import { runStageJob } from "./stage-runner.ts";

export interface StageWorkerOptions {
  connection: Redis;
  prefix: string;
  concurrency: number;
  /** Job lock; a worker that dies loses its jobs to another after this (BullMQ stalled check). */
  lockDurationMs?: number;
  stalledIntervalMs?: number;
  maxStalledCount?: number;
}

export interface StageWorkers {
  workers: Worker[];
  /** Stop taking jobs and wait (bounded) for active ones; unfinished ones go back to the queue. */
  close(timeoutMs?: number): Promise<void>;
}

/** One BullMQ worker per stage, each running `runStageJob` with the shared deps. */
export function createStageWorkers(
  stages: readonly StageName[],
  deps: PipelineDeps,
  options: StageWorkerOptions,
): StageWorkers {
  const workers = stages.map((stage) => {
    const worker = new Worker(
      stage,
      async (job: Job) => {
        const started = Date.now();
        try {
          const outcome = await runStageJob(stage, job, deps);
          deps.metrics?.stageJobs.inc({ stage, outcome: outcome === "ok" ? "ok" : "replayed" });
          deps.metrics?.stageDuration.observe({ stage, outcome: "ok" }, (Date.now() - started) / 1000);
          return outcome;
        } catch (err) {
          const name = (err as Error).name;
          const outcome = name === "UnrecoverableError" ? "failed" : "retry";
          deps.metrics?.stageJobs.inc({ stage, outcome });
          deps.metrics?.stageDuration.observe({ stage, outcome }, (Date.now() - started) / 1000);
          throw err;
        }
      },
      {
        connection: options.connection.duplicate(),
        prefix: options.prefix,
        concurrency: options.concurrency,
        lockDuration: options.lockDurationMs ?? 30_000,
        stalledInterval: options.stalledIntervalMs ?? 15_000,
        maxStalledCount: options.maxStalledCount ?? 3,
        autorun: true,
      },
    );
    worker.on("error", (err) => deps.logger.error({ stage, err: err.message }, "worker error"));
    return worker;
  });
  return {
    workers,
    async close(timeoutMs = 30_000) {
      // Graceful: stop fetching, let active jobs finish; past the bound, force-close (the jobs'
      // locks lapse and another worker picks them up as stalled).
      const graceful = Promise.all(workers.map((w) => w.close()));
      let timer: NodeJS.Timeout | undefined;
      const timeout = new Promise<"timeout">((resolve) => {
        timer = setTimeout(() => resolve("timeout"), timeoutMs);
      });
      const r = await Promise.race([graceful.then(() => "done" as const), timeout]);
      clearTimeout(timer);
      if (r === "timeout") await Promise.all(workers.map((w) => w.close(true)));
      await Promise.all(workers.map((w) => w.disconnect()));
    },
  };
}
