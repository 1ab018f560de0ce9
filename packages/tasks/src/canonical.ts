import { createHash } from "node:crypto";
import { FleetError, TaskContent, type TaskContentInput } from "@fleet/contracts";

/**
 * Canonical JSON: object keys sorted (by UTF-16 code unit), no whitespace, `undefined`
 * properties dropped. Two values that mean the same give the same text, whatever order their
 * keys were written in. Non-finite numbers, functions, bigints and symbols are refused rather
 * than silently turned into `null`.
 */
export function canonicalJson(value: unknown): string {
  return write(value, "$");
}

function write(value: unknown, at: string): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "string":
    case "boolean":
      return JSON.stringify(value);
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`${at}: non-finite number has no canonical JSON form`);
      return JSON.stringify(value);
    case "object": {
      if (Array.isArray(value)) return `[${value.map((v, i) => write(v, `${at}[${i}]`)).join(",")}]`;
      if (value instanceof Date) return JSON.stringify(value.toISOString());
      const entries = Object.keys(value)
        .filter((k) => (value as Record<string, unknown>)[k] !== undefined)
        .sort()
        .map((k) => `${JSON.stringify(k)}:${write((value as Record<string, unknown>)[k], `${at}.${k}`)}`);
      return `{${entries.join(",")}}`;
    }
    default:
      throw new TypeError(`${at}: a ${typeof value} has no canonical JSON form`);
  }
}

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
  return createHash("sha256").update(canonicalTaskJson(task), "utf8").digest("hex");
}

/** Size in bytes of the task as stored (its canonical JSON, UTF-8): what the size limit counts. */
export function taskSize(task: TaskContentInput): number {
  return Buffer.byteLength(canonicalTaskJson(task), "utf8");
}
