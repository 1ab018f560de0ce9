import { execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { link, lstat, mkdir, mkdtemp, readdir, readFile, rm, symlink, writeFile } from "node:fs/promises";
import type { ServerResponse } from "node:http";
import { type AddressInfo, createServer as createNetServer, type Socket } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { TaskContent } from "@fleet/contracts";
import { loadSuite } from "@fleet/tasks";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { MAX_SUBMIT_ROLLOUTS } from "./commands/submit.ts";
import { type CliContext, partialPath } from "./context.ts";
import { runCli } from "./program.ts";
import { Collector } from "./testing/collect.ts";
import {
  apiError,
  json,
  type RecordedRequest,
  startTestServer,
  type TestServer,
} from "./testing/http-server.ts";

const tasks = ["alpha", "beta"].map((id) =>
  TaskContent.parse({
    id,
    instruction: `do ${id}`,
    image: "fleet-base:latest",
    solution: { "solve.sh": "true\n" },
    tests: { "test.sh": "exit 0" },
  }),
);

let server: TestServer;
let dir: string;
let stdout: Collector;
let stderr: Collector;

beforeEach(async () => {
  server = await startTestServer();
  dir = await mkdtemp(path.join(tmpdir(), "fleet-cli-"));
  stdout = new Collector();
  stderr = new Collector();
});
afterEach(async () => {
  await server.close();
  await rm(dir, { recursive: true, force: true });
});

function ctx(over: Partial<CliContext> = {}): CliContext {
  return {
    stdout,
    stderr,
    defaults: { url: server.url, token: "env-token" },
    readFile: (p) => readFile(p, "utf8"),
    loadSuite: async () => tasks,
    digestOf: (t) => `digest-${t.id}`.padEnd(64, "0"),
    signal: new AbortController().signal,
    client: { retryBaseMs: 1, retryMaxMs: 20, retries: 1 },
    progress: { tty: false, plainIntervalMs: 0 },
    ...over,
  };
}

function rowsOf(req: RecordedRequest): Array<Record<string, unknown>> {
  if (req.headers["content-type"] === "application/x-ndjson") {
    return req.body
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l));
  }
  return JSON.parse(req.body).rollouts;
}

/**
 * A fake dispatcher: accepts batches, reports each batch half done on the first status poll and
 * finished on the next, then serves one result per rollout.
 */
function fakeDispatcher(
  /** A rollout's result line; null leaves it out (gone from the dispatcher). */
  results: (rolloutId: string, row: Record<string, unknown>) => Record<string, unknown> | null,
) {
  let n = 0;
  server.on("POST", "/v1/batches", (req, res) => {
    const batchId = `b-${++n}`;
    const rows = rowsOf(req);
    const ids = rows.map((_, i) => `${batchId}-r${i}`);
    let polls = 0;
    server.on("GET", `/v1/batches/${batchId}`, (_r, out) => {
      polls++;
      const done = polls === 1 ? Math.floor(rows.length / 2) : rows.length;
      json(out, 200, {
        id: batchId,
        total: rows.length,
        done,
        counts: { accepted: rows.length - done, completed: done },
        createdAt: 1,
      });
    });
    server.on("GET", `/v1/batches/${batchId}/results`, (_r, out) => {
      out.writeHead(200, { "content-type": "application/x-ndjson" });
      out.end(
        ids
          .map((id, i) => results(id, rows[i]!))
          .filter((r) => r !== null)
          .map((r) => `${JSON.stringify(r)}\n`)
          .join(""),
      );
    });
    json(res, 202, { batchId, rolloutIds: ids, count: rows.length });
  });
}

/** A submission of 40 rows (2 tasks × 20) that goes as several batches of at most 4 KiB. */
const CHUNKED = [
  "submit",
  "--suite",
  "s",
  "--agent",
  "oracle",
  "--repeat",
  "20",
  "--max-request-bytes",
  "4096",
];

/** Answer a batch POST as admitted: batch `b-<n>`, one rollout id per row. */
function acceptBatch(res: Parameters<typeof json>[0], n: number, rows: unknown[]): void {
  json(res, 202, { batchId: `b-${n}`, rolloutIds: rows.map((_, i) => `r${n}-${i}`), count: rows.length });
}

const completed = (id: string, reward: number) => ({
  id,
  status: "completed",
  reward,
  mask: false,
  failureKind: null,
});

