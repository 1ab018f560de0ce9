import { randomUUID } from "node:crypto";
import { hostname } from "node:os";
import {
  JanitorConfig,
  parseConfig,
  parseWorkerConfig,
  type WorkerKind,
  warnUnknownVariables,
} from "@fleet/config";
import { FailureKind, type SandboxCeiling, type StageName } from "@fleet/contracts";
import {
  claimSandboxHost,
  connectRedis,
  createAppLogging,
  fleetInstance,
  keepFleetInstance,
  keepSandboxHost,
  logConnectionOutages,
  RolloutStore,
  SANDBOX_HOST_CLAIM_MS,
  StageQueues,
  startRedisClock,
  TeardownLedger,
  waitForRedis,
  watchRedisTls,
} from "@fleet/queue";
import { createSandboxProvider, DockerGatewayNetworks, dockerConnectionFromEnv } from "@fleet/sandbox";
import {
  createFleetMetrics,
  createMetricsRegistry,
  isRepeatedSignal,
  portInUse,
  startMetricsServer,
} from "@fleet/telemetry";
import { testsTamperRisk } from "@fleet/verifiers";
import { checkCredentialsFile, createCredentialResolver } from "./credentials.ts";
import type { PipelineDeps } from "./deps.ts";
import { startJanitor } from "./janitor.ts";
import { providerProblem, watchProvider } from "./provider-gate.ts";
import { statusFor } from "./result.ts";
import { countStalledJobs, createStageWorkers, DEFAULT_SEED_AHEAD } from "./worker.ts";

/** Which stages each worker kind runs (DESIGN §2 table). */
export const STAGES_OF: Record<WorkerKind, StageName[]> = {
  resources: ["seed", "close"],
  agent: ["run"],
  verifier: ["verify"],
};

type Env = Record<string, string | undefined>;

interface Common {
  credentialsFile?: string | null;
  /** Agent worker: `FLEET_MODEL_BASE_URLS`. */
  modelBaseUrls?: readonly string[] | null;
  /** Agent worker: `FLEET_GATEWAY_MAX_CALLS_PER_MINUTE`. */
  gatewayMaxCallsPerMinute?: number;
  /** Resources and agent workers: subnets for the gateway networks (`FLEET_GATEWAY_SUBNET_POOL`; made where the sandbox is created). */
  gatewaySubnetPool?: { base: string; prefix: number } | null;
  bwrapRootfs: string | null;
  stateDir: string;
  redisUrl: string;
  /** `FLEET_REDIS_ACCEPT_WRITE_LOSS`: start on a Redis without `appendfsync always`. */
  acceptRedisWriteLoss: boolean;
  /** `FLEET_REDIS_TLS_CA_FILE`: the CAs a Redis over TLS is checked against (null: Node's public roots). */
  redisTlsCaFile: string | null;
  /** `FLEET_REDIS_TLS_CERT_FILE` / `FLEET_REDIS_TLS_KEY_FILE`: the client certificate presented to a Redis over TLS, and its key. */
  redisTlsCertFile: string | null;
  redisTlsKeyFile: string | null;
  redisTlsKeyPassphraseFile: string | null;
  redisTlsReloadMs: number;
  prefix: string;
  logLevel: string;
  shutdownTimeoutMs: number;
  resultTtlMs: number;
  sandboxProvider: "docker" | "bubblewrap";
  dockerHost: string | null;
  dockerCertPath: string | null;
  /** Stage workers: `FLEET_SANDBOX_MAX_*`, the most a task's sandbox options may ask here (the janitor makes no sandbox). */
  sandboxCeiling?: SandboxCeiling;
  metricsPort: number | null;
  metricsHost: string;
}

