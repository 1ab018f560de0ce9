import { RolloutRequest, RolloutResult } from "@fleet/contracts";
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

type JsonObject = Record<string, unknown>;

function schema(s: z.ZodType, io: "input" | "output"): JsonObject {
  const { $schema: _, ...rest } = z.toJSONSchema(s, { io, unrepresentable: "any" }) as JsonObject;
  return rest;
}

const ref = (name: string) => ({ $ref: `#/components/schemas/${name}` });
const json = (name: string) => ({ "application/json": { schema: ref(name) } });
const errors = (...statuses: number[]) =>
  Object.fromEntries(statuses.map((s) => [String(s), { description: "error", content: json("Error") }]));
const idParam = (what: string) => ({
  name: "id",
  in: "path",
  required: true,
  schema: { type: "string" },
  description: `${what} id`,
});

/**
 * A minimal OpenAPI 3.1 document of the API, its schemas generated from the same zod schemas
 * the routes validate with. (A later change may generate the whole document from route
 * definitions.)
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
      securitySchemes: { bearer: { type: "http", scheme: "bearer" } },
      schemas: {
        RolloutRequest: schema(RolloutRequest, "input"),
        BatchRequest: schema(BatchBody, "input"),
        RolloutResult: schema(RolloutResult, "output"),
        RolloutView: schema(RolloutView, "output"),
        RolloutAccepted: schema(RolloutAccepted, "output"),
        BatchAccepted: schema(BatchAccepted, "output"),
        BatchView: schema(BatchView, "output"),
        RolloutCancelAccepted: schema(RolloutCancelAccepted, "output"),
        BatchCancelAccepted: schema(BatchCancelAccepted, "output"),
        Error: schema(ErrorResponse, "output"),
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
      "/v1/rollouts/{id}/cancel": {
        post: {
          summary: "Cancel a rollout (close still runs)",
          parameters: [idParam("rollout")],
          responses: {
            "202": { description: "cancelling", content: json("RolloutCancelAccepted") },
            ...errors(401, 404, 409),
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
          parameters: [idParam("batch")],
          responses: {
            "200": {
              description: "one RolloutResult per line",
              content: { "application/x-ndjson": { schema: { type: "string" } } },
            },
            ...errors(401, 404),
          },
        },
      },
      "/v1/batches/{id}/cancel": {
        post: {
          summary: "Cancel every non-terminal rollout of a batch",
          parameters: [idParam("batch")],
          responses: {
            "202": { description: "cancelling", content: json("BatchCancelAccepted") },
            ...errors(401, 404),
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
        get: { summary: "This document", responses: { "200": { description: "OpenAPI 3.1" } } },
      },
    },
  };
}
