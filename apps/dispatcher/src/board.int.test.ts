import { randomUUID } from "node:crypto";
import { Readable } from "node:stream";
import { DispatcherConfig, parseConfig } from "@fleet/config";
import { createRedis, JANITOR_QUEUE, RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
import { createFleetMetrics, createLogger, createMetricsRegistry } from "@fleet/telemetry";
import { Queue, UnrecoverableError, Worker } from "bullmq";
import type { FastifyInstance, InjectOptions } from "fastify";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { LOGIN_FORM_BYTES } from "./routes/admin.ts";
import { createServer } from "./server.ts";
import { SESSION_COOKIE } from "./session.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const USER = `user-${randomUUID()}`;
const ADMIN = `admin-${randomUUID()}`;
const prefix = `{t-board-${randomUUID().slice(0, 8)}}`;
/** What `inject` sends as Host (and so what a same-origin page's Origin is). */
const ORIGIN = "http://localhost:80";

let redis: Redis;
let queues: StageQueues;
let app: FastifyInstance;

interface QueueJson {
  name: string;
  readOnlyMode: boolean;
  counts: Record<string, number>;
}

const call = (o: InjectOptions & { token?: string; cookie?: string }) => {
  const { token, cookie, headers, ...rest } = o;
  return app.inject({
    ...rest,
    headers: {
      ...(token ? { authorization: `Bearer ${token}` } : {}),
      ...(cookie ? { cookie: `${SESSION_COOKIE}=${cookie}` } : {}),
      ...headers,
    },
  });
};

/** The board's page as a browser asks for it, with `auth` (a bearer token or a session cookie) if any. */
const boardPage = (auth: { token?: string; cookie?: string } = {}) =>
  call({ method: "GET", url: "/admin/queues", headers: { accept: "text/html" }, ...auth });

async function login(token: string): Promise<string> {
  const res = await call({
    method: "POST",
    url: "/admin/login",
    headers: { "content-type": "application/x-www-form-urlencoded", origin: ORIGIN },
    payload: new URLSearchParams({ token, next: "/admin/queues/queue/run" }).toString(),
  });
  expect(res.statusCode).toBe(303);
  expect(res.headers.location).toBe("/admin/queues/queue/run");
  const setCookie = String(res.headers["set-cookie"]);
  expect(setCookie).toMatch(/HttpOnly/);
  expect(setCookie).toMatch(/SameSite=Strict/);
  expect(setCookie).toMatch(/Path=\/admin/);
  expect(setCookie).not.toContain(token);
  return new RegExp(`${SESSION_COOKIE}=([^;]+)`).exec(setCookie)![1]!;
}

/** A failed job in the run queue, for retry attempts. */
async function failedRunJob(id: string): Promise<void> {
  await queues.queues.run.add("run", { rolloutId: id }, { jobId: `${id}.run`, attempts: 1 });
  const worker = new Worker(
    "run",
    async () => {
      throw new UnrecoverableError("planted failure");
    },
    { connection: redis.duplicate(), prefix },
  );
  await new Promise<void>((resolve) => worker.on("failed", (job) => job?.id === `${id}.run` && resolve()));
  await worker.close();
}

beforeAll(async () => {
  redis = createRedis(REDIS_URL);
  queues = new StageQueues(redis, prefix);
  const registry = createMetricsRegistry({ app: "dispatcher", defaultMetrics: false });
  app = createServer({
    store: new RolloutStore(redis, prefix),
    queues,
    ledger: new TeardownLedger(redis, prefix),
    redis,
    config: parseConfig(DispatcherConfig, {
      FLEET_PREFIX: prefix,
      FLEET_API_TOKENS: `${USER},admin:${ADMIN}`,
      FLEET_MAX_BODY_BYTES: "65536",
    }),
    logger: createLogger({ name: "board-test", level: "silent" }),
    registry,
    metrics: createFleetMetrics(registry),
  });
  await app.ready();
  await queues.queues.seed.add("seed", { rolloutId: "r-a" }, { jobId: "r-a.seed" });
  await queues.queues.seed.add("seed", { rolloutId: "r-b" }, { jobId: "r-b.seed" });
  await failedRunJob("r-c");
});

afterAll(async () => {
  await app?.close();
  await queues?.obliterate();
  const stream = redis.scanStream({ match: `${prefix}*`, count: 1000 });
  for await (const keys of stream as AsyncIterable<string[]>)
    if (keys.length > 0) await redis.unlink(...keys);
  await queues?.close();
  await redis?.quit();
});

describe("Bull Board at /admin/queues", () => {
  it("without a token: 401 on the board, its API and the API; a browser gets the sign-in form", async () => {
    const page = await boardPage();
    expect(page.statusCode).toBe(401);
    expect(page.headers["content-type"]).toContain("text/html");
    expect(page.body).toContain('action="/admin/login"');
    expect(page.headers["x-frame-options"]).toBe("DENY");
    const api = await call({ method: "GET", url: "/admin/queues/api/queues" });
    expect(api.statusCode).toBe(401);
    expect(api.json()).toMatchObject({ error: { code: "unauthorized" } });
    expect((await call({ method: "GET", url: "/admin/queues/static/favicon-32x32.png" })).statusCode).toBe(
      401,
    );
    expect((await call({ method: "GET", url: "/v1/rollouts/x" })).statusCode).toBe(401);
    expect((await call({ method: "GET", url: "/admin/queues/api/queues", token: "wrong" })).statusCode).toBe(
      401,
    );
    expect(
      (await call({ method: "GET", url: "/admin/queues/api/queues", cookie: "v1.x.1.y" })).statusCode,
    ).toBe(401);
  });

  it("serves a signed-in token the board's page and the static files it loads", async () => {
    const page = await boardPage({ token: USER });
    expect(page.statusCode).toBe(200);
    expect(page.headers["content-type"]).toContain("text/html");
    const scripts = [...page.body.matchAll(/<script[^>]* src="([^"]+)"/g)].map((m) => m[1]!);
    expect(scripts.length).toBeGreaterThan(0);
    for (const src of scripts) {
      const js = await call({
        method: "GET",
        url: new URL(src, "http://board/admin/queues/").pathname,
        token: USER,
      });
      expect(js.statusCode, src).toBe(200);
      expect(js.headers["content-type"], src).toMatch(/javascript/);
      expect(js.body.length, src).toBeGreaterThan(0);
    }
    const icon = await call({ method: "GET", url: "/admin/queues/static/favicon-32x32.png", token: USER });
    expect(icon.statusCode).toBe(200);
    expect(icon.headers["content-type"]).toBe("image/png");
    expect(icon.rawPayload.subarray(1, 4).toString()).toBe("PNG");
  });

  it("shows the four stage queues and the janitor's, read-only for an ordinary token", async () => {
    const res = await call({ method: "GET", url: "/admin/queues/api/queues", token: USER });
    expect(res.statusCode).toBe(200);
    const qs = (res.json() as { queues: QueueJson[] }).queues;
    expect(qs.map((q) => q.name).sort()).toEqual(["close", "janitor", "run", "seed", "verify"]);
    expect(qs.every((q) => q.readOnlyMode)).toBe(true);
    expect(qs.find((q) => q.name === "seed")!.counts.waiting).toBe(2);
    expect(qs.find((q) => q.name === "run")!.counts.failed).toBe(1);

    const retry = await call({
      method: "PUT",
      url: "/admin/queues/api/queues/run/r-c.run/retry",
      token: USER,
    });
    expect(retry.statusCode).toBe(403);
    expect(retry.json()).toMatchObject({ error: { code: "forbidden" } });
    expect(await queues.queues.run.getJobState("r-c.run")).toBe("failed");

    // The router decodes the path: an encoded /admin reaches the board, and is refused the same.
    for (const url of [
      "/%61dmin/queues/api/queues/run/r-c.run/retry",
      "/admin/%71ueues/api/queues/seed/pause",
    ]) {
      const sneaky = await call({ method: "PUT", url, token: USER });
      expect(sneaky.statusCode, url).toBe(403);
      expect(sneaky.json(), url).toMatchObject({ error: { code: "forbidden" } });
    }
    expect(await queues.queues.run.getJobState("r-c.run")).toBe("failed");
    expect(await queues.queues.seed.isPaused()).toBe(false);
  });

  it("gives an admin token the full board, whose actions work", async () => {
    const res = await call({ method: "GET", url: "/admin/queues/api/queues", token: ADMIN });
    expect((res.json() as { queues: QueueJson[] }).queues.every((q) => !q.readOnlyMode)).toBe(true);
    await failedRunJob("r-d");
    const retry = await call({
      method: "PUT",
      url: "/admin/queues/api/queues/run/r-d.run/retry",
      token: ADMIN,
    });
    expect(retry.statusCode).toBe(204);
    expect(await queues.queues.run.getJobState("r-d.run")).toBe("waiting");
  });

  it("refuses an admin's 'add job' (it could take a stage job's own id, which the workers take for the rollout's stage)", async () => {
    for (const url of ["/admin/queues/api/queues/close/add", "/admin/queues/api/queues/close/%61dd"]) {
      const res = await call({
        method: "POST",
        url,
        token: ADMIN,
        payload: { name: "close", data: { rolloutId: "r-add" }, options: { jobId: "r-add.close" } },
      });
      expect(res.statusCode, url).toBe(403);
      expect(res.json()).toMatchObject({
        error: { code: "forbidden", message: expect.stringMatching(/adding a job/) },
      });
    }
    expect(await queues.queues.close.getJob("r-add.close")).toBeUndefined();
  });

  it("refuses an admin's 'update data' of a job (a stage job's data naming another rollout makes it a stray, its rollout left to wait out its deadline; any other field fails it, its rollout masked)", async () => {
    for (const [url, jobData] of [
      ["/admin/queues/api/queues/seed/r-a.seed/update-data", { rolloutId: "r-b" }],
      ["/admin/queues/api/queues/seed/r-a.seed/%75pdate-data", { rolloutId: "r-a", note: "x" }],
    ] as const) {
      const res = await call({ method: "PATCH", url, token: ADMIN, payload: { jobData } });
      expect(res.statusCode, url).toBe(403);
      expect(res.json()).toMatchObject({
        error: { code: "forbidden", message: expect.stringMatching(/job's data/) },
      });
    }
    expect((await queues.queues.seed.getJob("r-a.seed"))?.data).toEqual({ rolloutId: "r-a" });
  });

  it("refuses an admin's queue 'concurrency' and 'rate limit' on the janitor's queue (passes of two replicas overlapped; each pass held past its tick), not on a stage queue's", async () => {
    const janitor = new Queue(JANITOR_QUEUE, { connection: redis, prefix });
    try {
      await janitor.setGlobalConcurrency(1);
      for (const [url, payload] of [
        ["/admin/queues/api/queues/janitor/concurrency", { concurrency: 5 }],
        ["/admin/queues/api/queues/%6Aanitor/concurrency", { concurrency: 5 }],
        ["/admin/queues/api/queues/janitor/rate-limit", { max: 1, duration: 3_600_000 }],
      ] as const) {
        const res = await call({ method: "PUT", url, token: ADMIN, payload });
        expect(res.statusCode, url).toBe(403);
        expect(res.json()).toMatchObject({
          error: { code: "forbidden", message: expect.stringMatching(/janitor queue/) },
        });
      }
      expect(await janitor.getGlobalConcurrency()).toBe(1);
      expect(await janitor.getGlobalRateLimit()).toBeNull();
      // A stage queue's are the operator's to set.
      const res = await call({
        method: "PUT",
        url: "/admin/queues/api/queues/run/concurrency",
        token: ADMIN,
        payload: { concurrency: 4 },
      });
      expect(res.statusCode).toBe(200);
      expect(await queues.queues.run.getGlobalConcurrency()).toBe(4);
    } finally {
      await queues.queues.run.removeGlobalConcurrency();
      await janitor.close();
    }
  });

  it("answers a board action whose body is over the limit 413, as the API would, not 500", async () => {
    const res = await call({
      method: "PUT",
      url: "/admin/queues/api/queues/seed/pause",
      token: ADMIN,
      headers: { "content-type": "application/json" },
      payload: JSON.stringify({ pad: "x".repeat(100_000) }),
    });
    expect(res.statusCode).toBe(413);
    expect(await queues.queues.seed.isPaused()).toBe(false);
  });

  it("answers a board query value that does not decode (a lone %) 400 in the API's error body, not 500", async () => {
    for (const url of [
      "/admin/queues/api/queues?activeQueue=%25",
      "/admin/queues/api/job-schedulers?queueName=%25",
    ]) {
      const res = await call({ method: "GET", url, token: USER });
      expect(res.statusCode, url).toBe(400);
      expect(res.json()).toMatchObject({
        error: { code: "malformed", message: expect.stringMatching(/decode/) },
      });
    }
    // What does decode is served as before.
    const ok = await call({ method: "GET", url: "/admin/queues/api/queues?activeQueue=run", token: USER });
    expect(ok.statusCode).toBe(200);
  });

  it("signs a browser in with a token: an HMAC-signed session cookie, read-only or admin by the token", async () => {
    const user = await login(USER);
    const asUser = await call({ method: "GET", url: "/admin/queues/api/queues", cookie: user });
    expect(asUser.statusCode).toBe(200);
    expect((asUser.json() as { queues: QueueJson[] }).queues.every((q) => q.readOnlyMode)).toBe(true);
    const page = await boardPage({ cookie: user });
    expect(page.statusCode).toBe(200);
    expect(page.body).toContain("rollout-fleet (read-only)");
    // The cookie is for the board only, not the API.
    expect((await call({ method: "GET", url: "/openapi.json", cookie: user })).statusCode).toBe(401);
    const userRetry = await call({
      method: "PUT",
      url: "/admin/queues/api/queues/run/r-c.run/retry",
      cookie: user,
      headers: { origin: ORIGIN },
    });
    expect(userRetry.statusCode).toBe(403);

    const admin = await login(ADMIN);
    const asAdmin = await call({ method: "GET", url: "/admin/queues/api/queues", cookie: admin });
    expect((asAdmin.json() as { queues: QueueJson[] }).queues.every((q) => !q.readOnlyMode)).toBe(true);

    const wrong = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "application/x-www-form-urlencoded", origin: ORIGIN },
      payload: "token=not-a-token",
    });
    expect(wrong.statusCode).toBe(401);
    expect(wrong.headers["set-cookie"]).toBeUndefined();
  });

  it("answers a sign-in form over its own bound 413 naming that bound, not the API's body limit", async () => {
    const res = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "application/x-www-form-urlencoded", origin: ORIGIN },
      payload: new URLSearchParams({ token: USER, next: `/admin/queues/${"a".repeat(9000)}` }).toString(),
    });
    expect(res.statusCode).toBe(413);
    expect(res.json()).toEqual({
      error: {
        code: "payload_too_large",
        message: `the sign-in form is over the limit of ${LOGIN_FORM_BYTES} bytes`,
        details: { limit: LOGIN_FORM_BYTES },
      },
    });
    expect(res.headers["set-cookie"]).toBeUndefined();
    // A JSON body there (chunked: no length to refuse it by first) is bounded as any other body.
    const json = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "application/json", origin: ORIGIN },
      payload: Readable.from([JSON.stringify({ token: USER, pad: "x".repeat(100_000) })]),
    });
    expect(json.statusCode).toBe(413);
    expect(json.json().error.message).not.toContain("sign-in form");
    // And /openapi.json says the route answers so.
    const doc = (await call({ method: "GET", url: "/openapi.json", token: USER })).json() as {
      paths: Record<string, { post?: { responses: Record<string, unknown> } }>;
    };
    expect(doc.paths["/admin/login"]?.post?.responses).toHaveProperty("413");
    // Both bounds: the form's, and the JSON body's (which a client signing in with JSON meets).
    const described = String(
      (doc.paths["/admin/login"]!.post!.responses["413"] as { description: string }).description,
    );
    expect(described).toContain("8 KiB");
    expect(json.json().error.details.limit).toBe(64 * 1024);
    expect(described).toContain("64 KiB");
  });

  it("signs in with a JSON body as with the form, which /openapi.json lists as a body the route takes (its 415 is for neither)", async () => {
    const res = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "application/json", origin: ORIGIN },
      payload: JSON.stringify({ token: USER }),
    });
    expect(res.statusCode).toBe(303);
    expect(String(res.headers["set-cookie"])).toContain(`${SESSION_COOKIE}=`);
    const doc = (await call({ method: "GET", url: "/openapi.json", token: USER })).json() as {
      paths: Record<
        string,
        {
          post?: {
            requestBody: { content: Record<string, unknown> };
            responses: Record<string, { description: string }>;
          };
        }
      >;
    };
    const post = doc.paths["/admin/login"]!.post!;
    expect(Object.keys(post.requestBody.content)).toEqual(
      expect.arrayContaining(["application/x-www-form-urlencoded", "application/json"]),
    );
    expect(post.responses["415"]?.description).toContain("application/json");
  });

  it("answers a sign-in post of another type 415 saying to send the form, which /openapi.json lists", async () => {
    const res = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "text/plain", origin: ORIGIN },
      payload: `token=${USER}`,
    });
    expect(res.statusCode).toBe(415);
    expect(res.json()).toMatchObject({
      error: {
        code: "unsupported_media_type",
        message:
          "content type text/plain is not accepted: send the sign-in form as application/x-www-form-urlencoded",
      },
    });
    expect(res.headers["set-cookie"]).toBeUndefined();
    const doc = (await call({ method: "GET", url: "/openapi.json", token: USER })).json() as {
      paths: Record<string, { post?: { responses: Record<string, unknown> } }>;
    };
    expect(doc.paths["/admin/login"]?.post?.responses).toHaveProperty("415");
  });

  it("refuses a cross-site action on the admin's cookie (CSRF), a cross-site sign-in and a cross-site sign-out", async () => {
    const admin = await login(ADMIN);
    const url = "/admin/queues/api/queues/run/r-c.run/retry";
    for (const headers of [{ origin: "http://evil.example" }, { referer: "http://evil.example/x" }, {}]) {
      const res = await call({ method: "PUT", url, cookie: admin, headers });
      expect(res.statusCode).toBe(403);
      expect(res.json()).toMatchObject({
        error: { code: "forbidden", message: "cross-site request refused" },
      });
    }
    expect(await queues.queues.run.getJobState("r-c.run")).toBe("failed");
    const ok = await call({ method: "PUT", url, cookie: admin, headers: { origin: ORIGIN } });
    expect(ok.statusCode).toBe(204);
    expect(await queues.queues.run.getJobState("r-c.run")).toBe("waiting");

    const csrfLogin = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "application/x-www-form-urlencoded", origin: "http://evil.example" },
      payload: new URLSearchParams({ token: USER }).toString(),
    });
    expect(csrfLogin.statusCode).toBe(403);
    expect(csrfLogin.headers["set-cookie"]).toBeUndefined();

    // Nor sign out: another site's link (or image) to the sign-out route leaves the session be.
    // Its Referer withheld too (`referrerpolicy="no-referrer"` on the link, a no-referrer page):
    // the browser still says where the request came from (Sec-Fetch-Site), which no page sets.
    for (const headers of [
      { referer: "http://evil.example/page" },
      { origin: "null" },
      { "sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate" },
      { "sec-fetch-site": "same-site", "sec-fetch-mode": "navigate" },
    ]) {
      const csrfLogout = await call({ method: "GET", url: "/admin/logout", headers });
      expect(csrfLogout.statusCode).toBe(303);
      expect(csrfLogout.headers.location).toBe("/admin/queues");
      expect(csrfLogout.headers["set-cookie"]).toBeUndefined();
    }
    // The board's own link (its page the referrer) signs out.
    const logout = await call({
      method: "GET",
      url: "/admin/logout",
      headers: { referer: `${ORIGIN}/admin/queues` },
    });
    expect(String(logout.headers["set-cookie"])).toMatch(new RegExp(`${SESSION_COOKIE}=;.*Max-Age=0`));
    // And with no referrer sent (Referrer-Policy: no-referrer), or typed in (Sec-Fetch-Site: none).
    for (const site of ["same-origin", "none"]) {
      const own = await call({ method: "GET", url: "/admin/logout", headers: { "sec-fetch-site": site } });
      expect(String(own.headers["set-cookie"]), site).toMatch(new RegExp(`${SESSION_COOKIE}=;.*Max-Age=0`));
    }
  });

  it("only redirects to the board after sign-in, and signs out", async () => {
    const res = await call({
      method: "POST",
      url: "/admin/login",
      headers: { "content-type": "application/x-www-form-urlencoded", origin: ORIGIN },
      payload: new URLSearchParams({ token: USER, next: "//evil.example/x" }).toString(),
    });
    expect(res.headers.location).toBe("/admin/queues");
    const out = await call({ method: "GET", url: "/admin/logout" });
    expect(out.statusCode).toBe(303);
    expect(String(out.headers["set-cookie"])).toMatch(new RegExp(`${SESSION_COOKIE}=;.*Max-Age=0`));
    // The API still refuses form bodies.
    const form = await call({
      method: "POST",
      url: "/v1/rollouts",
      token: USER,
      headers: { "content-type": "application/x-www-form-urlencoded" },
      payload: "a=b",
    });
    expect(form.statusCode).toBe(415);
  });
});
