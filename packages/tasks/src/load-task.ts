import type { Dirent, Stats } from "node:fs";
import { constants, type FileHandle, lstat, open, readdir, readlink, realpath, stat } from "node:fs/promises";
import path from "node:path";
import {
  FILESET_TOO_LARGE,
  type FileSet,
  FleetError,
  isBlank,
  leafIssues,
  MAX_FILESET_ENTRIES,
  TASK_FILE_SETS,
  TaskContent,
  type TaskContentInput,
} from "@fleet/contracts";
import { parse as parseToml, TomlDate, TomlError } from "smol-toml";
import { taskSize } from "./canonical.ts";
import { describeIssues, TaskToml } from "./task-toml.ts";

/** The dispatcher's default task size limit; the loader refuses bigger tasks up front. */
export const DEFAULT_MAX_TASK_BYTES = 10 * 1024 * 1024;

export interface LoadTaskOptions {
  /**
   * Refuse a task whose files add up to more than this many bytes.
   * @defaultValue {@link DEFAULT_MAX_TASK_BYTES}
   */
  maxBytes?: number;
}

export interface LoadSuiteOptions extends LoadTaskOptions {
  /**
   * The tasks asked for (ids; one that does not load is matched by its directory's name and by
   * the `[task] id` its task.toml declares): a broken task of the suite not among them does not
   * refuse the load (it is left out), nor do two not among them that share an id. The tasks that
   * load are returned all the same, for the caller to pick from.
   */
  only?: readonly string[];
}

/**
 * Names skipped while reading a task's file trees (tool litter, never task content). Not `.git`:
 * in a file tree it is a repository the task gives (`workspace/repo/.git`), refused (`GIT_DATA`),
 * never dropped. (A task's or a suite's own `.git`, a checkout of the tasks, is never read: only
 * `workspace/`, `solution/` and `tests/` are, and a suite skips its `.`-directories.)
 */
const SKIPPED = new Set(["__pycache__", ".pytest_cache", ".DS_Store"]);

/**
 * Why a `.git` in a file tree is refused: a repository's objects and index are binary (a file set
 * holds UTF-8 text), and staged without them its files would be no repository, which an agent
 * told to work in one (`git diff`, `git log`) fails at, every one of them.
 */
const GIT_DATA =
  "is a git repository's data, which a task cannot carry (its objects and index are binary; a file set holds UTF-8 text), and without it the files would be staged as no repository: build the repository into the task's image, or remove .git";

/**
 * Why a directory with no file staged under it is refused: a file set holds files (and the
 * directories they imply) only, so it would vanish, and a task whose agent or tests expect it
 * (an `out/` to write to) would fail for every agent.
 */
const EMPTY_DIRECTORY =
  "holds no file a task carries (it is empty, or holds only skipped tool litter such as __pycache__ or .DS_Store), and a file set cannot carry an empty directory: keep a placeholder file in it (such as .gitkeep), or remove it";

/** The sub-directories whose files travel with the task, and the TaskContent field each fills. */
const FILE_TREES = TASK_FILE_SETS;

function invalid(file: string, message: string, cause?: unknown): FleetError {
  return new FleetError("invalid_task", `${file}: ${message}`, cause === undefined ? {} : { cause });
}

/**
 * Read one Harbor-layout task directory (`task.toml`, `instruction.md`, `workspace/`,
 * `solution/`, `tests/`) into a parsed {@link TaskContent}.
 *
 * @throws FleetError `invalid_task` (final) naming the offending file for a missing
 * instruction, bad TOML, unknown keys, unreadable or non-text files, symlinks or an oversize task.
 */
