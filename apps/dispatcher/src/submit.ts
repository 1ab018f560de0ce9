import { randomUUID } from "node:crypto";
import type { DispatcherConfig } from "@fleet/config";
import { sha256Hex } from "@fleet/contracts";
import {
  type Admitted,
  admit,
  BACKLOG_RESERVATION_TTL_MS,
  batchIdFor,
  type RolloutStore,
  rolloutIds,
  type Serialized,
  type StageQueues,
  serializeRequests,
} from "@fleet/queue";
import { HttpError, RETRY_AFTER_S, toHttpError } from "./http-error.ts";
import type { ParsedBatch } from "./requests.ts";
import { formatPath, type Issue } from "./zod-issues.ts";

export interface SubmitDeps {
  store: RolloutStore;
  queues: StageQueues;
  config: Pick<DispatcherConfig, "maxBacklog" | "maxTaskBytes"> &
    Partial<Pick<DispatcherConfig, "sandboxCeiling">>;
  now: () => number;
  /**
   * How long an admission's backlog reservation outlives its last refresh (it is refreshed every
   * third of this while the admission goes on). @defaultValue `BACKLOG_RESERVATION_TTL_MS`
   */
  reservationTtlMs?: number;
}

/**
 * Admit a submission: bound the backlog (429), then `admit` from @fleet/queue (records first,
 * then seed jobs; idempotent by key). An idempotent replay of something already admitted is
 * never refused for backpressure: the client is asking for what it already has.
 */
