import { STATUS_CODES } from "node:http";
import { Transform } from "node:stream";
import { capText } from "@fleet/contracts";
import { JANITOR_QUEUE } from "@fleet/queue";
import { Queue } from "bullmq";
import Fastify, {
  type FastifyBaseLogger,
  type FastifyInstance,
  type FastifyReply,
  type FastifyRequest,
  LogController,
} from "fastify";
import { BOARD_PATH, registerBoard } from "./board.ts";
import type { DispatcherDeps, RouteContext } from "./context.ts";
import { errorBody, HttpError, isHttpError, toHttpError, unavailable } from "./http-error.ts";
import { createAuthenticator, isAdminPath, sameOrigin } from "./request-auth.ts";
import {
  NdjsonBody,
  notUtf8,
  parseJsonText,
  readNdjsonBatch,
  textHasTooManyValues,
  tooManyValuesError,
} from "./requests.ts";
import { trackRoutes } from "./route-table.ts";
import { LOGIN_FORM_BYTES, LOGIN_PATH, registerAdminRoutes, sendLoginPage } from "./routes/admin.ts";
import { registerBatchRoutes } from "./routes/batches.ts";
import { registerOpsRoutes } from "./routes/ops.ts";
import { registerRolloutRoutes } from "./routes/rollouts.ts";

export type { DispatcherDeps } from "./context.ts";

/** The route that takes batches, JSON or NDJSON. */
const BATCHES_PATH = "/v1/batches";
/**
 * Bull Board's API routes refused (403) with why, by method and route as registered (matched by
 * route: an encoded path reaches them too).
 * - "Add job": a job it adds may take a stage job's own id (`<rolloutId>.close` as
 *   `options.jobId`), which the workers take for the rollout's stage (a close of a live rollout).
 *   The fleet's jobs are added by admission and its stages only.
 * - "Update data" of a job: a stage job's data is its rollout's id and nothing else. Data naming
 *   another rollout makes the job a stray, dropped and completed, and as it keeps its id the
 *   janitor's lost-job step (which looks for the id) never enqueues the stage again: the rollout
 *   waited out its deadline, its sandbox held, and ended masked. Any other field fails its parse
 *   at every attempt: the rollout ended masked though nothing had failed.
 */
const BOARD_REFUSED = new Map([
  [
    `POST ${BOARD_PATH}/api/queues/:queueName/add`,
    "adding a job from Bull Board is refused: stage jobs are the fleet's own; submit rollouts through the API",
  ],
  [
    `PATCH ${BOARD_PATH}/api/queues/:queueName/:jobId/update-data`,
    "changing a job's data from Bull Board is refused: a stage job's data is its rollout's id, which the fleet sets",
  ],
]);
/**
 * Bull Board's actions refused on the janitor's queue only (matched as `BOARD_REFUSED`), which
 * would break how its passes run: its one-pass-at-a-time limit raised, passes of two replicas
 * overlapped (a slow pass and the next tick); a rate limit held every pass past its tick (one
 * an hour, say). The janitor's schedule (`FLEET_JANITOR_INTERVAL_MS`) paces the passes.
 */
const BOARD_JANITOR_REFUSED = new Map([
  [
    `PUT ${BOARD_PATH}/api/queues/:queueName/concurrency`,
    "changing the janitor queue's concurrency from Bull Board is refused: its passes run one at a time",
  ],
  [
    `PUT ${BOARD_PATH}/api/queues/:queueName/rate-limit`,
    "a rate limit on the janitor queue from Bull Board is refused: its schedule (FLEET_JANITOR_INTERVAL_MS) paces its passes",
  ],
]);
/** The largest JSON body a route other than the two submissions reads (`otherJsonTooLarge`). */
export const OTHER_JSON_BODY_BYTES = 64 * 1024;
const ROLLOUTS_PATH = "/v1/rollouts";

/** The 401 of a request without a valid token (or session). */
const unauthorized = () =>
  new HttpError(401, "unauthorized", "missing or invalid bearer token", null, {
    "www-authenticate": 'Bearer realm="fleet"',
  });

/** What a URL Fastify's router refuses is told, in place of Fastify's message (which quotes it). */
const URL_ERRORS: Record<string, string> = {
  FST_ERR_BAD_URL: "the URL's path does not decode (a bad percent-encoding)",
  FST_ERR_MAX_PARAM_LENGTH: "no such resource: an id in the path is longer than any the API issues",
};

