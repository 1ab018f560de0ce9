import { randomUUID } from "node:crypto";
import {
  AgentSpec,
  CloseReceipt,
  capText,
  FailureRecord,
  fitRecordJson,
  isTerminal,
  MAX_DURATION_S,
  MAX_RECORD_BYTES,
  normalizeRelativePath,
  RolloutResult,
  RolloutStatus,
  RunReceipt,
  type SandboxHandle,
  SandboxOptions,
  SeedReceipt,
  type StageName,
  TASK_FILE_SETS,
  TaskContent,
  Usage,
  VerifyReceipt,
} from "@fleet/contracts";
import type { ChainableCommander } from "ioredis";
import { z } from "zod";
import { batcherFor, type ScriptBatcher } from "./batcher.ts";
import type { RedisConnection } from "./connection.ts";
import { createKeys, type Keys } from "./keys.ts";
import {
  BEGIN_CLOSE_FIELDS,
  BEGIN_FIELDS,
  type ScriptedRedis,
  type ScriptName,
  slotError,
  withScripts,
} from "./scripts.ts";
import type { StageQueues } from "./stage-queues.ts";
import { type RolloutSandboxes, readRolloutSandboxes, SandboxEntry, sandboxKey } from "./teardown-ledger.ts";

/** What admission fixes about a rollout; never changes afterwards. No secrets: credentials are names. */
export const RolloutMeta = z.object({
  id: z.string(),
  batchId: z.string().nullable(),
  /** sha256 of the canonical request body, for idempotency checks. */
  bodyHash: z.string(),
  taskDigest: z.string(),
  taskId: z.string(),
  agent: AgentSpec,
  agentName: z.string(),
  sandbox: SandboxOptions.optional(),
  metadata: z.record(z.string(), z.unknown()).nullable(),
  createdAt: z.number().int(),
  /** Absolute deadline (epoch ms), counted from acceptance; retries share it. */
  deadlineAt: z.number().int(),
});
export type RolloutMeta = z.infer<typeof RolloutMeta>;

export interface RolloutReceipts {
  seed?: SeedReceipt;
  run?: RunReceipt;
  verify?: VerifyReceipt;
  close?: CloseReceipt;
}

export interface RolloutRecord {
  meta: RolloutMeta;
  status: RolloutStatus;
  stage: string;
  receipts: RolloutReceipts;
  failure: FailureRecord | null;
  cancelRequested: boolean;
  closed: boolean;
  fence: string | null;
  /** How many times the agent was launched (fenced launches claimed, less those given back). */
  launches: number;
  /** Closes enqueued again after one ended without finalizing (`noteCloseAgain`). */
  closesAgain: number;
  result: RolloutResult | null;
  times: Record<string, number>;
}

export interface BatchProgress {
  id: string;
  total: number;
  done: number;
  counts: Record<RolloutStatus, number>;
  createdAt: number;
  bodyHash: string | null;
}

export interface BeginOptions {
  /** Seed: persist this stage's sandbox intent along with the begin. */
  intent?: { owner: SandboxEntry["owner"]; provider: SandboxEntry["provider"]; expirySlackMs: number };
  /** Run: claim the fenced launch with this token along with the begin. */
  launchToken?: string;
  /**
   * Run, with `launchToken`: the delivery's BullMQ job lock (its key and this delivery's token).
   * The launch is claimed only while the lock holds the token: a begin that reached Redis after
   * its delivery's lock lapsed (held in its client's queue through an outage of its own link)
   * gets 'superseded', whether or not a later delivery claimed first.
   */
  launchLock?: { key: string; token: string };
  /**
   * Verify: take the verify fence with this token along with the begin (this attempt is the one
   * that began last: only it may work in the sandbox, `noteVerifyWork`, or store its receipt).
   */
  verifyToken?: string;
  /**
   * Seed: take the seed fence with this token along with the begin (this delivery is the one
   * that began last: only it may store the seed's receipt, `storeReceipt`'s `deliveryFence`).
   */
  seedToken?: string;
}

export interface BeginResult {
  record: RolloutRecord | null;
  /** The failure log (close only; empty otherwise), its rows that read as failure records. */
  failures: FailureRecord[];
  /** Rows of the failure log left out of `failures`: not JSON, or not a failure record. */
  unreadableFailures: number;
  /** The sandbox intent is persisted (seed with `intent`, stage not skipped). */
  intentRecorded: boolean;
  /**
   * This begin recorded the intent first: no earlier attempt got as far as recording it, so
   * (intent before action, DESIGN §2 rule 9) none created the sandbox, and there is none to find.
   */
  intentFresh: boolean;
  /**
   * The launch claim made by this begin (`launchToken`, stage not skipped): `previous` is
   * 'stopped' when a stop won, 'superseded' when this token claimed before and another launch
   * holds the fence now (see `claimLaunch`), else the previous fence; null when no claim was made.
   */
  launch: { previous: string; launches: number; token: string } | null;
  /**
   * Verify: the token of `verifyToken` (null for other stages), whether or not the begin took the
   * fence; it did unless the stage is skipped, when no handler runs.
   */
  verifyToken: string | null;
  /** Seed: the token of `seedToken` (null for other stages), as `verifyToken`. */
  seedToken: string | null;
  /** Close only: the rollout's sandbox entries (intents and handles). */
  sandboxes: RolloutSandboxes | null;
  /**
   * Verify: how long an earlier attempt handed back at shutdown may still sweep its tests
   * (`claimTestsSweep`), by Redis's clock; 0 for none.
   */
  testsSweepLeftMs: number;
  /**
   * Verify: the attempt whose note of work in the sandbox `record.times["verify:prev"]` is
   * (`noteVerifyWork`) has left the sandbox since (`leaveVerifyWork`): whatever of its tests still
   * runs there is nobody's. False when none noted, or it may still be at work (its worker died,
   * or is paused past its lock).
   */
  earlierVerifyLeft: boolean;
  /**
   * Verify: the epoch of `verifyToken` (1 for the rollout's first verify attempt, one more for
   * each later one; the same for this very begin sent again); null for other stages or a skipped
   * verify. A root sweep raises the sandbox's verify fence to it (`KillOptions.fenceEpoch`), and
   * the tests' runner of an attempt with a lower one then refuses to start.
   */
  verifyEpoch: number | null;
  /**
   * Verify: the attempt whose note is `record.times["verify:prev"]` honours the sandbox's verify
   * fence (its release's staging and tests' runner read it first): a later attempt may fence the
   * sandbox against it and start at once. False when none noted, or an older release did.
   */
  earlierVerifyFenceAware: boolean;
}

/**
 * A delivery's hold on its stage: the rollout hash field its begin wrote its token to (`vfence`
 * for verify, `sfence` for seed: the one that began last holds it) and that token. A write fenced
 * by it (a receipt, a failure, an intent dropped) happens only while the field still holds the
 * token, atomically with the check.
 */
export interface DeliveryFence {
  /** A verify's (`vfence`), a seed's (`sfence`), or a run launch's (`fence`, its token `launched:<token>`). */
  field: "vfence" | "sfence" | "fence";
  token: string;
}

/**
 * The fence a verify or a seed took with its begin (`verifyToken`, `seedToken`), or the launch
 * fence a run holds (`launchFence`, set by its handler once it claims the launch); else null.
 */
export function deliveryFence(
  begun: Pick<BeginResult, "verifyToken" | "seedToken"> & { launchFence?: DeliveryFence },
): DeliveryFence | null {
  if (begun.verifyToken !== null) return { field: "vfence", token: begun.verifyToken };
  if (begun.seedToken !== null) return { field: "sfence", token: begun.seedToken };
  return begun.launchFence ?? null;
}

/** After a stage's receipt, in the same round trip: the next stage's job. */
export interface NextStage {
  queues: StageQueues;
  stage: StageName;
}

/** Receipt fields `fitRecordJson` never cuts. */
const RECEIPT_KEEP: ReadonlySet<string> = new Set(["answer"]);

const RECEIPT_SCHEMAS = {
  seed: SeedReceipt,
  run: RunReceipt,
  verify: VerifyReceipt,
  close: CloseReceipt,
} as const;
type ReceiptOf<S extends StageName> = z.infer<(typeof RECEIPT_SCHEMAS)[S]>;

/** The statuses this release knows (`parseRecord` refuses a record holding another, or none). */
const STATUSES: ReadonlySet<string> = new Set(RolloutStatus.options);

