import { mkdtemp, readdir, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import path from "node:path";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { ResultsFile } from "./context.ts";

describe("ResultsFile", () => {
  let dir: string;
  beforeEach(async () => {
    dir = await mkdtemp(path.join(tmpdir(), "fleet-cli-results-"));
  });
  afterEach(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  it("two results files for one path at once each write their own: the file is whole, the last one committed", async () => {
    const out = path.join(dir, "same.jsonl");
    const first = await ResultsFile.open(out);
    const second = await ResultsFile.open(out);
    for (let i = 0; i < 3; i++) await first.writeLine(`{"first":${i}}`);
    await second.writeLine('{"second":0}');
    await first.commit();
    expect(await readFile(out, "utf8")).toBe('{"first":0}\n{"first":1}\n{"first":2}\n');
    await second.writeLine('{"second":1}');
    await second.commit();
    expect(await readFile(out, "utf8")).toBe('{"second":0}\n{"second":1}\n');
    expect(await readdir(dir)).toEqual(["same.jsonl"]);
  });
});
