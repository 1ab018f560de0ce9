import { DispatcherConfig, parseConfig, warnFetchBlockedPort, warnUnknownVariables } from "@fleet/config";
import {
  connectRedis,
  createAppLogging,
  failFastOnceReady,
  logConnectionOutages,
  RolloutStore,
  StageQueues,
  startRedisClock,
  TeardownLedger,
  waitForRedis,
  watchRedisTls,
} from "@fleet/queue";
import {
  createFleetMetrics,
  createMetricsRegistry,
  isRepeatedSignal,
  onStartFailure,
  portInUse,
} from "@fleet/telemetry";
import { createServer } from "./server.ts";

/**
 * The dispatcher's one wiring point: config from the environment, logger, metrics, Redis,
 * queues, the HTTP server, and a bounded graceful shutdown on SIGTERM/SIGINT.
 */
async function main(): Promise<void> {
  const config = parseConfig(DispatcherConfig, process.env);
  // Its Redis TLS files read and checked; the key and passphrase scrubbed from every line.
  const { logger, secrets, tls } = createAppLogging({ name: "dispatcher", level: config.logLevel }, config);
  // A misspelt FLEET_ variable would be ignored without a word: named, with the closest known one.
  warnUnknownVariables(process.env, logger);
  // A port fetch refuses (6000, 10080, ...): curl works, the CLI (which refuses such a URL) and a browser never will.
  warnFetchBlockedPort("FLEET_HTTP_PORT", config.httpPort, logger);
  const registry = createMetricsRegistry({ app: "dispatcher" });
  const metrics = createFleetMetrics(registry);
  // A certificate rotated in place is taken without a restart.
  watchRedisTls(config, tls, {
    logger,
    secrets,
    intervalMs: config.redisTlsReloadMs,
    certificateExpiry: (at) => metrics.redisTlsCertExpiry.set(at),
  });
  // No blocking commands here (no Worker), so a request may fail fast while Redis is down
  // (→ 503) instead of waiting for it: at once once it has been up (`failFastOnceReady`), after
  // two reconnect attempts before that.
  const redis = connectRedis(config.redisUrl, { maxRetriesPerRequest: 2 }, tls);
  failFastOnceReady(redis);
  logConnectionOutages(redis, logger);
  // Redis not up yet (started beside it, restarting): wait for it, as the workers do, saying so;
  // a Redis that answers but is not safe for the fleet's state refuses the start at once.
  // Checked again at every reconnect (after a failover: the promoted replica), in the gauge.
  await waitForRedis(redis, {
    acceptWriteLoss: config.acceptRedisWriteLoss,
    logger,
    durable: (ok) => metrics.redisDurable.set(ok ? 1 : 0),
  });
  // Acceptance times and deadlines on Redis's clock, whatever this host's says (`startRedisClock`).
  const fleetClock = await startRedisClock(redis, { prefix: config.prefix, logger });
  const store = new RolloutStore(redis, config.prefix, {
    resultTtlMs: config.resultTtlMs,
    now: fleetClock.now,
  });
  const ledger = new TeardownLedger(redis, config.prefix);
  const queues = new StageQueues(redis, config.prefix);
  // A Queue re-emits its connection's errors (logged once per outage above); unheard, an
  // 'error' event would crash the process.
  for (const queue of Object.values(queues.queues)) queue.on("error", () => undefined);
  const app = createServer({
    store,
    queues,
    ledger,
    redis,
    config,
    logger,
    registry,
    metrics,
    now: fleetClock.now,
  });

  let closing = false;
  let closingSince = 0;
  const shutdown = (signal: string) => {
    // A second signal (a second Ctrl-C, an impatient supervisor) exits at once, as the workers do;
    // not the same Ctrl-C come again (`npm start` passes on the SIGINT the terminal sent it too).
    if (closing) {
      if (isRepeatedSignal(closingSince)) return;
      logger.error({ signal }, "second signal while shutting down; exiting at once");
      process.exit(1);
    }
    closing = true;
    closingSince = Date.now();
    logger.info({ signal }, "shutting down");
    const force = setTimeout(() => {
      logger.error({ timeoutMs: config.shutdownTimeoutMs }, "graceful shutdown timed out; exiting");
      process.exit(1);
    }, config.shutdownTimeoutMs);
    force.unref();
    (async () => {
      await app.close();
      await queues.close();
      // A QUIT needs Redis up (with the offline queue off it is refused at once while it is down):
      // down, there is nothing to say goodbye to.
      if (redis.status === "ready") await redis.quit();
      else redis.disconnect();
    })().then(
      () => {
        logger.info("stopped");
        clearTimeout(force);
      },
      (err: unknown) => {
        logger.error({ err }, "error while shutting down");
        process.exit(1);
      },
    );
  };
  process.on("SIGTERM", () => shutdown("SIGTERM"));
  process.on("SIGINT", () => shutdown("SIGINT"));

  logger.info({ prefix: config.prefix, maxBacklog: config.maxBacklog }, "starting");
  // Fastify logs the one "listening" line, with the bound address (port 0 → the real port).
  await app
    .listen({
      host: config.httpHost,
      port: config.httpPort,
      listenTextResolver: (address) => `dispatcher listening on ${address}`,
    })
    .catch(portInUse("FLEET_HTTP_PORT", config.httpPort, config.httpHost, "", "FLEET_HTTP_HOST"));
}

main().catch(onStartFailure(process.env));