export async function submit(
  deps: SubmitDeps,
  parsed: ParsedBatch,
  options: {
    batch: boolean;
    idempotencyKey: string | null;
    /** Who submits (`RequestAuth.principal`): each token has keys of its own. */
    principal?: string;
  },
): Promise<Admitted> {
  const { store, queues, config } = deps;
  // A request without a key gets one of the server's: admission writes in several steps (records
  // in chunks, then seed jobs), and one cut short by Redis leaves part of it admitted. The error
  // answer then gives this key, and replaying the same body with it finishes the admission
  // instead of admitting the rest twice.
  const generatedKey = options.idempotencyKey === null ? `fleet-${randomUUID()}` : null;
  let idempotencyKey = scopedKey(options.principal ?? "", options.idempotencyKey ?? generatedKey);
  const incoming = parsed.requests.length;
  // A keyed request some of whose rollouts are admitted already (a replay, or one finishing an
  // admission cut short) reserves room only for the rest.
  let toAdmit =
    generatedKey === null && idempotencyKey !== null
      ? await notYetAdmitted(store, idempotencyKey, options.batch, incoming)
      : incoming;
  let replay = toAdmit === 0;
  // The requests checked and serialised, when the legacy lookup below needed them: `admit` reuses
  // them instead of doing it again.
  let serialized: Serialized | undefined;
  if (
    !replay &&
    generatedKey === null &&
    idempotencyKey !== null &&
    idempotencyKey !== options.idempotencyKey
  ) {
    // Admitted before keys were scoped to tokens (under the bare key): a retry across that
    // upgrade must still land on what it admitted, not admit it twice.
    // Only for the very same body: a bare key was shared by every token, and another token's
    // different request under it is no replay of this one.
    const legacy = options.idempotencyKey!;
    // It hashes the body, which `admit` otherwise checks first: a shape that would break the
    // hashing (nested too deep, 1e999) is a 422 here too. Checked and hashed handing the event
    // loop on (`serializeRequests`): in one stretch, 40,000 rows held it for 0.87 s (loaded host).
    try {
      serialized = await serializeRequests(parsed.requests);
    } catch (err) {
      throw options.batch ? inBody(err, parsed) : withoutIndex(err);
    }
    if (await admittedWithBody(store, legacy, options.batch, serialized)) {
      idempotencyKey = legacy;
      toAdmit = await notYetAdmitted(store, legacy, options.batch, incoming);
      replay = toAdmit === 0;
    }
  }
  // What it would admit can never fit the bound: 413, not a 429 to retry forever. Checked on what
  // is not admitted yet: a replay of a batch admitted under a higher bound (the dispatcher
  // restarted with a lower FLEET_MAX_BACKLOG) gets its batch back, where a 413 made a client split
  // it into new batches under new keys, admitting its rollouts twice.
  if (toAdmit > config.maxBacklog) {
    throw new HttpError(
      413,
      "payload_too_large",
      `a batch of ${incoming} rollouts can never fit the backlog bound of ${config.maxBacklog}; split it`,
      { incoming, maxBacklog: config.maxBacklog },
    );
  }
  // The room is reserved in the same step as the check: submissions arriving together cannot
  // each see room for themselves and pass the bound together. Reserved once the request has
  // passed every check that refuses it for good: a request that can never be admitted gets its
  // 4xx, not a 429 that a client retries for as long as the fleet stays busy.
  const reservation = { release: async () => {} };
  const ttlMs = deps.reservationTtlMs ?? BACKLOG_RESERVATION_TTL_MS;
  const reserve = async (bodyHash?: string) => {
    if (replay) return;
    // A request with the client's key, sent again while the first is still being admitted
    // (a client-side timeout's retry, ranks sending the same step), shares its reservation.
    // Only the very same request: its body too. Another body under the key shared the first's
    // room, and when it won the key (the first answered 409 and gave its room back), its
    // rollouts were admitted against room no one held: others passed the bound meanwhile.
    const share =
      generatedKey === null && idempotencyKey !== null && bodyHash !== undefined
        ? sha256Hex(`${options.batch ? "batch" : "rollout"}:${idempotencyKey}:${incoming}:${bodyHash}`).slice(
            0,
            24,
          )
        : "";
    // By Redis's clock: every replica's reservations lapse by the same one.
    const room = await store.reserveBacklog(toAdmit, config.maxBacklog, null, ttlMs, share);
    if (room.reserved) {
      // Held for as long as the admission goes on, however long that is (100,000 rows took 28 s
      // on a loaded host): lapsed under it, its rollouts not yet recorded would not count
      // against the bound, and other submissions could pass it. A holder that dies stops
      // refreshing it, and it lapses `ttlMs` later.
      const keepAlive = setInterval(() => {
        room.refresh().catch(() => undefined);
      }, ttlMs / 3);
      keepAlive.unref();
      reservation.release = () => {
        clearInterval(keepAlive);
        return room.release();
      };
      return;
    }
    const busy = room.inflight + room.reservedByOthers;
    throw new HttpError(
      429,
      "backpressure",
      `the fleet has ${busy} rollouts in flight or being admitted; ${toAdmit} more would pass the bound of ${config.maxBacklog}`,
      {
        inflight: room.inflight,
        admitting: room.reservedByOthers,
        incoming: toAdmit,
        maxBacklog: config.maxBacklog,
        retryAfterS: RETRY_AFTER_S,
      },
      { "retry-after": String(RETRY_AFTER_S) },
    );
  };
  try {
    return await admit(
      store,
      queues,
      { requests: parsed.requests, batch: options.batch, idempotencyKey, serialized },
      {
        maxTaskBytes: config.maxTaskBytes,
        ...(config.sandboxCeiling ? { sandboxCeiling: config.sandboxCeiling } : {}),
        now: deps.now(),
        beforeRecord: reserve,
        // Recorded, they count as in flight: the room goes back now, not once their seeds are in.
        afterRecord: () => reservation.release().catch(() => undefined),
      },
    );
  } catch (err) {
    if (err instanceof HttpError) throw err; // the 429 above: nothing was written
    if (generatedKey !== null && !isAdmissionError(err)) {
      throw cutShort(
        err,
        generatedKey,
        rolloutIds(incoming, idempotencyKey, options.batch ? "batch" : "rollout"),
        options.batch,
      );
    }
    throw options.batch ? inBody(err, parsed) : withoutIndex(err);
  } finally {
    // Admitted rollouts are in flight now (they count there); refused ones never will be. (Given
    // back already once they were recorded; again is a no-op.)
    await reservation.release().catch(() => undefined);
  }
}

/**
 * An `Idempotency-Key` is the client's name for its request, so it is scoped to the client: two
 * tokens that pick the same key get rollouts of their own, never each other's (nor a 409 for the
 * other's body). With auth off every client is one principal and the key is used as it is.
 */
export function scopedKey(principal: string, key: string | null): string | null {
  if (key === null || principal === "") return key;
  return `${principal}\n${key}`; // a key is printable ASCII: no newline of its own
}

