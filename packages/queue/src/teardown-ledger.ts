import { CappedText, ProviderName, SandboxHandle } from "@fleet/contracts";
import { z } from "zod";
import type { RedisConnection } from "./connection.ts";
import { createKeys, type Keys } from "./keys.ts";
import type { DeliveryFence } from "./rollout-store.ts";
import { type ScriptedRedis, withScripts } from "./scripts.ts";

/** A sandbox the fleet intends to create or has created (its handle is null until created). */
export const SandboxEntry = z.object({
  key: z.string(),
  rolloutId: z.string(),
  owner: z.enum(["resources", "agent"]),
  provider: ProviderName,
  handle: SandboxHandle.nullable(),
  createdAt: z.number().int(),
  expiresAt: z.number().int(),
});
export type SandboxEntry = z.infer<typeof SandboxEntry>;

/** A teardown that failed and is retried by the janitor until confirmed. */
export const LedgerEntry = SandboxEntry.extend({
  attempts: z.number().int().nonnegative(),
  lastError: CappedText,
  firstFailedAt: z.number().int(),
  dueAt: z.number().int(),
});
export type LedgerEntry = z.infer<typeof LedgerEntry>;

/**
 * A rollout's two registry entries as close reads them. One that does not parse (torn, or
 * another release's shape in a rolling upgrade) is neither of them but is named in `unreadable`:
 * close cannot destroy it nor put it on the ledger, and must not report its teardown confirmed.
 */
export interface RolloutSandboxes {
  resources: SandboxEntry | null;
  agent: SandboxEntry | null;
  unreadable: SandboxEntry["owner"][];
}

/** `RolloutSandboxes` from the stored entries (null: none stored). */
export function readRolloutSandboxes(resources: string | null, agent: string | null): RolloutSandboxes {
  const out: RolloutSandboxes = { resources: null, agent: null, unreadable: [] };
  for (const [owner, raw] of [
    ["resources", resources],
    ["agent", agent],
  ] as const) {
    if (!raw) continue;
    let parsed: ReturnType<typeof SandboxEntry.safeParse> | null = null;
    try {
      parsed = SandboxEntry.safeParse(JSON.parse(raw));
    } catch {
      // Not JSON: torn.
    }
    if (parsed?.success) out[owner] = parsed.data;
    else out.unreadable.push(owner);
  }
  return out;
}

export function sandboxKey(rolloutId: string, owner: SandboxEntry["owner"]): string {
  return `${rolloutId}:${owner}`;
}

/** Which sandbox a ledger entry names (null: an intent, no sandbox yet). */
function handleId(handle: SandboxEntry["handle"]): string | null {
  return handle ? handle.id || `${handle.endpoint}/${handle.name}` : null;
}

/** Jittered exponential backoff for teardown retries: between half and all of base·2^n, capped. */
export function teardownBackoffMs(
  attempts: number,
  random = Math.random,
  baseMs = 2000,
  capMs = 300_000,
): number {
  const ceiling = Math.min(capMs, baseMs * 2 ** Math.min(attempts, 20));
  return Math.round(ceiling / 2 + (random() * ceiling) / 2);
}

/** A stored entry that does not parse: its key, and why. */
export type OnInvalidEntry = (key: string, err: Error) => void;

/** How long a due ledger entry that does not parse is put off before it is read again. */
export const INVALID_PUT_OFF_MS = 3_600_000;

function parseEntries<T>(
  schema: z.ZodType<T>,
  stored: readonly (readonly [string, string])[],
  onInvalid: OnInvalidEntry | undefined,
): T[] {
  return parseStored(schema, stored, onInvalid).map(([entry]) => entry);
}

/** `parseEntries`, each entry with the text it was parsed from. */
function parseStored<T>(
  schema: z.ZodType<T>,
  stored: readonly (readonly [string, string])[],
  onInvalid: OnInvalidEntry | undefined,
): [T, string][] {
  const entries: [T, string][] = [];
  for (const [key, raw] of stored) {
    try {
      entries.push([schema.parse(JSON.parse(raw)), raw]);
    } catch (err) {
      if (!onInvalid) throw err;
      onInvalid(key, err instanceof Error ? err : new Error(String(err)));
    }
  }
  return entries;
}

