import { createHash, randomUUID } from "node:crypto";
import { Readable } from "node:stream";
import { gzipSync } from "node:zlib";
import { DispatcherConfig, parseConfig } from "@fleet/config";
import { RolloutRequest, type RolloutResult, RUN_MARGIN_MS, TaskContent } from "@fleet/contracts";
import {
  admit,
  BATCH_PAGE,
  batchIdFor,
  CANCEL_CONCURRENCY,
  cancelBatch,
  cancelRollout,
  createRedis,
  digestTask,
  RolloutStore,
  rolloutIds,
  StageQueues,
  TeardownLedger,
} from "@fleet/queue";
import { createFleetMetrics, createLogger, createMetricsRegistry } from "@fleet/telemetry";
import type { FastifyInstance, InjectOptions, LightMyRequestResponse } from "fastify";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it, onTestFinished } from "vitest";
import { createServer, OTHER_JSON_BODY_BYTES } from "./server.ts";
import { completedResult, TEST_TASK } from "./test-server.ts";

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const TOKEN = "user-token-for-tests";
const ADMIN = "admin-token-for-tests";

const task = TEST_TASK;
const oracle = { harness: "oracle" } as const;
const row = { task, agent: oracle };

interface Harness {
  app: FastifyInstance;
  prefix: string;
  store: RolloutStore;
  queues: StageQueues;
  call(options: InjectOptions & { token?: string | null }): Promise<LightMyRequestResponse>;
}

let redis: Redis;
const harnesses: Harness[] = [];

/** A server on its own key prefix (cleaned up in afterAll); `env` overrides its config. */
async function makeHarness(
  env: Record<string, string> = {},
  /** Patch the queues before the server gets them (a fault behind our own interface). */
  patchQueues: (queues: StageQueues) => void = () => {},
  /** Where its log lines go, from debug up (none by default). */
  log?: (line: string) => void,
  /** Patch the store before the server gets it; its backlog reservations' TTL. */
  extra: {
    patchStore?: (store: RolloutStore) => void;
    reservationTtlMs?: number;
    /** Hooks of the test's own, added before the server is ready. */
    hooks?: (app: FastifyInstance) => void;
  } = {},
): Promise<Harness> {
  const prefix = `{t-disp-${randomUUID().slice(0, 8)}}`;
  const config = parseConfig(DispatcherConfig, {
    FLEET_PREFIX: prefix,
    FLEET_API_TOKENS: `${TOKEN},admin:${ADMIN}`,
    ...env,
  });
  const logger = log
    ? createLogger({ name: "dispatcher-test", level: "debug", destination: { write: log } })
    : createLogger({ name: "dispatcher-test", level: "silent" });
  const registry = createMetricsRegistry({ app: "dispatcher", defaultMetrics: false });
  const metrics = createFleetMetrics(registry);
  const store = new RolloutStore(redis, prefix);
  const queues = new StageQueues(redis, prefix);
  patchQueues(queues);
  extra.patchStore?.(store);
  const ledger = new TeardownLedger(redis, prefix);
  const app = createServer({
    store,
    queues,
    ledger,
    redis,
    config,
    logger,
    registry,
    metrics,
    ...(extra.reservationTtlMs !== undefined ? { reservationTtlMs: extra.reservationTtlMs } : {}),
  });
  extra.hooks?.(app);
  await app.ready();
  const h: Harness = {
    app,
    prefix,
    store,
    queues,
    call({ token = TOKEN, headers, ...options }) {
      return app.inject({
        ...options,
        headers: { ...(token === null ? {} : { authorization: `Bearer ${token}` }), ...headers },
      });
    },
  };
  harnesses.push(h);
  return h;
}

async function deleteByPrefix(prefix: string): Promise<void> {
  const stream = redis.scanStream({ match: `${prefix}*`, count: 1000 });
  for await (const keys of stream as AsyncIterable<string[]>) {
    if (keys.length > 0) await redis.unlink(...keys);
  }
}

const resultFor = completedResult;

function expectErrorBody(
  res: { statusCode: number; headers: Record<string, unknown>; body: string },
  status: number,
  code: string,
) {
  expect(res.statusCode, res.body).toBe(status);
  expect(String(res.headers["content-type"])).toContain("application/json");
  const body = JSON.parse(res.body) as { error: { code: string; message: string; details: unknown } };
  expect(body.error.code).toBe(code);
  expect(typeof body.error.message).toBe("string");
  expect(body.error).toHaveProperty("details");
  return body.error;
}

let h: Harness;

beforeAll(async () => {
  redis = createRedis(REDIS_URL);
  h = await makeHarness();
});

afterAll(async () => {
  for (const x of harnesses) {
    await x.app.close();
    await x.queues.obliterate();
    await x.queues.close();
    await deleteByPrefix(x.prefix);
  }
  await redis?.quit();
});