export async function loadTask(dir: string, options: LoadTaskOptions = {}): Promise<TaskContent> {
  // The directory named may be a link to the task (`--suite` given a link): the task is where it
  // points (its name the id's default); what the task holds may not be a link.
  const root = await realpath(path.resolve(dir)).catch(() => path.resolve(dir));
  const budget = {
    left: options.maxBytes ?? DEFAULT_MAX_TASK_BYTES,
    max: options.maxBytes ?? DEFAULT_MAX_TASK_BYTES,
  };
  const rootStat = await statOrNull(root);
  if (!rootStat?.isDirectory()) throw invalid(root, "not a task directory");

  const tomlFile = path.join(root, "task.toml");
  if ((await statOrNull(tomlFile)) === null) {
    throw invalid(tomlFile, (await missingTaskToml(root)) ?? MISSING_TOML);
  }
  const config = parseConfig(tomlFile, await readText(tomlFile, budget, MISSING_TOML));

  const instructionFile = path.join(root, "instruction.md");
  const instruction = await readText(instructionFile, budget, "missing (every task needs an instruction.md)");
  // White space and zero-width characters only (an editor's leftovers) are no instruction.
  if (isBlank(instruction)) throw invalid(instructionFile, "is empty");

  const trees: Record<(typeof FILE_TREES)[number], FileSet> = { workspace: {}, solution: {}, tests: {} };
  const modes: Record<string, string> = {};
  for (const name of FILE_TREES) {
    const tree = await readTree(path.join(root, name), budget);
    trees[name] = tree.files;
    // The workspace's modes are part of what the agent is given (a script it must make
    // executable); the solution's and tests' scripts are the fleet's to run, and keep staging's
    // default, as suites written for it before modes travelled rely on. A file system without
    // exec bits (Windows) says nothing of modes.
    if (name !== "workspace" || process.platform === "win32") continue;
    for (const [rel, mode] of Object.entries(tree.modes)) modes[`${name}/${rel}`] = mode;
  }

  const verifierKind = config.verifier?.kind ?? "tests";
  if (verifierKind === "tests" && trees.tests["test.sh"] === undefined) {
    throw invalid(
      path.join(root, "tests", "test.sh"),
      'missing (a [verifier] kind = "tests" task runs tests/test.sh)',
    );
  }
  if (Object.keys(trees.solution).length > 0 && trees.solution["solve.sh"] === undefined) {
    throw invalid(path.join(root, "solution", "solve.sh"), "missing (solution/ must hold solve.sh)");
  }

  const input = toContent(root, tomlFile, config, instruction, trees);
  // Only when some file needs it: a task whose files all stage at the default keeps its digest.
  if (Object.keys(modes).length > 0) input.modes = modes;
  const parsed = TaskContent.safeParse(input);
  if (!parsed.success) {
    const fromDirName = config.task?.id === undefined;
    const isFile = (p: PropertyKey[]) => (FILE_TREES as readonly PropertyKey[]).includes(p[0] ?? "");
    // A refused file name says why (`leafIssues`), not zod's "Invalid key in record".
    const issues = leafIssues(parsed.error.issues);
    const lines = issues.map((issue) => {
      const key = issue.path.map(String).join(".");
      if (key === "id" && fromDirName) {
        return `the directory name "${path.basename(root)}" is not a valid task id (${issue.message}); set [task] id`;
      }
      // A file's problem names the file (`tests/test.sh`), not a dotted key.
      if (isFile(issue.path)) return `${issue.path.map(String).join("/")}: ${issue.message}`;
      return `${CONTENT_KEYS[key] ?? key}: ${issue.message}`;
    });
    // Named after the task directory when only its files are at fault, else after task.toml.
    const where = issues.every((i) => isFile(i.path)) ? root : tomlFile;
    throw invalid(where, lines.join("; "), parsed.error);
  }
  // What the dispatcher's limit counts: the task as sent, where a control character takes six
  // bytes (`\u0001`) and a newline two. Refused here, before a submission sends any of a suite.
  const size = taskSize(parsed.data);
  if (size > budget.max) {
    throw invalid(
      root,
      `task is ${size} bytes as sent (its JSON, where escaped characters take several bytes each), over the limit of ${budget.max}`,
    );
  }
  return parsed.data;
}

