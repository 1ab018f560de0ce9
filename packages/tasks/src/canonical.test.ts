import path from "node:path";
import { isFleetError, TaskContent, type TaskContentInput } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { canonicalJson, canonicalTaskJson, taskDigest, taskSize } from "./canonical.ts";
import { loadTask } from "./load-task.ts";
import { EXAMPLE_SUITE_DIR } from "./paths.ts";

const TINY: TaskContentInput = {
  id: "tiny",
  instruction: "Say hi.",
  image: "rollout-fleet/base:latest",
  tests: { "test.sh": "exit 0\n" },
};

describe("canonicalJson", () => {
  it("sorts keys at every depth, keeps array order, drops undefined", () => {
    expect(canonicalJson({ b: 1, a: { d: [3, 1], c: null }, u: undefined })).toBe(
      '{"a":{"c":null,"d":[3,1]},"b":1}',
    );
  });

  it("refuses values JSON would silently change", () => {
    expect(() => canonicalJson({ x: Number.NaN })).toThrow(/non-finite/);
    expect(() => canonicalJson({ x: 1n })).toThrow(/bigint/);
  });
});

describe("taskDigest", () => {
  it("is pinned for a fixed task (the canonical form must not drift)", () => {
    expect(canonicalTaskJson(TINY)).toBe(
      '{"id":"tiny","image":"rollout-fleet/base:latest","instruction":"Say hi.","metadata":{},"solution":{},' +
        '"tests":{"test.sh":"exit 0\\n"},"timeouts":{"agentS":120,"verifierS":60},"verifier":{"kind":"tests"},' +
        '"workspace":{}}',
    );
    expect(taskDigest(TINY)).toBe("4f16351f7426b1d57d0ec73d5cdf3024703661d7b4bf878608b73f6cf957c664");
  });

  it("does not depend on key order or on defaults being spelled out", () => {
    const reordered = Object.fromEntries(Object.entries(TINY).reverse()) as TaskContentInput;
    expect(taskDigest(reordered)).toBe(taskDigest(TINY));
    expect(taskDigest(TaskContent.parse(TINY))).toBe(taskDigest(TINY));
    expect(
      taskDigest({ ...TINY, timeouts: { agentS: 120, verifierS: 60 }, verifier: { kind: "tests" } }),
    ).toBe(taskDigest(TINY));
  });

  it("changes when any content changes", () => {
    const base = taskDigest(TINY);
    const variants: TaskContentInput[] = [
      { ...TINY, id: "tiny2" },
      { ...TINY, instruction: "Say hi!" },
      { ...TINY, image: "other:latest" },
      { ...TINY, tests: { "test.sh": "exit 0\n\n" } },
      { ...TINY, tests: { "test.sh": "exit 0\n", "extra.txt": "" } },
      { ...TINY, workspace: { "a.txt": "" } },
      { ...TINY, solution: { "solve.sh": "" } },
      { ...TINY, timeouts: { agentS: 121 } },
      { ...TINY, tests: {}, verifier: { kind: "match", expected: "hi" } },
      { ...TINY, metadata: { tag: 1 } },
    ];
    const digests = variants.map(taskDigest);
    for (const digest of digests) expect(digest).not.toBe(base);
    expect(new Set(digests).size).toBe(variants.length);
  });

  it("is the same for two loads of the same directory", async () => {
    const dir = path.join(EXAMPLE_SUITE_DIR, "python-bugfix");
    expect(taskDigest(await loadTask(dir))).toBe(taskDigest(await loadTask(dir)));
    expect(taskDigest(await loadTask(dir))).toMatch(/^[0-9a-f]{64}$/);
  });

  it("throws invalid_task for content that does not parse", () => {
    const err = (() => {
      try {
        taskDigest({ ...TINY, id: "no spaces allowed" });
      } catch (e) {
        return e;
      }
      return null;
    })();
    expect(isFleetError(err) && err.kind).toBe("invalid_task");
  });
});

describe("taskSize", () => {
  it("counts UTF-8 bytes of the stored form", () => {
    const ascii = taskSize(TINY);
    expect(ascii).toBe(canonicalTaskJson(TINY).length);
    // "é" (replacing "i") is two bytes in UTF-8 but one UTF-16 unit.
    expect(taskSize({ ...TINY, instruction: "Say hé." })).toBe(ascii + 1);
  });
});