async function buildDeps(app: string, config: Common, workerId: string, env: Env) {
  // Its Redis TLS key and passphrase, and the credential values this worker resolves: the logger
  // scrubs them from every line.
  const {
    logger,
    secrets: knownSecrets,
    tls,
  } = createAppLogging({ name: app, level: config.logLevel as "info" }, config);
  // A misspelt FLEET_ variable would be ignored without a word: named, with the closest known one.
  warnUnknownVariables(env, logger);
  const registry = createMetricsRegistry({ app });
  const metrics = createFleetMetrics(registry);
  // A certificate rotated in place is taken without a restart.
  watchRedisTls(config, tls, {
    logger,
    secrets: knownSecrets,
    intervalMs: config.redisTlsReloadMs,
    certificateExpiry: (at) => metrics.redisTlsCertExpiry.set(at),
  });
  const redis = connectRedis(config.redisUrl, {}, tls);
  // Connection errors while Redis is away: ioredis reconnects by itself; say so once per outage.
  logConnectionOutages(redis, logger);
  // Redis not up yet: wait for it, saying so (the dispatcher too); a Redis that is not safe for
  // the fleet's state refuses the start at once.
  // Checked again at every reconnect (after a failover: the promoted replica), in the gauge.
  await waitForRedis(redis, {
    acceptWriteLoss: config.acceptRedisWriteLoss,
    logger,
    durable: (ok) => metrics.redisDurable.set(ok ? 1 : 0),
  });
  // Deadlines and timings on Redis's clock, whatever this host's says (`startRedisClock`).
  const fleetClock = await startRedisClock(redis, { prefix: config.prefix, logger });
  // This deployment's id, on its sandboxes: another fleet with the same prefix (its own Redis) on
  // the same daemon is told apart by it.
  const instance = await fleetInstance(redis, config.prefix);
  keepFleetInstance(redis, config.prefix, instance, (current) =>
    logger.error(
      { instance, current },
      "this fleet's Redis names another deployment id than this app's (its data was lost, and another app started first): restart this app, or its sandboxes read as another fleet's to the rest",
    ),
  );
  const docker = dockerConnectionFromEnv(config.dockerHost, config.dockerCertPath);
  const provider = createSandboxProvider({
    provider: config.sandboxProvider,
    docker,
    bubblewrap: config.bwrapRootfs
      ? { rootfs: config.bwrapRootfs, stateDir: `${config.stateDir}/bwrap` }
      : undefined,
    logger,
    // Only this fleet's sandboxes: the janitor must never reap another fleet's on a shared daemon.
    scope: config.prefix,
    instance,
  });
  // A bubblewrap fleet's apps all run on one host (its sandboxes are reachable there only): an
  // app on another host refuses to start rather than spend every stage's attempts on them.
  let stopHostClaim = () => {};
  if (provider.name === "bubblewrap") {
    const holder = await claimSandboxHost(redis, config.prefix, provider.endpoint);
    if (holder !== null) {
      redis.disconnect();
      await provider.close?.();
      throw new Error(
        `this bubblewrap fleet's sandboxes are on ${holder}, not this host (${provider.endpoint}): a bubblewrap fleet runs on one host (packages/sandbox/README.md, "One host per fleet"); run this host's apps with a FLEET_PREFIX of their own, or stop the other host's (its claim lapses ${SANDBOX_HOST_CLAIM_MS / 1000} s after they stop)`,
      );
    }
    stopHostClaim = keepSandboxHost(redis, config.prefix, provider.endpoint, (other) =>
      logger.error(
        { host: provider.endpoint, other },
        "another host's bubblewrap apps took this fleet while this host's claim had lapsed (Redis out of reach too long): the two hosts' workers now fail each other's rollouts; stop one host's apps",
      ),
    );
  }
  const deps: PipelineDeps = {
    store: new RolloutStore(redis, config.prefix, { resultTtlMs: config.resultTtlMs, now: fleetClock.now }),
    ledger: new TeardownLedger(redis, config.prefix),
    queues: new StageQueues(redis, config.prefix),
    provider,
    logger,
    metrics,
    workerId,
    now: fleetClock.now,
    ...(config.sandboxCeiling ? { sandboxCeiling: config.sandboxCeiling } : {}),
    ...(config.gatewayMaxCallsPerMinute ? { gatewayMaxCallsPerMinute: config.gatewayMaxCallsPerMinute } : {}),
    // Sealed per-rollout networks for agents that get a model (needs root/NET_ADMIN and a local daemon).
    networks:
      config.sandboxProvider === "docker"
        ? new DockerGatewayNetworks({
            docker,
            scope: config.prefix,
            instance,
            subnetPool: config.gatewaySubnetPool ?? undefined,
          })
        : undefined,
    harnessDeps: {
      resolveCredential: createCredentialResolver({
        env,
        file: config.credentialsFile ?? null,
        known: knownSecrets,
        // What a rollout's reason leaves out (the file changed since the start's check).
        onRefused: (why) => logger.error({ file: config.credentialsFile }, `FLEET_CREDENTIALS_FILE: ${why}`),
      }),
      modelEndpoints: config.modelBaseUrls ?? null,
    },
  };
  // A Queue re-emits its connection's errors; unheard, BullMQ prints each one raw to stderr.
  for (const queue of Object.values(deps.queues.queues)) queue.on("error", () => undefined);
  const server =
    config.metricsPort !== null
      ? await startMetricsServer({ registry, port: config.metricsPort, host: config.metricsHost }).catch(
          portInUse(
            "FLEET_METRICS_PORT",
            config.metricsPort,
            config.metricsHost ?? "127.0.0.1",
            ": each replica on a host needs a port of its own (0 picks a free one)",
            "FLEET_METRICS_HOST",
          ),
        )
      : null;
  if (server) logger.info({ port: server.port }, "metrics server listening");
  const heartbeat = setInterval(() => metrics.workerHeartbeat.set({ worker: app }, Date.now() / 1000), 5000);
  heartbeat.unref();
  metrics.workerHeartbeat.set({ worker: app }, Date.now() / 1000);
  const shutdown = async () => {
    clearInterval(heartbeat);
    stopHostClaim();
    await server?.close();
    await deps.queues.close();
    await provider.close?.();
    redis.disconnect();
  };
  return { deps, redis, logger, shutdown };
}