describe("POST /v1/rollouts", () => {
  it("accepts a rollout, records it and enqueues its seed job", async () => {
    const res = await h.call({ method: "POST", url: "/v1/rollouts", payload: row });
    expect(res.statusCode, res.body).toBe(202);
    const body = res.json() as { id: string; status: string; created: boolean };
    expect(body).toMatchObject({ status: "accepted", created: true });
    const job = await h.queues.queues.seed.getJob(`${body.id}.seed`);
    expect(job?.data).toEqual({ rolloutId: body.id });

    const view = await h.call({ method: "GET", url: `/v1/rollouts/${body.id}` });
    expect(view.statusCode).toBe(200);
    expect(view.json()).toMatchObject({
      id: body.id,
      batchId: null,
      status: "accepted",
      stage: "admission",
      taskId: "t-echo",
      agent: "oracle",
      failure: null,
    });
    // The stage a worker began, not only the one whose receipt was stored last: the agent runs
    // while the status still says the seed is done.
    const stageNow = async () =>
      ((await h.call({ method: "GET", url: `/v1/rollouts/${body.id}` })).json() as { stage: string }).stage;
    await h.store.begin(body.id, "seed", Date.now());
    expect(await stageNow()).toBe("seed");
    await h.store.begin(body.id, "run", Date.now());
    expect(await stageNow()).toBe("run");
  });

  it("is idempotent by key: same body → same id, other body → 409", async () => {
    const key = randomUUID();
    const first = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: row,
      headers: { "idempotency-key": key },
    });
    expect(first.statusCode).toBe(202);
    const again = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: row,
      headers: { "idempotency-key": key },
    });
    expect(again.statusCode).toBe(200);
    expect(again.json()).toEqual({ id: first.json().id, status: "accepted", created: false });
    const other = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, metadata: { n: 2 } },
      headers: { "idempotency-key": key },
    });
    const error = expectErrorBody(other, 409, "conflict");
    expect(error.details).toMatchObject({ rolloutId: first.json().id });
  });

  it("one key names one request: the same key on the other route (a rollout's on a batch, a batch's on a rollout) is 409, nothing admitted twice", async () => {
    for (const [firstUrl, firstPayload, secondUrl, secondPayload] of [
      ["/v1/rollouts", row, "/v1/batches", { rollouts: [row] }],
      ["/v1/batches", { rollouts: [row] }, "/v1/rollouts", row],
    ] as const) {
      const key = randomUUID();
      const headers = { "idempotency-key": key };
      const first = await h.call({ method: "POST", url: firstUrl, payload: firstPayload, headers });
      expect(first.statusCode).toBe(202);
      const before = await h.store.inflightCount();
      const second = await h.call({ method: "POST", url: secondUrl, payload: secondPayload, headers });
      expect(expectErrorBody(second, 409, "conflict").message).toMatch(/a key names one request/);
      expect(await h.store.inflightCount()).toBe(before);
    }
    // Both at the same moment: one of the two, never both (checked with the writes).
    for (let i = 0; i < 10; i++) {
      const headers = { "idempotency-key": randomUUID() };
      const answers = await Promise.all([
        h.call({ method: "POST", url: "/v1/rollouts", payload: row, headers }),
        h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row] }, headers }),
      ]);
      expect(answers.map((a) => a.statusCode).sort(), answers.map((a) => a.body).join("\n")).toEqual([
        202, 409,
      ]);
    }
  });

  it("scopes a key to the token: another token's same key gets its own rollout and batch, never 409", async () => {
    const key = randomUUID();
    // A key names one request: the batches below take one of their own.
    const post = (token: string, url: string, payload: object) =>
      h.call({
        method: "POST",
        url,
        payload,
        token,
        headers: { "idempotency-key": url === "/v1/batches" ? `${key}-b` : key },
      });
    const mine = await post(TOKEN, "/v1/rollouts", row);
    const theirs = await post(ADMIN, "/v1/rollouts", { ...row, metadata: { n: 2 } });
    expect([mine.statusCode, theirs.statusCode], theirs.body).toEqual([202, 202]);
    expect(theirs.json().id).not.toBe(mine.json().id);
    expect((await h.store.get(mine.json().id))!.meta.metadata).toBeNull();
    // Each token's replay still lands on its own rollout.
    const again = await post(ADMIN, "/v1/rollouts", { ...row, metadata: { n: 2 } });
    expect(again.json()).toMatchObject({ id: theirs.json().id, created: false });
    expectErrorBody(await post(TOKEN, "/v1/rollouts", { ...row, metadata: { n: 2 } }), 409, "conflict");

    const myBatch = await post(TOKEN, "/v1/batches", [row, row]);
    const theirBatch = await post(ADMIN, "/v1/batches", [row]);
    expect([myBatch.statusCode, theirBatch.statusCode], theirBatch.body).toEqual([202, 202]);
    expect(theirBatch.json().batchId).not.toBe(myBatch.json().batchId);
    expect((await post(TOKEN, "/v1/batches", [row, row])).json()).toMatchObject({
      batchId: myBatch.json().batchId,
      created: false,
    });
  });

  it("a key admitted before keys were scoped to tokens still replays to its rollout", async () => {
    const key = randomUUID();
    // As admitted by the previous release: under the bare key.
    const [legacy] = (
      await admit(
        h.store,
        h.queues,
        { requests: [RolloutRequest.parse(row)], batch: false, idempotencyKey: key },
        { maxTaskBytes: 1 << 20 },
      )
    ).ids;
    const again = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: row,
      headers: { "idempotency-key": key },
    });
    expect(again.statusCode).toBe(200);
    expect(again.json()).toMatchObject({ id: legacy, created: false });
    // Another body under the bare key is not that request's replay: admitted under the token's key.
    const other = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, metadata: { n: 3 } },
      token: ADMIN,
      headers: { "idempotency-key": key },
    });
    expect(other.statusCode, other.body).toBe(202);
    expect(other.json().id).not.toBe(legacy);
  });

  it("two requests at once with one key and two bodies: one is admitted, the other is 409, whichever wins", async () => {
    for (let round = 0; round < 5; round++) {
      const key = randomUUID();
      const send = (n: number) =>
        h.call({
          method: "POST",
          url: "/v1/rollouts",
          payload: { ...row, metadata: { n } },
          headers: { "idempotency-key": key },
        });
      const [a, b] = await Promise.all([send(1), send(2)]);
      const codes = [a.statusCode, b.statusCode].sort();
      expect(codes, `${a.body} ${b.body}`).toEqual([202, 409]);
      const winner = a.statusCode === 202 ? 1 : 2;
      const { id } = (a.statusCode === 202 ? a : b).json() as { id: string };
      expect((await h.store.get(id))!.meta.metadata).toEqual({ n: winner });
    }
  });

  it("re-enqueues the seed on replay when a crash lost it after the rollout was recorded", async () => {
    const key = randomUUID();
    const headers = { "idempotency-key": key };
    const first = await h.call({ method: "POST", url: "/v1/rollouts", payload: row, headers });
    const { id } = first.json() as { id: string };
    await h.queues.queues.seed.remove(`${id}.seed`);
    expect(await h.queues.queues.seed.getJob(`${id}.seed`)).toBeUndefined();
    const replay = await h.call({ method: "POST", url: "/v1/rollouts", payload: row, headers });
    expect(replay.json()).toMatchObject({ id, created: false });
    expect(await h.queues.queues.seed.getJob(`${id}.seed`)).toBeDefined();
  });

  it("answers 422 with readable details for an invalid task", async () => {
    const res = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { task: { ...task, id: "bad id!" }, agent: oracle },
    });
    const error = expectErrorBody(res, 422, "invalid");
    expect(error.details).toMatchObject({
      issues: [{ path: "task.id", message: expect.stringContaining("letters") }],
    });
  });

  it("answers 422 for a deadlineS shorter than a rollout needs (the agent's timeout, the tests', the run's margin, 10 s before its run): it could only be masked", async () => {
    const { agentS, verifierS } = TaskContent.parse(task).timeouts;
    const need = agentS + verifierS + RUN_MARGIN_MS / 1000 + 10;
    const short = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, deadlineS: need - 1 },
    });
    const error = expectErrorBody(short, 422, "invalid");
    expect(error.message).toMatch(
      new RegExp(`deadlineS ${need - 1} s is shorter than the ${need} s a rollout needs`),
    );
    expect(error.details).toMatchObject({ issues: [{ path: "deadlineS" }] });
    const own = {
      ...row,
      agent: { ...row.agent, timeoutS: 1 },
      deadlineS: 1 + verifierS + RUN_MARGIN_MS / 1000 + 10,
    };
    expect((await h.call({ method: "POST", url: "/v1/rollouts", payload: own })).statusCode).toBe(202);
  });

  it("answers 422 for sandbox options over the operator's ceiling (FLEET_SANDBOX_MAX_*), naming the variable, and admits nothing of a batch with such a row", async () => {
    const capped = await makeHarness({ FLEET_SANDBOX_MAX_MEMORY_MB: "2048", FLEET_SANDBOX_MAX_CPUS: "1.5" });
    const over = { ...row, sandbox: { memoryMb: 4096, cpus: 2, pidsLimit: 4096 } };
    const one = await capped.call({ method: "POST", url: "/v1/rollouts", payload: over });
    const error = expectErrorBody(one, 422, "invalid");
    expect(error.details).toEqual({
      issues: [
        {
          path: "sandbox.memoryMb",
          message: "asks for 4096, more than this fleet allows (FLEET_SANDBOX_MAX_MEMORY_MB=2048)",
        },
        {
          path: "sandbox.cpus",
          message: "asks for 2, more than this fleet allows (FLEET_SANDBOX_MAX_CPUS=1.5)",
        },
      ],
    });
    const batch = await capped.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: [row, over] },
    });
    expect(expectErrorBody(batch, 422, "invalid").details).toMatchObject({
      index: 1,
      issues: [{ path: "rollouts[1].sandbox.memoryMb" }, { path: "rollouts[1].sandbox.cpus" }],
    });
    expect(await capped.store.inflightCount()).toBe(0);
    // At the ceiling, and on a dispatcher without one, it is admitted.
    const at = { ...row, sandbox: { memoryMb: 2048, cpus: 1.5 } };
    expect((await capped.call({ method: "POST", url: "/v1/rollouts", payload: at })).statusCode).toBe(202);
    expect((await h.call({ method: "POST", url: "/v1/rollouts", payload: over })).statusCode).toBe(202);
  });

  it("answers 422 for a task whose tests/test.sh runs nothing (every agent would pass)", async () => {
    const res = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, task: { ...task, tests: { "test.sh": "#!/bin/sh\n# nothing yet\n" } } },
    });
    const error = expectErrorBody(res, 422, "invalid");
    expect(error.details).toMatchObject({
      issues: [{ path: "task.tests.test.sh", message: expect.stringContaining("runs nothing") }],
    });
  });

  it("answers 422 for a task graded by its tests without tests/test.sh, before any sandbox is made", async () => {
    const { tests: _, ...noTests } = task;
    const res = await h.call({ method: "POST", url: "/v1/rollouts", payload: { ...row, task: noTests } });
    const error = expectErrorBody(res, 422, "invalid");
    expect(error.details).toMatchObject({
      issues: [
        { path: "task.tests.test.sh", message: "is missing: a task graded by its tests needs tests/test.sh" },
      ],
    });
  });

  it("names no row of POST /v1/rollouts's 422 found at admission, keyed or not", async () => {
    // A non-finite number in the task's metadata: only admission refuses it (the request's own
    // metadata is refused by its schema first).
    const withX = JSON.stringify({ ...task, metadata: { x: 1 } }).replace('{"x":1}', '{"x":1e999}');
    const body = `{"task":${withX},"agent":{"harness":"oracle"}}`;
    const headers = { "content-type": "application/json" };
    const keyless = await h.call({ method: "POST", url: "/v1/rollouts", payload: body, headers });
    const keyed = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: body,
      headers: { ...headers, "idempotency-key": randomUUID() },
    });
    const a = expectErrorBody(keyless, 422, "invalid");
    const b = expectErrorBody(keyed, 422, "invalid");
    expect(a.message).toMatch(/too large for JSON \(non-finite\)/);
    expect(a.message).not.toMatch(/^rollout 0:/);
    expect(a.details).not.toHaveProperty("index");
    expect(b.message).toBe(a.message);
    expect(b.details).not.toHaveProperty("index");
  });

  it("answers 422 for an oracle rollout whose task has no solution/solve.sh, inline or by digest; a command agent takes the task", async () => {
    const { solution: _, ...noSolution } = task;
    const issues = [{ path: "task.solution.solve.sh", message: "is missing: the oracle agent runs it" }];
    const inline = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { task: noSolution, agent: oracle },
    });
    const error = expectErrorBody(inline, 422, "invalid");
    // One rollout: no "rollout 0" in what the client reads (a batch's row keeps its index).
    expect(error.message).toBe("task t-echo's solution/solve.sh is missing: the oracle agent runs it");
    expect(error.details).toEqual({ issues });

    const command = { harness: "command", argv: ["echo", "hello"] } as const;
    const taken = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { task: noSolution, agent: command },
    });
    expect(taken.statusCode, taken.body).toBe(202);
    // Stored now: the same task by its digest is read at admission, and refused for the oracle.
    const digest = digestTask(TaskContent.parse(noSolution));
    const byDigest = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: [row, { task: { digest }, agent: oracle }],
    });
    // A batch's row: its issues' paths start at the row, as a schema 422's do.
    expect(expectErrorBody(byDigest, 422, "invalid").details).toEqual({
      index: 1,
      issues: [{ ...issues[0], path: "[1].task.solution.solve.sh" }],
    });
  });

  it("places a batch row's admission 422 in the body as its schema 422s are: rollouts[i].path in JSON, the line in NDJSON", async () => {
    const short = { ...row, deadlineS: 20 };
    const json = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, short] } });
    const jsonError = expectErrorBody(json, 422, "invalid");
    expect(jsonError.message).toMatch(/^rollout 1: deadlineS 20 s is shorter/);
    expect(jsonError.details).toMatchObject({ index: 1, issues: [{ path: "rollouts[1].deadlineS" }] });
    // The same path a schema issue of that row gets.
    const schema = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: [row, { ...row, deadlineS: -1 }] },
    });
    expect(expectErrorBody(schema, 422, "invalid").details).toMatchObject({
      issues: [{ path: "rollouts[1].deadlineS" }],
    });

    const ndjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      headers: { "content-type": "application/x-ndjson" },
      payload: `${JSON.stringify(row)}\n\n${JSON.stringify(short)}\n`,
    });
    const ndjsonError = expectErrorBody(ndjson, 422, "invalid");
    expect(ndjsonError.message).toMatch(/^line 3: deadlineS 20 s is shorter/);
    expect(ndjsonError.details).toMatchObject({
      line: 3,
      index: 1,
      issues: [{ line: 3, path: "deadlineS" }],
    });
  });

  it("answers 422 for 1e999 (Infinity), negative timeouts, unknown sandbox options and harnesses", async () => {
    const bodies: [string, string][] = [
      [`{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"deadlineS":1e999}`, "deadlineS"],
      [
        `{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"x":[1,-1e999]}}`,
        "metadata.x[1]",
      ],
      [JSON.stringify({ ...row, agent: { harness: "oracle", timeoutS: -5 } }), "agent.timeoutS"],
      [JSON.stringify({ ...row, sandbox: { network: "host" } }), "sandbox"],
      [JSON.stringify({ ...row, agent: { harness: "gpt-direct" } }), "agent.harness"],
    ];
    for (const [payload, path] of bodies) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload,
        headers: { "content-type": "application/json" },
      });
      const error = expectErrorBody(res, 422, "invalid");
      expect(
        (error.details as { issues: { path: string }[] }).issues.map((i) => i.path),
        payload,
      ).toContain(path);
    }
  });

  it("answers 422, not 500, for a body nested too deep that comes with an Idempotency-Key", async () => {
    const deep = `${'{"a":'.repeat(20_000)}1${"}".repeat(20_000)}`;
    // In the task's metadata: a request's own `metadata` of that many values is refused before the
    // schema (MAX_METADATA_VALUES), so it never reaches the key's hashing.
    const one = `{"task":${JSON.stringify({ ...task, metadata: { x: 1 } }).replace('{"x":1}', `{"deep":${deep}}`)},"agent":{"harness":"oracle"}}`;
    for (const [url, payload] of [
      ["/v1/rollouts", one],
      ["/v1/batches", `{"rollouts":[${one}]}`],
    ] as const) {
      const res = await h.call({
        method: "POST",
        url,
        payload,
        headers: { "content-type": "application/json", "idempotency-key": `deep-${url}` },
      });
      expect(expectErrorBody(res, 422, "invalid").message).toMatch(/nested more than 64 levels/);
    }
  });

  it("never accepts a credential value: an apiKey in the agent is refused, and not echoed", async () => {
    const secret = "sk-live-DO-NOT-STORE-1234";
    const res = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, agent: { harness: "oracle", apiKey: secret } },
    });
    expectErrorBody(res, 422, "invalid");
    expect(res.body).toContain("apiKey");
    expect(res.body).not.toContain(secret);
  });

  it("answers 400 for a body that is not valid UTF-8 (never read with its bytes replaced: two bodies would read the same), JSON or NDJSON", async () => {
    const key = randomUUID();
    const withByte = (byte: number) =>
      Buffer.concat([
        Buffer.from(`{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"k":"`),
        Buffer.from([byte]),
        Buffer.from('"}}'),
      ]);
    for (const byte of [0xff, 0xfe]) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload: withByte(byte),
        headers: { "content-type": "application/json", "idempotency-key": key },
      });
      expect(expectErrorBody(res, 400, "malformed").message).toBe("the body is not valid UTF-8");
    }
    const ndjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: Buffer.concat([withByte(0xff), Buffer.from("\n")]),
      headers: { "content-type": "application/x-ndjson" },
    });
    expectErrorBody(ndjson, 400, "malformed");
    // Nothing was admitted under the key: the same key with a valid body is a first request.
    const valid = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: row,
      headers: { "idempotency-key": key },
    });
    expect(valid.statusCode, valid.body).toBe(202);
  });

  it("answers 415 for a body that declares a charset other than UTF-8 (never read as UTF-8 all the same), JSON or NDJSON", async () => {
    const key = randomUUID();
    // "Ã©" in latin1 is the bytes C3 A9, which are also valid UTF-8 ("é"): read as UTF-8, what
    // is stored would not be what the client sent.
    const body = Buffer.concat([
      Buffer.from(`{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"k":"`),
      Buffer.from("Ã©", "latin1"),
      Buffer.from('"}}'),
    ]);
    for (const type of ["application/json; charset=latin1", "application/json;charset=ISO-8859-1"]) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload: body,
        headers: { "content-type": type, "idempotency-key": key },
      });
      expect(expectErrorBody(res, 415, "unsupported_media_type").message).toMatch(/UTF-8/);
    }
    const ndjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: Buffer.concat([body, Buffer.from("\n")]),
      headers: { "content-type": "application/x-ndjson; charset=windows-1252" },
    });
    expectErrorBody(ndjson, 415, "unsupported_media_type");
    // UTF-8 declared, in any of its spellings, is read as before.
    for (const charset of ["utf-8", "UTF8", '"UTF-8"']) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload: row,
        headers: { "content-type": `application/json; charset=${charset}` },
      });
      expect(res.statusCode, res.body).toBe(202);
    }
    // US-ASCII is UTF-8's first 128 characters: a body of them reads the same either way (a
    // client labelling its JSON us-ascii, escaping the rest as \u), and is read. A byte past them
    // is no US-ASCII (browsers read the label as windows-1252): refused, not read as UTF-8.
    for (const charset of ["us-ascii", "US-ASCII", '"ascii"']) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload: row,
        headers: { "content-type": `application/json; charset=${charset}` },
      });
      expect(res.statusCode, `${charset}: ${res.body}`).toBe(202);
    }
    const asciiNdjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: `${JSON.stringify(row)}\n`,
      headers: { "content-type": "application/x-ndjson; charset=us-ascii" },
    });
    expect(asciiNdjson.statusCode, asciiNdjson.body).toBe(202);
    for (const [url, payload, type] of [
      ["/v1/rollouts", body, "application/json"],
      ["/v1/batches", Buffer.concat([body, Buffer.from("\n")]), "application/x-ndjson"],
    ] as const) {
      const res = await h.call({
        method: "POST",
        url,
        payload,
        headers: { "content-type": `${type}; charset=us-ascii`, "idempotency-key": key },
      });
      expect(expectErrorBody(res, 415, "unsupported_media_type").message).toMatch(/UTF-8/);
    }
    // A charset named twice says two things (RFC 6838 §4.3: an error): neither is taken, in either
    // order; the one named first read the latin1 body as UTF-8.
    for (const charsets of ["charset=utf-8; charset=latin1", "charset=latin1;charset=UTF-8"]) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload: body,
        headers: { "content-type": `application/json; ${charsets}`, "idempotency-key": key },
      });
      expect(expectErrorBody(res, 415, "unsupported_media_type").message, charsets).toMatch(/more than once/);
    }
    // The same charset named twice, in two spellings (a client that adds its own to the caller's)
    // says one thing: read as it was before, as UTF-8.
    for (const charsets of ["charset=utf-8; charset=utf-8", 'charset=UTF-8;charset="utf8"']) {
      const res = await h.call({
        method: "POST",
        url: "/v1/rollouts",
        payload: row,
        headers: { "content-type": `application/json; ${charsets}` },
      });
      expect(res.statusCode, `${charsets}: ${res.body}`).toBe(202);
    }
    // Nothing was admitted under the key: the same key with a UTF-8 body is a first request.
    const valid = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: row,
      headers: { "idempotency-key": key },
    });
    expect(valid.statusCode, valid.body).toBe(202);
  });

  it("a batch sent with the other format's content type says which one to use", async () => {
    const ndjsonAsJson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: `${JSON.stringify(row)}\n${JSON.stringify(row)}\n`,
      headers: { "content-type": "application/json" },
    });
    expectErrorBody(ndjsonAsJson, 400, "malformed");
    expect(ndjsonAsJson.json().error.message).toMatch(
      /^the body is not valid JSON \(.+\): one rollout request per line is NDJSON, which takes Content-Type: application\/x-ndjson$/,
    );
    const jsonAsNdjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: JSON.stringify({ rollouts: [row, row] }),
      headers: { "content-type": "application/x-ndjson" },
    });
    expectErrorBody(jsonAsNdjson, 422, "invalid");
    expect(jsonAsNdjson.json().error.message).toMatch(
      /^line 1: .+: a \{"rollouts": \[\.\.\.\]\} body is a JSON batch, which takes Content-Type: application\/json$/,
    );
    // Neither hint where it does not apply: one bad row of an NDJSON batch, a submit's bad JSON.
    const badRow = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: `${JSON.stringify(row)}\n{"agent":{}}\n`,
      headers: { "content-type": "application/x-ndjson" },
    });
    expectErrorBody(badRow, 422, "invalid");
    expect(badRow.json().error.message).not.toContain("Content-Type");
    const twoValues = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: `${JSON.stringify(row)}\n${JSON.stringify(row)}`,
      headers: { "content-type": "application/json" },
    });
    expectErrorBody(twoValues, 400, "malformed");
    expect(twoValues.json().error.message).not.toContain("Content-Type");
  });

  it("answers 400 for malformed JSON, 422 for JSON of the wrong shape (null, a string), and 415 for an unsupported content type", async () => {
    const bad = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: '{"task": ',
      headers: { "content-type": "application/json" },
    });
    expectErrorBody(bad, 400, "malformed");
    expect(bad.json().error.message).toMatch(/^the body is not valid JSON \(.+\)$/);
    const empty = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: "",
      headers: { "content-type": "application/json" },
    });
    expectErrorBody(empty, 400, "malformed");
    // JSON `null` is JSON: a body of the wrong shape, as `"x"` is, on both routes.
    for (const url of ["/v1/rollouts", "/v1/batches"]) {
      for (const payload of ["null", '"x"']) {
        const res = await h.call({
          method: "POST",
          url,
          payload,
          headers: { "content-type": "application/json" },
        });
        expectErrorBody(res, 422, "invalid");
      }
    }
    // A prototype-poisoning key is refused, not silently dropped.
    const poisoned = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: `{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"__proto__":{"x":1}}}`,
      headers: { "content-type": "application/json" },
    });
    expectErrorBody(poisoned, 400, "malformed");
    expect(poisoned.json().error.message).toBe(
      'the body has a "__proto__" or "constructor.prototype" key, which no request may carry',
    );
    const text = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: "hello",
      headers: { "content-type": "text/plain" },
    });
    expectErrorBody(text, 415, "unsupported_media_type");
    expect(text.json().error.message).toBe(
      "content type text/plain is not accepted: send application/json (POST /v1/batches also takes application/x-ndjson or application/jsonl)",
    );
    const ndjson = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: JSON.stringify(row),
      headers: { "content-type": "application/x-ndjson" },
    });
    expectErrorBody(ndjson, 415, "unsupported_media_type");
    expect(ndjson.json().error.message).toBe("this route takes application/json"); // the route's own
    // A compressed body says so, not "not valid JSON".
    const gzipped = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: gzipSync(JSON.stringify(row)),
      headers: { "content-type": "application/json", "content-encoding": "gzip" },
    });
    expectErrorBody(gzipped, 415, "unsupported_media_type");
    expect(gzipped.json().error.message).toBe(
      "Content-Encoding gzip is not supported: send the body uncompressed",
    );
    const identity = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: row,
      headers: { "content-encoding": "identity" },
    });
    expect(identity.statusCode).toBe(202);
  });

  it("a request without a body is not refused for a Content-Encoding a client sends on every request (415 is for a compressed body)", async () => {
    const headers = { "content-encoding": "gzip" };
    const accepted = await h.call({ method: "POST", url: "/v1/rollouts", payload: row });
    const { id } = accepted.json() as { id: string };
    for (const [method, url, status] of [
      ["GET", "/healthz", 200],
      ["GET", "/readyz", 200],
      ["GET", `/v1/rollouts/${id}`, 200],
      ["GET", "/v1/batches/bnope", 404],
      ["POST", `/v1/rollouts/${id}/cancel`, 202],
    ] as const) {
      const res = await h.call({ method, url, headers });
      expect(res.statusCode, `${method} ${url}: ${res.body}`).toBe(status);
    }
    // With a body, it is what it says: compressed, refused.
    const gzipped = await h.call({
      method: "POST",
      url: `/v1/rollouts/${id}/cancel`,
      payload: gzipSync("{}"),
      headers: { ...headers, "content-type": "application/json" },
    });
    expectErrorBody(gzipped, 415, "unsupported_media_type");
  });
});

