import { createReadStream } from "node:fs";
import { realpath, stat } from "node:fs/promises";
import { resolve } from "node:path";
import { createInterface } from "node:readline";
import {
  AgentSpec,
  type AgentSpecInput,
  agentName,
  metadataOverLimit,
  type RolloutRequestInput,
  type TaskContent,
} from "@fleet/contracts";
import { z } from "zod";
import { stripBom, UsageError } from "./requests.ts";

/** What `--rerun` reads of each line of a results file (older results have the same fields). */
const RerunLine = z.object({
  /** The rollout's id: a rollout in the file twice (its results appended twice) is rerun once. */
  id: z.string().optional(),
  status: z.string(),
  taskId: z.string(),
  taskDigest: z.string(),
  agent: z.string(),
  metadata: z.record(z.string(), z.unknown()).nullable().optional(),
});
type RerunLine = z.infer<typeof RerunLine>;

/**
 * The results file's masked lines (`--rerun <file>`), read a line at a time (a results file of
 * a million rollouts is gigabytes): a usage error for a line that is no result. A rollout whose
 * line is in the file more than once (`fleet results <batch> >> file` run twice) is taken once:
 * each copy would be submitted again, the one masked rollout run twice.
 */
export async function maskedLines(path: string): Promise<{ masked: RerunLine[]; lines: number }> {
  const masked: RerunLine[] = [];
  const maskedIds = new Set<string>();
  let lines = 0;
  let n = 0;
  const input = createReadStream(path, { encoding: "utf8" });
  try {
    for await (const raw of createInterface({ input, crlfDelay: Number.POSITIVE_INFINITY })) {
      n++;
      if (raw.trim() === "") continue;
      lines++;
      let json: unknown;
      try {
        // The file's byte order mark, if it has one (see `stripBom`), is no part of its first line.
        json = JSON.parse(n === 1 ? stripBom(raw) : raw);
      } catch {
        throw new UsageError(`--rerun ${path}: line ${n} is not JSON (a results file is one result a line)`);
      }
      const line = RerunLine.safeParse(json);
      if (!line.success) {
        const issue = line.error.issues[0];
        throw new UsageError(
          `--rerun ${path}: line ${n} is not a result (${issue?.path.join(".") || "line"}: ${issue?.message})`,
        );
      }
      if (line.data.status !== "masked") continue;
      if (line.data.id !== undefined) {
        if (maskedIds.has(line.data.id)) continue;
        maskedIds.add(line.data.id);
      }
      masked.push(line.data);
    }
  } catch (err) {
    if (err instanceof UsageError) throw err;
    throw new UsageError(`cannot read --rerun ${path}: ${(err as Error).message}`);
  } finally {
    input.destroy();
  }
  return { masked, lines };
}

/**
 * Whether `out` names the file `rerun` reads: the same path spelt otherwise, a symbolic link or a
 * hard link to it. `--out` is renamed into place when the run is done, so it would replace the
 * results the rerun was made from.
 */
export async function isRerunFile(rerun: string, out: string): Promise<boolean> {
  const real = (p: string) => realpath(p).catch(() => resolve(p));
  if ((await real(rerun)) === (await real(out))) return true;
  const [a, b] = await Promise.all([stat(rerun).catch(() => null), stat(out).catch(() => null)]);
  return a !== null && b !== null && a.dev === b.dev && a.ino === b.ino;
}

export interface RerunOptions {
  /** The results file's path (for messages). */
  path: string;
  masked: readonly RerunLine[];
  /** The suite's tasks, as loaded. */
  tasks: readonly TaskContent[];
  agent: AgentSpecInput;
  /** The content address of a task (`taskDigest` of `@fleet/tasks`): checked when given. */
  digestOf?: (task: TaskContent) => string;
  deadlineS?: number;
  /** `--metadata`, over each line's own. */
  metadata?: Record<string, unknown>;
}

/**
 * One request for each masked line, with its task from the suite and its own metadata (the
 * repeat index with it), so the new results line up with the old. Refused (a usage error) for a
 * task the suite no longer has or whose content changed since, and for another agent than the
 * results': either would mix two experiments' rewards under one task.
 */
export function rerunRollouts(options: RerunOptions): RolloutRequestInput[] {
  if (options.metadata !== undefined && Object.hasOwn(options.metadata, "repeat")) {
    throw new UsageError(
      '--metadata must not set "repeat": with --rerun, each rollout keeps the repetition index of its results line',
    );
  }
  const byId = new Map(options.tasks.map((t) => [t.id, t]));
  // Once a task, not once a line: a rerun is many lines of few tasks, and a digest hashes them whole.
  const digests = new Map<string, string>();
  const digestOf = (task: TaskContent): string | null => {
    if (options.digestOf === undefined) return null;
    let digest = digests.get(task.id);
    if (digest === undefined) {
      digest = options.digestOf(task);
      digests.set(task.id, digest);
    }
    return digest;
  };
  const parsed = AgentSpec.safeParse(options.agent);
  const name = parsed.success ? agentName(parsed.data) : null;
  const requests: RolloutRequestInput[] = [];
  for (const line of options.masked) {
    const task = byId.get(line.taskId);
    if (task === undefined) {
      throw new UsageError(
        `--rerun ${options.path}: task ${line.taskId} is not in the suite (or not selected by --task)`,
      );
    }
    const now = digestOf(task);
    if (now !== null && now !== line.taskDigest) {
      throw new UsageError(
        `--rerun ${options.path}: task ${line.taskId} changed since those results (digest ${line.taskDigest}, now ${now}): its rewards would not compare`,
      );
    }
    if (name !== null && name !== line.agent) {
      throw new UsageError(
        `--rerun ${options.path}: its rollouts ran agent ${JSON.stringify(line.agent)}, --agent is ${JSON.stringify(name)}`,
      );
    }
    const metadata =
      line.metadata == null && options.metadata === undefined
        ? undefined
        : { ...line.metadata, ...options.metadata };
    const over = metadata === undefined ? null : metadataOverLimit(metadata);
    if (over !== null) {
      throw new UsageError(
        `--rerun ${options.path}: task ${line.taskId}'s rerun (its line's metadata${options.metadata === undefined ? "" : " and --metadata"}): ${over.message}`,
      );
    }
    const request: RolloutRequestInput = { task, agent: options.agent };
    if (metadata !== undefined) request.metadata = metadata;
    if (options.deadlineS !== undefined) request.deadlineS = options.deadlineS;
    requests.push(request);
  }
  return requests;
}