/**
 * Wait at start until the sandbox provider answers (`list`), for at most `waitMs`, retrying
 * with backoff: a worker that cannot reach its sandboxes must not take stage jobs, or every
 * rollout it takes is retried and then masked `provider_unavailable` (a compose file run without
 * DOCKER_HOST or the socket override, a wrong DOCKER_HOST, a bubblewrap host without the rootfs).
 * Throws `ProviderUnreachableError` saying what to check once the wait is over.
 */
export async function waitForProvider(
  provider: PipelineDeps["provider"],
  logger: PipelineDeps["logger"],
  waitMs: number,
  options: {
    hint?: string;
    callTimeoutMs?: number;
    now?: () => number;
    /** Told once, when the first attempt fails (e.g. to export the provider as down meanwhile). */
    onDown?: () => void;
  } = {},
): Promise<void> {
  const now = options.now ?? Date.now;
  const end = now() + waitMs;
  let delayMs = 250;
  for (let attempt = 1; ; attempt++) {
    const callTimeoutMs = options.callTimeoutMs ?? 10_000;
    const message = await providerProblem(provider, callTimeoutMs);
    if (message === null) {
      if (attempt > 1) logger.info({ provider: provider.name, attempt }, "sandbox provider reachable");
      return;
    }
    if (now() + delayMs > end) {
      throw new ProviderUnreachableError(
        `cannot reach the ${provider.name} sandbox provider at ${provider.endpoint} after ${attempt} attempt(s) in ${Math.round(waitMs / 1000)} s: ${message}${options.hint ? `. ${options.hint}` : ""}`,
      );
    }
    if (attempt === 1) {
      options.onDown?.();
      logger.warn(
        { provider: provider.name, endpoint: provider.endpoint, err: message, waitMs },
        "sandbox provider not reachable yet; no stage job is taken until it is",
      );
    }
    await new Promise((r) => setTimeout(r, delayMs));
    delayMs = Math.min(delayMs * 2, 5_000);
  }
}

export class ProviderUnreachableError extends Error {
  override readonly name = "ProviderUnreachableError";
}

const PROVIDER_HINT: Record<Common["sandboxProvider"], string> = {
  docker:
    "Set DOCKER_HOST to the daemon (unix:///var/run/docker.sock, or tcp://host:2376 with DOCKER_CERT_PATH); under docker compose add -f docker-compose.sandbox-host.yml (FLEET_SANDBOX_DOCKER_HOST, FLEET_SANDBOX_DOCKER_CERT_DIR) or -f docker-compose.docker-socket.yml, and do not export DOCKER_HOST (compose would deploy the fleet itself there)",
  bubblewrap: "Check FLEET_BWRAP_ROOTFS and FLEET_STATE_DIR, and that bwrap is installed",
};

/**
 * `waitForProvider` for an app at start: on failure logs why, releases everything, exit code 1.
 * Meanwhile `fleet_sandbox_provider_up` is 0, and 1 once the provider answers (the stage
 * workers' breaker keeps it from then on). The janitor does not wait: `watchProvider`.
 */