describe("a request without a body, whatever its Content-Type", () => {
  it("cancels (curl -d '' sends a form's type, fetch with an empty body text/plain); a submit without a body gets its 400, not a 415", async () => {
    const accepted = await h.call({ method: "POST", url: "/v1/rollouts", payload: row });
    const { id } = accepted.json() as { id: string };
    for (const type of ["application/x-www-form-urlencoded", "text/plain;charset=UTF-8"]) {
      // As those clients send it: the type, and a length of 0.
      const headers = { "content-type": type, "content-length": "0" };
      const res = await h.call({ method: "POST", url: `/v1/rollouts/${id}/cancel`, payload: "", headers });
      expect(res.statusCode, `${type}: ${res.body}`).toBe(202);
      const submit = await h.call({ method: "POST", url: "/v1/rollouts", payload: "", headers });
      expectErrorBody(submit, 400, "malformed");
    }
    // Node's own fetch over a socket, as a client script would: text/plain, Content-Length: 0.
    const url = await h.app.listen({ host: "127.0.0.1", port: 0 });
    const other = (await h.call({ method: "POST", url: "/v1/rollouts", payload: row })).json() as {
      id: string;
    };
    const res = await fetch(`${url}/v1/rollouts/${other.id}/cancel`, {
      method: "POST",
      body: "",
      headers: { authorization: `Bearer ${TOKEN}` },
    });
    expect(res.status, await res.clone().text()).toBe(202);
    // With a body, the type is what it says: refused.
    const typed = await h.call({
      method: "POST",
      url: `/v1/rollouts/${id}/cancel`,
      payload: "a=1",
      headers: { "content-type": "application/x-www-form-urlencoded" },
    });
    expectErrorBody(typed, 415, "unsupported_media_type");
  });
});

/**
 * A `/healthz` request sent while another request is handled: whether it has been answered
 * yet, then that it was answered 200.
 */
function healthzProbe() {
  let answer: Promise<LightMyRequestResponse> | null = null;
  let answered = false;
  return {
    send(ask: () => Promise<LightMyRequestResponse>): void {
      answer = ask().finally(() => {
        answered = true;
      });
    },
    get answered(): boolean {
      return answered;
    },
    async expectOk(): Promise<void> {
      expect(answer, "/healthz was asked").not.toBeNull();
      expect((await answer!).statusCode).toBe(200);
    },
  };
}

/** A batch's NDJSON lines: the test's `row`, then `count - 1` rows of the same task by digest. */
function batchLines(count: number): string[] {
  const digest = digestTask(TaskContent.parse(task));
  const lines = [JSON.stringify(row)];
  for (let i = 1; i < count; i++)
    lines.push(JSON.stringify({ task: { digest }, agent: oracle, metadata: { i } }));
  return lines;
}