/**
 * A rollout hash as a record. Not re-validated with zod: every field was validated when our own
 * code wrote it (saveReceipt, admit, recordFailure), and this read is on every stage's hot path.
 */

function parseRecord(h: Record<string, string>): RolloutRecord | null {
  if (!h.meta) return null;
  // A record without a status (its field deleted by hand) or with one this release does not know
  // is unreadable, as a torn one is: read as it is, no script would ever finalize it (they take
  // it for terminal), so it would stay in flight for good, holding backlog room and its batch.
  if (h.status === undefined || !STATUSES.has(h.status)) {
    throw new Error(`its status ${JSON.stringify(h.status ?? null)} is not one this release knows`);
  }
  const receipts: RolloutReceipts = {};
  for (const stage of ["seed", "run", "verify", "close"] as const) {
    const raw = h[`r:${stage}`];
    if (raw) (receipts as Record<string, unknown>)[stage] = JSON.parse(raw);
  }
  const times: Record<string, number> = {};
  for (const [k, v] of Object.entries(h)) if (k.startsWith("t:")) times[k.slice(2)] = Number(v);
  return {
    meta: JSON.parse(h.meta) as RolloutMeta,
    status: h.status as RolloutStatus,
    stage: h.stage ?? "admission",
    receipts,
    failure: h.failure ? (JSON.parse(h.failure) as FailureRecord) : null,
    cancelRequested: h.cancel === "1",
    closed: h.closed === "1",
    fence: h.fence ?? null,
    launches: Number(h.launches ?? 0),
    closesAgain: Number(h["closes:again"] ?? 0),
    result: h.result ? (JSON.parse(h.result) as RolloutResult) : null,
    times,
  };
}

/**
 * A failure log's rows as failure records, leaving out (and counting) each row that is not JSON
 * or not a failure record: one written by another release (a failure kind this one does not
 * know, in a rolling upgrade) or edited by hand. The log is a diagnostic that goes into the
 * result; one row this release cannot read must not stop the rollout's close, which reads it
 * (every attempt would throw, and the rollout would stay in flight for good).
 */
export function readFailureLog(rows: readonly string[]): { failures: FailureRecord[]; unreadable: number } {
  const failures: FailureRecord[] = [];
  for (const row of rows) {
    let parsed: ReturnType<typeof FailureRecord.safeParse>;
    try {
      parsed = FailureRecord.safeParse(JSON.parse(row));
    } catch {
      continue;
    }
    if (parsed.success) failures.push(parsed.data);
  }
  return { failures, unreadable: rows.length - failures.length };
}

/**
 * A rollout record that cannot be read: a field that does not parse (torn), or a key that is not
 * a hash. No retry reads it; a Redis error that may pass is thrown as it is, never as this.
 */
export class UnreadableRecordError extends Error {
  override readonly name = "UnreadableRecordError";
  constructor(
    readonly rolloutId: string,
    cause: unknown,
  ) {
    super(
      `rollout ${rolloutId}'s record cannot be read: ${(cause instanceof Error ? cause.message : String(cause)).slice(0, 300)}`,
      { cause },
    );
  }
}

/** The fleet's scripts on a MULTI (defined on its connection by `withScripts`; ioredis's types know none). */
function scriptsIn(tx: ChainableCommander): Record<ScriptName, (...args: string[]) => ChainableCommander> {
  return tx as unknown as Record<ScriptName, (...args: string[]) => ChainableCommander>;
}

/** Run a MULTI; its replies, or the first command's error. */
async function execAll(tx: ChainableCommander, what: string): Promise<unknown[]> {
  const replies = await tx.exec();
  if (!replies) throw new Error(`${what}: the MULTI was discarded`);
  return replies.map(([err, reply]) => {
    if (err) throw err;
    return reply;
  });
}

/** Tasks are content-addressed and never change: a worker keeps the ones it has read. */
const TASK_CACHE_SIZE = 256;
/**
 * The task cache's bound in characters of task JSON (a task may be 10 MiB, up to 512 MiB with
 * FLEET_MAX_TASK_BYTES: 256 of them would be gigabytes in every worker). A task over a quarter of
 * it is not kept. @defaultValue 64 Mi characters
 */
export const DEFAULT_TASK_CACHE_CHARS = 64 * 1024 * 1024;

/**
 * The longest a rollout can be in flight: its deadline is at most the agent's and the verifier's
 * timeouts (a week each) plus an hour's slack, and close may retry for about 35 minutes after it.
 */
export const LONGEST_LIFE_MS = (2 * MAX_DURATION_S + 2 * 3600) * 1000;

/**
 * How long a batch created by an admission lives if none of its rollouts gets recorded (the
 * admission failed in between): its first rollout makes it live as long as its rollouts. A day:
 * far longer than any admission takes, so a slow one never loses its batch.
 */
export const BATCH_ADMISSION_LEASE_MS = 24 * 3600 * 1000;

/**
 * Most rollouts one `fleetAdmit` call records (as many as `enqueueSeeds` enqueues a round trip):
 * its reply and its inflight and id-list writes grow with it, and Redis runs nothing else meanwhile.
 */
const ADMIT_CHUNK = 500;

/**
 * Most bytes of rollout records one `fleetAdmit` call carries, past its first rollout: a batch of
 * rollouts each with a long agent spec (a prompt in its argv or env) would otherwise send the
 * whole request body in one call, and hold every other client of Redis (lock renewals, stage
 * scripts, `/readyz`) for up to a second.
 */
export const ADMIT_CHUNK_BYTES = 1024 * 1024;

/** Default retention of finished rollouts (`FLEET_RESULT_TTL_S`): a week. */
export const DEFAULT_RESULT_TTL_MS = 7 * 24 * 3600 * 1000;

/**
 * How long a backlog reservation (`reserveBacklog`) outlives its last refresh: the room of a
 * dispatcher that died mid-admission comes back after it. The admission refreshes it while it
 * goes on (every third of it), however long it takes.
 */
export const BACKLOG_RESERVATION_TTL_MS = 60_000;

export interface RolloutStoreOptions {
  /**
   * Retention: a finished rollout's record, result and failure log expire this long after it
   * finished, a batch's keys this long after its last rollout did, a task this long plus a week
   * after its latest admission. `0` keeps everything for good (Redis runs with noeviction, so
   * memory then only grows). @defaultValue `DEFAULT_RESULT_TTL_MS` (a week)
   */
  resultTtlMs?: number;
  /** The task cache's bound (`DEFAULT_TASK_CACHE_CHARS`). */
  taskCacheChars?: number;
  /**
   * The fleet's clock (Redis's in the apps: `startRedisClock`), for the dates of admission notes,
   * which the janitor compares with its own. @defaultValue `Date.now`
   */
  now?: () => number;
}

/**
 * What a stored result never loses to the 16 KiB bound (DESIGN §2 rules 12–13): who it is, what
 * it ran and how it ended. Only free text (reason, details, answers in failures, metadata strings)
 * is cut; `metadata` is bounded at admission (`MAX_METADATA_BYTES`), since numbers cannot be cut.
 */
export const RESULT_KEEP: ReadonlySet<string> = new Set([
  "id",
  "batchId",
  "taskId",
  "taskDigest",
  "agent",
  "status",
  "failureKind",
  "stage",
  "teardown",
  "failures.stage",
  "failures.failureKind",
]);

/**
 * The durable state of rollouts and batches (DESIGN §4). The rollout record, not the BullMQ job,
 * is the result of record.
 */
export class RolloutStore {
  readonly keys: Keys;
  private readonly redis: ScriptedRedis;
  private readonly batcher: ScriptBatcher;
  /** Parsed tasks by digest, oldest first, with their JSON's length (`taskCacheChars` in all). */
  private readonly taskCache = new Map<string, { task: TaskContent; chars: number }>();
  private taskCacheChars = 0;
  private readonly maxTaskCacheChars: number;

  /** How long a finished rollout's record and result are kept (0: for good). */
  readonly resultTtlMs: number;
  private readonly now: () => number;

  constructor(redis: RedisConnection, prefix = "{fleet}", options: RolloutStoreOptions = {}) {
    this.redis = withScripts(redis);
    this.batcher = batcherFor(redis);
    this.keys = createKeys(prefix);
    this.resultTtlMs = options.resultTtlMs ?? DEFAULT_RESULT_TTL_MS;
    this.now = options.now ?? Date.now;
    this.maxTaskCacheChars = options.taskCacheChars ?? DEFAULT_TASK_CACHE_CHARS;
    if (!Number.isSafeInteger(this.resultTtlMs) || this.resultTtlMs < 0) {
      throw new Error(`resultTtlMs must be a whole number of milliseconds >= 0, got ${this.resultTtlMs}`);
    }
  }