/** A due ledger entry and its text as stored when read (`dueToTake`), which `take` compares with. */
export interface DueEntry {
  entry: LedgerEntry;
  stored: string;
}

/** How long a failed gateway network removal waits before the janitor tries it again. */
export const NETWORK_RETRY_MS = 60_000;

/**
 * Sandbox intents (persisted before create, DESIGN §2 rule 9) and the teardown ledger
 * (failed destroys, retried by the janitor, rule 3). Both are durable in Redis.
 */
export class TeardownLedger {
  readonly keys: Keys;
  private readonly redis: ScriptedRedis;

  constructor(redis: RedisConnection, prefix = "{fleet}") {
    this.redis = withScripts(redis);
    this.keys = createKeys(prefix);
  }

  /**
   * Persist the intent to create a sandbox, atomically refused if the rollout was closed
   * (tombstone). Returns 'ok', 'closed' (a close already ran: do not create) or 'missing'.
   */
  async recordIntent(entry: SandboxEntry): Promise<"ok" | "closed" | "missing"> {
    const parsed = SandboxEntry.parse(entry);
    const r = String(
      await this.redis.fleetIntent(
        this.keys.rollout(parsed.rolloutId),
        this.keys.sandboxes(),
        parsed.key,
        JSON.stringify(parsed),
      ),
    );
    return r as "ok" | "closed" | "missing";
  }

  /** Attach the created handle to its intent. Returns true if the rollout was closed meanwhile. */
  async attachHandle(entry: SandboxEntry): Promise<boolean> {
    const closed = await this.redis.fleetAttach(
      this.keys.sandboxes(),
      this.keys.rollout(entry.rolloutId),
      entry.key,
      JSON.stringify(SandboxEntry.parse(entry)),
    );
    return closed === "1";
  }

  /** Both sandbox entries of a rollout (resources, agent) in one round trip. */
  async sandboxesOf(rolloutId: string): Promise<RolloutSandboxes> {
    const [r, a] = await this.redis.hmget(
      this.keys.sandboxes(),
      sandboxKey(rolloutId, "resources"),
      sandboxKey(rolloutId, "agent"),
    );
    return readRolloutSandboxes(r ?? null, a ?? null);
  }

  /** A registry entry as stored (null: none), for one that does not parse. */
  async rawSandbox(key: string): Promise<string | null> {
    return this.redis.hget(this.keys.sandboxes(), key);
  }

  /**
   * Retire a registry entry that does not parse (`raw`, as `rawSandbox` read it) once nothing of
   * its rollout is left (the caller checked the provider): moved as it is to
   * `keys.retiredSandboxes()`, and the rollout's finalized result's teardown confirmed if nothing
   * else of it is pending. Not when it changed since it was read, nor while the ledger has its key.
   * True if retired.
   */
  async retireUnreadable(key: string, raw: string, rolloutId: string): Promise<boolean> {
    const r = await this.redis.fleetRetireUnreadable(
      this.keys.sandboxes(),
      this.keys.retiredSandboxes(),
      this.keys.teardownEntries(),
      this.keys.rollout(rolloutId),
      this.keys.networkRetries(),
      key,
      raw,
      sandboxKey(rolloutId, "resources"),
      sandboxKey(rolloutId, "agent"),
      rolloutId,
    );
    return Number(r) === 1;
  }

  async getSandbox(key: string): Promise<SandboxEntry | null> {
    const raw = await this.redis.hget(this.keys.sandboxes(), key);
    return raw ? SandboxEntry.parse(JSON.parse(raw)) : null;
  }

  /**
   * Every sandbox registered. An entry that does not parse (torn, or another release's shape)
   * goes to `onInvalid` and is skipped, so it stops no sweep; without `onInvalid` it throws.
   */
  async listSandboxes(onInvalid?: OnInvalidEntry): Promise<SandboxEntry[]> {
    const all = await this.redis.hgetall(this.keys.sandboxes());
    return parseEntries(SandboxEntry, Object.entries(all), onInvalid);
  }

