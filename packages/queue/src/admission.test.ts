import {
  type AgentSpecInput,
  canonicalJson,
  RolloutRequest,
  type RolloutRequestInput,
  sha256Hex,
  TaskContent,
} from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import {
  AdmissionError,
  checkRequestShapes,
  digestTask,
  jsonDepth,
  MAX_METADATA_BYTES,
  MAX_REQUEST_DEPTH,
  prepareRollouts,
  serializeRequests,
} from "./admission.ts";
import type { RolloutStore } from "./rollout-store.ts";

/** The two calls `prepareRollouts` makes of a store, over a Map. */
function memoryStore(): { store: RolloutStore; tasks: Map<string, TaskContent> } {
  const tasks = new Map<string, TaskContent>();
  const store = {
    getTask: async (digest: string) => tasks.get(digest) ?? null,
    putTask: async (task: TaskContent, digest: string) => {
      tasks.set(digest, task);
    },
  } as unknown as RolloutStore;
  return { store, tasks };
}

const noSolution = { id: "t1", instruction: "do it", image: "img", tests: { "test.sh": "exit 0" } };
const command: AgentSpecInput = { harness: "command", argv: ["true"] };

async function prepare(store: RolloutStore, requests: RolloutRequestInput[]) {
  const parsed = requests.map((r) => RolloutRequest.parse(r));
  return prepareRollouts(
    store,
    parsed,
    parsed.map((_, i) => `r${i}`),
    null,
    { maxTaskBytes: 1 << 20 },
  );
}

