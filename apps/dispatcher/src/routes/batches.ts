import type { ServerResponse } from "node:http";
import type { Socket } from "node:net";
import { Readable } from "node:stream";
import type { RolloutStore } from "@fleet/queue";
import { BATCH_PAGE, cancelBatch } from "@fleet/queue";
import type { FastifyInstance } from "fastify";
import type { RouteContext } from "../context.ts";
import { HttpError } from "../http-error.ts";
import { NdjsonBody, parseIdempotencyKey, readBatchJson } from "../requests.ts";
import type { BatchAccepted, BatchView } from "../responses.ts";
import { submit } from "../submit.ts";
import { idParam, notFound } from "./params.ts";
import { requireJsonIfBody } from "./rollouts.ts";

/**
 * `POST /v1/batches`, `GET /v1/batches/:id`, `GET /v1/batches/:id/results`,
 * `POST /v1/batches/:id/cancel`.
 */
export function registerBatchRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { store, queues } = ctx;

  app.post("/v1/batches", async (req, reply) => {
    const idempotencyKey = parseIdempotencyKey(req.headers["idempotency-key"]);
    // The NDJSON parser hands over the batch it read as the body arrived, wrapped (a JSON body
    // that is a string is not mistaken for it); the JSON parser an already-parsed value.
    const parsed = req.body instanceof NdjsonBody ? req.body.read() : await readBatchJson(req.body);
    const started = performance.now();
    const admitted = await submit(ctx, parsed, { batch: true, idempotencyKey, principal: req.principal });
    const created = admitted.created.length > 0;
    const body: BatchAccepted = {
      batchId: admitted.batchId!,
      rolloutIds: admitted.ids,
      count: admitted.ids.length,
      created,
    };
    req.log.info(
      {
        batchId: body.batchId,
        count: body.count,
        created: admitted.created.length,
        admitMs: Math.round(performance.now() - started),
      },
      created ? "batch accepted" : "batch replayed",
    );
    return reply.code(created ? 202 : 200).send(body);
  });

  app.get("/v1/batches/:id", async (req) => {
    const id = idParam(req.params, "batch");
    const batch = await store.getBatch(id);
    if (!batch) throw notFound("batch", id);
    const { bodyHash: _, ...view } = batch;
    return view satisfies BatchView;
  });

  app.get("/v1/batches/:id/results", async (req, reply) => {
    const id = idParam(req.params, "batch");
    const after = afterParam(req.query);
    if (!(await store.getBatch(id))) throw notFound("batch", id);
    let lines: AsyncGenerator<string> | null = null;
    if (after !== null) {
      // The cursor: the rollouts that finished after the first `after`, in the order they
      // finished, up to how many had finished now; the next call's `after` in the header.
      const next = await store.batchDoneCount(id);
      // Past what has finished: no cursor of ours (they only grow to it). Echoed back, it would
      // skip the results that finish up to it.
      if (after > next) {
        throw new HttpError(
          400,
          "malformed",
          `after (${after}) is past the ${next} rollout(s) of this batch that have finished: use the fleet-results-next header's value (0 to start)`,
          { after, finished: next },
        );
      }
      if (req.method !== "HEAD") lines = finishedLines(store, id, after, next);
      reply.header(RESULTS_NEXT_HEADER, String(next));
    } else if (req.method !== "HEAD") {
      lines = resultLines(store, id);
    }
    reply.code(200).type("application/x-ndjson; charset=utf-8");
    // HEAD: the headers only. Given a stream, Fastify's HEAD route reads it to its end and throws
    // it away: every result of the batch read from Redis for nothing.
    if (lines === null) return reply.send();
    const stream = Readable.from(lines);
    stream.on("error", (err) => req.log.error({ err, batchId: id }, "results stream failed"));
    stallGuard(reply.raw, ctx.resultsStallMs ?? RESULTS_STALL_MS, () =>
      req.log.warn({ batchId: id }, "the client read nothing of its results stream for too long; closing it"),
    );
    return reply.send(stream);
  });

  app.post("/v1/batches/:id/cancel", async (req, reply) => {
    const id = idParam(req.params, "batch");
    requireJsonIfBody(req);
    const cancelled = await cancelBatch(store, queues, id, ctx.now);
    if (cancelled === null) throw notFound("batch", id);
    req.log.info({ batchId: id, cancelled }, "batch cancel requested");
    return reply.code(202).send({ batchId: id, cancelled });
  });
}