/**
 * How many of the `count` rollouts this idempotency key names are not admitted yet: 0 for a
 * replay of what was admitted whole, fewer than `count` for an admission cut short. Uses the id
 * derivation of `admit` (`rolloutIds`, `batchIdFor`).
 */
async function notYetAdmitted(
  store: RolloutStore,
  key: string,
  batch: boolean,
  count: number,
): Promise<number> {
  if (!batch) return (await store.get(rolloutIds(1, key, "rollout")[0]!)) !== null ? 0 : 1;
  const existing = await store.getBatch(batchIdFor(rolloutIds(count, key, "batch")));
  return existing === null ? count : Math.max(0, count - existing.total);
}

/**
 * Whether this key names an admitted rollout or batch whose stored body hash is this body's
 * (`serializeRequests`' of the requests).
 */
async function admittedWithBody(
  store: RolloutStore,
  key: string,
  batch: boolean,
  { canonical, bodyHash }: Serialized,
): Promise<boolean> {
  if (!batch) {
    const existing = await store.get(rolloutIds(1, key, "rollout")[0]!);
    return existing !== null && existing.meta.bodyHash === sha256Hex(canonical[0]!);
  }
  const existing = await store.getBatch(batchIdFor(rolloutIds(canonical.length, key, "batch")));
  return existing !== null && existing.bodyHash === bodyHash;
}

/**
 * An admission error about request `index` of a batch, placed in the body as a schema 422 is: of
 * an NDJSON body, the message and every issue name its line; of a JSON body, the issues' paths
 * start at the row (`rollouts[3].deadlineS`, where admission says `deadlineS` of rollout 3).
 */
function inBody(err: unknown, parsed: ParsedBatch): unknown {
  if (!isAdmissionError(err)) return err;
  const http = toHttpError(err);
  const details = http.details as { index?: unknown; issues?: unknown } | null;
  const index = details?.index;
  if (typeof index !== "number") return err;
  const issues = Array.isArray(details?.issues) ? (details.issues as Issue[]) : null;
  const line = parsed.lines?.[index];
  if (line !== undefined) {
    return new HttpError(
      http.status,
      http.code,
      `line ${line}: ${http.message.replace(/^rollout \d+: /, "")}`,
      {
        ...details,
        line,
        ...(issues ? { issues: issues.map((issue) => ({ line, ...issue })) } : {}),
      },
    );
  }
  if (parsed.rowsAt === null || issues === null) return err;
  const row = formatPath([...parsed.rowsAt, index]);
  const under = (path: string) =>
    path === "" ? row : path.startsWith("[") ? `${row}${path}` : `${row}.${path}`;
  return new HttpError(http.status, http.code, http.message, {
    ...details,
    issues: issues.map((issue) => ({ ...issue, path: under(issue.path) })),
  });
}

/** An admission error on the single-rollout route: there is no "rollout 0" to the client, so no index. */
function withoutIndex(err: unknown): unknown {
  if (!isAdmissionError(err)) return err;
  const http = toHttpError(err);
  const details = http.details;
  if (typeof details !== "object" || details === null || !("index" in details)) return err;
  const { index: _, ...rest } = details as Record<string, unknown>;
  return new HttpError(
    http.status,
    http.code,
    http.message.replace(/^rollout \d+: /, ""),
    rest,
    http.headers,
  );
}

function isAdmissionError(err: unknown): boolean {
  return typeof err === "object" && err !== null && (err as { name?: unknown }).name === "AdmissionError";
}

/**
 * A keyless admission that failed part way (Redis): the usual 5xx, plus the key it was admitted
 * under and its ids, so the client can finish it (same body, that key) or look at what landed.
 */
function cutShort(err: unknown, key: string, ids: readonly string[], batch: boolean): HttpError {
  const http = toHttpError(err);
  const where = batch ? { batchId: batchIdFor(ids) } : { rolloutId: ids[0] };
  return new HttpError(
    http.status,
    http.code,
    `${http.message}; part of this submission may be admitted already: send the same body again with the header \`Idempotency-Key: ${key}\` to finish it without admitting anything twice`,
    {
      ...(typeof http.details === "object" && http.details !== null ? http.details : {}),
      idempotencyKey: key,
      ...where,
    },
    http.headers,
  );
}
