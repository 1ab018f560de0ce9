import { randomUUID } from "node:crypto";
import { DispatcherConfig, parseConfig } from "@fleet/config";
import { type RolloutResult, TaskContent, type TaskContentInput } from "@fleet/contracts";
import { digestTask, RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
import { createFleetMetrics, createLogger, createMetricsRegistry } from "@fleet/telemetry";
import type { FastifyInstance } from "fastify";
import type { Redis } from "ioredis";
import type { DispatcherDeps } from "./context.ts";
import { createServer } from "./server.ts";

/** A dispatcher for a test: its own key prefix on `redis`, a silent logger, not listening. */
export interface TestServer {
  app: FastifyInstance;
  prefix: string;
  store: RolloutStore;
  queues: StageQueues;
  /** Close the server and its queues (not `redis`). */
  close(): Promise<void>;
}

/** Build and ready one; `env` is its configuration (FLEET_PREFIX is set here, as `{t-<name>-…}`). */
export async function startTestServer(
  redis: Redis,
  name: string,
  env: Record<string, string> = {},
  /** Test-only knobs of the dispatcher's (`DispatcherDeps`). */
  knobs: Partial<Pick<DispatcherDeps, "resultsStallMs" | "logger">> = {},
): Promise<TestServer> {
  const prefix = `{t-${name}-${randomUUID().slice(0, 8)}}`;
  const registry = createMetricsRegistry({ app: "dispatcher", defaultMetrics: false });
  const store = new RolloutStore(redis, prefix);
  const queues = new StageQueues(redis, prefix);
  const app = createServer({
    store,
    queues,
    ledger: new TeardownLedger(redis, prefix),
    redis,
    config: parseConfig(DispatcherConfig, { ...env, FLEET_PREFIX: prefix }),
    logger: createLogger({ name: `dispatcher-${name}`, level: "silent" }),
    registry,
    metrics: createFleetMetrics(registry),
    ...knobs,
  });
  await app.ready();
  return {
    app,
    prefix,
    store,
    queues,
    async close() {
      await app.close();
      await queues.close();
    },
  };
}

/** A small inline task for the dispatcher's tests. */
export const TEST_TASK = {
  id: "t-echo",
  instruction: "Print hello.",
  image: "fleet-base:test",
  solution: { "solve.sh": "#!/bin/sh\necho hello\n" },
  tests: { "test.sh": "#!/bin/sh\nexit 0\n" },
} satisfies TaskContentInput;

/** A completed result of `TEST_TASK` by the oracle, as close would store it. */
export function completedResult(id: string, batchId: string | null, reward: number): RolloutResult {
  const now = Date.now();
  return {
    id,
    batchId,
    taskId: TEST_TASK.id,
    taskDigest: digestTask(TaskContent.parse(TEST_TASK)),
    agent: "oracle",
    status: "completed",
    reward,
    mask: false,
    failureKind: null,
    stage: "close",
    reason: null,
    teardown: "confirmed",
    exitCode: 0,
    usage: null,
    agentLaunches: 1,
    timings: { queuedMs: 1, seedMs: 2, runMs: 3, verifyMs: 4, closeMs: 5, totalMs: 15, agentMs: 2 },
    details: null,
    failures: [],
    metadata: null,
    createdAt: now,
    finishedAt: now,
  };
}
