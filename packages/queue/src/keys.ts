import { randomUUID } from "node:crypto";
import type { RedisConnection } from "./connection.ts";
import { withScripts } from "./scripts.ts";

/**
 * Every Redis key the fleet owns, under one hash-tagged prefix (e.g. `{fleet}`) so that all of
 * them land in one Redis Cluster slot and multi-key Lua scripts stay legal.
 */
export interface Keys {
  readonly prefix: string;
  rollout(id: string): string;
  failures(id: string): string;
  batch(id: string): string;
  batchIds(id: string): string;
  /** A batch's finished rollouts in the order they finished (the results cursor's list). */
  batchDone(id: string): string;
  task(digest: string): string;
  idempotency(keyHash: string): string;
  /** Sorted set of non-terminal rollouts, scored by deadline (epoch ms). */
  inflight(): string;
  /**
   * Rollouts the deadline watchdog took out of `inflight` because their record cannot be read
   * (torn, or gone), scored by their deadline: kept for an operator, their record untouched.
   */
  unreadable(): string;
  /** Backlog reservations of submissions being admitted: `<id>:<count>`, scored by expiry. */
  reservations(): string;
  /**
   * Admissions under way (`b:<batchId>`, `r:<rolloutId>`), scored by when they began: one whose
   * dispatcher died before it enqueued its seeds stays here, and the janitor finishes it.
   */
  admitting(): string;
  /**
   * Batch cancels under way (batch ids), scored by when their walker last noted progress: one
   * whose dispatcher died before it had asked every rollout to stop stays here, and the janitor
   * walks the batch again.
   */
  cancelling(): string;
  /** Never written: the fleet's clock is read (`TIME`) on the node that holds this key's slot. */
  clock(): string;
  /** Written (with a minute's TTL) at each metrics scrape, to see whether Redis takes writes. */
  writeProbe(): string;
  /** Hash of live sandbox intents/handles: `<rolloutId>:<owner>` → JSON. */
  sandboxes(): string;
  /**
   * Registry entries that did not parse and had nothing of their rollout left behind them,
   * retired by the janitor: `<rolloutId>:<owner>` → the entry as it was stored.
   */
  retiredSandboxes(): string;
  /** Teardown ledger: due-time sorted set and its entries. */
  teardownDue(): string;
  teardownEntries(): string;
  /** Gateway networks whose removal at close failed (rollout ids, scored by when): the janitor retries them. */
  networkRetries(): string;
  /** This deployment's id (`fleetInstance`), set by the first app to start against this Redis. */
  instance(): string;
  /** The host a bubblewrap fleet's sandboxes live on (`claimSandboxHost`), while its apps renew it. */
  sandboxHost(): string;
  /**
   * When the newest janitor pass ended (epoch ms, the fleet's clock), or, before any pass, when
   * the first janitor started: where a janitor's `fleet_janitor_last_pass_timestamp_seconds`
   * starts from, so a janitor restarted (one that dies in every pass, say) does not report its
   * start as a pass.
   */
  janitorLastPass(): string;
  /**
   * The seeds each resources worker process is making (field: the process's seed-ahead bound,
   * value: `<seeds>:<expiresAt>`, the fleet's clock), so that each process's bound counts the
   * others' (`RolloutStore.shareSeeding`).
   */
  seeding(): string;
  /**
   * The worker processes that consume `queue` (field: a process's worker id, value:
   * `1:<expiresAt>`, the fleet's clock), each said again while it lives and removed at its close
   * (`RolloutStore.sayWorkerPresent`): `fleet_queue_workers` where Redis refuses `CLIENT LIST`.
   */
  workers(queue: string): string;
}

