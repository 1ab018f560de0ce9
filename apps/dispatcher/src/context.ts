import type { DispatcherConfig } from "@fleet/config";
import type { RedisConnection, RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
import type { createMetricsRegistry, FleetMetrics, Logger } from "@fleet/telemetry";

/** A prom-client registry, as `@fleet/telemetry` makes them. */
export type MetricsRegistry = ReturnType<typeof createMetricsRegistry>;

/** Everything the HTTP API needs; built once in `main.ts` (or a test). */
export interface DispatcherDeps {
  store: RolloutStore;
  queues: StageQueues;
  /** Read for `fleet_teardown_ledger_entries` at scrape time, when given. */
  ledger?: TeardownLedger;
  /** The connection `store` and `queues` use; pinged by `/readyz`. */
  redis: RedisConnection;
  config: DispatcherConfig;
  logger: Logger;
  registry: MetricsRegistry;
  metrics: FleetMetrics;
  /** Clock, for tests. @defaultValue `Date.now` */
  now?: () => number;
  /**
   * How long a submission's backlog reservation outlives its last refresh (`submit`), for tests.
   * @defaultValue `BACKLOG_RESERVATION_TTL_MS` (a minute)
   */
  reservationTtlMs?: number;
  /**
   * How long a results stream may wait on a client that reads nothing before its connection is
   * closed, for tests. @defaultValue `RESULTS_STALL_MS` (5 minutes)
   */
  resultsStallMs?: number;
}

/** What route modules get: the deps with the clock resolved. */
export type RouteContext = DispatcherDeps & { now: () => number };

declare module "fastify" {
  interface FastifyRequest {
    /** Who sent it (`RequestAuth.principal`), set by the auth hook; "" on public routes or with auth off. */
    principal: string;
  }
  interface FastifyContextConfig {
    /** Served without a bearer token (health, readiness, metrics). */
    public?: boolean;
  }
}