describe("POST /v1/batches", () => {
  it("reads an NDJSON body line by line as it arrives: /healthz answers while it is parsed", async () => {
    const h = await makeHarness();
    const digest = digestTask(TaskContent.parse(task));
    const half = Array.from(
      { length: 8_000 },
      (_, i) => `${JSON.stringify({ task: { digest }, agent: oracle, metadata: { i } })}\n`,
    ).join("");
    // The last line is no JSON, so the answer (a 400) comes as soon as the body is parsed,
    // with nothing of admission after it.
    const body = [Buffer.from(half), Buffer.from(`${half}{"task":\n`)];
    const healthz = healthzProbe();
    let batchDone = false;
    // The body's second half is handed over when the server asks for it: it has read the first
    // (the old parser read the whole body before parsing any of it, then parsed it in one go).
    // A health probe started then must be answered before the batch's answer, which comes only
    // once that second half is parsed too.
    const payload = new Readable({
      read() {
        const next = body.shift();
        if (next === undefined) {
          this.push(null);
          return;
        }
        if (body.length === 0) healthz.send(() => h.call({ method: "GET", url: "/healthz", token: null }));
        this.push(next);
      },
    });
    const batch = h
      .call({
        method: "POST",
        url: "/v1/batches",
        payload,
        headers: { "content-type": "application/x-ndjson" },
      })
      .finally(() => {
        batchDone = true;
        // The probe must have finished by now.
        expect(healthz.answered, "/healthz answered before the batch").toBe(true);
      });
    const res = await batch;
    expectErrorBody(res, 400, "malformed");
    expect(res.json().error.details).toEqual({ line: 16_001 });
    await healthz.expectOk();
    expect(batchDone).toBe(true);
  });

  it("admits a large batch handing the event loop on between rows: /healthz, asked as its admission starts, is answered before the admission first asks Redis", async () => {
    const healthz = healthzProbe();
    let answeredFirst: boolean | null = null;
    const h = await makeHarness({ FLEET_MAX_BACKLOG: "20000" }, undefined, undefined, {
      // The route's handler starts right after this: from there to its first question to Redis
      // (whether its key names a rollout), admission checks and serialises every row.
      hooks: (app) =>
        app.addHook("preHandler", async (req) => {
          if (req.url === "/v1/batches") healthz.send(() => app.inject({ method: "GET", url: "/healthz" }));
        }),
      patchStore: (store) => {
        const exists = store.exists.bind(store);
        store.exists = (...args) => {
          answeredFirst ??= healthz.answered;
          return exists(...args);
        };
      },
    });
    // The backlog is full: the batch gets its 429 at the reservation, nothing recorded.
    await redis.zadd(
      h.store.keys.inflight(),
      ...Array.from({ length: 15_000 }, (_, i) => [Date.now() + 3_600_000, `busy-${i}`]).flat(),
    );
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: batchLines(8_000).join("\n"),
      headers: { "content-type": "application/x-ndjson" },
    });
    expectErrorBody(res, 429, "backpressure");
    await healthz.expectOk();
    expect(answeredFirst, "/healthz answered while the batch's rows were checked").toBe(true);
  });

  it("enqueues a large batch's seeds handing the event loop on: /healthz, asked as the seeds start, is answered before the last of them is sent", async () => {
    const rows = 2_500;
    let app: FastifyInstance | null = null;
    const healthz = healthzProbe();
    // For each transaction of seed jobs sent, whether /healthz had been answered by then.
    const sends: { jobs: number; healthzDone: boolean }[] = [];
    const h = await makeHarness({}, (queues) => {
      const enqueueSeeds = queues.enqueueSeeds.bind(queues);
      queues.enqueueSeeds = (ids) => {
        healthz.send(() => app!.inject({ method: "GET", url: "/healthz" }));
        return enqueueSeeds(ids);
      };
      const seed = queues.queues.seed;
      const addBulk = seed.addBulk.bind(seed);
      seed.addBulk = (jobs) => {
        sends.push({ jobs: jobs.length, healthzDone: healthz.answered });
        return addBulk(jobs);
      };
    });
    app = h.app;
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: batchLines(rows).join("\n"),
      headers: { "content-type": "application/x-ndjson" },
    });
    expect(res.statusCode, res.body.slice(0, 500)).toBe(202);
    await healthz.expectOk();
    // One transaction of every seed was built in one stretch of the event loop (40,000 rows: 2.4 s).
    expect(
      sends.at(-1)?.healthzDone,
      `/healthz answered before the last seeds were sent (${sends.length} sends)`,
    ).toBe(true);
    // Every seed, once.
    expect(sends.reduce((n, s) => n + s.jobs, 0)).toBe(rows);
    const { rolloutIds: ids } = res.json() as { rolloutIds: string[] };
    const pipe = redis.pipeline();
    for (const id of ids) pipe.exists(`${h.prefix}:seed:${id}.seed`);
    expect((await pipe.exec())!.filter(([, v]) => v === 1)).toHaveLength(rows);
  });

  it("checks and hashes a token's keyed batch handing the event loop on: /healthz, asked once the key's batch is looked up, is answered before the key's unscoped batch is", async () => {
    let app: FastifyInstance | null = null;
    const healthz = healthzProbe();
    let answeredFirst: boolean | null = null;
    let lookups = 0;
    const h = await makeHarness({}, undefined, undefined, {
      patchStore: (store) => {
        const getBatch = store.getBatch.bind(store);
        store.getBatch = async (...args) => {
          // The first: what the key (scoped to the token) has admitted; the second: whether the
          // bare key, from before keys were scoped, names this very body. Between them every row
          // is checked and serialised, and the body hashed.
          if (++lookups === 2) answeredFirst = healthz.answered;
          const found = await getBatch(...args);
          if (lookups === 1) healthz.send(() => app!.inject({ method: "GET", url: "/healthz" }));
          return found;
        };
      },
    });
    app = h.app;
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: batchLines(8_000).join("\n"),
      headers: { "content-type": "application/x-ndjson", "idempotency-key": randomUUID() },
    });
    expect(res.statusCode, res.body.slice(0, 500)).toBe(202);
    expect(res.json().count).toBe(8_000);
    await healthz.expectOk();
    expect(answeredFirst, "/healthz answered while the rows were checked and hashed").toBe(true);
  });

  it("checks a JSON batch's rows handing the event loop on: /healthz, asked as its handler starts, is answered before the submission first asks Redis", async () => {
    const healthz = healthzProbe();
    let answeredFirst: boolean | null = null;
    const h = await makeHarness({}, undefined, undefined, {
      // The route's handler starts right after this; its body's rows are checked there, then the
      // submission asks Redis what its key has admitted.
      hooks: (app) =>
        app.addHook("preHandler", async (req) => {
          if (req.url === "/v1/batches") healthz.send(() => app.inject({ method: "GET", url: "/healthz" }));
        }),
      patchStore: (store) => {
        const getBatch = store.getBatch.bind(store);
        store.getBatch = (...args) => {
          answeredFirst ??= healthz.answered;
          return getBatch(...args);
        };
      },
    });
    const digest = digestTask(TaskContent.parse(task));
    const rows = [
      row,
      ...Array.from({ length: 7_999 }, (_, i) => ({ task: { digest }, agent: oracle, metadata: { i } })),
    ];
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: rows },
      headers: { "idempotency-key": randomUUID() },
    });
    expect(res.statusCode, res.body.slice(0, 500)).toBe(202);
    expect(res.json().count).toBe(8_000);
    await healthz.expectOk();
    expect(answeredFirst, "/healthz answered while the batch's rows were checked").toBe(true);
  });

  it("holds a batch's backlog room for as long as its admission goes on, past the reservation's TTL (by Redis's clock)", async () => {
    const ttlMs = 1000;
    let recording!: () => void;
    const recordingNow = new Promise<void>((resolve) => {
      recording = resolve;
    });
    let proceed!: () => void;
    const gate = new Promise<void>((resolve) => {
      proceed = resolve;
    });
    // The first admission's recording waits for the test: an admission as slow as a loaded host's.
    let slow = true;
    const h = await makeHarness({ FLEET_MAX_BACKLOG: "2" }, undefined, undefined, {
      reservationTtlMs: ttlMs,
      patchStore: (store) => {
        const record = store.admit.bind(store);
        store.admit = async (...args) => {
          if (slow) {
            slow = false;
            recording();
            await gate;
          }
          return record(...args);
        };
      },
    });
    const first = h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row] } });
    // However this test ends, the first admission is let go.
    onTestFinished(() => proceed());
    await recordingNow;
    const reservations = h.store.keys.reservations();
    const taken = await redis.zrange(reservations, "0", "-1", "WITHSCORES");
    expect(taken).toHaveLength(2);
    // Expiring by Redis's clock, not this process's.
    const redisNow = async () => {
      const [sec, usec] = await redis.time();
      return Number(sec) * 1000 + Math.floor(Number(usec) / 1000);
    };
    expect(Number(taken[1])).toBeGreaterThan((await redisNow()) - 1);
    expect(Number(taken[1])).toBeLessThanOrEqual((await redisNow()) + ttlMs);
    // Past the TTL it was taken with, the admission still going on:
    while ((await redisNow()) <= Number(taken[1]) + ttlMs / 2) {
      await new Promise((resolve) => setTimeout(resolve, 25));
    }
    // its room is still held (refreshed), so one more rollout would pass the bound of 2.
    const second = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row] } });
    expectErrorBody(second, 429, "backpressure");
    expect(second.json().error.details).toMatchObject({ inflight: 0, admitting: 2, incoming: 1 });
    proceed();
    const res = await first;
    expect(res.statusCode, res.body).toBe(202);
    // Given back once recorded: the rollouts count as in flight now.
    expect(await redis.zcard(reservations)).toBe(0);
    expect(await h.store.inflightCount()).toBe(2);
  });

  it("takes a JSON batch body up to FLEET_MAX_JSON_BATCH_BYTES; past it a 413 that says to send NDJSON, which takes the same rows", async () => {
    const h = await makeHarness({ FLEET_MAX_JSON_BATCH_BYTES: "4096" });
    const rows = Array.from({ length: 20 }, (_, i) => ({ ...row, metadata: { i } }));
    const json = JSON.stringify({ rollouts: rows });
    expect(json.length).toBeGreaterThan(4096);
    const expectJson413 = (res: LightMyRequestResponse) => {
      const err = expectErrorBody(res, 413, "payload_too_large");
      expect(err.message).toMatch(/^a JSON batch body is at most 4096 bytes.*send a large batch as NDJSON/);
      expect(err.details).toMatchObject({ limit: 4096, ndjsonLimit: 32 * 1024 * 1024 });
    };
    // By its Content-Length, and chunked (no length: counted as it is read).
    const sized = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: json,
      headers: { "content-type": "application/json" },
    });
    expectJson413(sized);
    expect(sized.json().error.details.bytes).toBe(json.length);
    expectJson413(
      await h.call({
        method: "POST",
        url: "/v1/batches",
        payload: Readable.from([Buffer.from(json)]),
        headers: { "content-type": "application/json", "transfer-encoding": "chunked" },
      }),
    );
    const ndjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: rows.map((r) => JSON.stringify(r)).join("\n"),
      headers: { "content-type": "application/x-ndjson" },
    });
    expect(ndjson.statusCode, ndjson.body).toBe(202);
    expect(ndjson.json().count).toBe(20);
    // Under the bound, JSON as before; a single rollout is not bounded by it.
    const small = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: rows.slice(0, 2) },
    });
    expect(small.statusCode, small.body).toBe(202);
    const single = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, metadata: { pad: "x".repeat(4000) } },
    });
    expect(single.statusCode, single.body).toBe(202);
  });

  it("admits 10,000 NDJSON rows (one task inline, then by digest) with every seed job", async () => {
    const big = await makeHarness();
    const digest = digestTask(TaskContent.parse(task));
    const lines = [JSON.stringify(row)];
    for (let i = 1; i < 10_000; i++) {
      lines.push(JSON.stringify({ task: { digest }, agent: oracle, metadata: { i } }));
    }
    const payload = `${lines.join("\n")}\n`;
    const started = performance.now();
    const res = await big.call({
      method: "POST",
      url: "/v1/batches",
      payload,
      headers: { "content-type": "application/x-ndjson", "idempotency-key": randomUUID() },
    });
    const ms = performance.now() - started;
    console.log(
      `POST /v1/batches: 10,000 NDJSON rows (${(payload.length / 1024).toFixed(0)} KiB) admitted in ${ms.toFixed(0)} ms`,
    );
    expect(res.statusCode, res.body.slice(0, 500)).toBe(202);
    const body = res.json() as { batchId: string; rolloutIds: string[]; count: number; created: boolean };
    expect(body.count).toBe(10_000);
    expect(body.created).toBe(true);
    expect(new Set(body.rolloutIds).size).toBe(10_000);

    const batch = await big.call({ method: "GET", url: `/v1/batches/${body.batchId}` });
    expect(batch.json()).toMatchObject({
      id: body.batchId,
      total: 10_000,
      done: 0,
      counts: { accepted: 10_000 },
    });

    const counts = await big.queues.queues.seed.getJobCounts("waiting", "delayed", "prioritized", "active");
    expect(Object.values(counts).reduce((a, b) => a + b, 0)).toBe(10_000);
    const pipe = redis.pipeline();
    for (const id of body.rolloutIds) pipe.exists(`${big.prefix}:seed:${id}.seed`);
    const exists = (await pipe.exec())!.map(([, v]) => v);
    expect(exists.filter((v) => v === 1)).toHaveLength(10_000);
    // Ten thousand rollouts, one stored task.
    expect(await big.store.getTask(digest)).toMatchObject({ id: "t-echo" });
  });

  it("accepts { rollouts } JSON, replays by key, and answers 409 for another body", async () => {
    const key = randomUUID();
    const payload = { rollouts: [row, { ...row, metadata: { n: 1 } }] };
    const first = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload,
      headers: { "idempotency-key": key },
    });
    expect(first.statusCode, first.body).toBe(202);
    const body = first.json() as { batchId: string; rolloutIds: string[]; count: number; created: boolean };
    expect(body).toMatchObject({ count: 2, created: true });
    const again = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload,
      headers: { "idempotency-key": key },
    });
    expect(again.statusCode).toBe(200);
    expect(again.json()).toEqual({ ...body, created: false });
    const other = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: [row] },
      headers: { "idempotency-key": key },
    });
    expectErrorBody(other, 409, "conflict");
  });

  it("a JSON body that is a string is not a batch (422), however much it looks like NDJSON", async () => {
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      headers: { "content-type": "application/json" },
      payload: JSON.stringify(JSON.stringify(row)),
    });
    expectErrorBody(res, 422, "invalid");
  });

  it("a rollout body of more than 100,000 JSON values is its 422 before it is parsed (JSON.parse cannot be cut short)", async () => {
    // Cut short, so not even JSON: parsed first, it would be a 400; unparsed, the count refuses it.
    const values = `{"x":[${"{},".repeat(100_001)}{}`;
    const res = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      headers: { "content-type": "application/json" },
      payload: values,
    });
    const error = expectErrorBody(res, 422, "invalid");
    expect(error.message).toMatch(/^rollout request is invalid \(body: holds more than 100000 JSON values/);
    // The same as NDJSON: that line's 422.
    const ndjson = await h.call({
      method: "POST",
      url: "/v1/batches",
      headers: { "content-type": "application/x-ndjson" },
      payload: `${JSON.stringify(row)}\n${values}\n`,
    });
    expect(expectErrorBody(ndjson, 422, "invalid").message).toMatch(
      /^line 2: holds more than 100000 JSON values/,
    );
  });

  it("metadata over 4 KiB of JSON is a 422 naming the limit", async () => {
    const metadata = { tokens: Array.from({ length: 1000 }, (_, i) => 100_000 + i) };
    const res = await h.call({ method: "POST", url: "/v1/rollouts", payload: { ...row, metadata } });
    const error = expectErrorBody(res, 422, "invalid");
    expect(error.message).toMatch(/metadata is \d+ bytes of JSON, over the limit of 4096/);
    const small = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: { ...row, metadata: { step: 7 } },
    });
    expect(small.statusCode, small.body).toBe(202);
  });

  it("a batch refused at admission records nothing: its key stays free for the corrected body", async () => {
    const key = randomUUID();
    const headers = { "idempotency-key": key };
    const unknown = { task: { digest: "0".repeat(64) }, agent: oracle };
    const refused = await h.call({ method: "POST", url: "/v1/batches", payload: [row, unknown], headers });
    const error = expectErrorBody(refused, 422, "invalid");
    expect(error.message).toContain("unknown task digest");
    const fixed = await h.call({ method: "POST", url: "/v1/batches", payload: [row, row], headers });
    expect(fixed.statusCode, fixed.body).toBe(202);
    const { batchId } = fixed.json() as { batchId: string };
    const progress = await h.call({ method: "GET", url: `/v1/batches/${batchId}` });
    expect(progress.json()).toMatchObject({ total: 2 });
  });

  it("names the bad NDJSON line (422 invalid, 400 not JSON, 422 unknown digest)", async () => {
    const lines = [JSON.stringify(row), "", JSON.stringify({ ...row, deadlineS: 0 }), JSON.stringify(row)];
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: lines.join("\n"),
      headers: { "content-type": "application/x-ndjson" },
    });
    const error = expectErrorBody(res, 422, "invalid");
    expect(error.message).toMatch(/^line 3: deadlineS/);
    expect(error.details).toMatchObject({ line: 3 });

    const notJson = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: `${JSON.stringify(row)}\nnot json\n`,
      headers: { "content-type": "application/x-ndjson" },
    });
    expect(expectErrorBody(notJson, 400, "malformed").details).toEqual({ line: 2 });

    const unknownDigest = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: `${JSON.stringify(row)}\n\n${JSON.stringify({ task: { digest: "0".repeat(64) }, agent: oracle })}\n`,
      headers: { "content-type": "application/x-ndjson" },
    });
    const e3 = expectErrorBody(unknownDigest, 422, "invalid");
    expect(e3.message).toMatch(/^line 3: unknown task digest/);
  });
});

