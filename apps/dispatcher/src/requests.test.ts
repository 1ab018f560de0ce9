import { MAX_METADATA_BYTES } from "@fleet/queue";
import fc from "fast-check";
import { describe, expect, it, vi } from "vitest";
import { HttpError } from "./http-error.ts";
import {
  ApiRolloutRequest,
  countJsonTextValues,
  MAX_BAD_ROWS,
  MAX_CHECKED_ISSUES,
  MAX_METADATA_VALUES,
  MAX_REQUEST_VALUES,
  parseBatchJson,
  parseBatchNdjson,
  parseIdempotencyKey,
  parseRolloutBody,
  readBatchJson,
  textHasTooManyValues,
} from "./requests.ts";

const task = {
  id: "t1",
  instruction: "say hi",
  image: "img",
  solution: { "solve.sh": "true" },
  tests: { "test.sh": "exit 0" },
};
const row = { task, agent: { harness: "oracle" } };

function thrown(fn: () => unknown): HttpError {
  try {
    fn();
  } catch (err) {
    if (err instanceof HttpError) return err;
    throw err;
  }
  throw new Error("expected an HttpError");
}

describe("parseRolloutBody", () => {
  it("accepts a valid request and applies defaults", () => {
    const req = parseRolloutBody(row);
    expect(req.agent).toMatchObject({ harness: "oracle", sandbox: "borrow" });
  });

  it("reports the closest branch of the task union with a readable path", () => {
    const err = thrown(() =>
      parseRolloutBody({ task: { id: "t1", image: "img" }, agent: { harness: "oracle" } }),
    );
    expect(err.status).toBe(422);
    expect(err.code).toBe("invalid");
    expect(err.details).toMatchObject({ issues: [{ path: "task.instruction" }], total: 1 });
    expect(err.message).toContain("task.instruction");
    // Two fields short of an inline task: still an inline task (it has keys a digest's branch
    // refuses), not "task.digest: expected string" beside "unrecognized key id".
    const short = thrown(() => parseRolloutBody({ task: { id: "t1" }, agent: { harness: "oracle" } }));
    expect((short.details as { issues: { path: string }[] }).issues.map((i) => i.path)).toEqual([
      "task.instruction",
      "task.image",
    ]);
    // A digest that is not one is still reported as the digest's.
    const digest = thrown(() => parseRolloutBody({ task: { digest: "abc" }, agent: { harness: "oracle" } }));
    expect(digest.details).toMatchObject({ issues: [{ path: "task.digest" }] });
  });

  it("refuses a task file path not spelled plainly (422), naming its plain spelling: `./a` and `a` are one file, and one digest", () => {
    const err = thrown(() =>
      parseRolloutBody({ ...row, task: { ...task, workspace: { "./src//main.py": "x" } } }),
    );
    expect([err.status, err.code]).toEqual([422, "invalid"]);
    expect(err.details).toMatchObject({
      issues: [{ path: "task.workspace../src//main.py", message: 'must be spelled "src/main.py"' }],
    });
  });

  it("refuses non-finite and negative timeouts, unknown sandbox options and unknown harnesses", () => {
    const cases: [unknown, string][] = [
      [{ ...row, deadlineS: Number.POSITIVE_INFINITY }, "deadlineS"],
      [{ ...row, deadlineS: -1 }, "deadlineS"],
      [{ ...row, task: { ...task, timeouts: { agentS: 0 } } }, "task.timeouts.agentS"],
      [{ ...row, sandbox: { privileged: true } }, "sandbox"],
      [{ ...row, agent: { harness: "magic" } }, "agent.harness"],
      // Past a week: a deadline that is no deadline (and overflows timers).
      [{ ...row, deadlineS: 1e306 }, "deadlineS"],
      [{ ...row, agent: { harness: "oracle", timeoutS: 30 * 24 * 3600 } }, "agent.timeoutS"],
      // Allowed by the contract for the providers' tests; never through the API.
      [{ ...row, sandbox: { pidMode: "host" } }, "sandbox.pidMode"],
    ];
    for (const [body, path] of cases) {
      const err = thrown(() => parseRolloutBody(body));
      expect(err.status, path).toBe(422);
      expect((err.details as { issues: { path: string }[] }).issues.map((i) => i.path)).toContain(path);
    }
  });

  it("refuses a JSON null or a string as a body of the wrong shape (422), and no body at all as malformed (400)", () => {
    for (const body of [null, "x"]) {
      for (const err of [thrown(() => parseRolloutBody(body)), thrown(() => parseBatchJson(body))]) {
        expect([err.status, err.code], JSON.stringify(body)).toEqual([422, "invalid"]);
      }
    }
    for (const err of [thrown(() => parseRolloutBody(undefined)), thrown(() => parseBatchJson(undefined))]) {
      expect([err.status, err.code, err.message]).toEqual([
        400,
        "malformed",
        expect.stringMatching(/^expected a JSON body/),
      ]);
    }
  });

  it("says what an agent is when it is given by name, as the CLI takes it, in a row of a batch too", () => {
    const err = thrown(() => parseRolloutBody({ ...row, agent: "oracle" }));
    expect(err.status).toBe(422);
    expect(err.message).toBe(
      'rollout request is invalid (agent: must be an object, e.g. {"harness":"oracle"} or {"harness":"command","argv":[...]}; a name such as "oracle" is the CLI\'s shorthand for one)',
    );
    const batch = thrown(() => parseBatchJson({ rollouts: [row, { ...row, agent: "oracle" }] }));
    expect((batch.details as { issues: { path: string; message: string }[] }).issues[0]).toMatchObject({
      path: "rollouts[1].agent",
      message: expect.stringContaining('e.g. {"harness":"oracle"}'),
    });
  });

  it("quotes an agent given by name cut between characters: a name of emoji cut at 40 left a lone surrogate in the 422", () => {
    const err = thrown(() => parseRolloutBody({ ...row, agent: `a${"\u{1F600}".repeat(30)}` }));
    expect(err.status).toBe(422);
    expect(err.message).toContain('a name such as "a\u{1F600}');
    expect((err.message as string & { isWellFormed(): boolean }).isWellFormed()).toBe(true);
  });

  it("says that Infinity is not a finite number", () => {
    const err = thrown(() => parseRolloutBody({ ...row, deadlineS: Number.POSITIVE_INFINITY }));
    expect(err.message).toMatch(/Infinity/);
  });

  it("refuses a credential value smuggled into the agent (schemas are strict)", () => {
    const err = thrown(() =>
      parseRolloutBody({ ...row, agent: { harness: "oracle", apiKey: "sk-live-123" } }),
    );
    expect(err.status).toBe(422);
    expect(JSON.stringify(err.details)).not.toContain("sk-live-123");
    expect(JSON.stringify(err.details)).toContain("apiKey");
  });

  it("refuses agent env names that hold credentials, naming them but not echoing values", () => {
    const agent = (env: Record<string, string>) => ({
      ...row,
      agent: { harness: "command", argv: ["x"], env },
    });
    for (const name of [
      "OPENAI_API_KEY",
      "HF_TOKEN",
      "GITHUB_TOKEN",
      "AWS_SECRET_ACCESS_KEY",
      "PGPASSWORD",
      "API_KEY",
      "STRIPE_SECRET_KEY",
      "GCP_PRIVATE_KEY",
      "OPENAI_API_KEY_2",
      "HF_TOKEN2",
      "OPENAI_KEY",
      "WANDB_KEY",
    ]) {
      const err = thrown(() => parseRolloutBody(agent({ [name]: "sk-live-SECRETVALUE" })));
      expect(err.status, name).toBe(422);
      expect(err.message, name).toContain("credential");
      expect(JSON.stringify(err.details)).not.toContain("SECRETVALUE");
    }
    // Names that merely mention tokens or keys are fine.
    const ok = parseRolloutBody(
      agent({
        MAX_TOKENS: "10",
        TOKENIZERS_PARALLELISM: "false",
        KEYBOARD: "us",
        SORT_KEY: "id",
        CACHE_KEY: "v1",
        PAD_TOKEN: "<pad>",
        EOS_TOKEN: "</s>",
        AWS_ACCESS_KEY_ID: "AKIA-not-secret",
        SSH_AUTH_SOCK: "/tmp/s",
        SORT_KEY_2: "id",
        MAX_TOKENS_2: "5",
      }),
    );
    expect(ok.agent).toMatchObject({ env: { MAX_TOKENS: "10" } });
  });

  it("refuses a command agent's model without a base URL up front (422), not at run time", () => {
    const command = (model: Record<string, unknown>) => ({
      ...row,
      agent: { harness: "command", argv: ["agent"], model },
    });
    const ok = parseRolloutBody(command({ name: "m", baseUrl: "http://127.0.0.1:8000/v1", credential: "K" }));
    expect(ok.agent).toMatchObject({ harness: "command", model: { name: "m" } });
    const err = thrown(() => parseRolloutBody(command({ name: "m", credential: "K" })));
    expect(err.status).toBe(422);
    expect((err.details as { issues: { path: string }[] }).issues[0]!.path).toBe("agent.model.baseUrl");
  });

  it("refuses a model base URL with a query, fragment, credentials or another scheme", () => {
    const toolLoop = (baseUrl: string) => ({
      ...row,
      agent: { harness: "tool-loop", model: { baseUrl, name: "m" }, credential: "default" },
    });
    expect(parseRolloutBody(toolLoop("http://127.0.0.1:8000/v1")).agent).toMatchObject({
      harness: "tool-loop",
    });
    for (const bad of [
      "http://attacker.test/x?",
      "http://127.0.0.1:8000/v1?next=/admin",
      "http://127.0.0.1:8000/v1#frag",
      "http://user:pw@127.0.0.1:8000/v1",
      "file:///etc/passwd",
    ]) {
      const err = thrown(() => parseRolloutBody(toolLoop(bad)));
      expect(err.status, bad).toBe(422);
      expect((err.details as { issues: { path: string }[] }).issues[0]!.path, bad).toBe(
        "agent.model.baseUrl",
      );
    }
  });

  it("needs a body", () => {
    expect(thrown(() => parseRolloutBody(undefined)).status).toBe(400);
  });
});

