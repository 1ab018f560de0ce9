import fc from "fast-check";
import { describe, expect, it } from "vitest";
import type { z } from "zod";
import { AgentSpec, looksLikeCredential } from "./agent.ts";
import {
  capText,
  decodeUtf8,
  fitRecord,
  MAX_DURATION_S,
  MAX_FIELD_CHARS,
  MAX_RECORD_BYTES,
  wholeSlice,
} from "./bounded.ts";
import { classifyFailure, FailureKind, FailureRecord, Usage } from "./failure.ts";
import { leafIssues } from "./issues.ts";
import {
  CloseReceipt,
  parseStageJob,
  RolloutRequest,
  RolloutResult,
  RunReceipt,
  SeedReceipt,
  StageJob,
  VerifyReceipt,
} from "./rollout.ts";
import { CleanupReceipt, ExecResult, ProbeReport, SandboxHandle, SandboxSpec } from "./sandbox.ts";
import {
  comparableAnswer,
  fileModes,
  imageReferenceProblem,
  isBlank,
  matchExpectedProblem,
  matchPattern,
  TaskContent,
  WellFormedText,
} from "./task.ts";

const id = fc.stringMatching(/^[A-Za-z0-9][A-Za-z0-9._-]{0,20}$/);
const rid = fc.stringMatching(/^[A-Za-z0-9_-]{1,30}$/);
const text = fc.string({ maxLength: 50 });
const relPath = fc.stringMatching(/^[a-z]{1,8}(\/[a-z]{1,8}){0,2}\.(sh|py|txt)$/);
const files = fc.dictionary(relPath, text, { maxKeys: 3 });
const secs = fc.double({ min: 1, max: MAX_DURATION_S, noNaN: true });
const nat = fc.nat({ max: 1e12 });
/** No number JSON cannot hold exactly as an integer (refused in metadata: see the test below). */
const exact = (v: unknown): boolean =>
  typeof v === "number"
    ? !Number.isInteger(v) || Number.isSafeInteger(v) || Math.abs(v) >= 1e21
    : v === null || typeof v !== "object" || Object.values(v).every(exact);
/**
 * No own `__proto__` key at any depth: metadata refuses one on purpose (tested below), and
 * fast-check's strings make one now and then (about 1 run of 50 of 150 values each), which failed
 * a round trip at random.
 */
const noProtoKey = (v: unknown): boolean =>
  v === null ||
  typeof v !== "object" ||
  (!Object.hasOwn(v, "__proto__") && Object.values(v).every(noProtoKey));
const json = fc
  .dictionary(fc.string({ minLength: 1, maxLength: 8 }), fc.jsonValue({ maxDepth: 2 }), { maxKeys: 3 })
  .filter(exact)
  .filter(noProtoKey);

const task = fc
  .record({
    id,
    instruction: text.filter((s) => !isBlank(s)),
    image: fc.constantFrom("rollout-fleet/base:latest", "img:1"),
    workspace: files,
    solution: files,
    tests: files,
    timeouts: fc.record({ agentS: secs, verifierS: secs }),
    verifier: fc.oneof(
      fc.constant({ kind: "tests" as const }),
      fc
        .record({
          kind: fc.constant("match" as const),
          expected: text,
          mode: fc.constantFrom("exact" as const, "regex" as const),
        })
        .filter((spec) => matchExpectedProblem(spec) === undefined),
    ),
    metadata: json,
  })
  // Graded by its tests: it needs a tests/test.sh that runs something; by a match: no tests.
  .map((t) =>
    t.verifier.kind === "tests" ? { ...t, tests: { ...t.tests, "test.sh": "exit 0" } } : { ...t, tests: {} },
  );
/** What a process can take as an argument or environment value: no NUL byte. */
const argText = text.filter((s) => !s.includes("\0"));
const agent = fc.oneof(
  fc.record({
    harness: fc.constant("oracle" as const),
    sandbox: fc.constantFrom("borrow" as const, "own" as const),
  }),
  fc.record({
    harness: fc.constant("command" as const),
    sandbox: fc.constant("borrow" as const),
    argv: fc.array(argText, { minLength: 1, maxLength: 3 }),
    env: fc.dictionary(
      fc.stringMatching(/^[A-Z_][A-Z0-9_]{0,8}$/).filter((name) => !looksLikeCredential(name)),
      argText,
      { maxKeys: 2 },
    ),
  }),
  fc.record({
    harness: fc.constant("tool-loop" as const),
    sandbox: fc.constant("borrow" as const),
    model: fc.record({
      baseUrl: fc.constant("http://127.0.0.1:8000/v1"),
      name: text.filter((s) => s.trim().length > 0),
    }),
    credential: fc.stringMatching(/^[a-z]{1,10}$/),
    maxSteps: fc.integer({ min: 1, max: 100 }),
    toolTimeoutS: secs,
  }),
);
const exec = fc.record({
  exitCode: fc.integer({ min: -2, max: 255 }),
  timedOut: fc.boolean(),
  stdout: text,
  stderr: text,
  stdoutTruncated: fc.boolean(),
  stderrTruncated: fc.boolean(),
  durationMs: nat,
  oomKilled: fc.boolean(),
});
const cleanup = fc.record({
  confirmed: fc.boolean(),
  scope: fc.constantFrom("processes" as const, "sandbox" as const),
  at: nat,
  alreadyGone: fc.boolean(),
  remaining: fc.nat({ max: 10 }),
});
const handle = fc.record({
  provider: fc.constant("docker" as const),
  endpoint: text,
  id: rid,
  name: rid,
  rolloutId: rid,
  owner: fc.constantFrom("resources" as const, "agent" as const),
  volumes: fc.array(rid, { maxLength: 2 }),
});
const usage = fc.record({
  calls: fc.nat({ max: 100 }),
  promptTokens: fc.option(fc.nat(), { nil: null }),
  completionTokens: fc.option(fc.nat(), { nil: null }),
  cachedTokens: fc.option(fc.nat(), { nil: null }),
  gaps: fc.array(text, { maxLength: 2 }),
});
const failure = fc.record({
  stage: fc.constantFrom(
    "admission" as const,
    "seed" as const,
    "run" as const,
    "verify" as const,
    "close" as const,
  ),
  terminal: fc.boolean(),
  failureKind: fc.constantFrom(...FailureKind.options),
  mask: fc.boolean(),
  reason: text,
  at: nat,
});
const nullableMs = fc.option(nat, { nil: null });
const result = fc.record({
  id: rid,
  batchId: fc.option(rid, { nil: null }),
  taskId: id,
  taskDigest: fc.stringMatching(/^[0-9a-f]{64}$/),
  agent: text,
  status: fc.constantFrom("completed" as const, "masked" as const, "failed" as const, "cancelled" as const),
  reward: fc.option(fc.double({ min: 0, max: 1, noNaN: true }), { nil: null }),
  mask: fc.boolean(),
  failureKind: fc.option(fc.constantFrom(...FailureKind.options), { nil: null }),
  stage: fc.constantFrom("seed" as const, "close" as const),
  reason: fc.option(text, { nil: null }),
  teardown: fc.option(fc.constantFrom("confirmed" as const, "pending" as const), { nil: null }),
  exitCode: fc.option(fc.integer({ min: -2, max: 255 }), { nil: null }),
  usage: fc.option(usage, { nil: null }),
  timings: fc.record({
    queuedMs: nullableMs,
    seedMs: nullableMs,
    runMs: nullableMs,
    verifyMs: nullableMs,
    closeMs: nullableMs,
    totalMs: nullableMs,
  }),
  details: fc.option(json, { nil: null }),
  failures: fc.array(failure, { maxLength: 2 }),
  metadata: fc.option(json, { nil: null }),
  createdAt: nat,
  finishedAt: fc.option(nat, { nil: null }),
});