/**
 * The batch's terminal results as NDJSON, a page of rollout ids at a time: memory stays
 * bounded by one page whatever the batch's size, and a slow reader slows the reads.
 */
export async function* resultLines(store: RolloutStore, batchId: string): AsyncGenerator<string> {
  for (let start = 0; ; start += BATCH_PAGE) {
    const ids = await store.batchRolloutIds(batchId, start, start + BATCH_PAGE - 1);
    if (ids.length === 0) return;
    const chunk = await resultsNdjson(store, ids);
    if (chunk !== "") yield chunk;
    if (ids.length < BATCH_PAGE) return;
  }
}

/**
 * How long a results stream may go without the socket sending anything (its client stopped
 * reading: a process stopped, a network cut off) before the connection is closed. Until then the
 * stream holds what is buffered for it (up to about 25 MiB of results a connection).
 */
export const RESULTS_STALL_MS = 5 * 60_000;

/** The guard that last took a socket, and the timeout the socket had before the first of them. */
const guards = new WeakMap<Socket, { before: number }>();

/**
 * Close the connection of `res` once nothing went through it for `ms`, for as long as `res`
 * lasts; then its socket has the timeout it would have had (a kept-alive connection serves other
 * requests, and is closed once idle for the server's keep-alive timeout, as after any route). A
 * response pipelined behind another gets its socket when that one is done: guarded from then.
 */
function stallGuard(res: ServerResponse, ms: number, onStall: () => void): void {
  const attach = (socket: Socket | null) => {
    // Not a network socket (Fastify's `inject`): nothing to guard.
    if (typeof socket?.setTimeout !== "function") return;
    const guard = { before: guards.get(socket)?.before ?? socket.timeout ?? 0 };
    guards.set(socket, guard);
    const stalled = () => {
      onStall();
      socket.destroy();
    };
    socket.setTimeout(ms);
    socket.on("timeout", stalled);
    res.once("close", () => {
      socket.off("timeout", stalled);
      // A response pipelined behind this one took the socket (and its timeout) over already.
      if (guards.get(socket) !== guard) return;
      guards.delete(socket);
      // A response that finished on a kept-alive connection armed the keep-alive timeout already
      // (Node does, before this "close"): left as it is. Turned off (0), the idle connection was
      // never closed, one more for every results read of a client that pools its connections.
      if (socket.timeout === ms) socket.setTimeout(guard.before);
    });
  };
  if (res.socket !== null) attach(res.socket);
  else res.once("socket", attach);
}

/** The results cursor's next position (`GET /v1/batches/:id/results?after=n`). */
export const RESULTS_NEXT_HEADER = "fleet-results-next";

/** `?after=<n>` (n ≥ 0, an integer), or null without one. */
function afterParam(query: unknown): number | null {
  const raw = (query as { after?: unknown } | null)?.after;
  if (raw === undefined) return null;
  if (typeof raw !== "string" || !/^\d{1,9}$/.test(raw)) {
    throw new HttpError(400, "malformed", "after must be a whole number of finished rollouts (0 to start)", {
      after: String(raw).slice(0, 40),
    });
  }
  return Number(raw);
}

/**
 * Results of the rollouts at positions `from` to `to - 1` of a batch's finish order, a page at a
 * time (one whose result expired is left out; it still counts toward `to`).
 */
export async function* finishedLines(
  store: RolloutStore,
  batchId: string,
  from: number,
  to: number,
): AsyncGenerator<string> {
  for (let start = from; start < to; start += BATCH_PAGE) {
    const ids = await store.batchDoneIds(batchId, start, Math.min(start + BATCH_PAGE, to) - 1);
    if (ids.length === 0) return;
    const chunk = await resultsNdjson(store, ids);
    if (chunk !== "") yield chunk;
  }
}

/**
 * The results of `ids` as NDJSON lines, as stored (as `GET /v1/rollouts/:id` answers them), those
 * not there (not terminal, or expired) left out.
 */
async function resultsNdjson(store: RolloutStore, ids: readonly string[]): Promise<string> {
  let chunk = "";
  for (const json of await store.getResultsJson(ids)) {
    if (json !== null) chunk += `${json}\n`;
  }
  return chunk;
}