async function refusal(promise: Promise<unknown>): Promise<AdmissionError> {
  const err = await promise.then(
    () => null,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(AdmissionError);
  return err as AdmissionError;
}

describe("admission of a task by digest stored under an older schema", () => {
  it("quotes why it no longer parses cut between characters: a file name of emoji cut at 300 left a lone surrogate in the 422", async () => {
    // The store's read refuses it as the real one does (a ZodError, its message the issues'
    // JSON, a file's name in it as it is); either parity of the cut, by a name one unit longer.
    for (const name of ["\u{1F600}".repeat(200), `a${"\u{1F600}".repeat(200)}`]) {
      const issues = TaskContent.safeParse({ ...noSolution, tests: { [name]: 5 } }).error!;
      const store = {
        getTask: async () => {
          throw issues;
        },
        putTask: async () => undefined,
      } as unknown as RolloutStore;
      const err = await refusal(prepare(store, [{ task: { digest: "a".repeat(64) }, agent: command }]));
      expect(err.message).toContain("is no longer valid (");
      expect(err.message).toContain("\u{1F600}");
      expect((err.message as string & { isWellFormed(): boolean }).isWellFormed(), name.slice(0, 2)).toBe(
        true,
      );
    }
  });
});

describe("admission of an oracle rollout", () => {
  it("refuses one whose task has no solution/solve.sh (422), naming the field, and records nothing", async () => {
    const { store, tasks } = memoryStore();
    const err = await refusal(
      prepare(store, [
        { task: noSolution, agent: command },
        { task: noSolution, agent: { harness: "oracle" } },
      ]),
    );
    expect(err.code).toBe("invalid");
    expect(err.message).toBe("rollout 1: task t1's solution/solve.sh is missing: the oracle agent runs it");
    expect(err.details).toEqual({
      index: 1,
      issues: [{ path: "task.solution.solve.sh", message: "is missing: the oracle agent runs it" }],
    });
    expect(tasks.size).toBe(0);
  });

  it("refuses one whose task, given by digest, has no solution/solve.sh", async () => {
    const { store, tasks } = memoryStore();
    await prepare(store, [{ task: noSolution, agent: command }]);
    const [digest] = [...tasks.keys()];
    const err = await refusal(prepare(store, [{ task: { digest: digest! }, agent: { harness: "oracle" } }]));
    expect(err.code).toBe("invalid");
    expect(err.details).toMatchObject({ index: 0, issues: [{ path: "task.solution.solve.sh" }] });
  });

  it("accepts a command agent with the same task, and an oracle one once solve.sh is there", async () => {
    const { store, tasks } = memoryStore();
    const metas = await prepare(store, [
      { task: noSolution, agent: command },
      { task: { ...noSolution, solution: { "solve.sh": "true" } }, agent: { harness: "oracle" } },
    ]);
    expect(metas.map((m) => m.agentName)).toEqual(["command", "oracle"]);
    expect(tasks.size).toBe(2);
    expect(metas[0]!.taskDigest).toBe(digestTask(tasks.get(metas[0]!.taskDigest)!));
  });
});

describe("admission's bounds", () => {
  const task = { ...noSolution, solution: { "solve.sh": "true" } };

  it("admits a task of exactly maxTaskBytes, and refuses one a byte over (413)", async () => {
    const { store } = memoryStore();
    const request = RolloutRequest.parse({ task, agent: command });
    const bytes = Buffer.byteLength(canonicalJson(TaskContent.parse(task)));
    const prepareWith = (maxTaskBytes: number) =>
      prepareRollouts(store, [request], ["r0"], null, { maxTaskBytes });
    expect(await prepareWith(bytes)).toHaveLength(1);
    expect((await refusal(prepareWith(bytes - 1))).code).toBe("payload_too_large");
  });

  it("admits metadata of exactly MAX_METADATA_BYTES and a request nested exactly MAX_REQUEST_DEPTH deep; one more is refused (422)", () => {
    const withMetadata = (metadata: Record<string, unknown>) =>
      RolloutRequest.parse({ task, agent: command, metadata });
    // {"k":"…"}: 8 bytes around the value.
    const atBound = withMetadata({ k: "x".repeat(MAX_METADATA_BYTES - 8) });
    expect(Buffer.byteLength(JSON.stringify(atBound.metadata))).toBe(MAX_METADATA_BYTES);
    expect(() => checkRequestShapes([atBound])).not.toThrow();
    const over = withMetadata({ k: "x".repeat(MAX_METADATA_BYTES - 7) });
    expect(() => checkRequestShapes([over])).toThrow(AdmissionError);

    const nested = (levels: number): Record<string, unknown> => {
      let v: Record<string, unknown> = {};
      for (let i = 1; i < levels; i++) v = { a: v };
      return v;
    };
    // The request is one level, its metadata the rest.
    const deepest = withMetadata(nested(MAX_REQUEST_DEPTH - 1));
    expect(jsonDepth(deepest)).toBe(MAX_REQUEST_DEPTH);
    expect(() => checkRequestShapes([deepest])).not.toThrow();
    const deeper = withMetadata(nested(MAX_REQUEST_DEPTH));
    expect(() => checkRequestShapes([deeper])).toThrow(/nested more than 64 levels deep/);
  });

  it("hashes a submission row by row to what hashing its rows joined gives (the body hash replays are matched by)", async () => {
    const requests = [
      RolloutRequest.parse({ task: noSolution, agent: command }),
      RolloutRequest.parse({
        task: { digest: "a".repeat(64) },
        agent: command,
        metadata: { s: "é😀\u2028" },
      }),
      RolloutRequest.parse({
        task: noSolution,
        agent: command,
        deadlineS: 3600,
        metadata: { n: [1, 2.5, null] },
      }),
    ];
    for (const rows of [requests.slice(0, 1), requests]) {
      const { canonical, bodyHash } = await serializeRequests(rows);
      expect(canonical).toEqual(rows.map((r) => canonicalJson(r)));
      expect(bodyHash).toBe(sha256Hex(`[${canonical.join(",")}]`));
    }
  });

  it("refuses an agent in its own sandbox on a task its tests grade in the task sandbox (they could not see its work)", async () => {
    const { store } = memoryStore();
    const err = await refusal(prepare(store, [{ task, agent: { ...command, sandbox: "own" } }]));
    expect(err.code).toBe("invalid");
    expect(err.message).toMatch(/agent.sandbox "own"/);
  });

  it("refuses file sets their sandbox directory cannot hold at the sizes the request sets (tests after the agent ran, once), naming the size; what fits passes", async () => {
    const { store, tasks } = memoryStore();
    // 300 files of one byte: 300 pages of 4 KiB, 1.2 MiB staged, into a 1 MiB /tests.
    const tests: Record<string, string> = { "test.sh": "exit 0" };
    for (let f = 0; f < 299; f++) tests[`t${f}.py`] = "x";
    const big = { ...task, tests };
    const err = await refusal(prepare(store, [{ task: big, agent: command, sandbox: { tmpfsMb: 1 } }]));
    expect(err.code).toBe("invalid");
    expect(err.details).toEqual({
      index: 0,
      issues: [
        {
          path: "sandbox.tmpfsMb",
          message:
            "of 1 MiB cannot hold task t1's tests (1200 KiB staged, each file rounded up to 4 KiB): raise it",
        },
      ],
    });
    expect(tasks.size).toBe(0);
    // The solution counts for the oracle only (it alone stages it); the workspace against diskMb.
    const solution: Record<string, string> = { "solve.sh": "true" };
    for (let f = 0; f < 299; f++) solution[`s${f}.txt`] = "x";
    await prepare(store, [{ task: { ...task, solution }, agent: command, sandbox: { tmpfsMb: 1 } }]);
    const oracle = {
      task: { ...task, solution },
      agent: { harness: "oracle" as const },
      sandbox: { tmpfsMb: 1 },
    };
    expect((await refusal(prepare(store, [oracle]))).details).toMatchObject({
      issues: [{ path: "sandbox.tmpfsMb", message: expect.stringMatching(/t1's solution \(1200 KiB/) }],
    });
    const workspace: Record<string, string> = {};
    for (let f = 0; f < 300; f++) workspace[`w${f}.txt`] = "y";
    expect(
      (
        await refusal(
          prepare(store, [{ task: { ...task, workspace }, agent: command, sandbox: { diskMb: 1 } }]),
        )
      ).details,
    ).toMatchObject({ issues: [{ path: "sandbox.diskMb" }] });
    // No sizes set, or sizes that hold them: admitted.
    await prepare(store, [
      { task: big, agent: command },
      { task: big, agent: command, sandbox: { tmpfsMb: 2 } },
      { task: { ...task, workspace }, agent: command, sandbox: { diskMb: 2 } },
    ]);
  });
});
