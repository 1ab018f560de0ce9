import { RolloutRequest, RolloutResult, RolloutTrajectory } from "@fleet/contracts";
import { z } from "zod";
import { BatchBody } from "./requests.ts";
import {
  BatchAccepted,
  BatchCancelAccepted,
  BatchView,
  ErrorResponse,
  RolloutAccepted,
  RolloutCancelAccepted,
} from "./responses.ts";
import { RolloutView } from "./rollout-view.ts";
import { LoginForm } from "./routes/admin.ts";
import { SESSION_COOKIE } from "./session.ts";

type JsonObject = Record<string, unknown>;

function schema(s: z.ZodType, io: "input" | "output"): JsonObject {
  const { $schema: _, ...rest } = z.toJSONSchema(s, { io, unrepresentable: "any" }) as JsonObject;
  return rest;
}

const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });
const html = { "text/html": { schema: { type: "string" } } };
const json = (name: string) => ({ "application/json": { schema: ref(name) } });
/** A route's error answers; every one may also answer 500 and 503 (its Redis unavailable). */
const errors = (...statuses: number[]) =>
  Object.fromEntries(
    [...new Set([...statuses, 500, 503])].map((s) => [
      String(s),
      { description: "error", content: json("Error") },
    ]),
  );
const idParam = (what: string) => ({
  name: "id",
  in: "path",
  required: true,
  schema: { type: "string" },
  description: `${what} id`,
});

/**
 * A minimal OpenAPI 3.1 document of the API, its schemas generated from the same zod schemas
 * the routes validate with. A test (`openapi.int.test.ts`) checks it against every route the
 * server registers (Fastify's `onRoute`), so a new route cannot go undocumented.
 */