/**
 * Parse, serialise to JSON, parse that again: the JSON text is a fixed point (what a worker
 * stores is exactly what the next one reads). Compared as JSON text, since JSON itself folds -0
 * into 0.
 */
function roundTrips<T extends z.ZodType>(schema: T, arb: fc.Arbitrary<unknown>) {
  fc.assert(
    fc.property(arb, (value) => {
      const stored = JSON.stringify(schema.parse(value));
      const again = JSON.stringify(schema.parse(JSON.parse(stored)));
      expect(again).toBe(stored);
    }),
    { numRuns: 150 },
  );
}

describe("AgentSpec refusals", () => {
  it("a NUL byte in a command agent's argv or env is refused up front (422), not at the exec", () => {
    const r1 = AgentSpec.safeParse({ harness: "command", argv: ["sh", "-c", "echo a\0b"] });
    const r2 = AgentSpec.safeParse({ harness: "command", argv: ["true"], env: { A: "\0" } });
    expect(r1.success || r2.success).toBe(false);
    expect(r1.error?.issues[0]?.message).toMatch(/NUL/);
    expect(r2.error?.issues[0]?.path).toEqual(["env", "A"]);
  });

  it("a command agent's argument or environment entry no exec can take (over Linux's 128 KiB a string, E2BIG), or all of them past the bound, is refused up front (422), not at the exec (where a provider's spawn failure masked it as provider_unavailable after retries)", () => {
    const big = "x".repeat(128 * 1024);
    const arg = AgentSpec.safeParse({ harness: "command", argv: ["echo", big] });
    expect(arg.error?.issues[0]).toMatchObject({ path: ["argv", 1] });
    expect(arg.error?.issues[0]?.message).toMatch(/131072 bytes/);
    // An environment entry is `NAME=value`, one string as the exec gets it.
    const env = AgentSpec.safeParse({ harness: "command", argv: ["true"], env: { A: big.slice(2) } });
    expect(env.error?.issues[0]).toMatchObject({ path: ["env", "A"] });
    // Each one under the bound, all of them together past it.
    const many = Array.from({ length: 20 }, () => "y".repeat(100 * 1024));
    const total = AgentSpec.safeParse({ harness: "command", argv: ["echo", ...many] });
    expect(total.error?.issues[0]?.path).toEqual(["argv"]);
    expect(total.error?.issues[0]?.message).toMatch(/1048576 bytes/);
    // At the bounds, accepted: an argument of 131,071 bytes (its NUL makes 131,072), an entry too.
    const most = "z".repeat(128 * 1024 - 1);
    expect(AgentSpec.safeParse({ harness: "command", argv: ["echo", most] }).success).toBe(true);
    expect(
      AgentSpec.safeParse({ harness: "command", argv: ["true"], env: { A: most.slice(2) } }).success,
    ).toBe(true);
  });

  it("a model base URL on a link-local or metadata host is refused (422), for both harnesses that name one: no worker calls it", () => {
    for (const baseUrl of [
      "http://169.254.169.254/latest",
      "http://[::ffff:169.254.169.254]/v1",
      "http://[fe80::1]/v1",
      "http://100.100.100.200/latest",
      "http://metadata.google.internal/computeMetadata/v1",
    ]) {
      const toolLoop = AgentSpec.safeParse({ harness: "tool-loop", model: { baseUrl, name: "m" } });
      const command = AgentSpec.safeParse({
        harness: "command",
        argv: ["true"],
        model: { name: "m", baseUrl, credential: "default" },
      });
      for (const parsed of [toolLoop, command]) {
        expect(parsed.error?.issues[0], baseUrl).toMatchObject({
          path: ["model", "baseUrl"],
          message: "must not be a link-local or metadata address (a cloud's metadata service)",
        });
      }
    }
    expect(
      AgentSpec.safeParse({ harness: "tool-loop", model: { baseUrl: "http://10.0.0.5:8000/v1", name: "m" } })
        .success,
    ).toBe(true);
  });

  it("a blank model name is refused (422), for both harnesses that name one", () => {
    const url = "http://127.0.0.1:8000/v1";
    const toolLoop = AgentSpec.safeParse({ harness: "tool-loop", model: { baseUrl: url, name: "   " } });
    const command = AgentSpec.safeParse({
      harness: "command",
      argv: ["true"],
      model: { name: " \t", baseUrl: url, credential: "default" },
    });
    expect(toolLoop.error?.issues[0]).toMatchObject({
      path: ["model", "name"],
      message: "must not be blank",
    });
    expect(command.error?.issues[0]).toMatchObject({ path: ["model", "name"], message: "must not be blank" });
    expect(AgentSpec.safeParse({ harness: "tool-loop", model: { baseUrl: url, name: " m " } }).success).toBe(
      true,
    );
  });
});

describe("comparableAnswer", () => {
  const trimmed = ["\n", "\r\n", " ", "\t", "\u00a0", "\u3000", "\u200b", "\u200d", "\u2060", "\ufeff"];
  it("trims white space and zero-width characters at either end, as the regex it replaced (NFC, CRLF as LF)", () => {
    const reference = (t: string) =>
      t
        .normalize("NFC")
        .replace(/\r\n/g, "\n")
        .replace(/^[\s\u200b-\u200d\u2060]+|[\s\u200b-\u200d\u2060]+$/g, "");
    const piece = fc.oneof(
      fc.constantFrom(...trimmed, "a", "e\u0301", "42", "\r"),
      fc.string({ maxLength: 3 }),
    );
    fc.assert(
      fc.property(fc.array(piece, { maxLength: 12 }), (parts) => {
        const text = parts.join("");
        expect(comparableAnswer(text)).toBe(reference(text));
      }),
      { numRuns: 2_000 },
    );
    expect(comparableAnswer(" \u200b\r\n 42 \n\u2060")).toBe("42");
    expect(comparableAnswer("\n\t \u200b")).toBe("");
  });

  it("does not hang on a long run of white space before a word (an agent's 256 KiB of newlines)", () => {
    expect(comparableAnswer(`start${"\n".repeat(256_000)}done`)).toBe(`start${"\n".repeat(256_000)}done`);
    expect(comparableAnswer(`${" ".repeat(256_000)}x${" ".repeat(256_000)}`)).toBe("x");
  });
});

