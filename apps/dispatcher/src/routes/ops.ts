import type { Queue } from "bullmq";
import type { FastifyInstance } from "fastify";
import type { RouteContext } from "../context.ts";
import { unavailable } from "../http-error.ts";
import { buildOpenApi } from "../openapi.ts";
import { refreshScrapeMetrics, withTimeout } from "../scrape-metrics.ts";

/** How long `/readyz` and the Redis-sampled gauges of `/metrics` wait for Redis. */
export const REDIS_CHECK_TIMEOUT_MS = 2000;

/** `/healthz`, `/readyz`, `/metrics` (no token: see README), `/openapi.json` (token). */
export function registerOpsRoutes(
  app: FastifyInstance,
  ctx: RouteContext & {
    /** Queues sampled for the queue gauges: the stage queues and the janitor's. */
    scrapeQueues: readonly Queue[];
  },
): void {
  const { redis, registry, metrics, store, ledger } = ctx;

  // Liveness: the process answers. Touches nothing else, so a Redis outage does not get the
  // dispatcher restarted (readiness takes it out of rotation instead).
  app.get("/healthz", { config: { public: true } }, async () => ({ status: "ok" }));

  app.get("/readyz", { config: { public: true } }, async (req) => {
    try {
      await withTimeout(redis.ping(), REDIS_CHECK_TIMEOUT_MS, "redis ping");
    } catch (err) {
      // The client's own words stay in the log: this route is public, and they say nothing to a
      // load balancer or a user.
      req.log.warn(
        { err: err instanceof Error ? err.message : String(err) },
        "readiness: Redis does not answer",
      );
      throw unavailable("the fleet's Redis does not answer (unreachable, or too slow); not ready");
    }
    return { status: "ready" };
  });

  // Scrapes that arrive together share one refresh (about 300 Redis commands, a write among
  // them): the route is public, and 200 concurrent scrapes ran 58,000 commands.
  let refreshing: Promise<void> | null = null;
  const refresh = () => {
    refreshing ??= refreshScrapeMetrics({
      redis,
      queues: ctx.scrapeQueues,
      store,
      ledger,
      metrics,
      now: ctx.now(),
      timeoutMs: REDIS_CHECK_TIMEOUT_MS,
    }).finally(() => {
      refreshing = null;
    });
    return refreshing;
  };
  app.get("/metrics", { config: { public: true } }, async (req, reply) => {
    try {
      await refresh();
    } catch (err) {
      // Still serve the process metrics (and fleet_redis_up 0); the Redis-sampled gauges are
      // absent rather than stale.
      req.log.warn({ err }, "queue metrics unavailable");
    }
    return reply.type(registry.contentType).send(await registry.metrics());
  });

  let openapi: Record<string, unknown> | undefined;
  app.get("/openapi.json", async () => {
    openapi ??= buildOpenApi();
    return openapi;
  });
}
