import { describe, expect, it } from "vitest";
import { buildOpenApi } from "./openapi.ts";

describe("buildOpenApi", () => {
  it("is an OpenAPI 3.1 document naming every route, with schemas from zod", () => {
    const doc = buildOpenApi() as {
      openapi: string;
      paths: Record<string, unknown>;
      components: { schemas: Record<string, { properties?: Record<string, unknown> }> };
    };
    expect(doc.openapi).toBe("3.1.0");
    expect(Object.keys(doc.paths).sort()).toEqual(
      [
        "/admin",
        "/admin/login",
        "/admin/logout",
        "/admin/queues",
        "/healthz",
        "/metrics",
        "/openapi.json",
        "/readyz",
        "/v1/batches",
        "/v1/batches/{id}",
        "/v1/batches/{id}/cancel",
        "/v1/batches/{id}/results",
        "/v1/rollouts",
        "/v1/rollouts/{id}",
        "/v1/rollouts/{id}/cancel",
        "/v1/rollouts/{id}/trajectory",
      ].sort(),
    );
    expect(Object.keys(doc.components.schemas.RolloutRequest!.properties!)).toEqual(
      expect.arrayContaining(["task", "agent", "deadlineS", "sandbox", "metadata"]),
    );
    expect(doc.components.schemas.RolloutResult!.properties).toHaveProperty("reward");
    expect(doc.components.schemas.RolloutTrajectory!.properties).toHaveProperty("run");
    expect(() => JSON.stringify(doc)).not.toThrow();
  });

  it("documents that every /v1 operation may answer 500 and 503 (its Redis unavailable), and the batch route's NDJSON types", () => {
    const doc = buildOpenApi() as {
      paths: Record<
        string,
        Record<string, { responses: Record<string, unknown>; requestBody?: { content: object } }>
      >;
    };
    for (const [path, ops] of Object.entries(doc.paths).filter(([p]) => p.startsWith("/v1/"))) {
      for (const [method, op] of Object.entries(ops)) {
        expect(Object.keys(op.responses), `${method} ${path}`).toEqual(
          expect.arrayContaining(["500", "503"]),
        );
      }
    }
    expect(Object.keys(doc.paths["/v1/batches"]!.post!.requestBody!.content)).toEqual(
      expect.arrayContaining(["application/json", "application/x-ndjson", "application/jsonl"]),
    );
  });
});