  /**
   * Destroy confirmed: forget the sandbox and any ledger entry for it, and if that was the
   * rollout's last teardown on the ledger, mark its finalized result's teardown confirmed.
   */
  async confirm(
    entry: Pick<SandboxEntry, "key" | "rolloutId">,
    /**
     * The sandbox whose destroy was confirmed (null: none was found). Given, only entries without
     * a handle or with this one are forgotten: one recorded meanwhile for a sandbox that replaced
     * it under the same key stays. Omitted: the key is forgotten whatever it holds.
     */
    destroyed?: SandboxHandle | null,
    options: {
      /**
       * Only while this delivery holds its stage's fence (a seed delivery dropping the intent its
       * begin recorded: once a later delivery began, the intent is that one's).
       */
      deliveryFence?: DeliveryFence;
    } = {},
  ): Promise<void> {
    const only = destroyed === undefined ? "" : destroyed === null || !destroyed.id ? "-" : destroyed.id;
    await this.redis.fleetConfirm(
      this.keys.sandboxes(),
      this.keys.teardownEntries(),
      this.keys.teardownDue(),
      this.keys.rollout(entry.rolloutId),
      this.keys.networkRetries(),
      entry.key,
      sandboxKey(entry.rolloutId, "resources"),
      sandboxKey(entry.rolloutId, "agent"),
      entry.rolloutId,
      only,
      ...(options.deliveryFence ? [options.deliveryFence.field, options.deliveryFence.token] : []),
    );
  }

  /**
   * Record a failed destroy (or re-failure) and schedule the next attempt; its entry, or null when
   * the destroy was confirmed meanwhile (by another close or janitor pass: the entry this call read,
   * of this sandbox, is gone, so the sandbox is, and nothing is recorded). Two failures of one sandbox recorded at
   * once count twice: the entry is written only if it is still the one read (`fleetLedgerWrite`),
   * else read again.
   */
  async recordFailure(
    entry: SandboxEntry,
    error: string,
    now: number,
    random = Math.random,
    options: {
      /**
       * The entry `take` wrote for this attempt, which counted it and scheduled the next: while it
       * is still the one stored, only its error is recorded (counted again, a retry would be put
       * off twice as long as its count says). Changed since (another failure recorded), this
       * failure is counted from what is stored, as any; gone, its sandbox's destroy was confirmed.
       */
      taken?: LedgerEntry;
    } = {},
  ): Promise<LedgerEntry | null> {
    let prevRaw = await this.redis.hget(this.keys.teardownEntries(), entry.key);
    if (options.taken) {
      // The entry taken is gone: only a confirmed destroy of its sandbox removes it (another pass's
      // or a close's), so nothing is left to record, as when it goes between a read and a write below.
      if (prevRaw === null) return null;
      const takenRaw = JSON.stringify(options.taken);
      if (prevRaw === takenRaw) {
        const ledger = LedgerEntry.parse({ ...options.taken, lastError: error });
        const written = await this.writeIf(entry.key, takenRaw, ledger);
        if (written === 1) return ledger;
        if (written === null) return null;
        prevRaw = written;
      }
    }
    for (let tries = 0; ; tries++) {
      // A torn entry (or one this release cannot read) under the key: this failure is recorded
      // over it, its count starting again, rather than throwing and leaving the failure
      // unrecorded (an orphan's destroy then retried every janitor pass, without backoff).
      const prev = prevRaw ? parseLedgerEntry(prevRaw) : null;
      const attempts = (prev?.attempts ?? 0) + 1;
      const ledger: LedgerEntry = LedgerEntry.parse({
        ...SandboxEntry.parse(entry),
        attempts,
        lastError: error,
        firstFailedAt: prev?.firstFailedAt ?? now,
        dueAt: now + teardownBackoffMs(attempts - 1, random),
      });
      const written = await this.writeIf(entry.key, prevRaw ?? "", ledger);
      if (written === 1) return ledger;
      // The entry read is gone: a destroy of its sandbox was confirmed. When it was this
      // sandbox's, nothing is left to record. Another's (the sandbox this one replaced under the
      // key, or an intent of none yet): this failure is recorded afresh.
      if (written === null && prev !== null && handleId(prev.handle) === handleId(entry.handle)) return null;
      // Changed under us more often than a handful of passes could: record over it, as before.
      if (tries >= 8) {
        await this.redis
          .multi()
          .hset(this.keys.teardownEntries(), entry.key, JSON.stringify(ledger))
          .zadd(this.keys.teardownDue(), ledger.dueAt, entry.key)
          .exec();
        return ledger;
      }
      prevRaw = written;
    }
  }

