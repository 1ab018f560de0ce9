import { randomUUID } from "node:crypto";
import { DispatcherConfig, parseConfig } from "@fleet/config";
import { RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
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
  knobs: Pick<DispatcherDeps, "resultsStallMs"> = {},
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
