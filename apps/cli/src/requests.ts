import {
  AgentSpec,
  type AgentSpecInput,
  metadataOverLimit,
  type RolloutRequestInput,
  type TaskContent,
} from "@fleet/contracts";

/** A mistake in what the user asked for (bad flag value, unknown task): exit 2, no stack. */
export class UsageError extends Error {
  override readonly name = "UsageError";
}

/** Agents that need no configuration, usable by bare name with `--agent`. */
export const NAMED_AGENTS: Readonly<Record<string, AgentSpecInput>> = {
  oracle: { harness: "oracle" },
};

/**
 * Resolve `--agent`: a bare name (`oracle`), inline JSON (`{"harness":"command",...}`), or the
 * path of a JSON file holding an AgentSpec. Validated against the contract, so a typo fails
 * here rather than as 422 on the server. Returns the spec as written (the server applies
 * defaults).
 */
export async function resolveAgent(
  value: string,
  readFile: (path: string) => Promise<string>,
): Promise<AgentSpecInput> {
  const trimmed = value.trim();
  const named = NAMED_AGENTS[trimmed];
  if (named !== undefined) return named;
  let source: string;
  let text: string;
  // JSON of any kind (`[1]`, `"oracle"`), not only an object: the spec it holds is refused as one
  // (not an object), rather than taken for a file name and called an unknown agent.
  if (/^[{["]/.test(trimmed)) {
    source = "inline --agent JSON";
    text = trimmed;
  } else {
    source = trimmed;
    try {
      // A byte order mark (Windows editors write one, as Windows PowerShell's `Out-File -Encoding
      // utf8` does) is no part of the JSON: `JSON.parse` refuses it, which read as "not valid
      // JSON" of a valid file.
      text = stripBom(await readFile(trimmed));
    } catch (err) {
      const code = (err as { code?: string }).code;
      if (code === "ENOENT") {
        // Written as a path (agents/x.json): the file is what is missing, not a name.
        if (/[/\\]|\.json$/i.test(trimmed)) {
          throw new UsageError(
            `no such agent file: ${trimmed} (an agent is ${Object.keys(NAMED_AGENTS).join(", ")}, ` +
              "a JSON file with an agent spec, or inline JSON)",
          );
        }
        throw new UsageError(
          `unknown agent "${trimmed}": expected ${Object.keys(NAMED_AGENTS).join(", ")}, ` +
            "a JSON file with an agent spec, or inline JSON",
        );
      }
      throw new UsageError(`cannot read agent file ${trimmed}: ${(err as Error).message}`);
    }
  }
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch (err) {
    throw new UsageError(`${source} is not valid JSON: ${(err as Error).message}`);
  }
  const parsed = AgentSpec.safeParse(json);
  if (!parsed.success) {
    const problems = parsed.error.issues.map((i) => `${i.path.join(".") || "(agent)"}: ${i.message}`);
    throw new UsageError(`${source} is not a valid agent spec: ${problems.join("; ")}`);
  }
  return json as AgentSpecInput;
}

/** `text` without a leading byte order mark (U+FEFF). */
export function stripBom(text: string): string {
  return text.charCodeAt(0) === 0xfeff ? text.slice(1) : text;
}

export interface BuildRolloutsOptions {
  tasks: readonly TaskContent[];
  agent: AgentSpecInput;
  /** Rollouts per task. @defaultValue 1 */
  repeat?: number;
  /** Only these task ids (all when empty or absent). */
  taskIds?: readonly string[];
  deadlineS?: number;
  /** Echoed into every result; `repeat` (the repetition index) is added. */
  metadata?: Record<string, unknown>;
}

/**
 * Task × repeat rollout requests, repetition-major (every task once, then every task again),
 * so a partly finished batch already covers every task.
 */
/** The tasks `--task` names (each once, in its order), or every task; a name not there is a usage error. */
export function selectTasks(
  tasks: readonly TaskContent[],
  taskIds?: readonly string[],
): readonly TaskContent[] {
  let selected = tasks;
  if (taskIds !== undefined && taskIds.length > 0) {
    const known = new Map(tasks.map((t) => [t.id, t]));
    const missing = taskIds.filter((id) => !known.has(id));
    if (missing.length > 0) {
      throw new UsageError(
        `unknown task ${missing.map((m) => `"${m}"`).join(", ")}; the suite has: ${[...known.keys()].join(", ")}`,
      );
    }
    selected = [...new Set(taskIds)].map((id) => known.get(id)!);
  }
  if (selected.length === 0) throw new UsageError("the suite has no tasks");
  return selected;
}

export function buildRollouts(options: BuildRolloutsOptions): RolloutRequestInput[] {
  const repeat = options.repeat ?? 1;
  if (!Number.isInteger(repeat) || repeat < 1)
    throw new UsageError("--repeat must be a positive whole number");
  const tasks = selectTasks(options.tasks, options.taskIds);
  if (options.metadata !== undefined && Object.hasOwn(options.metadata, "repeat")) {
    // Overwritten by the repetition index, it would come back changed without a word.
    throw new UsageError(
      '--metadata must not set "repeat": the CLI sets it to each rollout\'s repetition index',
    );
  }
  // The last repetition's index is the longest: its metadata is the largest sent.
  const over = metadataOverLimit({ ...options.metadata, repeat: repeat - 1 });
  if (over !== null) {
    // Refused before anything is sent: admitted in chunks, the first would go in before a later
    // one's 422.
    throw new UsageError(
      `--metadata is refused: with "repeat" added (${repeat - 1} at most) its ${over.message}`,
    );
  }
  const requests: RolloutRequestInput[] = [];
  for (let r = 0; r < repeat; r++) {
    for (const task of tasks) {
      const request: RolloutRequestInput = {
        task,
        agent: options.agent,
        metadata: { ...options.metadata, repeat: r },
      };
      if (options.deadlineS !== undefined) request.deadlineS = options.deadlineS;
      requests.push(request);
    }
  }
  return requests;
}

/** Bytes of `{"rollouts":[` + `]}` around a batch's rows (NDJSON needs fewer). */
export const BATCH_ENVELOPE_BYTES = 14;

/** Largest request body the CLI sends in one POST (kept under the dispatcher's body limit). */
export const DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024;

export interface ChunkOptions {
  /** @defaultValue `DEFAULT_MAX_REQUEST_BYTES` */
  maxBytes?: number;
  /**
   * The content address of an inline task (`taskDigest` from `@fleet/tasks`). When given, a
   * task already sent inline in an earlier chunk is sent as `{ "digest" }` in later ones: the
   * dispatcher stored it when it accepted that chunk. Without it every row carries its task.
   */
  digestOf?: (task: TaskContent) => string;
}

/**
 * Serialize requests into chunks of JSON lines, each chunk's body at most `maxBytes` (a single
 * request bigger than that goes alone; the server answers 413 if it is too big). Chunks must
 * be submitted in order, stopping at the first failure, for the digest references to hold.
 */
export function chunkRollouts(
  requests: readonly RolloutRequestInput[],
  options: ChunkOptions = {},
): string[][] {
  const maxBytes = options.maxBytes ?? DEFAULT_MAX_REQUEST_BYTES;
  const memo = new WeakMap<object, string>();
  const digestOf =
    options.digestOf === undefined
      ? undefined
      : (task: TaskContent): string => {
          let digest = memo.get(task);
          if (digest === undefined) {
            digest = options.digestOf!(task);
            memo.set(task, digest);
          }
          return digest;
        };
  const envelope = BATCH_ENVELOPE_BYTES;
  const chunks: string[][] = [];
  /** Digests of tasks sent inline in a chunk already closed (so stored by the time the next one is sent). */
  const stored = new Set<string>();
  let pendingDigests: string[] = [];
  let chunk: string[] = [];
  let bytes = envelope;
  const encode = (request: RolloutRequestInput): { line: string; digest: string | null } => {
    const task = request.task;
    if (digestOf === undefined || "digest" in task) return { line: JSON.stringify(request), digest: null };
    const digest = digestOf(task as TaskContent);
    if (stored.has(digest)) return { line: JSON.stringify({ ...request, task: { digest } }), digest: null };
    return { line: JSON.stringify(request), digest };
  };
  for (const request of requests) {
    let encoded = encode(request);
    let size = Buffer.byteLength(encoded.line) + 1;
    if (chunk.length > 0 && bytes + size > maxBytes) {
      chunks.push(chunk);
      for (const d of pendingDigests) stored.add(d);
      pendingDigests = [];
      chunk = [];
      bytes = envelope;
      encoded = encode(request);
      size = Buffer.byteLength(encoded.line) + 1;
    }
    chunk.push(encoded.line);
    bytes += size;
    if (encoded.digest !== null) pendingDigests.push(encoded.digest);
  }
  if (chunk.length > 0) chunks.push(chunk);
  return chunks;
}
