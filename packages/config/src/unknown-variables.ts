import { z } from "zod";
import { CliConfig, DispatcherConfig, JanitorConfig, WorkerConfig } from "./schemas.ts";

/**
 * `FLEET_` variables the project's own tooling reads, not an app: docker compose's
 * (`FLEET_IMAGE`, `FLEET_HTTP_PUBLISH`, the per-kind concurrencies it passes on as
 * `FLEET_CONCURRENCY`), the image build's, and the tests' and scripts'. One environment (a shell,
 * a `.env` file) often serves them and the apps alike: not misspellings.
 */
const TOOLING_VARIABLES = [
  "FLEET_IMAGE",
  "FLEET_HTTP_PUBLISH",
  "FLEET_PROMETHEUS_PUBLISH",
  "FLEET_REDIS_MAXMEMORY",
  "FLEET_SANDBOX_DOCKER_HOST",
  "FLEET_SANDBOX_DOCKER_CERT_DIR",
  "FLEET_RESOURCES_CONCURRENCY",
  "FLEET_AGENT_CONCURRENCY",
  "FLEET_VERIFIER_CONCURRENCY",
  "FLEET_BASE_IMAGE",
  "FLEET_DEBIAN_MIRROR",
  "FLEET_DEBIAN_SUITE",
  "FLEET_TEST_REDIS_PORT",
  "FLEET_TEST_LOG_LEVEL",
  "FLEET_WORKER_OPTIONS",
  "FLEET_KEEP_LOGS",
  "FLEET_FUZZ_RUNS",
  "FLEET_CHROMIUM",
] as const;

/**
 * Families of variables named by the operator: `FLEET_CREDENTIAL_<NAME>` and
 * `FLEET_CREDENTIAL_<NAME>_BASE_URL` (an agent worker's credentials), `FLEET_CHAOS_*` (the chaos
 * tests').
 */
const KNOWN_PREFIXES = ["FLEET_CREDENTIAL_", "FLEET_CHAOS_"] as const;

/** The environment variables a config schema reads (its object's keys, through refinements and transforms). */
export function variablesOf(schema: z.ZodType): string[] {
  if (schema instanceof z.ZodObject) return Object.keys(schema.shape);
  if (schema instanceof z.ZodPipe) return variablesOf(schema.in as z.ZodType);
  throw new TypeError("variablesOf: not an object schema (or a transform of one)");
}

/**
 * Every `FLEET_` variable any of the fleet's apps reads, and the tooling's: the union, since one
 * environment file usually serves every app (the dispatcher's `FLEET_HTTP_PORT` in a worker's
 * environment is no mistake).
 */
export const KNOWN_FLEET_VARIABLES: ReadonlySet<string> = new Set(
  [...appVariables(), ...TOOLING_VARIABLES].filter((v) => v.startsWith("FLEET_")),
);

function appVariables(): string[] {
  return [DispatcherConfig, WorkerConfig, JanitorConfig, CliConfig].flatMap((s) => variablesOf(s));
}

/** The apps' variables without the prefix (`REDIS_URL`, `DOCKER_HOST`): `FLEET_REDIS_URL` means one. */
const UNPREFIXED_VARIABLES: ReadonlySet<string> = new Set(
  appVariables().filter((v) => !v.startsWith("FLEET_")),
);

export interface UnknownVariable {
  /** The variable as set. */
  variable: string;
  /** The known variable closest to it, when one is close enough to be what was meant. */
  suggestion: string | null;
}

/**
 * The `FLEET_`-prefixed variables set in `env` that no app of the fleet reads (a misspelling is
 * otherwise silently ignored: `FLEET_CONCURENCY=64` runs with the default), each with the closest
 * known name when one is close (`FLEET_CONCURRENCY`). Sorted by name. Unset and empty values
 * count too: a compose file's `FLEET_X: ${FLEET_X:-}` names a variable.
 */
export function unknownFleetVariables(env: Record<string, string | undefined>): UnknownVariable[] {
  return Object.keys(env)
    .filter((v) => v.startsWith("FLEET_") && !KNOWN_FLEET_VARIABLES.has(v))
    .filter((v) => !KNOWN_PREFIXES.some((p) => v.startsWith(p) && v.length > p.length))
    .sort()
    .map((variable) => ({ variable, suggestion: closestKnown(variable) }));
}

