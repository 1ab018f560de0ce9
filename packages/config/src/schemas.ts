import {
  DEFAULT_SANDBOX_SIZES,
  ProviderName,
  SANDBOX_CEILING_VARS,
  type SandboxCeiling,
} from "@fleet/contracts";
import { z } from "zod";
import {
  apiTokensVar,
  boolVar,
  dispatcherUrlProblem,
  durationMsVar,
  intVar,
  LogLevel,
  numberVar,
  portVar,
  redisUrlVar,
  urlVar,
  wordVar,
} from "./env.ts";

/** Default for every app's Redis connection. */
export const DEFAULT_REDIS_URL = "redis://127.0.0.1:6379";
/** Hash-tagged so every key of the fleet lands in one Redis Cluster slot. */
export const DEFAULT_PREFIX = "{fleet}";
export const DEFAULT_HTTP_PORT = 8080;
export const DEFAULT_HOST = "127.0.0.1";
export const DEFAULT_DISPATCHER_URL = `http://${DEFAULT_HOST}:${DEFAULT_HTTP_PORT}`;
export const DEFAULT_MAX_BACKLOG = 100_000;
export const DEFAULT_MAX_TASK_BYTES = 10 * 1024 * 1024;
/** Room for a 10 MiB task inline in one request, JSON escaping included; the CLI sends at most 8 MiB. */
export const DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024;
/**
 * Largest `application/json` body of `POST /v1/batches` (a JSON batch is parsed in one go, which
 * holds the event loop; NDJSON is read line by line). Twice the JSON body the `fleet` CLI sends
 * (it sends NDJSON past 1 MiB).
 */
export const DEFAULT_MAX_JSON_BATCH_BYTES = 2 * 1024 * 1024;
/**
 * How long the dispatcher waits for a whole request (headers and body) to arrive: Node's own
 * default, which Fastify would otherwise turn off. @defaultValue 5 minutes
 */
export const DEFAULT_HTTP_REQUEST_TIMEOUT_MS = 300_000;
export const DEFAULT_SHUTDOWN_TIMEOUT_MS = 30_000;
export const DEFAULT_JANITOR_INTERVAL_MS = 10_000;
export const DEFAULT_ORPHAN_GRACE_MS = 120_000;
export const DEFAULT_PROVIDER_WAIT_MS = 60_000;
/** Below these a lock or sweep is a typo (seconds given as ms): a 30 ms lock lapses on a GC pause. */
const MIN_LOCK_DURATION_MS = 1000;
const MIN_STALLED_INTERVAL_MS = 1000;
const MIN_JANITOR_INTERVAL_MS = 100;

export const WorkerKind = z.enum(["resources", "agent", "verifier"]);
export type WorkerKind = z.infer<typeof WorkerKind>;

/** Stage jobs a worker of each kind runs at once, unless `FLEET_CONCURRENCY` says otherwise. */
export const DEFAULT_CONCURRENCY: Readonly<Record<WorkerKind, number>> = {
  resources: 8,
  agent: 8,
  verifier: 8,
};

/** Finished rollouts are kept a week by default (`FLEET_RESULT_TTL_S`), at most ten years. */
export const DEFAULT_RESULT_TTL_S = 7 * 24 * 3600;
const MAX_RESULT_TTL_S = 10 * 365 * 24 * 3600;
const MIN_RESULT_TTL_S = 2 * 24 * 3600;

