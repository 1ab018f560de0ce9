import { execFileSync } from "node:child_process";
import { appendFileSync, mkdirSync, renameSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { chmod, mkdir, mkdtemp, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { FleetError, fileModes, isFleetError, MAX_FILESET_ENTRIES } from "@fleet/contracts";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { loadSuite, loadTask } from "./load-task.ts";
import { EXAMPLE_SUITE_DIR } from "./paths.ts";

// Paths the loader is refused to read, as for a file or directory mode 000 is to a user without
// CAP_DAC_OVERRIDE (these tests may run as root, which reads everything).
const unreadable = vi.hoisted(() => new Set<string>());
/** Files the loader opened to read (`open` calls). */
const reads = vi.hoisted(() => ({ count: 0 }));
/**
 * A file changed under the loader: run (once) just before the loader opens the path, after it
 * has listed and checked it (`before`), or just after it took the opened file's size (`afterStat`).
 */
const changes = vi.hoisted(() => ({
  before: new Map<string, () => void>(),
  afterStat: new Map<string, () => void>(),
}));
vi.mock("node:fs/promises", async (importOriginal) => {
  const real = await importOriginal<typeof import("node:fs/promises")>();
  const refuse = (what: string, p: unknown): void => {
    if (!unreadable.has(String(p))) return;
    throw Object.assign(new Error(`EACCES: permission denied, ${what} '${String(p)}'`), {
      code: "EACCES",
      errno: -13,
      syscall: what,
      path: String(p),
    });
  };
  const runChange = (changes: Map<string, () => void>, p: unknown): void => {
    const change = changes.get(String(p));
    changes.delete(String(p));
    change?.();
  };
  return {
    ...real,
    open: (async (p: string, ...rest: []) => {
      reads.count++;
      refuse("open", p);
      runChange(changes.before, p);
      const handle = await real.open(p, ...rest);
      if (!changes.afterStat.has(String(p))) return handle;
      const stat = handle.stat.bind(handle);
      return Object.assign(handle, {
        stat: async (...args: []) => {
          const st = await stat(...args);
          runChange(changes.afterStat, p);
          return st;
        },
      });
    }) as typeof real.open,
    readFile: (async (p: string, ...rest: []) => {
      runChange(changes.before, p);
      return real.readFile(p, ...rest);
    }) as typeof real.readFile,
    readdir: (async (p: string, ...rest: []) => {
      refuse("scandir", p);
      return real.readdir(p, ...rest);
    }) as typeof real.readdir,
  };
});

const GOOD_TOML = `version = "1.0"

[task]
image = "rollout-fleet/base:latest"

[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 10.0

[metadata]
difficulty = "easy"
`;

let tmp: string;
beforeEach(async () => {
  tmp = await mkdtemp(path.join(tmpdir(), "fleet-tasks-"));
});
afterEach(async () => {
  unreadable.clear();
  changes.before.clear();
  changes.afterStat.clear();
  await rm(tmp, { recursive: true, force: true });
});

/** Write a task directory from a map of relative path → content (null = skip the default). */
async function writeTask(name: string, files: Record<string, string | Buffer | null>): Promise<string> {
  const dir = path.join(tmp, name);
  const all: Record<string, string | Buffer | null> = {
    "task.toml": GOOD_TOML,
    "instruction.md": "Do the thing.\n",
    "tests/test.sh": "exit 0\n",
    "solution/solve.sh": "true\n",
    ...files,
  };
  for (const [rel, content] of Object.entries(all)) {
    if (content === null) continue;
    await mkdir(path.dirname(path.join(dir, rel)), { recursive: true });
    await writeFile(path.join(dir, rel), content);
  }
  return dir;
}

/** Run `fn`, expect a final invalid_task FleetError, and return its message. */
async function invalidTask(fn: () => Promise<unknown>): Promise<string> {
  const err = await fn().then(
    () => null,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(FleetError);
  if (!isFleetError(err)) throw new Error("unreachable");
  expect(err.kind).toBe("invalid_task");
  expect(err.retryable).toBe(false);
  return err.message;
}

describe("the bundled example suite", () => {
  it("has at least 12 tasks that all parse, with unique ids and the base image", async () => {
    const tasks = await loadSuite(EXAMPLE_SUITE_DIR);
    expect(tasks.length).toBeGreaterThanOrEqual(12);
    expect(new Set(tasks.map((t) => t.id)).size).toBe(tasks.length);
    for (const task of tasks) {
      expect(task.image).toBe("rollout-fleet/base:latest");
      expect(task.solution["solve.sh"], `${task.id} has a reference solution`).toBeDefined();
      if (task.verifier.kind === "tests") expect(task.tests["test.sh"], `${task.id} has tests`).toBeDefined();
    }
  });

  it("covers the kinds of task the suite promises", async () => {
    const byId = new Map((await loadSuite(EXAMPLE_SUITE_DIR)).map((t) => [t.id, t]));
    expect(byId.get("long-deadline")?.timeouts.agentS).toBe(200);
    expect(byId.get("sum-answer")?.verifier).toEqual({ kind: "match", expected: "4217", mode: "exact" });
    expect(byId.get("version-answer")?.verifier).toMatchObject({ kind: "match", mode: "regex" });
    expect(byId.get("poem-stats")?.tests["test.sh"]).toContain("/logs/verifier/reward.txt");
    expect(Object.keys(byId.get("python-bugfix")?.tests ?? {})).toContain("test_stats.py");
    expect(Object.keys(byId.get("directory-tree")?.workspace ?? {})).toContain("inbox/cat.png");
  });

  it("stages its scripts at their default modes: only file-permissions' run.sh is not executable", async () => {
    const moded = (await loadSuite(EXAMPLE_SUITE_DIR)).filter((t) => t.modes !== undefined);
    expect(moded.map((t) => [t.id, t.modes])).toEqual([["file-permissions", { "workspace/run.sh": "644" }]]);
  });

  it("loads a single task directory as a suite of one", async () => {
    const tasks = await loadSuite(path.join(EXAMPLE_SUITE_DIR, "hello-file"));
    expect(tasks.map((t) => t.id)).toEqual(["hello-file"]);
  });
});

describe("loadTask", () => {
  it("maps task.toml and the file trees onto TaskContent", async () => {
    const dir = await writeTask("my-task", {
      "workspace/data/input.txt": "1\n2\n",
      "tests/helper.py": "print('hi')\n",
      "tests/__pycache__/helper.cpython-311.pyc": Buffer.from([0, 1, 2, 255]),
    });
    const task = await loadTask(dir);
    expect(task).toEqual({
      id: "my-task",
      instruction: "Do the thing.\n",
      image: "rollout-fleet/base:latest",
      workspace: { "data/input.txt": "1\n2\n" },
      solution: { "solve.sh": "true\n" },
      tests: { "helper.py": "print('hi')\n", "test.sh": "exit 0\n" },
      timeouts: { agentS: 30, verifierS: 10 },
      verifier: { kind: "tests" },
      metadata: { difficulty: "easy" },
    });
  });

  it("takes [task] id over the directory name and Harbor's docker_image for the image", async () => {
    const dir = await writeTask("Weird Name!", {
      "task.toml":
        '[task]\nid = "renamed"\n[environment]\ndocker_image = "img:1"\ncpus = 2\nmemory_mb = 512\n',
    });
    const task = await loadTask(dir);
    expect(task.id).toBe("renamed");
    expect(task.image).toBe("img:1");
    expect(task.timeouts).toEqual({ agentS: 120, verifierS: 60 });
    expect(task.metadata).toEqual({ environment: { cpus: 2, memory_mb: 512 } });
  });

  it("keeps each file's executable bit where staging's default would not give it, and a leading BOM", async () => {
    const dir = await writeTask("moded", {
      "workspace/deploy.sh": "#!/bin/sh\necho deploy\n", // 644 on disk, a script: stays 644
      "workspace/tool": "echo tool\n", // 755 on disk, no #!: stays 755
      "workspace/secret.txt": "s\n", // 600: not executable, as the default gives (644)
      "workspace/bom.txt": Buffer.from("\uFEFFhello\n", "utf8"),
      "tests/test.sh": "#!/bin/bash\nexit 0\n", // 755, a script: the default
      "tests/check.sh": "#!/bin/sh\nexit 0\n", // 644 on disk: tests stage at the default all the same
    });
    await chmod(path.join(dir, "workspace/tool"), 0o755);
    await chmod(path.join(dir, "workspace/secret.txt"), 0o600);
    await chmod(path.join(dir, "tests/test.sh"), 0o755);
    const task = await loadTask(dir);
    expect(task.modes).toEqual({ "workspace/deploy.sh": "644", "workspace/tool": "755" });
    expect(fileModes(task, "workspace")).toEqual({ "deploy.sh": 0o644, tool: 0o755 });
    expect(task.workspace["bom.txt"]).toBe("\uFEFFhello\n");
    // The instruction is text for the agent, not a file it works on: its BOM goes.
    const bomInstruction = await writeTask("bom", {
      "instruction.md": Buffer.from("\uFEFFDo it.\n", "utf8"),
    });
    expect((await loadTask(bomInstruction)).instruction).toBe("Do it.\n");
  });

  it("accepts a match task without tests/", async () => {
    const dir = await writeTask("m", {
      "task.toml": '[task]\nimage = "i"\n[verifier]\nkind = "match"\nexpected = "4\\\\d"\nmode = "regex"\n',
      "tests/test.sh": null,
    });
    expect((await loadTask(dir)).verifier).toEqual({ kind: "match", expected: "4\\d", mode: "regex" });
  });

  it("turns TOML dates into ISO strings in metadata", async () => {
    const dir = await writeTask("d", { "task.toml": `${GOOD_TOML}created = 2024-05-01\n` });
    expect((await loadTask(dir)).metadata).toEqual({ difficulty: "easy", created: "2024-05-01" });
  });
});

describe("broken tasks give invalid_task naming the file", () => {
  it("a __proto__ key in [metadata], at any depth: refused, not dropped", async () => {
    for (const toml of [`${GOOD_TOML}__proto__ = "x"\n`, `${GOOD_TOML}[metadata.env]\n__proto__ = 1\n`]) {
      const dir = await writeTask("proto", { "task.toml": toml });
      expect(await invalidTask(() => loadTask(dir))).toMatch(
        /task\.toml.*__proto__.*"__proto__" key, which JavaScript readers drop/,
      );
    }
  });

  it("[metadata] the dispatcher would refuse in the request: refused here, before any of the suite is sent", async () => {
    // A "constructor.prototype" key: the dispatcher's JSON parser refuses it (400), as it does __proto__.
    const ctor = await writeTask("ctor", {
      "task.toml": `${GOOD_TOML}[metadata.constructor]\nprototype = "x"\n`,
    });
    expect(await invalidTask(() => loadTask(ctor))).toMatch(
      /task\.toml: \[metadata\]\.constructor\.prototype: a "constructor\.prototype" key/,
    );
    // A constructor key alone is fine.
    const plain = await writeTask("ctor-ok", { "task.toml": `${GOOD_TOML}constructor = "x"\n` });
    expect((await loadTask(plain)).metadata).toMatchObject({ constructor: "x" });
    // Nested past the bound (admission would refuse the request at 64 levels, the task inside it).
    const nested = (levels: number) => `${"[".repeat(levels)}1${"]".repeat(levels)}`;
    const ok = await writeTask("deep-ok", { "task.toml": `${GOOD_TOML}deep = ${nested(31)}\n` });
    expect(JSON.stringify((await loadTask(ok)).metadata.deep)).toBe(nested(31));
    const deep = await writeTask("deep", { "task.toml": `${GOOD_TOML}deep = ${nested(70)}\n` });
    expect(await invalidTask(() => loadTask(deep))).toMatch(
      /\[metadata\]\.deep(\[0\])+: nested more than 32 levels deep/,
    );
    // More values than a request may carry, past the bound.
    const many = await writeTask("many", {
      "task.toml": `${GOOD_TOML}many = [${Array.from({ length: 10_001 }, (_, i) => i).join(",")}]\n`,
    });
    expect(await invalidTask(() => loadTask(many))).toMatch(
      /\[metadata\]\.many\[\d+\]: holds more than 10000 values/,
    );
  });

  it("a file named __proto__: refused, not dropped (a plain object's key by that name sets its prototype)", async () => {
    for (const tree of ["workspace", "solution", "tests"]) {
      const dir = await writeTask(`proto-file-${tree}`, { [`${tree}/__proto__`]: "x\n" });
      expect(await invalidTask(() => loadTask(dir))).toContain(
        `${path.join(dir, tree, "__proto__")}: is named "__proto__", which a file set cannot hold`,
      );
    }
    // Below the top of a tree the name is only part of a path: kept.
    const below = await writeTask("proto-below", { "workspace/d/__proto__": "x\n" });
    expect((await loadTask(below)).workspace).toEqual({ "d/__proto__": "x\n" });
  });

  it("a match task with tests/: they would never run", async () => {
    const dir = await writeTask("mt", {
      "task.toml": '[task]\nimage = "i"\n[verifier]\nkind = "match"\nexpected = "42"\n',
    });
    expect(await invalidTask(() => loadTask(dir))).toMatch(
      /tests: are never run for a task graded by matching its answer \(\[verifier\] kind = "match"\)/,
    );
  });

  it("missing instruction.md", async () => {
    const dir = await writeTask("t", { "instruction.md": null });
    expect(await invalidTask(() => loadTask(dir))).toContain(path.join(dir, "instruction.md"));
  });

  it("empty instruction.md", async () => {
    const dir = await writeTask("t", { "instruction.md": "  \n" });
    expect(await invalidTask(() => loadTask(dir))).toMatch(/instruction\.md: is empty/);
    // Zero-width characters (an editor's leftovers) are no instruction either.
    const invisible = await writeTask("t", { "instruction.md": "\u200b\u2060\n\u200d" });
    expect(await invalidTask(() => loadTask(invisible))).toMatch(/instruction\.md: is empty/);
    // Nor are other characters that show nothing (a soft hyphen, a Hangul filler).
    const ignorable = await writeTask("t", { "instruction.md": "\u00ad\n\u3164\n" });
    expect(await invalidTask(() => loadTask(ignorable))).toMatch(/instruction\.md: is empty/);
  });

  it("missing task.toml", async () => {
    const dir = await writeTask("t", { "task.toml": null });
    expect(await invalidTask(() => loadTask(dir))).toContain(`${path.join(dir, "task.toml")}: missing`);
  });

  it("not a directory at all", async () => {
    expect(await invalidTask(() => loadTask(path.join(tmp, "nope")))).toContain("not a task directory");
  });

  it("bad TOML, with line and column", async () => {
    const dir = await writeTask("t", { "task.toml": '[task]\nimage = "x"\n[agent\ntimeout_sec = 1\n' });
    const message = await invalidTask(() => loadTask(dir));
    expect(message).toContain(path.join(dir, "task.toml"));
    expect(message).toMatch(/invalid TOML at line 3, column \d+/);
  });

  it("an unknown key, named with its table", async () => {
    const dir = await writeTask("t", {
      "task.toml": `${GOOD_TOML.replace("[agent]", "[agent]\ntimout_sec = 5")}`,
    });
    const message = await invalidTask(() => loadTask(dir));
    expect(message).toContain(path.join(dir, "task.toml"));
    expect(message).toContain('unknown key "timout_sec" in [agent]');
  });

  it("an unknown table", async () => {
    const dir = await writeTask("t", { "task.toml": `${GOOD_TOML}[solution]\nenv = { A = "1" }\n` });
    expect(await invalidTask(() => loadTask(dir))).toContain('unknown key "solution" at the top level');
  });

  it("a wrongly typed value", async () => {
    const dir = await writeTask("t", { "task.toml": '[task]\nimage = "x"\n[agent]\ntimeout_sec = "soon"\n' });
    expect(await invalidTask(() => loadTask(dir))).toMatch(/\[agent\] timeout_sec: /);
  });

  it("a non-finite or non-positive timeout", async () => {
    const inf = await writeTask("inf", { "task.toml": '[task]\nimage = "x"\n[agent]\ntimeout_sec = inf\n' });
    expect(await invalidTask(() => loadTask(inf))).toContain("[agent] timeout_sec: must be finite");
    const neg = await writeTask("neg", {
      "task.toml": '[task]\nimage = "x"\n[verifier]\ntimeout_sec = -1\n',
    });
    expect(await invalidTask(() => loadTask(neg))).toContain("[verifier] timeout_sec: must be positive");
  });

  it("no image", async () => {
    const dir = await writeTask("t", { "task.toml": "[agent]\ntimeout_sec = 5\n" });
    expect(await invalidTask(() => loadTask(dir))).toContain("[task] image is required");
  });

  it("conflicting image and docker_image", async () => {
    const dir = await writeTask("t", {
      "task.toml": '[task]\nimage = "a"\n[environment]\ndocker_image = "b"\n',
    });
    expect(await invalidTask(() => loadTask(dir))).toContain("differ");
  });

  it("allow_internet = true", async () => {
    const dir = await writeTask("t", {
      "task.toml": '[task]\nimage = "a"\n[environment]\nallow_internet = true\n',
    });
    expect(await invalidTask(() => loadTask(dir))).toContain("sandboxes have no network");
  });

  it("a tests task without tests/test.sh", async () => {
    const dir = await writeTask("t", { "tests/test.sh": null, "tests/other.py": "x\n" });
    expect(await invalidTask(() => loadTask(dir))).toContain(path.join(dir, "tests", "test.sh"));
  });

  it("a tests/test.sh that runs nothing (empty, blank or comments only): every agent would pass", async () => {
    for (const script of ["", "\n  \n", "#!/bin/bash\n# TODO: write the tests\n"]) {
      const dir = await writeTask(`t${script.length}`, { "tests/test.sh": script });
      expect(await invalidTask(() => loadTask(dir))).toMatch(/test\.sh.*runs nothing/);
    }
    const real = await writeTask("real", { "tests/test.sh": "#!/bin/bash\n# checks\ntest -f out.txt\n" });
    expect((await loadTask(real)).tests["test.sh"]).toContain("test -f");
  });

  it("a solution without solve.sh", async () => {
    const dir = await writeTask("t", { "solution/solve.sh": null, "solution/fix.py": "x\n" });
    expect(await invalidTask(() => loadTask(dir))).toContain(path.join(dir, "solution", "solve.sh"));
  });

  it("a match task without expected, or with a bad regex", async () => {
    const noExpected = await writeTask("a", {
      "task.toml": '[task]\nimage = "i"\n[verifier]\nkind = "match"\n',
    });
    expect(await invalidTask(() => loadTask(noExpected))).toContain("[verifier] expected is required");
    const badRegex = await writeTask("b", {
      "task.toml":
        '[task]\nimage = "i"\n[verifier]\nkind = "match"\nexpected = "(unclosed"\nmode = "regex"\n',
    });
    expect(await invalidTask(() => loadTask(badRegex))).toContain("not a valid regular expression");
  });

  it("a match task whose expected is blank, or a regex an empty answer matches: an agent that prints nothing would pass", async () => {
    const cases = [
      ['expected = ""', /\[verifier\] expected: is blank/],
      ['expected = """\n  \n"""', /\[verifier\] expected: is blank/],
      ["expected = '  '\nmode = \"regex\"", /\[verifier\] expected: is blank/],
      ["expected = '\\d*'\nmode = \"regex\"", /\[verifier\] expected: matches an empty answer/],
      ["expected = '(yes)?'\nmode = \"regex\"", /\[verifier\] expected: matches an empty answer/],
    ] as const;
    for (const [i, [line, why]] of cases.entries()) {
      const dir = await writeTask(`t${i}`, {
        "task.toml": `[task]\nimage = "i"\n[verifier]\nkind = "match"\n${line}\n`,
        "tests/test.sh": null,
      });
      const message = await invalidTask(() => loadTask(dir));
      expect(message, line).toContain(path.join(dir, "task.toml"));
      expect(message, line).toMatch(why);
    }
  });

  it("a regex refused as the grader compiles it (trimmed, anchored), not only as written", async () => {
    // `2\.10\.0\ ` compiles as written; trimmed for grading it ends in a lone backslash.
    const dir = await writeTask("t", {
      "task.toml":
        '[task]\nimage = "i"\n[verifier]\nkind = "match"\nexpected = \'2\\.10\\.0\\ \'\nmode = "regex"\n',
      "tests/test.sh": null,
    });
    const message = await invalidTask(() => loadTask(dir));
    expect(message).toContain("[verifier] expected: is not a valid regular expression");
    expect(message).toContain("/^(?:2\\.10\\.0\\)$/");
  });

  it("expected on a tests task", async () => {
    const dir = await writeTask("t", { "task.toml": '[task]\nimage = "i"\n[verifier]\nexpected = "1"\n' });
    expect(await invalidTask(() => loadTask(dir))).toContain('only apply to kind = "match"');
  });

  it("a directory name that is not a valid id", async () => {
    const dir = await writeTask("bad name", {});
    expect(await invalidTask(() => loadTask(dir))).toContain(
      'directory name "bad name" is not a valid task id',
    );
    // Only allowed characters, but not a letter or digit first: the message names that rule.
    const draft = await writeTask("_draft", {});
    expect(await invalidTask(() => loadTask(draft))).toContain(
      `the directory name "_draft" is not a valid task id (must start with a letter or digit, then only letters, digits, '.', '_' or '-'); set [task] id`,
    );
  });

  it("a solve.sh with CRLF line endings, named as the file, not as a key of task.toml", async () => {
    const dir = await writeTask("t", { "solution/solve.sh": "#!/bin/bash\r\ntrue\r\n" });
    expect(await invalidTask(() => loadTask(dir))).toBe(
      `${dir}: solution/solve.sh: has Windows (CRLF) line endings, which bash cannot run: convert it (dos2unix)`,
    );
  });

  it("a file nested too deep says why (its name's own rule), not zod's \"Invalid key in record\"", async () => {
    const deep = `${Array.from({ length: 33 }, (_, i) => `d${i}`).join("/")}/f.txt`;
    const dir = await writeTask("t", { [`workspace/${deep}`]: "x\n" });
    const message = await invalidTask(() => loadTask(dir));
    expect(message).toContain(`workspace/${deep}: must be nested in at most 32 directories`);
    expect(message).not.toMatch(/Invalid key/);
  });

  it("a task directory named through a symbolic link loads (the link is the suite the user gave); links inside it do not", async () => {
    const dir = await writeTask("t", {});
    const link = path.join(tmp, "link-to-t");
    await symlink(dir, link);
    expect((await loadSuite(link)).map((t) => t.id)).toEqual(["t"]);
    await symlink("/etc/passwd", path.join(dir, "tests", "passwd"));
    expect(await invalidTask(() => loadTask(link))).toContain("is a symbolic link");
  });

  it("a binary file", async () => {
    const dir = await writeTask("t", { "workspace/blob.bin": Buffer.from([0xff, 0xfe, 0x00, 0x80]) });
    expect(await invalidTask(() => loadTask(dir))).toContain(
      `${path.join(dir, "workspace", "blob.bin")}: is not UTF-8`,
    );
  });

  it("a symbolic link", async () => {
    const dir = await writeTask("t", {});
    await symlink("/etc/passwd", path.join(dir, "tests", "passwd"));
    expect(await invalidTask(() => loadTask(dir))).toContain(
      `${path.join(dir, "tests", "passwd")}: is a symbolic link`,
    );
  });

  it("a file swapped for a symbolic link after it was listed: refused, its target never read", async () => {
    const dir = await writeTask("t", { "tests/data.txt": "plain\n" });
    const secret = path.join(tmp, "secret.txt");
    await writeFile(secret, "host secret\n");
    const file = path.join(dir, "tests", "data.txt");
    // Synchronous: the change lands between the loader's check and its read.
    changes.before.set(file, () => {
      rmSync(file);
      symlinkSync(secret, file);
    });
    const message = await invalidTask(() => loadTask(dir));
    expect(message).toContain(`${file}: is a symbolic link`);
    expect(message).not.toContain("host secret");
    expect(changes.before.size).toBe(0);
  });

  it("a directory swapped for a symbolic link after it was listed: refused, its target's files never read", async () => {
    const dir = await writeTask("t", { "tests/a.txt": "first\n", "tests/b/x.txt": "plain\n" });
    const outside = path.join(tmp, "outside");
    mkdirSync(outside);
    writeFileSync(path.join(outside, "x.txt"), "host secret\n");
    const sub = path.join(dir, "tests", "b");
    // Listed as a directory; swapped for a link as the loader reads the file before it (a.txt).
    changes.before.set(path.join(dir, "tests", "a.txt"), () => {
      rmSync(sub, { recursive: true });
      symlinkSync(outside, sub);
    });
    const err = await loadTask(dir).then(
      (task) => task.tests,
      (e: unknown) => e,
    );
    expect(changes.before.size).toBe(0);
    expect(JSON.stringify(err)).not.toContain("host secret");
    expect(isFleetError(err) && err.kind).toBe("invalid_task");
    expect((err as Error).message).toContain(
      `${path.join(sub, "x.txt")}: is not where the walk found it as it was opened`,
    );
  });

  it("a file replaced (an editor's save: written aside, renamed over it) after it was opened: read as opened, not refused as reached through a symbolic link", async () => {
    const dir = await writeTask("t", { "tests/a.txt": "as opened\n" });
    const file = path.join(dir, "tests", "a.txt");
    // Linux names the opened file, its name gone, `<path> (deleted)`: still the path the walk spelled.
    changes.afterStat.set(file, () => {
      writeFileSync(`${file}.swp`, "saved since\n");
      renameSync(`${file}.swp`, file);
    });
    const task = await loadTask(dir);
    expect(changes.afterStat.size).toBe(0);
    expect(task.tests["a.txt"]).toBe("as opened\n");
  });

  it("a file swapped for a FIFO after it was listed: refused at once, not waited on for a writer", async () => {
    const dir = await writeTask("t", {});
    const file = path.join(dir, "instruction.md");
    changes.before.set(file, () => {
      rmSync(file);
      execFileSync("mkfifo", [file]);
    });
    expect(await invalidTask(() => loadTask(dir))).toContain(`${file}: is not a regular file`);
    expect(changes.before.size).toBe(0);
  });

  it("a suite whose unasked-for task has a FIFO for its task.toml loads the task asked for, not waiting on the FIFO", async () => {
    await writeTask("a", {});
    const fifo = path.join(await writeTask("b", { "task.toml": null }), "task.toml");
    execFileSync("mkfifo", [fifo]);
    // Its id is looked for in its task.toml (it might be the one asked for): refused, not opened for a writer.
    expect((await loadSuite(tmp, { only: ["a"] })).map((t) => t.id)).toEqual(["a"]);
    expect(await invalidTask(() => loadSuite(tmp))).toContain(`${fifo}: is not a regular file`);
  });

  it("a file that grows past the size counted against the limit while it is read: refused", async () => {
    const dir = await writeTask("t", { "workspace/log.txt": "short\n" });
    const file = path.join(dir, "workspace", "log.txt");
    changes.afterStat.set(file, () => appendFileSync(file, "x".repeat(100_000)));
    expect(await invalidTask(() => loadTask(dir, { maxBytes: 10_000 }))).toContain(
      `${file}: changed while it was read`,
    );
    expect(changes.afterStat.size).toBe(0);
  });

  it("a file set that is a symbolic link to a directory, named as a link", async () => {
    const dir = await writeTask("t", {});
    const real = path.join(tmp, "real-tests");
    await mkdir(real);
    await writeFile(path.join(real, "test.sh"), "exit 0\n");
    await rm(path.join(dir, "tests"), { recursive: true, force: true });
    await symlink(real, path.join(dir, "tests"));
    expect(await invalidTask(() => loadTask(dir))).toContain(
      `${path.join(dir, "tests")}: is a symbolic link`,
    );
  });

  it("a file whose name is not UTF-8, named as such (not as one that vanished)", async () => {
    const dir = await writeTask("t", {});
    await mkdir(path.join(dir, "workspace"), { recursive: true });
    // (Synchronous `node:fs`: this file's mock of `node:fs/promises` takes paths as strings.)
    writeFileSync(
      Buffer.concat([
        Buffer.from(`${path.join(dir, "workspace")}/`),
        Buffer.from([0xff, 0xfe]),
        Buffer.from(".txt"),
      ]),
      "x\n",
    );
    expect(await invalidTask(() => loadTask(dir))).toContain("has a name that is not UTF-8");
  });

  it("a directory whose name is not UTF-8, named as such: in a file set, and as a suite's task", async () => {
    const notUtf8 = (parent: string) =>
      Buffer.concat([Buffer.from(`${parent}/caf`), Buffer.from([0xe9]), Buffer.from("/")]);
    const dir = await writeTask("t", {});
    mkdirSync(notUtf8(path.join(dir, "workspace")), { recursive: true });
    writeFileSync(Buffer.concat([notUtf8(path.join(dir, "workspace")), Buffer.from("a.txt")]), "x\n");
    expect(await invalidTask(() => loadTask(dir))).toMatch(
      /workspace\/caf\uFFFD: has a name that is not UTF-8/,
    );
    await rm(dir, { recursive: true, force: true });
    // A task directory that holds a task.toml, under a name that is not UTF-8 (not "no task.toml").
    mkdirSync(notUtf8(tmp));
    writeFileSync(Buffer.concat([notUtf8(tmp), Buffer.from("task.toml")]), GOOD_TOML);
    expect(await invalidTask(() => loadSuite(tmp))).toMatch(/caf\uFFFD: has a name that is not UTF-8/);
  });

  it("a task.toml spelled in another case: missing, and says what was found", async () => {
    const dir = await writeTask("t", { "task.toml": null, "Task.toml": GOOD_TOML });
    expect(await invalidTask(() => loadTask(dir))).toContain(
      `${path.join(dir, "task.toml")}: missing (found "Task.toml"; the name must be exactly task.toml)`,
    );
  });

  it("a file or directory that cannot be read: invalid_task naming it, not a raw EACCES", async () => {
    const file = await writeTask("file", {});
    unreadable.add(path.join(file, "instruction.md"));
    expect(await invalidTask(() => loadTask(file))).toContain(
      `${path.join(file, "instruction.md")}: cannot be read (EACCES: permission denied)`,
    );
    const tree = await writeTask("tree", { "workspace/data/input.txt": "1\n" });
    unreadable.add(path.join(tree, "workspace", "data"));
    expect(await invalidTask(() => loadTask(tree))).toContain(
      `${path.join(tree, "workspace", "data")}: cannot be read (EACCES: permission denied)`,
    );
  });

  it("a task over the size limit", async () => {
    const dir = await writeTask("t", { "workspace/big.txt": "x".repeat(5000) });
    expect(await invalidTask(() => loadTask(dir, { maxBytes: 4096 }))).toContain(
      "task is over the limit of 4096 bytes (its files, as read)",
    );
    await expect(loadTask(dir, { maxBytes: 10_000 })).resolves.toBeDefined();
  });

  it("a file set of more files than a task may hold is refused once it has that many, not after reading them all", async () => {
    // Empty files take none of the size budget: a tree of a million of them was read whole
    // (minutes, and each file held in memory) before the schema refused the task.
    const dir = await writeTask("t", {});
    await mkdir(path.join(dir, "workspace", "many"), { recursive: true });
    const files = MAX_FILESET_ENTRIES + 1000;
    for (let i = 0; i < files; i++) writeFileSync(path.join(dir, "workspace", "many", `f${i}`), "");
    reads.count = 0;
    expect(await invalidTask(() => loadTask(dir))).toContain(
      `workspace: holds more than ${MAX_FILESET_ENTRIES} files`,
    );
    expect(reads.count).toBeLessThanOrEqual(MAX_FILESET_ENTRIES + 2);
  }, 60_000);

  it("a file set whose files and directories are more than a task may hold is refused as they are walked, not after reading its files", async () => {
    // 6,000 directories of one empty file each: fewer files than the limit, but twice as many
    // tar entries. Each directory is counted as it is walked (the schema counts them alike).
    const dir = await writeTask("t", {});
    const dirs = MAX_FILESET_ENTRIES * 0.6;
    for (let i = 0; i < dirs; i++) {
      mkdirSync(path.join(dir, "workspace", `d${i}`), { recursive: true });
      writeFileSync(path.join(dir, "workspace", `d${i}`, "f"), "");
    }
    reads.count = 0;
    expect(await invalidTask(() => loadTask(dir))).toContain(
      `workspace: holds more than ${MAX_FILESET_ENTRIES} files and directories`,
    );
    expect(reads.count).toBeLessThanOrEqual(MAX_FILESET_ENTRIES / 2 + 2);
  }, 60_000);

  it("a .git in a file tree (a repository the task gives the agent): refused, not dropped; a task's own .git, or a suite's, is not read", async () => {
    // Staged without it, workspace/repo would be files and no repository: every agent told to
    // work in it (git diff, git log) fails.
    const repo = await writeTask("repo", {
      "workspace/repo/README.md": "hi\n",
      "workspace/repo/.git/HEAD": "ref: refs/heads/main\n",
      "workspace/repo/.git/objects/ab/cdef": Buffer.from([0x78, 0x9c, 0xff]),
    });
    const message = await invalidTask(() => loadTask(repo));
    expect(message).toContain(`${path.join(repo, "workspace", "repo", ".git")}: is a git repository's data`);
    expect(message).toMatch(/build the repository into the task's image, or remove \.git$/);
    // A submodule's .git is a file pointing elsewhere: no repository either.
    const submodule = await writeTask("submodule", {
      "workspace/.git": "gitdir: ../../.git/modules/x\n",
      "workspace/a.txt": "a\n",
    });
    expect(await invalidTask(() => loadTask(submodule))).toContain(
      `${path.join(submodule, "workspace", ".git")}: is a git repository's data`,
    );
    // The tasks' own checkout: a suite's .git, and one in a task directory beside its trees.
    const suite = path.join(tmp, "suite");
    await writeTask("suite/one", {
      ".git/HEAD": "ref: refs/heads/main\n",
      ".git/index": Buffer.from([0xff]),
    });
    await mkdir(path.join(suite, ".git", "objects"), { recursive: true });
    await writeFile(path.join(suite, ".git", "HEAD"), "ref: refs/heads/main\n");
    expect((await loadSuite(suite)).map((t) => t.id)).toEqual(["one"]);
    expect((await loadTask(path.join(suite, "one"))).workspace).toEqual({});
    // Other git files are files like any other.
    const ignore = await writeTask("ignore", {
      "workspace/.gitignore": "*.o\n",
      "workspace/out/.gitkeep": "",
    });
    expect((await loadTask(ignore)).workspace).toEqual({ ".gitignore": "*.o\n", "out/.gitkeep": "" });
  });

  it("a directory with no file in it (empty, or only tool litter): refused, not dropped; an empty file tree is fine", async () => {
    // A file set holds files only: the directory would be missing in the sandbox.
    const empty = await writeTask("empty", { "workspace/data/in.txt": "1\n" });
    await mkdir(path.join(empty, "workspace", "out"));
    expect(await invalidTask(() => loadTask(empty))).toBe(
      `${path.join(empty, "workspace", "out")}: holds no file a task carries (it is empty, or holds only skipped tool litter such as __pycache__ or .DS_Store), and a file set cannot carry an empty directory: keep a placeholder file in it (such as .gitkeep), or remove it`,
    );
    // Nested: the innermost is named.
    const nested = await writeTask("nested", {});
    await mkdir(path.join(nested, "tests", "a", "b"), { recursive: true });
    expect(await invalidTask(() => loadTask(nested))).toMatch(
      new RegExp(
        `^${path.join(nested, "tests", "a", "b").replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}: holds no file`,
      ),
    );
    const litter = await writeTask("litter", { "workspace/build/.DS_Store": "x" });
    expect(await invalidTask(() => loadTask(litter))).toContain(
      `${path.join(litter, "workspace", "build")}: holds no file`,
    );
    // A tree that is empty itself is a set of no files.
    const bare = await writeTask("bare", {});
    await mkdir(path.join(bare, "workspace"));
    expect((await loadTask(bare)).workspace).toEqual({});
  });

  it("a task under the limit on disk but over it as sent (escaped characters take several bytes), as the dispatcher counts", async () => {
    const dir = await writeTask("t", { "workspace/ctl.txt": "\u0001".repeat(3000) });
    expect(await invalidTask(() => loadTask(dir, { maxBytes: 10_000 }))).toMatch(
      /task is \d+ bytes as sent .* over the limit of 10000/,
    );
    await expect(loadTask(dir, { maxBytes: 40_000 })).resolves.toBeDefined();
  });
});

describe("loadSuite", () => {
  it("a suite path that does not exist, or is a file, says which", async () => {
    expect(await invalidTask(() => loadSuite(path.join(tmp, "nope")))).toContain(
      "cannot read suite directory (no such directory)",
    );
    const file = path.join(tmp, "a-file");
    await writeFile(file, "x");
    expect(await invalidTask(() => loadSuite(file))).toContain(
      "cannot read suite directory (not a directory",
    );
  });

  it("with the tasks asked for (--task), a broken task not among them does not refuse the suite; one among them does", async () => {
    await writeTask("good", {});
    await writeTask("other", {});
    await writeTask("no-instruction", { "instruction.md": null });
    await mkdir(path.join(tmp, "stray"));
    expect((await loadSuite(tmp, { only: ["good"] })).map((t) => t.id)).toEqual(["good", "other"]);
    const message = await invalidTask(() => loadSuite(tmp, { only: ["good", "no-instruction"] }));
    expect(message).toContain("1 broken task(s)");
    expect(message).toContain(path.join(tmp, "no-instruction", "instruction.md"));
    expect(await invalidTask(() => loadSuite(tmp, { only: [] }))).toContain("2 broken task(s)");
  });

  it("a broken task asked for by the [task] id its task.toml declares (not its directory's name) refuses the suite", async () => {
    await writeTask("good", {});
    await writeTask("dir-name", {
      "task.toml": GOOD_TOML.replace("[task]\n", '[task]\nid = "declared"\n'),
      "instruction.md": null,
    });
    const message = await invalidTask(() => loadSuite(tmp, { only: ["declared"] }));
    expect(message).toContain("1 broken task(s)");
    expect(message).toContain(path.join(tmp, "dir-name", "instruction.md"));
    // Asked for another task, it is still left out.
    expect((await loadSuite(tmp, { only: ["good"] })).map((t) => t.id)).toEqual(["good"]);
  });

  it("reports every broken task at once, and skips . and _ directories", async () => {
    await writeTask("good", {});
    await writeTask("no-instruction", { "instruction.md": null });
    await writeTask("bad-toml", { "task.toml": "[[[" });
    await mkdir(path.join(tmp, "stray"));
    await mkdir(path.join(tmp, "_drafts"));
    await mkdir(path.join(tmp, ".hidden"));
    const message = await invalidTask(() => loadSuite(tmp));
    expect(message).toContain("3 broken task(s)");
    expect(message).toContain(path.join(tmp, "no-instruction", "instruction.md"));
    expect(message).toContain(path.join(tmp, "bad-toml", "task.toml"));
    expect(message).toContain(`${path.join(tmp, "stray")}: not a task directory`);
    expect(message).not.toContain("_drafts");
  });

  it("a task directory without its task.toml names the missing task.toml, not its sub-directories", async () => {
    const dir = await writeTask("t", { "task.toml": null, "workspace/a.txt": "a\n" });
    const message = await invalidTask(() => loadSuite(dir));
    expect(message).toContain(`${path.join(dir, "task.toml")}: missing (every task needs a task.toml)`);
    expect(message).not.toContain("not a task directory");
    const misnamed = await writeTask("u", { "task.toml": null, "Task.toml": GOOD_TOML });
    expect(await invalidTask(() => loadSuite(misnamed))).toContain(
      `${path.join(misnamed, "task.toml")}: missing (found "Task.toml"`,
    );
  });

  it("a suite's task without its task.toml is named as such, a stray directory as no task", async () => {
    await writeTask("good", {});
    await writeTask("misnamed", { "task.toml": null, "TASK.TOML": GOOD_TOML });
    await writeTask("no-toml", { "task.toml": null });
    await mkdir(path.join(tmp, "stray"));
    const message = await invalidTask(() => loadSuite(tmp));
    expect(message).toContain("3 broken task(s)");
    expect(message).toContain(`${path.join(tmp, "misnamed", "task.toml")}: missing (found "TASK.TOML"`);
    expect(message).toContain(`${path.join(tmp, "no-toml", "task.toml")}: missing (every task needs`);
    expect(message).toContain(
      `${path.join(tmp, "stray")}: not a task directory (no task.toml; start its name with _ or . to keep it in the suite unloaded)`,
    );
  });

  it("a suite's task graded by its tests without tests/test.sh is one of its broken tasks, named", async () => {
    await writeTask("good", {});
    const bad = await writeTask("no-tests", { "tests/test.sh": null, "tests/check.py": "x\n" });
    const message = await invalidTask(() => loadSuite(tmp));
    expect(message).toContain("1 broken task(s)");
    expect(message).toContain(
      `${path.join(bad, "tests", "test.sh")}: missing (a [verifier] kind = "tests" task runs tests/test.sh)`,
    );
  });

  it("a suite's unreadable task file is one of its broken tasks, named", async () => {
    await writeTask("good", {});
    const bad = await writeTask("bad", {});
    unreadable.add(path.join(bad, "tests", "test.sh"));
    const message = await invalidTask(() => loadSuite(tmp));
    expect(message).toContain("1 broken task(s)");
    expect(message).toContain(
      `${path.join(bad, "tests", "test.sh")}: cannot be read (EACCES: permission denied)`,
    );
  });

  it("reports a symlinked task directory instead of skipping it", async () => {
    await writeTask("a-task", {});
    const elsewhere = await mkdtemp(path.join(tmpdir(), "elsewhere-"));
    try {
      await symlink(elsewhere, path.join(tmp, "linked"));
      const message = await invalidTask(() => loadSuite(tmp));
      expect(message).toContain(`${path.join(tmp, "linked")}: is a symlink`);
    } finally {
      await rm(elsewhere, { recursive: true, force: true });
    }
  });

  it("ignores a symlink to a file in the suite's root (a README kept elsewhere), as it does a file; a broken one is refused", async () => {
    await writeTask("a-task", {});
    const elsewhere = await mkdtemp(path.join(tmpdir(), "elsewhere-"));
    try {
      await writeFile(path.join(elsewhere, "README.md"), "# the suite\n");
      await symlink(path.join(elsewhere, "README.md"), path.join(tmp, "README.md"));
      expect((await loadSuite(tmp)).map((t) => t.id)).toEqual(["a-task"]);
      await symlink(path.join(elsewhere, "gone"), path.join(tmp, "dangling"));
      expect(await invalidTask(() => loadSuite(tmp))).toContain(
        `${path.join(tmp, "dangling")}: is a symlink`,
      );
    } finally {
      await rm(elsewhere, { recursive: true, force: true });
    }
  });

  it("refuses duplicate ids", async () => {
    await writeTask("a", { "task.toml": '[task]\nid = "same"\nimage = "i"\n' });
    await writeTask("b", { "task.toml": '[task]\nid = "same"\nimage = "i"\n' });
    expect(await invalidTask(() => loadSuite(tmp))).toContain('task id "same" is used twice (a, b)');
  });

  it("with the tasks asked for (--task), duplicate ids refuse the suite only when that id is asked for", async () => {
    await writeTask("a", { "task.toml": '[task]\nid = "same"\nimage = "i"\n' });
    await writeTask("b", { "task.toml": '[task]\nid = "same"\nimage = "i"\n' });
    await writeTask("good", {});
    // Two other tasks sharing an id are no reason to refuse the one asked for (as a broken task
    // not asked for is none).
    expect((await loadSuite(tmp, { only: ["good"] })).map((t) => t.id)).toContain("good");
    expect(await invalidTask(() => loadSuite(tmp, { only: ["same"] }))).toContain(
      'task id "same" is used twice (a, b)',
    );
  });

  it("refuses an empty suite", async () => {
    expect(await invalidTask(() => loadSuite(tmp))).toContain("no tasks found");
  });

  it("returns tasks in directory-name order", async () => {
    await writeTask("zeta", {});
    await writeTask("alpha", {});
    expect((await loadSuite(tmp)).map((t) => t.id)).toEqual(["alpha", "zeta"]);
  });
});