  /**
   * Put a sandbox on the ledger to be destroyed now (e.g. an orphan found by the janitor). One
   * already on it keeps its entry and backoff. True if this call put it there.
   */
  async schedule(entry: SandboxEntry, now: number): Promise<boolean> {
    const ledger = LedgerEntry.parse({
      ...entry,
      attempts: 0,
      lastError: "",
      firstFailedAt: now,
      dueAt: now,
    });
    // Only where there is no entry, in one step: a failure recorded since a look would be lost.
    return (await this.writeIf(entry.key, "", ledger)) === 1;
  }

  /**
   * Ledger entries due at `now`. One that does not parse goes to `onInvalid` (without it, throws)
   * and is put off by an hour, kept for a release that can read it: left due, a few of them
   * would fill every pass's `limit` and hold up the retries behind them. A due mark whose entry
   * is gone (removed from outside) is dropped, and told to `onInvalid` too: left, 50 of them
   * filled every pass's read, and the entries behind them were neither retried nor, being on the
   * ledger, swept as orphans.
   */
  async due(now: number, limit = 50, onInvalid?: OnInvalidEntry): Promise<LedgerEntry[]> {
    return (await this.dueToTake(now, limit, onInvalid)).map((due) => due.entry);
  }

  /** `due`, each entry with its text as stored, for `take`. */
  async dueToTake(now: number, limit = 50, onInvalid?: OnInvalidEntry): Promise<DueEntry[]> {
    const keys = await this.redis.zrangebyscore(this.keys.teardownDue(), "-inf", now, "LIMIT", 0, limit);
    if (keys.length === 0) return [];
    // As bytes, kept for the put-off's comparison: an entry torn in the middle of a character is
    // no UTF-8, and its text (read with U+FFFD for the broken bytes) never equals what Redis holds.
    const bytes = await this.redis.hmgetBuffer(this.keys.teardownEntries(), ...keys);
    const raws = bytes.map((b) => (b === null ? null : b.toString()));
    const bare = keys.filter((_, i) => raws[i] == null);
    if (bare.length > 0) {
      const dropped = (await this.redis.fleetLedgerDropBare(
        this.keys.teardownEntries(),
        this.keys.teardownDue(),
        ...bare,
      )) as string[];
      for (const key of dropped) {
        onInvalid?.(key, new Error("a due mark without its entry (removed from outside the fleet): dropped"));
      }
    }
    const stored = keys.flatMap((key, i) => (raws[i] == null ? [] : [[key, raws[i]] as [string, string]]));
    const putOff: string[] = [];
    const entries = parseStored(
      LedgerEntry,
      stored,
      onInvalid &&
        ((key, err) => {
          putOff.push(key);
          onInvalid(key, err);
        }),
    );
    // Only while the key still holds the bytes read: a close may have recorded its failure over
    // it since (due on its backoff, which an hour's put-off would have overridden).
    for (const key of putOff)
      await this.redis.fleetLedgerPutOff(
        this.keys.teardownEntries(),
        this.keys.teardownDue(),
        key,
        bytes[keys.indexOf(key)]!,
        now + INVALID_PUT_OFF_MS,
      );
    return entries.map(([entry, stored]) => ({ entry, stored }));
  }