export async function providerReady(
  deps: PipelineDeps,
  config: Pick<Common, "sandboxProvider"> & {
    /** `FLEET_PROVIDER_WAIT_MS` (stage workers only). */
    providerWaitMs: number;
  },
  logger: PipelineDeps["logger"],
  shutdown: () => Promise<void>,
): Promise<boolean> {
  let wentDown = false;
  try {
    await waitForProvider(deps.provider, logger, config.providerWaitMs, {
      hint: PROVIDER_HINT[config.sandboxProvider],
      // Its heartbeat is fresh meanwhile: without this, no alert would see the worker is idle
      // for want of its sandboxes (FleetSandboxProviderDown).
      onDown: () => {
        wentDown = true;
        deps.metrics?.sandboxProviderUp.set(0);
      },
    });
    if (wentDown) deps.metrics?.sandboxProviderUp.set(1);
    return true;
  } catch (err) {
    logger.error({ err: (err as Error).message }, "refusing to start: no sandbox provider");
    await shutdown();
    process.exitCode = 1;
    return false;
  }
}

/**
 * Bounded graceful stop on SIGTERM/SIGINT: `stop` gets `timeoutMs` minus a moment for closing
 * connections, and the process exits within `timeoutMs` whatever happens. A second signal
 * exits at once (one within a second of the first is taken for the same one, sent twice).
 */
function onSignals(
  logger: PipelineDeps["logger"],
  stop: (budgetMs: number) => Promise<void>,
  timeoutMs: number,
): void {
  let stopping = false;
  let stoppingSince = 0;
  const handler = (signal: string) => {
    // Not the same Ctrl-C come again (`npm start` passes on the SIGINT the terminal sent it too).
    if (stopping && !isRepeatedSignal(stoppingSince)) process.exit(1);
    if (stopping) return;
    stopping = true;
    stoppingSince = Date.now();
    logger.info({ signal, timeoutMs }, "shutting down");
    const force = setTimeout(() => {
      logger.error({ timeoutMs }, "graceful shutdown timed out; exiting");
      process.exit(1);
    }, timeoutMs);
    force.unref();
    stop(Math.max(1, timeoutMs - Math.min(2_000, Math.floor(timeoutMs / 5)))).then(
      () => {
        logger.info("stopped");
        process.exit(0);
      },
      (err: unknown) => {
        logger.error({ err: String(err) }, "shutdown failed");
        process.exit(1);
      },
    );
  };
  process.on("SIGTERM", () => handler("SIGTERM"));
  process.on("SIGINT", () => handler("SIGINT"));
}

/**
 * fleet_rollouts_finished_total from 0 for every status/failure_kind pair a close can report, so
 * increase() (the masked- and failed-ratio alerts) sees each pair's first rollout: in the
 * processes that finalize rollouts (the close stage's workers, and the janitor, which closes
 * those whose close jobs keep failing: `closeWithoutDestroys`).
 */
function countFinishedFromZero(deps: PipelineDeps): void {
  if (!deps.metrics) return;
  deps.metrics.rolloutsFinished.inc({ status: "completed", failure_kind: "none" }, 0);
  for (const failureKind of FailureKind.options) {
    deps.metrics.rolloutsFinished.inc({ status: statusFor(failureKind), failure_kind: failureKind }, 0);
  }
}

/**
 * What a verifier says at start of the sandboxes' kernel when it lets the agent's code that the
 * tests run tamper with the tests' own processes (`risk`, from `testsTamperRisk`; null: it does
 * not): a warning, or with `FLEET_REQUIRE_PTRACE_SCOPE` (`required`) a refusal to start. Checked
 * on this host, which is the sandboxes' for bubblewrap and a local Docker daemon; a remote
 * daemon's host (`remoteEndpoint`) is not seen from here, so it is named for the operator to check.
 */
export function testsTamperCheck(
  risk: string | null,
  required: boolean,
  remoteEndpoint: string | null,
): { refuse: string } | { warn: string } | null {
  if (risk === null) return null;
  const where =
    remoteEndpoint !== null
      ? "this host's kernel (check the Docker daemon's host too)"
      : "the sandboxes' kernel";
  const fix =
    'set kernel.yama.ptrace_scope=1 on every sandbox host (packages/tasks/README.md, "What tests cannot stop")';
  if (required) {
    return {
      refuse: `FLEET_REQUIRE_PTRACE_SCOPE is set and ${where}: ${risk}, so the agent's code that a task's tests run could force a pass: ${fix}`,
    };
  }
  return {
    warn: `${where}: ${risk}. The agent's code that a task's tests run (as root, like the tests) can then trace or write the memory of the tests' own processes and force a pass: ${fix}`,
  };
}