/** What an app logs for one unknown variable. */
export function unknownVariableMessage(u: UnknownVariable): string {
  // A duration's unit said, so a value meant in another unit is not taken as it stands.
  const unit = u.suggestion?.endsWith("_MS")
    ? ", in milliseconds"
    : u.suggestion?.endsWith("_S")
      ? ", in seconds"
      : "";
  return `${u.variable} is not a variable of the fleet: it is ignored${u.suggestion ? ` (did you mean ${u.suggestion}${unit}?)` : ""}`;
}

/** Units a duration's name may be spelt with; the fleet's are `_MS` and `_S`. */
const UNIT_SUFFIX = /_(MS|S|SEC|SECS|SECOND|SECONDS|MSEC|MSECS|MILLIS|MILLISECOND|MILLISECONDS)$/;

/**
 * At an app's start: one warning per unknown `FLEET_` variable in `env` (a pino logger fits).
 * A warning, not a refusal: a variable of a newer or older version of the fleet in a shared
 * environment must not stop an app.
 */
export function warnUnknownVariables(
  env: Record<string, string | undefined>,
  logger: { warn(obj: object, msg: string): void },
): UnknownVariable[] {
  const unknown = unknownFleetVariables(env);
  for (const u of unknown) {
    logger.warn({ variable: u.variable, didYouMean: u.suggestion }, unknownVariableMessage(u));
  }
  return unknown;
}

/**
 * The known variable `variable` names without its unit (`FLEET_LOCK_DURATION`:
 * `FLEET_LOCK_DURATION_MS`), else the known variable nearest to it by edit distance (a letter left out, doubled,
 * swapped, or a wrong one; `_` counts as a letter), when it is at most 2 edits away, or 3 for
 * names of more than 20 characters; ties go to the first in alphabetical order. Else an app's
 * variable named with the prefix (`FLEET_REDIS_URL`: `REDIS_URL`), or a credential's misspelt
 * prefix (`FLEET_CREDENTAL_X`: `FLEET_CREDENTIAL_X`).
 */
function closestKnown(variable: string): string | null {
  // FLEET_LOCK_DURATION: a duration named without its unit (3 edits, past the limit below), or
  // with another spelling of one (FLEET_RESULT_TTL_SECONDS, FLEET_LOCK_DURATION_SEC).
  const base = variable.replace(UNIT_SUFFIX, "");
  for (const stem of base === variable ? [variable] : [base, variable]) {
    for (const unit of ["_MS", "_S"]) {
      if (KNOWN_FLEET_VARIABLES.has(`${stem}${unit}`)) return `${stem}${unit}`;
    }
  }
  const limit = variable.length > 20 ? 3 : 2;
  let best: { name: string; distance: number } | null = null;
  for (const name of [...KNOWN_FLEET_VARIABLES].sort()) {
    const d = editDistance(variable, name);
    if (d <= limit && (best === null || d < best.distance)) best = { name, distance: d };
  }
  if (best !== null) return best.name;
  // FLEET_REDIS_URL: a variable the apps read without the prefix.
  const bare = variable.slice("FLEET_".length);
  if (UNPREFIXED_VARIABLES.has(bare)) return bare;
  // FLEET_CREDENTAL_X: a credential with its prefix misspelt.
  const credential = "FLEET_CREDENTIAL_";
  const cut = variable.indexOf("_", "FLEET_".length);
  if (cut > 0 && cut + 1 < variable.length && editDistance(variable.slice(0, cut + 1), credential) <= 2) {
    return `${credential}${variable.slice(cut + 1)}`;
  }
  return null;
}

/** Optimal string alignment distance: insertions, deletions, substitutions, adjacent swaps. */
function editDistance(a: string, b: string): number {
  const rows: number[][] = Array.from({ length: a.length + 1 }, (_, i) =>
    Array.from({ length: b.length + 1 }, (_, j) => (i === 0 ? j : j === 0 ? i : 0)),
  );
  for (let i = 1; i <= a.length; i++) {
    for (let j = 1; j <= b.length; j++) {
      const cost = a[i - 1] === b[j - 1] ? 0 : 1;
      let d = Math.min(rows[i - 1]![j]! + 1, rows[i]![j - 1]! + 1, rows[i - 1]![j - 1]! + cost);
      if (i > 1 && j > 1 && a[i - 1] === b[j - 2] && a[i - 2] === b[j - 1]) {
        d = Math.min(d, rows[i - 2]![j - 2]! + 1);
      }
      rows[i]![j] = d;
    }
  }
  return rows[a.length]![b.length]!;
}
