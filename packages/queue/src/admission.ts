import { createHash, randomUUID } from "node:crypto";
import {
  ADMISSION_ALLOWANCE_MS,
  agentName,
  canonicalJson,
  describeOverCeiling,
  MAX_METADATA_BYTES,
  metadataOverLimit,
  type RolloutRequest,
  RUN_MARGIN_MS,
  runNeeds,
  type SandboxCeiling,
  sandboxOverCeiling,
  sha256Hex as sha256,
  stagedBytes,
  TaskContent,
  wholeSlice,
} from "@fleet/contracts";
import { admissionOf, OTHER_ROUTE, type RolloutMeta, type RolloutStore } from "./rollout-store.ts";
import type { StageQueues } from "./stage-queues.ts";

/** Slack added to the task's own timeouts for queueing, seeding and closing, when no deadline is given. */
export const DEFAULT_DEADLINE_SLACK_S = 3600;

export interface AdmissionOptions {
  /** Largest task accepted, in bytes of canonical JSON (DESIGN §4: default 10 MiB → 413). */
  maxTaskBytes: number;
  now?: number;
  /**
   * Called once every check that can refuse the request has passed, before anything of it is
   * written; what it throws ends the admission. The dispatcher reserves backlog room here, so a
   * request it must refuse (422, 413) gets that answer, never a 429 to retry for. Given the
   * submission's body hash when `admit` calls it (what names the very same request).
   */
  beforeRecord?: (bodyHash?: string) => Promise<void>;
  /**
   * Called once the rollouts are recorded (they count as in flight from then), before their
   * seeds are enqueued: the dispatcher gives back the room it reserved, which would otherwise
   * count them twice while the seeds go in.
   */
  afterRecord?: () => Promise<void>;
  /**
   * A replay of a batch admitted already (its stored body this one): its deadlines were admitted
   * under the bound of their day, and its rest must stay admittable (no stricter bound since).
   */
  replay?: boolean;
  /** The operator's ceiling on a request's `sandbox` options (`FLEET_SANDBOX_MAX_*`): over it, 422. */
  sandboxCeiling?: SandboxCeiling;
}

export interface Admitted {
  batchId: string | null;
  ids: string[];
  /** Ids created by this call (the rest already existed: an idempotent replay). */
  created: string[];
}

/**
 * Deepest nesting (arrays/objects) a request may have. `metadata` is free JSON, but hashing,
 * storing and echoing it recurses: a body nested thousands deep would overflow the stack (a
 * 500), so it is refused up front (422).
 */
export const MAX_REQUEST_DEPTH = 64;

/** `MAX_METADATA_BYTES` lives in @fleet/contracts (the CLI checks it too); exported here as before. */
export { MAX_METADATA_BYTES };

/** Nesting depth of a JSON value, counted without recursion; stops counting once past `limit`. */
export function jsonDepth(value: unknown, limit = Number.POSITIVE_INFINITY): number {
  return inspectJson(value, limit).depth;
}

/**
 * Nesting depth (stops counting once past `limit`) and the path of the first number JSON cannot
 * carry (`1e999` parses to Infinity: hashing and storing it would fail), without recursion.
 */
function inspectJson(value: unknown, limit: number): { depth: number; nonFinite: string | null } {
  let max = 0;
  const stack: [unknown, number, string][] = [[value, 0, ""]];
  while (stack.length > 0) {
    const [v, d, path] = stack.pop()!;
    if (typeof v === "number" && !Number.isFinite(v)) return { depth: max, nonFinite: path };
    if (v === null || typeof v !== "object") continue;
    const depth = d + 1;
    if (depth > max) {
      max = depth;
      if (max > limit) return { depth: max, nonFinite: null };
    }
    for (const [key, child] of Object.entries(v)) {
      stack.push([child, depth, path === "" ? key : Array.isArray(v) ? `${path}[${key}]` : `${path}.${key}`]);
    }
  }
  return { depth: max, nonFinite: null };
}

/**
 * What admission refuses in a request's shape before anything else reads it (hashing included):
 * nesting deeper than `MAX_REQUEST_DEPTH`, a number JSON cannot carry, `metadata` over
 * `MAX_METADATA_BYTES`. Throws AdmissionError `invalid` (422).
 */
export function checkRequestShapes(requests: readonly RolloutRequest[]): void {
  for (const [i, req] of requests.entries()) checkRequestShape(req, i);
}