/** Where a TaskContent field comes from in task.toml, for error messages. */
const CONTENT_KEYS: Record<string, string> = {
  id: "[task] id",
  image: "[task] image",
  "timeouts.agentS": "[agent] timeout_sec",
  "timeouts.verifierS": "[verifier] timeout_sec",
  "verifier.expected": "[verifier] expected",
  "verifier.mode": "[verifier] mode",
};

const MISSING_TOML = "missing (every task needs a task.toml)";

/**
 * Why a directory without `task.toml` is a task that lacks one: `task.toml` spelled in another
 * case, or an `instruction.md` or a `workspace/`, `solution/` or `tests/` that is no task of its
 * own beside it. `undefined` when it does not look like a task at all.
 */
async function missingTaskToml(dir: string): Promise<string | undefined> {
  const entries = await readdir(dir, { withFileTypes: true }).catch(() => []);
  const misnamed = entries.find((e) => e.name !== "task.toml" && e.name.toLowerCase() === "task.toml");
  if (misnamed !== undefined) return `missing (found "${misnamed.name}"; the name must be exactly task.toml)`;
  for (const e of entries) {
    if (e.name === "instruction.md") return MISSING_TOML;
    const tree = (FILE_TREES as readonly string[]).includes(e.name) && e.isDirectory();
    if (tree && (await statOrNull(path.join(dir, e.name, "task.toml")).catch(() => null)) === null) {
      return MISSING_TOML;
    }
  }
  return undefined;
}

/**
 * Load every task of a suite: each sub-directory holding a `task.toml`, in name order. A
 * directory that is itself a task (or looks like one without its `task.toml`) loads as a suite
 * of one. Directories whose names start with `.` or `_` are skipped. All broken tasks are
 * reported together in one `invalid_task` error.
 */
export async function loadSuite(dir: string, options: LoadSuiteOptions = {}): Promise<TaskContent[]> {
  const only = options.only !== undefined && options.only.length > 0 ? new Set(options.only) : null;
  const root = path.resolve(dir);
  const rootToml = path.join(root, "task.toml");
  if ((await statOrNull(rootToml)) !== null) return [await loadTask(root, options)];
  const rootMissing = await missingTaskToml(root);
  if (rootMissing !== undefined) throw invalid(rootToml, rootMissing);
  let entries: Dirent[];
  try {
    entries = await readdir(root, { withFileTypes: true });
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    const why =
      code === "ENOENT"
        ? "no such directory"
        : code === "ENOTDIR"
          ? "not a directory (give a suite directory or a task directory)"
          : code === "EACCES" || code === "EPERM"
            ? `${code}: permission denied`
            : (code ?? String(err));
    throw invalid(root, `cannot read suite directory (${why})`, err);
  }
  const visible = entries.filter((e) => !e.name.startsWith(".") && !e.name.startsWith("_"));
  const dirs = visible
    .filter((e) => e.isDirectory())
    .map((e) => e.name)
    .sort();
  const loaded: Array<{ dir: string; task: TaskContent }> = [];
  // A symlinked task is refused like any symlink in a task (not skipped without a word); a link
  // to a regular file (a README kept elsewhere) is not a task, ignored as files there are.
  const problems: string[] = [];
  for (const e of visible) {
    if (!e.isSymbolicLink() || (only !== null && !only.has(e.name))) continue;
    const link = path.join(root, e.name);
    if ((await stat(link).catch(() => null))?.isFile()) continue;
    problems.push(`${link}: is a symlink (refused; copy the task into the suite)`);
  }
  for (const name of dirs) {
    const taskDir = path.join(root, name);
    try {
      if ((await statOrNull(path.join(taskDir, "task.toml"))) === null) {
        if (only !== null && !only.has(name)) continue;
        // A name that is not UTF-8 comes back with U+FFFD in it, and names no directory.
        if (name.includes("\uFFFD")) {
          problems.push(`${taskDir}: has a name that is not UTF-8 (rename it)`);
          continue;
        }
        const missing = await missingTaskToml(taskDir);
        problems.push(
          missing === undefined
            ? `${taskDir}: not a task directory (no task.toml; start its name with _ or . to keep it in the suite unloaded)`
            : `${path.join(taskDir, "task.toml")}: ${missing}`,
        );
        continue;
      }
      loaded.push({ dir: name, task: await loadTask(taskDir, options) });
    } catch (err) {
      // Not a task asked for, by its directory's name or by the id its task.toml declares (it
      // did not load, so that id is read on its own, as far as the file parses).
      if (only !== null && !only.has(name) && !only.has((await declaredId(taskDir)) ?? name)) continue;
      problems.push(err instanceof Error ? err.message : String(err));
    }
  }
  const seen = new Map<string, string>();
  for (const { dir: name, task } of loaded) {
    const other = seen.get(task.id);
    // With the tasks asked for, two others sharing an id are left out like any broken task.
    const asked =
      only === null || only.has(task.id) || only.has(name) || (other !== undefined && only.has(other));
    if (other !== undefined && asked)
      problems.push(`${root}: task id "${task.id}" is used twice (${other}, ${name})`);
    seen.set(task.id, name);
  }
  if (problems.length > 0) {
    throw new FleetError(
      "invalid_task",
      `${problems.length} broken task(s) in ${root}: ${problems.join(" | ")}`,
    );
  }
  if (loaded.length === 0) throw invalid(root, "no tasks found (expected sub-directories holding task.toml)");
  return loaded.map((l) => l.task);
}

