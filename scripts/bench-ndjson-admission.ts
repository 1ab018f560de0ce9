/**
 * A large NDJSON batch through the dispatcher, measured: a dispatcher listening on a free port
 * (in this process, its own key prefix on REDIS_URL) is sent `--rows` small valid rollouts
 * (`POST /v1/batches`, application/x-ndjson; the first row's task inline, the rest by digest,
 * or every one inline with `--inline`; with `--auth` as the fleet CLI sends it, with a token and
 * an Idempotency-Key; with `--json` as one JSON body, `{ "rollouts": [...] }`, which
 * FLEET_MAX_JSON_BATCH_BYTES bounds: about 15,000 such rows), while a 10 ms timer measures how late it fires (the
 * event loop's longest stall) and another process asks `/healthz` every 20 ms. Prints the
 * batch's status and time, the longest stalls (with when they began, from the POST) and the
 * slowest /healthz answer; deletes its keys.
 *
 *   node --import tsx scripts/bench-ndjson-admission.ts [--rows 40000] [--inline] [--auth] [--json]
 *   node --cpu-prof --cpu-prof-dir=/tmp/prof --import tsx scripts/bench-ndjson-admission.ts
 *
 * Needs Redis at REDIS_URL (default redis://127.0.0.1:6379).
 */
import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { request } from "node:http";
import type { AddressInfo } from "node:net";
import { parseArgs } from "node:util";
import { TaskContent } from "@fleet/contracts";
import { createRedis, digestTask } from "@fleet/queue";
import { startTestServer } from "../apps/dispatcher/src/test-server.ts";
import { deleteKeys } from "./lib/bench-redis.ts";
import { positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({
  options: {
    rows: { type: "string", default: "40000" },
    inline: { type: "boolean", default: false },
    auth: { type: "boolean", default: false },
    json: { type: "boolean", default: false },
  },
});
const ROWS = positiveInt(values.rows, "--rows");
const TOKEN = "bench-token";

const task = {
  id: "t-echo",
  instruction: "Print hello.",
  image: "fleet-base:test",
  solution: { "solve.sh": "#!/bin/sh\necho hello\n" },
  tests: { "test.sh": "#!/bin/sh\nexit 0\n" },
};
const agent = { harness: "oracle" };
const digest = digestTask(TaskContent.parse(task));
const lines: string[] = [];
for (let i = 0; i < ROWS; i++) {
  const ref = i === 0 || values.inline ? task : { digest };
  lines.push(JSON.stringify({ task: ref, agent, metadata: { i } }));
}
const CONTENT_TYPE = values.json ? "application/json" : "application/x-ndjson";
const body = Buffer.from(values.json ? `{"rollouts":[${lines.join(",")}]}` : `${lines.join("\n")}\n`);

const redis = createRedis(process.env.REDIS_URL ?? "redis://127.0.0.1:6379");
const server = await startTestServer(redis, "bench-ndj", {
  FLEET_MAX_BACKLOG: String(ROWS + 100),
  ...(values.auth ? { FLEET_API_TOKENS: TOKEN } : {}),
});
const { app, prefix, queues } = server;
await app.listen({ host: "127.0.0.1", port: 0 });
const { port } = app.server.address() as AddressInfo;

function call(method: string, path: string, payload?: Buffer): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const req = request(
      {
        host: "127.0.0.1",
        port,
        method,
        path,
        headers: {
          ...(payload ? { "content-type": CONTENT_TYPE, "content-length": payload.length } : {}),
          // As the fleet CLI sends a batch: a token, and a key of its own.
          ...(payload && values.auth
            ? { authorization: `Bearer ${TOKEN}`, "idempotency-key": randomUUID() }
            : {}),
        },
      },
      (res) => {
        let text = "";
        res.setEncoding("utf8");
        res.on("data", (c: string) => {
          text += c;
        });
        res.on("end", () => resolve({ status: res.statusCode ?? 0, text }));
      },
    );
    req.on("error", reject);
    req.end(payload);
  });
}

// Warm up (JIT, connections, scripts loaded) with a small batch.
await call(
  "POST",
  "/v1/batches",
  Buffer.from(values.json ? `[${lines.slice(0, 50).join(",")}]` : `${lines.slice(0, 50).join("\n")}\n`),
);

// Reset just before the POST, once the prober below has started (its start-up is not the batch's).
let started = performance.now();
const stalls: { at: number; ms: number }[] = [];
let last = performance.now();
const probe = setInterval(() => {
  const now = performance.now();
  const late = now - last - 10;
  if (late > 50) stalls.push({ at: last - started, ms: late });
  last = now;
}, 10);
// /healthz asked from another process (one in this process would be held up with it), every
// 20 ms, a request at a time: its slowest answer is how long the dispatcher went unanswered.
const prober = spawn(
  process.execPath,
  [
    "-e",
    `const http = require("node:http"); let slowest = 0, answered = 0, stop = false;
process.on("SIGTERM", () => { stop = true; });
process.stderr.write("ready");
(async () => {
  while (!stop) {
    const t = performance.now();
    const ok = await new Promise((r) => http.get("http://127.0.0.1:${port}/healthz", (res) => { res.resume(); res.on("end", () => r(res.statusCode === 200)); }).on("error", () => r(false)));
    slowest = Math.max(slowest, performance.now() - t);
    if (ok) answered++;
    await new Promise((r) => setTimeout(r, 20));
  }
  process.stdout.write(JSON.stringify({ slowest, answered }));
})();`,
  ],
  { stdio: ["ignore", "pipe", "pipe"] },
);
// Started (its SIGTERM handler set) before the batch is sent.
await new Promise((resolve) => prober.stderr.once("data", resolve));
prober.stderr.on("data", (c: Buffer) => process.stderr.write(c));
let probed = "";
prober.stdout.on("data", (c: Buffer) => {
  probed += c;
});
const proberDone = new Promise((resolve) => prober.on("close", resolve));
started = performance.now();
last = started;
stalls.length = 0;
const res = await call("POST", "/v1/batches", body);
const totalMs = performance.now() - started;
clearInterval(probe);
prober.kill("SIGTERM");
await proberDone;
const healthz = JSON.parse(probed) as { slowest: number; answered: number };
const answer = JSON.parse(res.text) as { count?: number };
stalls.sort((a, b) => b.ms - a.ms);
console.log(
  JSON.stringify({
    rows: ROWS,
    inline: values.inline,
    json: values.json,
    bodyMiB: +(body.length / 2 ** 20).toFixed(1),
    status: res.status,
    count: answer.count ?? res.text.slice(0, 300),
    totalMs: Math.round(totalMs),
    longestStallMs: Math.round(stalls[0]?.ms ?? 0),
    stallsOver50Ms: stalls.slice(0, 8).map((s) => `${Math.round(s.ms)}ms@${Math.round(s.at)}`),
    healthzAnswered: healthz.answered,
    slowestHealthzMs: Math.round(healthz.slowest),
  }),
);

await queues.obliterate();
await server.close();
await deleteKeys(redis, `${prefix}*`);
await redis.quit();
