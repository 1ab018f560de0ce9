import Fastify, {
  type FastifyBaseLogger,
  type FastifyInstance,
  type FastifyReply,
  type FastifyRequest,
  LogController,
} from "fastify";
import { createTokenChecker } from "./auth.ts";
import type { DispatcherDeps, RouteContext } from "./context.ts";
import { errorBody, HttpError, toHttpError } from "./http-error.ts";
import { registerBatchRoutes } from "./routes/batches.ts";
import { registerOpsRoutes } from "./routes/ops.ts";
import { registerRolloutRoutes } from "./routes/rollouts.ts";

export type { DispatcherDeps } from "./context.ts";

/** Content types read as NDJSON (one RolloutRequest per line) by `POST /v1/batches`. */
export const NDJSON_TYPES = ["application/x-ndjson", "application/jsonl"];

/**
 * The dispatcher's HTTP API as a Fastify instance, not listening (tests drive it with
 * `inject`; `main.ts` calls `listen`). Closing it does not close `deps.queues` or `deps.redis`.
 */
export function createServer(deps: DispatcherDeps): FastifyInstance {
  const { config, logger } = deps;
  const ctx: RouteContext = { ...deps, now: deps.now ?? Date.now };
  const app = Fastify({
    // Typed as Fastify's base logger so the instance is a plain FastifyInstance (a pino Logger
    // type parameter would make it incompatible with route modules typed FastifyInstance).
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: config.maxBodyBytes,
    logController: new RequestLog(),
  });

  const tokens = createTokenChecker(config.apiTokens.tokens, config.apiTokens.adminTokens);
  if (!tokens.enabled) {
    logger.warn(
      "FLEET_API_TOKENS is empty: the API accepts every request WITHOUT authentication. " +
        "Set FLEET_API_TOKENS unless the dispatcher is reachable only from a trusted host.",
    );
  }

  // Bodies: JSON (Fastify's parser: prototype-poisoning keys refused) and NDJSON as raw text,
  // both under `bodyLimit`. No text/plain: any other type is a 415.
  app.removeContentTypeParser("text/plain");
  app.addContentTypeParser(NDJSON_TYPES, { parseAs: "string" }, (_req, body, done) => done(null, body));

  // Auth runs before the body is read, so an unauthenticated client cannot make us parse 32 MiB.
  app.addHook("onRequest", async (req) => {
    if (req.routeOptions.config?.public) return;
    if (tokens.check(req.headers.authorization) === "none") {
      throw new HttpError(401, "unauthorized", "missing or invalid bearer token", null, {
        "www-authenticate": 'Bearer realm="fleet"',
      });
    }
  });

  app.setErrorHandler((err, req, reply) => {
    const http = toHttpError(err);
    if (http.status >= 500) req.log.error({ err }, "request failed");
    else req.log.debug({ code: http.code, message: http.message }, "request refused");
    return reply.code(http.status).headers(http.headers).send(errorBody(http));
  });

  app.setNotFoundHandler((req, reply) => {
    const path = req.url.split("?")[0]!.slice(0, 200);
    const http = new HttpError(404, "not_found", `no route ${req.method} ${path}`);
    return reply.code(404).send(errorBody(http));
  });

  registerOpsRoutes(app, ctx);
  registerRolloutRoutes(app, ctx);
  registerBatchRoutes(app, ctx);
  // Bull Board (a later change) is registered here, at `/admin/queues`, behind the same
  // onRequest auth hook; write actions need `tokens.check(...) === "admin"`
  // (FLEET_API_TOKENS entries prefixed `admin:`), everyone else gets a read-only board.

  return app;
}

/** One log line per request, on completion (no "incoming request" line). */
class RequestLog extends LogController {
  override incomingRequest(): void {}

  override requestCompleted(error: Error | null | undefined, req: FastifyRequest, reply: FastifyReply): void {
    const line = {
      method: req.method,
      route: req.routeOptions.url ?? null,
      status: reply.statusCode,
      ms: Math.round(reply.elapsedTime),
    };
    if (error || reply.statusCode >= 500) reply.log.error({ ...line, err: error ?? undefined }, "request");
    else reply.log.info(line, "request");
  }
}