describe("fleet submit", () => {
  it("submits task × repeat as one batch, waits with progress, writes results and a summary", async () => {
    fakeDispatcher((id, row) =>
      (row.task as { id: string }).id === "alpha"
        ? completed(id, 1)
        : { id, status: "masked", reward: null, mask: true, failureKind: "sandbox_lost" },
    );
    const out = path.join(dir, "results.jsonl");
    const code = await runCli(
      [
        "submit",
        "--suite",
        "suite",
        "--agent",
        "oracle",
        "--repeat",
        "2",
        "--wait",
        "--out",
        out,
        "--deadline",
        "300",
        "--poll-interval",
        "10",
      ],
      ctx(),
    );
    expect(stderr.text()).not.toContain("error");
    expect(code).toBe(0);

    const posts = server.requests.filter((r) => r.method === "POST");
    expect(posts).toHaveLength(1);
    expect(posts[0]?.headers.authorization).toBe("Bearer env-token");
    const rows = rowsOf(posts[0]!);
    expect(
      rows.map((r) => `${(r.task as { id: string }).id}/${(r.metadata as { repeat: number }).repeat}`),
    ).toEqual(["alpha/0", "beta/0", "alpha/1", "beta/1"]);
    expect(
      rows.every((r) => r.deadlineS === 300 && (r.agent as { harness: string }).harness === "oracle"),
    ).toBe(true);

    const lines = (await readFile(out, "utf8")).trim().split("\n");
    expect(lines.map((l) => JSON.parse(l).id)).toEqual(["b-1-r0", "b-1-r1", "b-1-r2", "b-1-r3"]);
    expect(await readdir(dir)).toEqual(["results.jsonl"]); // no .partial left behind

    const text = stdout.text();
    expect(text.split("\n")[0]).toBe("b-1");
    expect(text).toContain("completed 2  masked 2  failed 0  cancelled 0");
    expect(text).toContain("mean reward: 1.0000 over 2 graded");
    expect(text).toContain(`results written to ${out}`);
    expect(stderr.text()).toContain("submitted 4 rollouts (2 tasks × 2) in 1 batch");
    expect(stderr.text()).toMatch(/progress 2\/4 \(50\.0%\)/);
    expect(stderr.text()).toMatch(/progress 4\/4 \(100\.0%\)/);
  });

  it("says when a submission was a replay of an earlier one with the same --idempotency-key", async () => {
    // The dispatcher knows the first chunk's key (replayed, 200) and not the second's (created, 202).
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      const rows = rowsOf(req);
      n++;
      const body = { batchId: `b-${n}`, rolloutIds: rows.map((_, i) => `r${n}-${i}`), count: rows.length };
      json(res, n === 1 ? 200 : 202, { ...body, created: n !== 1 });
    });
    expect(await runCli([...CHUNKED, "--idempotency-key", "k1"], ctx())).toBe(0);
    expect(stderr.text()).toMatch(
      /^submitted 40 rollouts \(2 tasks × 20\) in \d+ batches to http:\S+; \d+ of them \(1 batch\) were already submitted with this --idempotency-key: replayed, nothing started again$/m,
    );
    // All of them replayed: nothing was submitted this time (the route is answered anew).
    n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      const rows = rowsOf(req);
      n++;
      json(res, 200, {
        batchId: `b-${n}`,
        rolloutIds: rows.map((_, i) => `r${n}-${i}`),
        count: rows.length,
        created: false,
      });
    });
    expect(
      await runCli(["submit", "--suite", "s", "--agent", "oracle", "--idempotency-key", "k2"], ctx()),
    ).toBe(0);
    expect(stderr.text()).toMatch(
      /^already submitted: 2 rollouts \(2 tasks × 1\) in 1 batch at http:\S+, with this --idempotency-key: replayed, nothing started again$/m,
    );
    expect(stderr.text()).not.toMatch(/^submitted 2 rollouts/m);
  });

  it("counts one rollout, one task and one batch in the singular", async () => {
    server.on("POST", "/v1/batches", (req, res) => {
      const rows = rowsOf(req);
      json(res, 202, { batchId: "b-1", rolloutIds: rows.map((_, i) => `r-${i}`), count: rows.length });
    });
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--task", "alpha"], ctx())).toBe(0);
    expect(stderr.text()).toMatch(/^submitted 1 rollout \(1 task × 1\) in 1 batch to http:/m);
  });

  it("splits a large submission into chunks, referencing tasks by digest after the first, and follows all", async () => {
    fakeDispatcher((id) => completed(id, 0.5));
    const code = await runCli(CHUNKED, ctx());
    expect(code).toBe(0);
    const posts = server.requests.filter((r) => r.method === "POST");
    expect(posts.length).toBeGreaterThan(1);
    expect(posts.every((p) => Buffer.byteLength(p.body) <= 4096)).toBe(true);
    const allRows = posts.flatMap(rowsOf);
    expect(allRows).toHaveLength(40);
    expect(rowsOf(posts[0]!).every((r) => "id" in (r.task as object))).toBe(true);
    expect(rowsOf(posts.at(-1)!).every((r) => "digest" in (r.task as object))).toBe(true);
    expect(new Set(posts.map((p) => p.headers["idempotency-key"])).size).toBe(posts.length);
    expect(stdout.text().trim().split("\n")).toEqual(posts.map((_, i) => `b-${i + 1}`));
  });

  it("with --inline-tasks never sends a digest", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const code = await runCli([...CHUNKED, "--inline-tasks"], ctx());
    expect(code).toBe(0);
    const rows = server.requests.filter((r) => r.method === "POST").flatMap(rowsOf);
    expect(rows.every((r) => "id" in (r.task as object))).toBe(true);
  });

  it("prints the summary as JSON with --json", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--json", "--poll-interval", "10"],
      ctx(),
    );
    expect(code).toBe(0);
    // stdout is that one object and nothing else (`| jq` reads it); the batch id goes to stderr.
    const summary = JSON.parse(stdout.text());
    expect(summary).toMatchObject({ batchIds: ["b-1"], accepted: 2, total: 2, meanReward: 1, masked: 0 });
    expect(stderr.text()).toMatch(/^b-1$/m);
  });

  it("exits 1 when fewer results come back than rollouts were accepted, having written and summed up those that came", async () => {
    fakeDispatcher((id) => (id.endsWith("-r0") ? null : completed(id, 1)));
    const out = path.join(dir, "short.jsonl");
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--poll-interval", "10", "--out", out],
      ctx(),
    );
    expect(code).toBe(1);
    expect(stderr.text()).toMatch(/2 rollouts accepted but 1 results returned/);
    expect((await readFile(out, "utf8")).trim().split("\n")).toHaveLength(1);
  });

  it("watch polls a finished batch no more while another runs on: a submission split into many batches is not asked about every one each interval", async () => {
    const polls = new Map<string, number>();
    const batch = (batchId: string, doneAfter: number) => {
      server.on("GET", `/v1/batches/${batchId}`, (_r, out) => {
        const n = (polls.get(batchId) ?? 0) + 1;
        polls.set(batchId, n);
        const done = n >= doneAfter ? 1 : 0;
        json(out, 200, { id: batchId, total: 1, done, counts: { accepted: 1 - done, completed: done } });
      });
      server.on("GET", `/v1/batches/${batchId}/results`, (_r, out) => {
        out.writeHead(200, { "content-type": "application/x-ndjson" });
        out.end(`${JSON.stringify(completed(`${batchId}-r0`, 1))}\n`);
      });
    };
    // b-1 is done from the first look (the watch's own, for its size); b-2 after six polls.
    batch("b-1", 1);
    batch("b-2", 6);
    expect(await runCli(["watch", "b-1", "b-2", "--poll-interval", "10"], ctx())).toBe(0);
    expect(polls.get("b-2")).toBe(6);
    // The look for its size, then the first poll that found it finished: never again.
    expect(polls.get("b-1")).toBe(2);
  });

  it("watch follows batches submitted earlier to the end: summary, results file, one JSON object with --json", async () => {
    fakeDispatcher((id) => completed(id, id.endsWith("-r0") ? 1 : 0));
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle"], ctx())).toBe(0);
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle"], ctx())).toBe(0);
    expect(stdout.text()).toBe("b-1\nb-2\n");
    stdout = new Collector();
    const out = path.join(dir, "watched.jsonl");
    const code = await runCli(
      ["watch", "b-1", "b-2", "b-1", "--out", out, "--json", "--poll-interval", "10"],
      {
        ...ctx(),
        stdout,
      },
    );
    expect(code, stderr.text()).toBe(0);
    expect(JSON.parse(stdout.text())).toMatchObject({
      batchIds: ["b-1", "b-2"],
      accepted: 4,
      total: 4,
      meanReward: 0.5,
    });
    expect((await readFile(out, "utf8")).trim().split("\n")).toHaveLength(4);
    // An unknown batch is an error before any waiting, and writes no file.
    const missing = path.join(dir, "missing.jsonl");
    expect(await runCli(["watch", "b-404", "--out", missing, "--poll-interval", "10"], ctx())).toBe(1);
    expect(stderr.text()).toMatch(/not_found/);
    expect(existsSync(missing)).toBe(false);
  });

  it("watch rides out a dispatcher down when it starts as --outage-wait says, not for the client's few retries", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 1, done: 1, counts: { completed: 1 } }),
    );
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.end(`${JSON.stringify(completed("r1", 1))}\n`);
    });
    // Not listening yet for 6 connections: ctx() allows 1 retry, so the client alone gave up after 2.
    server.refuse = 6;
    const code = await runCli(["watch", "b-1", "--poll-interval", "10", "--outage-wait", "60"], ctx());
    expect(code, stderr.text()).toBe(0);
    expect(server.refuse).toBe(0);
    expect(stderr.text().match(/dispatcher unreachable \(.*\); still waiting \(since /g)).toHaveLength(1);
    expect(stderr.text()).toContain("dispatcher answering again after");
    expect(stdout.text()).toContain("completed 1");
  });

  it("watch --wait-timeout gives up on batches that do not finish, exits 1 and says where they keep running", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 2, done: 1, counts: { completed: 1, running: 1 } }),
    );
    // A poll interval far past the bound: the bound holds all the same.
    const code = await runCli(["watch", "b-1", "--poll-interval", "600000", "--wait-timeout", "0.2"], ctx());
    expect(code, stderr.text()).toBe(1);
    expect(stderr.text()).toContain(
      "error: wait_timeout: the batches were not finished after --wait-timeout",
    );
    expect(stderr.text()).toContain("(1/2 done)");
    expect(stderr.text()).toContain("the batches keep running on the dispatcher");
    expect(server.requests.filter((r) => r.path.endsWith("/results"))).toEqual([]);
  });

  it("stops at an API error, names batches already submitted, and exits 1", async () => {
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      n++;
      if (n === 1) json(res, 202, { batchId: "b-1", rolloutIds: [], count: rowsOf(req).length });
      else apiError(res, 413, "payload_too_large", "task over 10 MiB", { limit: 10485760 });
    });
    const code = await runCli(CHUNKED, ctx());
    expect(code).toBe(1);
    expect(stdout.text()).toBe("b-1\n");
    expect(stderr.text()).toContain("before the error: b-1");
    expect(stderr.text()).toContain("error: payload_too_large: task over 10 MiB (HTTP 413)");
    expect(stderr.text()).toContain('details: {"limit":10485760}');
    // A 413 naming a limit the body is under is about something else: the chunk is not split.
    expect(server.requests).toHaveLength(2);
  });

  it("with the oracle agent, a task without solution/solve.sh is a usage error before anything is submitted; another agent takes it", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const { solution: _, ...beta } = tasks[1]!;
    const suite = async () => [tasks[0]!, TaskContent.parse(beta)];
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle"], ctx({ loadSuite: suite }))).toBe(2);
    expect(stderr.text()).toContain(
      "the oracle agent runs each task's solution/solve.sh, which this task lacks: beta",
    );
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(0);
    const command = ["submit", "--suite", "s", "--agent", '{"harness":"command","argv":["true"]}'];
    expect(await runCli(command, ctx({ loadSuite: suite }))).toBe(0);
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(1);
    // Left out with --task, as the error says, the rest goes with the oracle.
    const alpha = ["submit", "--suite", "s", "--agent", "oracle", "--task", "alpha"];
    expect(await runCli(alpha, ctx({ loadSuite: suite }))).toBe(0);
    const posts = server.requests.filter((r) => r.method === "POST");
    expect(posts).toHaveLength(2);
    expect(rowsOf(posts[1]!).map((r) => (r.task as { id?: string }).id)).toEqual(["alpha"]);
  });

  it("--rerun submits again each masked rollout of a results file, with its task and its metadata, and nothing else", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const line = (taskId: string, status: string, repeat: number, over: Record<string, unknown> = {}) =>
      JSON.stringify({
        id: `old-${taskId}-${repeat}`,
        taskId,
        taskDigest: `digest-${taskId}`.padEnd(64, "0"),
        agent: "oracle",
        status,
        metadata: { run: "exp-7", repeat },
        ...over,
      });
    const results = path.join(dir, "old.jsonl");
    await writeFile(
      results,
      [
        line("alpha", "completed", 0),
        line("beta", "masked", 0),
        line("alpha", "masked", 1),
        line("beta", "failed", 1),
        line("beta", "masked", 2),
        "",
      ].join("\n"),
    );
    const rerun = ["submit", "--suite", "s", "--agent", "oracle", "--rerun", results];
    expect(await runCli([...rerun, "--deadline", "300", "--metadata", '{"rerun":1}'], ctx())).toBe(0);
    const posts = server.requests.filter((r) => r.method === "POST");
    expect(posts).toHaveLength(1);
    expect(rowsOf(posts[0]!).map((r) => [(r.task as { id: string }).id, r.metadata, r.deadlineS])).toEqual([
      ["beta", { run: "exp-7", repeat: 0, rerun: 1 }, 300],
      ["alpha", { run: "exp-7", repeat: 1, rerun: 1 }, 300],
      ["beta", { run: "exp-7", repeat: 2, rerun: 1 }, 300],
    ]);
    expect(stderr.text()).toContain(`submitted 3 rollouts (the masked of ${results}, 2 tasks) in 1 batch`);

    // --task narrows it; none masked left is said, and nothing is sent.
    expect(await runCli([...rerun, "--task", "alpha"], ctx())).toBe(0);
    expect(rowsOf(server.requests.filter((r) => r.method === "POST")[1]!)).toHaveLength(1);
    const clean = path.join(dir, "clean.jsonl");
    await writeFile(clean, `${line("alpha", "completed", 0)}\n`);
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--rerun", clean], ctx())).toBe(0);
    expect(stderr.text()).toContain(`nothing to rerun: none of the 1 results in ${clean} is masked`);
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(2);
  });

  it("--rerun refuses, before sending anything, what would not line up with the results: another agent, a task gone or changed, --repeat, a line that is no result", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const masked = (over: Record<string, unknown>) =>
      JSON.stringify({
        taskId: "alpha",
        taskDigest: "digest-alpha".padEnd(64, "0"),
        agent: "oracle",
        status: "masked",
        metadata: { repeat: 0 },
        ...over,
      });
    const cases: [string, string[], string][] = [
      [
        masked({ agent: "my-agent" }),
        [],
        '--rerun FILE: its rollouts ran agent "my-agent", --agent is "oracle"',
      ],
      [masked({ taskId: "gamma" }), [], "--rerun FILE: task gamma is not in the suite"],
      [masked({ taskDigest: "f".repeat(64) }), [], "--rerun FILE: task alpha changed since those results"],
      [
        masked({}),
        ["--repeat", "2"],
        "error: option '--rerun <results.jsonl>' cannot be used with option '--repeat <n>'",
      ],
      [masked({}), ["--metadata", '{"repeat":3}'], '--metadata must not set "repeat"'],
      ["{not json", [], "--rerun FILE: line 1 is not JSON"],
      [`${masked({})}\n{"status":"masked"}`, [], "--rerun FILE: line 2 is not a result (taskId:"],
    ];
    for (const [i, [text, extra, message]] of cases.entries()) {
      const file = path.join(dir, `case-${i}.jsonl`);
      await writeFile(file, text);
      stderr = new Collector();
      const code = await runCli(
        ["submit", "--suite", "s", "--agent", "oracle", "--rerun", file, ...extra],
        ctx({ stderr }),
      );
      expect([code, stderr.text()], text).toEqual([
        2,
        expect.stringContaining(message.replace("FILE", file)),
      ]);
    }
    const missing = path.join(dir, "missing.jsonl");
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--rerun", missing], ctx())).toBe(2);
    expect(stderr.text()).toContain(`cannot read --rerun ${missing}`);
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(0);
  });

  it("--rerun refuses an --out that is its results file (that path, another spelling, a symbolic or a hard link): the rerun would replace them", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const results = path.join(dir, "old.jsonl");
    const text = `${JSON.stringify({ taskId: "alpha", taskDigest: "digest-alpha".padEnd(64, "0"), agent: "oracle", status: "masked" })}\n`;
    await writeFile(results, text);
    await link(results, path.join(dir, "hard.jsonl"));
    await symlink(results, path.join(dir, "soft.jsonl"));
    for (const [rerun, out] of [
      [results, results],
      [results, `${dir}/./old.jsonl`],
      [results, path.join(dir, "hard.jsonl")],
      [path.join(dir, "soft.jsonl"), results],
    ] as const) {
      stderr = new Collector();
      const command = [
        "submit",
        "--suite",
        "s",
        "--agent",
        "oracle",
        "--rerun",
        rerun,
        "--wait",
        "--out",
        out,
      ];
      expect([await runCli(command, ctx()), stderr.text()], `${rerun} ${out}`).toEqual([
        2,
        `error: --out ${out} is the --rerun file ${rerun}: the rerun's results would replace the results it reruns; write the rerun elsewhere (another --out)\n`,
      ]);
      expect(await readFile(results, "utf8")).toBe(text);
    }
    expect(server.requests).toHaveLength(0);
    expect((await readdir(dir)).sort()).toEqual(["hard.jsonl", "old.jsonl", "soft.jsonl"]);
  });

  it("--rerun with a --task the suite does not have is the usage error a submission without --rerun gives, not nothing to rerun", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const results = path.join(dir, "old.jsonl");
    await writeFile(
      results,
      `${JSON.stringify({ taskId: "alpha", taskDigest: "digest-alpha".padEnd(64, "0"), agent: "oracle", status: "masked" })}\n`,
    );
    for (const rerun of [["--rerun", results], []]) {
      stderr = new Collector();
      const command = ["submit", "--suite", "s", "--agent", "oracle", ...rerun, "--task", "alpah"];
      expect([await runCli(command, ctx()), stderr.text()], rerun.join(" ")).toEqual([
        2,
        'error: unknown task "alpah"; the suite has: alpha, beta\n',
      ]);
    }
    expect(server.requests).toHaveLength(0);
  });

  it("a --deadline shorter than a task's rollout needs is a usage error naming the tasks, before anything is submitted (a later chunk's 422 came after earlier ones were admitted)", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const long = TaskContent.parse({ ...tasks[1]!, timeouts: { agentS: 600, verifierS: 120 } });
    const suite = async () => [tasks[0]!, long];
    // A rollout needs its agent's timeout + its tests' + 8 s + 10 s: beta 600 + 120 + 18.
    const { agentS, verifierS } = tasks[0]!.timeouts;
    const alphaNeeds = agentS + verifierS + 18;
    const command = ["submit", "--suite", "s", "--agent", "oracle", "--deadline", String(alphaNeeds)];
    expect(await runCli(command, ctx({ loadSuite: suite }))).toBe(2);
    expect(stderr.text()).toContain(
      `--deadline ${alphaNeeds} s is shorter than a rollout of this task needs (the agent's timeout, the tests', 8 s to stop and grade, 10 s before the run): beta (738 s)`,
    );
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(0);
    // Left out with --task, the rest goes.
    expect(await runCli([...command, "--task", "alpha"], ctx({ loadSuite: suite }))).toBe(0);
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(1);
  });

  it(`more rollouts than one submit sends (tasks × --repeat over ${MAX_SUBMIT_ROLLOUTS}) is a usage error, not a process out of memory`, async () => {
    fakeDispatcher((id) => completed(id, 1));
    const repeat = MAX_SUBMIT_ROLLOUTS / tasks.length + 1;
    expect(
      await runCli(["submit", "--suite", "s", "--agent", "oracle", "--repeat", String(repeat)], ctx()),
    ).toBe(2);
    expect(stderr.text()).toContain(
      `${repeat * tasks.length} rollouts (${tasks.length} tasks × --repeat ${repeat}) are more than one submit sends (${MAX_SUBMIT_ROLLOUTS}): submit them in parts`,
    );
    expect(server.requests).toHaveLength(0);
  });

  it("a --token that cannot go into an HTTP header is a usage error, not an unreachable dispatcher, and its value is not printed", async () => {
    for (const token of ["s3cret€", "s3cret tok", "s3cret\nX-Injected: 1"]) {
      for (const args of [
        ["status", "b-1", "--token", token],
        ["status", "b-1", `--token=${token}`],
        ["--token", token, "status", "b-1"],
      ]) {
        stderr = new Collector();
        expect(await runCli(args, ctx()), args.join(" ")).toBe(2);
        const err = stderr.text();
        expect(err).toContain(
          "--token: must be printable ASCII without spaces (it goes into an HTTP header) (value hidden)",
        );
        expect(err).not.toContain("s3cret");
      }
    }
    expect(server.requests).toHaveLength(0);
  });

  it("an --out path that cannot be written is a usage error before anything is submitted", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const out = path.join(dir, "no-such-dir", "results.jsonl");
    const code = await runCli(["submit", "--suite", "s", "--agent", "oracle", "--wait", "--out", out], ctx());
    expect(code).toBe(2);
    expect(stderr.text()).toContain(`cannot write --out ${out}`);
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(0);
  });

  it("an --out that is empty, a link or a FIFO (as a device) is a usage error before anything is submitted, and is left as it was", async () => {
    fakeDispatcher((id) => completed(id, 1));
    const target = path.join(dir, "target.jsonl");
    await writeFile(target, "kept\n");
    const link = path.join(dir, "link.jsonl");
    await symlink(target, link);
    const fifo = path.join(dir, "fifo");
    execFileSync("mkfifo", [fifo]);
    for (const [out, why] of [
      ["", "an empty path"],
      [link, "is a symbolic link"],
      [fifo, "is not a regular file"],
    ] as const) {
      stderr = new Collector();
      const code = await runCli(
        ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--out", out],
        ctx(),
      );
      expect(code, out).toBe(2);
      expect(stderr.text(), out).toContain(why);
    }
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(0);
    expect((await lstat(link)).isSymbolicLink()).toBe(true);
    expect(await readFile(target, "utf8")).toBe("kept\n");
    expect((await lstat(fifo)).isFIFO()).toBe(true);
  });

  it.skipIf(!existsSync("/dev/full"))(
    "a results file that fails while being written (ENOSPC) exits 1 naming the batches, leaving no partial file",
    async () => {
      fakeDispatcher((id) => completed(id, 1));
      const out = path.join(dir, "results.jsonl");
      await symlink("/dev/full", partialPath(out)); // opens fine; every write fails with ENOSPC
      const code = await runCli(
        ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--out", out, "--poll-interval", "10"],
        ctx(),
      );
      expect(code).toBe(1);
      expect(stderr.text()).toContain(`error: cannot write ${out}: ENOSPC`);
      expect(stderr.text()).toContain("the results stay on the dispatcher");
      expect(stderr.text()).toContain("for b-1");
      expect(stdout.text()).toBe("b-1\n"); // no summary claiming the results were written
      expect(await readdir(dir)).toEqual([]);
    },
  );

  it("goes as batches the backlog can hold, and waits while the backlog is full instead of giving up", async () => {
    const maxBacklog = 7;
    let full = 2; // the first two offers after the first batch find no room
    backlogHeldBack(() => full-- <= 0);
    const code = await runCli(["submit", "--suite", "s", "--agent", "oracle", "--repeat", "10"], ctx());
    expect(code, stderr.text()).toBe(0);
    const admitted = server.requests.filter((r) => r.method === "POST" && rowsOf(r).length <= maxBacklog);
    expect(stdout.text().trim().split("\n")).toEqual(["b-1", "b-2", "b-3"]);
    expect(stderr.text()).toContain("the fleet's backlog is full; offering");
    expect(stderr.text()).toContain("submitted 20 rollouts");
    expect(admitted.length).toBeGreaterThanOrEqual(3);
  });

  /** 20 rollouts (10 × 2 tasks), followed with --wait, polled every 10 ms: 3 batches of at most 7 under `backlogHeldBack`. */
  const HELD_WAIT = [
    "submit",
    "--suite",
    "s",
    "--agent",
    "oracle",
    "--repeat",
    "10",
    "--wait",
    "--poll-interval",
    "10",
  ];

  /**
   * A dispatcher whose backlog holds 7 rollouts: batches of at most that many, a larger one 413.
   * The first batch is admitted; later ones are answered 429 (full) until `room()` says there is
   * room. Batch `b-1` is 3 of 7 done (one masked) until every batch is in, then every batch is
   * done; each rollout's result is completed with reward 1 but b-1's first, masked. A status poll
   * is answered once `beforeStatus` (given the poll's response) settles.
   */
  function backlogHeldBack(
    room: () => boolean,
    retryAfterS = 0.01,
    beforeStatus: (res: ServerResponse) => Promise<void> = async () => {},
  ) {
    const maxBacklog = 7;
    const state = { admitted: 0, statusPolls: new Map<string, number>() };
    server.on("POST", "/v1/batches", (req, res) => {
      const rows = rowsOf(req);
      if (rows.length > maxBacklog) {
        return apiError(res, 413, "payload_too_large", "can never fit", {
          incoming: rows.length,
          maxBacklog,
        });
      }
      if (state.admitted > 0 && !room()) {
        return apiError(res, 429, "backpressure", "no room", { maxBacklog, retryAfterS });
      }
      const n = ++state.admitted;
      const batchId = `b-${n}`;
      const ids = rows.map((_, i) => `r${n}-${i}`);
      server.on("GET", `/v1/batches/${batchId}`, async (_r, out) => {
        state.statusPolls.set(batchId, (state.statusPolls.get(batchId) ?? 0) + 1);
        await beforeStatus(out);
        const held = n === 1 && state.admitted < 3;
        const done = held ? 3 : rows.length;
        const masked = n === 1 ? 1 : 0;
        json(out, 200, {
          id: batchId,
          total: rows.length,
          done,
          counts: { accepted: rows.length - done, completed: done - masked, masked },
        });
      });
      server.on("GET", `/v1/batches/${batchId}/results`, (_r, out) => {
        out.writeHead(200, { "content-type": "application/x-ndjson" });
        out.end(
          ids
            .map((id, i) =>
              n === 1 && i === 0
                ? { id, status: "masked", reward: null, mask: true, failureKind: "sandbox_lost" }
                : completed(id, 1),
            )
            .map((r) => `${JSON.stringify(r)}\n`)
            .join(""),
        );
      });
      acceptBatch(res, n, rows);
    });
    return state;
  }

  it("with --wait, shows the progress of the batches admitted so far, out of every rollout, while the backlog holds the rest back", async () => {
    // The backlog has room again only once the first batch's finished rollouts were shown: a
    // submission that drew no progress while held back would wait for good (--backlog-wait).
    backlogHeldBack(() => /progress [1-9]\d*\/20 /.test(stderr.text()));
    const code = await runCli([...HELD_WAIT, "--backlog-wait", "5"], ctx());
    const err = stderr.text();
    expect(err).toMatch(/progress 3\/20 \(15\.0%\) .* masked 1 failed 0/);
    expect(code, err).toBe(0);
    // Drawn after the note that the backlog is full, before the last chunk went in.
    const held = err.search(/progress 3\/20 /);
    expect(err.indexOf("the fleet's backlog is full; offering")).toBeLessThan(held);
    expect(held).toBeLessThan(err.indexOf("submitted 20 rollouts (2 tasks × 10) in 3 batches"));
    // Following goes on as before: the same final line, results and summary.
    expect(err.trimEnd().split("\n").at(-1)).toMatch(/^progress 20\/20 \(100\.0%\) .* masked 1 failed 0/);
    expect(stdout.text()).toBe(
      "b-1\nb-2\nb-3\nresults: 20\n  completed 19  masked 1  failed 0  cancelled 0\n" +
        "  mean reward: 1.0000 over 19 graded\n  masked: 1  (failure kinds: sandbox_lost 1)\n",
    );
  });

  it("with --wait, polls the admitted batches at most once a --poll-interval while held back, and prints plain progress at most once an interval", async () => {
    let refused = 0;
    const backlog = backlogHeldBack(() => ++refused > 5); // five offers find the backlog full
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "10", "--wait", "--poll-interval", "60000"],
      ctx({ progress: { tty: false } }), // plain lines every 10 s, as in a CI log
    );
    expect(code, stderr.text()).toBe(0);
    const lines = stderr.text().trimEnd().split("\n");
    // Once while held back (the first wait), once when following found every batch done.
    expect(backlog.statusPolls.get("b-1")).toBe(2);
    expect(lines.filter((l) => l.startsWith("the fleet's backlog is full; offering"))).toHaveLength(5);
    expect(lines.filter((l) => l.startsWith("progress "))).toEqual([
      expect.stringMatching(/^progress 3\/20 /),
      expect.stringMatching(/^progress 20\/20 \(100\.0%\)/),
    ]);
  });

  it("with --wait on a TTY, the notes while held back are written above the progress line, not over it", async () => {
    // Room once two offers were refused, one of them with the line drawn: a poll that outlasts its
    // wait (10 ms) is drawn by a later one.
    let refused = 0;
    let refusedWhileDrawn = false;
    backlogHeldBack(() => {
      if (refused >= 2 && refusedWhileDrawn) return true;
      refused++;
      refusedWhileDrawn ||= / 3\/20 {3}15%/.test(stderr.text());
      return false;
    });
    const code = await runCli(HELD_WAIT, ctx({ progress: { tty: true } }));
    expect(code, stderr.text()).toBe(0);
    // "\r" and the erase to the line's end ("\x1b[K") spelt out, to be matched as text.
    const err = stderr.text().replaceAll("\r", "<CR>").replaceAll("\x1b[K", "<EL>");
    // The line drawn while held is cleared for the next note and drawn again below it.
    expect(err).toMatch(
      /<CR>\[#+\.+\] {3}3\/20 {3}15%[^\n]*<EL><CR><EL>the fleet's backlog is full; offering 7 more rollouts again in 0 s\n\[#+\.+\] {3}3\/20/,
    );
    expect(err).toMatch(/<CR><EL>submitted 20 rollouts \(2 tasks × 10\) in 3 batches to [^\n]*\n\[/);
    expect(err).toMatch(/20\/20 {2}100%[^\n]*<EL>\n$/);
  });

  it("with --wait, a status poll the dispatcher does not answer does not hold back the chunk's next offer", async () => {
    // No status poll is answered until the backlog has room again (the second offer after b-1).
    const offeredAt: number[] = [];
    let release = () => {};
    const released = new Promise<void>((resolve) => {
      release = resolve;
    });
    backlogHeldBack(
      () => {
        offeredAt.push(performance.now());
        if (offeredAt.length === 1) return false;
        release();
        return true;
      },
      0.01,
      () => released,
    );
    const statusTimeoutMs = 20_000;
    const code = await runCli(
      HELD_WAIT,
      ctx({ client: { retryBaseMs: 1, retryMaxMs: 20, retries: 1, statusTimeoutMs } }),
    );
    expect(code, stderr.text()).toBe(0);
    expect(offeredAt).toHaveLength(3);
    // Offered again after the 0.01 s wait, not once the wait's poll had given up (its status timeout).
    expect(offeredAt[1]! - offeredAt[0]!).toBeLessThan(statusTimeoutMs / 2);
    expect(stdout.text()).toContain("results: 20\n");
  });

  it("with --wait, a submission that fails while a status poll is unanswered leaves no poll behind", async () => {
    let unanswered = 0;
    backlogHeldBack(
      () => false,
      0.01,
      async (res) => {
        unanswered++;
        res.once("close", () => unanswered--);
        await new Promise(() => {}); // answered never: only the client ends it
      },
    );
    const code = await runCli(
      [...HELD_WAIT, "--backlog-wait", "1"],
      ctx({ client: { retryBaseMs: 1, retryMaxMs: 20, retries: 1, statusTimeoutMs: 20_000 } }),
    );
    expect(code).toBe(1);
    expect(stderr.text()).toContain("submitted 7 of 20 rollouts in 1 batch before the error: b-1");
    // Its poll is given up with the submission, not left to its 20 s timeout (a process kept alive).
    await vi.waitFor(() => expect(unanswered).toBe(0), { timeout: 5000 });
  });

  it("with --wait, Ctrl-C while held back and showing progress names what went in, as before", async () => {
    // A long Retry-After: the Ctrl-C comes while the chunk waits for room, with nothing in flight.
    backlogHeldBack(() => false, 30);
    const interrupt = new AbortController();
    const running = runCli(HELD_WAIT, ctx({ signal: interrupt.signal, progress: { tty: true } }));
    await vi.waitFor(() => expect(stderr.text()).toMatch(/ 3\/20 {3}15%/), { timeout: 10_000 });
    interrupt.abort();
    expect(await running).toBe(130);
    const err = stderr.text();
    // The progress line is ended before the notes, which are as without progress.
    expect(err).toMatch(/15%[^\n]*\nsubmitted 7 of 20 rollouts in 1 batch before the error: b-1 /);
    expect(err).toContain("interrupted; submitted rollouts keep running on the dispatcher in batch b-1");
    // Nothing was in flight: the chunk's rest was not sent, not "may have been admitted".
    expect(err).toContain(
      "was interrupted while waiting for room in the fleet's backlog: what the backlog had no room for was not sent",
    );
    expect(err).not.toContain("was not confirmed");
  });

  it("a chunk over the dispatcher's body limit (413 naming it) goes as bodies under it, losing no row", async () => {
    const limit = 3000; // a few rows' worth: the CLI's 8 MiB chunk is far over it
    const accepted: Array<Record<string, unknown>> = [];
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      const bytes = Buffer.byteLength(req.body);
      if (bytes > limit) {
        return apiError(
          res,
          413,
          "payload_too_large",
          `the request body (${bytes} bytes) is over the limit`,
          {
            limit,
          },
        );
      }
      accepted.push(...rowsOf(req));
      acceptBatch(res, ++n, rowsOf(req));
    });
    const args = ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "10", "--idempotency-key", "k"];
    expect(await runCli(args, ctx()), stderr.text()).toBe(0);
    expect(accepted).toHaveLength(20);
    expect(new Set(accepted.map((r) => JSON.stringify(r))).size).toBe(20);
    expect(stderr.text()).toContain(`submitted 20 rollouts (2 tasks × 10) in ${n} batches`);
    expect(stderr.text()).toContain(
      `the dispatcher takes request bodies of at most ${limit} bytes: sending these 20 rollouts as ${n} batches`,
    );
    // Each part under its own key, the same on a re-run: nothing admitted twice.
    const keys = server.requests
      .filter((r) => Buffer.byteLength(r.body) <= limit)
      .map((r) => r.headers["idempotency-key"]);
    expect(new Set(keys).size).toBe(n);
    const first = server.requests.length;
    expect(await runCli(args, ctx())).toBe(0);
    const again = server.requests.slice(first).filter((r) => Buffer.byteLength(r.body) <= limit);
    expect(again.map((r) => r.headers["idempotency-key"])).toEqual(keys);
  });

  it("a chunk over the dispatcher's JSON batch limit (413 naming ndjsonLimit) goes again as NDJSON under the same key, split only by the NDJSON body limit", async () => {
    // As the dispatcher answers with FLEET_MAX_JSON_BATCH_BYTES and FLEET_MAX_BODY_BYTES both
    // under the size the CLI sends NDJSON from.
    const jsonLimit = 1000;
    const bodyLimit = 2500;
    const accepted: Array<Record<string, unknown>> = [];
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      const bytes = Buffer.byteLength(req.body);
      const ndjson = req.headers["content-type"] === "application/x-ndjson";
      if (!ndjson && bytes > jsonLimit) {
        return apiError(res, 413, "payload_too_large", "a JSON batch body is at most …: send it as NDJSON", {
          limit: jsonLimit,
          bytes,
          ndjsonLimit: bodyLimit,
        });
      }
      if (bytes > bodyLimit) {
        return apiError(res, 413, "payload_too_large", "over the limit", { limit: bodyLimit });
      }
      accepted.push(...rowsOf(req));
      acceptBatch(res, ++n, rowsOf(req));
    });
    const args = ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "10", "--idempotency-key", "k"];
    expect(await runCli(args, ctx()), stderr.text()).toBe(0);
    expect(accepted).toHaveLength(20);
    expect(new Set(accepted.map((r) => JSON.stringify(r))).size).toBe(20);
    // Split by the NDJSON body limit, never by the JSON batch limit.
    expect(stderr.text()).not.toContain(`at most ${jsonLimit} bytes`);
    const posts = server.requests.filter((r) => r.method === "POST");
    const refused = posts.filter((r) => r.headers["content-type"] === "application/json");
    expect(refused).toHaveLength(1); // later bodies go as NDJSON from the start
    // The refused body's rollouts again as NDJSON, under its key.
    expect(posts[1]!.headers["content-type"]).toBe("application/x-ndjson");
    expect(posts[1]!.headers["idempotency-key"]).toBe(refused[0]!.headers["idempotency-key"]);
    const sent = posts.filter(
      (r) => r.headers["content-type"] === "application/x-ndjson" && Buffer.byteLength(r.body) <= bodyLimit,
    );
    expect(sent).toHaveLength(n);
    expect(n).toBeGreaterThan(1);
  });

  it("a single row over the dispatcher's body limit is not split: the 413 and exit 1", async () => {
    server.on("POST", "/v1/batches", (req, res) =>
      apiError(
        res,
        413,
        "payload_too_large",
        `the request body (${req.body.length} bytes) is over the limit`,
        {
          limit: 10,
        },
      ),
    );
    const code = await runCli(["submit", "--suite", "s", "--agent", "oracle", "--task", "alpha"], ctx());
    expect(code).toBe(1);
    expect(stderr.text()).toContain("error: payload_too_large:");
    expect(server.requests).toHaveLength(1);
  });

  /**
   * A dispatcher whose backlog (7) has room for 3 more rollouts: a batch of more is answered 429
   * naming the bound and what is in flight, or 413 past the bound itself; smaller ones admitted.
   */
  function backlogWithRoomFor3() {
    const state = { accepted: [] as Array<Record<string, unknown>>, posts: 0 };
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      state.posts++;
      const rows = rowsOf(req);
      if (rows.length > 7) return apiError(res, 413, "payload_too_large", "never", { maxBacklog: 7 });
      if (rows.length > 3) {
        return apiError(res, 429, "backpressure", "partly full", {
          maxBacklog: 7,
          inflight: 4,
          admitting: 0,
          retryAfterS: 0.01,
        });
      }
      state.accepted.push(...rows);
      acceptBatch(res, ++n, rows);
    });
    return state;
  }

  it("sends the part of a chunk the backlog has room for first, then the rest, losing no row", async () => {
    const backlog = backlogWithRoomFor3();
    const accepted = backlog.accepted;
    const code = await runCli(["submit", "--suite", "s", "--agent", "oracle", "--repeat", "10"], ctx());
    expect(code, stderr.text()).toBe(0);
    expect(accepted).toHaveLength(20);
    const repeats = accepted.map((r) => (r.metadata as { repeat: number }).repeat);
    expect(repeats).toEqual([...repeats].sort((a, b) => a - b));
    expect(new Set(accepted.map((r) => JSON.stringify(r))).size).toBe(20);
  });

  it("a submission that stops after part of a split chunk went in counts what went in, not whole chunks", async () => {
    let posts = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      // Room for 3, once: then the backlog stays full.
      if (posts++ > 1)
        return apiError(res, 429, "backpressure", "full", { maxBacklog: 7, inflight: 7, retryAfterS: 0.01 });
      if (rowsOf(req).length > 3) {
        return apiError(res, 429, "backpressure", "partly full", {
          maxBacklog: 7,
          inflight: 4,
          retryAfterS: 0.01,
        });
      }
      acceptBatch(res, 1, rowsOf(req));
    });
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "3", "--backlog-wait", "1"],
      ctx(),
    );
    expect(code).toBe(1);
    expect(stderr.text()).toContain("submitted 3 of 6 rollouts in 1 batch before the error: b-1");
  });

  it("with --wait too, a full backlog (429) splits the chunk at once; it is no dispatcher outage to ride out", async () => {
    const backlog = backlogWithRoomFor3();
    const accepted = backlog.accepted;
    // (The batches are not followed here: their status routes are not served, so the command ends
    // in an error once everything is submitted; the submission is what this test is about.)
    await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "10", "--wait", "--outage-wait", "30"],
      ctx(),
    );
    expect(accepted).toHaveLength(20);
    expect(new Set(accepted.map((r) => JSON.stringify(r))).size).toBe(20);
    expect(stderr.text()).not.toContain("dispatcher unreachable");
    expect(stderr.text()).toContain("submitted 20 rollouts");
    // A few 429s per split, not a retry loop for as long as --outage-wait allows.
    expect(backlog.posts).toBeLessThan(40);
  });

  it("stops offering once --backlog-wait has passed, naming what it submitted", async () => {
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      if (n++ === 0) return json(res, 202, { batchId: "b-1", rolloutIds: [], count: rowsOf(req).length });
      apiError(res, 429, "backpressure", "no room", { retryAfterS: 0.01 });
    });
    const code = await runCli([...CHUNKED, "--backlog-wait", "1"], ctx());
    expect(code).toBe(1);
    expect(stderr.text()).toContain("before the error: b-1");
    expect(stderr.text()).toContain("backpressure");
  });

  it("a full backlog is offered again as --backlog-wait says, not retried by the client first (a Retry-After of 5 s)", async () => {
    server.on("POST", "/v1/batches", (_req, res) => {
      res.setHeader("retry-after", "5");
      apiError(res, 429, "backpressure", "no room", { maxBacklog: 10, inflight: 10, retryAfterS: 5 });
    });
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "1", "--backlog-wait", "1"],
      ctx(),
    );
    expect(code).toBe(1);
    // The first offer, and one more once the wait is over: no five retries of 5 s in between.
    expect(server.requests.filter((r) => r.method === "POST")).toHaveLength(2);
    expect(stderr.text()).toContain("the fleet's backlog is full; offering 2 more rollouts again in 1 s");
    expect(stderr.text()).not.toMatch(/attempt \d\/\d/);
  });

  it("--backlog-wait counts from the answer that the backlog is full, not from before a slow first answer", async () => {
    let posts = 0;
    server.on("POST", "/v1/batches", (_req, res) => {
      // The first answer is slow (a loaded dispatcher, a slow link): that is no wait for room.
      const answer = () =>
        apiError(res, 429, "backpressure", "no room", { maxBacklog: 10, inflight: 10, retryAfterS: 5 });
      if (posts++ === 0) setTimeout(answer, 400);
      else answer();
    });
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "1", "--backlog-wait", "1"],
      ctx(),
    );
    expect(code).toBe(1);
    expect(posts).toBe(2);
    expect(stderr.text()).toContain("the fleet's backlog is full; offering 2 more rollouts again in 1 s");
  });

  it("--wait rides out a dispatcher outage far past the retry budget, then writes complete results", async () => {
    let back = false;
    server.on("POST", "/v1/batches", (req, res) => acceptBatch(res, 1, rowsOf(req)));
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 2, done: back ? 2 : 1, counts: {} }),
    );
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.end(`${JSON.stringify(completed("r1-0", 1))}\n${JSON.stringify(completed("r1-1", 0))}\n`);
    });
    const out = path.join(dir, "results.jsonl");
    const running = runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--out", out, "--poll-interval", "10"],
      ctx(),
    );
    await vi.waitFor(() => expect(server.requests.some((r) => r.path === "/v1/batches/b-1")).toBe(true), {
      timeout: 10_000,
    });
    server.down = true; // e.g. the dispatcher restarting
    // ctx() allows 1 retry: the old client gave up after 2 failed attempts.
    await vi.waitFor(() => expect(server.dropped).toBeGreaterThanOrEqual(6), { timeout: 5000 });
    back = true;
    server.down = false;
    expect(await running, stderr.text()).toBe(0);
    expect(stderr.text().match(/dispatcher unreachable \(.*\); still waiting \(since /g)).toHaveLength(1);
    expect(stderr.text().match(/dispatcher answering again after/g)).toHaveLength(1);
    expect(
      (await readFile(out, "utf8"))
        .trim()
        .split("\n")
        .map((l) => JSON.parse(l).id),
    ).toEqual(["r1-0", "r1-1"]);
  });

  it("--wait rides out a dispatcher outage while submitting too (a restart), then follows the batch", async () => {
    server.on("POST", "/v1/batches", (req, res) => acceptBatch(res, 1, rowsOf(req)));
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 2, done: 2, counts: {} }),
    );
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.end(`${JSON.stringify(completed("r1-0", 1))}\n${JSON.stringify(completed("r1-1", 0))}\n`);
    });
    server.down = true; // restarting when the submission starts
    const running = runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--poll-interval", "10"],
      ctx(),
    );
    // ctx() allows 1 retry: without patience the submission gave up after 2 failed attempts.
    await vi.waitFor(() => expect(server.dropped).toBeGreaterThanOrEqual(6), { timeout: 5000 });
    server.down = false;
    expect(await running, stderr.text()).toBe(0);
    expect(stderr.text().match(/dispatcher unreachable \(.*\); still waiting \(since /g)).toHaveLength(1);
    expect(stderr.text()).toContain("dispatcher answering again after");
    expect(server.requests.filter((r) => r.path === "/v1/batches")).toHaveLength(1);
    expect(stdout.text()).toContain("completed 2");
  });

  it("without --wait, a submission to a dispatcher that does not answer fails fast", async () => {
    server.down = true;
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle"], ctx())).toBe(1);
    expect(server.dropped).toBe(2);
    expect(stderr.text()).not.toContain("still waiting");
  });

  it("--wait --out fetches a results stream cut mid-body again, writing every result once", async () => {
    let fetches = 0;
    server.on("POST", "/v1/batches", (req, res) => acceptBatch(res, 1, rowsOf(req)));
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 4, done: 4, counts: {} }),
    );
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      fetches++;
      const body = [0, 1, 2, 3].map((i) => `${JSON.stringify(completed(`r1-${i}`, 1))}\n`).join("");
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      if (fetches === 1) res.write(body.slice(0, body.length - 20), () => res.destroy());
      else res.end(body);
    });
    const out = path.join(dir, "results.jsonl");
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--repeat", "2", "--wait", "--out", out],
      ctx(),
    );
    expect(code, stderr.text()).toBe(0);
    expect(fetches).toBe(2);
    expect(stderr.text()).toContain("the results stream of batch b-1");
    expect(
      (await readFile(out, "utf8"))
        .trim()
        .split("\n")
        .map((l) => JSON.parse(l).id),
    ).toEqual(["r1-0", "r1-1", "r1-2", "r1-3"]);
    expect(stdout.text()).toContain("completed 4");
  });

  it("--wait gives up after --outage-wait of continuous failure with a clear message naming the batches", async () => {
    server.on("POST", "/v1/batches", (req, res) => acceptBatch(res, 1, rowsOf(req)));
    server.on("GET", "/v1/batches/b-1", (_req, res) => apiError(res, 503, "unavailable", "redis down"));
    const out = path.join(dir, "results.jsonl");
    const code = await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--out", out, "--outage-wait", "0.2"],
      ctx(),
    );
    expect(code).toBe(1);
    const err = stderr.text();
    // The dispatcher answered: it is the fleet's Redis that cannot serve, not the dispatcher down.
    expect(err).toContain("the fleet's Redis is unavailable (GET /v1/batches/b-1: HTTP 503");
    expect(err).not.toContain("dispatcher unreachable");
    expect(err).toMatch(/error: unavailable: redis down \(still failing after \d+s; gave up\) \(HTTP 503\)/);
    expect(err).toContain("`fleet results <batchId> --out <file>` for b-1");
    expect(err).not.toMatch(/\n\s+at /); // no stack trace
    expect(await readdir(dir)).toEqual([]);
  });

  it("a chunk whose POST fails with a 5xx names its Idempotency-Key; re-running with --idempotency-key admits nothing twice", async () => {
    /** A dispatcher that remembers keys: a replay returns the same batch. */
    const admitted = new Map<string, { body: string; batchId: string }>();
    let down = true; // while true, the second chunk is admitted but every answer to it is lost (503)
    server.on("POST", "/v1/batches", (req, res) => {
      const key = String(req.headers["idempotency-key"]);
      let known = admitted.get(key);
      if (known !== undefined && known.body !== req.body) {
        return apiError(res, 409, "conflict", "key reused with another body");
      }
      const created = known === undefined;
      if (known === undefined) {
        known = { body: req.body, batchId: `b-${admitted.size + 1}` };
        admitted.set(key, known);
      }
      if (down && known.batchId === "b-2") return apiError(res, 503, "unavailable", "answer lost");
      json(res, created ? 202 : 200, { batchId: known.batchId, rolloutIds: [], count: rowsOf(req).length });
    });
    expect(await runCli(CHUNKED, ctx())).toBe(1);
    const first = stderr.text();
    const base = /--idempotency-key (\S+)/.exec(first)?.[1];
    expect(base, first).toMatch(/^[0-9a-f-]{36}$/);
    expect(first).toContain(`may have admitted it, fully or in part, under Idempotency-Key ${base}-1.`);
    expect(first).toContain(
      `To finish the submission without admitting anything twice, re-run the same command with --idempotency-key ${base}`,
    );
    expect(stdout.text()).toBe("b-1\n");
    const firstRun = server.requests.filter((r) => r.method === "POST");
    expect(firstRun.map((r) => r.headers["idempotency-key"])).toEqual([
      `${base}-0`,
      `${base}-1`,
      `${base}-1`,
    ]);

    down = false;
    expect(await runCli([...CHUNKED, "--idempotency-key", base!], ctx()), stderr.text()).toBe(0);
    const rerun = server.requests.filter((r) => r.method === "POST").slice(firstRun.length);
    expect(rerun.slice(0, 2).map((r) => [r.headers["idempotency-key"], r.body])).toEqual(
      firstRun.slice(0, 2).map((r) => [r.headers["idempotency-key"], r.body]),
    );
    const rows = [...admitted.values()].flatMap((a) =>
      rowsOf({ body: a.body, headers: {}, method: "POST", path: "" }),
    );
    expect(rows).toHaveLength(40); // every rollout admitted exactly once over both runs
    expect(stdout.text().trim().split("\n").slice(1, 3)).toEqual(["b-1", "b-2"]);
  });

  it("after a backlog split, a failed chunk's note does not promise a duplicate-free re-run", async () => {
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      const rows = rowsOf(req);
      if (n === 0 && rows.length > 3) {
        return apiError(res, 429, "backpressure", "partly full", {
          maxBacklog: 7,
          inflight: 4,
          retryAfterS: 0.01,
        });
      }
      if (n++ === 0) return acceptBatch(res, n, rows);
      apiError(res, 503, "unavailable", "gone");
    });
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--repeat", "5"], ctx())).toBe(1);
    expect(stderr.text()).toContain("may have admitted it, fully or in part, under Idempotency-Key");
    expect(stderr.text()).toContain("could be admitted twice");
    expect(stderr.text()).not.toContain("without admitting anything twice");
  });

  it("after a chunk split by the dispatcher's bound (a 413), a failed chunk's note says the re-run admits nothing twice only while that bound is unchanged", async () => {
    let n = 0;
    server.on("POST", "/v1/batches", (req, res) => {
      const rows = rowsOf(req);
      if (rows.length > 3) return apiError(res, 413, "payload_too_large", "never", { maxBacklog: 3 });
      if (n++ === 0) return acceptBatch(res, n, rows);
      apiError(res, 503, "unavailable", "gone");
    });
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--repeat", "3"], ctx())).toBe(1);
    const err = stderr.text();
    expect(err).toContain("without admitting anything twice");
    expect(err).toContain(
      "This run split a chunk by the dispatcher's FLEET_MAX_BACKLOG (3): the re-run sends the same batches only while that setting is unchanged",
    );
  });

  it("a failed chunk's note says nothing of a split when none was made", async () => {
    server.on("POST", "/v1/batches", (_req, res) => apiError(res, 503, "unavailable", "gone"));
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle"], ctx())).toBe(1);
    expect(stderr.text()).toContain("without admitting anything twice");
    expect(stderr.text()).not.toContain("split");
  });

  it("exits 2 on bad usage without calling the API", async () => {
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--task", "nope"], ctx())).toBe(2);
    expect(stderr.text()).toContain('unknown task "nope"; the suite has: alpha, beta');
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--repeat", "0"], ctx())).toBe(2);
    expect(await runCli(["submit", "--suite", "s", "--agent", "bogus"], ctx())).toBe(2);
    expect(
      await runCli(["submit", "--suite", "s", "--agent", "oracle", "--idempotency-key", "has space"], ctx()),
    ).toBe(2);
    expect(stderr.text()).toContain("printable ASCII");
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--deadline", "0.5"], ctx())).toBe(2);
    expect(stderr.text()).toContain("must be at least 1 second");
    // Past Node's longest timer a poll would come every millisecond.
    const slow = ["--poll-interval", "3000000000"];
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--wait", ...slow], ctx())).toBe(2);
    expect(await runCli(["watch", "b-1", ...slow], ctx())).toBe(2);
    expect(stderr.text()).toContain("must be at most 2147483647 ms");
    expect(await runCli(["submit", "--agent", "oracle"], ctx())).toBe(2);
    expect(stderr.text()).toContain("required option '--suite <dir>' not specified");
    // What only --wait prints (its stdout would otherwise be batch ids, not the JSON asked for).
    expect(
      await runCli(
        ["submit", "--suite", "s", "--agent", "oracle", "--out", path.join(dir, "r.jsonl")],
        ctx(),
      ),
    ).toBe(2);
    expect(stderr.text()).toContain("--out needs --wait");
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--json"], ctx())).toBe(2);
    expect(stderr.text()).toContain("--json needs --wait");
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", "--wait-timeout", "60"], ctx())).toBe(
      2,
    );
    expect(stderr.text()).toContain("--wait-timeout needs --wait");
    for (const [flag, value] of [
      ["--poll-interval", "500"],
      ["--outage-wait", "60"],
    ]) {
      expect(await runCli(["submit", "--suite", "s", "--agent", "oracle", flag!, value!], ctx())).toBe(2);
      expect(stderr.text()).toContain(`${flag} needs --wait`);
    }
    expect(server.requests).toHaveLength(0);
  });

  it("refuses --metadata the contract refuses (a __proto__ key at any depth, an integer past 2^53, a number past the largest double) before sending, as a usage error", async () => {
    const submit = (metadata: string) =>
      runCli(["submit", "--suite", "s", "--agent", "oracle", "--metadata", metadata], ctx());
    expect(await submit('{"run":"x","__proto__":{"admin":true}}')).toBe(2);
    expect(stderr.text()).toContain('--metadata is refused: __proto__ is a "__proto__" key');
    expect(await submit('{"cfg":{"items":[{"__proto__":1}]}}')).toBe(2);
    expect(stderr.text()).toContain('--metadata is refused: cfg.items.0.__proto__ is a "__proto__" key');
    expect(await submit('{"step":12345678901234567890}')).toBe(2);
    expect(stderr.text()).toContain(
      "--metadata is refused: step 12345678901234567000 is an integer beyond 2^53",
    );
    // JSON.parse reads 1e400 as Infinity, which JSON.stringify would send as null.
    expect(await submit('{"x":1e400,"y":[-1e999]}')).toBe(2);
    expect(stderr.text()).toContain("--metadata is refused: x must be a finite number");
    expect(stderr.text()).toContain("y.0 must be a finite number");
    expect(server.requests).toHaveLength(0);
  });

  it("reports a suite that does not load as a usage error", async () => {
    const code = await runCli(
      ["submit", "--suite", "missing", "--agent", "oracle"],
      ctx({ loadSuite: async () => Promise.reject(new Error("missing: not a task directory")) }),
    );
    expect(code).toBe(2);
    expect(stderr.text()).toContain("cannot load suite missing: missing: not a task directory");
  });

  it("loads the suite under --max-task-bytes (the fleet's FLEET_MAX_TASK_BYTES may allow more than the default), and says so when a task is over it", async () => {
    const bounds: number[] = [];
    const over = (dir: string, options: { maxBytes: number }) => {
      bounds.push(options.maxBytes);
      return Promise.reject(
        new Error(`${dir}/t: task is 12000000 bytes as sent (...), over the limit of ${options.maxBytes}`),
      );
    };
    expect(await runCli(["submit", "--suite", "s", "--agent", "oracle"], ctx({ loadSuite: over }))).toBe(2);
    expect(stderr.text()).toContain(
      "over the limit of 10485760 (a fleet whose FLEET_MAX_TASK_BYTES allows more: --max-task-bytes)",
    );
    const loaded: number[] = [];
    await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--max-task-bytes", "31457280"],
      ctx({
        loadSuite: async (_dir, options) => {
          loaded.push(options.maxBytes);
          return tasks;
        },
      }),
    );
    expect([...bounds, ...loaded]).toEqual([10 * 1024 * 1024, 31457280]);
    // --task asks the loader for those tasks only: another broken task of the suite stops nothing.
    const asked: Array<readonly string[]> = [];
    await runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--task", "beta"],
      ctx({
        loadSuite: async (_dir, options) => {
          asked.push(options.only);
          return tasks;
        },
      }),
    );
    expect(asked).toEqual([["beta"]]);
  });

  it("says so of a task whose files (read by the real loader) are over --max-task-bytes, too", async () => {
    const suite = path.join(dir, "suite");
    const task = path.join(suite, "big");
    await mkdir(path.join(task, "tests"), { recursive: true });
    await mkdir(path.join(task, "workspace"), { recursive: true });
    await writeFile(path.join(task, "task.toml"), '[task]\nimage = "fleet-base"\n');
    await writeFile(path.join(task, "instruction.md"), "Do it.\n");
    await writeFile(path.join(task, "tests", "test.sh"), "#!/bin/sh\ntest -f /workspace/done\n");
    await writeFile(path.join(task, "workspace", "blob.txt"), "x".repeat(8192));
    const real = ctx({ loadSuite: (d, options) => loadSuite(d, options) });
    const command = ["submit", "--suite", suite, "--agent", "oracle", "--max-task-bytes", "4096"];
    expect(await runCli(command, real)).toBe(2);
    expect(stderr.text()).toContain(
      "task is over the limit of 4096 bytes (its files, as read) (a fleet whose FLEET_MAX_TASK_BYTES allows more: --max-task-bytes)",
    );
    expect(server.requests).toHaveLength(0);
  });

  it("stops waiting on Ctrl-C with exit 130, leaving the batch running", async () => {
    server.on("POST", "/v1/batches", (_req, res) =>
      json(res, 202, { batchId: "b-1", rolloutIds: [], count: 2 }),
    );
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 2, done: 0, counts: { accepted: 2 } }),
    );
    const interrupt = new AbortController();
    const running = runCli(
      ["submit", "--suite", "s", "--agent", "oracle", "--wait", "--poll-interval", "60000"],
      ctx({ signal: interrupt.signal }),
    );
    await vi.waitFor(() => expect(server.requests.some((r) => r.method === "GET")).toBe(true), {
      timeout: 10_000,
    });
    interrupt.abort();
    expect(await running).toBe(130);
    // The batch is named (it was printed when submitted), not left as `<batchId>`.
    expect(stderr.text()).toContain(
      "interrupted; submitted rollouts keep running on the dispatcher in batch b-1 (`fleet status b-1` shows it, `fleet watch b-1` follows it",
    );
    expect(stderr.text()).not.toContain("fleet status <batchId>");
    expect(server.requests.filter((r) => r.path.startsWith("/v1/batches/b-1/cancel"))).toHaveLength(0);
  });
});

