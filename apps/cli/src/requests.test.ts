import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { MAX_METADATA_BYTES, TaskContent } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { buildRollouts, chunkRollouts, resolveAgent, UsageError } from "./requests.ts";
import { maskedLines, rerunRollouts } from "./rerun.ts";

function task(id: string, pad = 0): TaskContent {
  return TaskContent.parse({
    id,
    instruction: `do ${id}`,
    image: "fleet-base:latest",
    tests: { "test.sh": `exit 0\n${"#".repeat(pad)}` },
  });
}

const noFiles = async (path: string): Promise<string> => {
  throw Object.assign(new Error(`ENOENT: ${path}`), { code: "ENOENT" });
};

describe("resolveAgent", () => {
  it("knows oracle by name", async () => {
    expect(await resolveAgent("oracle", noFiles)).toEqual({ harness: "oracle" });
  });

  it("accepts inline JSON and returns it as written", async () => {
    const spec = await resolveAgent('{"harness":"command","argv":["sh","-c","echo 1"]}', noFiles);
    expect(spec).toEqual({ harness: "command", argv: ["sh", "-c", "echo 1"] });
  });

  it("reads a JSON file", async () => {
    const files: Record<string, string> = { "agent.json": '{"harness":"oracle","name":"ref"}' };
    expect(await resolveAgent("agent.json", async (p) => files[p] ?? noFiles(p))).toEqual({
      harness: "oracle",
      name: "ref",
    });
  });

  it("reads a JSON file that starts with a byte order mark (Windows editors write one)", async () => {
    const files: Record<string, string> = { "agent.json": '\uFEFF{"harness":"oracle","name":"ref"}\r\n' };
    expect(await resolveAgent("agent.json", async (p) => files[p] ?? noFiles(p))).toEqual({
      harness: "oracle",
      name: "ref",
    });
  });

  it("refuses an unknown name, bad JSON and an invalid spec with a usage error", async () => {
    await expect(resolveAgent("gpt-agent", noFiles)).rejects.toThrow(
      /unknown agent "gpt-agent": expected oracle/,
    );
    // Written as a path: the missing file is named as such, not taken for an unknown name.
    for (const path of ["agents/mine.json", "mine.json", "./agent"]) {
      await expect(resolveAgent(path, noFiles)).rejects.toThrow(
        `no such agent file: ${path} (an agent is oracle`,
      );
    }
    await expect(resolveAgent("{nope", noFiles)).rejects.toThrow(/inline --agent JSON is not valid JSON/);
    // JSON that is no object is inline JSON all the same, not a file's name.
    for (const inline of ["[1]", '"oracle"']) {
      await expect(resolveAgent(inline, noFiles)).rejects.toThrow(
        /^inline --agent JSON is not a valid agent spec/,
      );
    }
    const err = await resolveAgent('{"harness":"command","argv":[]}', noFiles).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UsageError);
    expect((err as Error).message).toContain("argv: argv must name a command");
  });
});