const common = {
  REDIS_URL: redisUrlVar().default(DEFAULT_REDIS_URL),
  // One hash tag first, so that every key of the fleet hashes to one Redis Cluster slot (the
  // queue's own check, said here with the variable's name).
  FLEET_PREFIX: wordVar()
    .regex(/^\{[^{}]+\}/, 'must start with a hash tag in braces, such as "{fleet}" or "{fleet}:eval"')
    .default(DEFAULT_PREFIX),
  FLEET_LOG_LEVEL: z.string().trim().toLowerCase().pipe(LogLevel).default("info"),
  FLEET_SHUTDOWN_TIMEOUT_MS: durationMsVar().default(DEFAULT_SHUTDOWN_TIMEOUT_MS),
  /**
   * Retention of finished rollouts, in seconds: 0 (keep for good) or at least two days, longer
   * than BullMQ keeps a finished job (a day): a rollout admitted again under its key after it
   * expired must not find its old seed job still there (BullMQ would skip the new one).
   */
  FLEET_RESULT_TTL_S: intVar(0, MAX_RESULT_TTL_S)
    .refine((s) => s === 0 || s >= MIN_RESULT_TTL_S, {
      message: `must be 0 (keep for good) or at least ${MIN_RESULT_TTL_S} (two days)`,
    })
    .default(DEFAULT_RESULT_TTL_S),
  /**
   * Start on a Redis whose AOF is not fsynced before each reply (`appendfsync everysec`, Redis's
   * default, or `no`). A crash of its host then loses the last second or two of acknowledged
   * writes: rollouts answered 202 come back 404, finished ones are decided again (a reward
   * reported and then retracted, or a verification run twice at once and graded 0). Off: the
   * apps refuse such a Redis (`assertRedisDurable`).
   */
  FLEET_REDIS_ACCEPT_WRITE_LOSS: boolVar().default(false),
  /**
   * For a Redis over TLS (`rediss://`, `rediss-cluster://`, `rediss-sentinel://`) whose
   * certificate a private CA signed: a PEM file of the CAs to trust for it, in place of Node's
   * public roots. Read at start.
   */
  FLEET_REDIS_TLS_CA_FILE: z.string().trim().optional(),
  /**
   * The client certificate (PEM) the apps present to a Redis over TLS that asks for one
   * (`tls-auth-clients yes`, Redis's default), and its private key: both or neither.
   */
  FLEET_REDIS_TLS_CERT_FILE: z.string().trim().optional(),
  FLEET_REDIS_TLS_KEY_FILE: z.string().trim().optional(),
  /**
   * For an encrypted FLEET_REDIS_TLS_KEY_FILE: a file whose first line is its passphrase (as
   * openssl's `-passin file:`). Read at start.
   */
  FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: z.string().trim().optional(),
  /**
   * How often the apps read the TLS files above again, to take a rotated certificate (or CA, or
   * key) without a restart: from each connection's next connect.
   */
  FLEET_REDIS_TLS_RELOAD_MS: durationMsVar(100).default(60_000),
};

/**
 * The most a task's `sandbox` options may ask (each unset: the request schema's own bound). The
 * dispatcher refuses a request over one with a 422; a worker fails a rollout over its own (one
 * admitted by a dispatcher configured otherwise) as `invalid_task`, before it makes a sandbox. At
 * least the sandbox's default, which every sandbox gets when its task asks nothing.
 */
const ceilingVar = (key: keyof typeof SANDBOX_CEILING_VARS, max: number, whole = true) => {
  const min = DEFAULT_SANDBOX_SIZES[key];
  const message = `must be a ${whole ? "whole " : ""}number from ${min} (the sandbox default, which a task asking nothing gets) to ${max}`;
  return (whole ? intVar(min, max, message) : numberVar(min, max, message)).optional();
};
const ceiling = {
  [SANDBOX_CEILING_VARS.memoryMb]: ceilingVar("memoryMb", 65_536),
  [SANDBOX_CEILING_VARS.cpus]: ceilingVar("cpus", 64, false),
  [SANDBOX_CEILING_VARS.pidsLimit]: ceilingVar("pidsLimit", 32_768),
  [SANDBOX_CEILING_VARS.diskMb]: ceilingVar("diskMb", 1_048_576),
  [SANDBOX_CEILING_VARS.tmpfsMb]: ceilingVar("tmpfsMb", 65_536),
} as const;

function ceilingConfig(e: Record<string, unknown>): SandboxCeiling {
  const out: SandboxCeiling = {};
  for (const [key, name] of Object.entries(SANDBOX_CEILING_VARS) as [keyof SandboxCeiling, string][]) {
    const value = e[name];
    if (typeof value === "number") out[key] = value;
  }
  return out;
}

/**
 * How an app reaches the sandbox provider: the workers, which make sandboxes, and the janitor,
 * which lists and destroys them (bubblewrap's listing checks the rootfs too).
 */
const sandbox = {
  FLEET_SANDBOX_PROVIDER: z
    .string()
    .trim()
    .toLowerCase()
    .pipe(z.enum(ProviderName.options, { error: `must be one of ${ProviderName.options.join(", ")}` }))
    .default("docker"),
  DOCKER_HOST: z.string().trim().optional(),
  /** TLS to a remote daemon: the directory with ca.pem, cert.pem, key.pem (as Docker's client). */
  DOCKER_CERT_PATH: z.string().trim().optional(),
  /** bubblewrap: the unpacked base rootfs directory (see packages/sandbox/README.md). */
  FLEET_BWRAP_ROOTFS: z.string().trim().optional(),
  /** Local state (bubblewrap sandboxes live under `<dir>/bwrap`). */
  FLEET_STATE_DIR: z.string().trim().default("/var/lib/rollout-fleet"),
};