export function buildOpenApi(version = "0.1.0"): JsonObject {
  return {
    openapi: "3.1.0",
    info: {
      title: "rollout-fleet dispatcher",
      version,
      description:
        "Submit LLM-agent rollouts and read their results. Errors: { error: { code, message, details } }.",
    },
    components: {
      securitySchemes: {
        bearer: { type: "http", scheme: "bearer" },
        boardSession: {
          type: "apiKey",
          in: "cookie",
          name: SESSION_COOKIE,
          description: "Bull Board session set by POST /admin/login (HttpOnly, SameSite=Strict, Path=/admin)",
        },
      },
      schemas: {
        RolloutRequest: schema(RolloutRequest, "input"),
        BatchRequest: schema(BatchBody, "input"),
        RolloutResult: schema(RolloutResult, "output"),
        RolloutView: schema(RolloutView, "output"),
        RolloutTrajectory: schema(RolloutTrajectory, "output"),
        RolloutAccepted: schema(RolloutAccepted, "output"),
        BatchAccepted: schema(BatchAccepted, "output"),
        BatchView: schema(BatchView, "output"),
        RolloutCancelAccepted: schema(RolloutCancelAccepted, "output"),
        BatchCancelAccepted: schema(BatchCancelAccepted, "output"),
        Error: schema(ErrorResponse, "output"),
        LoginForm: schema(LoginForm, "input"),
      },
    },
    security: [{ bearer: [] }],
    paths: {
      "/v1/rollouts": {
        post: {
          summary: "Submit one rollout",
          parameters: [
            { name: "Idempotency-Key", in: "header", required: false, schema: { type: "string" } },
          ],
          requestBody: { required: true, content: json("RolloutRequest") },
          responses: {
            "202": { description: "accepted", content: json("RolloutAccepted") },
            "200": { description: "idempotent replay", content: json("RolloutAccepted") },
            ...errors(400, 401, 409, 413, 415, 422, 429),
          },
        },
      },
      "/v1/batches": {
        post: {
          summary: "Submit a batch (JSON { rollouts } or NDJSON, one request per line)",
          parameters: [
            { name: "Idempotency-Key", in: "header", required: false, schema: { type: "string" } },
          ],
          requestBody: {
            required: true,
            content: {
              ...json("BatchRequest"),
              "application/x-ndjson": {
                schema: { type: "string", description: "one RolloutRequest per line" },
              },
              "application/jsonl": {
                schema: { type: "string", description: "one RolloutRequest per line" },
              },
            },
          },
          responses: {
            "202": { description: "accepted", content: json("BatchAccepted") },
            "200": { description: "idempotent replay", content: json("BatchAccepted") },
            ...errors(400, 401, 409, 413, 415, 422, 429),
          },
        },
      },
      "/v1/rollouts/{id}": {
        get: {
          summary: "A rollout: its result when terminal, else its progress",
          parameters: [idParam("rollout")],
          responses: {
            "200": {
              description: "result or progress",
              content: {
                "application/json": { schema: { oneOf: [ref("RolloutResult"), ref("RolloutView")] } },
              },
            },
            ...errors(401, 404),
          },
        },
      },
      "/v1/rollouts/{id}/trajectory": {
        get: {
          summary: "What the agent did: its output, answer, transcript and usage, once its run is stored",
          parameters: [idParam("rollout")],
          responses: {
            "200": {
              description: "trajectory (run null until the run is stored)",
              content: json("RolloutTrajectory"),
            },
            ...errors(401, 404),
          },
        },
      },
      "/v1/rollouts/{id}/cancel": {
        post: {
          summary: "Cancel a rollout (close still runs)",
          parameters: [idParam("rollout")],
          responses: {
            "202": { description: "cancelling", content: json("RolloutCancelAccepted") },
            // 400, 413, 415: a body it was sent (none is needed) that is not JSON, too large, or another type.
            ...errors(400, 401, 404, 409, 413, 415),
          },
        },
      },
      "/v1/batches/{id}": {
        get: {
          summary: "Batch progress",
          parameters: [idParam("batch")],
          responses: { "200": { description: "progress", content: json("BatchView") }, ...errors(401, 404) },
        },
      },
      "/v1/batches/{id}/results": {
        get: {
          summary: "NDJSON stream of the batch's terminal results",
          parameters: [
            idParam("batch"),
            {
              name: "after",
              in: "query",
              required: false,
              schema: { type: "integer", minimum: 0 },
              description:
                "a cursor: only the rollouts that finished after the first `after`, in the order they finished (start at 0; the next value is in the fleet-results-next header)",
            },
          ],
          responses: {
            "200": {
              description: "one RolloutResult per line",
              headers: {
                "fleet-results-next": {
                  description: "with ?after: the after of the next call",
                  schema: { type: "integer" },
                },
              },
              content: { "application/x-ndjson": { schema: { type: "string" } } },
            },
            ...errors(400, 401, 404),
          },
        },
      },
      "/v1/batches/{id}/cancel": {
        post: {
          summary: "Cancel every non-terminal rollout of a batch",
          parameters: [idParam("batch")],
          responses: {
            "202": { description: "cancelling", content: json("BatchCancelAccepted") },
            ...errors(400, 401, 404, 413, 415),
          },
        },
      },
      "/healthz": {
        get: { summary: "Liveness", security: [], responses: { "200": { description: "alive" } } },
      },
      "/readyz": {
        get: {
          summary: "Readiness (Redis reachable)",
          security: [],
          responses: { "200": { description: "ready" }, ...errors(503) },
        },
      },
      "/metrics": {
        get: {
          summary: "Prometheus metrics",
          security: [],
          responses: { "200": { description: "text exposition format" } },
        },
      },
      "/openapi.json": {
        get: {
          summary: "This document",
          responses: {
            "200": { description: "OpenAPI 3.1" },
            "401": { description: "error", content: json("Error") },
          },
        },
      },
      "/admin": {
        get: {
          summary: "Redirect to the board",
          security: [],
          responses: { "303": { description: "to /admin/queues" } },
        },
      },
      "/admin/login": {
        get: {
          summary: "Bull Board sign-in form (HTML)",
          security: [],
          parameters: [{ name: "next", in: "query", required: false, schema: { type: "string" } }],
          responses: {
            "200": { description: "the form", content: html },
            "303": { description: "auth is off (no FLEET_API_TOKENS): to /admin/queues" },
          },
        },
        post: {
          summary: "Sign in to Bull Board with an API token: sets an HMAC-signed session cookie",
          security: [],
          requestBody: {
            required: true,
            // A browser posts the form; a script may post the same fields as JSON (read as any JSON body).
            content: {
              "application/x-www-form-urlencoded": { schema: ref("LoginForm") },
              "application/json": { schema: ref("LoginForm") },
            },
          },
          responses: {
            "303": {
              description: `signed in: Set-Cookie ${SESSION_COOKIE} (HttpOnly; SameSite=Strict; Path=/admin), Location: the board`,
            },
            "400": { description: "no token in the form", content: html },
            "401": { description: "wrong token (the form again)", content: html },
            "403": { description: "Origin/Referer is another site (login CSRF)", content: html },
            "413": {
              description:
                "a form over 8 KiB (LOGIN_FORM_BYTES), or a JSON body over 64 KiB (OTHER_JSON_BODY_BYTES)",
              content: json("Error"),
            },
            "415": {
              description:
                "neither a form (application/x-www-form-urlencoded) nor application/json, or a charset other than UTF-8 (US-ASCII: only its 128 characters)",
              content: json("Error"),
            },
          },
        },
      },
      "/admin/logout": {
        get: {
          summary: "Sign out of Bull Board (clears the session cookie)",
          security: [],
          responses: {
            "303": {
              description:
                "to /admin/login; from another site's page (Origin/Referer/Sec-Fetch-Site: logout CSRF), to the board, still signed in",
            },
          },
        },
      },
      "/admin/queues": {
        get: {
          summary:
            "Bull Board (HTML): the seed, run, verify, close and janitor queues. Read-only unless an admin token; " +
            "its JSON API under /admin/queues/api/ is Bull Board's own, and its mutating calls need an admin " +
            "token (403 otherwise) and, on a session cookie, a same-origin Origin/Referer (403 otherwise)",
          security: [{ bearer: [] }, { boardSession: [] }],
          responses: {
            "200": { description: "the board", content: html },
            "401": { description: "no valid token or session: the sign-in form", content: html },
          },
        },
      },
    },
  };
}