  // ---- tasks (content-addressed) ----

  /**
   * Store a task once (content-addressed). With retention on, it lives `resultTtlMs` plus the
   * longest a rollout can live (`LONGEST_LIFE_MS`) past its latest admission, which refreshes it:
   * every rollout that refers to it finishes before it goes. With retention off, for good.
   */
  async putTask(task: TaskContent, digest: string): Promise<void> {
    const key = this.keys.task(digest);
    const tx = this.redis.multi();
    if (this.resultTtlMs === 0) {
      // Kept for good, also when a release with retention stored it first (a rolling restart
      // that turned retention off): its lease would run out under rollouts still in flight.
      tx.set(key, JSON.stringify(task), "NX").persist(key);
    } else {
      const ttl = this.resultTtlMs + LONGEST_LIFE_MS;
      tx.set(key, JSON.stringify(task), "PX", ttl, "NX").pexpire(key, ttl);
    }
    const replies = await tx.exec();
    for (const [err] of replies ?? []) if (err) throw err;
  }

  async getTask(digest: string): Promise<TaskContent | null> {
    const cached = this.taskCache.get(digest);
    if (cached) return cached.task;
    const raw = await this.redis.get(this.keys.task(digest));
    if (raw === null) return null;
    const stored = JSON.parse(raw) as { verifier?: { kind?: unknown } } & Record<string, unknown>;
    // A match-graded task with tests/ is refused at admission now; one an earlier version stored
    // may still run here. Its tests never run (the match grades it): dropped, not a failed rollout.
    if (stored.verifier?.kind === "match") stored.tests = {};
    // So is a file path not spelled plainly (`./a`, `a//b`); an earlier version took it (never
    // two spellings of one file) and staged it as `a`, `a/b`: read so, not a failed rollout.
    for (const set of TASK_FILE_SETS) {
      const files = stored[set];
      if (files === null || typeof files !== "object") continue;
      const keys = Object.keys(files);
      if (keys.some((key) => normalizeRelativePath(key) !== key)) {
        stored[set] = Object.fromEntries(
          Object.entries(files).map(([key, text]) => [normalizeRelativePath(key), text]),
        );
      }
    }
    const task = TaskContent.parse(stored);
    const chars = raw.length;
    if (chars > this.maxTaskCacheChars / 4 || this.taskCache.has(digest)) return task;
    while (
      this.taskCache.size > 0 &&
      (this.taskCache.size >= TASK_CACHE_SIZE || this.taskCacheChars + chars > this.maxTaskCacheChars)
    ) {
      const [oldest, entry] = this.taskCache.entries().next().value!;
      this.taskCache.delete(oldest);
      this.taskCacheChars -= entry.chars;
    }
    this.taskCache.set(digest, { task, chars });
    this.taskCacheChars += chars;
    return task;
  }

  async hasTask(digest: string): Promise<boolean> {
    return (await this.redis.exists(this.keys.task(digest))) === 1;
  }

  // ---- admission ----

  /**
   * Create the batch hash if new; returns the stored body hash (the caller's if it created it).
   * One script (`fleetCreateBatch`): a crash cannot leave a body hash without `createdAt` (a batch
   * nobody could read), a new batch gets a lease (`BATCH_ADMISSION_LEASE_MS`) that its first
   * admitted rollout ends, and `total`/`done` are never written here, only counted up by
   * admission and finalize (`HINCRBY` creates them), so a concurrent replay's admissions are
   * never reset to 0.
   */
  async createBatch(
    batchId: string,
    bodyHash: string,
    now: number,
    /** The single rollout the batch's idempotency key would name: none may exist (`OTHER_ROUTE`). */
    keyRolloutId?: string,
  ): Promise<string> {
    const stored = (await this.redis.fleetCreateBatch(
      this.keys.batch(batchId),
      this.keys.admitting(),
      keyRolloutId !== undefined ? this.keys.rollout(keyRolloutId) : this.keys.batch(batchId),
      this.keys.batchDone(batchId),
      bodyHash,
      String(now),
      String(BATCH_ADMISSION_LEASE_MS),
      admissionOf({ batchId }),
      // The note's time is now, not the admission's start: its task uploads may have taken long.
      String(this.now()),
    )) as string | null;
    return stored ?? bodyHash;
  }

  /**
   * Of a batch that finished and is expiring (retention), the rollouts it admitted that are gone
   * already (at most `limit`); none for a batch that is not expiring.
   */
  async expiredOfBatch(batchId: string, limit = 10): Promise<string[]> {
    const [ttl, total] = await Promise.all([
      this.redis.pttl(this.keys.batch(batchId)),
      this.redis.hget(this.keys.batch(batchId), "total"),
    ]);
    if (ttl <= 0 || total === null) return [];
    return this.batchRolloutsWhere(batchId, (status) => status === null, limit);
  }

  /**
   * A batch's rollouts (a page of ids at a time) whose record's status passes `keep` (null: no
   * record), at most `limit`.
   */
  private async batchRolloutsWhere(
    batchId: string,
    keep: (status: string | null) => boolean,
    limit = Number.POSITIVE_INFINITY,
  ): Promise<string[]> {
    const kept: string[] = [];
    for (let start = 0; kept.length < limit; start += 500) {
      const ids = await this.batchRolloutIds(batchId, start, start + 499);
      if (ids.length === 0) break;
      const statuses = await this.statusesOf(ids);
      ids.forEach((id, i) => {
        if (kept.length < limit && keep(statuses[i]!)) kept.push(id);
      });
      if (ids.length < 500) break;
    }
    return kept;
  }

  /**
   * An admission's seeds are enqueued: it is no longer under way (see `Keys.admitting`). With
   * `ifScore`, only while its note still has that score (the janitor's: a live admission that
   * noted a new chunk since the janitor read it keeps its note).
   */
  async admissionDone(admission: string, ifScore?: number): Promise<void> {
    if (ifScore === undefined) await this.redis.zrem(this.keys.admitting(), admission);
    else await this.redis.fleetNoteDone(this.keys.admitting(), admission, String(ifScore));
  }

  /** Admissions still under way that began before `before` (their dispatcher may have died), with their notes' scores. */
  async admissionsBefore(before: number, limit = 20): Promise<Array<{ admission: string; score: number }>> {
    return (await this.notesBefore(this.keys.admitting(), before, limit)).map(({ member, score }) => ({
      admission: member,
      score,
    }));
  }

  /**
   * Batch cancels still under way whose walker last noted progress before `before` (their
   * dispatcher may have died before it asked every rollout to stop), with their notes' scores.
   */
  async cancelsBefore(before: number, limit = 20): Promise<Array<{ batchId: string; score: number }>> {
    return (await this.notesBefore(this.keys.cancelling(), before, limit)).map(({ member, score }) => ({
      batchId: member,
      score,
    }));
  }

  /**
   * A batch cancel's walker is still at it: its note is dated `at` (noted again if another
   * walker of the same batch finished meanwhile and took it away).
   */
  async cancelProgress(batchId: string, at: number): Promise<void> {
    await this.redis.zadd(this.keys.cancelling(), at, batchId);
  }

  /** A batch cancel's walk is done: its note goes, only while it still has `ifScore` (another walker's later note stays). */
  async cancelDone(batchId: string, ifScore: number): Promise<void> {
    await this.redis.fleetNoteDone(this.keys.cancelling(), batchId, String(ifScore));
  }

  private async notesBefore(
    key: string,
    before: number,
    limit: number,
  ): Promise<Array<{ member: string; score: number }>> {
    const flat = await this.redis.zrangebyscore(key, "-inf", before, "WITHSCORES", "LIMIT", 0, limit);
    const out: Array<{ member: string; score: number }> = [];
    for (let i = 0; i + 1 < flat.length; i += 2) out.push({ member: flat[i]!, score: Number(flat[i + 1]) });
    return out;
  }

  /** Of an admission's rollouts, those recorded and never started (their seed may never have been enqueued). */
  async unseededOf(admission: string): Promise<string[]> {
    const accepted = (status: string | null) => status === "accepted";
    if (admission.startsWith("b:")) return this.batchRolloutsWhere(admission.slice(2), accepted);
    return this.unseeded([admission.slice(2)]);
  }