/**
 * Only the stage workers' (which make sandboxes): not in the janitor's schema, so that a bad
 * value is refused by the workers that read it, not by a janitor that never does (it neither
 * waits for its provider at start, `watchProvider`, nor makes a sandbox).
 */
const workerSandbox = {
  ...ceiling,
  /** At start, how long to wait for the sandbox provider to answer before exiting 1. */
  FLEET_PROVIDER_WAIT_MS: durationMsVar().default(DEFAULT_PROVIDER_WAIT_MS),
};

const metrics = {
  /** Unset: no metrics server. `0`: a free port (logged). */
  FLEET_METRICS_PORT: portVar().optional(),
  FLEET_METRICS_HOST: wordVar().default(DEFAULT_HOST),
};

/**
 * `a.b.c.d/n`, each octet 0–255, n from 8 to 29: a gateway network is at most a /29
 * (`FLEET_GATEWAY_SUBNET_PREFIX`), so a smaller pool could hold none.
 */
function isPoolCidr(value: string): boolean {
  const m = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})\/(\d{1,2})$/.exec(value);
  if (!m) return false;
  const bits = Number(m[5]);
  return m.slice(1, 5).every((o) => Number(o) <= 255) && bits >= 8 && bits <= 29;
}

/** bubblewrap runs sandboxes from an unpacked rootfs: without one a worker could make none. */
function bwrapNeedsRootfs(
  e: { FLEET_SANDBOX_PROVIDER: string; FLEET_BWRAP_ROOTFS?: string | undefined },
  ctx: z.RefinementCtx,
): void {
  if (e.FLEET_SANDBOX_PROVIDER === "bubblewrap" && !e.FLEET_BWRAP_ROOTFS) {
    ctx.addIssue({
      code: "custom",
      path: ["FLEET_BWRAP_ROOTFS"],
      message:
        "must be set with FLEET_SANDBOX_PROVIDER=bubblewrap: the unpacked base rootfs directory (see packages/sandbox/README.md)",
    });
  }
}

/**
 * A TLS file for Redis with a URL that speaks no TLS: the operator meant TLS, and would get plain
 * TCP without a word. Refused; so is a client certificate without its key, or a key without it.
 */
function redisTlsNeedsTls(
  e: {
    REDIS_URL: string;
    FLEET_REDIS_TLS_CA_FILE?: string | undefined;
    FLEET_REDIS_TLS_CERT_FILE?: string | undefined;
    FLEET_REDIS_TLS_KEY_FILE?: string | undefined;
    FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE?: string | undefined;
  },
  ctx: z.RefinementCtx,
): void {
  const tls = /^rediss(?:-cluster|-sentinel)?:\/\//i.test(e.REDIS_URL);
  for (const name of [
    "FLEET_REDIS_TLS_CA_FILE",
    "FLEET_REDIS_TLS_CERT_FILE",
    "FLEET_REDIS_TLS_KEY_FILE",
    "FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE",
  ] as const) {
    if (e[name] && !tls) {
      ctx.addIssue({
        code: "custom",
        path: [name],
        message:
          "is set, but REDIS_URL speaks no TLS: use rediss://, rediss-cluster:// or rediss-sentinel://, or unset it",
      });
    }
  }
  // A certificate without its key (or a key without its certificate) authenticates nothing.
  if (!e.FLEET_REDIS_TLS_CERT_FILE !== !e.FLEET_REDIS_TLS_KEY_FILE) {
    ctx.addIssue({
      code: "custom",
      path: [e.FLEET_REDIS_TLS_CERT_FILE ? "FLEET_REDIS_TLS_KEY_FILE" : "FLEET_REDIS_TLS_CERT_FILE"],
      message:
        "must be set with the other: FLEET_REDIS_TLS_CERT_FILE and FLEET_REDIS_TLS_KEY_FILE go together",
    });
  }
  // A passphrase with no key to open.
  if (e.FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE && !e.FLEET_REDIS_TLS_KEY_FILE) {
    ctx.addIssue({
      code: "custom",
      path: ["FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE"],
      message: "is set without FLEET_REDIS_TLS_KEY_FILE, the encrypted key it opens",
    });
  }
}

