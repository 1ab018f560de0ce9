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
  const sandboxes = `${x}sandboxes`;
  const retiredSandboxes = `${x}sandboxes:retired`;
  const teardownDue = `${x}teardown:due`;
  const teardownEntries = `${x}teardown:entries`;
  const networkRetries = `${x}teardown:networks`;
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
    sandboxes: () => sandboxes,
    retiredSandboxes: () => retiredSandboxes,
    teardownDue: () => teardownDue,
    teardownEntries: () => teardownEntries,
    networkRetries: () => networkRetries,
  };
}