  /** Of `ids` (in their order), those recorded and never started: gone, seeded or finished ones are left out. */
  async unseeded(ids: readonly string[]): Promise<string[]> {
    const out: string[] = [];
    for (let i = 0; i < ids.length; i += 500) {
      const chunk = ids.slice(i, i + 500);
      const statuses = await this.statusesOf(chunk);
      chunk.forEach((id, j) => {
        if (statuses[j] === "accepted") out.push(id);
      });
    }
    return out;
  }

  /**
   * The status of each of `ids`' records, in their order (null: no record), in one round trip.
   * A command's error is thrown: a record that could not be read is not one that is gone.
   */
  private async statusesOf(ids: readonly string[]): Promise<Array<string | null>> {
    const pipe = this.redis.pipeline();
    for (const id of ids) pipe.hget(this.keys.rollout(id), "status");
    const replies = (await pipe.exec()) ?? [];
    return ids.map((_, i) => {
      const [err, status] = replies[i] ?? [null, null];
      if (err) throw err;
      return (status as string | null) ?? null;
    });
  }

  /**
   * Admit rollouts (idempotent per id). Returns the ids newly created, those that already
   * existed with another body hash (`conflicting`: nothing of theirs was changed), and those gone
   * from a finished batch that is expiring (`expired`: not created again).
   */
  async admit(
    metas: readonly RolloutMeta[],
    now: number,
    /** For a single rollout with an idempotency key: the batch that key would name (none may exist). */
    keyBatchId?: string,
  ): Promise<{ created: string[]; conflicting: string[]; expired: string[]; otherRoute: string[] }> {
    const created: string[] = [];
    const conflicting: string[] = [];
    const expired: string[] = [];
    const otherRoute: string[] = [];
    const sorted: Record<number, string[]> = {
      1: created,
      2: created, // by this very call, sent again (a reconnect lost its reply)
      [-1]: conflicting,
      [-2]: expired,
      [-3]: otherRoute,
    };
    const inflight = this.keys.inflight();
    // In order, up to 500 at a time and about `ADMIT_CHUNK_BYTES` of records, one `fleetAdmit`
    // call per run of rollouts of one batch (or of single ones): an admission's are all of one.
    for (let i = 0; i < metas.length; ) {
      const batchId = metas[i]!.batchId;
      const records: string[] = [];
      let bytes = 0;
      let end = i;
      while (
        end < metas.length &&
        end - i < ADMIT_CHUNK &&
        metas[end]!.batchId === batchId &&
        (end === i || bytes < ADMIT_CHUNK_BYTES)
      ) {
        const json = JSON.stringify(metas[end]);
        records.push(json);
        bytes += Buffer.byteLength(json);
        end++;
      }
      const chunk = metas.slice(i, end);
      i = end;
      const keys =
        batchId !== null
          ? [
              inflight,
              this.keys.admitting(),
              this.keys.batch(batchId),
              this.keys.batchIds(batchId),
              this.keys.batchDone(batchId),
            ]
          : [
              inflight,
              this.keys.admitting(),
              keyBatchId !== undefined ? this.keys.batch(keyBatchId) : inflight,
              inflight,
              inflight,
            ];
      const args = [
        String(now),
        batchId !== null ? "batch" : keyBatchId !== undefined ? "keyed" : "single",
        // A long admission keeps its note fresh: the janitor finishes only one left for dead.
        String(this.now()),
        batchId !== null ? admissionOf({ batchId }) : "",
      ];
      chunk.forEach((m, j) => {
        keys.push(this.keys.rollout(m.id), this.keys.failures(m.id));
        args.push(records[j]!, String(m.deadlineAt), m.id, m.bodyHash);
      });
      // Last: this call's id (the same call sent again is told what it created) and the result's
      // retention, recorded with each rollout (its finalize keeps it so long).
      args.push(randomUUID(), String(this.resultTtlMs));
      const replies = (await this.redis.fleetAdmit(keys.length, ...keys, ...args)) as unknown[];
      let failed: Error | null = null;
      chunk.forEach((m, j) => {
        const reply = replies[j];
        const err = slotError(reply, this.redis);
        if (err) failed ??= err;
        else sorted[reply as number]?.push(m.id);
      });
      // As a pipeline of one call per rollout did: the others ran, the first error is thrown.
      if (failed) throw failed;
    }
    return { created, conflicting, expired, otherRoute };
  }

  // ---- reads ----

  /** @throws UnreadableRecordError when the stored record does not parse or is not a hash. */
  async get(id: string): Promise<RolloutRecord | null> {
    let h: Record<string, string>;
    try {
      h = await this.redis.hgetall(this.keys.rollout(id));
    } catch (err) {
      if (err instanceof Error && err.message.startsWith("WRONGTYPE"))
        throw new UnreadableRecordError(id, err);
      throw err;
    }
    try {
      return parseRecord(h);
    } catch (err) {
      throw new UnreadableRecordError(id, err);
    }
  }

  /**
   * Begin a stage in one round trip: the record (after recording the stage's start time, and for
   * close after setting the tombstone), only the fields the stage reads (`BEGIN_FIELDS`: before
   * close without `times`; for close `BEGIN_CLOSE_FIELDS`, with the stages' timings),
   * plus what the stage asked for: for close, the failure log
   * and the rollout's sandbox entries; with `intent` (seed), its sandbox intent persisted
   * (DESIGN §2 rule 9); with `launchToken` (run), the fenced launch claimed (rule 10); with
   * `verifyToken` (verify), the verify fence taken. Intent, claim and fence happen only when the stage is not to be skipped (closed, failed, cancelled, receipt
   * stored), atomically with that check.
   */
  async begin(id: string, stage: StageName, now: number, options: BeginOptions = {}): Promise<BeginResult> {
    const close = stage === "close";
    let intentKey = "";
    let intentPrefix = "";
    if (options.intent) {
      const { owner, provider } = options.intent;
      intentKey = sandboxKey(id, owner);
      // The entry's JSON up to its last field; the script appends deadlineAt + slack and `}`.
      const entry: Omit<SandboxEntry, "expiresAt"> = {
        key: intentKey,
        rolloutId: id,
        owner,
        provider,
        handle: null,
        createdAt: now,
      };
      intentPrefix = `${JSON.stringify(entry).slice(0, -1)},"expiresAt":`;
    }
    const rollout = this.keys.rollout(id);
    const lock = options.launchToken !== undefined ? options.launchLock : undefined;
    const keys = [rollout, this.keys.failures(id), this.keys.sandboxes(), lock?.key ?? rollout];
    const args = [
      stage,
      String(now),
      close ? "1" : "0",
      close ? "1" : "0",
      intentKey,
      intentPrefix,
      String(options.intent?.expirySlackMs ?? 0),
      options.launchToken ?? options.verifyToken ?? options.seedToken ?? "",
      close ? sandboxKey(id, "resources") : "",
      close ? sandboxKey(id, "agent") : "",
      lock?.token ?? "",
    ];
    const [
      values,
      failures,
      intent,
      previous,
      launches,
      sbResources,
      sbAgent,
      sweepLeft,
      verifyPrev,
      prevLeft,
      epoch,
      prevAware,
    ] = (await this.batcher.call("fleetBegin", keys, args)) as [
      (string | null)[],
      string[],
      string,
      string,
      number,
      string,
      string,
      number,
      string | null,
      number,
      number,
      number,
    ];
    const names = close ? BEGIN_CLOSE_FIELDS : BEGIN_FIELDS;
    const h: Record<string, string> = {};
    for (let i = 0; i < names.length; i++) {
      const value = values[i];
      if (value !== null && value !== undefined) h[names[i]!] = value;
    }
    if (verifyPrev !== null && verifyPrev !== undefined) h["t:verify:prev"] = verifyPrev;
    const claimed =
      options.launchToken !== undefined &&
      (previous === "stopped" || previous === "superseded" || Number(launches) > 0);
    const log = readFailureLog(failures);
    return {
      record: parseRecord(h),
      failures: log.failures,
      unreadableFailures: log.unreadable,
      intentRecorded: intent === "ok" || intent === "new",
      intentFresh: intent === "new",
      launch: claimed
        ? { previous: String(previous), launches: Number(launches), token: options.launchToken! }
        : null,
      verifyToken: stage === "verify" ? (options.verifyToken ?? null) : null,
      seedToken: stage === "seed" ? (options.seedToken ?? null) : null,
      testsSweepLeftMs: Number(sweepLeft),
      earlierVerifyLeft: Number(prevLeft) === 1,
      verifyEpoch: stage === "verify" && Number(epoch) > 0 ? Number(epoch) : null,
      earlierVerifyFenceAware: Number(prevAware) === 1,
      sandboxes: close ? readRolloutSandboxes(sbResources || null, sbAgent || null) : null,
    };
  }

