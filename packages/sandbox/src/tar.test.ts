import { Readable } from "node:stream";
import tar from "tar-stream";
import { describe, expect, it } from "vitest";
import { buildTar, safeRelativeParts, tarHasContent } from "./tar.ts";

interface Entry {
  name: string;
  type: string;
  mode: number;
  uid: number;
  gid: number;
  body: string;
}

async function entries(archive: Buffer): Promise<Entry[]> {
  const out: Entry[] = [];
  const extract = tar.extract();
  const done = new Promise<void>((resolve, reject) => {
    extract.on("entry", (header, stream, next) => {
      const chunks: Buffer[] = [];
      stream.on("data", (c: unknown) => chunks.push(c as Buffer));
      stream.on("end", () => {
        out.push({
          name: header.name,
          type: header.type,
          mode: header.mode,
          uid: header.uid,
          gid: header.gid,
          body: Buffer.concat(chunks).toString(),
        });
        next();
      });
    });
    extract.on("finish", () => resolve());
    extract.on("error", reject);
  });
  extract.end(archive);
  await done;
  return out;
}

describe("buildTar", () => {
  it("a file named as an Object property (constructor, toString) takes the default mode when the modes name it not, never that property", async () => {
    // As the stages pass them: `fileModes` gives a plain object, empty for most tasks.
    const archive = await buildTar(
      { constructor: "plain\n", toString: "#!/bin/sh\n", "src/valueOf": "x" },
      { uid: 1000, gid: 1000, modes: {} },
    );
    expect((await entries(archive)).map((e) => [e.name, e.mode])).toEqual([
      ["src/", 0o755],
      ["constructor", 0o644],
      ["src/valueOf", 0o644],
      ["toString", 0o755],
    ]);
  });

  it("writes files with owner, modes and a directory entry for each parent", async () => {
    const archive = await buildTar(
      { "b/c/run.sh": "#!/bin/sh\necho hi\n", "a.txt": "héllo" },
      { uid: 1000, gid: 1000, prefix: "sub" },
    );
    const got = await entries(archive);
    expect(got.map((e) => [e.name, e.type])).toEqual([
      ["sub/", "directory"],
      ["sub/b/", "directory"],
      ["sub/b/c/", "directory"],
      ["sub/a.txt", "file"],
      ["sub/b/c/run.sh", "file"],
    ]);
    expect(got.every((e) => e.uid === 1000 && e.gid === 1000)).toBe(true);
    expect(got.find((e) => e.name === "sub/a.txt")).toMatchObject({ mode: 0o644, body: "héllo" });
    expect(got.find((e) => e.name === "sub/b/c/run.sh")?.mode).toBe(0o755);
  });

  it("applies an explicit mode to every file", async () => {
    const got = await entries(await buildTar({ x: "#!/bin/sh", y: "" }, { uid: 0, gid: 0, mode: 0o600 }));
    expect(got.map((e) => e.mode)).toEqual([0o600, 0o600]);
  });

  it("gives single files their own modes, by normalized path, over the default and `mode`", async () => {
    const files = { "./bin//deploy.sh": "#!/bin/sh\n", "key.pem": "k", "plain.txt": "p", locked: "l" };
    const modes = { "bin/deploy.sh": 0o644, "key.pem": 0o600, locked: 0 };
    const byName = async (options: Parameters<typeof buildTar>[1]) =>
      Object.fromEntries((await entries(await buildTar(files, options))).map((e) => [e.name, e.mode]));
    expect(await byName({ uid: 0, gid: 0, modes })).toMatchObject({
      "bin/deploy.sh": 0o644,
      "key.pem": 0o600,
      "plain.txt": 0o644,
      locked: 0, // no permission at all, not "none given"
    });
    expect(await byName({ uid: 0, gid: 0, modes, mode: 0o640 })).toMatchObject({
      "bin/deploy.sh": 0o644,
      "key.pem": 0o600,
      "plain.txt": 0o640,
    });
    await expect(buildTar(files, { uid: 0, gid: 0, modes: { "key.pem": 0o4755 } })).rejects.toThrow(
      /key\.pem.*0\.\.0o777/,
    );
  });

  it("refuses paths that climb out", async () => {
    await expect(buildTar({ "../etc/passwd": "x" }, { uid: 0, gid: 0 })).rejects.toThrow(/\.\./);
    expect(() => safeRelativeParts("/abs")).toThrow(/relative/);
    expect(safeRelativeParts("./a//b/")).toEqual(["a", "b"]);
  });
});

describe("tarHasContent", () => {
  const archive = async (names: string[]) => {
    const pack = tar.pack();
    for (const name of names) {
      if (name.endsWith("/")) pack.entry({ name, type: "directory" });
      else pack.entry({ name }, "x");
    }
    pack.finalize();
    const chunks: Buffer[] = [];
    for await (const chunk of pack) chunks.push(chunk as Buffer);
    return Readable.from([Buffer.concat(chunks)]);
  };
  it("is false for a directory alone, true once anything lies below it", async () => {
    expect(await tarHasContent(await archive(["workspace/"]))).toBe(false);
    expect(await tarHasContent(await archive(["workspace/", "workspace/a.txt"]))).toBe(true);
    expect(await tarHasContent(await archive(["workspace/", "workspace/sub/"]))).toBe(true);
  });
});