/** The `[task] id` a task directory's task.toml declares, when it parses that far; else null. */
async function declaredId(taskDir: string): Promise<string | null> {
  try {
    // Read as a task's files are (never a FIFO's wait, a link's target or an endless file).
    const budget = { left: DEFAULT_MAX_TASK_BYTES, max: DEFAULT_MAX_TASK_BYTES };
    const raw = parseToml(await readText(path.join(taskDir, "task.toml"), budget, "missing")) as {
      task?: { id?: unknown };
    };
    return typeof raw.task?.id === "string" ? raw.task.id : null;
  } catch {
    return null;
  }
}

function parseConfig(file: string, text: string): TaskToml {
  let raw: unknown;
  try {
    raw = parseToml(text);
  } catch (err) {
    if (err instanceof TomlError) {
      const reason = err.message.split("\n")[0]?.replace(/^Invalid TOML document: /, "") ?? "parse error";
      throw invalid(file, `invalid TOML at line ${err.line}, column ${err.column}: ${reason}`, err);
    }
    throw invalid(file, "invalid TOML", err);
  }
  const parsed = TaskToml.safeParse(raw);
  if (!parsed.success) throw invalid(file, describeIssues(parsed.error).join("; "), parsed.error);
  return parsed.data;
}

function toContent(
  root: string,
  tomlFile: string,
  config: TaskToml,
  instruction: string,
  trees: Record<(typeof FILE_TREES)[number], FileSet>,
): TaskContentInput {
  const env = config.environment ?? {};
  const taskImage = config.task?.image;
  if (taskImage !== undefined && env.docker_image !== undefined && taskImage !== env.docker_image) {
    throw invalid(
      tomlFile,
      `[task] image ("${taskImage}") and [environment] docker_image ("${env.docker_image}") differ`,
    );
  }
  const image = taskImage ?? env.docker_image;
  if (image === undefined) throw invalid(tomlFile, "[task] image is required (the sandbox image to run in)");
  if (env.allow_internet === true) {
    throw invalid(
      tomlFile,
      "[environment] allow_internet = true is not supported: sandboxes have no network",
    );
  }

  const verifier = config.verifier ?? {};
  const kind = verifier.kind ?? "tests";
  let verifierSpec: TaskContentInput["verifier"];
  if (kind === "tests") {
    if (verifier.expected !== undefined || verifier.mode !== undefined) {
      throw invalid(tomlFile, '[verifier] expected/mode only apply to kind = "match"');
    }
    verifierSpec = { kind: "tests" };
  } else {
    if (verifier.expected === undefined)
      throw invalid(tomlFile, '[verifier] expected is required for kind = "match"');
    // A blank `expected`, a bad pattern or one an empty answer matches: the schema refuses them
    // (matchExpectedProblem, as the grader checks them), named as [verifier] expected.
    verifierSpec = { kind: "match", expected: verifier.expected, mode: verifier.mode ?? "exact" };
  }

  const metadata = toJson(config.metadata ?? {}, tomlFile, "[metadata]") as Record<string, unknown>;
  const hints = Object.fromEntries(
    (["cpus", "memory_mb", "storage_mb", "build_timeout_sec"] as const)
      .filter((k) => env[k] !== undefined)
      .map((k) => [k, env[k]]),
  );
  if (Object.keys(hints).length > 0) {
    if (metadata.environment !== undefined) {
      throw invalid(tomlFile, "[metadata] environment clashes with the [environment] hints recorded there");
    }
    metadata.environment = toJson(hints, tomlFile, "[environment]");
  }

  return {
    id: config.task?.id ?? path.basename(root),
    instruction,
    image,
    workspace: trees.workspace,
    solution: trees.solution,
    tests: trees.tests,
    timeouts: {
      ...(config.agent?.timeout_sec === undefined ? {} : { agentS: config.agent.timeout_sec }),
      ...(config.verifier?.timeout_sec === undefined ? {} : { verifierS: config.verifier.timeout_sec }),
    },
    verifier: verifierSpec,
    metadata,
  };
}

