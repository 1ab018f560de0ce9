import { canonicalJson, FleetError, sha256Hex, TaskContent, type TaskContentInput } from "@fleet/contracts";

export { canonicalJson };

/**
 * The canonical JSON of a task after parsing (defaults applied), i.e. exactly the text the
 * dispatcher stores. Throws `invalid_task` when the content does not parse.
 */
export function canonicalTaskJson(task: TaskContentInput): string {
  const parsed = TaskContent.safeParse(task);
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    const where = issue && issue.path.length > 0 ? `${issue.path.join(".")}: ` : "";
    throw new FleetError("invalid_task", `task content is invalid: ${where}${issue?.message ?? "unknown"}`, {
      cause: parsed.error,
    });
  }
  try {
    return canonicalJson(parsed.data);
  } catch (err) {
    throw new FleetError("invalid_task", `task content is not serialisable: ${(err as Error).message}`, {
      cause: err,
    });
  }
}

/** sha256 hex of the task's canonical JSON: the task's content address. Stable across key order. */
export function taskDigest(task: TaskContentInput): string {
  return sha256Hex(canonicalTaskJson(task));
}

/** Size in bytes of the task as stored (its canonical JSON, UTF-8): what the size limit counts. */
export function taskSize(task: TaskContentInput): number {
  return Buffer.byteLength(canonicalTaskJson(task), "utf8");
}
