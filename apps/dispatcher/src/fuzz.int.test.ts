import type { TaskContentInput } from "@fleet/contracts";
import { createRedis, type StageQueues } from "@fleet/queue";
import fc from "fast-check";
import type { FastifyInstance, InjectOptions, LightMyRequestResponse } from "fastify";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { startTestServer, type TestServer } from "./test-server.ts";

/**
 * Property tests against the dispatcher's HTTP surface (in-process, `inject`, real Redis under a
 * private prefix): whatever arrives (arbitrary JSON, wrong types, huge strings, deep nesting,
 * bad headers, truncated bodies, random paths and methods), the answer is never a 5xx, the
 * server never falls over, and every error is the one JSON body
 * `{ "error": { "code", "message", "details" } }`.
 */
const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const TOKEN = "fuzz-user-token";
const MAX_BODY = 64 * 1024;
const MAX_TASK = 16 * 1024;
const RUNS = Number(process.env.FLEET_FUZZ_RUNS ?? 60);

const task = {
  id: "t-fuzz",
  instruction: "Print hello.",
  image: "fleet-base:test",
  solution: { "solve.sh": "#!/bin/sh\necho hello\n" },
  tests: { "test.sh": "#!/bin/sh\nexit 0\n" },
} satisfies TaskContentInput;
const row = { task, agent: { harness: "oracle" } };

let redis: Redis;
let app: FastifyInstance;
let queues: StageQueues;
let prefix: string;
let server: TestServer;

beforeAll(async () => {
  redis = createRedis(REDIS_URL);
  server = await startTestServer(redis, "fuzz", {
    FLEET_API_TOKENS: `${TOKEN},admin:fuzz-admin-token`,
    FLEET_MAX_BODY_BYTES: String(MAX_BODY),
    FLEET_MAX_TASK_BYTES: String(MAX_TASK),
  });
  ({ app, queues, prefix } = server);
});

afterAll(async () => {
  await queues?.obliterate();
  await server?.close();
  const stream = redis.scanStream({ match: `${prefix}*`, count: 1000 });
  for await (const keys of stream as AsyncIterable<string[]>) {
    if (keys.length > 0) await redis.unlink(...keys);
  }
  await redis?.quit();
});

function call(options: InjectOptions & { token?: string | null }): Promise<LightMyRequestResponse> {
  const { token = TOKEN, headers, ...rest } = options;
  return app.inject({
    ...rest,
    headers: { ...(token === null ? {} : { authorization: `Bearer ${token}` }), ...headers },
  });
}

/** Never a 5xx; any error carries the one JSON error body. Returns the status. */
function expectSafe(res: LightMyRequestResponse, method = "GET"): number {
  expect(res.statusCode, `${res.statusCode}: ${res.body.slice(0, 500)}`).toBeLessThan(500);
  if (res.statusCode >= 400 && method !== "HEAD") {
    expect(String(res.headers["content-type"]), res.body.slice(0, 200)).toContain("application/json");
    const body = JSON.parse(res.body) as { error?: { code?: unknown; message?: unknown; details?: unknown } };
    expect(typeof body.error?.code, res.body.slice(0, 300)).toBe("string");
    expect(typeof body.error?.message).toBe("string");
    expect(body.error).toHaveProperty("details");
  }
  return res.statusCode;
}

/** The server still serves an ordinary request (it did not fall over). */
async function expectAlive(): Promise<void> {
  const res = await call({ method: "GET", url: "/healthz", token: null });
  expect(res.statusCode).toBe(200);
}

const ACCEPTABLE_SUBMIT = [200, 202, 400, 409, 413, 415, 422, 429];

/** A JSON value with every kind of leaf, including the awkward ones. */
const anyJson = fc.jsonValue({ maxDepth: 6 });
const awkward = fc.oneof(
  anyJson,
  fc.constantFrom(null, true, 0, -1, 1e308, -0, "", " ", "\u0000", "\uffff", [], {}),
  fc.string({ unit: "binary", maxLength: 200 }),
  fc.double(),
  fc.bigInt().map(String),
);

/** `value` with the leaf at a random path replaced. */
function mutate(value: unknown, path: number[], replacement: unknown): unknown {
  if (path.length === 0 || value === null || typeof value !== "object") return replacement;
  const entries = Array.isArray(value) ? value.map((v, i) => [String(i), v] as const) : Object.entries(value);
  if (entries.length === 0) return replacement;
  const [head, ...rest] = path;
  const at = head! % entries.length;
  const copy: Record<string, unknown> | unknown[] = Array.isArray(value) ? [...value] : { ...value };
  const key = entries[at]![0];
  (copy as Record<string, unknown>)[key] = mutate(entries[at]![1], rest, replacement);
  return copy;
}

