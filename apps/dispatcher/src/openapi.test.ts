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
      ].sort(),
    );
    expect(Object.keys(doc.components.schemas.RolloutRequest!.properties!)).toEqual(
      expect.arrayContaining(["task", "agent", "deadlineS", "sandbox", "metadata"]),
    );
    expect(doc.components.schemas.RolloutResult!.properties).toHaveProperty("reward");
    expect(() => JSON.stringify(doc)).not.toThrow();
  });
});