/** `checkRequestShapes` for request `i` of a submission. */
function checkRequestShape(req: RolloutRequest, i: number): void {
  {
    const { depth, nonFinite } = inspectJson(req, MAX_REQUEST_DEPTH);
    if (depth > MAX_REQUEST_DEPTH) {
      throw new AdmissionError("invalid", `rollout ${i}: nested more than ${MAX_REQUEST_DEPTH} levels deep`, {
        index: i,
        maxDepth: MAX_REQUEST_DEPTH,
      });
    }
    if (nonFinite !== null) {
      throw new AdmissionError(
        "invalid",
        `rollout ${i}: ${nonFinite} is a number too large for JSON (non-finite)`,
        { index: i, issues: [{ path: nonFinite, message: "must be a finite number" }] },
      );
    }
    const over = req.metadata ? metadataOverLimit(req.metadata) : null;
    if (over !== null) {
      throw new AdmissionError("invalid", `rollout ${i}: ${over.message}`, {
        index: i,
        bytes: over.bytes,
        limit: MAX_METADATA_BYTES,
      });
    }
  }
}

/**
 * Longest stretch of the event loop admission's work on a submission's rows keeps (checking,
 * serialising, resolving tasks: about 25 µs a row on a loaded host, seconds for a large batch)
 * before it hands the loop on, so the dispatcher answers other requests meanwhile.
 */
export const ADMISSION_SLICE_MS = 10;

/** Called between rows: hands the event loop on once `sliceMs` of work has passed since it last did. */
function eventLoopPacer(sliceMs = ADMISSION_SLICE_MS): () => Promise<void> {
  let since = performance.now();
  return async () => {
    if (performance.now() - since < sliceMs) return;
    await new Promise<void>((resolve) => setImmediate(resolve));
    since = performance.now();
  };
}

/** Requests checked and serialised (`serializeRequests`): each one's canonical JSON, and the body hash. */
export interface Serialized {
  canonical: string[];
  bodyHash: string;
}

/**
 * Each request checked (`checkRequestShapes`) and serialised once, and the submission's body hash
 * (sha256 of the array of them: `[c0,c1,...]`) taken row by row, the event loop handed on every
 * `ADMISSION_SLICE_MS`. Joined and hashed whole after the rows, 40,000 of them (8.5 MiB) held the
 * loop for 0.23-0.38 s.
 */
export async function serializeRequests(requests: readonly RolloutRequest[]): Promise<Serialized> {
  const pace = eventLoopPacer();
  const canonical: string[] = [];
  const hash = createHash("sha256").update("[");
  for (const [i, req] of requests.entries()) {
    await pace();
    checkRequestShape(req, i);
    const json = canonicalJson(req);
    canonical.push(json);
    if (i > 0) hash.update(",");
    hash.update(json, "utf8");
  }
  return { canonical, bodyHash: hash.update("]").digest("hex") };
}

/** Digest of a task: sha256 of its canonical JSON. Pass a parsed `TaskContent` (defaults applied): raw input digests differently. */
export function digestTask(task: TaskContent): string {
  return sha256(canonicalJson(task));
}

export class AdmissionError extends Error {
  override readonly name = "AdmissionError";
  constructor(
    readonly code: "invalid" | "payload_too_large" | "conflict",
    message: string,
    readonly details: unknown = null,
  ) {
    super(message);
  }
}

/**
 * Resolve each request's task (store inline ones content-addressed, check referenced digests),
 * and build the rollout metadata. Throws AdmissionError for what the API answers 4xx to.
 */