  async getResult(id: string): Promise<RolloutResult | null> {
    const raw = await this.redis.hget(this.keys.rollout(id), "result");
    return raw ? RolloutResult.parse(JSON.parse(raw)) : null;
  }

  /** Whether a rollout is recorded under this id. */
  async exists(id: string): Promise<boolean> {
    return (await this.redis.exists(this.keys.rollout(id))) === 1;
  }

  /** Whether a batch is recorded under this id (its creation at least). */
  async batchExists(id: string): Promise<boolean> {
    return (await this.redis.exists(this.keys.batch(id))) === 1;
  }

  async getBatch(id: string): Promise<BatchProgress | null> {
    const h = await this.redis.hgetall(this.keys.batch(id));
    if (!h.createdAt) return null;
    const counts = Object.fromEntries(
      RolloutStatus.options.map((s) => [s, Number(h[`count:${s}`] ?? 0)]),
    ) as Record<RolloutStatus, number>;
    return {
      id,
      total: Number(h.total ?? 0),
      done: Number(h.done ?? 0),
      counts,
      createdAt: Number(h.createdAt),
      bodyHash: h.bodyHash ?? null,
    };
  }

  async batchRolloutIds(id: string, start = 0, stop = -1): Promise<string[]> {
    return this.redis.lrange(this.keys.batchIds(id), start, stop);
  }

  /**
   * How many of a batch's rollouts have finished, as the results cursor counts them. A list
   * without the expiry its batch has (an older release's finalize ended the batch: it knows no
   * list) takes the batch's.
   */
  async batchDoneCount(id: string): Promise<number> {
    const [len, listTtl, batchTtl] = await Promise.all([
      this.redis.llen(this.keys.batchDone(id)),
      this.redis.pttl(this.keys.batchDone(id)),
      this.redis.pttl(this.keys.batch(id)),
    ]);
    if (len > 0 && listTtl === -1 && batchTtl > 0)
      await this.redis.pexpire(this.keys.batchDone(id), batchTtl);
    return len;
  }

  /** A batch's finished rollouts in the order they finished, positions `start` to `stop`. */
  async batchDoneIds(id: string, start: number, stop: number): Promise<string[]> {
    return this.redis.lrange(this.keys.batchDone(id), start, stop);
  }

  /** Results of many rollouts in one round trip (null where not terminal yet). */
  async getResults(ids: readonly string[]): Promise<(RolloutResult | null)[]> {
    return (await this.getResultsJson(ids)).map((raw) =>
      raw === null ? null : RolloutResult.parse(JSON.parse(raw)),
    );
  }

  /**
   * The stored results of `ids` as stored (one JSON line each; null where there is none), for
   * what passes them on: the results stream answers what `GET /v1/rollouts/:id` does, and a result
   * another release of the fleet wrote (a field this one does not know, or lacks) is passed on
   * whole, never a stream broken for the whole batch.
   */
  async getResultsJson(ids: readonly string[]): Promise<(string | null)[]> {
    if (ids.length === 0) return [];
    const pipe = this.redis.pipeline();
    for (const id of ids) pipe.hget(this.keys.rollout(id), "result");
    const rows = (await pipe.exec()) ?? [];
    return rows.map(([err, raw]) => {
      if (err) throw err;
      return typeof raw === "string" ? raw : null;
    });
  }

  /** Rollouts not yet terminal. */
  async inflightCount(): Promise<number> {
    return this.redis.zcard(this.keys.inflight());
  }

  /**
   * Reserve room for `count` rollouts under the backlog bound `max` (see `fleetReserve`): the
   * check and the reservation are one step, so concurrent submissions never pass the bound
   * together. `release` once the rollouts are admitted (they are in flight then) or refused;
   * `refresh` while the admission goes on, more often than `ttlMs`: a reservation neither
   * released nor refreshed lapses `ttlMs` after it was taken or last refreshed (its holder died).
   */
  async reserveBacklog(
    count: number,
    max: number,
    /** The clock reservations lapse by; null for Redis's own (one clock for every dispatcher). */
    now: number | null,
    ttlMs = BACKLOG_RESERVATION_TTL_MS,
    /**
     * What names the request (from its idempotency key): a call for the same request while
     * another holds a reservation for it shares that one (it admits the same rollouts), never
     * refused for backpressure; its release leaves the other's alone.
     */
    share = "",
  ): Promise<{
    reserved: boolean;
    inflight: number;
    reservedByOthers: number;
    release(): Promise<void>;
    /** Move its expiry to `ttlMs` from now; false when it is not held (released, lapsed, shared). */
    refresh(): Promise<boolean>;
  }> {
    const id = randomUUID();
    const member = share === "" ? `${id}:${count}` : `${id}:${share}:${count}`; // as the script stores it
    const clock = now === null ? "" : String(now);
    const [ok, inflight, others, shared] = (await this.redis.fleetReserve(
      this.keys.inflight(),
      this.keys.reservations(),
      id,
      String(count),
      String(max),
      clock,
      String(ttlMs),
      share,
    )) as [number, number, number, number];
    // Its own, once: released once, a release again (an admission gives its room back when its
    // rollouts are recorded, and again however it ends) sends nothing.
    let held = ok === 1 && Number(shared) !== 1;
    return {
      reserved: ok === 1,
      inflight: Number(inflight),
      reservedByOthers: Number(others),
      release: async () => {
        if (!held) return;
        await this.redis.zrem(this.keys.reservations(), member);
        held = false;
      },
      refresh: async () => {
        if (!held) return false;
        const refreshed = await this.redis.fleetReserveRefresh(
          this.keys.reservations(),
          member,
          clock,
          String(ttlMs),
        );
        return Number(refreshed) === 1;
      },
    };
  }

  /**
   * Take a rollout whose record cannot be read (`UnreadableRecordError`, or gone) out of the
   * in-flight index into `keys.unreadable()`, scored by its deadline: it no longer holds a place
   * among the watchdog's overdue rollouts nor backlog room. Its record is kept as it is.
   * True if it was in flight.
   */
  async setAsideUnreadable(id: string): Promise<boolean> {
    return (await this.redis.fleetSetAside(this.keys.inflight(), this.keys.unreadable(), id)) === 1;
  }

  /** Rollouts set aside by `setAsideUnreadable`, the earliest deadline first. */
  async unreadable(limit = 100): Promise<string[]> {
    return this.redis.zrange(this.keys.unreadable(), "0", String(limit - 1));
  }

  /** Open rollouts, by deadline: `count` of them from rank `start`. */
  async inflightPage(start: number, count: number): Promise<string[]> {
    return this.redis.zrange(this.keys.inflight(), String(start), String(start + count - 1));
  }

  /**
   * Write a short-lived probe key: rejects when Redis refuses writes (full under noeviction:
   * OOM; a read-only replica after a failover) though it still answers reads and PING.
   */
  async probeWrite(): Promise<void> {
    await this.redis.set(this.keys.writeProbe(), String(Date.now()), "PX", 60_000);
  }

  /** Non-terminal rollouts whose deadline passed before `before`, most overdue first, from `offset`. */
  async pastDeadline(before: number, limit = 100, offset = 0): Promise<string[]> {
    return this.redis.zrangebyscore(this.keys.inflight(), "-inf", before, "LIMIT", offset, limit);
  }

  // ---- transitions ----

  private batchArgs(meta: Pick<RolloutMeta, "id" | "batchId">): [string, string] {
    return meta.batchId !== null ? [this.keys.batch(meta.batchId), "1"] : [this.keys.rollout(meta.id), "0"];
  }

  /**
   * Store a stage receipt and advance status; false if the rollout is terminal/closed, or if
   * another receipt of the stage is stored already (receipts are written once; the same receipt
   * again is true). With `attach`, the created sandbox's entry is stored first (whatever the
   * status; not when another receipt is there). With `next`, the next stage's job is added in the
   * same round trip, after the receipt (Redis runs one connection's commands in order), whether or
   * not the receipt was stored: a next stage that finds the rollout closed or terminal skips.
   */
  async saveReceipt<S extends StageName>(
    meta: Pick<RolloutMeta, "id" | "batchId">,
    stage: S,
    receipt: ReceiptOf<S>,
    newStatus: RolloutStatus,
    now: number,
    options: Parameters<RolloutStore["storeReceipt"]>[5] = {},
  ): Promise<boolean> {
    return (await this.storeReceipt(meta, stage, receipt, newStatus, now, options)) === "stored";
  }