describe("dispatcher under fuzzing (never a 5xx, always the JSON error body)", () => {
  it("arbitrary JSON bodies to the submission routes", async () => {
    await fc.assert(
      fc.asyncProperty(anyJson, fc.constantFrom("/v1/rollouts", "/v1/batches"), async (body, url) => {
        const res = await call({
          method: "POST",
          url,
          payload: JSON.stringify(body),
          headers: { "content-type": "application/json" },
        });
        expect(ACCEPTABLE_SUBMIT).toContain(expectSafe(res, "POST"));
      }),
      { numRuns: RUNS },
    );
    await expectAlive();
  });

  it("a valid request with one field replaced by a value of the wrong type", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.nat(), { minLength: 0, maxLength: 5 }),
        awkward,
        fc.boolean(),
        async (path, replacement, batch) => {
          const body = mutate(row, path, replacement);
          const res = await call({
            method: "POST",
            url: batch ? "/v1/batches" : "/v1/rollouts",
            payload: JSON.stringify(batch ? { rollouts: [body] } : body),
            headers: { "content-type": "application/json" },
          });
          expect(ACCEPTABLE_SUBMIT).toContain(expectSafe(res, "POST"));
        },
      ),
      { numRuns: RUNS * 2 },
    );
    await expectAlive();
  });

  it("truncated bodies, JSON and NDJSON", async () => {
    const json = JSON.stringify({ rollouts: [row, row] });
    const ndjson = `${JSON.stringify(row)}\n${JSON.stringify(row)}\n`;
    await fc.assert(
      fc.asyncProperty(fc.nat(), fc.boolean(), fc.boolean(), async (cut, asNdjson, rollouts) => {
        const full = asNdjson ? ndjson : rollouts ? JSON.stringify(row) : json;
        const payload = full.slice(0, cut % full.length);
        const res = await call({
          method: "POST",
          url: asNdjson || !rollouts ? "/v1/batches" : "/v1/rollouts",
          payload,
          headers: { "content-type": asNdjson ? "application/x-ndjson" : "application/json" },
        });
        expect(ACCEPTABLE_SUBMIT).toContain(expectSafe(res, "POST"));
      }),
      { numRuns: RUNS },
    );
    await expectAlive();
  });

  it("huge strings anywhere: 413 past the body or task limit, never a 5xx", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.nat(), { maxLength: 4 }),
        fc.integer({ min: 1_000, max: 200_000 }),
        fc.constantFrom("x", "é", "\u{1F600}", "\\", '"', "\u0000"),
        async (path, size, unit) => {
          const body = mutate(row, path, unit.repeat(Math.ceil(size / unit.length)));
          const res = await call({
            method: "POST",
            url: "/v1/rollouts",
            payload: JSON.stringify(body),
            headers: { "content-type": "application/json" },
          });
          const status = expectSafe(res, "POST");
          expect(ACCEPTABLE_SUBMIT).toContain(status);
          if (Buffer.byteLength(JSON.stringify(body)) > MAX_BODY) expect(status).toBe(413);
        },
      ),
      { numRuns: Math.ceil(RUNS / 2) },
    );
    const over = await call({
      method: "POST",
      url: "/v1/batches",
      payload: "y".repeat(MAX_BODY + 1),
      headers: { "content-type": "application/x-ndjson" },
    });
    expect(expectSafe(over, "POST")).toBe(413);
    expect(JSON.parse(over.body).error.code).toBe("payload_too_large");
    await expectAlive();
  });

  it("deep nesting in metadata, in the task and at the top level", async () => {
    for (const depth of [100, 1_000, 5_000, 20_000]) {
      const nestedObject = `${'{"a":'.repeat(depth)}1${"}".repeat(depth)}`;
      const nestedArray = `${"[".repeat(depth)}${"]".repeat(depth)}`;
      const bodies = [
        `{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"deep":${nestedObject}}}`,
        `{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"deep":${nestedArray}}}`,
        `{"task":${JSON.stringify(task).replace('"tests":', `"extra":${nestedObject},"tests":`)},"agent":{"harness":"oracle"}}`,
        nestedArray,
        nestedObject,
      ];
      for (const payload of bodies) {
        if (Buffer.byteLength(payload) > MAX_BODY) continue;
        for (const url of ["/v1/rollouts", "/v1/batches"]) {
          const res = await call({
            method: "POST",
            url,
            payload,
            headers: { "content-type": "application/json" },
          });
          const status = expectSafe(res, "POST");
          expect(ACCEPTABLE_SUBMIT, `depth ${depth} ${url}`).toContain(status);
          // Past MAX_REQUEST_DEPTH (64) a well-formed request is refused as invalid, not crashed on.
          if (depth > 64 && payload.startsWith('{"task"') && url === "/v1/rollouts") expect(status).toBe(422);
        }
        const nd = await call({
          method: "POST",
          url: "/v1/batches",
          payload,
          headers: { "content-type": "application/x-ndjson" },
        });
        expect(ACCEPTABLE_SUBMIT, `depth ${depth} ndjson`).toContain(expectSafe(nd, "POST"));
      }
    }
    await expectAlive();
  });

  it("bad headers: content types, authorization, idempotency keys, content length", async () => {
    const headerValue = fc.oneof(
      fc.string({ maxLength: 300 }),
      fc.string({ unit: "grapheme-ascii", maxLength: 300 }),
      fc.constantFrom("", " ", "application/json; charset=utf-16", "application/x-ndjson; charset=latin1"),
    );
    await fc.assert(
      fc.asyncProperty(
        fc.record(
          {
            "content-type": headerValue,
            authorization: fc.oneof(
              headerValue,
              headerValue.map((v) => `Bearer ${v}`),
            ),
            "idempotency-key": headerValue,
            "content-length": fc.oneof(fc.nat().map(String), headerValue),
            accept: headerValue,
          },
          { requiredKeys: [] },
        ),
        fc.constantFrom("/v1/rollouts", "/v1/batches", "/v1/rollouts/abc", "/v1/batches/abc/results"),
        fc.constantFrom("GET", "POST"),
        async (headers, url, method) => {
          // Header values Node's HTTP layer would refuse to send are not requests anyone can make.
          const sendable = Object.fromEntries(
            Object.entries(headers).filter(([, v]) => /^[\t\x20-\x7e\x80-\xff]*$/.test(v)),
          );
          const res = await call({
            method: method as "GET",
            url,
            payload: method === "POST" ? JSON.stringify(row) : undefined,
            headers: sendable,
            token: "authorization" in sendable ? null : TOKEN,
          });
          expectSafe(res, method);
        },
      ),
      { numRuns: RUNS * 2 },
    );
    await expectAlive();
  });

  it("random paths and methods", async () => {
    const segment = fc.oneof(
      fc.string({ maxLength: 40 }).map(encodeURIComponent),
      fc.constantFrom(
        "v1",
        "rollouts",
        "batches",
        "results",
        "cancel",
        "..",
        ".",
        "%2e%2e",
        "%00",
        "admin",
        "queues",
      ),
      fc
        .string({ unit: "binary", maxLength: 20 })
        .map((s) => encodeURIComponent(s.replace(/[\uD800-\uDFFF]/g, "?"))),
    );
    await fc.assert(
      fc.asyncProperty(
        fc.array(segment, { maxLength: 6 }),
        fc.constantFrom("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"),
        fc.option(fc.string({ maxLength: 40 }).map(encodeURIComponent)),
        fc.boolean(),
        async (segments, method, query, authed) => {
          const url = `/${segments.join("/")}${query === null ? "" : `?${query}`}`;
          const res = await call({
            method: method as "GET",
            url,
            payload: method === "POST" || method === "PUT" ? "{}" : undefined,
            headers: method === "POST" || method === "PUT" ? { "content-type": "application/json" } : {},
            token: authed ? TOKEN : null,
          });
          expectSafe(res, method);
        },
      ),
      { numRuns: RUNS * 2 },
    );
    for (const url of ["//v1//rollouts", "/v1/rollouts/%2F..%2F", `/v1/rollouts/${"a".repeat(90)}`]) {
      expectSafe(await call({ method: "GET", url }));
    }
    await expectAlive();
  });

  // Fastify answers a URL whose percent-encoding does not decode (`%ff`, a lone `%`:
  // FST_ERR_BAD_URL) or whose path parameter is longer than `maxParamLength` (100:
  // FST_ERR_MAX_PARAM_LENGTH) with its own body, `{ error: "Bad Request", code, message,
  // statusCode }`, before any hook or handler runs: it bypasses the one error handler unless
  // the server sets Fastify's `frameworkErrors` option.
  it("URLs Fastify refuses before routing still get the JSON error body", async () => {
    const urls = [
      "/%ff",
      "/v1/rollouts/%",
      "/v1/rollouts/%E0%A4%A",
      "/v1/batches/%zz/results",
      `/v1/rollouts/${"a".repeat(101)}`,
      `/v1/batches/${"b".repeat(10_000)}/results`,
    ];
    for (const url of urls) {
      for (const token of [TOKEN, null]) {
        const res = await call({ method: "GET", url, token });
        expect([400, 401, 404], url).toContain(res.statusCode);
        expectSafe(res);
      }
    }
    await expectAlive();
  });

  it("a URL Fastify refuses before routing is a 401 without a token, as any other request, and its answer never quotes the URL", async () => {
    const cases: [string, number, string][] = [
      ["/v1/rollouts/%ZZ", 400, "the URL's path does not decode (a bad percent-encoding)"],
      [
        `/v1/batches/${"x".repeat(120)}/results`,
        404,
        "no such resource: an id in the path is longer than any the API issues",
      ],
    ];
    for (const [url, status, message] of cases) {
      const anonymous = await call({ method: "GET", url, token: null });
      expect(anonymous.statusCode, url).toBe(401);
      expect(anonymous.json()).toEqual({
        error: { code: "unauthorized", message: "missing or invalid bearer token", details: null },
      });
      const res = await call({ method: "GET", url, token: TOKEN });
      expect(res.statusCode, url).toBe(status);
      expect(res.json().error.message).toBe(message);
    }
    // A browser on a bad board URL gets the sign-in page, as on a good one.
    const page = await call({
      method: "GET",
      url: "/admin/queues/%ZZ",
      token: null,
      headers: { accept: "text/html" },
    });
    expect(page.statusCode).toBe(401);
    expect(String(page.headers["content-type"])).toContain("text/html");
  });
});