export async function prepareRollouts(
  store: RolloutStore,
  requests: readonly RolloutRequest[],
  ids: readonly string[],
  batchId: string | null,
  options: AdmissionOptions,
  /** Each request's canonical JSON, when the caller has it already. */
  canonical: readonly string[] = requests.map((r) => canonicalJson(r)),
): Promise<RolloutMeta[]> {
  const now = options.now ?? Date.now();
  const tasks = new Map<string, TaskContent>();
  const metas: RolloutMeta[] = [];
  const pace = eventLoopPacer();
  for (const [i, req] of requests.entries()) {
    await pace();
    // Over what this fleet's operator allows a sandbox: a worker would fail it before making one.
    // (A replay's rest was admitted under the ceiling of its day, as its deadlines were.)
    const over =
      options.sandboxCeiling && !options.replay
        ? sandboxOverCeiling(req.sandbox, options.sandboxCeiling)
        : [];
    if (over.length > 0) {
      throw new AdmissionError("invalid", `rollout ${i}: ${describeOverCeiling(over)}`, {
        index: i,
        issues: over,
      });
    }
    let task: TaskContent;
    let digest: string;
    if ("digest" in req.task) {
      digest = req.task.digest;
      const known = tasks.get(digest) ?? (await storedTask(store, digest, i));
      if (!known) {
        throw new AdmissionError("invalid", `rollout ${i}: unknown task digest ${digest}`, {
          index: i,
          digest,
        });
      }
      task = known;
    } else {
      task = TaskContent.parse(req.task);
      const json = canonicalJson(task);
      const bytes = Buffer.byteLength(json);
      // (A replay's rest was admitted under the task bound of its day, as its deadlines were: a
      // 413 now would have its client split it into new batches under new keys, run twice.)
      if (bytes > options.maxTaskBytes && !options.replay) {
        throw new AdmissionError(
          "payload_too_large",
          `rollout ${i}: task ${task.id} is ${bytes} bytes, over the limit of ${options.maxTaskBytes}`,
          { index: i, bytes, limit: options.maxTaskBytes },
        );
      }
      digest = sha256(json);
    }
    if (!tasks.has(digest)) tasks.set(digest, task);
    if (req.agent.sandbox === "own" && task.verifier.kind === "tests") {
      throw new AdmissionError(
        "invalid",
        `rollout ${i}: agent.sandbox "own" leaves the task sandbox untouched, so task ${task.id}'s tests could not see the agent's work; use a match verifier or the default "borrow"`,
        { index: i },
      );
    }
    // The oracle runs the task's solution/solve.sh (looked up by that exact key, as the harness
    // does): without one it could only fail as `invalid_task` after a sandbox was made. Checked
    // for a task by digest too: it is read here anyway.
    if (req.agent.harness === "oracle" && task.solution["solve.sh"] === undefined) {
      const message = "is missing: the oracle agent runs it";
      throw new AdmissionError("invalid", `rollout ${i}: task ${task.id}'s solution/solve.sh ${message}`, {
        index: i,
        issues: [{ path: "task.solution.solve.sh", message }],
      });
    }
    // File sets their sandbox directory cannot hold (`sandbox.tmpfsMb`, `diskMb` set small):
    // tests that do not fit /tests fail only once staged for verification, after the agent ran.
    const tooBig = options.replay ? null : fileSetsOverCaps(task, req);
    if (tooBig !== null) {
      throw new AdmissionError("invalid", `rollout ${i}: ${tooBig.path} ${tooBig.message}`, {
        index: i,
        issues: [tooBig],
      });
    }
    // A deadline shorter than what a run needs (the agent's timeout, the tests', the margin) could
    // only mask the rollout (its run is masked before it starts: `runBudgetShortfall`): refused.
    const needs = runNeeds(task, req.agent);
    const leastMs = needs.needMs + ADMISSION_ALLOWANCE_MS;
    if (req.deadlineS !== undefined && req.deadlineS * 1000 < leastMs && !options.replay) {
      const message = `${req.deadlineS} s is shorter than the ${leastMs / 1000} s a rollout needs (the agent's timeout, ${needs.ownS} s${needs.verifyS > 0 ? `, the tests', ${needs.verifyS} s,` : ""} ${RUN_MARGIN_MS / 1000} s to stop and grade, and ${ADMISSION_ALLOWANCE_MS / 1000} s before its run starts): the rollout could never be graded, only masked; raise deadlineS or lower agent.timeoutS`;
      throw new AdmissionError("invalid", `rollout ${i}: deadlineS ${message}`, {
        index: i,
        issues: [{ path: "deadlineS", message }],
      });
    }
    const deadlineS =
      req.deadlineS ??
      (req.agent.timeoutS ?? task.timeouts.agentS) + task.timeouts.verifierS + DEFAULT_DEADLINE_SLACK_S;
    metas.push({
      id: ids[i]!,
      batchId,
      bodyHash: sha256(canonical[i]!),
      taskDigest: digest,
      taskId: task.id,
      agent: req.agent,
      agentName: agentName(req.agent),
      sandbox: req.sandbox,
      metadata: req.metadata ?? null,
      createdAt: now,
      deadlineAt: now + Math.round(deadlineS * 1000),
    });
  }
  await options.beforeRecord?.();
  for (const [digest, task] of tasks) await store.putTask(task, digest);
  return metas;
}

/** A stored record that does not parse: JSON torn, or written under an older, looser schema. */
export function isInvalidStoredData(err: unknown): err is Error {
  return err instanceof SyntaxError || (err instanceof Error && err.name === "ZodError");
}