/**
 * How deep and how large a task's `[metadata]` may be. The task travels inside a rollout
 * request, which the dispatcher refuses nested past 64 levels or holding over 100,000 JSON values:
 * a task past these bounds is refused here, before a submission sends any of its suite, rather
 * than after the rows before it were admitted. Far above any metadata a task needs.
 */
export const MAX_TASK_METADATA_DEPTH = 32;
export const MAX_TASK_METADATA_VALUES = 10_000;

/**
 * TOML values → plain JSON values (dates as ISO strings). Refused: non-finite numbers, nesting
 * past `MAX_TASK_METADATA_DEPTH`, more than `MAX_TASK_METADATA_VALUES` values, and a
 * `constructor` table holding a `prototype` key, which the dispatcher's JSON parser refuses in a
 * request (as it does `__proto__`, which `TaskToml` refuses already).
 */
function toJson(value: unknown, file: string, where: string, seen = { values: 0 }, depth = 0): unknown {
  if (++seen.values > MAX_TASK_METADATA_VALUES) {
    throw invalid(file, `${where}: holds more than ${MAX_TASK_METADATA_VALUES} values`);
  }
  if (value instanceof TomlDate) return value.toISOString();
  if (typeof value === "number") {
    if (!Number.isFinite(value))
      throw invalid(file, `${where}: non-finite numbers (inf, nan) are not allowed`);
    return value;
  }
  if (typeof value === "bigint") return Number(value);
  if (typeof value !== "object" || value === null) return value;
  if (depth >= MAX_TASK_METADATA_DEPTH) {
    throw invalid(file, `${where}: nested more than ${MAX_TASK_METADATA_DEPTH} levels deep`);
  }
  if (Array.isArray(value)) return value.map((v, i) => toJson(v, file, `${where}[${i}]`, seen, depth + 1));
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(value)) {
    if (k === "constructor" && typeof v === "object" && v !== null && Object.hasOwn(v, "prototype")) {
      throw invalid(
        file,
        `${where}.constructor.prototype: a "constructor.prototype" key, which the dispatcher refuses in a request: rename it`,
      );
    }
    out[k] = toJson(v, file, `${where}.${k}`, seen, depth + 1);
  }
  return out;
}