  /**
   * `saveReceipt`, saying why a receipt was not stored: `refused` (terminal or closed; an
   * `attach` entry was stored), `superseded` (fenced, and the fence is not this launch's or
   * delivery's: nothing was written) or `taken` (another receipt of the stage is stored: nothing
   * was written).
   */
  async storeReceipt<S extends StageName>(
    meta: Pick<RolloutMeta, "id" | "batchId">,
    stage: S,
    receipt: ReceiptOf<S>,
    newStatus: RolloutStatus,
    now: number,
    options: {
      attach?: SandboxEntry;
      next?: NextStage;
      /** Store only while this launch token holds the rollout's fence (a run's receipt). */
      fence?: string;
      /** Store only while this delivery holds its stage's fence (a verify's or a seed's receipt). */
      deliveryFence?: DeliveryFence;
    } = {},
  ): Promise<"stored" | "refused" | "taken" | "superseded"> {
    // Bounded (DESIGN §2 rule 13); the answer a match verifier grades is never cut.
    const json = fitRecordJson(RECEIPT_SCHEMAS[stage].parse(receipt), MAX_RECORD_BYTES, RECEIPT_KEEP);
    const [batchKey, hasBatch] = this.batchArgs(meta);
    const keys = [this.keys.rollout(meta.id), batchKey, this.keys.sandboxes()];
    const args = [
      `r:${stage}`,
      json,
      newStatus,
      stage,
      `t:${stage}:end`,
      String(now),
      hasBatch,
      stage === "close" ? "1" : "0",
      options.attach ? options.attach.key : "",
      options.attach ? JSON.stringify(SandboxEntry.parse(options.attach)) : "",
      ...(options.fence
        ? [`launched:${options.fence}`, "fence"]
        : options.deliveryFence
          ? [options.deliveryFence.token, options.deliveryFence.field]
          : ["", ""]),
    ];
    const next = options.next;
    const r = next
      ? await next.queues.enqueueAfter(next.stage, meta.id, "fleetReceipt", keys, args)
      : await this.batcher.call("fleetReceipt", keys, args);
    return r === 1 ? "stored" : r === 2 ? "taken" : r === 3 ? "superseded" : "refused";
  }

  /**
   * Note that a verify attempt works in the sandbox from now (stages, then starts, its tests): a
   * verify delivered again waits that out, counted from then (`begin` returns it as
   * `times["verify:prev"]`). With `at` null, clear the note (its staging failed: nothing started,
   * so a retry need not wait). Only while `token` holds the verify fence
   * (`BeginOptions.verifyToken`): `superseded` when a later attempt began since (this one must
   * not touch the sandbox: the other is verifying); `terminal` (nothing done) on a terminal rollout.
   */
  async noteVerifyWork(
    id: string,
    at: number | null,
    token: string,
  ): Promise<"noted" | "superseded" | "terminal"> {
    const r = Number(
      // '1': this release's verify honours the sandbox's verify fence (its staging and runner).
      await this.redis.fleetNoteVerify(this.keys.rollout(id), at === null ? "" : String(at), token, "1"),
    );
    return r === 1 ? "noted" : r === -1 ? "superseded" : "terminal";
  }

  /**
   * The sandbox's verify fence holds `atLeast`, above every epoch Redis gave the rollout's verify
   * attempts (Redis lost `vepoch`: a failover, a restore): raise it, so that the next attempt's
   * epoch is above the fence. Returns the epoch now.
   */
  async raiseVerifyEpoch(id: string, atLeast: number): Promise<number> {
    return Number(await this.redis.fleetRaiseVerifyEpoch(this.keys.rollout(id), String(atLeast)));
  }

  /**
   * A verify attempt handed back at shutdown claims the sweep of its tests for `windowMs` (by
   * Redis's clock) before it sweeps (`fleetTestsSweep`): only while `token` holds the verify
   * fence, atomically with that check. A later attempt's `begin` returns how long the claim has
   * left (`testsSweepLeftMs`); it waits for `endTestsSweep` or the claim's end before it works in
   * the sandbox.
   */
  async claimTestsSweep(
    id: string,
    token: string,
    windowMs: number,
  ): Promise<{ claimed: true; claim: string } | { claimed: false; why: "superseded" | "terminal" }> {
    const r: unknown = await this.redis.fleetTestsSweep(
      this.keys.rollout(id),
      "claim",
      String(windowMs),
      token,
    );
    if (typeof r === "string") return { claimed: true, claim: r };
    return { claimed: false, why: Number(r) === -1 ? "superseded" : "terminal" };
  }

  /**
   * The sweep `claim` ended (a later claim is left alone). With `notedAt`, its tests were
   * confirmed stopped: the note of that attempt's work in the sandbox goes too, if it is still
   * the note (`noteVerifyWork` at `notedAt`), so the next attempt has nothing to wait out.
   */
  async endTestsSweep(id: string, claim: string, notedAt: number | null): Promise<void> {
    await this.redis.fleetTestsSweep(
      this.keys.rollout(id),
      "end",
      claim,
      notedAt === null ? "" : String(notedAt),
    );
  }

  /** How long a sweep claim has left, by Redis's clock (0: none). */
  async testsSweepLeftMs(id: string): Promise<number> {
    return Number(await this.redis.fleetTestsSweep(this.keys.rollout(id), "left"));
  }

  /**
   * When a verify attempt last noted work in the sandbox (`noteVerifyWork`), if one did, and
   * whether that attempt has left it since (`leaveVerifyWork`).
   */
  async verifyNote(id: string): Promise<{ at: number; left: boolean } | undefined> {
    const [at, by] = await this.redis.hmget(this.keys.rollout(id), "t:verify:last", "vnote");
    return at === null || at === undefined ? undefined : { at: Number(at), left: by === `left:${at}` };
  }

  /**
   * A verify attempt that noted work in the sandbox ends without handing its verdict on (its exec
   * broke, say): its code touches the sandbox no more. If the note is still its own (`token`'s),
   * a later attempt's `begin` says so (`earlierVerifyLeft`), and that attempt may stop the
   * tests still running there rather than wait out their budget. False when the note is not
   * its own (none, a later attempt's, or already marked).
   */
  async leaveVerifyWork(id: string, token: string): Promise<boolean> {
    return Number(await this.redis.fleetLeaveVerify(this.keys.rollout(id), token)) === 1;
  }

  /**
   * Count a close enqueued for this rollout after one ended without finalizing (by the deadline
   * watchdog, or by a stage worker for a close job BullMQ failed as stalled): the count so far,
   * this one included (0 for a rollout unknown or terminal). Past `CLOSE_AGAIN_LIMIT` no close
   * is enqueued again and the janitor closes the rollout itself. With `expected`, the count its
   * caller read before it found no close under way: counted only if it is still that, else
   * nothing is and the count now comes back negated (another caller counted, and acts on it).
   * The same call sent again (`callId`; a reconnect lost its reply) answers the count it made.
   */
  async noteCloseAgain(id: string, expected?: number, callId: string = randomUUID()): Promise<number> {
    return Number(await this.redis.fleetNoteCloseAgain(this.keys.rollout(id), expected ?? "", callId));
  }

  /** Whether the delivery still holds its stage's fence (no later delivery of the stage began). */
  async holdsFence(id: string, fence: DeliveryFence): Promise<boolean> {
    const value = await this.redis.hget(this.keys.rollout(id), fence.field);
    // A run launch's fence a stop took ('stopped': a cancel, a close) went to no other launch:
    // the launch was stopped, not taken over.
    return value === fence.token || (fence.field === "fence" && value === "stopped");
  }