describe("parseBatchJson", () => {
  it("takes { rollouts } or a bare array", () => {
    expect(parseBatchJson({ rollouts: [row, row] }).requests).toHaveLength(2);
    expect(parseBatchJson([row]).requests).toHaveLength(1);
  });

  it("names the bad row and caps the issues", () => {
    const rows = Array.from({ length: 50 }, () => ({ ...row, deadlineS: -1 }));
    const err = thrown(() => parseBatchJson({ rollouts: rows }));
    expect(err.status).toBe(422);
    const details = err.details as { issues: { path: string }[]; total: number };
    expect(details.issues).toHaveLength(20);
    expect(details.total).toBe(50);
    expect(details.issues[3]!.path).toBe("rollouts[3].deadlineS");
  });

  it("reads a body as readBatchJson does, handing the event loop on between rows: the same batch, the same 422", async () => {
    const bad = { ...row, deadlineS: -1 };
    const bodies = [
      { rollouts: [row, row] },
      [row],
      { rollouts: [row, bad, row, bad] },
      { rollouts: [] },
      undefined,
    ];
    const outcome = (value: unknown) =>
      value instanceof HttpError
        ? { status: value.status, message: value.message, details: value.details }
        : { batch: value };
    for (const body of bodies) {
      let sync: unknown;
      try {
        sync = parseBatchJson(body);
      } catch (err) {
        sync = err;
      }
      // A slice of 0: the loop is handed on before every row.
      const paced = await readBatchJson(body, 0).catch((err: unknown) => err);
      expect(outcome(paced)).toEqual(outcome(sync));
    }
  });

  it("refuses an empty batch", () => {
    expect(thrown(() => parseBatchJson({ rollouts: [] })).status).toBe(422);
  });

  it("counts a JSON text's values off the text as they are counted parsed (array items and properties, nested)", () => {
    // The parsed count: array items and object properties, nested included.
    const parsedCount = (v: unknown): number => {
      if (Array.isArray(v)) return v.length + v.reduce((n: number, c) => n + parsedCount(c), 0);
      if (typeof v === "object" && v !== null) {
        const values = Object.values(v);
        return values.length + values.reduce((n: number, c) => n + parsedCount(c), 0);
      }
      return 0;
    };
    fc.assert(
      fc.property(fc.jsonValue(), fc.constantFrom(undefined, 2, "\t"), (value, indent) => {
        const text = JSON.stringify(value, null, indent);
        expect(countJsonTextValues(text, Number.POSITIVE_INFINITY)).toBe(parsedCount(JSON.parse(text)));
      }),
      { numRuns: 500 },
    );
    // Strings holding the characters that count elsewhere, escapes included.
    expect(countJsonTextValues('{"a:,[":"],{\\":,","b":[ ]}', 100)).toBe(2);
    expect(countJsonTextValues('[[],[ ],{},"x",[1,[2,3]]]', 100)).toBe(9);
    // It stops past the limit.
    expect(countJsonTextValues(`[${"0,".repeat(1000)}0]`, 10)).toBe(11);
  });

  it("tells a text of more than MAX_REQUEST_VALUES values before parsing it; a large task's text is no such text", () => {
    const values = `{"x":[${"{},".repeat(MAX_REQUEST_VALUES)}{}`; // cut short: not even JSON
    expect(textHasTooManyValues(values)).toBe(true);
    expect(textHasTooManyValues(`{"x":[${"{},".repeat(MAX_REQUEST_VALUES - 2)}{}]}`)).toBe(false);
    const bigTask = JSON.stringify({ ...row, task: { ...task, instruction: "x".repeat(10 * 1024 * 1024) } });
    expect(textHasTooManyValues(bigTask)).toBe(false);
  });

  it("an NDJSON line of more than MAX_REQUEST_VALUES values is that line's 422, never parsed (so one cut short is no 400)", () => {
    const line = `{"x":[${"{},".repeat(MAX_REQUEST_VALUES)}{}`;
    const err = thrown(() => parseBatchNdjson(`${JSON.stringify(row)}\n${line}\n`));
    expect(err.status).toBe(422);
    expect(err.details).toMatchObject({ line: 2, badLines: 1 });
    expect(err.message).toMatch(/^line 2: holds more than 100000 JSON values/);
  });

  it("a request holding more than MAX_REQUEST_VALUES JSON values is refused by its size, before the schema (no zod stack overflow, no million issues)", () => {
    const env: Record<string, number> = {};
    for (let i = 0; i < MAX_REQUEST_VALUES + 1; i++) env[`K${i}`] = 0;
    const bad = { ...row, agent: { harness: "command", argv: ["x"], env } };
    for (const [body, path] of [
      [[bad], "[0]"],
      [{ rollouts: [row, bad] }, "rollouts[1]"],
    ] as const) {
      const err = thrown(() => parseBatchJson(body));
      expect(err.status).toBe(422);
      expect(err.details).toMatchObject({ total: 1, issues: [{ path }] });
      expect(err.message).toMatch(/more than 100000 JSON values/);
    }
    expect(thrown(() => parseRolloutBody(bad)).message).toMatch(/more than 100000 JSON values/);
    // Just under it, the schema runs and names the first bad value.
    for (let i = 0; i < 50; i++) delete env[`K${i}`];
    const under = thrown(() => parseBatchJson([bad]));
    expect((under.details as { issues: { path: string }[] }).issues[0]!.path).toBe("[0].agent.env.K50");
  }, 60_000);

  it("refuses metadata with more values than its byte bound has room for before the schema walks it (32 MiB of such rows held the event loop for seconds)", () => {
    const fat = { ...row, metadata: { tokens: Array(MAX_METADATA_VALUES).fill(0) } };
    // No JSON of that many values fits the bound: refusing by the count never refuses what admission takes.
    expect(Buffer.byteLength(JSON.stringify(fat.metadata))).toBeGreaterThan(MAX_METADATA_BYTES);
    const schema = vi.spyOn(ApiRolloutRequest, "safeParse");
    try {
      const rows = Array(50).fill(fat);
      for (const [run, path] of [
        [() => parseBatchJson({ rollouts: rows }), "rollouts[0].metadata"],
        [() => parseBatchNdjson(rows.map((r) => JSON.stringify(r)).join("\n")), "metadata"],
        [() => parseRolloutBody(fat), "metadata"],
      ] as const) {
        const err = thrown(run);
        expect([err.status, err.code]).toEqual([422, "invalid"]);
        const first = (err.details as { issues: { path: string; message: string }[] }).issues[0];
        expect(first).toMatchObject({
          path,
          message: expect.stringContaining("over the limit of 4096 bytes"),
        });
      }
      expect(schema).not.toHaveBeenCalled();
      // One value fewer: the schema reads it (admission then measures its bytes).
      const under = { ...row, metadata: { tokens: Array(MAX_METADATA_VALUES - 1).fill(0) } };
      expect(parseRolloutBody(under).metadata).toEqual(under.metadata);
      expect(schema).toHaveBeenCalledTimes(1);
    } finally {
      schema.mockRestore();
    }
  });

  it("stops checking after MAX_CHECKED_ISSUES problems, however few rows held them", () => {
    const env: Record<string, number> = {};
    for (let i = 0; i < 6000; i++) env[`K${i}`] = 0;
    const bad = { ...row, agent: { harness: "command", argv: ["x"], env } };
    const err = thrown(() => parseBatchJson([bad, bad, bad, bad]));
    expect(err.details).toMatchObject({ truncated: true, checkedRows: 2, rows: 4, total: 12_000 });
    const nd = thrown(() => parseBatchNdjson(Array(4).fill(JSON.stringify(bad)).join("\n")));
    expect(nd.details).toMatchObject({ truncated: true, badLines: 2 });
    expect(MAX_CHECKED_ISSUES).toBe(10_000);
  });

  it("stops checking after MAX_BAD_ROWS invalid rows, saying there were more", () => {
    const rows = [row, ...Array(MAX_BAD_ROWS + 5).fill(0)];
    const err = thrown(() => parseBatchJson(rows));
    expect(err.status).toBe(422);
    expect(err.details).toMatchObject({
      truncated: true,
      checkedRows: MAX_BAD_ROWS + 1,
      rows: MAX_BAD_ROWS + 6,
    });
    expect((err.details as { issues: unknown[] }).issues[0]).toMatchObject({ path: "[1]" });
    const text = [JSON.stringify(row), ...Array(MAX_BAD_ROWS + 5).fill("0")].join("\n");
    const nd = thrown(() => parseBatchNdjson(text));
    expect(nd).toMatchObject({ status: 422, details: { line: 2, badLines: MAX_BAD_ROWS, truncated: true } });
    expect(nd.message).toMatch(new RegExp(`and at least ${MAX_BAD_ROWS - 1} more invalid lines`));
    // Exactly MAX_BAD_ROWS bad lines, the last of them last: everything was checked.
    const exact = [JSON.stringify(row), ...Array(MAX_BAD_ROWS).fill("0"), ""].join("\n");
    const all = thrown(() => parseBatchNdjson(exact));
    expect(all.details).not.toHaveProperty("truncated");
    expect(all.message).toMatch(new RegExp(`and ${MAX_BAD_ROWS - 1} more invalid lines`));
    // A row's issues all count in the total, though only the first 20 are listed.
    const many = thrown(() =>
      parseBatchJson([
        { ...row, deadlineS: -1, agent: { harness: "command", argv: ["x"], env: { A: 1, B: 2 } } },
      ]),
    );
    expect(many.details).toMatchObject({ total: 3 });
    const wide: Record<string, number> = {};
    for (let i = 0; i < 30; i++) wide[`K${i}`] = 0;
    const thirty = thrown(() =>
      parseBatchJson([{ ...row, agent: { harness: "command", argv: ["x"], env: wide } }]),
    );
    expect(thirty.details).toMatchObject({ total: 30 });
    expect((thirty.details as { issues: unknown[] }).issues).toHaveLength(20);
    // Under the bound, every bad row is counted.
    const some = thrown(() => parseBatchJson([row, 0, 0]));
    expect(some.details).toMatchObject({ total: 2 });
    expect(some.details).not.toHaveProperty("truncated");
  });

  it("refuses an argv of more than 4096 items up front", () => {
    const long = { ...row, agent: { harness: "command", argv: Array(4097).fill("x") } };
    expect(thrown(() => parseRolloutBody(long)).message).toMatch(/argv has at most 4096 items/);
  });
});