describe("limits", () => {
  it("answers 413 for a body over the limit and for a task over maxTaskBytes", async () => {
    const small = await makeHarness({ FLEET_MAX_BODY_BYTES: "65536", FLEET_MAX_TASK_BYTES: "4096" });
    const huge = { ...row, task: { ...task, instruction: "x".repeat(70_000) } };
    const overBody = await small.call({ method: "POST", url: "/v1/rollouts", payload: huge });
    expectErrorBody(overBody, 413, "payload_too_large");
    const overNdjson = await small.call({
      method: "POST",
      url: "/v1/batches",
      payload: JSON.stringify(huge),
      headers: { "content-type": "application/x-ndjson" },
    });
    expectErrorBody(overNdjson, 413, "payload_too_large");
    // A body on a GET is no route's to read: not drained nor refused.
    const get = await small.call({
      method: "GET",
      url: "/v1/rollouts/no-such-rollout",
      payload: JSON.stringify(huge),
    });
    expect(get.statusCode).toBe(404);
    // Chunked (no Content-Length): refused as it passes the limit, in the same words.
    const chunked = await small.call({
      method: "POST",
      url: "/v1/rollouts",
      payload: Readable.from([Buffer.from(JSON.stringify(huge))]),
      headers: { "content-type": "application/json" },
    });
    const tooLarge = expectErrorBody(chunked, 413, "payload_too_large");
    expect(tooLarge).toMatchObject({
      message: "the request body is over the limit of 65536 bytes",
      details: { limit: 65536 },
    });

    const bigTask = { ...row, task: { ...task, instruction: "y".repeat(5000) } };
    const overTask = await small.call({ method: "POST", url: "/v1/rollouts", payload: bigTask });
    const error = expectErrorBody(overTask, 413, "payload_too_large");
    expect(error.details).toMatchObject({ limit: 4096 });
  });

  it("refuses, unparsed, a JSON body over 64 KiB on a route no submission reads: the public sign-in, a cancel, a route not there (a parse of megabytes held the event loop for seconds)", async () => {
    const h = await makeHarness();
    // 3 MiB of `[{},{},…]`: a million values to parse.
    const values = `[${"{},".repeat(1024 * 1024 - 1)}{}]`;
    for (const [url, token] of [
      ["/admin/login", null],
      ["/v1/rollouts/nope/cancel", TOKEN],
      ["/v1/batches/bnope/cancel", TOKEN],
      ["/v1/nothing", TOKEN],
    ] as const) {
      for (const payload of [values, Readable.from([Buffer.from(values)])]) {
        const res = await h.call({
          method: "POST",
          url,
          token,
          payload,
          headers: { "content-type": "application/json" },
        });
        const err = expectErrorBody(res, 413, "payload_too_large");
        expect(err.details, url).toMatchObject({ limit: OTHER_JSON_BODY_BYTES });
      }
    }
    // A small one is read as before: the cancel of a rollout that is not there.
    const small = await h.call({ method: "POST", url: "/v1/rollouts/nope/cancel", payload: {} });
    expectErrorBody(small, 404, "not_found");
  });

  it("holds the backlog bound under concurrent submissions: what passes it is a 429, never admitted", async () => {
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "10" });
    const five = { rollouts: [row, row, row, row, row] };
    const answers = await Promise.all(
      Array.from({ length: 6 }, () => tight.call({ method: "POST", url: "/v1/batches", payload: five })),
    );
    const codes = answers.map((a) => a.statusCode).sort();
    expect(codes, answers.map((a) => a.body).join("\n")).toEqual([202, 202, 429, 429, 429, 429]);
    expect(await tight.store.inflightCount()).toBe(10);
    // The reservations went with their requests: room that frees up is usable at once.
    expect(await redis.zcard(`${tight.prefix}:x:reservations`)).toBe(0);
  });

  it("the same keyed request sent again while the first is still being admitted shares its room: never a 429, one set of rollouts", async () => {
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "10" });
    const six = { rollouts: [row, row, row, row, row, row] };
    for (let trial = 0; trial < 3; trial++) {
      const key = randomUUID();
      const answers = await Promise.all(
        Array.from({ length: 3 }, () =>
          tight.call({
            method: "POST",
            url: "/v1/batches",
            payload: six,
            headers: { "idempotency-key": key },
          }),
        ),
      );
      expect(
        answers.map((a) => a.statusCode).every((c) => c === 200 || c === 202),
        answers.map((a) => a.body).join("\n"),
      ).toBe(true);
      expect(new Set(answers.map((a) => a.json().batchId)).size).toBe(1);
      expect(await tight.store.inflightCount()).toBe(6);
      expect(await redis.zcard(`${tight.prefix}:x:reservations`)).toBe(0);
      for (const id of answers[0]!.json().rolloutIds as string[]) {
        await tight.store.finalize(
          { id, batchId: answers[0]!.json().batchId },
          resultFor(id, null, 1),
          Date.now(),
        );
      }
    }
    // Another request (no key) while one holds room is still bound: 6 + 6 > 10.
    const key = randomUUID();
    const [keyed, other] = await Promise.all([
      tight.call({ method: "POST", url: "/v1/batches", payload: six, headers: { "idempotency-key": key } }),
      tight.call({ method: "POST", url: "/v1/batches", payload: six }),
    ]);
    expect([keyed.statusCode, other.statusCode].sort()).toEqual([202, 429]);
  });

  it("a request under the same key with another body never shares the first's room: a 429 while the first holds it", async () => {
    // The first admission stops after its reservation, before it claims the key (`createBatch`).
    const gate = latchPair();
    let first = true;
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "10" }, undefined, undefined, {
      patchStore: (store) => {
        const create = store.createBatch.bind(store);
        store.createBatch = async (...args) => {
          if (first) {
            first = false;
            gate.entered();
            await gate.released;
          }
          return create(...args);
        };
      },
    });
    onTestFinished(() => gate.release());
    const key = randomUUID();
    const six = (n: number) => ({ rollouts: Array.from({ length: 6 }, () => ({ ...row, metadata: { n } })) });
    const send = (n: number) =>
      tight.call({
        method: "POST",
        url: "/v1/batches",
        payload: six(n),
        headers: { "idempotency-key": key },
      });
    const holding = send(1);
    await gate.enteredP;
    // 6 held, 6 more would pass 10: refused, not let in on the first's room (it would then claim
    // the key, the first would give its room back with its 409, and its rollouts hold none).
    const other = await send(2);
    expectErrorBody(other, 429, "backpressure");
    gate.release();
    expect((await holding).statusCode).toBe(202);
    expect(await tight.store.inflightCount()).toBe(6);
    // The same body again is the same request: it shares, as ever (a replay now: nothing to reserve).
    expect((await send(1)).statusCode).toBe(200);
  });

  it("a keyed request finishing an admission cut short reserves room for what it still admits: the bound holds", async () => {
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "10" });
    const key = randomUUID();
    const six = [row, row, row, row, row, row];
    // A dispatcher recorded 2 of the 6, then died.
    const dying = Object.create(tight.store) as typeof tight.store;
    dying.admit = async (metas, now) => {
      await tight.store.admit(metas.slice(0, 2), now);
      throw new Error("the dispatcher died");
    };
    const requests = six.map((r) => RolloutRequest.parse(r));
    await expect(
      admit(dying, tight.queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e7 }),
    ).rejects.toThrow("the dispatcher died");
    // Another client fills the room meanwhile: 2 + 6 in flight.
    const other = await tight.call({ method: "POST", url: "/v1/batches", payload: { rollouts: six } });
    expect(other.statusCode).toBe(202);
    // The replay would admit 4 more: 8 + 4 > 10.
    const replay = await tight.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: six },
      headers: { "idempotency-key": key },
    });
    expect(expectErrorBody(replay, 429, "backpressure").details).toMatchObject({ inflight: 8, incoming: 4 });
    expect(await tight.store.inflightCount()).toBe(8);
    // The same under a key scoped to the token (the path of every key sent since keys were scoped).
    const scoped = randomUUID();
    const principal = createHash("sha256").update(TOKEN).digest("hex");
    await expect(
      admit(
        dying,
        tight.queues,
        { requests, batch: true, idempotencyKey: `${principal}\n${scoped}` },
        { maxTaskBytes: 1e7 },
      ),
    ).rejects.toThrow("the dispatcher died");
    const again = await tight.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: six },
      headers: { "idempotency-key": scoped },
    });
    expect(expectErrorBody(again, 429, "backpressure").details).toMatchObject({ inflight: 10, incoming: 4 });
  });

  it("a batch's key sent with another body is a 409 at a full backlog too, never a 429 to retry for", async () => {
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "3" });
    const key = randomUUID();
    const headers = { "idempotency-key": key };
    const first = await tight.call({ method: "POST", url: "/v1/batches", payload: [row, row], headers });
    expect(first.statusCode, first.body).toBe(202);
    const fill = await tight.call({ method: "POST", url: "/v1/rollouts", payload: row });
    expect(fill.statusCode, fill.body).toBe(202);
    // Other rows under the key, more of them than it admitted: no room would ever make it a batch.
    const other = { ...row, metadata: { n: 1 } };
    for (const payload of [
      [other, other, other],
      [row, row, other],
    ]) {
      const refused = await tight.call({ method: "POST", url: "/v1/batches", payload, headers });
      const error = expectErrorBody(refused, 409, "conflict");
      expect(error.details).toEqual({ batchId: first.json().batchId });
    }
    expect(await tight.store.inflightCount()).toBe(3);
    expect(await redis.zcard(`${tight.prefix}:x:reservations`)).toBe(0);
  });

  it("replays an admitted batch larger than a backlog bound lowered since (a restart): never a 413 that a client splits into new batches", async () => {
    const before = await makeHarness({ FLEET_MAX_BACKLOG: "10" });
    const key = randomUUID();
    const payload = { rollouts: [row, row, row, row] };
    const first = await before.call({
      method: "POST",
      url: "/v1/batches",
      payload,
      headers: { "idempotency-key": key },
    });
    expect(first.statusCode, first.body).toBe(202);
    // The dispatcher restarted with FLEET_MAX_BACKLOG=3, on the same Redis and prefix.
    const registry = createMetricsRegistry({ app: "dispatcher", defaultMetrics: false });
    const lowered = createServer({
      store: before.store,
      queues: before.queues,
      ledger: new TeardownLedger(redis, before.prefix),
      redis,
      config: parseConfig(DispatcherConfig, {
        FLEET_PREFIX: before.prefix,
        FLEET_API_TOKENS: TOKEN,
        FLEET_MAX_BACKLOG: "3",
      }),
      logger: createLogger({ name: "dispatcher-test", level: "silent" }),
      registry,
      metrics: createFleetMetrics(registry),
    });
    try {
      await lowered.ready();
      const replay = await lowered.inject({
        method: "POST",
        url: "/v1/batches",
        payload,
        headers: { authorization: `Bearer ${TOKEN}`, "idempotency-key": key },
      });
      expect(replay.statusCode, replay.body).toBe(200);
      expect(replay.json()).toEqual({ ...first.json(), created: false });
      // A new batch that size still can never fit.
      const fresh = await lowered.inject({
        method: "POST",
        url: "/v1/batches",
        payload,
        headers: { authorization: `Bearer ${TOKEN}` },
      });
      expectErrorBody(fresh, 413, "payload_too_large");
    } finally {
      await lowered.close();
    }
  });

  it("answers 429 with Retry-After past the backlog bound, but still replays an admitted batch", async () => {
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "3" });
    const key = randomUUID();
    const payload = { rollouts: [row, row] };
    const first = await tight.call({
      method: "POST",
      url: "/v1/batches",
      payload,
      headers: { "idempotency-key": key },
    });
    expect(first.statusCode).toBe(202);
    const more = await tight.call({ method: "POST", url: "/v1/batches", payload });
    const error = expectErrorBody(more, 429, "backpressure");
    expect(more.headers["retry-after"]).toBe("5");
    expect(error.details).toMatchObject({ inflight: 2, admitting: 0, incoming: 2, maxBacklog: 3 });
    const one = await tight.call({ method: "POST", url: "/v1/rollouts", payload: row });
    expect(one.statusCode).toBe(202);
    const full = await tight.call({ method: "POST", url: "/v1/rollouts", payload: row });
    expectErrorBody(full, 429, "backpressure");
    // Full, and a request that can never be admitted: its own 4xx, not a 429 to retry for.
    const unknown = { ...row, task: { digest: "0".repeat(64) } };
    for (const [url, payload] of [
      ["/v1/rollouts", unknown],
      ["/v1/batches", { rollouts: [row, unknown] }],
    ] as const) {
      const refused = await tight.call({ method: "POST", url, payload });
      expect(expectErrorBody(refused, 422, "invalid").message).toMatch(/unknown task digest/);
    }
    expect(await redis.zcard(`${tight.prefix}:x:reservations`)).toBe(0);
    // The client lost the first answer and retries: it gets its batch back, not a 429.
    const replay = await tight.call({
      method: "POST",
      url: "/v1/batches",
      payload,
      headers: { "idempotency-key": key },
    });
    expect(replay.statusCode, replay.body).toBe(200);
    expect(replay.json().batchId).toBe(first.json().batchId);
    // A batch that could never fit is 413, not a 429 to retry forever.
    const never = await tight.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: [row, row, row, row] },
    });
    expectErrorBody(never, 413, "payload_too_large");
  });
});