function commonConfig(e: z.output<z.ZodObject<typeof common>>) {
  return {
    redisUrl: e.REDIS_URL,
    prefix: e.FLEET_PREFIX,
    logLevel: e.FLEET_LOG_LEVEL,
    shutdownTimeoutMs: e.FLEET_SHUTDOWN_TIMEOUT_MS,
    resultTtlMs: e.FLEET_RESULT_TTL_S * 1000,
    acceptRedisWriteLoss: e.FLEET_REDIS_ACCEPT_WRITE_LOSS,
    // Empty is unset (compose passes `${VAR:-}` through).
    redisTlsCaFile: e.FLEET_REDIS_TLS_CA_FILE || null,
    redisTlsCertFile: e.FLEET_REDIS_TLS_CERT_FILE || null,
    redisTlsKeyFile: e.FLEET_REDIS_TLS_KEY_FILE || null,
    redisTlsKeyPassphraseFile: e.FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE || null,
    redisTlsReloadMs: e.FLEET_REDIS_TLS_RELOAD_MS,
  };
}

function sandboxAndMetricsConfig(e: z.output<z.ZodObject<typeof sandbox & typeof metrics>>) {
  return {
    sandboxProvider: e.FLEET_SANDBOX_PROVIDER,
    bwrapRootfs: e.FLEET_BWRAP_ROOTFS ?? null,
    stateDir: e.FLEET_STATE_DIR,
    // Empty is unset (compose passes `${DOCKER_HOST:-}` through).
    dockerHost: e.DOCKER_HOST || null,
    dockerCertPath: e.DOCKER_CERT_PATH || null,
    metricsPort: e.FLEET_METRICS_PORT ?? null,
    metricsHost: e.FLEET_METRICS_HOST,
  };
}

/** `apps/dispatcher`: the HTTP API. */
export const DispatcherConfig = z
  .object({
    ...common,
    FLEET_HTTP_PORT: portVar().default(DEFAULT_HTTP_PORT),
    FLEET_HTTP_HOST: wordVar().default(DEFAULT_HOST),
    FLEET_API_TOKENS: apiTokensVar().default(() => ({ tokens: [], adminTokens: [] })),
    FLEET_MAX_BACKLOG: intVar(1, 1_000_000_000).default(DEFAULT_MAX_BACKLOG),
    FLEET_MAX_TASK_BYTES: intVar(1, 512 * 1024 * 1024).default(DEFAULT_MAX_TASK_BYTES),
    FLEET_MAX_BODY_BYTES: intVar(1024, 1024 * 1024 * 1024).optional(),
    FLEET_MAX_JSON_BATCH_BYTES: intVar(1024, 1024 * 1024 * 1024).default(DEFAULT_MAX_JSON_BATCH_BYTES),
    FLEET_HTTP_REQUEST_TIMEOUT_MS: durationMsVar(1000).default(DEFAULT_HTTP_REQUEST_TIMEOUT_MS),
    ...ceiling,
  })
  .superRefine(redisTlsNeedsTls)
  .transform((e) => ({
    ...commonConfig(e),
    httpPort: e.FLEET_HTTP_PORT,
    httpHost: e.FLEET_HTTP_HOST,
    apiTokens: e.FLEET_API_TOKENS,
    maxBacklog: e.FLEET_MAX_BACKLOG,
    maxTaskBytes: e.FLEET_MAX_TASK_BYTES,
    maxBodyBytes: e.FLEET_MAX_BODY_BYTES ?? defaultMaxBodyBytes(e.FLEET_MAX_TASK_BYTES),
    maxJsonBatchBytes: e.FLEET_MAX_JSON_BATCH_BYTES,
    requestTimeoutMs: e.FLEET_HTTP_REQUEST_TIMEOUT_MS,
    sandboxCeiling: ceilingConfig(e),
  }));

/**
 * `FLEET_MAX_BODY_BYTES` unset: 32 MiB, or a task at `FLEET_MAX_TASK_BYTES` plus 1 MiB for the
 * request around it when that is more (a raised task limit alone would otherwise meet a 413 for
 * the body).
 */
export function defaultMaxBodyBytes(maxTaskBytes: number): number {
  return Math.max(DEFAULT_MAX_BODY_BYTES, maxTaskBytes + 1024 * 1024);
}
export type DispatcherConfig = z.output<typeof DispatcherConfig>;

