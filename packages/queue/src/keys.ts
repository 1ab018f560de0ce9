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
  task(digest: string): string;
  idempotency(keyHash: string): string;
  /** Sorted set of non-terminal rollouts, scored by deadline (epoch ms). */
  inflight(): string;
  /** Hash of live sandbox intents/handles: `<rolloutId>:<owner>` → JSON. */
  sandboxes(): string;
  /** Teardown ledger: due-time sorted set and its entries. */
  teardownDue(): string;
  teardownEntries(): string;
}

export function createKeys(prefix = "{fleet}"): Keys {
  if (!/^\{[^{}]+\}/.test(prefix)) {
    throw new Error(`queue prefix ${JSON.stringify(prefix)} must start with a hash tag such as "{fleet}"`);
  }
  const k = (...parts: string[]) => [prefix, "x", ...parts].join(":");
  return {
    prefix,
    rollout: (id) => k("rollout", id),
    failures: (id) => k("rollout", id, "failures"),
    batch: (id) => k("batch", id),
    batchIds: (id) => k("batch", id, "ids"),
    task: (digest) => k("task", digest),
    idempotency: (keyHash) => k("idem", keyHash),
    inflight: () => k("inflight"),
    sandboxes: () => k("sandboxes"),
    teardownDue: () => k("teardown", "due"),
    teardownEntries: () => k("teardown", "entries"),
  };
}