/** A stored task by digest; one stored under an older, looser schema is refused (send it inline). */
async function storedTask(store: RolloutStore, digest: string, index: number): Promise<TaskContent | null> {
  try {
    return await store.getTask(digest);
  } catch (err) {
    if (!isInvalidStoredData(err)) throw err;
    throw new AdmissionError(
      "invalid",
      // Cut between characters (`wholeSlice`): the issues name the task's files as they are.
      `rollout ${index}: stored task ${digest} is no longer valid (${wholeSlice(err.message, 0, 300)}); send the task inline`,
      { index, digest },
    );
  }
}

/** Rollout ids: random, or derived from an idempotency key so a replay lands on the same ids. */
export function rolloutIds(count: number, idempotencyKey: string | null, scope: string): string[] {
  const base = idempotencyKey
    ? sha256(`${scope}:${idempotencyKey}`).slice(0, 24)
    : randomUUID().replaceAll("-", "");
  if (scope === "rollout") return [base];
  return Array.from({ length: count }, (_, i) => `${base.slice(0, 20)}-${i}`);
}

/** A batch's id, derived from its rollout ids (so an idempotent replay finds the same batch). */
export function batchIdFor(ids: readonly string[]): string {
  return `b${ids[0]!.slice(0, 20)}`;
}

/**
 * Admit one rollout or a batch: idempotent by key (same key + same body → same ids, different
 * body → conflict), records first, then seed jobs (deterministic ids, so a replay re-enqueues
 * nothing twice).
 */