/**
 * The resources, agent and verifier workers. `FLEET_WORKER_KIND` is normally set by the app
 * itself (see `parseWorkerConfig`), not by the operator.
 */
export const WorkerConfig = z
  .object({
    ...common,
    ...sandbox,
    ...workerSandbox,
    ...metrics,
    FLEET_WORKER_KIND: z
      .string({ error: "must be set (resources, agent or verifier)" })
      .trim()
      .pipe(z.enum(WorkerKind.options, { error: `must be one of ${WorkerKind.options.join(", ")}` })),
    FLEET_WORKER_ID: wordVar().optional(),
    FLEET_CONCURRENCY: intVar(1, 10_000).optional(),
    /**
     * DESIGN §2 rule 4: no host fallback. This build has no host execution at all (model-directed
     * commands run only in Docker or bubblewrap sandboxes), so `true` asks for what cannot be
     * given: refused, rather than read and ignored. `false` (or unset) is accepted.
     */
    FLEET_ALLOW_HOST_EXECUTION: boolVar()
      .refine((allow) => !allow, {
        message:
          "must be false: this build has no host execution (model-directed commands run only in Docker or bubblewrap sandboxes, never on the host: DESIGN §2 rule 4); unset it",
      })
      .default(false),
    FLEET_CREDENTIALS_FILE: z.string().trim().optional(),
    /**
     * Agent worker: the model endpoints (comma-separated base URLs) a tool-loop agent naming no
     * credential may call from the worker's host. Unset: any (a credential's own binding still
     * limits where it goes; a link-local host is always refused).
     */
    FLEET_MODEL_BASE_URLS: z
      .string()
      .trim()
      .transform((v) =>
        v
          .split(",")
          .map((u) => u.trim())
          .filter((u) => u !== ""),
      )
      .pipe(
        z
          .array(z.url({ protocol: /^https?$/, error: "must be comma-separated http(s) URLs" }))
          .min(1, "must name at least one URL"),
      )
      .optional(),
    /**
     * Agent worker: calls a command agent's model gateway forwards per rollout in any 60 s (past
     * it, 429 `rate_limited` with Retry-After): one rollout cannot by itself exhaust the
     * operator's key's request rate.
     */
    FLEET_GATEWAY_MAX_CALLS_PER_MINUTE: intVar(1, 1_000_000).default(120),
    /**
     * Agent worker: an IPv4 CIDR reserved for the per-rollout gateway networks of agents that
     * talk to a model (Docker's default pools hold only about 30 networks), each
     * `FLEET_GATEWAY_SUBNET_PREFIX` long. Unset: Docker's default pools.
     */
    FLEET_GATEWAY_SUBNET_POOL: z
      .string()
      .trim()
      .refine(isPoolCidr, "must be an IPv4 CIDR from /8 to /29, such as 10.213.0.0/16")
      .optional(),
    FLEET_GATEWAY_SUBNET_PREFIX: intVar(8, 29).default(28),
    /** A dead worker's job is handed to another after this (BullMQ lock). */
    FLEET_LOCK_DURATION_MS: durationMsVar(MIN_LOCK_DURATION_MS).default(30_000),
    FLEET_STALLED_INTERVAL_MS: durationMsVar(MIN_STALLED_INTERVAL_MS).default(15_000),
    /**
     * The provider breaker: while the sandbox provider does not answer, seed, run and verify
     * jobs are held (no attempt spent) and none is taken; it is asked again every
     * `FLEET_PROVIDER_PROBE_MS`. `false`: every failure spends an attempt.
     */
    FLEET_PROVIDER_BREAKER: boolVar().default(true),
    /**
     * Verifier worker: refuse to start (rather than warn) when this host's kernel lets the agent's
     * code that the tests run tamper with the tests' own processes (no Yama ptrace restriction):
     * grades from such a host can be forced to a pass.
     */
    FLEET_REQUIRE_PTRACE_SCOPE: boolVar().default(false),
    FLEET_PROVIDER_PROBE_MS: durationMsVar(100).default(2_000),
    /**
     * Resources worker: seeding pauses while at least this many rollouts (or as many as agents
     * are running, or take per half second, if more) are seeded and wait for an agent or a
     * verifier. `0`: no bound.
     */
    FLEET_SEED_AHEAD: intVar(0, 1_000_000).default(16),
  })
  .superRefine(bwrapNeedsRootfs)
  .superRefine(redisTlsNeedsTls)
  .superRefine((e, ctx) => {
    const bits = Number(e.FLEET_GATEWAY_SUBNET_POOL?.split("/")[1]);
    // Only for a pool that is one (a bad one is said once, as the pool's own error).
    const pool = e.FLEET_GATEWAY_SUBNET_POOL;
    if (pool && isPoolCidr(pool) && e.FLEET_GATEWAY_SUBNET_PREFIX < bits) {
      ctx.addIssue({
        code: "custom",
        path: ["FLEET_GATEWAY_SUBNET_PREFIX"],
        message: `must be at least the pool's own /${bits}`,
      });
    }
  })
  .transform((e) => ({
    ...commonConfig(e),
    kind: e.FLEET_WORKER_KIND,
    workerId: e.FLEET_WORKER_ID ?? null,
    ...sandboxAndMetricsConfig(e),
    providerWaitMs: e.FLEET_PROVIDER_WAIT_MS,
    sandboxCeiling: ceilingConfig(e),
    concurrency: e.FLEET_CONCURRENCY ?? DEFAULT_CONCURRENCY[e.FLEET_WORKER_KIND],
    credentialsFile: e.FLEET_CREDENTIALS_FILE ?? null,
    modelBaseUrls: e.FLEET_MODEL_BASE_URLS ?? null,
    gatewayMaxCallsPerMinute: e.FLEET_GATEWAY_MAX_CALLS_PER_MINUTE,
    gatewaySubnetPool: e.FLEET_GATEWAY_SUBNET_POOL
      ? { base: e.FLEET_GATEWAY_SUBNET_POOL, prefix: e.FLEET_GATEWAY_SUBNET_PREFIX }
      : null,
    lockDurationMs: e.FLEET_LOCK_DURATION_MS,
    stalledIntervalMs: e.FLEET_STALLED_INTERVAL_MS,
    providerProbeMs: e.FLEET_PROVIDER_BREAKER ? e.FLEET_PROVIDER_PROBE_MS : null,
    requirePtraceScope: e.FLEET_REQUIRE_PTRACE_SCOPE,
    seedAhead: e.FLEET_SEED_AHEAD === 0 ? null : e.FLEET_SEED_AHEAD,
  }));