interface Budget {
  left: number;
  max: number;
}

/** `file`'s lstat, or `null` when it does not exist; any other failure is `invalid_task` naming it. */
async function statOrNull(file: string): Promise<Stats | null> {
  try {
    return await lstat(file);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "ENOENT" || code === "ENOTDIR") return null;
    throw cannotRead(file, err);
  }
}

function cannotRead(file: string, err: unknown): FleetError {
  const code = (err as NodeJS.ErrnoException).code;
  const why = code === "EACCES" || code === "EPERM" ? `${code}: permission denied` : (code ?? String(err));
  return invalid(file, `cannot be read (${why})`, err);
}

async function readText(file: string, budget: Budget, missing: string): Promise<string> {
  return (await readTextFile(file, budget, missing, false)).text;
}

/**
 * `file`'s text and whether its owner may execute it. With `keepBom`, a leading byte order mark
 * stays part of the text (a task file is staged as it is on disk).
 *
 * The checks are made on the file as opened, not on its path before a read: a file swapped for
 * a symbolic link (`O_NOFOLLOW`), a FIFO (`O_NONBLOCK`: opening one would wait for a writer, and
 * the load with it) or a bigger file between a check and the read is refused, never read. With
 * `atPath` (`file` spelled from the task's real path), so is a file reached through a directory
 * above it swapped for a symbolic link after it was listed (`O_NOFOLLOW` guards only the last
 * name): where Linux says what was opened (`/proc/self/fd`), it must be `file` itself (its name
 * gone since, as an editor's save leaves it, is still `file`: it is read as opened).
 */
async function readTextFile(
  file: string,
  budget: Budget,
  missing: string,
  keepBom: boolean,
  atPath = false,
): Promise<{ text: string; executable: boolean }> {
  let handle: FileHandle;
  try {
    handle = await open(file, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "ENOENT" || code === "ENOTDIR") throw invalid(file, missing);
    if (code === "ELOOP") throw invalid(file, "is a symbolic link (tasks must hold regular files)");
    throw cannotRead(file, err);
  }
  let bytes: Buffer;
  let executable: boolean;
  try {
    const st = await handle.stat();
    if (!st.isFile()) throw invalid(file, "is not a regular file");
    if (atPath && process.platform === "linux") {
      const opened = await readlink(`/proc/self/fd/${handle.fd}`).catch(() => null);
      // A file whose name went after it was opened (an editor's save renames another over it) is
      // `<path> (deleted)` to Linux: still the file the walk spelled, read as opened.
      if (opened !== null && opened !== file && opened !== `${file} (deleted)`) {
        throw invalid(
          file,
          "is not where the walk found it as it was opened (a directory above it was swapped for a symbolic link, or moved, while the task was read): refused, never read; load the task again once it is still",
        );
      }
    }
    budget.left -= st.size;
    if (budget.left < 0)
      throw invalid(file, `task is over the limit of ${budget.max} bytes (its files, as read)`);
    executable = (st.mode & 0o100) !== 0;
    bytes = await readAtMost(handle, st.size).catch((err: unknown) => {
      throw cannotRead(file, err);
    });
    // Grown since its size was counted: what it holds now was not.
    if (bytes.length > st.size) throw invalid(file, "changed while it was read (read it again)");
  } finally {
    await handle.close().catch(() => undefined);
  }
  try {
    const text = new TextDecoder("utf-8", { fatal: true, ignoreBOM: keepBom }).decode(bytes);
    return { text, executable };
  } catch (err) {
    throw invalid(file, "is not UTF-8 text (binary files are not supported in tasks)", err);
  }
}