describe("Ctrl-C in the commands that submit nothing", () => {
  /** Run `argv` against a dispatcher that never finishes answering `path`; Ctrl-C once it is asked. */
  async function interrupted(argv: string[], path: string, partial?: string): Promise<number> {
    server.on("GET", path, (_req, res) => {
      if (partial !== undefined)
        res.writeHead(200, { "content-type": "application/x-ndjson" }).write(partial);
    });
    const interrupt = new AbortController();
    const running = runCli(argv, ctx({ signal: interrupt.signal }));
    await vi.waitFor(() => expect(server.requests.some((r) => r.path === path)).toBe(true), {
      timeout: 10_000,
    });
    interrupt.abort();
    return running;
  }

  it("fleet status says nothing was cancelled and the batch keeps running, not that it submitted rollouts", async () => {
    expect(await interrupted(["status", "b-7"], "/v1/batches/b-7")).toBe(130);
    expect(stderr.text()).toContain("interrupted; nothing was cancelled: batch b-7 keeps running");
    expect(stderr.text()).not.toContain("submitted");
  });

  it("fleet results says the same", async () => {
    const line = '{"id":"r1","status":"completed"}\n';
    expect(await interrupted(["results", "b-8"], "/v1/batches/b-8/results", line)).toBe(130);
    expect(stderr.text()).toContain("interrupted; nothing was cancelled: batch b-8 keeps running");
    expect(stderr.text()).not.toContain("submitted");
  });
});