export type WorkerConfig = z.output<typeof WorkerConfig>;

/**
 * `apps/janitor`: teardown ledger retries and sweeps. The provider's connection (it lists and
 * destroys sandboxes), not the workers' sandbox ceiling or provider wait, which it does not read.
 */
export const JanitorConfig = z
  .object({
    ...common,
    ...sandbox,
    ...metrics,
    FLEET_JANITOR_INTERVAL_MS: durationMsVar(MIN_JANITOR_INTERVAL_MS).default(DEFAULT_JANITOR_INTERVAL_MS),
    FLEET_ORPHAN_GRACE_MS: durationMsVar().default(DEFAULT_ORPHAN_GRACE_MS),
  })
  .superRefine(bwrapNeedsRootfs)
  .superRefine(redisTlsNeedsTls)
  .transform((e) => ({
    ...commonConfig(e),
    ...sandboxAndMetricsConfig(e),
    intervalMs: e.FLEET_JANITOR_INTERVAL_MS,
    orphanGraceMs: e.FLEET_ORPHAN_GRACE_MS,
  }));
export type JanitorConfig = z.output<typeof JanitorConfig>;

/** What an API token may hold: it is sent as an HTTP header value (`Authorization: Bearer …`). */
export const TOKEN_CHARS = /^[\x21-\x7e]+$/;

/** `apps/cli`: where the dispatcher is. Command-line flags override these. */
export const CliConfig = z
  .object({
    FLEET_URL: urlVar(["http:", "https:"])
      .superRefine((url, ctx) => {
        const problem = dispatcherUrlProblem(url);
        if (problem !== undefined) ctx.addIssue({ code: "custom", message: problem });
      })
      .default(DEFAULT_DISPATCHER_URL),
    FLEET_TOKEN: z
      .string()
      .trim()
      .regex(TOKEN_CHARS, "must be printable ASCII without spaces (it goes into an HTTP header)")
      .optional(),
  })
  .transform((e) => ({
    url: e.FLEET_URL.replace(/\/+$/, ""),
    token: e.FLEET_TOKEN ?? null,
  }));
export type CliConfig = z.output<typeof CliConfig>;