/** Content types read as NDJSON (one RolloutRequest per line) by `POST /v1/batches`. */
export const NDJSON_TYPES = ["application/x-ndjson", "application/jsonl"];

/**
 * The dispatcher's HTTP API as a Fastify instance, not listening (tests drive it with
 * `inject`; `main.ts` calls `listen`). Closing it does not close `deps.queues` or `deps.redis`.
 */
export function createServer(deps: DispatcherDeps): FastifyInstance {
  const { config, logger } = deps;
  const ctx: RouteContext = { ...deps, now: deps.now ?? Date.now };
  /** A body over the limit is read and discarded before its 413 up to this size (see below). */
  const lingerBytes = config.maxBodyBytes * LINGER_FACTOR;
  /** A signed-in client's body over the limit is drained up to this size (see `preParsing` below). */
  const drainBytes = Math.max(lingerBytes, LINGER_FLOOR_BYTES);
  const bodyTooLarge = (
    what: string,
    headers: Readonly<Record<string, string>> = {},
    limit: number = config.maxBodyBytes,
  ) =>
    new HttpError(
      413,
      "payload_too_large",
      `${what} is over the limit of ${limit} bytes`,
      { limit },
      headers,
    );
  /**
   * Connections whose request was answered before its body had all arrived (and has not since):
   * `clientErrorHandler` writes them no answer of its own (below).
   */
  const answeredMidBody = new WeakSet<object>();
  /** Per connection, the request lines of its requests not answered yet (`requestAborted`). */
  const unanswered = new WeakMap<object, Set<() => void>>();
  const requestLog = new RequestLog();
  const app = Fastify({
    // Typed as Fastify's base logger so the instance is a plain FastifyInstance (a pino Logger
    // type parameter would make it incompatible with route modules typed FastifyInstance).
    loggerInstance: logger as FastifyBaseLogger,
    bodyLimit: config.maxBodyBytes,
    // A request (headers and body) that has not all arrived by then is answered 408 (below) and
    // its connection closed: a client that stalls mid-body would otherwise hold its socket, and
    // a graceful shutdown, for good (Fastify turns Node's own limit off by default). Node checks
    // at `connectionsCheckingInterval`; the headers' own limit may not exceed the request's.
    requestTimeout: config.requestTimeoutMs,
    http: {
      connectionsCheckingInterval: Math.min(30_000, Math.ceil(config.requestTimeoutMs / 4)),
      headersTimeout: Math.min(60_000, config.requestTimeoutMs),
    },
    // A request that arrives while the server closes gets the one error body (the hook below),
    // not Fastify's own 503 body.
    return503OnClosing: false,
    logController: requestLog,
    // Errors Fastify raises before routing (a URL that does not decode): the one error body too.
    frameworkErrors: (err, req, reply) => {
      // Raised before routing, so before the auth hook: an unauthenticated client gets the 401
      // any other request of its gets, and nobody gets the raw URL echoed back.
      if (auth.authenticate(req.raw).access === "none") {
        // A browser on a bad board URL gets the sign-in page, as on a good one (back to the board).
        if (isAdminPath(req.url) && req.method === "GET" && wantsHtml(req)) {
          void sendLoginPage(reply as FastifyReply, 401, { next: BOARD_PATH });
          return;
        }
        void refuse(reply as FastifyReply, unauthorized());
        return;
      }
      const http = toHttpError(err);
      const fixed = URL_ERRORS[(err as { code?: string }).code ?? ""];
      void refuse(reply as FastifyReply, fixed ? new HttpError(http.status, http.code, fixed) : http);
    },
    // And what Node's HTTP parser refuses before Fastify sees a request (headers too large, not
    // HTTP, too slow): written to the socket, in the same error body.
    clientErrorHandler: (err, socket) => {
      const code = (err as { code?: unknown }).code;
      if (code === "ECONNRESET" || socket.destroyed) return;
      const http =
        code === "ERR_HTTP_REQUEST_TIMEOUT"
          ? new HttpError(408, "malformed", "the request did not arrive in time")
          : code === "HPE_HEADER_OVERFLOW"
            ? new HttpError(431, "malformed", "the request's headers are too large")
            : new HttpError(400, "malformed", "the request is not valid HTTP");
      const body = JSON.stringify(errorBody(http));
      // Not after an answer to the request whose body is still arriving (a 415 answered before
      // its body all arrived, then the request's time ran out): a second answer on the socket
      // would be read as the next request's.
      if (socket.writable && !answeredMidBody.has(socket)) {
        socket.write(
          `HTTP/1.1 ${http.status} ${STATUS_CODES[http.status]}\r\nContent-Type: application/json\r\n` +
            `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
        );
      }
      socket.destroy(err);
    },
  });

  app.addHook("onResponse", async (req) => {
    const raw = req.raw;
    if (raw.complete) return;
    answeredMidBody.add(raw.socket);
    raw.once("end", () => answeredMidBody.delete(raw.socket));
  });

  // A request whose client hung up before its answer was sent (mid-body, or while its batch was
  // admitted) never finishes, and Fastify writes its line on finish only: it would leave none, an
  // admission beside no request in the log. Written when its connection closes instead.
  app.addHook("onRequest", async (req, reply) => {
    // A request pipelined behind another whose answer was not sent yet gets no event at all when
    // the connection closes (Node never closes its queued response): its line is written on the
    // connection's close, by one listener of the connection's for all its requests unanswered.
    const socket = req.raw.socket;
    let open = unanswered.get(socket);
    if (open === undefined) {
      const lines = new Set<() => void>();
      socket.once("close", () => {
        for (const write of lines) write();
      });
      unanswered.set(socket, lines);
      open = lines;
    }
    const pending = open;
    // Fastify writes the line of a response that finished or failed (`requestCompleted`).
    let logged = false;
    const done = () => {
      logged = true;
      pending.delete(aborted);
    };
    const aborted = () => {
      if (logged) return;
      done();
      requestLog.requestAborted(req, reply);
    };
    pending.add(aborted);
    reply.raw.once("finish", done);
    reply.raw.once("error", done);
    reply.raw.once("close", aborted);
  });

  const auth = createAuthenticator(config.apiTokens.tokens, config.apiTokens.adminTokens, ctx.now);
  if (!auth.enabled) {
    logger.warn(
      "FLEET_API_TOKENS is empty: the API and Bull Board accept every request WITHOUT authentication. " +
        "Set FLEET_API_TOKENS unless the dispatcher is reachable only from a trusted host.",
    );
  }
  trackRoutes(app);

  // A JSON batch is parsed whole (`JSON.parse` cannot be cut into turns of the event loop), so its
  // body is bounded far lower than an NDJSON one, which is read line by line as it arrives.
  const jsonBatchTooLarge = (bytes: number | null, headers: Readonly<Record<string, string>> = {}) =>
    new HttpError(
      413,
      "payload_too_large",
      `a JSON batch body is at most ${config.maxJsonBatchBytes} bytes${bytes === null ? "" : ` (this one is ${bytes})`}: send a large batch as NDJSON (Content-Type: application/x-ndjson, one rollout request per line), which may be up to ${config.maxBodyBytes} bytes`,
      {
        limit: config.maxJsonBatchBytes,
        ...(bytes === null ? {} : { bytes }),
        ndjsonLimit: config.maxBodyBytes,
      },
      headers,
    );
  const isRolloutSubmit = (req: FastifyRequest) =>
    req.method === "POST" && req.routeOptions.url === ROLLOUTS_PATH;
  const isBatchSubmit = (req: FastifyRequest) =>
    req.method === "POST" && req.routeOptions.url === BATCHES_PATH;
  const isJson = (req: FastifyRequest) =>
    /^application\/json\s*(;|$)/i.test(String(req.headers["content-type"] ?? ""));
  const isJsonBatch = (req: FastifyRequest) => isBatchSubmit(req) && isJson(req);
  /**
   * A JSON body no submission reads (a cancel, a sign-in, Bull Board's actions, a route that is
   * not there) over `OTHER_JSON_BODY_BYTES`: refused before it is parsed. A parse of megabytes of
   * `[{},{},…]` held the event loop for seconds (health probes included) and took a gigabyte, and
   * the sign-in route is public.
   */
  const otherJsonTooLarge = (req: FastifyRequest, bytes: number) =>
    bytes > OTHER_JSON_BODY_BYTES && isJson(req) && !isRolloutSubmit(req) && !isBatchSubmit(req);
  const otherJsonError = (bytes: number, headers: Readonly<Record<string, string>> = {}) =>
    new HttpError(
      413,
      "payload_too_large",
      `this route reads a JSON body of at most ${OTHER_JSON_BODY_BYTES} bytes (this one is ${bytes})`,
      { limit: OTHER_JSON_BODY_BYTES, bytes },
      headers,
    );

  // Bodies: JSON (prototype-poisoning keys refused, `parseJsonText`) under `bodyLimit`, a JSON
  // batch under `maxJsonBatchBytes`; NDJSON read line by line as it arrives. No text/plain: any
  // other type is a 415.
  app.removeContentTypeParser("text/plain");
  // JSON parsed here rather than by Fastify's parser, whose one message ("Body is not valid
  // JSON") says nothing of where the syntax breaks or of a refused `__proto__` key. An empty body
  // is no body (not a 400): a client that sets `content-type: application/json` on every request
  // may POST a cancel without one, and a submit without one still gets its own 400 ("expected a
  // JSON body").
  app.removeContentTypeParser("application/json");
  app.addContentTypeParser("application/json", { parseAs: "buffer" }, (req, body, done) => {
    try {
      // A chunked one (no Content-Length to refuse it by before it is read: `preParsing` below).
      if ((body as Buffer).length > config.maxJsonBatchBytes && isJsonBatch(req)) {
        throw jsonBatchTooLarge((body as Buffer).length);
      }
      if (otherJsonTooLarge(req, (body as Buffer).length)) throw otherJsonError((body as Buffer).length);
      const text = utf8Body(body as Buffer);
      // One rollout request of more values than any is refused before its parse holds the loop.
      if (isRolloutSubmit(req) && textHasTooManyValues(text)) throw tooManyValuesError();
      done(null, text === "" ? undefined : parseJsonText(text, "the body"));
    } catch (err) {
      // A JSON value followed by more, on a batch: most likely NDJSON sent as JSON; say so.
      if (err instanceof HttpError && isJsonBatch(req) && /after JSON at position/.test(err.message)) {
        done(
          new HttpError(
            err.status,
            err.code,
            `${err.message}: one rollout request per line is NDJSON, which takes Content-Type: application/x-ndjson`,
            err.details,
          ),
          undefined,
        );
        return;
      }
      done(err as Error, undefined);
    }
  });
  // NDJSON: each line parsed and checked as it arrives, the event loop handed on between turns
  // (`readNdjsonBatch`): a batch of any size the body limit allows never holds the dispatcher
  // (its health probes included) for longer than a turn. Its bytes are counted here (Fastify
  // bounds only the bodies it reads itself), past `bodyLimit` a 413 with the rest unread. What is
  // wrong with the lines is thrown by the route, once it has checked its headers. Only
  // `POST /v1/batches` reads it: elsewhere it is left unread, for the route's 415.
  app.addContentTypeParser(NDJSON_TYPES, async (req: FastifyRequest, payload: NodeJS.ReadableStream) => {
    if (!isBatchSubmit(req)) {
      return new NdjsonBody(() => {
        throw new HttpError(415, "unsupported_media_type", "this route takes application/json");
      });
    }
    const read = await readNdjsonBatch(payload as AsyncIterable<Buffer>, {
      maxBytes: config.maxBodyBytes,
      tooLarge: () => bodyTooLarge("the request body", { connection: "close" }),
    });
    return new NdjsonBody(read);
  });

  // A body declared US-ASCII holds only its 128 characters: a byte past them says it is in
  // another charset (browsers read the label as windows-1252), and read as UTF-8 it would be
  // other text than the client sent (latin1's "Ã©" is UTF-8's "é"): 415, as for latin1.
  app.addHook("preParsing", async (req, _reply, payload) => {
    const charset = declaredCharset(req);
    if (charset === undefined || !US_ASCII.test(charset)) return payload;
    const ascii = new Transform({
      transform(chunk: Buffer, _encoding, callback) {
        if (chunk.some((byte) => byte > 0x7f)) {
          callback(
            new HttpError(
              415,
              "unsupported_media_type",
              "a body declared charset=us-ascii holds a byte past US-ASCII: send the body as UTF-8 (charset=utf-8, or none)",
            ),
          );
          return;
        }
        callback(null, chunk);
      },
    });
    // Not by `pipeline`: its refusal would destroy the request, and with it the connection the
    // 415 goes back on. A client that hangs up mid-body still fails the read, as without it.
    payload.on("error", (err) => ascii.destroy(err));
    return payload.pipe(ascii);
  });

  // A body over the limit by its Content-Length is read and thrown away before the 413 is sent,
  // when it is at most LINGER_FACTOR times the limit and arrives within LINGER_MS: a client that
  // writes its whole body before it reads (Python's http.client and requests do) then gets the
  // 413, where Fastify's own refusal closed the connection under it (a broken pipe, no answer).
  // The connection stays open for the next request. Past those bounds the 413 closes it, as
  // before. (A chunked body without a length is still refused, and closed, once it passes the limit.)
  // Whatever the limit, up to LINGER_FLOOR_BYTES is drained: with a limit set low, the fleet CLI's
  // chunks (8 MiB) are far past four times it, and Node's fetch, which fails on the closed
  // connection while it still writes (EPIPE), reported the 413 as a dispatcher it could not reach.
  // Only here, after sign-in: an unauthenticated client stays bound by LINGER_FACTOR (onSend below).
  // A JSON batch over `maxJsonBatchBytes` by its Content-Length is refused the same way, its body
  // drained, not parsed.
  app.addHook("preParsing", async (req, _reply, payload) => {
    const length = Number(req.headers["content-length"]);
    // Before sign-in too (the sign-in route is public): not read, the connection closed.
    if (req.method !== "GET" && req.method !== "HEAD" && otherJsonTooLarge(req, length)) {
      throw otherJsonError(length, { connection: "close" });
    }
    const overJsonBatch = length > config.maxJsonBatchBytes && isJsonBatch(req);
    if (!(length > config.maxBodyBytes) && !overJsonBatch) return payload;
    // Not for a body no route reads (GET, HEAD), nor before sign-in (public routes): there Node
    // discards it after the answer, and the onSend hook below closes past the bound.
    if (req.method === "GET" || req.method === "HEAD" || req.routeOptions.config?.public) return payload;
    const drained = length <= drainBytes && (await discard(payload, LINGER_MS));
    const headers: Record<string, string> = drained ? {} : { connection: "close" };
    if (length > config.maxBodyBytes) throw bodyTooLarge(`the request body (${length} bytes)`, headers);
    throw jsonBatchTooLarge(length, headers);
  });

  // Any answer sent before a body was read (401, 403, 503, 413 past the drain's bounds): Node
  // reads and discards the rest of the body to keep the connection, however large it is. Past the
  // drain's bound, or chunked (of unknown length), the connection is closed instead: an
  // unauthenticated client cannot make the dispatcher read gigabytes.
  app.addHook("onSend", async (req, reply) => {
    const length = Number(req.headers["content-length"]);
    const unbounded =
      length > lingerBytes ||
      (req.headers["content-length"] === undefined && req.headers["transfer-encoding"] !== undefined);
    if (unbounded && !req.raw.complete) reply.header("connection", "close");
  });

  // Shutting down: a request that still arrives (pipelined, or on a busy keep-alive connection)
  // is told to come back, in the API's error body, and its connection is closed after it.
  let closing = false;
  app.addHook("preClose", async () => {
    closing = true;
  });
  app.addHook("onRequest", async (_req, reply) => {
    if (!closing) return;
    return refuse(reply, unavailable("the dispatcher is shutting down; try again", { connection: "close" }));
  });
  // A compressed body would be read as its bytes (a 400 "not valid JSON" that hides why): 415.
  // Only a body: a request without one (a GET, a health probe, a cancel) from a client that sends
  // the header on every request has nothing compressed to refuse. Nor a type: without a body, its
  // Content-Type types nothing (`curl -d ''` sends a form's, `fetch` with `body: ""` text/plain,
  // each with `Content-Length: 0`),
  // and Fastify would refuse it with a 415 for want of a parser; dropped, the request is one
  // without a body (a cancel goes through, a submit gets its 400 for the missing body).
  app.addHook("onRequest", async (req, reply) => {
    const length = req.headers["content-length"];
    const hasBody =
      req.headers["transfer-encoding"] !== undefined || (length !== undefined && Number(length) !== 0);
    if (!hasBody) {
      if (length !== undefined) delete req.headers["content-type"];
      return;
    }
    // An unauthenticated request is the auth hook's (below) to answer: its 401, as for anything
    // else it sends (an unknown route, a body that is not JSON), not a 415 to fix and send again.
    if (!req.routeOptions.config?.public && auth.authenticate(req.raw).access === "none") return;
    // A body in another charset would be read as UTF-8 all the same (its bytes may well decode:
    // latin1's "Ã©" is UTF-8's "é"), stored as other text than the client sent: 415. JSON is
    // UTF-8 (RFC 8259); a charset parameter may only say so.
    // US-ASCII is UTF-8's first 128 characters, read the same either way: taken, its bytes held
    // to them (`preParsing` below).
    // Named twice, it says two things (RFC 6838 §4.3: an error), and each reader takes its own
    // pick: `charset=utf-8; charset=latin1` was read by the first, a latin1 body as UTF-8. The
    // same one twice (a client adding its own to its caller's) says one thing: read, as before.
    const charsets = declaredCharsets(req);
    const named = new Set(charsets.map((c) => (/^utf-?8$/i.test(c) ? "utf-8" : c.toLowerCase())));
    if (named.size > 1) {
      return refuse(
        reply,
        new HttpError(
          415,
          "unsupported_media_type",
          `the Content-Type names its charset more than once (${charsets.map((c) => c.slice(0, 40)).join(", ")}): name it once, as UTF-8 (charset=utf-8, or none)`,
        ),
      );
    }
    const charset = charsets[0];
    if (charset !== undefined && !/^utf-?8$/i.test(charset) && !US_ASCII.test(charset)) {
      return refuse(
        reply,
        new HttpError(
          415,
          "unsupported_media_type",
          `charset ${charset.slice(0, 40)} is not accepted: send the body as UTF-8 (charset=utf-8, or none)`,
        ),
      );
    }
    const encoding = String(req.headers["content-encoding"] ?? "identity")
      .trim()
      .toLowerCase();
    if (encoding === "identity" || encoding === "") return;
    return refuse(
      reply,
      new HttpError(
        415,
        "unsupported_media_type",
        `Content-Encoding ${encoding.slice(0, 40)} is not supported: send the body uncompressed`,
      ),
    );
  });

  // Auth runs before the body is read, so an unauthenticated client cannot make us parse 32 MiB.
  // Refusals are sent from here rather than thrown: Bull Board's routes have their own error
  // handler, which would turn a thrown 401 into its 500.
  app.decorateRequest("principal", "");
  app.addHook("onRequest", async (req, reply) => {
    if (req.routeOptions.config?.public) return;
    const { access, via, principal } = auth.authenticate(req.raw);
    req.principal = principal;
    const admin = onAdminRoute(req);
    if (access === "none") {
      if (admin && req.method === "GET" && wantsHtml(req)) {
        return sendLoginPage(reply, 401, { next: req.url });
      }
      return refuse(reply, unauthorized());
    }
    if (admin && !SAFE_METHODS.has(req.method)) {
      // Bull Board actions (retry, clean, promote, remove, pause, ...): admin tokens only.
      if (access !== "admin") {
        return refuse(
          reply,
          new HttpError(403, "forbidden", "Bull Board actions need an admin token (admin:<token>)"),
        );
      }
      // CSRF: a session cookie rides along with any request the browser makes, so a mutating
      // request on a cookie must come from a page of this dispatcher. (The cookie is also
      // SameSite=Strict; a bearer header cannot be attached by another site's page at all.)
      if (via === "session" && sameOrigin(req.headers) !== true) {
        return refuse(reply, new HttpError(403, "forbidden", "cross-site request refused"));
      }
      // Bull Board's actions that would break a stage job (`BOARD_REFUSED`).
      const route = `${req.method} ${req.routeOptions.url}`;
      const refused =
        BOARD_REFUSED.get(route) ??
        ((req.params as { queueName?: string } | undefined)?.queueName === JANITOR_QUEUE
          ? BOARD_JANITOR_REFUSED.get(route)
          : undefined);
      if (refused !== undefined) return refuse(reply, new HttpError(403, "forbidden", refused));
    }
  });

  // The board and the login pages must not be framed (clickjacking an admin's click on "clean").
  app.addHook("onSend", async (req, reply) => {
    if (!onAdminRoute(req)) return;
    reply.header("x-frame-options", "DENY");
    if (!reply.hasHeader("content-security-policy")) {
      reply.header("content-security-policy", "frame-ancestors 'none'");
    }
  });

  app.setErrorHandler((err, req, reply) => {
    let http = toHttpError(err);
    if (http.code === "payload_too_large" && !isHttpError(err)) {
      // Fastify's own (a chunked body that passed the limit as it came): the same answer as a
      // Content-Length over it. Its connection is closed (the rest of the body is not read).
      // The sign-in form has a bound of its own, far lower: that one is named.
      http =
        req.routeOptions.url === LOGIN_PATH && isForm(req)
          ? bodyTooLarge("the sign-in form", http.headers, LOGIN_FORM_BYTES)
          : bodyTooLarge("the request body", http.headers);
    } else if (http.code === "unsupported_media_type" && !isHttpError(err)) {
      // Fastify says only "Unsupported Media Type": say what is taken instead.
      const got = String(req.headers["content-type"] ?? "none").slice(0, 100);
      // The sign-in route's form is posted by a browser: the API's types are not what it takes.
      const send =
        req.routeOptions.url === LOGIN_PATH
          ? "send the sign-in form as application/x-www-form-urlencoded"
          : `send application/json (POST /v1/batches also takes ${NDJSON_TYPES.join(" or ")})`;
      http = new HttpError(415, http.code, `content type ${got} is not accepted: ${send}`);
    }
    if (http.status >= 500) req.log.error({ err }, "request failed");
    else req.log.debug({ code: http.code, message: http.message }, "request refused");
    // JSON whatever the route had set before it failed: the results stream sets NDJSON before its
    // first read, and a read that fails (Redis gone) is answered here, by this body.
    return reply
      .code(http.status)
      .headers(http.headers)
      .type("application/json; charset=utf-8")
      .send(errorBody(http));
  });

  app.setNotFoundHandler((req, reply) => {
    const fullPath = req.url.split("?")[0]!;
    const path = fullPath.slice(0, 200);
    // A route that exists with other methods: 405 and the methods it has (RFC 9110 §15.5.6).
    // Not when a route of this method matched and sent its own not-found (a missing static file
    // of Bull Board's): that is a 404.
    const allowed = ROUTE_METHODS.filter((method) => app.findRoute({ method, url: fullPath }) !== null);
    if (allowed.length > 0 && !allowed.includes(req.method as (typeof ROUTE_METHODS)[number])) {
      const http = new HttpError(
        405,
        "method_not_allowed",
        `${path} does not take ${req.method.slice(0, 20)}; it takes ${allowed.join(", ")}`,
        { allow: allowed },
        { allow: allowed.join(", ") },
      );
      return reply.code(405).headers(http.headers).send(errorBody(http));
    }
    const http = new HttpError(404, "not_found", `no route ${req.method} ${path}`);
    return reply.code(404).send(errorBody(http));
  });

  // Bull Board's view of the janitor's queue (the stage queues come with `deps.queues`). It
  // shares the Redis connection, which closing the queue leaves open.
  const janitorQueue = new Queue(JANITOR_QUEUE, { connection: deps.redis, prefix: config.prefix });
  // It re-emits the connection's errors, which the connection's owner logs (`logConnectionOutages`).
  janitorQueue.on("error", () => undefined);
  app.addHook("onClose", async () => {
    await janitorQueue.close();
  });

  registerOpsRoutes(app, { ...ctx, scrapeQueues: [...Object.values(deps.queues.queues), janitorQueue] });
  registerRolloutRoutes(app, ctx);
  registerBatchRoutes(app, ctx);
  registerAdminRoutes(app, auth);
  registerBoard(app, { queues: deps.queues, janitorQueue, auth });
  app.get("/admin", { config: { public: true } }, async (_req, reply) => reply.redirect(BOARD_PATH, 303));

  return app;
}

const SAFE_METHODS = new Set(["GET", "HEAD", "OPTIONS"]);
/** The methods a 405's `Allow` may name (those Fastify routes; HEAD comes with every GET). */
const ROUTE_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"] as const;

/** An over-limit body is read and discarded before its 413 up to this many times the limit, */
export const LINGER_FACTOR = 4;
/** and for at most this long; */
export const LINGER_MS = 30_000;
/** but at least this much of a signed-in client's body, whatever the limit (twice the CLI's chunk). */
export const LINGER_FLOOR_BYTES = 16 * 1024 * 1024;

/** Read `payload` to its end and throw it away: true once it ended, false if it broke or took over `ms`. */
function discard(payload: NodeJS.ReadableStream, ms: number): Promise<boolean> {
  if ((payload as { destroyed?: boolean }).destroyed) return Promise.resolve(false);
  return new Promise((resolve) => {
    let settled = false;
    const settle = (ended: boolean) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      payload.removeListener("data", ignore);
      resolve(ended);
    };
    const ignore = () => undefined;
    const timer = setTimeout(() => settle(false), ms);
    timer.unref();
    payload.on("data", ignore);
    payload.once("end", () => settle(true));
    payload.once("error", () => settle(false));
    payload.once("close", () => settle(false));
    payload.resume();
  });
}

/** A form post's body (`application/x-www-form-urlencoded`: the sign-in form). */
function isForm(req: FastifyRequest): boolean {
  return /^application\/x-www-form-urlencoded\s*(;|$)/i.test(String(req.headers["content-type"] ?? ""));
}

/** A browser navigating (it asks for HTML), not a script asking for JSON. */
function wantsHtml(req: FastifyRequest): boolean {
  return (req.headers.accept ?? "").includes("text/html");
}

function refuse(reply: FastifyReply, err: HttpError): FastifyReply {
  return reply.code(err.status).headers(err.headers).send(errorBody(err));
}

/** One log line per request, on completion (no "incoming request" line). */
class RequestLog extends LogController {
  override incomingRequest(): void {}

  override requestCompleted(error: Error | null | undefined, req: FastifyRequest, reply: FastifyReply): void {
    const route = req.routeOptions.url ?? null;
    const line = this.line(req, reply);
    if (error || reply.statusCode >= 500) reply.log.error({ ...line, err: error ?? undefined }, "request");
    // Prometheus scrapes and health probes, every few seconds: not worth a line each.
    else if (route === "/metrics" || route === "/healthz" || route === "/readyz")
      reply.log.debug(line, "request");
    else reply.log.info(line, "request");
  }

  /** The line of a request whose client closed its connection before the answer was all sent. */
  requestAborted(req: FastifyRequest, reply: FastifyReply): void {
    // No status when none was sent: its default (200) would read as an answer.
    const status = reply.raw.headersSent ? reply.statusCode : null;
    reply.log.info({ ...this.line(req, reply), status, aborted: true }, "request");
  }

  private line(req: FastifyRequest, reply: FastifyReply) {
    // The rollout or batch a request names, so its lines can be found by id.
    const id = (req.params as { id?: unknown } | undefined)?.id;
    return {
      method: req.method,
      route: req.routeOptions.url ?? null,
      ...(typeof id === "string" ? { id: capText(id, 200) } : {}),
      status: reply.statusCode,
      ms: Math.round(reply.elapsedTime),
    };
  }
}

/**
 * Whether a request was routed to the board or the login pages. By the route it matched, not the
 * raw URL: the router decodes the path, so `/%61dmin/...` reaches the board's routes while its raw
 * URL does not start with `/admin`. An unmatched request (a 404) falls back to the raw URL.
 */
function onAdminRoute(req: FastifyRequest): boolean {
  return isAdminPath(req.routeOptions.url ?? req.url) || isAdminPath(req.url);
}

/** A Content-Type's charset parameter, unquoted, if it has one (the first, if it has more). */
function declaredCharset(req: FastifyRequest): string | undefined {
  return declaredCharsets(req)[0];
}

/** Each charset parameter of a Content-Type, unquoted. */
function declaredCharsets(req: FastifyRequest): string[] {
  const type = String(req.headers["content-type"] ?? "");
  return Array.from(type.matchAll(/;\s*charset\s*=\s*"?([^";\s]*)/gi), (m) => m[1]!);
}

/** US-ASCII's names (RFC 2046's `us-ascii`, and `ascii`): a subset of UTF-8. */
const US_ASCII = /^(us-)?ascii$/i;

const STRICT_UTF8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });

/**
 * A body's text. Bytes that are no UTF-8 are refused (400), not replaced with U+FFFD: two
 * different bodies would read the same (one request's Idempotency-Key replaying the other's),
 * and what is stored would not be what was sent.
 */
function utf8Body(body: Buffer): string {
  try {
    return STRICT_UTF8.decode(body);
  } catch {
    throw notUtf8();
  }
}
