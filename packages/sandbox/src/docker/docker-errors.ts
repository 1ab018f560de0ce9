import { capText, FleetError, isFleetError } from "@fleet/contracts";

/** What the provider was doing when a Docker call failed; decides what a 404/409 means. */
export type DockerOperation =
  | "create"
  | "start"
  | "exec"
  | "put"
  | "get"
  | "inspect"
  | "destroy"
  | "list"
  | "probe"
  | "kill";

/** The facts of a failed Docker call, read off a dockerode / Node error. */
export interface DockerErrorFacts {
  /** HTTP status from the daemon, when it answered. */
  statusCode: number | null;
  /** Node system error code (`ECONNREFUSED`, `ENOENT`, ...), or `TimeoutError`/`AbortError`. */
  code: string | null;
  /** The daemon's own message when it sent one, else the error message. */
  message: string;
}

/** Read the facts of anything a dockerode call threw. */
export function dockerErrorFacts(err: unknown): DockerErrorFacts {
  if (typeof err !== "object" || err === null) {
    return { statusCode: null, code: null, message: capText(String(err)) };
  }
  const e = err as {
    statusCode?: unknown;
    code?: unknown;
    name?: unknown;
    message?: unknown;
    json?: unknown;
  };
  const statusCode = typeof e.statusCode === "number" ? e.statusCode : null;
  let code: string | null = typeof e.code === "string" ? e.code : null;
  if (e.name === "TimeoutError" || e.name === "AbortError") code = e.name;
  const json = e.json as { message?: unknown } | null | undefined;
  const daemonMessage =
    json && typeof json === "object" && typeof json.message === "string" ? json.message : undefined;
  let message = daemonMessage ?? (typeof e.message === "string" ? e.message : String(err));
  if (code === "TimeoutError" || code === "AbortError")
    message = `request timed out or was aborted (${message})`;
  return { statusCode, code, message: capText(message.trim()) };
}

const NO_SUCH_CONTAINER = /no such container|is not running|is restarting|container .* is dead/i;
/** Paused (`docker pause`, a freezer): its processes are all there and resume on unpause. */
const PAUSED = /is paused/i;
const NO_SUCH_IMAGE = /no such image|pull access denied|repository does not exist|manifest unknown/i;
const NO_SUCH_NETWORK = /network .* not found|no such network/i;
const NO_SUCH_PATH = /could not find the file|no such file|not a directory/i;
const NAME_CONFLICT = /conflict|already in use/i;
/**
 * The daemon no longer knows an exec it started: it restarted (with live-restore the container
 * runs on, but exec instances are not restored). Not the sandbox's end: a retry finds out.
 */
const EXEC_FORGOTTEN = /no such exec instance/i;

/** The Docker outcome as one tag; `classifyDockerError` turns it into a FleetError. */
export type DockerErrorClass =
  | "daemon_unavailable"
  | "sandbox_gone"
  | "image_missing"
  | "network_missing"
  | "path_missing"
  | "name_conflict"
  | "bad_request";

/**
 * Classify a failed Docker call. Pure: unit-tested without a daemon.
 * - socket errors, timeouts, 5xx (other than "container not running"), a paused container, an exec
 *   the daemon forgot (404 "no such exec instance": it restarted) → `daemon_unavailable`
 * - 404 for a container / 409 or 500 "is not running" → `sandbox_gone`
 * - 404 "No such image" on create → `image_missing`; 404 network on create → `network_missing`
 * - 404 for a path in put/get → `path_missing`; 409 name in use on create → `name_conflict`
 * - other 4xx → `bad_request`
 */
export function classifyDockerFacts(facts: DockerErrorFacts, op: DockerOperation): DockerErrorClass {
  const { statusCode, message } = facts;
  if (statusCode === null) return "daemon_unavailable";
  // Never "gone": a kill that cannot exec in a paused sandbox has stopped nothing.
  if (PAUSED.test(message)) return "daemon_unavailable";
  if (statusCode === 404) {
    if (EXEC_FORGOTTEN.test(message)) return "daemon_unavailable";
    if (op === "create" && NO_SUCH_IMAGE.test(message)) return "image_missing";
    if (op === "create" && NO_SUCH_NETWORK.test(message)) return "network_missing";
    if ((op === "put" || op === "get") && NO_SUCH_PATH.test(message)) return "path_missing";
    if (op === "create" && !NO_SUCH_CONTAINER.test(message)) return "image_missing";
    return "sandbox_gone";
  }
  if (statusCode === 409) {
    if (op === "create" && NAME_CONFLICT.test(message)) return "name_conflict";
    return "sandbox_gone";
  }
  if (statusCode >= 500) {
    if (op !== "create" && NO_SUCH_CONTAINER.test(message)) return "sandbox_gone";
    return "daemon_unavailable";
  }
  if (statusCode === 400 && (op === "put" || op === "get") && NO_SUCH_PATH.test(message))
    return "path_missing";
  return "bad_request";
}

/**
 * Turn a failed Docker call into the FleetError the rest of the fleet understands:
 * `provider_unavailable` (retryable), `sandbox_lost` (final), `invalid_task` (final).
 * FleetErrors pass through unchanged.
 */
export function classifyDockerError(err: unknown, op: DockerOperation, subject = ""): FleetError {
  if (isFleetError(err)) return err as FleetError;
  const facts = dockerErrorFacts(err);
  const klass = classifyDockerFacts(facts, op);
  const where = subject ? ` (${subject})` : "";
  const detail = `${facts.statusCode === null ? (facts.code ?? "error") : `HTTP ${facts.statusCode}`}: ${facts.message}`;
  switch (klass) {
    case "daemon_unavailable":
      return FleetError.retryable("provider_unavailable", `docker ${op}${where} failed: ${detail}`, err);
    case "sandbox_gone":
      return FleetError.nonRetryable("sandbox_lost", `sandbox${where} is gone: ${detail}`, err);
    case "image_missing":
      return FleetError.nonRetryable(
        "invalid_task",
        // The daemon's own words name the image (`No such image: <ref>`); the subject is the container.
        `the task's sandbox image is not present on this Docker host (images are built offline, never pulled): ${detail}`,
        err,
      );
    case "network_missing":
      return FleetError.nonRetryable(
        "invalid_task",
        `sandbox network${where} does not exist: ${detail}`,
        err,
      );
    case "path_missing":
      return FleetError.nonRetryable(
        "invalid_task",
        `path${where} does not exist in the sandbox: ${detail}`,
        err,
      );
    case "name_conflict":
      return FleetError.retryable("provider_unavailable", `sandbox name${where} is in use: ${detail}`, err);
    case "bad_request":
      return FleetError.nonRetryable("invalid_task", `docker ${op}${where} rejected: ${detail}`, err);
    default:
      return assertNever(klass);
  }
}

function assertNever(x: never): never {
  throw new Error(`unhandled docker error class: ${String(x)}`);
}