  /**
   * Take a due entry (as `dueToTake` read it) for a destroy attempt, before the destroy is tried:
   * the attempt counted and the next one scheduled (`teardownBackoffMs`, from `at`), so that an
   * attempt that never returns (a provider call that crashes the janitor, an OOM, a hang until its
   * supervisor kills it) still counts and backs off. Counted only once it returned, such an entry
   * stayed due at its old time, first in every pass's read: the restarted janitor took it first
   * again, and could crash-loop on it for good, every entry behind it never retried. The attempt's
   * failure is then recorded without counting it again (`recordFailure`'s `taken`); its success
   * confirms as any. The entry written, or null (nothing written) when it is no longer the one
   * read (`fleetLedgerWrite`): another failure of it recorded meanwhile (scheduled anew), or its
   * destroy confirmed (gone). One Redis round trip.
   */
  async take(due: DueEntry, at: number, random = Math.random): Promise<LedgerEntry | null> {
    const { entry } = due;
    const attempts = entry.attempts + 1;
    const taken = LedgerEntry.parse({
      ...entry,
      attempts,
      // Replaced by the attempt's error if it fails; left, it says which attempt never ended.
      // The attempt before's error kept after it: a janitor that dies in this one loses nothing.
      // An attempt before that had no outcome either (its own note) passes on the error it kept,
      // once: nested one note a death, a poisoned entry's real error was cut off by the cap.
      lastError: `${noOutcomeNote(attempts, at)}; ${carriedError(entry)}`,
      dueAt: at + teardownBackoffMs(entry.attempts, random),
    });
    return (await this.writeIf(entry.key, due.stored, taken)) === 1 ? taken : null;
  }

  /**
   * Put a sandbox not on the ledger (an orphan the janitor is about to destroy) on it already
   * taken for its first destroy attempt, as `take` leaves a retried one: attempts 1, due
   * `teardownBackoffMs(0)` from `at`. A destroy that never returns (the janitor crashed or was
   * killed in it) then leaves it to the ledger's retries on their backoff; with nothing recorded,
   * the next pass's orphan sweep tried it again first, in its listing's order, every pass dying
   * on it. Its failure is recorded with `recordFailure`'s `taken`; its success confirms as any.
   * Only where the key is free, in one round trip: `taken`, the entry written, or `held`, what
   * the key holds (null: an entry that does not parse), nothing written.
   */
  async takeNew(
    entry: SandboxEntry,
    at: number,
    random = Math.random,
    options: {
      /**
       * A key holding text that is not JSON at all (torn: no release can read it) is taken over
       * too, in a second round trip while it holds that text: the attempt's outcome replaces it
       * anyway (a failure is recorded over it; a confirmed destroy forgets it), and left as it
       * is, a destroy that never returns was tried again first by every pass.
       */
      overUndecodable?: boolean;
    } = {},
  ): Promise<{ taken: LedgerEntry } | { held: LedgerEntry | null }> {
    const taken = LedgerEntry.parse({
      ...SandboxEntry.parse(entry),
      attempts: 1,
      // Replaced by the attempt's error if it fails; left, it says which attempt never ended.
      lastError: noOutcomeNote(1, at, " (of an orphan)"),
      firstFailedAt: at,
      dueAt: at + teardownBackoffMs(0, random),
    });
    const write = (over: string) => this.writeIf(entry.key, over, taken);
    let written = await write("");
    if (options.overUndecodable && typeof written === "string" && !isJson(written)) {
      written = await write(written);
      // Gone meanwhile (its key's destroy confirmed): free now, as on the first try.
      if (written === null) written = await write("");
    }
    if (written === 1) return { taken };
    return { held: written === null ? null : parseLedgerEntry(written) };
  }

  /**
   * Write `ledger` under `key`, due at its `dueAt`, only while the key holds `expected` ("": no
   * entry) (`fleetLedgerWrite`): 1 if written, else what the key holds (null: nothing).
   */
  private async writeIf(key: string, expected: string, ledger: LedgerEntry): Promise<1 | string | null> {
    return (await this.redis.fleetLedgerWrite(
      this.keys.teardownEntries(),
      this.keys.teardownDue(),
      key,
      expected,
      JSON.stringify(ledger),
      ledger.dueAt,
    )) as 1 | string | null;
  }

  /** Every ledger entry; one that does not parse goes to `onInvalid` (without it, throws). */
  async pending(onInvalid?: OnInvalidEntry): Promise<LedgerEntry[]> {
    const all = await this.redis.hgetall(this.keys.teardownEntries());
    return parseEntries(LedgerEntry, Object.entries(all), onInvalid);
  }

  async size(): Promise<number> {
    return this.redis.zcard(this.keys.teardownDue());
  }

