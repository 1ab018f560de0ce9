import {
  type AgentSpecInput,
  RolloutRequest,
  type RolloutRequestInput,
  type TaskContent,
} from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { AdmissionError, digestTask, prepareRollouts } from "./admission.ts";
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

  it("names another spelling of solve.sh: the harness looks it up by that exact key", async () => {
    const { store } = memoryStore();
    const task = { ...noSolution, solution: { "./solve.sh": "true" } };
    const err = await refusal(prepare(store, [{ task, agent: { harness: "oracle" } }]));
    expect(err.message).toContain('(found "./solve.sh": name it exactly "solve.sh")');
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