  /**
   * Keep the first terminal failure; later ones only go to the failure log. Returns true if
   * stored. The log row and the field are one MULTI: a call that failed wrote neither, so trying
   * it again never logs the failure twice.
   */
  async recordFailure(
    id: string,
    failure: FailureRecord,
    options: {
      /** Only while the result is still open: not once close began or the rollout is graded. */
      beforeDecided?: boolean;
      /** With `beforeDecided`: only while this delivery holds its stage's fence (a verify's or a seed's failure). */
      deliveryFence?: DeliveryFence;
    } = {},
  ): Promise<boolean> {
    const parsed = FailureRecord.parse(failure);
    const json = fitRecordJson(parsed); // one bounded serialisation for the log and the field
    if (options.beforeDecided && parsed.terminal) {
      // Logged only when it decides: a refused one (the result was decided already) would show
      // in that result's failures as if it had counted.
      const fence = options.deliveryFence
        ? [options.deliveryFence.field, options.deliveryFence.token]
        : ["", ""];
      // The call's id: the same call sent again (a reconnect lost its reply) is told it set the failure.
      const set =
        (await this.redis.fleetSetField(
          this.keys.rollout(id),
          "failure",
          json,
          "2",
          ...fence,
          randomUUID(),
        )) === 1;
      if (set) await execAll(this.appendFailure(this.redis.multi(), id, json), `log a failure of ${id}`);
      return set;
    }
    const tx = this.appendFailure(this.redis.multi(), id, json);
    if (parsed.terminal) {
      scriptsIn(tx).fleetSetField(this.keys.rollout(id), "failure", json, "1", "", "", randomUUID());
    }
    const replies = await execAll(tx, `record the failure of ${id}`);
    return parsed.terminal && replies.at(-1) === 1;
  }

  /** Append to the bounded per-rollout failure log (retries included). */
  async logFailure(id: string, failure: FailureRecord): Promise<void> {
    await execAll(
      this.appendFailure(this.redis.multi(), id, fitRecordJson(failure)),
      `log a failure of ${id}`,
    );
  }

  private appendFailure(tx: ChainableCommander, id: string, json: string): ChainableCommander {
    const key = this.keys.failures(id);
    tx.rpush(key, json).ltrim(key, -20, -1);
    // With retention on, the log outlives its rollout's whole life from any append (finalize then
    // cuts it to the result's retention), and a late append after finalize still expires. Off,
    // it expires with its rollout once that has an expiry (a late append after a finalize by a
    // release with retention, which could not cut a log that did not exist yet).
    if (this.resultTtlMs > 0) tx.pexpire(key, this.resultTtlMs + LONGEST_LIFE_MS);
    else scriptsIn(tx).fleetFailuresFollow(key, this.keys.rollout(id));
    return tx;
  }

  /** The rollout's failure log: its rows that read as failure records (see `readFailureLog`). */
  async failureLog(id: string): Promise<FailureRecord[]> {
    return readFailureLog(await this.redis.lrange(this.keys.failures(id), 0, -1)).failures;
  }

  /**
   * Durable tombstone; after it no seed creates a sandbox. Returns the previous fence ('' for none,
   * and for a rollout with no record, for which nothing is written).
   */
  async tombstone(id: string): Promise<string> {
    return String(await this.redis.fleetTombstone(this.keys.rollout(id)));
  }

  /**
   * Fenced launch: `previous` is 'stopped' if a stop won; 'superseded' if this token claimed
   * before and the fence has moved on since (a later delivery claimed, or this claim was given
   * back): this claim sent again late (ioredis re-sends one whose reply a reconnect lost) takes
   * nothing back; otherwise the previous fence ('' on the first launch). `launches` counts
   * launches so far, this one included (0 when stopped or superseded).
   */
  async claimLaunch(id: string, token: string): Promise<{ previous: string; launches: number }> {
    const [previous, launches] = (await this.redis.fleetClaimLaunch(this.keys.rollout(id), token)) as [
      string,
      number,
    ];
    return { previous: String(previous), launches: Number(launches) };
  }

  /**
   * Cancel what a batch's admission records from now on (a batch cancelled while it is being
   * admitted: its later rollouts are recorded cancelled, and stop at their seed), and note the
   * batch's cancel under way, dated `at` (see `Keys.cancelling`). False for no such batch.
   */
  async cancelBatchAdmission(batchId: string, at: number): Promise<boolean> {
    return (
      Number(
        await this.redis.fleetCancelBatch(
          this.keys.batch(batchId),
          this.keys.cancelling(),
          batchId,
          String(at),
        ),
      ) === 1
    );
  }

  /**
   * Request cancellation; returns the status it found, null for an unknown rollout, or
   * `"unreadable"` for a status this release does not know (another release's, in a rolling
   * upgrade; an edit): such a rollout is asked to stop all the same. It threw, and one such
   * rollout stopped a batch's cancel short of the rest, again at every janitor pass.
   */
  async requestCancel(id: string): Promise<RolloutStatus | "unreadable" | null> {
    const prev = String(await this.redis.fleetCancel(this.keys.rollout(id)));
    if (prev === "") return null;
    const status = RolloutStatus.safeParse(prev);
    return status.success ? status.data : "unreadable";
  }

  /**
   * The fields `currentStage` reads, raw: for a record that does not parse as a whole (a torn
   * receipt), whose stage and times are most often intact.
   */
  async stageFields(id: string): Promise<{ stage: string; times: Record<string, number> }> {
    const fields = ["stage", "t:seed:start", "t:run:start", "t:verify:start", "t:close:start"];
    const values = await this.redis.hmget(this.keys.rollout(id), ...fields);
    const times: Record<string, number> = {};
    for (const [i, v] of values.entries()) {
      if (i > 0 && v !== null && Number.isFinite(Number(v))) times[fields[i]!.slice(2)] = Number(v);
    }
    return { stage: values[0] ?? "", times };
  }

  /**
   * Say how many seeds this process's seed-ahead bound (`self`) is making now, until `expiresAt`
   * (the fleet's clock; it says so again before then while it lives), and learn how many the
   * other processes' bounds are making, as each last said: entries past their expiry (a process
   * that died) are not counted, and are removed (in one script: an entry said again meanwhile
   * stays). The hash lasts at least as long as the entry: its expiry is only ever lengthened.
   */
  async shareSeeding(self: string, seeds: number, now: number, expiresAt: number): Promise<number> {
    return Number(await this.sayingSeeds(self, seeds, now, expiresAt, true));
  }

  /** `shareSeeding`'s saying alone (no read): for a process that let more seeds in since. */
  async saySeeding(self: string, seeds: number, now: number, expiresAt: number): Promise<void> {
    await this.sayingSeeds(self, seeds, now, expiresAt, false);
  }

  /** This process's entry (`shareSeeding`), the hash's expiry lengthened to it, and with `read` the others' seeds. */
  private sayingSeeds(self: string, seeds: number, now: number, expiresAt: number, read: boolean) {
    const ttl = String(Math.max(1, expiresAt - now));
    const args = [this.keys.seeding(), self, `${seeds}:${expiresAt}`, ttl];
    return read ? this.redis.fleetSayEntry(...args, String(now)) : this.redis.fleetSayEntry(...args);
  }

  /**
   * Of `ids` (in their order), whether each rollout's seed will make no sandbox: it is gone, has a
   * cancel requested, or its close began (finished ones included: their close set `closed`), so
   * its seed's begin skips it. One round trip. One whose record cannot be read (not a hash:
   * WRONGTYPE) is said false, as if waiting (its begin reports it), not an error for all of them.
   */
  async seedsSkipped(ids: readonly string[]): Promise<boolean[]> {
    const pipe = this.redis.pipeline();
    for (const id of ids) pipe.hmget(this.keys.rollout(id), "status", "cancel", "closed");
    const replies = (await pipe.exec()) ?? [];
    return ids.map((_, i) => {
      const [err, fields] = replies[i] ?? [null, null];
      if (err) return false;
      const [status, cancel, closed] = fields as Array<string | null>;
      return status === null || cancel === "1" || closed === "1";
    });
  }

  /** This process's seed-ahead bound is gone: its seeds are no longer counted (`shareSeeding`). */
  async forgetSeeding(self: string): Promise<void> {
    await this.redis.hdel(this.keys.seeding(), self);
  }

  /**
   * Say that a worker process (`self`, unique to it) consumes `queue` until `expiresAt` (the
   * fleet's clock; it says so again before then while it lives), and remove the entries of the
   * others past their expiry (a process that died), as `shareSeeding` does its own hash's: the
   * presence `workersPresent` counts where Redis refuses `CLIENT LIST`.
   */
  async sayWorkerPresent(queue: string, self: string, now: number, expiresAt: number): Promise<void> {
    const ttl = String(Math.max(1, expiresAt - now));
    await this.redis.fleetSayEntry(this.keys.workers(queue), self, `1:${expiresAt}`, ttl, String(now));
  }