export async function admit(
  store: RolloutStore,
  queues: StageQueues,
  input: {
    requests: readonly RolloutRequest[];
    batch: boolean;
    idempotencyKey?: string | null;
    /** `serializeRequests(requests)`, when the caller has it already. */
    serialized?: Serialized | undefined;
  },
  options: AdmissionOptions,
): Promise<Admitted> {
  const { canonical, bodyHash } = input.serialized ?? (await serializeRequests(input.requests));
  const now = options.now ?? Date.now();
  const key = input.idempotencyKey ?? null;
  const ids = rolloutIds(input.requests.length, key, input.batch ? "batch" : "rollout");
  const batchId = input.batch ? batchIdFor(ids) : null;

  // One key names one request: the same key on the other route is another body (409), not a
  // second admission under it. Checked first here (no work for a request that is refused), and
  // atomically with the writes (`createBatch`, `store.admit`): two at once cannot both pass.
  const keyRolloutId = key && input.batch ? rolloutIds(1, key, "rollout")[0]! : undefined;
  const keyBatchId = key && !input.batch ? batchIdFor(rolloutIds(1, key, "batch")) : undefined;
  const differentBatchBody = () =>
    new AdmissionError("conflict", "Idempotency-Key was used with a different batch body", { batchId });
  const otherRoute = () =>
    new AdmissionError(
      "conflict",
      `Idempotency-Key was used for ${input.batch ? "a single rollout (POST /v1/rollouts)" : "a batch (POST /v1/batches)"}; a key names one request`,
      keyRolloutId !== undefined ? { rolloutId: keyRolloutId } : { batchId: keyBatchId },
    );
  if (keyRolloutId !== undefined && (await store.exists(keyRolloutId))) throw otherRoute();
  if (keyBatchId !== undefined && (await store.batchExists(keyBatchId))) throw otherRoute();
  if (key && !input.batch) {
    const existing = await store.get(ids[0]!);
    if (existing) {
      const reqHash = sha256(canonical[0]!);
      if (existing.meta.bodyHash !== reqHash) {
        throw new AdmissionError("conflict", "Idempotency-Key was used with a different request body", {
          rolloutId: ids[0],
        });
      }
      // A replay after a crash between recording the rollout and enqueueing its seed: enqueue
      // it now (deduplicated by job id when it is already there).
      if (existing.status === "accepted") {
        await queues.enqueueSeeds(ids);
        await store.admissionDone(admissionOf({ rolloutId: ids[0]! }));
      }
      return { batchId: null, ids, created: [] };
    }
  }
  // Every check that can refuse the request comes before anything of it is recorded: a refused
  // batch leaves no batch behind, and its key stays free for the corrected body.
  // A replay of a batch recorded already (cut short, or its answer lost) finishes it as it was
  // admitted, whatever bound a later release put on deadlines.
  const storedHash = batchId !== null && key !== null ? (await store.getBatch(batchId))?.bodyHash : null;
  const replay = storedHash === bodyHash;
  // Another body under a batch's key is a 409 whatever else holds, told now: it must not wait
  // behind `beforeRecord` (the dispatcher's backlog room), whose 429 a client retries for as long
  // as the fleet stays busy, for a request that can never be admitted. (`createBatch` below still
  // decides atomically, for two first requests at once.)
  if (typeof storedHash === "string" && !replay) throw differentBatchBody();
  const before = options.beforeRecord;
  const metas = await prepareRollouts(
    store,
    input.requests,
    ids,
    batchId,
    { ...options, now, replay, ...(before ? { beforeRecord: () => before(bodyHash) } : {}) },
    canonical,
  );
  const expiring = (expired: readonly string[]) =>
    new AdmissionError(
      "conflict",
      `batch ${batchId} has finished and its rollouts are expiring (retention): its Idempotency-Key replays it only while it is kept; submit it again under a new key`,
      { batchId, expired: expired.slice(0, 10) },
    );
  const admission = batchId !== null ? admissionOf({ batchId }) : admissionOf({ rolloutId: ids[0]! });
  if (batchId !== null) {
    // A replay of a batch that finished and is expiring, some of whose rollouts are gone: refused
    // before anything of it is recorded (admitting its never-recorded rest would bring a batch
    // about to vanish back, and a client told to use a new key would run that rest twice).
    const gone = await store.expiredOfBatch(batchId);
    if (gone.length > 0) throw expiring(gone);
    const stored = await store.createBatch(batchId, bodyHash, now, keyRolloutId);
    if (stored === OTHER_ROUTE) throw otherRoute();
    if (stored !== bodyHash) throw differentBatchBody();
  }
  const { created, conflicting, expired, otherRoute: refused } = await store.admit(metas, now, keyBatchId);
  await options.afterRecord?.();
  if (refused.length > 0) throw otherRoute();
  if (expired.length > 0 && created.length === 0) {
    await store.admissionDone(admission);
    throw expiring(expired);
  }
  // (Expired rollouts beside created ones: a retention ended between the check above and the
  // admission. The rest is admitted and runs, as the check would have let it; those are gone.)
  if (conflicting.length > 0) {
    // Only a single rollout can get here (a batch's body is checked whole, atomically, above):
    // a concurrent request with the same key and another body recorded it first.
    throw new AdmissionError("conflict", "Idempotency-Key was used with a different request body", {
      rolloutId: conflicting[0],
    });
  }
  // Seeds for the rollouts this call recorded, and of those a replay found, the ones still
  // waiting for theirs (an admission cut short before its seeds): not for one gone (a batch still
  // running keeps a rollout that finished early only for its retention), seeded or finished,
  // whose seed job would only be dropped (unknown) or replayed by a worker.
  const recorded = new Set(created);
  const found = ids.filter((id) => !recorded.has(id));
  const waiting = new Set(found.length > 0 ? await store.unseeded(found) : []);
  await queues.enqueueSeeds(ids.filter((id) => recorded.has(id) || waiting.has(id)));
  // Not under way any more; one cut short before here is finished by the janitor (its seeds
  // enqueued) or by a replay.
  await store.admissionDone(admission);
  return { batchId, ids, created };
}

/**
 * The first of the task's file sets its sandbox directory cannot hold at the sizes the request
 * sets (`sandbox.tmpfsMb` for `/tests`, and `/solution` for the oracle, which stages it;
 * `sandbox.diskMb` for the workspace), as an issue on the size; null when all fit or none is set.
 * By their pages alone (`stagedBytes`): a near fit may still fail when staged.
 */
function fileSetsOverCaps(task: TaskContent, req: RolloutRequest): { path: string; message: string } | null {
  const { tmpfsMb, diskMb } = req.sandbox ?? {};
  const sets: Array<
    [keyof Pick<TaskContent, "tests" | "solution" | "workspace">, string, number | undefined]
  > = [
    ["tests", "tmpfsMb", tmpfsMb],
    ["solution", "tmpfsMb", req.agent.harness === "oracle" ? tmpfsMb : undefined],
    ["workspace", "diskMb", diskMb],
  ];
  for (const [set, option, mb] of sets) {
    if (mb === undefined) continue;
    const bytes = stagedBytes(task[set]);
    if (bytes > mb * 1024 * 1024) {
      return {
        path: `sandbox.${option}`,
        message: `of ${mb} MiB cannot hold task ${task.id}'s ${set} (${Math.ceil(bytes / 1024)} KiB staged, each file rounded up to 4 KiB): raise it`,
      };
    }
  }
  return null;
}