describe("parseBatchNdjson", () => {
  it("skips blank lines and records each request's line", () => {
    const text = `${JSON.stringify(row)}\n\n  \r\n${JSON.stringify(row)}\r\n`;
    const parsed = parseBatchNdjson(text);
    expect(parsed.requests).toHaveLength(2);
    expect(parsed.lines).toEqual([1, 4]);
  });

  it("names the first invalid line (422) and counts the others", () => {
    const bad = JSON.stringify({ ...row, agent: { harness: "nope" } });
    const text = [JSON.stringify(row), JSON.stringify(row), bad, JSON.stringify(row), bad].join("\n");
    const err = thrown(() => parseBatchNdjson(text));
    expect(err.status).toBe(422);
    expect(err.message).toMatch(/^line 3: agent\.harness/);
    expect(err.message).toContain("1 more");
    expect(err.details).toMatchObject({ line: 3, badLines: 2, issues: [{ line: 3 }, { line: 5 }] });
  });

  it("answers 400 for a line that is not JSON, naming it", () => {
    const err = thrown(() => parseBatchNdjson(`${JSON.stringify(row)}\n{"task":`));
    expect(err.status).toBe(400);
    expect(err.code).toBe("malformed");
    expect(err.details).toEqual({ line: 2 });
  });

  it("refuses a __proto__ key as the JSON parser does, instead of dropping it", () => {
    const line = `{"task":${JSON.stringify(task)},"agent":{"harness":"oracle"},"metadata":{"__proto__":{"x":1},"k":2}}`;
    const err = thrown(() => parseBatchNdjson(line));
    expect([err.status, err.code]).toEqual([400, "malformed"]);
    expect(err.details).toEqual({ line: 1 });
    expect(err.message).toBe(
      'line 1 has a "__proto__" or "constructor.prototype" key, which no request may carry',
    );
  });

  it("refuses a body of blank lines", () => {
    expect(thrown(() => parseBatchNdjson("\n\n")).status).toBe(422);
  });
});

describe("parseIdempotencyKey", () => {
  it("is optional and must be one printable value", () => {
    expect(parseIdempotencyKey(undefined)).toBeNull();
    expect(parseIdempotencyKey("abc-123")).toBe("abc-123");
    expect(thrown(() => parseIdempotencyKey("")).status).toBe(400);
    expect(thrown(() => parseIdempotencyKey("a b")).status).toBe(400);
    expect(thrown(() => parseIdempotencyKey(["a", "b"])).status).toBe(400);
    expect(thrown(() => parseIdempotencyKey("x".repeat(201))).status).toBe(400);
  });
});