describe("fleet status / results / cancel", () => {
  it("shows a batch's status, and its JSON", async () => {
    server.on("GET", "/v1/batches/b-7", (_req, res) =>
      json(res, 200, { id: "b-7", total: 10, done: 4, counts: { seeded: 6, completed: 3, masked: 1 } }),
    );
    expect(await runCli(["status", "b-7"], ctx())).toBe(0);
    expect(stdout.text()).toBe("batch b-7: running, 4/10 done (40.0%)\n  seeded 6  completed 3  masked 1\n");
    expect(await runCli(["status", "b-7", "--json"], ctx())).toBe(0);
    expect(JSON.parse(stdout.text().split("\n")[2]!)).toMatchObject({ id: "b-7", done: 4 });
  });

  it("never shows a running batch as 100% done: 1999 of 2000 is 99.9%", async () => {
    server.on("GET", "/v1/batches/b-8", (_req, res) =>
      json(res, 200, { id: "b-8", total: 2000, done: 1999, counts: { completed: 1999, seeded: 1 } }),
    );
    expect(await runCli(["status", "b-8"], ctx())).toBe(0);
    expect(stdout.text()).toMatch(/^batch b-8: running, 1999\/2000 done \(99\.9%\)\n/);
  });

  it("uses --url and --token over the environment's defaults", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 0, done: 0, counts: {} }),
    );
    const code = await runCli(
      ["status", "b-1", "--url", server.url, "--token", "flag-token"],
      ctx({ defaults: { url: "http://127.0.0.1:59", token: "env-token" } }),
    );
    expect(code).toBe(0);
    expect(server.requests[0]?.headers.authorization).toBe("Bearer flag-token");
  });

  it("takes --url and --token before the command too; given after it as well, the command's win", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 0, done: 0, counts: {} }),
    );
    const env = ctx({ defaults: { url: "http://127.0.0.1:59", token: "env-token" } });
    expect(await runCli(["--url", server.url, "--token", "before", "status", "b-1"], env)).toBe(0);
    expect(server.requests[0]?.headers.authorization).toBe("Bearer before");
    const after = ["--url", "http://127.0.0.1:59", "--token", "before", "status", "b-1", "--url", server.url];
    expect(await runCli([...after, "--token", "after"], env)).toBe(0);
    expect(server.requests[1]?.headers.authorization).toBe("Bearer after");
  });

  it("refuses a --url on a port fetch never connects to (6000, 10080) as bad usage, asking nothing", async () => {
    for (const url of ["http://127.0.0.1:6000", "https://fleet.example:10080/"]) {
      for (const argv of [
        ["status", "b-1", "--url", url],
        ["--url", url, "status", "b-1"],
      ]) {
        expect(await runCli(argv, ctx())).toBe(2);
        expect(stderr.text()).toContain("fetch and browsers refuse to connect to");
      }
    }
    expect(server.requests).toHaveLength(0);
  });

  it("refuses a --url with credentials, a query or a fragment as bad usage, asking nothing", async () => {
    for (const [url, said] of [
      [server.url.replace("http://", "http://bob:hunter2@"), "must not hold credentials"],
      [`${server.url}/?x=1`, "must not have a query"],
      [`${server.url}#top`, "must not have a query"],
    ] as const) {
      expect(await runCli(["status", "b-1", "--url", url], ctx()), url).toBe(2);
      expect(stderr.text()).toContain(said);
    }
    expect(stderr.text()).toContain("'http://***@127.0.0.1:");
    // Written without `//`, which URL parsers read as `http://bob:hunter2@…` all the same.
    for (const url of [
      server.url.replace("http://", "http:/bob:hunter2@"),
      server.url.replace("http://", "http:bob:hunter2@"),
      server.url.replace("http://", "http://bob:hun'ter2@"), // a quote in the password
      server.url.replace("http://", "http://bob:hun'x\nter2@"), // and a line break
    ]) {
      expect(await runCli(["status", "b-1", "--url", url], ctx()), url).toBe(2);
    }
    expect(stderr.text()).toContain("'http:/***@127.0.0.1:");
    expect(stderr.text()).toContain("'http:***@127.0.0.1:");
    expect(stderr.text()).not.toContain("hunter2");
    expect(stderr.text()).not.toContain("ter2");
    // A mistyped option given with `=`: its value is not echoed (a token, a URL's password).
    for (const argv of [
      ["status", "b-1", "--urll=http://bob:hunter2@h"],
      ["status", "b-1", "--tokenn=s3cr3t-token"],
    ]) {
      expect(await runCli(argv, ctx()), argv[2]).toBe(2);
    }
    expect(stderr.text()).toContain("unknown option '--urll=***'");
    expect(stderr.text()).not.toContain("hunter2");
    expect(stderr.text()).not.toContain("s3cr3t-token");
    expect(server.requests).toHaveLength(0);
  });

  it("exits 1 with the API's message on 401 and 404", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) => apiError(res, 401, "unauthorized", "bad token"));
    expect(await runCli(["status", "b-1"], ctx())).toBe(1);
    expect(stderr.text()).toContain("error: unauthorized: bad token (HTTP 401)");
    expect(stderr.text()).toContain("hint: set FLEET_TOKEN (or pass --token)");
    const before = stderr.text().length;
    expect(await runCli(["status", "nope"], ctx())).toBe(1);
    expect(stderr.text()).toContain("error: not_found:");
    expect(stderr.text().slice(before)).not.toContain("hint:");
  });

  it("streams results to stdout or to a file", async () => {
    const body = '{"id":"r1","status":"completed"}\n{"id":"r2","status":"failed"}\n';
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end(body);
    });
    expect(await runCli(["results", "b-1"], ctx())).toBe(0);
    expect(stdout.text()).toBe(body);
    const out = path.join(dir, "r.jsonl");
    expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(0);
    expect(await readFile(out, "utf8")).toBe(body);
    expect(stderr.text()).toContain(`wrote 2 results to ${out}`);
  });

  it("results of a batch still running says so on stderr (the lines are not all of it), exit 0 as documented", async () => {
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n');
    });
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 20, done: 4, counts: { completed: 4, running: 16 } }),
    );
    expect(await runCli(["results", "b-1"], ctx())).toBe(0);
    expect(stdout.text()).toBe('{"id":"r1"}\n');
    expect(stderr.text()).toContain("note: 4 of 20 rollouts of batch b-1 have finished; it is still running");
  });

  it("results of a batch that finishes while they are read says the lines are not all of it", async () => {
    // One of two finished when the results are read; the other finishes as they are sent.
    let sent = false;
    server.on("GET", "/v1/batches/b-1", (_req, res) => {
      const done = sent ? 2 : 1;
      json(res, 200, { id: "b-1", total: 2, done, counts: { completed: done, running: 2 - done } });
    });
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      sent = true;
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n');
    });
    expect(await runCli(["results", "b-1"], ctx())).toBe(0);
    expect(stdout.text()).toBe('{"id":"r1"}\n');
    expect(stderr.text()).toContain(
      "note: batch b-1 finished while its results were being read: 1 of its 2 results are here; `fleet results b-1` again gives them all",
    );
    const out = path.join(dir, "r.jsonl");
    sent = false;
    expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(0);
    expect(await readFile(out, "utf8")).toBe('{"id":"r1"}\n');
    expect(stderr.text().match(/finished while its results were being read/g)).toHaveLength(2);
  });

  it("results of a finished batch with fewer results than rollouts (the rest past their retention) exits 1 saying so, having written those that came", async () => {
    server.on("GET", "/v1/batches/b-1", (_req, res) =>
      json(res, 200, { id: "b-1", total: 3, done: 3, counts: { completed: 3 } }),
    );
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n{"id":"r3"}\n');
    });
    const error =
      "error: batch b-1 has 3 rollouts but 2 results were returned; the rest are gone from the dispatcher (past its result retention?)\n";
    expect(await runCli(["results", "b-1"], ctx())).toBe(1);
    expect(stdout.text()).toBe('{"id":"r1"}\n{"id":"r3"}\n');
    expect(stderr.text()).toBe(error);
    const out = path.join(dir, "r.jsonl");
    expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(1);
    expect(await readFile(out, "utf8")).toBe('{"id":"r1"}\n{"id":"r3"}\n');
    expect(stderr.text()).toBe(`${error}wrote 2 results to ${out}\n${error}`);
  });

  it("results whose status read before them failed says what it can after them, not an exit 0 without a word", async () => {
    // The first status read (asked once, before the results) fails; the one after them answers.
    let reads = 0;
    let up = true;
    server.on("GET", "/v1/batches/b-1", (_req, res) => {
      if (++reads === 1 || !up) return apiError(res, 503, "unavailable", "redis blip");
      json(res, 200, { id: "b-1", total: 3, done: 3, counts: { completed: 3 } });
    });
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n{"id":"r3"}\n');
    });
    expect(await runCli(["results", "b-1"], ctx())).toBe(1);
    expect(stdout.text()).toBe('{"id":"r1"}\n{"id":"r3"}\n');
    expect(stderr.text()).toContain(
      "error: batch b-1 has 3 rollouts but 2 results were returned; its status could not be read before them",
    );
    // Neither read answers: the lines are given, and said to be of a batch whose status is unknown.
    up = false;
    const out = path.join(dir, "r.jsonl");
    expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(0);
    expect(await readFile(out, "utf8")).toBe('{"id":"r1"}\n{"id":"r3"}\n');
    expect(stderr.text()).toContain(
      "note: the status of batch b-1 could not be read (redis blip): whether these 2 results are all of it is not known",
    );
  });

  it("results of a batch running when they were read, whose status read after them fails, still says the lines are not all of it", async () => {
    // The status read before the results answers (running); the one after them fails.
    let reads = 0;
    server.on("GET", "/v1/batches/b-1", (_req, res) => {
      if (++reads > 1) return apiError(res, 503, "unavailable", "redis blip");
      json(res, 200, { id: "b-1", total: 20, done: 4, counts: { completed: 4, running: 16 } });
    });
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n');
    });
    expect(await runCli(["results", "b-1"], ctx())).toBe(0);
    expect(stdout.text()).toBe('{"id":"r1"}\n');
    expect(stderr.text()).toContain(
      "note: 4 of 20 rollouts of batch b-1 had finished when its results were read; it was still running",
    );
    // All of them came (it finished meanwhile): nothing to say.
    reads = 0;
    const all = Array.from({ length: 20 }, (_, i) => `{"id":"r${i}"}\n`).join("");
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end(all);
    });
    const said = stderr.text();
    expect(await runCli(["results", "b-1"], ctx())).toBe(0);
    expect(stderr.text().slice(said.length)).not.toContain("note:");
  });

  it("results --out: a path that cannot be written is a usage error before fetching, not a crash", async () => {
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n');
    });
    const out = path.join(dir, "no-such-dir", "r.jsonl");
    expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(2);
    expect(stderr.text()).toContain(`error: cannot write --out ${out}: ENOENT`);
    expect(server.requests).toHaveLength(0);
    expect(await readdir(dir)).toEqual([]);
  });

  it.skipIf(!existsSync("/dev/full"))(
    "results --out: a write that fails (ENOSPC) exits 1 and removes the partial file",
    async () => {
      server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
        res.writeHead(200, { "content-type": "application/x-ndjson" }).end('{"id":"r1"}\n{"id":"r2"}\n');
      });
      const out = path.join(dir, "r.jsonl");
      await symlink("/dev/full", partialPath(out)); // opens fine; every write fails with ENOSPC
      expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(1);
      expect(stderr.text()).toBe(`error: cannot write ${out}: ENOSPC: no space left on device, write\n`);
      expect(await readdir(dir)).toEqual([]);
    },
  );

  it("results: a 200 that is not NDJSON (a proxy's page, another server) is refused, and --out writes no file", async () => {
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "text/html" }).end("<html>sign in</html>\n");
    });
    const out = path.join(dir, "r.jsonl");
    expect(await runCli(["results", "b-1", "--out", out], ctx())).toBe(1);
    expect(stderr.text()).toContain(
      "error: bad_response: the results of batch b-1 came as text/html, not NDJSON",
    );
    expect(stdout.text()).toBe("");
    expect(await readdir(dir)).toEqual([]);
  });

  it("results: a stream that keeps breaking off ends with a clear error, not a stack trace", async () => {
    server.on("GET", "/v1/batches/b-1/results", (_req, res) => {
      res.writeHead(200, { "content-type": "application/x-ndjson" });
      res.write('{"id":"r1"}\n{"id":"r2', () => res.destroy());
    });
    expect(await runCli(["results", "b-1"], ctx())).toBe(1);
    expect(stdout.text()).toBe('{"id":"r1"}\n'); // once, though it came on every attempt
    expect(stderr.text()).toContain("error: stream_broken: the results stream of batch b-1");
    expect(stderr.text()).not.toContain("TypeError");
  });

  it("results: a body that ends inside a line where its connection closes (no length, not chunked) is fetched again, not saved with half a result", async () => {
    // node:http always frames a body (a length or chunks): this one ends only where its
    // connection closes, so a cut there looks like a whole body to fetch.
    let fetches = 0;
    const sockets = new Set<Socket>();
    const raw = createNetServer((socket) => {
      sockets.add(socket);
      socket.on("close", () => sockets.delete(socket));
      let head = "";
      socket.on("data", (chunk: Buffer) => {
        head += chunk.toString("latin1");
        if (!head.includes("\r\n\r\n")) return;
        const target = head.split(" ")[1];
        if (target === "/v1/batches/b-1") {
          const body = JSON.stringify({ id: "b-1", total: 2, done: 2, counts: { completed: 2 } });
          socket.end(
            `HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`,
          );
          return;
        }
        const body = `${JSON.stringify(completed("r1", 1))}\n${JSON.stringify(completed("r2", 0))}\n`;
        fetches++;
        socket.end(
          "HTTP/1.0 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n" +
            (fetches === 1 ? body.slice(0, body.length - 10) : body),
        );
      });
    });
    await new Promise<void>((resolve) => raw.listen(0, "127.0.0.1", resolve));
    try {
      const url = `http://127.0.0.1:${(raw.address() as AddressInfo).port}`;
      const out = path.join(dir, "r.jsonl");
      const code = await runCli(["results", "b-1", "--out", out], ctx({ defaults: { url, token: null } }));
      expect(code, stderr.text()).toBe(0);
      expect(fetches).toBe(2);
      expect(stderr.text()).toContain("the results stream of batch b-1 from");
      expect(stderr.text()).toContain("broke off (it ended inside a line)");
      expect(
        (await readFile(out, "utf8"))
          .trim()
          .split("\n")
          .map((l) => JSON.parse(l).id),
      ).toEqual(["r1", "r2"]);
    } finally {
      for (const socket of sockets) socket.destroy();
      await new Promise<void>((resolve) => raw.close(() => resolve()));
    }
  });

  it("cancels a rollout, falls back to a batch, and says when neither exists", async () => {
    server.on("POST", "/v1/rollouts/r-1/cancel", (_req, res) =>
      json(res, 202, { id: "r-1", status: "cancelled" }),
    );
    server.on("POST", "/v1/batches/b-1/cancel", (_req, res) =>
      json(res, 202, { batchId: "b-1", cancelled: 3 }),
    );
    server.on("POST", "/v1/batches/b-2/cancel", (_req, res) =>
      json(res, 202, { batchId: "b-2", cancelled: 0 }),
    );
    // As the dispatcher answers an id nothing has: 404 naming it.
    for (const id of ["b-1", "b-2", "zzz"]) {
      server.on("POST", `/v1/rollouts/${id}/cancel`, (_req, res) =>
        apiError(res, 404, "not_found", `no rollout "${id}"`, { rolloutId: id }),
      );
    }
    server.on("POST", "/v1/batches/zzz/cancel", (_req, res) =>
      apiError(res, 404, "not_found", 'no batch "zzz"', { batchId: "zzz" }),
    );
    expect(await runCli(["cancel", "r-1"], ctx())).toBe(0);
    expect(await runCli(["cancel", "b-1"], ctx())).toBe(0);
    expect(await runCli(["cancel", "b-2"], ctx())).toBe(0);
    expect(stdout.text()).toBe(
      "cancel requested for rollout r-1\n" +
        "cancel requested for batch b-1: 3 rollouts will end cancelled\n" +
        "cancel requested for batch b-2: no rollout of it was left to stop (all finished or closing)\n",
    );
    expect(server.requests.map((r) => r.path)).toEqual([
      "/v1/rollouts/r-1/cancel",
      "/v1/rollouts/b-1/cancel",
      "/v1/batches/b-1/cancel",
      "/v1/rollouts/b-2/cancel",
      "/v1/batches/b-2/cancel",
    ]);
    expect(await runCli(["cancel", "zzz"], ctx())).toBe(1);
    expect(stderr.text()).toContain("error: not_found: no rollout or batch with id zzz (HTTP 404)");
  });

  it("cancel: a 404 that is not the dispatcher's unknown id (a wrong path in FLEET_URL, a proxy's page) is said as it is, not as an unknown id", async () => {
    // The fake answers every unrouted request 404 "no route …", without an id in its details.
    expect(await runCli(["cancel", "r-9"], ctx())).toBe(1);
    expect(stderr.text()).toContain("error: not_found: no route POST /v1/rollouts/r-9/cancel");
    expect(stderr.text()).not.toContain("no rollout or batch with id");
    expect(server.requests.map((r) => r.path)).toEqual(["/v1/rollouts/r-9/cancel"]);
  });

  it("a rollout cancelled already is what was asked for (exit 0); one that ended otherwise is not", async () => {
    const conflict = (status: string) => ({
      error: { code: "conflict", message: `rollout already finished (${status})`, details: { status } },
    });
    server.on("POST", "/v1/rollouts/r-c/cancel", (_req, res) => json(res, 409, conflict("cancelled")));
    server.on("POST", "/v1/rollouts/r-d/cancel", (_req, res) => json(res, 409, conflict("completed")));
    expect(await runCli(["cancel", "r-c"], ctx())).toBe(0);
    expect(stdout.text()).toBe("rollout r-c is already cancelled\n");
    expect(await runCli(["cancel", "r-d"], ctx())).toBe(1);
    expect(stderr.text()).toContain("rollout already finished (completed)");
    expect(server.requests.some((r) => r.path.startsWith("/v1/batches/"))).toBe(false);
  });

  it("prints help for every command with exit 0", async () => {
    for (const cmd of ["submit", "status", "results", "cancel"]) {
      expect(await runCli([cmd, "--help"], ctx())).toBe(0);
      expect(stdout.text()).toContain(`Usage: fleet ${cmd}`);
    }
    expect(stdout.text()).toContain("--url <url>");
    expect(stdout.text()).toContain("--token <token>");
  });
});