/** Up to `size + 1` bytes of an open file from its start (one more than `size` tells it grew). */
async function readAtMost(handle: FileHandle, size: number): Promise<Buffer> {
  const buf = Buffer.alloc(size + 1);
  let n = 0;
  while (n < buf.length) {
    const { bytesRead } = await handle.read(buf, n, buf.length - n, n);
    if (bytesRead === 0) break;
    n += bytesRead;
  }
  return buf.subarray(0, n);
}

/**
 * Every regular file under `dir` as a FileSet keyed by POSIX relative path (`{}` if `dir` is
 * absent), and the files whose mode is not the one staging gives by default: a file whose owner
 * may execute it is 755, any other 644, as git keeps them (the other bits depend on the umask of
 * whoever checked the task out, and would change its digest from one machine to the next).
 */
async function readTree(
  dir: string,
  budget: Budget,
): Promise<{ files: FileSet; modes: Record<string, string> }> {
  const files: FileSet = {};
  const modes: Record<string, string> = {};
  const st = await statOrNull(dir);
  if (st === null) return { files, modes };
  if (st.isSymbolicLink()) throw invalid(dir, "is a symbolic link (tasks must hold a directory here)");
  if (!st.isDirectory()) throw invalid(dir, "must be a directory");
  // Empty files take none of the size budget: past as many files and directories as a file set
  // may hold (`FileSet` counts them alike: each is an entry of the staging tar), the rest is not
  // read. A directory is counted as it is walked, so a tree of 100,000 directories is not walked
  // whole first.
  let count = 0;
  const counted = () => {
    if (++count > MAX_FILESET_ENTRIES) {
      throw invalid(path.dirname(dir), `${path.basename(dir)}: ${FILESET_TOO_LARGE}`);
    }
  };
  /** Read the files under `abs` into `files`; how many it read. */
  const walk = async (abs: string, rel: string): Promise<number> => {
    const listed = await readdir(abs, { withFileTypes: true }).catch((err: unknown) => {
      throw cannotRead(abs, err);
    });
    const entries = listed.sort((a, b) => (a.name < b.name ? -1 : 1));
    let read = 0;
    for (const entry of entries) {
      const childAbs = path.join(abs, entry.name);
      if (entry.name === ".git") throw invalid(childAbs, GIT_DATA);
      if (SKIPPED.has(entry.name) || entry.name.endsWith(".pyc")) continue;
      const childRel = rel === "" ? entry.name : `${rel}/${entry.name}`;
      if (entry.isDirectory()) {
        if (entry.name.includes("\uFFFD"))
          throw invalid(childAbs, "has a name that is not UTF-8 (rename it)");
        counted();
        const under = await walk(childAbs, childRel);
        if (under === 0) throw invalid(childAbs, EMPTY_DIRECTORY);
        read += under;
      } else if (entry.isSymbolicLink())
        throw invalid(childAbs, "is a symbolic link (tasks must hold regular files)");
      else if (entry.isFile()) {
        // Assigned to a plain object, this name would set its prototype: the file would vanish.
        if (childRel === "__proto__")
          throw invalid(childAbs, 'is named "__proto__", which a file set cannot hold: rename it');
        counted();
        // A name that is not UTF-8 comes back with U+FFFD in it, and names no file.
        const gone = entry.name.includes("\uFFFD")
          ? "has a name that is not UTF-8 (rename it)"
          : "vanished while reading";
        // `childAbs` is spelled from the task's real path (`loadTask`'s `realpath`).
        const { text, executable } = await readTextFile(childAbs, budget, gone, true, true);
        files[childRel] = text;
        read++;
        // Staged by default at 0755 when it starts with `#!` (`buildTar`), 0644 otherwise.
        if (executable !== text.startsWith("#!")) modes[childRel] = executable ? "755" : "644";
      } else throw invalid(childAbs, "is not a regular file");
    }
    return read;
  };
  await walk(dir, "");
  return { files, modes };
}