export function createKeys(prefix = "{fleet}"): Keys {
  if (!/^\{[^{}]+\}/.test(prefix)) {
    throw new Error(`queue prefix ${JSON.stringify(prefix)} must start with a hash tag such as "{fleet}"`);
  }
  // Built on every stage's hot path: plain concatenation onto a fixed base.
  const x = `${prefix}:x:`;
  const inflight = `${x}inflight`;
  const unreadable = `${x}unreadable`;
  const reservations = `${x}reservations`;
  const admitting = `${x}admitting`;
  const cancelling = `${x}cancelling`;
  const clockKey = `${x}clock`;
  const writeProbe = `${x}write-probe`;
  const sandboxes = `${x}sandboxes`;
  const retiredSandboxes = `${x}sandboxes:retired`;
  const teardownDue = `${x}teardown:due`;
  const teardownEntries = `${x}teardown:entries`;
  const networkRetries = `${x}teardown:networks`;
  const instance = `${x}instance`;
  const sandboxHost = `${x}sandbox-host`;
  const janitorLastPass = `${x}janitor:last-pass`;
  const seeding = `${x}seeding`;
  return {
    prefix,
    rollout: (id) => `${x}rollout:${id}`,
    failures: (id) => `${x}rollout:${id}:failures`,
    batch: (id) => `${x}batch:${id}`,
    batchIds: (id) => `${x}batch:${id}:ids`,
    batchDone: (id) => `${x}batch:${id}:done`,
    task: (digest) => `${x}task:${digest}`,
    idempotency: (keyHash) => `${x}idem:${keyHash}`,
    inflight: () => inflight,
    unreadable: () => unreadable,
    reservations: () => reservations,
    admitting: () => admitting,
    cancelling: () => cancelling,
    clock: () => clockKey,
    writeProbe: () => writeProbe,
    sandboxes: () => sandboxes,
    retiredSandboxes: () => retiredSandboxes,
    teardownDue: () => teardownDue,
    teardownEntries: () => teardownEntries,
    networkRetries: () => networkRetries,
    instance: () => instance,
    sandboxHost: () => sandboxHost,
    janitorLastPass: () => janitorLastPass,
    seeding: () => seeding,
    workers: (queue) => `${x}workers:${queue}`,
  };
}

/**
 * This deployment's id, kept in its Redis (`keys.instance()`): made by the first app that asks
 * (every app asks at start; the first write wins) and the same for every app on this Redis ever
 * after. Sandboxes carry it (`fleet.instance`), so two fleets that share a key prefix, each with
 * its own Redis, on one Docker daemon tell their sandboxes apart. Redis emptied, the next start
 * makes a new one, and the janitor takes what was made before for another fleet's: removed when
 * it expires.
 */
export async function fleetInstance(
  redis: InstanceRedis,
  prefix: string,
  id: string = randomUUID(),
): Promise<string> {
  const key = createKeys(prefix).instance();
  await redis.set(key, id, "NX");
  const current = await redis.get(key);
  if (!current) throw new Error(`${key} was removed as it was read; start again`);
  return current;
}

type InstanceRedis = {
  set(key: string, value: string, nx: "NX"): Promise<unknown>;
  get(key: string): Promise<string | null>;
};

/**
 * Keep this app's deployment id in its Redis across reconnects: a Redis that lost its data
 * (restarted without its AOF) gets it back from the first app to reconnect (`fleetInstance` with
 * it), and an app that finds another there (a new app started first) has `onOther` called: its
 * sandboxes now read as another deployment's to the apps that hold the new one.
 */
export function keepFleetInstance(
  redis: InstanceRedis & { on(event: "ready", listener: () => void): unknown },
  prefix: string,
  id: string,
  onOther: (current: string) => void,
): void {
  redis.on("ready", () => {
    fleetInstance(redis, prefix, id).then(
      (current) => {
        if (current !== id) onOther(current);
      },
      () => undefined, // gone again: the next ready tries
    );
  });
}

/** How long a host's claim on a bubblewrap fleet lasts unless one of its apps renews it. */
export const SANDBOX_HOST_CLAIM_MS = 30_000;

/**
 * Claim this fleet's sandboxes for the host at `endpoint` (a bubblewrap host, `bwrap://<name>`), or
 * renew the claim: null when it is this host's, else the endpoint of the host that holds it. A
 * bubblewrap sandbox lives on the host that made it and no job is routed to it, so the apps of
 * one bubblewrap fleet must all run on one host: those of another host would spend every stage's
 * attempts on sandboxes they cannot reach (correct rollouts masked). A claim lapses
 * `ttlMs` after the last renewal (every app of the host renews it: `keepSandboxHost`).
 */
export async function claimSandboxHost(
  redis: RedisConnection,
  prefix: string,
  endpoint: string,
  ttlMs = SANDBOX_HOST_CLAIM_MS,
): Promise<string | null> {
  const held = await withScripts(redis).fleetHostClaim(createKeys(prefix).sandboxHost(), endpoint, ttlMs);
  return held === 1 ? null : String(held);
}

/**
 * Renew this host's claim (`claimSandboxHost`) every third of its life, until the returned stop
 * is called; `onOther` is told when another host holds it (this host's lapsed, through a Redis
 * outage longer than the claim, and another's apps started meanwhile).
 */
export function keepSandboxHost(
  redis: RedisConnection,
  prefix: string,
  endpoint: string,
  onOther: (holder: string) => void,
  ttlMs = SANDBOX_HOST_CLAIM_MS,
): () => void {
  const timer = setInterval(() => {
    claimSandboxHost(redis, prefix, endpoint, ttlMs).then(
      (holder) => {
        if (holder !== null) onOther(holder);
      },
      () => undefined, // Redis away: the next renewal tries
    );
  }, ttlMs / 3);
  timer.unref();
  return () => clearInterval(timer);
}