  /** How many worker processes said they consume `queue` (`sayWorkerPresent`) and have not expired at `now`. */
  async workersPresent(queue: string, now: number): Promise<number> {
    return Number(await this.redis.fleetCountEntries(this.keys.workers(queue), String(now)));
  }

  /** This worker process no longer consumes `queue` (a graceful close): no longer counted. */
  async forgetWorkerPresent(queue: string, self: string): Promise<void> {
    await this.redis.hdel(this.keys.workers(queue), self);
  }

  /**
   * A live stage's heartbeat, `times["<stage>:beat"]`: the janitor's lost-job check
   * (`requeueLostJobs`) takes a rollout whose record changed within its grace for one a delivery
   * is working on. Not on a closed or gone rollout.
   */
  async beat(id: string, stage: StageName, at: number): Promise<boolean> {
    return Number(await this.redis.fleetBeat(this.keys.rollout(id), `t:${stage}:beat`, String(at))) === 1;
  }

  /**
   * Whether a running launch may go on: `stop` when a cancel, a close or a stop claim came;
   * `lost` when another launch took the fence (this one's was handed to another worker
   * meanwhile, and only that one may still act on the sandbox or store a receipt);
   * otherwise `run`.
   */
  async launchState(id: string, token: string): Promise<"run" | "stop" | "lost"> {
    const [cancel, closed, fence] = await this.redis.hmget(
      this.keys.rollout(id),
      "cancel",
      "closed",
      "fence",
    );
    if (cancel === "1" || closed === "1" || fence === "stopped") return "stop";
    if (fence !== `launched:${token}`) return "lost";
    return "run";
  }

  /** Undo a launch claim whose harness never started (see `fleetReleaseLaunch`). True if released. */
  async releaseLaunch(id: string, token: string, previous: string): Promise<boolean> {
    return (await this.redis.fleetReleaseLaunch(this.keys.rollout(id), token, previous)) === 1;
  }

  /**
   * What a run stopped by a close (a cancel, the rollout's deadline) had spent, for the rollout's
   * result: a stopped run stores no receipt. Kept for a close still to finalize, or put in a result
   * finalized already that says no usage (see `fleetStoppedRunUsage`). Nothing for a rollout gone,
   * or whose run receipt holds its usage, nor from a launch (`launch`, its claim's token and
   * number) that is not the rollout's last: one taken over (its spend is not the result's, as for a
   * run taken over unstopped), or one of a rollout admitted again under the same id since. Gaps
   * past `STOPPED_USAGE_GAPS` are left out, said as one.
   */
  async saveStoppedRunUsage(
    id: string,
    usage: Usage,
    launch: { token: string; launches: number },
  ): Promise<"none" | "kept" | "in-result"> {
    const parsed = Usage.parse(usage);
    const gaps = parsed.gaps.slice(0, STOPPED_USAGE_GAPS).map((g) => capText(g, 500));
    if (parsed.gaps.length > STOPPED_USAGE_GAPS) {
      gaps.push(`${parsed.gaps.length - STOPPED_USAGE_GAPS} more gap(s) not kept`);
    }
    const r = await this.redis.fleetStoppedRunUsage(
      this.keys.rollout(id),
      JSON.stringify({ ...parsed, gaps }),
      launch.token,
      String(launch.launches),
    );
    return r === 0 ? "none" : r === 2 ? "in-result" : "kept";
  }

  /**
   * Finalize exactly once (DESIGN §2 rule 1). True if this call did it, also when ioredis sent it
   * twice (its first reply lost to a reconnect): the finalized metrics count it. See `finalizeStored`.
   */
  async finalize(...args: Parameters<RolloutStore["finalizeStored"]>): Promise<boolean> {
    return (await this.finalizeStored(...args)) !== null;
  }

  /**
   * Finalize exactly once (DESIGN §2 rule 1): the result as stored if this call did it, else null
   * (the same call sent again by ioredis, its first reply lost to a reconnect, did it: its answer
   * is the result as given). `confirmed` names
   * sandbox keys whose destroy was confirmed: they leave the sandboxes hash and the teardown ledger
   * in the same script, whether or not this call finalizes. The teardown stored may differ from
   * `result`'s: pending when a sandbox of the rollout is left on the ledger or registered (one
   * that replaced the sandbox destroyed), confirmed when a pending one's sandboxes are all gone
   * by then (the janitor finished the teardown while this close ran). The usage stored may be a
   * stopped run's (`saveStoppedRunUsage`) where `result` has none; the copy returned says none.
   */
  async finalizeStored(
    meta: Pick<RolloutMeta, "id" | "batchId">,
    result: RolloutResult,
    now: number,
    closeReceipt?: CloseReceipt,
    /**
     * Sandbox keys whose destroy was confirmed; with `destroyed`, only the entries of that sandbox
     * (or handle-less ones) are forgotten (see `TeardownLedger.confirm`).
     */
    confirmed: readonly (string | { key: string; destroyed: SandboxHandle | null })[] = [],
    /** Identifies this call (a test may fix it, to send the same call twice). */
    callId: string = randomUUID(),
  ): Promise<RolloutResult | null> {
    if (!isTerminal(result.status)) throw new Error(`finalize needs a terminal status, got ${result.status}`);
    const parsed = RolloutResult.parse(result);
    const [batchKey, hasBatch] = this.batchArgs(meta);
    if (confirmed.length > 2) throw new Error("finalize confirms at most the rollout's two sandboxes");
    const r = await this.batcher.call(
      "fleetFinalize",
      [
        this.keys.rollout(meta.id),
        batchKey,
        this.keys.inflight(),
        this.keys.sandboxes(),
        this.keys.teardownEntries(),
        this.keys.teardownDue(),
        this.keys.failures(meta.id),
        meta.batchId !== null ? this.keys.batchIds(meta.batchId) : this.keys.rollout(meta.id),
        this.keys.networkRetries(),
        meta.batchId !== null ? this.keys.batchDone(meta.batchId) : this.keys.rollout(meta.id),
      ],
      [
        // A result saying no usage keeps room for a stopped run's, said without its gaps
        // (`fleetStoppedRunUsage`, which may come after): still within the bound.
        fitRecordJson(
          parsed,
          MAX_RECORD_BYTES - (parsed.usage === null ? STOPPED_USAGE_ROOM : 0),
          RESULT_KEEP,
        ),
        parsed.status,
        String(now),
        hasBatch,
        meta.id,
        closeReceipt ? JSON.stringify(CloseReceipt.parse(closeReceipt)) : "",
        confirmedKeyOf(confirmed[0]),
        confirmedKeyOf(confirmed[1]),
        sandboxKey(meta.id, "resources"),
        sandboxKey(meta.id, "agent"),
        String(this.resultTtlMs),
        callId,
        confirmedOnlyOf(confirmed[0]),
        confirmedOnlyOf(confirmed[1]),
      ],
    );
    // The script's edits of the result (see fleetFinalize), made here on the parsed copy.
    if (r === 2) {
      const kind =
        parsed.status === "completed" && parsed.failureKind === null ? "teardown_failed" : parsed.failureKind;
      return { ...parsed, teardown: "pending", failureKind: kind };
    }
    if (r === 3) {
      return {
        ...parsed,
        teardown: "confirmed",
        failureKind: parsed.failureKind === "teardown_failed" ? null : parsed.failureKind,
      };
    }
    return r === 1 ? parsed : null;
  }
}

/** Gaps of a stopped run's usage kept for its result (`saveStoppedRunUsage`). */
export const STOPPED_USAGE_GAPS = 20;

/**
 * Bytes a result saying no usage keeps free (`finalizeStored`), for a stopped run's usage put in
 * it later with its gaps said as one (`fleetStoppedRunUsage`): its four numbers and that gap.
 */
export const STOPPED_USAGE_ROOM = 256;

type Confirmed = string | { key: string; destroyed: SandboxHandle | null } | undefined;
function confirmedKeyOf(c: Confirmed): string {
  return c === undefined ? "" : typeof c === "string" ? c : c.key;
}
function confirmedOnlyOf(c: Confirmed): string {
  if (c === undefined || typeof c === "string") return "";
  return c.destroyed === null || !c.destroyed.id ? "-" : c.destroyed.id;
}

/** What `createBatch` returns when the idempotency key names a single rollout already. */
export const OTHER_ROUTE = "@other-route";

/** An admission's member in `Keys.admitting`: a batch's, or a single rollout's. */
export function admissionOf(of: { batchId: string } | { rolloutId: string }): string {
  return "batchId" in of ? `b:${of.batchId}` : `r:${of.rolloutId}`;
}
