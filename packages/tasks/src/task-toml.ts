import { JsonObject } from "@fleet/contracts";
import { z } from "zod";

/** A timeout in seconds: a finite, positive number (an `inf` or `nan` from TOML is refused). */
const TimeoutSec = z.custom<number>((v) => typeof v === "number" && Number.isFinite(v) && v > 0, {
  error: (issue) =>
    typeof issue.input !== "number"
      ? "must be a number of seconds"
      : Number.isFinite(issue.input)
        ? "must be positive"
        : "must be finite",
});

/**
 * The keys `task.toml` may carry. Close to Harbor's task.toml where Harbor has the key
 * (`version`, `[metadata]`, `[agent] timeout_sec`, `[verifier] timeout_sec`,
 * `[environment] docker_image`, resource hints); `[task]` and the `[verifier]` grading keys are
 * ours. Every table is strict: an unknown key is an error, never silently ignored.
 */
export const TaskToml = z.strictObject({
  /** Harbor's task schema version, e.g. `"1.0"`. Informational. */
  version: z.string().optional(),
  task: z
    .strictObject({
      /** Defaults to the task directory's name. */
      id: z.string().optional(),
      /** Sandbox image; must exist on the worker hosts. Same as `[environment] docker_image`. */
      image: z.string().optional(),
    })
    .optional(),
  agent: z.strictObject({ timeout_sec: TimeoutSec.optional() }).optional(),
  verifier: z
    .strictObject({
      timeout_sec: TimeoutSec.optional(),
      kind: z.enum(["tests", "match"]).optional(),
      expected: z.string().optional(),
      mode: z.enum(["exact", "regex"]).optional(),
    })
    .optional(),
  environment: z
    .strictObject({
      /** Harbor's name for the prebuilt image; same as `[task] image`. */
      docker_image: z.string().optional(),
      /** Sandboxes have no network; only `false` is accepted. */
      allow_internet: z.boolean().optional(),
      /** Harbor build timeout. Images are prebuilt here, so it is recorded, not used. */
      build_timeout_sec: z.number().optional(),
      /** Resource hints, recorded under `metadata.environment` (request `sandbox` overrides enforce limits). */
      cpus: z.number().optional(),
      memory_mb: z.number().optional(),
      storage_mb: z.number().optional(),
    })
    .optional(),
  /** Free values (no `__proto__` key: `JsonObject`). */
  metadata: JsonObject.optional(),
});
export type TaskToml = z.infer<typeof TaskToml>;

/** Render a zod issue path as TOML: `verifier.mode` → `[verifier] mode`. */
export function tomlPath(path: readonly PropertyKey[]): string {
  const parts = path.map(String);
  if (parts.length === 0) return "top level";
  if (parts.length === 1) return parts[0]!;
  return `[${parts.slice(0, -1).join(".")}] ${parts[parts.length - 1]}`;
}

/** One readable line per zod issue, unknown keys named. */
export function describeIssues(error: z.ZodError): string[] {
  return error.issues.map((issue) => {
    if (issue.code === "unrecognized_keys") {
      const where = issue.path.length === 0 ? "at the top level" : `in [${issue.path.map(String).join(".")}]`;
      const keys = issue.keys.map((k) => JSON.stringify(k)).join(", ");
      return `unknown key${issue.keys.length > 1 ? "s" : ""} ${keys} ${where}`;
    }
    return `${tomlPath(issue.path)}: ${issue.message}`;
  });
}