describe("auth, 404s and ops routes", () => {
  it("answers 401 without a token or with a wrong one, on API routes and unknown routes", async () => {
    for (const token of [null, "wrong-token", `${TOKEN}x`]) {
      for (const [method, url] of [
        ["GET", "/v1/batches/nope"],
        ["POST", "/v1/rollouts"],
        ["GET", "/openapi.json"],
        ["GET", "/no/such/route"],
      ] as const) {
        const res = await h.call({ method, url, token, payload: method === "POST" ? row : undefined });
        expectErrorBody(res, 401, "unauthorized");
        expect(res.headers["www-authenticate"]).toContain("Bearer");
      }
      // A body the dispatcher would not read (compressed, in another charset): still the 401 an
      // unauthenticated client gets for anything, not the 415 a signed-in one is told to fix.
      for (const headers of [
        { "content-type": "application/json", "content-encoding": "gzip" },
        { "content-type": "application/json; charset=latin1" },
      ]) {
        for (const url of ["/v1/rollouts", "/v1/rollouts/nope/cancel", "/no/such/route"]) {
          const res = await h.call({ method: "POST", url, token, payload: JSON.stringify(row), headers });
          expectErrorBody(res, 401, "unauthorized");
        }
      }
    }
    const admin = await h.call({ method: "GET", url: "/openapi.json", token: ADMIN });
    expect(admin.statusCode).toBe(200);
  });

  it("logs each request with the id it names; scrapes and probes at debug only", async () => {
    const lines: Record<string, unknown>[] = [];
    const logged = await makeHarness({}, undefined, (l) => lines.push(JSON.parse(l)));
    const accepted = await logged.call({ method: "POST", url: "/v1/rollouts", payload: row });
    const id = (accepted.json() as { id: string }).id;
    await logged.call({ method: "GET", url: `/v1/rollouts/${id}` });
    await logged.call({ method: "GET", url: "/metrics", token: null });
    const requests = lines.filter((l) => l.msg === "request");
    expect(requests.map((l) => [l.level, l.method, l.route, l.id ?? null])).toEqual([
      [30, "POST", "/v1/rollouts", null],
      [30, "GET", "/v1/rollouts/:id", id],
      [20, "GET", "/metrics", null],
    ]);
  });

  it("serves health, readiness and metrics without a token", async () => {
    const health = await h.call({ method: "GET", url: "/healthz", token: null });
    expect(health.json()).toEqual({ status: "ok" });
    const ready = await h.call({ method: "GET", url: "/readyz", token: null });
    expect(ready.json()).toEqual({ status: "ready" });
    await h.call({ method: "POST", url: "/v1/rollouts", payload: row });
    const metrics = await h.call({ method: "GET", url: "/metrics", token: null });
    expect(metrics.statusCode).toBe(200);
    expect(metrics.headers["content-type"]).toContain("text/plain");
    const waiting = /fleet_queue_jobs\{queue="seed",state="waiting",app="dispatcher"\} (\d+)/.exec(
      metrics.body,
    );
    expect(Number(waiting?.[1])).toBeGreaterThan(0);
    expect(metrics.body).toMatch(
      /fleet_queue_oldest_waiting_age_seconds\{queue="seed",app="dispatcher"\} [\d.]+/,
    );
    expect(metrics.body).toMatch(/fleet_teardown_ledger_entries\{app="dispatcher"\} 0/);
    expect(metrics.body).toMatch(/fleet_redis_up\{app="dispatcher"\} 1/);
    expect(metrics.body).toMatch(/fleet_rollouts_inflight\{app="dispatcher"\} [1-9]/);
    // No worker consumes this test's queues; the janitor's queue is sampled too.
    expect(metrics.body).toMatch(/fleet_queue_workers\{queue="run",app="dispatcher"\} 0/);
    expect(metrics.body).toMatch(/fleet_queue_jobs\{queue="janitor",state="waiting",app="dispatcher"\} 0/);
  });

  it("scrapes of /metrics that arrive together share one refresh from Redis (the route is public); one after it refreshes again", async () => {
    let probes = 0;
    const shared = await makeHarness({}, undefined, undefined, {
      patchStore: (store) => {
        const probeWrite = store.probeWrite.bind(store);
        store.probeWrite = async () => {
          probes++;
          return probeWrite();
        };
      },
    });
    const scrapes = await Promise.all(
      Array.from({ length: 20 }, () => shared.call({ method: "GET", url: "/metrics", token: null })),
    );
    for (const m of scrapes) expect(m.body).toMatch(/fleet_redis_up\{app="dispatcher"\} 1/);
    expect(probes).toBe(1);
    await shared.call({ method: "GET", url: "/metrics", token: null });
    expect(probes).toBe(2);
  });

  it("answers 404 with the JSON error body for unknown rollouts, batches and routes", async () => {
    expectErrorBody(await h.call({ method: "GET", url: "/v1/rollouts/nope" }), 404, "not_found");
    expectErrorBody(await h.call({ method: "GET", url: "/v1/rollouts/has:colon" }), 404, "not_found");
    expectErrorBody(await h.call({ method: "GET", url: "/v1/batches/nope" }), 404, "not_found");
    expectErrorBody(await h.call({ method: "GET", url: "/v1/batches/nope/results" }), 404, "not_found");
    expectErrorBody(await h.call({ method: "POST", url: "/v1/batches/nope/cancel" }), 404, "not_found");
    expectErrorBody(await h.call({ method: "GET", url: "/v2/anything" }), 404, "not_found");
    expectErrorBody(await h.call({ method: "DELETE", url: "/v1/rollouts/nope/cancel/x" }), 404, "not_found");
  });

  it("answers 405 with the methods it takes for a route asked with another method", async () => {
    for (const [method, url, allow] of [
      ["DELETE", "/v1/rollouts", "POST"],
      ["GET", "/v1/batches", "POST"],
      ["PUT", "/v1/rollouts/some-id", "GET, HEAD"],
      ["DELETE", "/v1/batches/some-id?x=1", "GET, HEAD"],
      ["GET", "/v1/rollouts/some-id/cancel", "POST"],
    ] as const) {
      const res = await h.call({ method, url });
      const error = expectErrorBody(res, 405, "method_not_allowed");
      expect(res.headers.allow, `${method} ${url}`).toBe(allow);
      expect(error.details).toEqual({ allow: allow.split(", ") });
      expect(error.message).toContain(method);
    }
    // A route of this very method that sent its own not-found (a missing file of Bull Board's): 404.
    expectErrorBody(await h.call({ method: "GET", url: "/admin/queues/static/nope.js" }), 404, "not_found");
    // Without a token the route table is not told: 401 first.
    const anon = await h.call({ method: "DELETE", url: "/v1/rollouts", token: null });
    expect(anon.statusCode).toBe(401);
  });

  it("serves an OpenAPI 3.1 document", async () => {
    const res = await h.call({ method: "GET", url: "/openapi.json" });
    expect(res.statusCode).toBe(200);
    const doc = res.json() as { openapi: string; paths: Record<string, unknown> };
    expect(doc.openapi).toBe("3.1.0");
    expect(doc.paths).toHaveProperty("/v1/batches/{id}/results");
  });
});

