import { cancelRollout } from "@fleet/queue";
import type { FastifyInstance, FastifyRequest } from "fastify";
import type { RouteContext } from "../context.ts";
import { HttpError } from "../http-error.ts";
import { NdjsonBody, parseIdempotencyKey, parseRolloutBody } from "../requests.ts";
import type { RolloutAccepted } from "../responses.ts";
import { presentRollout, presentTrajectory } from "../rollout-view.ts";
import { submit } from "../submit.ts";
import { idParam, notFound } from "./params.ts";

/** A JSON route got a body some other parser read (NDJSON): say which format it takes. */
export function requireJson(body: unknown): void {
  if (body instanceof NdjsonBody) {
    throw new HttpError(415, "unsupported_media_type", "this route takes application/json");
  }
}

/**
 * A cancel route's body (none is needed): one of another type than JSON is refused, as the other
 * routes refuse it. Not a request that names NDJSON but carries no body (neither `Content-Length`
 * nor `Transfer-Encoding`: `curl -X POST -H 'content-type: application/x-ndjson'`).
 */
export function requireJsonIfBody(req: FastifyRequest): void {
  if (req.headers["content-length"] === undefined && req.headers["transfer-encoding"] === undefined) return;
  requireJson(req.body);
}

/**
 * `POST /v1/rollouts`, `GET /v1/rollouts/:id`, `GET /v1/rollouts/:id/trajectory`,
 * `POST /v1/rollouts/:id/cancel`.
 */
export function registerRolloutRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { store, queues } = ctx;

  app.post("/v1/rollouts", async (req, reply) => {
    const idempotencyKey = parseIdempotencyKey(req.headers["idempotency-key"]);
    requireJson(req.body);
    const request = parseRolloutBody(req.body);
    const admitted = await submit(
      ctx,
      { requests: [request], lines: null, rowsAt: null },
      { batch: false, idempotencyKey, principal: req.principal },
    );
    const id = admitted.ids[0]!;
    if (admitted.created.length > 0) {
      req.log.info({ rolloutId: id }, "rollout accepted");
      return reply.code(202).send({ id, status: "accepted", created: true } satisfies RolloutAccepted);
    }
    const record = await store.get(id);
    const status = record?.status ?? "accepted";
    return reply.code(200).send({ id, status, created: false } satisfies RolloutAccepted);
  });

  app.get("/v1/rollouts/:id", async (req) => {
    const id = idParam(req.params, "rollout");
    const record = await store.get(id);
    if (!record) throw notFound("rollout", id);
    return presentRollout(record);
  });

  app.get("/v1/rollouts/:id/trajectory", async (req) => {
    const id = idParam(req.params, "rollout");
    const record = await store.get(id);
    if (!record) throw notFound("rollout", id);
    return presentTrajectory(record);
  });

  app.post("/v1/rollouts/:id/cancel", async (req, reply) => {
    const id = idParam(req.params, "rollout");
    requireJsonIfBody(req);
    const outcome = await cancelRollout(store, queues, id, ctx.now());
    switch (outcome.kind) {
      case "unknown":
        throw notFound("rollout", id);
      case "terminal":
        throw new HttpError(409, "conflict", `rollout ${id} already finished (${outcome.status})`, {
          rolloutId: id,
          status: outcome.status,
        });
      case "decided":
        throw new HttpError(
          409,
          "conflict",
          `rollout ${id} is already closing for ${outcome.failureKind}, which decides its result; it was stopped but will not end cancelled`,
          { rolloutId: id, status: outcome.previous, failureKind: outcome.failureKind },
        );
      case "closing":
        throw new HttpError(
          409,
          "conflict",
          `rollout ${id} is ${outcome.graded ? "graded" : "closing"} already, which decides its result; it was stopped but will not end cancelled`,
          { rolloutId: id, status: outcome.previous, closing: true, graded: outcome.graded },
        );
      case "cancelling":
        req.log.info({ rolloutId: id, previous: outcome.previous }, "rollout cancel requested");
        return reply.code(202).send({ id, status: "cancelling" });
    }
  });
}