/** The whole of a stage worker app's `main.ts`. */
export async function runWorkerApp(kind: WorkerKind, env: Env): Promise<void> {
  const config = parseWorkerConfig(kind, env);
  // Only the agent worker resolves credentials (its harnesses' model calls).
  if (kind === "agent" && config.credentialsFile) await checkCredentialsFile(config.credentialsFile);
  const workerId = config.workerId ?? `${kind}-${hostname()}-${process.pid}-${randomUUID().slice(0, 8)}`;
  const { deps, redis, logger, shutdown } = await buildDeps(`${kind}-worker`, config, workerId, env);
  const risk = kind === "verifier" ? testsTamperRisk() : null;
  const dockerEndpoint =
    deps.provider.name === "docker" && !deps.provider.endpoint.startsWith("unix://")
      ? deps.provider.endpoint
      : null;
  const tamper = testsTamperCheck(risk, config.requirePtraceScope, dockerEndpoint);
  if (tamper !== null && "refuse" in tamper) {
    await shutdown();
    throw new Error(tamper.refuse);
  }
  if (!(await providerReady(deps, config, logger, shutdown))) return;
  const workers = createStageWorkers(STAGES_OF[kind], deps, {
    connection: redis,
    prefix: config.prefix,
    concurrency: config.concurrency,
    lockDurationMs: config.lockDurationMs,
    stalledIntervalMs: config.stalledIntervalMs,
    providerBreaker:
      config.providerProbeMs === null ? false : { probeMs: config.providerProbeMs, callTimeoutMs: 5_000 },
    seedAhead: config.seedAhead === null ? false : { ...DEFAULT_SEED_AHEAD, min: config.seedAhead },
    // Every worker, the supervisor's replacements included (job ids are `<rolloutId>.<stage>`).
    onWorker: (worker) => countStalledJobs(worker, deps, "a stage job stalled; it is delivered again"),
  });
  if (STAGES_OF[kind].includes("close")) countFinishedFromZero(deps);
  if (tamper !== null && "warn" in tamper) {
    logger.warn({ risk, ...(dockerEndpoint !== null ? { dockerEndpoint } : {}) }, tamper.warn);
  }
  // The handlers first, then the line that says it started: a Ctrl-C sent on that line (as a
  // supervisor or a test may) must find them (without them SIGINT kills the process outright).
  onSignals(
    logger,
    async (budgetMs) => {
      const { closed, abandoned } = await workers.close(budgetMs);
      await shutdown();
      // Not a clean stop: a supervisor must not take it for one (exit 1).
      if (!closed) {
        throw new Error(
          abandoned > 0
            ? `${abandoned} stage job(s) still ran when the shutdown budget (FLEET_SHUTDOWN_TIMEOUT_MS) ran out and were not handed back; each is delivered again once its lock lapses`
            : "the workers did not close within the shutdown budget (FLEET_SHUTDOWN_TIMEOUT_MS; is Redis reachable?): a job whose end Redis did not record is delivered again once its lock lapses",
        );
      }
    },
    config.shutdownTimeoutMs,
  );
  logger.info({ kind, workerId, stages: STAGES_OF[kind], concurrency: config.concurrency }, "worker started");
}

/** The whole of the janitor app's `main.ts`. */
export async function runJanitorApp(env: Env): Promise<void> {
  const config = parseConfig(JanitorConfig, env);
  const workerId = `janitor-${hostname()}-${process.pid}`;
  const { deps, redis, logger, shutdown } = await buildDeps("janitor", config, workerId, env);
  // Not `providerReady`: the janitor's watchdog, admissions and registry need only Redis, so it
  // starts without its provider (a daemon down, restarting, or a wrong DOCKER_HOST), says so
  // (fleet_sandbox_provider_up 0, a warning with what to check), and runs its sandbox steps once
  // the provider answers, probed with backoff.
  const providerGate = await watchProvider(deps, { hint: PROVIDER_HINT[config.sandboxProvider] });
  // A sandbox intent whose container never appeared: trusted as never created after the same
  // grace as an unknown labelled sandbox (the label sweep still catches a late create).
  deps.intentGraceMs = config.orphanGraceMs;
  countFinishedFromZero(deps);
  const janitor = await startJanitor(deps, {
    connection: redis,
    prefix: config.prefix,
    intervalMs: config.intervalMs,
    orphanGraceMs: config.orphanGraceMs,
    providerGate,
  });
  // The handlers first, then the line that says it started (see the worker app's).
  onSignals(
    logger,
    async (budgetMs) => {
      providerGate.stop();
      await janitor.close(budgetMs);
      await shutdown();
    },
    config.shutdownTimeoutMs,
  );
  logger.info({ intervalMs: config.intervalMs, providerUp: providerGate.up }, "janitor started");
}