describe("cancel", () => {
  it("records a terminal cancelled failure and enqueues close; 404 unknown; 409 finished", async () => {
    const { id } = (await h.call({ method: "POST", url: "/v1/rollouts", payload: row })).json() as {
      id: string;
    };
    const res = await h.call({ method: "POST", url: `/v1/rollouts/${id}/cancel` });
    expect(res.statusCode, res.body).toBe(202);
    expect(res.json()).toEqual({ id, status: "cancelling" });
    const record = await h.store.get(id);
    expect(record?.cancelRequested).toBe(true);
    expect(record?.fence).toBe("stopped");
    expect(record?.failure).toMatchObject({
      stage: "admission",
      terminal: true,
      failureKind: "cancelled",
      mask: false,
      reason: "cancelled by request",
    });
    expect((await h.queues.queues.close.getJob(`${id}.close`))?.data).toEqual({ rolloutId: id });
    const view = await h.call({ method: "GET", url: `/v1/rollouts/${id}` });
    expect(view.json()).toMatchObject({ cancelRequested: true, failure: { failureKind: "cancelled" } });

    // A second cancel is harmless; so is one sent with a JSON content type and no body (a
    // client that sets the header on every request).
    expect((await h.call({ method: "POST", url: `/v1/rollouts/${id}/cancel` })).statusCode).toBe(202);
    const typed = await h.call({
      method: "POST",
      url: `/v1/rollouts/${id}/cancel`,
      headers: { "content-type": "application/json" },
    });
    expect(typed.statusCode, typed.body).toBe(202);
    // A submit without a body is still its own 400.
    const empty = await h.call({
      method: "POST",
      url: "/v1/rollouts",
      headers: { "content-type": "application/json" },
    });
    expect(expectErrorBody(empty, 400, "malformed").message).toMatch(/expected a JSON body/);

    expectErrorBody(
      await h.call({ method: "POST", url: "/v1/rollouts/unknown-id/cancel" }),
      404,
      "not_found",
    );

    await h.store.finalize(
      { id, batchId: null },
      { ...resultFor(id, null, 0), status: "cancelled", reward: null },
      Date.now(),
    );
    const late = await h.call({ method: "POST", url: `/v1/rollouts/${id}/cancel` });
    expect(expectErrorBody(late, 409, "conflict").details).toMatchObject({ status: "cancelled" });
  });

  it("409 for a rollout already closing for another failure, which decides its result; it is still stopped", async () => {
    const { id } = (await h.call({ method: "POST", url: "/v1/rollouts", payload: row })).json() as {
      id: string;
    };
    const lost = {
      stage: "run",
      terminal: true,
      failureKind: "sandbox_lost",
      mask: true,
      reason: "gone",
      at: 1,
    } as const;
    expect(await h.store.recordFailure(id, lost)).toBe(true);
    const res = await h.call({ method: "POST", url: `/v1/rollouts/${id}/cancel` });
    expect(expectErrorBody(res, 409, "conflict").details).toEqual({
      rolloutId: id,
      status: "accepted",
      failureKind: "sandbox_lost",
    });
    const record = await h.store.get(id);
    expect(record?.cancelRequested).toBe(true);
    expect(record?.failure?.failureKind).toBe("sandbox_lost");
    expect(await h.queues.queues.close.getJob(`${id}.close`)).toBeDefined();
  });

  it("409 once close began or the rollout is graded: the result close composes (or the reward) stands", async () => {
    const post = async () =>
      ((await h.call({ method: "POST", url: "/v1/rollouts", payload: row })).json() as { id: string }).id;
    const closing = await post();
    // The resources worker's close began: it composes the result from the record it read then.
    await h.store.begin(closing, "close", Date.now());
    const late = await h.call({ method: "POST", url: `/v1/rollouts/${closing}/cancel` });
    expect(expectErrorBody(late, 409, "conflict").details).toEqual({
      rolloutId: closing,
      status: "accepted",
      closing: true,
      graded: false,
    });
    expect((await h.store.get(closing))?.failure).toBeNull();
    // Nothing of the refused cancel is left to show later: no stop claim, no failure-log row.
    expect((await h.store.get(closing))?.cancelRequested).toBe(false);
    expect(await h.store.failureLog(closing)).toEqual([]);

    // A cancel repeated after its first try claimed the stop but lost its failure record, and
    // close began in between: close read the claim and ends it cancelled, so this is a 202.
    const repeated = await post();
    await h.store.requestCancel(repeated);
    await h.store.begin(repeated, "close", Date.now());
    const again = await h.call({ method: "POST", url: `/v1/rollouts/${repeated}/cancel` });
    expect(again.statusCode, again.body).toBe(202);

    const graded = await post();
    await redis.hset(
      h.store.keys.rollout(graded),
      "r:verify",
      JSON.stringify({ reward: 1 }),
      "status",
      "verified",
    );
    const res = await h.call({ method: "POST", url: `/v1/rollouts/${graded}/cancel` });
    expect(expectErrorBody(res, 409, "conflict").details).toMatchObject({ closing: true, graded: true });
    expect((await h.store.get(graded))?.failure).toBeNull();
  });

  it("a cancel that loses to the rollout's own finish reports it terminal, not cancelling", async () => {
    const { id } = (await h.call({ method: "POST", url: "/v1/rollouts", payload: row })).json() as {
      id: string;
    };
    // The rollout's close finalizes it between the cancel's stop claim and its failure record.
    const racing = Object.create(h.store) as typeof h.store;
    racing.recordFailure = async (rid, failure) => {
      await h.store.finalize({ id: rid, batchId: null }, resultFor(rid, null, 1), Date.now());
      return h.store.recordFailure(rid, failure);
    };
    expect(await cancelRollout(racing, h.queues, id, Date.now())).toEqual({
      kind: "terminal",
      status: "completed",
    });
  });

  it("a batch cancelled while it is being admitted (its id seen through another replica) cancels what its admission records afterwards too", async () => {
    // The batch and its first rollout are recorded; the rest of its admission is still to come.
    const key = `admitting-${Date.now()}`;
    const ids = rolloutIds(3, key, "batch");
    const batchId = batchIdFor(ids);
    const requests = [row, row, row].map((r) => RolloutRequest.parse(r));
    const admitting = Object.create(h.store) as typeof h.store;
    let cancelled: number | null = null;
    admitting.admit = async (metas, now) => {
      const first = await h.store.admit(metas.slice(0, 1), now);
      cancelled = await cancelBatch(h.store, h.queues, batchId);
      const rest = await h.store.admit(metas.slice(1), now);
      return { ...rest, created: [...first.created, ...rest.created] };
    };
    await admit(admitting, h.queues, { requests, batch: true, idempotencyKey: key }, { maxTaskBytes: 1e7 });
    expect(cancelled).toBe(1);
    for (const id of ids) expect((await h.store.get(id))?.cancelRequested, id).toBe(true);
  });

  it("cancels every non-terminal rollout of a batch", async () => {
    const res = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row, row] } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    await h.store.finalize(
      { id: rolloutIds[0]!, batchId },
      resultFor(rolloutIds[0]!, batchId, 1),
      Date.now(),
    );
    const cancel = await h.call({ method: "POST", url: `/v1/batches/${batchId}/cancel` });
    expect(cancel.statusCode).toBe(202);
    expect(cancel.json()).toEqual({ batchId, cancelled: 2 });
    for (const id of rolloutIds.slice(1)) {
      expect((await h.store.get(id))?.failure?.failureKind).toBe("cancelled");
      expect(await h.queues.queues.close.getJob(`${id}.close`)).toBeDefined();
    }
    expect(await h.queues.queues.close.getJob(`${rolloutIds[0]}.close`)).toBeUndefined();
    // The walk is done: nothing is left for the janitor to walk again.
    expect(await redis.zscore(h.store.keys.cancelling(), batchId)).toBeNull();
  });

  it("a batch cancel goes past a rollout whose record cannot be read: the rest are stopped and closed, and that one too", async () => {
    const rows = Array.from({ length: CANCEL_CONCURRENCY + 50 }, () => row);
    const res = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: rows } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    const torn = rolloutIds[5]!;
    await redis.hset(h.store.keys.rollout(torn), "meta", "{not json");
    const cancel = await h.call({ method: "POST", url: `/v1/batches/${batchId}/cancel` });
    expect(cancel.statusCode, cancel.body).toBe(202);
    expect(cancel.json()).toEqual({ batchId, cancelled: rows.length });
    for (const id of rolloutIds) {
      expect(await h.queues.queues.close.getJob(`${id}.close`), id).toBeDefined();
      if (id !== torn) expect((await h.store.get(id))?.failure?.failureKind, id).toBe("cancelled");
    }
    expect(await redis.hget(h.store.keys.rollout(torn), "cancel")).toBe("1");
    expect(await redis.zscore(h.store.keys.cancelling(), batchId)).toBeNull();
  });

  it("a cancel of a rollout whose record does not parse as a whole records the stage its raw fields say (its agent running: run)", async () => {
    const { id } = (await h.call({ method: "POST", url: "/v1/rollouts", payload: row })).json() as {
      id: string;
    };
    const key = h.store.keys.rollout(id);
    // Seeded and its agent running, then its seed receipt torn.
    await redis.hset(
      key,
      "status",
      "seeded",
      "stage",
      "seed",
      "r:seed",
      "{torn",
      "t:run:start",
      String(Date.now()),
    );
    await expect(h.store.get(id)).rejects.toThrow(/cannot be read/);
    expect(await cancelRollout(h.store, h.queues, id, Date.now())).toEqual({
      kind: "cancelling",
      previous: "seeded",
    });
    expect(JSON.parse((await redis.hget(key, "failure"))!)).toMatchObject({
      stage: "run",
      failureKind: "cancelled",
    });
  });

  it("a batch cancel notes its progress a page at a time, so that the janitor leaves a long walk alone and takes up one cut short", async () => {
    const rows = Array.from({ length: BATCH_PAGE * 2 + 1 }, () => row);
    const res = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: rows } });
    const { batchId } = res.json() as { batchId: string };
    let t = 1_000;
    const notes: Array<string | null> = [];
    const watching = Object.create(h.store) as typeof h.store;
    watching.cancelProgress = async (id, at) => {
      await h.store.cancelProgress(id, at);
      notes.push(await redis.zscore(h.store.keys.cancelling(), id));
    };
    expect(await cancelBatch(watching, h.queues, batchId, () => t++)).toBe(rows.length);
    // Dated at its start (1000), then after each full page.
    expect(notes).toEqual(["1001", "1002"]);
    expect(await redis.zscore(h.store.keys.cancelling(), batchId)).toBeNull();

    // A walker that dies on its second page leaves its last note for the janitor.
    const dying = Object.create(h.store) as typeof h.store;
    dying.batchRolloutIds = async (id, start, stop) => {
      if (start !== undefined && start > 0) throw new Error("the dispatcher died");
      return h.store.batchRolloutIds(id, start, stop);
    };
    await expect(cancelBatch(dying, h.queues, batchId, () => 5_000)).rejects.toThrow("died");
    expect(await h.store.cancelsBefore(6_000)).toContainEqual({ batchId, score: 5_000 });
    await h.store.cancelDone(batchId, 5_000);
  });
});