describe("TaskContent refusals", () => {
  const base = { id: "t", instruction: "i", image: "img", tests: { "test.sh": "exit 0" } };
  it("refuses a test.sh or solve.sh with CRLF line endings (bash cannot run them); other files may have them", () => {
    const crlf = "#!/bin/bash\r\nexit 0\r\n";
    const issues = (task: object) =>
      TaskContent.safeParse({ ...base, ...task }).error?.issues.map((i) => [i.path.join("/"), i.message]);
    const message = "has Windows (CRLF) line endings, which bash cannot run: convert it (dos2unix)";
    expect(issues({ tests: { "test.sh": crlf } })).toEqual([["tests/test.sh", message]]);
    expect(issues({ solution: { "solve.sh": crlf } })).toEqual([["solution/solve.sh", message]]);
    // Classic Mac (CR only): one line to bash, a comment when it starts with `#!`; named as such,
    // not as a script that runs nothing.
    const cr = "#!/bin/bash\rexit 0\r";
    const crMessage =
      "has classic Mac (CR) line endings, which bash reads as one line: convert it (mac2unix)";
    expect(issues({ tests: { "test.sh": cr } })).toEqual([["tests/test.sh", crMessage]]);
    expect(issues({ solution: { "solve.sh": cr } })).toEqual([["solution/solve.sh", crMessage]]);
    expect(
      issues({ workspace: { "notes.txt": "a\r\nb\r\n" }, solution: { "solve.sh": "true\n" } }),
    ).toBeUndefined();
    // A match task's tests are never run: refused as such, not for their line endings.
    const match = { verifier: { kind: "match", expected: "42" } };
    expect(issues({ ...match, tests: { "test.sh": crlf } })).toEqual([
      ["tests", expect.stringMatching(/^are never run for a task graded by matching its answer/)],
    ]);
  });

  it("refuses an instruction of nothing but white space or zero-width characters, as the task loader refuses an empty instruction.md: the agent would be run on no task", () => {
    const issues = (task: object) =>
      TaskContent.safeParse({ ...base, ...task }).error?.issues.map((i) => [i.path.join("/"), i.message]);
    const message = "must not be empty (it holds only white space or zero-width characters)";
    for (const instruction of [" ", "\n\t  \r\n", "\u200b\u200c\u200d", "\u2060 \ufeff"]) {
      expect(issues({ instruction }), JSON.stringify(instruction)).toEqual([["instruction", message]]);
    }
    // Other characters that show nothing (Unicode's default-ignorable ones): a soft hyphen, a
    // variation selector, an invisible operator, a Hangul filler.
    for (const instruction of ["\u00ad", "\ufe0f\ufe0f", "\u2063 \u2064", "\u3164"]) {
      expect(issues({ instruction }), JSON.stringify(instruction)).toEqual([["instruction", message]]);
    }
    expect(issues({ instruction: "" })).toEqual([["instruction", "must not be empty"]]);
    // One visible character is an instruction, whatever surrounds it.
    expect(issues({ instruction: "\u200b x \u200b" })).toBeUndefined();
  });

  it("refuses text with a lone UTF-16 surrogate in a path, a file, the instruction or a match's expected answer (staged as U+FFFD: two files would become one); a pair is fine", () => {
    const issues = (task: object) => {
      const error = TaskContent.safeParse({ ...base, ...task }).error;
      return error && leafIssues(error.issues).map((i) => [i.path.join("/"), i.message]);
    };
    const message =
      "must be well-formed Unicode (a lone UTF-16 surrogate would be staged as U+FFFD, not as sent)";
    expect(issues({ workspace: { "a\ud800.txt": "first", "a\udc00.txt": "second" } })).toEqual([
      ["workspace/a\ud800.txt", message],
      ["workspace/a\udc00.txt", message],
    ]);
    expect(issues({ workspace: { "a.txt": "x\ud800y" } })).toEqual([["workspace/a.txt", message]]);
    expect(issues({ instruction: "fix it \udfff" })).toEqual([["instruction", message]]);
    expect(issues({ tests: {}, verifier: { kind: "match", expected: "\ud83d" } })).toEqual([
      ["verifier/expected", message],
    ]);
    // A surrogate pair is one character (U+1F600), staged as its four UTF-8 bytes.
    expect(
      issues({ instruction: "smile \ud83d\ude00", workspace: { "\ud83d\ude00.txt": "\ud83d\ude00" } }),
    ).toBeUndefined();
  });

  it("refuses a test.sh or solve.sh that starts with a byte order mark (bash runs it as part of the first command)", () => {
    const issues = (task: object) =>
      TaskContent.safeParse({ ...base, ...task }).error?.issues.map((i) => [i.path.join("/"), i.message]);
    const message =
      "starts with a byte order mark, which bash would run as part of its first command: save it without one";
    expect(issues({ tests: { "test.sh": "\uFEFFset -e\nexit 0\n" } })).toEqual([["tests/test.sh", message]]);
    expect(issues({ solution: { "solve.sh": "\uFEFFtrue\n" } })).toEqual([["solution/solve.sh", message]]);
    expect(issues({ workspace: { "notes.txt": "\uFEFFhi\n" } })).toBeUndefined(); // data, kept as it is
  });

  it("refuses a test.sh whose #! interpreter is relative (looked up in the agent's workspace); an absolute one, env or none is fine", () => {
    const issues = (script: string) =>
      TaskContent.safeParse({ ...base, tests: { "test.sh": script } }).error?.issues.map((i) => [
        i.path.join("/"),
        i.message,
      ]);
    expect(issues("#!bash\nexit 0\n")).toEqual([
      [
        "tests/test.sh",
        "names a relative #! interpreter (bash), which would be looked up in the agent's workspace: name its path (#!/bin/bash, or #!/usr/bin/env bash)",
      ],
    ]);
    expect(issues("#! python3 -u\nexit 0\n")?.[0]?.[1]).toMatch(/relative #! interpreter \(python3\)/);
    for (const fine of ["#!/bin/bash\nexit 0\n", "#! /usr/bin/env python3\nexit 0\n", "exit 0\n"]) {
      expect(issues(fine), fine).toBeUndefined();
    }
    // solve.sh runs with bash, whatever its #! line says.
    expect(TaskContent.safeParse({ ...base, solution: { "solve.sh": "#!bash\ntrue\n" } }).success).toBe(true);
  });

  it('refuses a test.sh whose #!/usr/bin/env line passes more than one word without -S (env would look for a program named "bash -e")', () => {
    const issues = (script: string) =>
      TaskContent.safeParse({ ...base, tests: { "test.sh": script } }).error?.issues.map((i) => [
        i.path.join("/"),
        i.message,
      ]);
    expect(issues("#!/usr/bin/env bash -e\nexit 0\n")).toEqual([
      [
        "tests/test.sh",
        'runs "bash -e" through #!/usr/bin/env, which gets it as one argument and would look for a program by that name: split it with -S (#!/usr/bin/env -S bash -e)',
      ],
    ]);
    expect(issues("#! /bin/env\tpython3\t-u  \nexit 0\n")?.[0]?.[1]).toMatch(
      /^runs "python3\t-u" through #!\/bin\/env/,
    );
    // Another long option is no split (`--unset=A B` unsets "A B"), nor one not spelled by getopt.
    for (const refused of ["--unset=A bash -e", "--split-strings=bash -e"]) {
      expect(issues(`#!/usr/bin/env ${refused}\nexit 0\n`)?.[0]?.[1], refused).toMatch(/^runs "/);
    }
    // With a space, env takes `--split-string bash -e` for one option it does not know.
    expect(issues("#!/usr/bin/env --split-string bash -e\nexit 0\n")?.[0]?.[1]).toMatch(
      /^runs "--split-string bash -e" through/,
    );
    for (const fine of [
      "#!/usr/bin/env -S bash -e\nexit 0\n",
      "#!/usr/bin/env -vS bash -e\nexit 0\n",
      "#!/usr/bin/env -iS bash -e\nexit 0\n",
      "#!/usr/bin/env --split-string=bash -e\nexit 0\n",
      "#!/usr/bin/env --sp=bash -e\nexit 0\n", // getopt's abbreviations, down to one letter
      "#!/usr/bin/env --s=bash -e\nexit 0\n",
      "#!/usr/bin/env bash \nexit 0\n", // trailing white space: the kernel drops it
      "#!/bin/bash -e\nexit 0\n", // one option, as bash gets it
      "#!/usr/bin/envy bash -e\nexit 0\n", // not env
    ]) {
      expect(issues(fine), fine).toBeUndefined();
    }
    // solve.sh runs with bash, whatever its #! line says.
    expect(
      TaskContent.safeParse({ ...base, solution: { "solve.sh": "#!/usr/bin/env bash -e\ntrue\n" } }).success,
    ).toBe(true);
  });

  it("refuses modes that would leave test.sh or solve.sh unreadable to whoever runs it", () => {
    const issues = (modes: Record<string, string>) =>
      TaskContent.safeParse({ ...base, solution: { "solve.sh": "true\n" }, modes }).error?.issues.map((i) => [
        i.path.join("/"),
        i.message,
      ]);
    expect(issues({ "tests/test.sh": "200" })).toEqual([
      ["modes/tests/test.sh", "takes away the read bit of its owner (root), so tests/test.sh could not run"],
    ]);
    expect(issues({ "solution/solve.sh": "750" })).toEqual([
      [
        "modes/solution/solve.sh",
        "takes away the read bit of others (the agent's uid runs it), so solution/solve.sh could not run",
      ],
    ]);
    expect(issues({ "tests/test.sh": "400", "solution/solve.sh": "704" })).toBeUndefined();
  });

  it("takes file modes that name the task's files, as three octal digits, and keeps a task without them as it was", () => {
    const workspace = { "bin/deploy.sh": "#!/bin/sh\n", "key.pem": "k" };
    const modes = { "workspace/bin/deploy.sh": "644", "workspace/key.pem": "600", "tests/test.sh": "755" };
    const task = TaskContent.parse({ ...base, workspace, modes });
    expect(fileModes(task, "workspace")).toEqual({ "bin/deploy.sh": 0o644, "key.pem": 0o600 });
    expect(fileModes(task, "tests")).toEqual({ "test.sh": 0o755 });
    expect(fileModes(task, "solution")).toEqual({});
    expect("modes" in TaskContent.parse(base)).toBe(false); // no key: the digest of a task without modes is unchanged

    const refused = (m: Record<string, string>) =>
      TaskContent.safeParse({ ...base, workspace, modes: m }).error?.issues.map((i) => [
        i.path.join("."),
        i.message,
      ]);
    expect(refused({ "workspace/missing.txt": "644" })?.[0]?.[1]).toMatch(/names no file of the task/);
    expect(refused({ "deploy.sh": "644" })?.[0]?.[1]).toMatch(/names no file/);
    expect(refused({ "solution/key.pem": "644" })?.[0]?.[1]).toMatch(/names no file/); // another set's file
    expect(refused({ "workspace/key.pem": "0600" })?.[0]?.[1]).toMatch(/three octal digits/);
    expect(refused({ "workspace/key.pem": "4755" })?.[0]?.[1]).toMatch(/three octal digits/); // no setuid
    expect(refused({ "workspace/key.pem": "689" })?.[0]?.[1]).toMatch(/three octal digits/);
    // One spelling per file (so one digest for one staging), and no empty map.
    expect(refused({ "workspace/key.pem": "600", "workspace/./key.pem": "644" })).toEqual([
      ["modes.workspace/./key.pem", 'must be spelled "workspace/key.pem"'],
    ]);
    expect(refused({})).toEqual([["modes", "is empty: leave it out"]]);
  });

  it("takes a file set at its limits: 32 directories deep, 255-byte names, 10,000 entries", () => {
    const wide = Object.fromEntries(Array.from({ length: 5_000 }, (_, i) => [`p${i}/f`, ""]));
    const workspace = { ...wide, [`${"d/".repeat(31)}f`]: "", [`${"é".repeat(127)}x`]: "" };
    expect(TaskContent.safeParse({ ...base, workspace }).success).toBe(false); // 10,034 entries
    delete workspace["p0/f"];
    delete workspace["p1/f"];
    for (let i = 2; i < 20; i++) delete workspace[`p${i}/f`];
    // 4,980 files in 4,980 directories, one nested in 31 directories, one with a 255-byte name.
    expect(TaskContent.safeParse({ ...base, workspace }).success).toBe(true);
  });
  it.each([
    [{ ".": "x" }, /must name a file/],
    [{ "./": "x" }, /must name a file/],
    // One spelling per file: `./a` and `a` would stage the same file under two task digests.
    [{ a: "1", "./a": "2" }, /must be spelled "a"/],
    [{ a: "x", "a/b": "y" }, /"a\/b" needs it as a directory/],
    // Deep or wide enough to make a staging tar of gigabytes from a 10 MiB task.
    [{ [`${"a/".repeat(33)}f`]: "" }, /nested in at most 32 directories/],
    [{ [`${"é".repeat(128)}/f`]: "" }, /at most 255 bytes/],
    [
      Object.fromEntries(Array.from({ length: 2_000 }, (_, i) => [`p${i}/${"d/".repeat(4)}f`, ""])),
      /more than 10000 files and directories/,
    ],
  ])("workspace %j is refused up front, with why", (workspace, why) => {
    const r = TaskContent.safeParse({ ...base, workspace });
    expect(r.success).toBe(false);
    const messages = (
      list: readonly { message: string; issues?: readonly { message: string }[] }[],
    ): string[] => list.flatMap((i) => [i.message, ...messages(i.issues ?? [])]);
    expect(messages(r.error!.issues).join("; ")).toMatch(why);
  });

  it("a file path spelled other than plainly is refused, naming its plain spelling: one staging, one digest", () => {
    for (const [path, plain] of [
      ["./a", "a"],
      ["a//b", "a/b"],
      ["a/./b", "a/b"],
      ["a/", "a"],
      ["dir/sub/", "dir/sub"],
    ] as const) {
      for (const set of ["workspace", "solution", "tests"] as const) {
        const files = set === "tests" ? { ...base.tests, [path]: "x" } : { [path]: "x" };
        const r = TaskContent.safeParse({ ...base, [set]: files });
        expect(r.success, `${set}/${path}`).toBe(false);
        expect(leafIssues(r.error!.issues).map((i) => [i.path.join("/"), i.message])).toEqual([
          [`${set}/${path}`, `must be spelled "${plain}"`],
        ]);
      }
    }
    // Spelled plainly, it is taken (a name may start with a dot or hold one).
    expect(TaskContent.safeParse({ ...base, workspace: { ".env": "x", "a/.b/c.d": "y" } }).success).toBe(
      true,
    );
  });

  it("a task graded by its tests without tests/test.sh is refused up front, naming the file", () => {
    for (const task of [
      { id: "t", instruction: "i", image: "img" },
      { ...base, tests: { "check.py": "assert True" }, verifier: { kind: "tests" } },
    ]) {
      const r = TaskContent.safeParse(task);
      expect(r.success).toBe(false);
      expect(r.error!.issues).toEqual([
        expect.objectContaining({
          path: ["tests", "test.sh"],
          message: "is missing: a task graded by its tests needs tests/test.sh",
        }),
      ]);
    }
    // The workers look it up by the key `test.sh` exactly: another spelling is refused, naming it.
    const dotted = TaskContent.safeParse({ ...base, tests: { "./test.sh": "exit 0" } });
    expect(leafIssues(dotted.error!.issues).map((i) => [i.path.join("/"), i.message])).toEqual([
      ["tests/./test.sh", 'must be spelled "test.sh"'],
    ]);
  });

  it("refuses tests for a task graded by a match: they would never run, and the author expects them to count", () => {
    const r = TaskContent.safeParse({
      id: "t",
      instruction: "i",
      image: "img",
      verifier: { kind: "match", expected: "42" },
      tests: { "test_answer.py": "assert False\n" },
    });
    expect(r.error?.issues.map((i) => [i.path.join("/"), i.message])).toEqual([
      [
        "tests",
        'are never run for a task graded by matching its answer ([verifier] kind = "match"): remove tests/, or grade with kind = "tests"',
      ],
    ]);
  });

  it("a task graded by a match needs no tests/test.sh", () => {
    const r = TaskContent.safeParse({
      id: "t",
      instruction: "i",
      image: "img",
      verifier: { kind: "match", expected: "42" },
    });
    expect(r.error?.issues).toBeUndefined();
    expect(r.data?.tests).toEqual({});
  });

  it.each([
    ["exact", "", /is blank/],
    ["exact", " \n\t", /is blank/],
    ["regex", "  ", /is blank/],
    ["regex", "\\d*", /matches an empty answer/],
    ["regex", "yes|", /matches an empty answer/],
    ["regex", "(unclosed", /not a valid regular expression/],
    // Valid as written, but trimmed (as graded) it ends in a lone backslash.
    ["regex", "2\\.10\\.0\\ ", /not a valid regular expression/],
    // Would escape the whole-answer group: `^(?:42)|(?:[\s\S])$` passes any one-character answer.
    ["regex", "42)|(?:[\\s\\S]", /not a valid regular expression/],
    // Other dialects' syntax, which JavaScript reads as literals (`\Z` as "Z", the POSIX class
    // as a class then "]+"), grading even the reference answer 0.
    ["regex", "\\d+\\Z", /another dialect's anchor/],
    ["regex", "\\A\\d+", /another dialect's anchor/],
    ["regex", "[[:digit:]]+", /\[\[:digit:\]\] is a POSIX class/],
    // Escapes JavaScript without the `u` flag reads as a bare letter: `\p{L}+` matches "p{L}".
    ["regex", "\\p{L}+", /\\p is a Unicode property class/],
    ["regex", "[\\P{N}]+", /\\P is a negated Unicode property class/],
    ["regex", "a\\hb", /\\h is PCRE's horizontal whitespace/],
    ["regex", "\\Q1+1\\E", /\\Q is PCRE's quoting/],
    // Code point escapes JavaScript reads without the `u` flag as a letter: `caf\u{e9}` is
    // "cafu{e9}" (and `\u{2}` "uu"), never the answer "café".
    ["regex", "caf\\u{e9}", /\\u\{…\} is a code point escape/],
    ["regex", "caf\\x{e9}", /\\x\{…\} is a code point escape/],
    ["regex", "caf\\u0e9", /\\u without four hex digits/],
    ["regex", "caf\\xe", /\\x without two hex digits/],
    ["regex", "a\\Rb", /\\R is PCRE's line break/],
    ["regex", "\\G\\d+", /\\G is another dialect's anchor/],
    ["regex", "\\d+\\z", /\\z is another dialect's anchor/],
    ["regex", "a\\Kb", /\\K is PCRE's match reset/],
    ["regex", "\\X+", /\\X is PCRE's grapheme cluster/],
    // Any other escaped letter JavaScript has no escape for is that letter.
    ["regex", "a\\eb", /\\e is no JavaScript escape/],
    ["regex", "[\\N]+", /\\N is no JavaScript escape/],
    // A character above U+FFFF is two UTF-16 units without the `u` flag: in a class each half
    // is a member (`[😀😁]` matches half an emoji), before a quantifier only the second repeats.
    ["regex", "[\u{1F600}\u{1F601}]", /😀 in a character class is a character above U\+FFFF/],
    ["regex", "[^\u{1F600}]+", /😀 in a character class/],
    ["regex", "\u{1F600}+", /😀 before a quantifier \(\+\) .*group it, as \(\?:😀\)\+/],
    ["regex", "ok \u{1F600}{2}", /😀 before a quantifier \(\{2\}\)/],
    ["regex", "ok \\\u{1F600}?", /\\😀 before a quantifier \(\?\)/],
    ["regex", "ok \\uD83D\\uDE00*", /\\uD83D\\uDE00 before a quantifier \(\*\)/],
    ["regex", "[\\ud83d\\ude00]", /\\ud83d\\ude00 in a character class/],
    // A range to an emoji from anything but a surrogate is an emoji in a class all the same.
    ["regex", "[a-\\uD83D\\uDE00]", /\\uD83D\\uDE00 in a character class/],
    ["regex", "[\\uD83D\\uDE00-z]", /\\uD83D\\uDE00 in a character class/],
    // After a `-` that is no range's (one after a range is a literal), or a range from an escaped backslash's `0`.
    ["regex", "[\\uDC00-\\uDFFF-\\uD83D\\uDE00]", /\\uD83D\\uDE00 in a character class/],
    ["regex", "[\\\\uD800-\\uD83D\\uDE00]", /\\uD83D\\uDE00 in a character class/],
  ] as const)("a %s match expecting %j is refused up front: %s", (mode, expected, why) => {
    const r = TaskContent.safeParse({ ...base, tests: {}, verifier: { kind: "match", expected, mode } });
    expect(r.success).toBe(false);
    expect(r.error!.issues).toEqual([expect.objectContaining({ path: ["verifier", "expected"] })]);
    expect(r.error!.issues[0]!.message).toMatch(why);
  });

  it("a regex match keeps JavaScript's own escapes (an escaped '-' or quote), and an escaped backslash before Z is no anchor", () => {
    for (const expected of ["v1\\-beta", 'say \\"hi\\"', "C:\\\\Z"]) {
      expect(matchExpectedProblem({ expected, mode: "regex" })).toBeUndefined();
    }
    expect(matchPattern("v1\\-beta").test("v1-beta")).toBe(true);
    expect(matchPattern("C:\\\\Z").test("C:\\Z")).toBe(true);
  });

  it("a regex match keeps JavaScript's escapes and characters above U+FFFF that are one character", () => {
    const valid: [string, string][] = [
      ["caf\\u00e9", "café"],
      ["caf\\xe9", "café"],
      ["[\\u00e0-\\u00ff]+", "éà"],
      ["\\cJ", "\n"],
      ["\\bword\\B\\S\\s\\D\\d\\W\\w\\f?\\v?\\t?", "wordX y1 z"],
      ["(?<n>a)\\k<n>", "aa"],
      ["[\\b\\-\\]]+", "-]\b"],
      ["v1\\-beta", "v1-beta"],
      // As a sequence, an emoji is matched whole: alone, grouped, in an alternation, escaped.
      ["\u{1F600}", "\u{1F600}"],
      ["(?:\u{1F600})+", "\u{1F600}\u{1F600}"],
      ["(?:\u{1F600}|\u{1F601}) ok", "\u{1F601} ok"],
      ["\\uD83D\\uDE00!", "\u{1F600}!"],
      ["\\\u{1F600}", "\u{1F600}"],
      ["x\\\\u{2}", "x\\uu"], // an escaped backslash, then "u{2}": "u" twice
      // Surrogate ranges, as UTF-16 units: any character above U+FFFF (a lead, then a trail).
      ["[\\uD800-\\uDBFF\\uDC00-\\uDFFF]{2}", "\u{1F600}"],
      ["(?:[\\uD800-\\uDBFF][\\uDC00-\\uDFFF])+", "\u{1F600}\u{1F601}"],
    ];
    for (const [expected, answer] of valid) {
      expect(matchExpectedProblem({ expected, mode: "regex" }), expected).toBeUndefined();
      expect(matchPattern(expected).test(answer), expected).toBe(true);
    }
  });

  it("a regex match's escaped CRLF matches the answer's line end, which is compared as LF: as written it never could", () => {
    const answer = comparableAnswer("line one\r\nline two\r\n");
    for (const expected of [
      "line one\\r\\nline two",
      "line one\\r\nline two",
      "(?:line one\\r\\n)+line two",
      "line one\\r\\n+line two",
    ]) {
      expect(matchPattern(expected).test(answer), expected).toBe(true);
    }
    // Inside a class, or with an `\n` that may be absent (a lone CR matches): left as written.
    expect(matchPattern("a\\r\\n?b").test("a\rb")).toBe(true);
    expect(matchPattern("a\\r\\n*b").test("a\rb")).toBe(true);
    expect(matchPattern("a[\\r\\n]b").test("a\rb")).toBe(true);
    expect(matchPattern("a\\\\r\\nb").test("a\\r\nb")).toBe(true); // an escaped backslash, then "r"
    expect(matchPattern("a\\r\\nb").test("a\rb")).toBe(false);
    // In a negative lookaround, a `\r\n` that never matches lets it always pass: left so.
    expect(matchPattern("foo(?!\\r\\n)[\\s\\S]*").test("foo\nbar")).toBe(true);
    expect(matchPattern("(?:a(?!\\r\\n)\\s)b\\r\\nc").test("a\nb\nc")).toBe(true);
  });

  it("an exact match expecting more than an answer keeps (4,000 characters) is refused up front: no agent could match it", () => {
    const r = TaskContent.safeParse({
      ...base,
      tests: {},
      verifier: { kind: "match", expected: "x".repeat(4001) },
    });
    expect(r.error?.issues[0]?.message).toMatch(/longer than the 4000 characters an answer is kept to/);
  });

  it("a match whose expected an empty answer cannot match is accepted", () => {
    for (const [mode, expected] of [
      ["exact", "0"],
      ["exact", ` ${"x".repeat(4000)}\n`],
      ["regex", "\\d+"],
      ["regex", "v?2\\.10\\.0\n"],
    ] as const) {
      const r = TaskContent.safeParse({ ...base, tests: {}, verifier: { kind: "match", expected, mode } });
      expect(r.error?.issues, `${mode} ${expected}`).toBeUndefined();
    }
  });
});

describe("every schema round-trips through JSON", () => {
  it("TaskContent", () => roundTrips(TaskContent, task));
  it("AgentSpec", () => roundTrips(AgentSpec, agent));
  it.each([
    ["rollout-fleet/base:latest", undefined],
    ["localhost:5000/team/img:1.2", undefined],
    [`registry.example.com/x@sha256:${"a".repeat(64)}`, undefined],
    ["[::1]:5000/x", undefined],
    [" rollout-fleet/base:latest", "must have no whitespace"],
    ["Rollout-Fleet/base:latest", "has a name that is not lowercase"],
    ["a//b", "has a name that is not lowercase"],
    ["x/y:", "has a tag that is not"],
    ["x@sha256:zz", "has a digest that is not"],
  ])("image %j: %s", (ref, problem) => {
    const found = imageReferenceProblem(ref);
    if (problem === undefined) expect(found).toBeUndefined();
    else expect(found).toContain(problem);
  });

  it("TaskContent refuses an image Docker cannot parse, at its path (a 422 at the API, not a failed seed)", () => {
    const r = TaskContent.safeParse({
      id: "t",
      instruction: "x",
      image: "Rollout-Fleet/base:latest",
      tests: { "test.sh": "exit 0\n" },
    });
    expect(r.success).toBe(false);
    expect(r.error!.issues[0]).toMatchObject({
      path: ["image"],
      message: expect.stringMatching(/not a Docker image reference$/),
    });
  });

  it("RolloutRequest metadata refuses integers past 2^53 (JSON parsing rounded them already) and numbers past the largest double, saying where", () => {
    const parsed = JSON.parse(
      '{"step": 12345678901234567890, "nested": [{"id": 1152921504606846976}], "ok": 9007199254740991, "lr": 0.5, "s": "12345678901234567890", "flops": 6e23, "big": 1e400}',
    );
    const r = RolloutRequest.safeParse({
      task: { digest: "a".repeat(64) },
      agent: { harness: "oracle" },
      metadata: parsed,
    });
    expect(r.success).toBe(false);
    expect(r.error!.issues.map((i) => [i.path.join("."), i.message])).toEqual([
      [
        "metadata.step",
        "12345678901234567000 is an integer beyond 2^53, which JSON numbers cannot hold exactly: send it as a string",
      ],
      [
        "metadata.nested.0.id",
        "1152921504606847000 is an integer beyond 2^53, which JSON numbers cannot hold exactly: send it as a string",
      ],
      // Read as Infinity, which JSON would write back as null.
      ["metadata.big", "must be a finite number (1e309 and up do not fit in one)"],
    ]);
  });

  it("a __proto__ key in metadata, at any depth, is refused, saying where (zod's record dropped it without a word)", () => {
    const request = (metadata: string) =>
      RolloutRequest.safeParse(
        JSON.parse(
          `{"task":{"digest":"${"a".repeat(64)}"},"agent":{"harness":"oracle"},"metadata":${metadata}}`,
        ),
      );
    const message =
      'is a "__proto__" key, which JavaScript readers drop (it names an object\'s prototype): rename it';
    for (const [metadata, path] of [
      ['{"__proto__":{"x":1},"k":2}', "metadata.__proto__"],
      ['{"k":{"__proto__":1}}', "metadata.k.__proto__"],
      ['{"k":[0,{"__proto__":null}]}', "metadata.k.1.__proto__"],
    ] as const) {
      const r = request(metadata);
      expect(
        r.error?.issues.map((i) => [i.path.join("."), i.message]),
        metadata,
      ).toEqual([[path, message]]);
    }
    // A task's metadata (its task.toml's [metadata]) as well.
    const task = TaskContent.safeParse({
      ...JSON.parse('{"metadata":{"__proto__":"x"}}'),
      id: "t",
      instruction: "i",
      image: "img",
      tests: { "test.sh": "exit 0" },
    });
    expect(task.error?.issues.map((i) => [i.path.join("."), i.message])).toEqual([
      ["metadata.__proto__", message],
    ]);
    // Keys that merely look like it, and metadata without one, are kept as they are.
    const kept = request('{"proto":1,"__proto":2,"constructor":{"prototype":3},"k":{"a":[1]}}');
    expect(kept.data?.metadata).toEqual({
      proto: 1,
      __proto: 2,
      constructor: { prototype: 3 },
      k: { a: [1] },
    });
  });

  it("RolloutRequest", () =>
    roundTrips(RolloutRequest, fc.record({ task, agent, deadlineS: secs, metadata: json })));
  it("RolloutRequest by digest", () =>
    roundTrips(
      RolloutRequest,
      fc.record({ task: fc.record({ digest: fc.stringMatching(/^[0-9a-f]{64}$/) }), agent }),
    ));
  it("SandboxSpec", () =>
    roundTrips(
      SandboxSpec,
      fc.record({
        image: fc.constant("img"),
        rolloutId: rid,
        owner: fc.constantFrom("resources" as const, "agent" as const),
        expiresAt: fc.integer({ min: 1, max: 2 ** 40 }),
        options: fc.record(
          { memoryMb: fc.integer({ min: 16, max: 4096 }), pidsLimit: fc.integer({ min: 8, max: 1000 }) },
          { requiredKeys: [] },
        ),
      }),
    ));
  it("SandboxHandle", () => roundTrips(SandboxHandle, handle));
  it("ExecResult", () => roundTrips(ExecResult, exec));
  it("CleanupReceipt", () => roundTrips(CleanupReceipt, cleanup));
  it("ProbeReport", () =>
    roundTrips(
      ProbeReport,
      fc.record({
        isolated: fc.boolean(),
        checks: fc.dictionary(text, fc.boolean()),
        detail: text,
        durationMs: nat,
      }),
    ));
  it("FailureRecord", () => roundTrips(FailureRecord, failure));
  it("Usage", () => roundTrips(Usage, usage));
  it("SeedReceipt", () =>
    roundTrips(
      SeedReceipt,
      fc.record({
        handle,
        probe: fc.record({ isolated: fc.boolean(), checks: fc.constant({}), detail: text, durationMs: nat }),
        createMs: nat,
        probeMs: nat,
        stageMs: nat,
        reused: fc.boolean(),
        at: nat,
      }),
    ));
  it("RunReceipt", () =>
    roundTrips(
      RunReceipt,
      fc.record({
        exec,
        answer: fc.option(text, { nil: null }),
        transcript: fc.option(text, { nil: null }),
        usage: fc.option(usage, { nil: null }),
        cleanup,
        ownedSandbox: fc.option(fc.record({ handle, released: cleanup }), { nil: null }),
        startedAt: nat,
        stoppedAt: nat,
        attempts: fc.integer({ min: 1, max: 5 }),
        at: nat,
      }),
    ));
  it("VerifyReceipt", () =>
    roundTrips(
      VerifyReceipt,
      fc.record({
        reward: fc.double({ min: 0, max: 1, noNaN: true }),
        details: json,
        startedAt: nat,
        at: nat,
      }),
    ));
  it("CloseReceipt", () =>
    roundTrips(
      CloseReceipt,
      fc.record({
        cleanup: fc.option(cleanup, { nil: null }),
        teardown: fc.constantFrom("confirmed" as const, "pending" as const),
        at: nat,
      }),
    ));
  it("RolloutResult", () => roundTrips(RolloutResult, result));
});

describe("validation says what is wrong", () => {
  const base = {
    task: {
      id: "t",
      instruction: "x",
      image: "img",
      solution: { "solve.sh": "true" },
      tests: { "test.sh": "exit 0" },
    },
    agent: { harness: "oracle" },
  };
  const message = (value: unknown) => {
    const r = RolloutRequest.safeParse(value);
    expect(r.success).toBe(false);
    return r.success ? "" : r.error.issues.map((i) => `${i.path.join(".")}: ${i.message}`).join("; ");
  };

  it("rejects non-finite and non-positive timeouts", () => {
    expect(message({ ...base, deadlineS: Number.POSITIVE_INFINITY })).toMatch(/deadlineS: .*finite/);
    expect(message({ ...base, deadlineS: 0 })).toMatch(/deadlineS: must be positive/);
    // Too short to run anything once a sandbox is ready: refused, not masked attempt after attempt.
    expect(message({ ...base, agent: { harness: "oracle", timeoutS: 0.001 } })).toMatch(
      /agent.timeoutS: must be at least 1 second/,
    );
    expect(message({ ...base, task: { ...base.task, timeouts: { verifierS: 0.5 } } })).toMatch(
      /task.timeouts.verifierS: must be at least 1 second/,
    );
    expect(message({ ...base, deadlineS: Number.NaN })).toMatch(/deadlineS/);
    expect(message({ ...base, task: { ...base.task, timeouts: { agentS: -1 } } })).toMatch(
      /task.*agentS.*positive|timeouts/,
    );
  });

  it("rejects unknown sandbox options and unknown agent fields", () => {
    expect(message({ ...base, sandbox: { privileged: true } })).toMatch(
      /sandbox.*privileged|Unrecognized key.*privileged/,
    );
    expect(message({ ...base, agent: { harness: "oracle", apiKey: "sk-x" } })).toMatch(/apiKey/);
    expect(message({ ...base, agent: { harness: "nope" } })).toMatch(/agent/);
  });

  it("rejects a CPU share under 0.01: Docker refuses one, and one that rounds to 0 nano-CPUs is no limit at all", () => {
    for (const cpus of [1e-10, 0.004, 0.0099]) {
      expect(message({ ...base, sandbox: { cpus } })).toMatch(/^sandbox\.cpus: must be at least 0\.01/);
    }
    expect(RolloutRequest.safeParse({ ...base, sandbox: { cpus: 0.01 } }).success).toBe(true);
  });
});

describe("failures", () => {
  it("every kind is classified; infrastructure kinds mask, never grade", () => {
    for (const kind of FailureKind.options) {
      const c = classifyFailure(kind);
      expect(["fail", "mask", "cancel", "graded"]).toContain(c.outcome);
    }
    for (const k of [
      "provider_unavailable",
      "sandbox_lost",
      "verifier_error",
      "deadline_exceeded",
      "provider_oom_killed",
    ] as const) {
      expect(classifyFailure(k).outcome).toBe("mask");
    }
    expect(classifyFailure("isolation_refused")).toEqual({ outcome: "fail", retryable: false });
    expect(classifyFailure("agent_timeout").outcome).toBe("graded");
  });

  it("caps text and decodes bytes with replacement characters", () => {
    fc.assert(fc.property(fc.string({ maxLength: 10_000 }), (s) => capText(s).length <= MAX_FIELD_CHARS));
    expect(decodeUtf8(new Uint8Array([0x61, 0xff, 0x62]))).toBe("a\uFFFDb");
  });

  it("cuts text between characters, never between the halves of one beyond the BMP (a lone surrogate an endpoint may refuse)", () => {
    // Well-formed text stays well-formed cut anywhere, from the front or the back.
    const text = fc.string({ unit: "grapheme", maxLength: 300 });
    fc.assert(
      fc.property(text, fc.nat(400), fc.nat(400), (s, a, b) => {
        const cut = wholeSlice(s, Math.min(a, b), Math.max(a, b));
        expect(WellFormedText.safeParse(cut).success).toBe(true);
        expect(cut.length).toBeLessThanOrEqual(Math.max(a, b) - Math.min(a, b));
        expect(WellFormedText.safeParse(capText(s, 50)).success).toBe(true);
      }),
    );
    expect(WellFormedText.safeParse(capText(`x${"🎉".repeat(3000)}`, 4000)).success).toBe(true);
    expect(wholeSlice("a🎉b", 0, 2)).toBe("a");
    expect(wholeSlice("a🎉b", 2, 4)).toBe("b");
    expect(wholeSlice("a🎉b", 1, 3)).toBe("🎉");
  });
});

describe("parseStageJob", () => {
  /** What a parse gives: the value, or the error's words. */
  const outcome = (parse: (d: unknown) => unknown, data: unknown) => {
    try {
      return { ok: parse(data) };
    } catch (err) {
      return { error: String(err) };
    }
  };

  it("answers every payload as StageJob.parse does: the id, or the same error", () => {
    const payloads: unknown[] = [
      { rolloutId: "a1b2-c3_d4" },
      { rolloutId: "x".repeat(64) },
      { rolloutId: "x".repeat(65) },
      { rolloutId: "" },
      { rolloutId: "has space" },
      { rolloutId: "../etc" },
      { rolloutId: 7 },
      { rolloutId: "ok", task: { secret: 1 } },
      { rolloutId: undefined },
      {},
      Object.assign(Object.create(null), { rolloutId: "no-prototype" }),
      Object.assign(Object.create({ inherited: 1 }), { rolloutId: "own-prototype" }),
      ["rolloutId"],
      "rollout",
      null,
      undefined,
    ];
    for (const data of payloads) {
      expect(outcome(parseStageJob, data), JSON.stringify(data)).toEqual(
        outcome((d) => StageJob.parse(d), data),
      );
    }
    fc.assert(
      fc.property(
        fc.oneof(fc.string({ maxLength: 80 }), fc.stringMatching(/^[A-Za-z0-9_-]{1,70}$/)),
        (rolloutId) => {
          expect(outcome(parseStageJob, { rolloutId })).toEqual(
            outcome((d) => StageJob.parse(d), { rolloutId }),
          );
        },
      ),
    );
  });

  it("returns a new object holding the id alone", () => {
    const data = { rolloutId: "r-1" };
    const parsed = parseStageJob(data);
    expect(parsed).toEqual({ rolloutId: "r-1" });
    expect(parsed).not.toBe(data);
  });
});

describe("fitRecord", () => {
  const bytes = (v: unknown) => Buffer.byteLength(JSON.stringify(v));
  it("keeps a record that fits as it is", () => {
    const r = { a: "x".repeat(100), n: 1 };
    expect(fitRecord(r)).toBe(r);
  });

  it("cuts the longest fields of a record past 16 KiB (escapes and multi-byte text count), never a kept one", () => {
    const r = {
      exec: { stdout: "漢".repeat(4000), stderr: "\u001b".repeat(4000), exitCode: 0 },
      answer: "答".repeat(4000),
      usage: null,
    };
    expect(bytes(r)).toBeGreaterThan(MAX_RECORD_BYTES);
    const fit = fitRecord(r, MAX_RECORD_BYTES, new Set(["answer"]));
    expect(bytes(fit)).toBeLessThanOrEqual(MAX_RECORD_BYTES);
    expect(fit.answer).toBe(r.answer);
    expect(fit.exec.exitCode).toBe(0);
    expect(fit.exec.stderr).toMatch(/…\[truncated\]$/);
    expect(r.exec.stderr).toHaveLength(4000); // the input is not changed
  });
});
