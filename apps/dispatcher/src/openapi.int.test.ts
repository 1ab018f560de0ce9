import { createRedis } from "@fleet/queue";
import type { FastifyInstance } from "fastify";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { BOARD_PATH } from "./board.ts";
import { registeredRoutes } from "./route-table.ts";
import { startTestServer, type TestServer } from "./test-server.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const TOKEN = "openapi-test-token";

let redis: Redis;
let server: TestServer;
let app: FastifyInstance;

beforeAll(async () => {
  redis = createRedis(REDIS_URL);
  server = await startTestServer(redis, "openapi", { FLEET_API_TOKENS: TOKEN });
  app = server.app;
});

afterAll(async () => {
  await server?.close();
  await redis?.quit();
});

/** `/v1/rollouts/:id` → `/v1/rollouts/{id}`. */
const openApiPath = (url: string) => url.replace(/:([A-Za-z0-9_]+)/g, "{$1}");

describe("/openapi.json", () => {
  it("documents every route Fastify registered, and nothing that is not one", async () => {
    const res = await app.inject({
      method: "GET",
      url: "/openapi.json",
      headers: { authorization: `Bearer ${TOKEN}` },
    });
    expect(res.statusCode).toBe(200);
    const doc = res.json() as { openapi: string; paths: Record<string, Record<string, unknown>> };
    expect(doc.openapi).toBe("3.1.0");

    const routes = registeredRoutes(app);
    const visible = routes.filter((r) => !r.hidden);
    expect(visible.length).toBeGreaterThan(10);
    const undocumented = visible
      .filter((r) => !doc.paths[openApiPath(r.url)]?.[r.method.toLowerCase()])
      .map((r) => `${r.method} ${r.url}`);
    expect(undocumented).toEqual([]);

    // Hidden routes are Bull Board's own (its pages, JSON API and static files), all under the
    // board's path, which is documented as one entry.
    const hidden = routes.filter((r) => r.hidden);
    expect(hidden.length).toBeGreaterThan(20);
    expect(hidden.filter((r) => !r.url.startsWith(BOARD_PATH))).toEqual([]);
    expect(doc.paths[BOARD_PATH]?.get).toBeDefined();

    // And the other way round: each documented operation is served.
    const served = new Set(routes.map((r) => `${r.method.toLowerCase()} ${openApiPath(r.url)}`));
    const phantom = Object.entries(doc.paths).flatMap(([path, ops]) =>
      Object.keys(ops)
        .filter((m) => !served.has(`${m} ${path}`))
        .map((m) => `${m} ${path}`),
    );
    expect(phantom).toEqual([]);

    // Public routes are documented as such (`security: []`), the rest need a credential.
    for (const r of visible) {
      const op = doc.paths[openApiPath(r.url)]![r.method.toLowerCase()] as { security?: unknown[] };
      expect({ route: `${r.method} ${r.url}`, public: op.security?.length === 0 }).toEqual({
        route: `${r.method} ${r.url}`,
        public: r.public,
      });
    }
  });
});

describe("/openapi.json's own documented answers", () => {
  it("answers 401 without a token, which it lists", async () => {
    const res = await app.inject({ method: "GET", url: "/openapi.json" });
    expect(res.statusCode).toBe(401);
    const doc = (
      await app.inject({ method: "GET", url: "/openapi.json", headers: { authorization: `Bearer ${TOKEN}` } })
    ).json() as { paths: Record<string, { get: { responses: Record<string, unknown> } }> };
    expect(Object.keys(doc.paths["/openapi.json"]!.get.responses)).toEqual(["200", "401"]);
  });
});

describe("the cancel routes' documented answers", () => {
  it("list the 4xx a body brings them (400 not JSON, 413 over the limit, 415 another type), which they answer", async () => {
    const auth = { authorization: `Bearer ${TOKEN}` };
    const doc = (await app.inject({ method: "GET", url: "/openapi.json", headers: auth })).json() as {
      paths: Record<string, { post: { responses: Record<string, unknown> } }>;
    };
    for (const [path, url] of [
      ["/v1/rollouts/{id}/cancel", "/v1/rollouts/r-nope/cancel"],
      ["/v1/batches/{id}/cancel", "/v1/batches/b-nope/cancel"],
    ] as const) {
      const answers = [
        await app.inject({
          method: "POST",
          url,
          headers: { ...auth, "content-type": "application/json" },
          payload: "{",
        }),
        await app.inject({
          method: "POST",
          url,
          headers: {
            ...auth,
            "content-type": "application/json",
            "content-length": String(64 * 1024 * 1024),
          },
          payload: "{}",
        }),
        await app.inject({
          method: "POST",
          url,
          headers: { ...auth, "content-type": "text/plain" },
          payload: "x",
        }),
        // NDJSON, which only POST /v1/batches takes.
        await app.inject({
          method: "POST",
          url,
          headers: { ...auth, "content-type": "application/x-ndjson" },
          payload: "{}\n",
        }),
      ];
      const statuses = answers.map((a) => a.statusCode);
      expect(statuses, path).toEqual([400, 413, 415, 415]);
      expect(Object.keys(doc.paths[path]!.post.responses), path).toEqual(
        expect.arrayContaining(statuses.map(String)),
      );
    }
  });
});

describe("the sign-in form's documented answers with auth off", () => {
  it("list the redirect to the board it answers when no token is configured", async () => {
    const open = await startTestServer(redis, "openapi-open");
    try {
      const form = await open.app.inject({ method: "GET", url: "/admin/login" });
      expect(form.statusCode).toBe(303);
      expect(form.headers.location).toBe(BOARD_PATH);
      const doc = (await open.app.inject({ method: "GET", url: "/openapi.json" })).json() as {
        paths: Record<string, { get: { responses: Record<string, unknown> } }>;
      };
      expect(Object.keys(doc.paths["/admin/login"]!.get.responses)).toContain(String(form.statusCode));
    } finally {
      await open.close();
    }
  });
});