  /**
   * Since when the ledger's oldest entry has awaited a confirmed destroy (its first failure, or
   * when close handed it over), epoch ms; null when empty. Reads every entry: the ledger holds
   * failed teardowns only, a few at a time.
   */
  async oldestSince(): Promise<number | null> {
    let oldest: number | null = null;
    for (const raw of await this.redis.hvals(this.keys.teardownEntries())) {
      let at: number;
      try {
        at = Number((JSON.parse(raw) as { firstFailedAt?: unknown }).firstFailedAt);
      } catch {
        continue; // torn: the janitor reports it
      }
      if (Number.isFinite(at) && (oldest === null || at < oldest)) oldest = at;
    }
    return oldest;
  }

  /**
   * A rollout's gateway network (or its firewall rules) that close could not remove: kept until
   * the janitor's retry succeeds (DESIGN §2 rule 3). Once the network is gone nothing else would
   * find its rules again: they would stay on the host for good.
   */
  async networkRemovalFailed(rolloutId: string, at: number): Promise<void> {
    await this.redis.zadd(this.keys.networkRetries(), "NX", at, rolloutId);
  }

  /** Rollouts whose network removal is due for a retry at `now`, the longest due first. */
  async networkRetries(now: number, limit = 50): Promise<string[]> {
    return this.redis.zrangebyscore(this.keys.networkRetries(), "-inf", now, "LIMIT", 0, limit);
  }

  /** A retry failed again: due again `delayMs` from `now` (others due meanwhile come first). */
  async networkRetryLater(rolloutId: string, now: number, delayMs = NETWORK_RETRY_MS): Promise<void> {
    await this.redis.zadd(this.keys.networkRetries(), "XX", now + delayMs, rolloutId);
  }

  /**
   * The rollout's network and rules are gone: nothing left to retry, and if nothing else of the
   * rollout is on the ledger, its finalized result's teardown is marked confirmed.
   */
  async networkRemoved(rolloutId: string): Promise<void> {
    await this.redis.fleetNetworkRemoved(
      this.keys.networkRetries(),
      this.keys.teardownEntries(),
      this.keys.rollout(rolloutId),
      this.keys.sandboxes(),
      rolloutId,
      sandboxKey(rolloutId, "resources"),
      sandboxKey(rolloutId, "agent"),
    );
  }

  /** Is a teardown still pending for this rollout (any owner)? */
  async isPending(rolloutId: string): Promise<boolean> {
    const [a, b] = await this.redis.hmget(
      this.keys.teardownEntries(),
      sandboxKey(rolloutId, "resources"),
      sandboxKey(rolloutId, "agent"),
    );
    return a !== null || b !== null;
  }
}

/** What a taken entry's `lastError` says until its attempt's outcome is recorded. */
function noOutcomeNote(attempt: number, at: number, of = ""): string {
  return `destroy attempt ${attempt}${of} began at ${new Date(at).toISOString()} and has no outcome recorded (if this stays, the janitor died or hung in it)`;
}

const NO_OUTCOME_NOTE =
  /^destroy attempt \d+(?: \(of an orphan\))? began at \S+ and has no outcome recorded \(if this stays, the janitor died or hung in it\)(?:; (attempt \d+: [\s\S]*))?$/;

/**
 * The error a take keeps after its note: the attempt before's; when that attempt had no outcome
 * either (its entry still holds its note), the error its note kept, else that it had none.
 */
function carriedError(entry: LedgerEntry): string {
  const note = NO_OUTCOME_NOTE.exec(entry.lastError);
  if (!note) return `attempt ${entry.attempts}: ${entry.lastError}`;
  return note[1] ?? `attempt ${entry.attempts}: no outcome recorded either`;
}

/** Whether a stored text is JSON at all (what `forgetDestroyed`'s decode can read). */
function isJson(raw: string): boolean {
  try {
    JSON.parse(raw);
    return true;
  } catch {
    return false;
  }
}

/** A stored ledger entry, or null when it does not parse. */
function parseLedgerEntry(raw: string): LedgerEntry | null {
  try {
    const parsed = LedgerEntry.safeParse(JSON.parse(raw));
    return parsed.success ? parsed.data : null;
  } catch {
    return null;
  }
}