describe("results", () => {
  it("streams NDJSON of the finalized rollouts only, and GET /v1/rollouts/:id returns the result", async () => {
    const res = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row, row] } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    const empty = await h.call({ method: "GET", url: `/v1/batches/${batchId}/results` });
    expect(empty.statusCode).toBe(200);
    expect(empty.body).toBe("");
    for (const [i, id] of [rolloutIds[0]!, rolloutIds[2]!].entries()) {
      expect(await h.store.finalize({ id, batchId }, resultFor(id, batchId, i), Date.now())).toBe(true);
    }
    const stream = await h.call({ method: "GET", url: `/v1/batches/${batchId}/results` });
    expect(stream.statusCode).toBe(200);
    expect(stream.headers["content-type"]).toContain("application/x-ndjson");
    const lines = stream.body.split("\n").filter((l) => l !== "");
    expect(lines).toHaveLength(2);
    const results = lines.map((l) => JSON.parse(l) as RolloutResult);
    expect(results.map((r) => r.id)).toEqual([rolloutIds[0], rolloutIds[2]]);
    expect(results.map((r) => r.reward)).toEqual([0, 1]);

    const batch = await h.call({ method: "GET", url: `/v1/batches/${batchId}` });
    expect(batch.json()).toMatchObject({ total: 3, done: 2, counts: { completed: 2, accepted: 1 } });
    expect(batch.json()).not.toHaveProperty("bodyHash");

    const one = await h.call({ method: "GET", url: `/v1/rollouts/${rolloutIds[2]}` });
    expect(one.json()).toMatchObject({ id: rolloutIds[2], status: "completed", reward: 1, stage: "close" });
  });

  it("GET /v1/rollouts/:id of a record that cannot be read is a 500 naming the rollout (and logged so); the batch's results and progress still answer", async () => {
    const lines: Record<string, unknown>[] = [];
    const logged = await makeHarness({}, undefined, (l) => lines.push(JSON.parse(l)));
    const res = await logged.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row] } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    for (const [i, id] of rolloutIds.entries()) {
      expect(await logged.store.finalize({ id, batchId }, resultFor(id, batchId, i), Date.now())).toBe(true);
    }
    const torn = rolloutIds[1]!;
    await redis.hset(logged.store.keys.rollout(torn), "meta", "{torn");
    for (const url of [`/v1/rollouts/${torn}`, `/v1/rollouts/${torn}/trajectory`]) {
      const error = expectErrorBody(await logged.call({ method: "GET", url }), 500, "internal");
      expect(error.message, url).toContain(`rollout ${torn} cannot be read`);
      expect(error.details).toEqual({ rolloutId: torn });
    }
    const failed = lines.filter((l) => l.msg === "request failed");
    expect(failed.length).toBe(2);
    expect(JSON.stringify(failed[0]!.err)).toContain(torn);
    const stream = await logged.call({ method: "GET", url: `/v1/batches/${batchId}/results` });
    expect(stream.statusCode).toBe(200);
    const ids = stream.body
      .split("\n")
      .filter((l) => l !== "")
      .map((l) => (JSON.parse(l) as RolloutResult).id);
    expect(ids).toEqual(rolloutIds);
    const batch = await logged.call({ method: "GET", url: `/v1/batches/${batchId}` });
    expect(batch.json()).toMatchObject({ total: 2, done: 2 });
  });

  it("GET /v1/rollouts/:id/trajectory: run null until the run stage stored one; 404 for an unknown id", async () => {
    const res = await h.call({ method: "POST", url: "/v1/rollouts", payload: row });
    const { id } = res.json() as { id: string };
    const before = await h.call({ method: "GET", url: `/v1/rollouts/${id}/trajectory` });
    expect(before.statusCode).toBe(200);
    expect(before.json()).toEqual({ id, status: "accepted", agent: "oracle", harness: "oracle", run: null });
    const unknown = await h.call({ method: "GET", url: "/v1/rollouts/nope/trajectory" });
    expect(unknown.statusCode).toBe(404);
    expect(unknown.json()).toMatchObject({ error: { code: "not_found", details: { rolloutId: "nope" } } });
    const anonymous = await h.call({ method: "GET", url: `/v1/rollouts/${id}/trajectory`, token: null });
    expect(anonymous.statusCode).toBe(401);
  });

  it("HEAD answers as GET would, without reading the batch's results (Fastify's HEAD drains a stream it was given)", async () => {
    const own = await makeHarness();
    const res = await own.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row] } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    for (const id of rolloutIds)
      await own.store.finalize({ id, batchId }, resultFor(id, batchId, 1), Date.now());
    let reads = 0;
    const getResultsJson = own.store.getResultsJson.bind(own.store);
    own.store.getResultsJson = async (ids) => {
      reads++;
      return getResultsJson(ids);
    };
    for (const url of [`/v1/batches/${batchId}/results`, `/v1/batches/${batchId}/results?after=0`]) {
      const head = await own.call({ method: "HEAD", url });
      expect(head.statusCode, head.body).toBe(200);
      expect(head.headers["content-type"]).toContain("application/x-ndjson");
      expect(head.body).toBe("");
    }
    expect(
      (await own.call({ method: "HEAD", url: `/v1/batches/${batchId}/results?after=0` })).headers[
        "fleet-results-next"
      ],
    ).toBe("2");
    expect((await own.call({ method: "HEAD", url: "/v1/batches/bnope/results" })).statusCode).toBe(404);
    await new Promise((resolve) => setImmediate(resolve));
    expect(reads).toBe(0);
    const get = await own.call({ method: "GET", url: `/v1/batches/${batchId}/results` });
    expect(get.body.trim().split("\n")).toHaveLength(2);
    expect(reads).toBe(1);
  });

  it("a results stream whose first read fails (Redis gone) answers 503 in the API's JSON error body, not labelled NDJSON", async () => {
    const own = await makeHarness();
    const res = await own.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row] } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    await own.store.finalize(
      { id: rolloutIds[0]!, batchId },
      resultFor(rolloutIds[0]!, batchId, 1),
      Date.now(),
    );
    // The batch is found, then its results are read on a connection that is gone (a real client's error).
    const gone = createRedis(REDIS_URL);
    await gone.quit();
    const cut = new RolloutStore(gone, own.prefix);
    own.store.getResultsJson = (ids) => cut.getResultsJson(ids);
    const failed = await own.call({ method: "GET", url: `/v1/batches/${batchId}/results` });
    expectErrorBody(failed, 503, "unavailable");
    expect(failed.headers["retry-after"]).toBe("5");
    expect(failed.headers["content-type"]).not.toContain("ndjson");
  });

  it("streams each result as stored, as GET /v1/rollouts/:id answers it: one another release wrote (a field this one does not know, one it lacks) does not break the stream", async () => {
    const res = await h.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row, row, row] } });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    for (const [i, id] of rolloutIds.entries()) {
      await h.store.finalize({ id, batchId }, resultFor(id, batchId, i % 2), Date.now());
    }
    // As a later release would store it (a new field), and as an earlier one would (no `usage`).
    const stored = (id: string) => h.store.getResultsJson([id]).then(([json]) => JSON.parse(json!));
    const newer = { ...(await stored(rolloutIds[0]!)), costUsd: 0.25 };
    const { usage: _usage, ...older } = await stored(rolloutIds[1]!);
    await redis.hset(h.store.keys.rollout(rolloutIds[0]!), "result", JSON.stringify(newer));
    await redis.hset(h.store.keys.rollout(rolloutIds[1]!), "result", JSON.stringify(older));

    for (const url of [`/v1/batches/${batchId}/results`, `/v1/batches/${batchId}/results?after=0`]) {
      const stream = await h.call({ method: "GET", url });
      expect(stream.statusCode, stream.body.slice(0, 300)).toBe(200);
      const lines = stream.body.split("\n").filter((l) => l !== "");
      expect(lines.map((l) => JSON.parse(l).id)).toEqual(rolloutIds);
      for (const [i, id] of rolloutIds.entries()) {
        const one = await h.call({ method: "GET", url: `/v1/rollouts/${id}` });
        expect(JSON.parse(lines[i]!), id).toEqual(one.json());
      }
      expect(JSON.parse(lines[0]!)).toMatchObject({ costUsd: 0.25 });
      expect(JSON.parse(lines[1]!)).not.toHaveProperty("usage");
    }
    // Nor a cancel of the batch, which reads which of its rollouts have a result.
    const cancel = await h.call({ method: "POST", url: `/v1/batches/${batchId}/cancel` });
    expect(cancel.statusCode, cancel.body).toBe(202);
    expect(cancel.json()).toMatchObject({ cancelled: 0 });
  });

  it("pages through a batch bigger than one page", async () => {
    const payload = { rollouts: Array.from({ length: 1201 }, (_, i) => ({ ...row, metadata: { i } })) };
    const res = await h.call({ method: "POST", url: "/v1/batches", payload });
    expect(res.statusCode, res.body.slice(0, 300)).toBe(202);
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    const picked = [0, 499, 500, 1000, 1200].map((i) => rolloutIds[i]!);
    for (const id of picked) await h.store.finalize({ id, batchId }, resultFor(id, batchId, 1), Date.now());
    const stream = await h.call({ method: "GET", url: `/v1/batches/${batchId}/results` });
    const ids = stream.body
      .split("\n")
      .filter((l) => l !== "")
      .map((l) => (JSON.parse(l) as RolloutResult).id);
    expect(ids).toEqual(picked);
  });

  it("a cursor (?after=n) gives only what finished since, in the order it finished, and the next n in a header", async () => {
    const res = await h.call({
      method: "POST",
      url: "/v1/batches",
      payload: { rollouts: [row, row, row, row] },
    });
    const { batchId, rolloutIds } = res.json() as { batchId: string; rolloutIds: string[] };
    const read = async (after: string) => {
      const r = await h.call({ method: "GET", url: `/v1/batches/${batchId}/results?after=${after}` });
      expect(r.statusCode, r.body).toBe(200);
      const ids = r.body
        .split("\n")
        .filter((l) => l !== "")
        .map((l) => (JSON.parse(l) as RolloutResult).id);
      return { ids, next: r.headers["fleet-results-next"] };
    };
    expect(await read("0")).toEqual({ ids: [], next: "0" });
    const finish = async (id: string) =>
      expect(await h.store.finalize({ id, batchId }, resultFor(id, batchId, 1), Date.now())).toBe(true);
    // Finishing out of batch order: the cursor follows the finish order.
    await finish(rolloutIds[2]!);
    await finish(rolloutIds[0]!);
    expect(await read("0")).toEqual({ ids: [rolloutIds[2], rolloutIds[0]], next: "2" });
    expect(await read("2")).toEqual({ ids: [], next: "2" });
    await finish(rolloutIds[3]!);
    expect(await read("2")).toEqual({ ids: [rolloutIds[3]], next: "3" });
    expect(await read("1")).toEqual({ ids: [rolloutIds[0], rolloutIds[3]], next: "3" });
    // A cursor past what has finished is none of ours: refused, not echoed back (a poller keeping
    // it would skip the results that finish up to it).
    const past = await h.call({ method: "GET", url: `/v1/batches/${batchId}/results?after=4` });
    expectErrorBody(past, 400, "malformed");
    expect(past.json()).toMatchObject({ error: { details: { after: 4, finished: 3 } } });
    for (const bad of ["-1", "x", "1.5", "9999999999"]) {
      const r = await h.call({ method: "GET", url: `/v1/batches/${batchId}/results?after=${bad}` });
      expectErrorBody(r, 400, "malformed");
    }
  });
});

describe("the backlog bound while an admission enqueues its seeds", () => {
  it("counts the admission's recorded rollouts once: a request that fits beside them is admitted", async () => {
    const gate = latchPair();
    let first = true;
    const tight = await makeHarness({ FLEET_MAX_BACKLOG: "10" }, (queues) => {
      const enqueueSeeds = queues.enqueueSeeds.bind(queues);
      queues.enqueueSeeds = async (ids) => {
        if (first) {
          first = false;
          gate.entered();
          // The first batch's five rollouts are recorded (in flight); its seeds wait here.
          await gate.released;
        }
        return enqueueSeeds(ids);
      };
    });
    const five = { rollouts: [row, row, row, row, row] };
    const a = tight.call({ method: "POST", url: "/v1/batches", payload: five });
    await gate.enteredP;
    // Five in flight, a bound of ten: five more fit (they were refused, counted with the first
    // five again as being admitted).
    const b = await tight.call({ method: "POST", url: "/v1/batches", payload: five });
    gate.release();
    expect((await a).statusCode).toBe(202);
    expect(b.statusCode, b.body).toBe(202);
    // And no more than the bound: one more is refused.
    const c = await tight.call({ method: "POST", url: "/v1/batches", payload: { rollouts: [row] } });
    expectErrorBody(c, 429, "backpressure");
  });
});

function latchPair() {
  let entered = () => {};
  let release = () => {};
  const enteredP = new Promise<void>((r) => {
    entered = r;
  });
  const released = new Promise<void>((r) => {
    release = r;
  });
  return { entered: () => entered(), enteredP, release: () => release(), released };
}

describe("Redis down", () => {
  it("stays live, answers /readyz 503 and a submission 503 unavailable with Retry-After", async () => {
    // A real client pointed at a port nothing listens on.
    const dead = createRedis("redis://127.0.0.1:1", { maxRetriesPerRequest: 0, retryStrategy: () => 100 });
    dead.on("error", () => {});
    const prefix = `{t-disp-${randomUUID().slice(0, 8)}}`;
    const queues = new StageQueues(dead, prefix);
    for (const q of Object.values(queues.queues)) q.on("error", () => {});
    const registry = createMetricsRegistry({ app: "dispatcher", defaultMetrics: false });
    const app = createServer({
      store: new RolloutStore(dead, prefix),
      queues,
      redis: dead,
      config: parseConfig(DispatcherConfig, { FLEET_PREFIX: prefix }),
      logger: createLogger({ name: "dispatcher-test", level: "silent" }),
      registry,
      metrics: createFleetMetrics(registry),
    });
    try {
      expect((await app.inject({ method: "GET", url: "/healthz" })).statusCode).toBe(200);
      const ready = await app.inject({ method: "GET", url: "/readyz" });
      expectErrorBody(ready, 503, "unavailable");
      // Its words, not the Redis client's (this route is public).
      expect(ready.json().error.message).toBe(
        "the fleet's Redis does not answer (unreachable, or too slow); not ready",
      );
      const submit = await app.inject({ method: "POST", url: "/v1/rollouts", payload: row });
      expectErrorBody(submit, 503, "unavailable");
      expect(submit.headers["retry-after"]).toBe("5");
      const metrics = await app.inject({ method: "GET", url: "/metrics" });
      expect(metrics.statusCode).toBe(200);
      expect(metrics.body).not.toMatch(/fleet_queue_jobs\{/);
      expect(metrics.body).not.toMatch(/fleet_rollouts_inflight\{/);
      expect(metrics.body).toMatch(/fleet_redis_up\{app="dispatcher"\} 0/);
    } finally {
      await app.close();
      await queues.close();
      dead.disconnect();
    }
  });
});

describe("a keyless submission cut short by Redis", () => {
  it("answers 503 with the key it was admitted under; the same body under that key finishes it, nothing admitted twice", async () => {
    let blips = 1;
    // Redis goes away after the records, before the seed jobs.
    const cut = await makeHarness({}, (queues) => {
      const enqueueSeeds = queues.enqueueSeeds.bind(queues);
      queues.enqueueSeeds = async (ids) => {
        if (blips-- > 0) throw new Error("Connection is closed.");
        return enqueueSeeds(ids);
      };
    });
    const post = (headers: Record<string, string> = {}) =>
      cut.call({ method: "POST", url: "/v1/batches", headers, payload: { rollouts: [row, row, row] } });
    const first = await post();
    expectErrorBody(first, 503, "unavailable");
    const { error } = first.json() as { error: { message: string; details: Record<string, string> } };
    const key = error.details.idempotencyKey!;
    expect(error.message).toContain(`Idempotency-Key: ${key}`);
    expect(await cut.store.getBatch(error.details.batchId!)).toMatchObject({ total: 3 });
    expect(await cut.queues.queues.seed.getJobCountByTypes("waiting")).toBe(0);

    const finished = await post({ "idempotency-key": key });
    expect(finished.statusCode, finished.body).toBe(200); // a replay: its records were there
    const { batchId, rolloutIds } = finished.json() as { batchId: string; rolloutIds: string[] };
    expect(batchId).toBe(error.details.batchId);
    expect(await cut.store.getBatch(batchId)).toMatchObject({ total: 3 });
    expect(await cut.queues.queues.seed.getJobCountByTypes("waiting")).toBe(3);
    expect(new Set(rolloutIds).size).toBe(3);
  });
});