describe("maskedLines", () => {
  it("reads a results file that starts with a byte order mark (a file saved again by a Windows editor)", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-rerun-"));
    try {
      const path = join(dir, "results.jsonl");
      const line = (status: string) =>
        JSON.stringify({ status, taskId: "t", taskDigest: "d", agent: "oracle", metadata: { repeat: 0 } });
      await writeFile(path, `\uFEFF${line("masked")}\r\n${line("completed")}\r\n`);
      const read = await maskedLines(path);
      expect(read.lines).toBe(2);
      expect(read.masked.map((l) => l.taskId)).toEqual(["t"]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
  it("reads a rollout that is in the file twice (one batch's results appended twice) once: it is rerun once", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-rerun-"));
    try {
      const path = join(dir, "results.jsonl");
      const line = (id: string, status: string, repeat: number) =>
        JSON.stringify({ id, status, taskId: "t", taskDigest: "d", agent: "oracle", metadata: { repeat } });
      const once = [line("r-0", "masked", 0), line("r-1", "completed", 1), line("r-2", "masked", 2)];
      await writeFile(path, `${[...once, ...once].join("\n")}\n`);
      const read = await maskedLines(path);
      expect(read.masked.map((l) => l.metadata)).toEqual([{ repeat: 0 }, { repeat: 2 }]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

describe("buildRollouts", () => {
  const tasks = [task("a"), task("b"), task("c")];

  it("builds task × repeat requests, repetition-major, with the repeat index in metadata", () => {
    const reqs = buildRollouts({ tasks, agent: { harness: "oracle" }, repeat: 2, metadata: { run: "x" } });
    expect(
      reqs.map((r) => `${(r.task as TaskContent).id}${(r.metadata as { repeat: number }).repeat}`),
    ).toEqual(["a0", "b0", "c0", "a1", "b1", "c1"]);
    expect(reqs[0]).toEqual({
      task: tasks[0],
      agent: { harness: "oracle" },
      metadata: { run: "x", repeat: 0 },
    });
    expect(reqs[0]).not.toHaveProperty("deadlineS");
  });

  it("refuses metadata nested too deep to be written as JSON with a usage error, not JSON.stringify's RangeError", () => {
    let deep: Record<string, unknown> = { leaf: 1 };
    for (let i = 0; i < 20_000; i++) deep = { a: deep };
    expect(() => buildRollouts({ tasks, agent: { harness: "oracle" }, repeat: 1, metadata: deep })).toThrow(
      /--metadata is refused: .*nests too deeply to be written as JSON/,
    );
  });

  it("refuses metadata with its own repeat key, which the repetition index would overwrite", () => {
    expect(() =>
      buildRollouts({ tasks, agent: { harness: "oracle" }, repeat: 1, metadata: { repeat: 5 } }),
    ).toThrow(/--metadata must not set "repeat"/);
  });

  it("filters by task id and sets the deadline", () => {
    const reqs = buildRollouts({
      tasks,
      agent: { harness: "oracle" },
      taskIds: ["c", "a", "c"],
      deadlineS: 90,
    });
    expect(reqs.map((r) => (r.task as TaskContent).id)).toEqual(["c", "a"]);
    expect(reqs.every((r) => r.deadlineS === 90)).toBe(true);
  });

  it("names unknown tasks and lists the suite's", () => {
    expect(() => buildRollouts({ tasks, agent: { harness: "oracle" }, taskIds: ["zz"] })).toThrow(
      'unknown task "zz"; the suite has: a, b, c',
    );
  });

  it("refuses, before anything is sent, metadata that the repetition index takes past the dispatcher's limit: the last repetition's, not only the first", () => {
    // {"k":"xx…","repeat":N}: 4,096 bytes with a one-digit N, 4,097 with two.
    const metadata = { k: "x".repeat(MAX_METADATA_BYTES - 19) };
    const build = (repeat: number) =>
      buildRollouts({ tasks, agent: { harness: "oracle" }, repeat, metadata });
    const last = build(10).at(-1)!.metadata!;
    expect(Buffer.byteLength(JSON.stringify(last))).toBe(MAX_METADATA_BYTES);
    expect(() => build(11)).toThrow(
      /^--metadata is refused: with "repeat" added \(10 at most\) its metadata is 4097 bytes of JSON, over the limit of 4096/,
    );
  });

  it("refuses a rerun whose line's metadata with --metadata over it is past the dispatcher's limit, naming the task", () => {
    const line = { status: "masked", taskId: "a", taskDigest: "d", agent: "oracle", metadata: { repeat: 3 } };
    const rerun = (metadata: Record<string, unknown>) =>
      rerunRollouts({ path: "r.jsonl", masked: [line], tasks, agent: { harness: "oracle" }, metadata });
    // {"repeat":3,"k":"xx…"}: 4,096 bytes, then 4,097.
    expect(rerun({ k: "x".repeat(MAX_METADATA_BYTES - 19) })).toHaveLength(1);
    expect(() => rerun({ k: "x".repeat(MAX_METADATA_BYTES - 18) })).toThrow(
      /^--rerun r\.jsonl: task a's rerun \(its line's metadata and --metadata\): metadata is 4097 bytes of JSON/,
    );
  });

  it("refuses an empty suite and a bad repeat", () => {
    expect(() => buildRollouts({ tasks: [], agent: { harness: "oracle" } })).toThrow(UsageError);
    expect(() => buildRollouts({ tasks, agent: { harness: "oracle" }, repeat: 0 })).toThrow(/--repeat/);
  });
});

describe("chunkRollouts", () => {
  const agent = { harness: "oracle" as const };
  const bodyBytes = (lines: string[]) => Buffer.byteLength(`{"rollouts":[${lines.join(",")}]}`);

  it("keeps a small submission in one chunk", () => {
    const reqs = buildRollouts({ tasks: [task("a"), task("b")], agent, repeat: 3 });
    const chunks = chunkRollouts(reqs);
    expect(chunks).toHaveLength(1);
    expect(chunks[0]?.map((l) => JSON.parse(l))).toEqual(JSON.parse(JSON.stringify(reqs)));
  });

  it("splits by bytes, every chunk's body within the limit, order kept", () => {
    const reqs = buildRollouts({ tasks: [task("a", 3000), task("b", 3000)], agent, repeat: 10 });
    const maxBytes = 16 * 1024;
    const chunks = chunkRollouts(reqs, { maxBytes });
    expect(chunks.length).toBeGreaterThan(1);
    for (const chunk of chunks) expect(bodyBytes(chunk)).toBeLessThanOrEqual(maxBytes);
    expect(chunks.flat().map((l) => JSON.parse(l).metadata.repeat)).toEqual(
      reqs.map((r) => r.metadata?.repeat),
    );
  });

  it("sends an oversize request alone rather than dropping it", () => {
    const reqs = buildRollouts({ tasks: [task("small"), task("huge", 50_000), task("small2")], agent });
    const chunks = chunkRollouts(reqs, { maxBytes: 10_000 });
    expect(chunks.map((c) => c.length)).toEqual([1, 1, 1]);
  });

  it("references a task by digest only in chunks after the one that carried it inline", () => {
    const a = task("a", 3000);
    const reqs = buildRollouts({ tasks: [a], agent, repeat: 12 });
    let digestCalls = 0;
    const chunks = chunkRollouts(reqs, {
      maxBytes: 8 * 1024,
      digestOf: (t) => {
        digestCalls++;
        return `digest-of-${t.id}`;
      },
    });
    expect(chunks.length).toBeGreaterThan(1);
    const tasksIn = (chunk: string[]) => chunk.map((l) => JSON.parse(l).task);
    expect(tasksIn(chunks[0]!).every((t) => t.id === "a")).toBe(true);
    for (const chunk of chunks.slice(1)) {
      expect(tasksIn(chunk)).toEqual(chunk.map(() => ({ digest: "digest-of-a" })));
    }
    expect(chunks.flat()).toHaveLength(12);
    expect(digestCalls).toBe(1); // memoised per task object
  });

  it("without a digest function every row carries its task", () => {
    const reqs = buildRollouts({ tasks: [task("a", 3000)], agent, repeat: 12 });
    for (const line of chunkRollouts(reqs, { maxBytes: 8 * 1024 }).flat())
      expect(JSON.parse(line).task.id).toBe("a");
  });
});
