import type {
  CleanupReceipt,
  ExecOptions,
  ExecResult,
  FileSet,
  ProbeReport,
  ProviderName,
  SandboxHandle,
  SandboxSpecInput,
} from "@fleet/contracts";

/** Labels every fleet sandbox carries (DESIGN §5). */
export const LABEL_MANAGED = "fleet.managed";
export const LABEL_ROLLOUT = "fleet.rollout";
export const LABEL_OWNER = "fleet.owner";
export const LABEL_EXPIRES = "fleet.expires";
/**
 * Which fleet a sandbox belongs to (the apps set it to their Redis key prefix). A provider
 * given a scope labels what it creates with it and lists only those, so two fleets (or test
 * runs) sharing one Docker daemon never see, adopt or reap each other's sandboxes.
 */
export const LABEL_SCOPE = "fleet.scope";
/**
 * Which deployment of that fleet made it: an id each fleet keeps in its own Redis (the apps pass
 * it as the provider's `instance`). Two fleets that use the same key prefix, each with its own
 * Redis, on one Docker daemon share a scope; a janitor judges only its own fleet's sandboxes by
 * its records (another's rollouts are unknown to it, and would read as orphans), and another
 * fleet's only by their expiry.
 */
export const LABEL_INSTANCE = "fleet.instance";

/**
 * Whether `labels` name another deployment than `own` (`LABEL_INSTANCE`); never when either is
 * unknown (made by a release before the label, or a provider given no instance).
 */
export function madeByAnotherInstance(labels: Record<string, string>, own: string | undefined): boolean {
  const theirs = labels[LABEL_INSTANCE];
  return own !== undefined && theirs !== undefined && theirs !== own;
}

/** Fixed paths inside every sandbox. */
export const SANDBOX_PATHS = {
  /** The agent's writable working directory (a capped tmpfs of the sandbox's own; a volume when uncapped). */
  workspace: "/workspace",
  /** Task tests, staged only after the agent has stopped. */
  tests: "/tests",
  /** Reference solution, staged only for the oracle agent. */
  solution: "/solution",
  /** Verifier logs; a test may write `/logs/verifier/reward.txt`. */
  logs: "/logs",
} as const;

/** How hard `killProcesses` tries. */
export interface KillOptions {
  /**
   * One sweep whose exec is bounded by this many ms (a stop at shutdown, with seconds to spare),
   * instead of up to 3 of 30 s each and, on Docker, a reaper after them; a second one within the
   * same bound only when the first was killed as it ran. Unconfirmed when it runs out.
   */
  quickMs?: number;
  /**
   * A root sweep that first raises the sandbox's verify fence (`VERIFY_FENCE_FILE`) to this
   * epoch (a verify attempt's, from Redis: later attempts have higher ones), then kills: the
   * tests' runner of an older attempt that starts after it refuses to (it reads the fence
   * first), and one that started before it is a root process the sweep kills. The receipt's
   * `fenced` says the fence holds at least this epoch. A fence above it (a later attempt took the
   * sandbox over, this sweep landing late) stops the sweep before its next round:
   * `TestsSupersededError`.
   */
  fenceEpoch?: number;
  /**
   * A root sweep that stops, killing nothing more, once the sandbox's verify fence is above this
   * epoch (`TestsSupersededError`), without raising it: a verify attempt's sweep of its own tests
   * as it hands its job back, which, landing late, must not take a later attempt's tests for its
   * own. (`fenceEpoch` does this too, after raising the fence.)
   */
  refuseAbove?: number;
}

/**
 * The sandbox's verify fence: the epoch of the latest verify attempt that took the sandbox over
 * from an earlier one (`KillOptions.fenceEpoch`). In a directory of its own (`FENCE_MOUNT`),
 * owned by the keepalive's user, nobody, 0755, and written only as that user: the tests (root
 * without capabilities, running the agent's code) and the agent can read it, never write it.
 */
export const VERIFY_FENCE_DIR = "/run/fleet";
export const VERIFY_FENCE_FILE = `${VERIFY_FENCE_DIR}/verify-epoch`;

/**
 * Where the fleet's own commands in a sandbox start (kill sweeps, staging, reads, scratch
 * scrubs): never the default, `/workspace`, which is the agent's, and one it made unenterable
 * (`chmod 000 /workspace`) must not fail them (a failed sweep masks its rollout; a failed staging
 * step fails it, ungraded).
 */
export const OPS_CWD = "/";

/** The standard directories of a root filesystem (the sandbox's is read-only), as a PATH. */
export const STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/**
 * The environment of the fleet's own commands, which must never run the agent's programs: every
 * operation on a `SandboxExec` (sweeps, fence, staging, reads; the Docker provider binds it), the
 * scratch scrub, and the tests' runner's own commands. A Docker exec takes its PATH from the
 * image, and an image whose PATH holds a directory the agent can write (`/workspace/.venv/bin`)
 * ran the agent's `sh` in the sweep (its `remaining=0` confirmed a stop that never happened) and
 * its `mkdir` as root in the tests' runner (which wrote a reward). Bubblewrap sets this PATH for
 * every command.
 */
export const OPS_ENV: Readonly<Record<string, string>> = Object.freeze({ PATH: STANDARD_PATH });

/** The unprivileged user harness commands run as by default. */
export const AGENT_USER = "1000:1000";
/** Root inside the sandbox (no capabilities): used for staging and verification. */
export const ROOT_USER = "0:0";

/** Options of `SandboxProvider.put`. */
export interface PutOptions {
  /** `uid[:gid]` owning the files (and running the extraction); defaults by path. */
  user?: string;
  /** Mode of every file `modes` does not name (default: 0755 for a file starting with `#!`, else 0644). */
  mode?: number;
  /** Modes of single files (relative path, as `normalizeRelativePath` spells it → mode bits). */
  modes?: Readonly<Record<string, number>>;
  /** Empty `dir` first, proving nothing is left (see `SandboxProvider.put`). */
  replace?: boolean;
  /**
   * A verify attempt's epoch: touch nothing when the sandbox's verify fence holds a higher one
   * (a later attempt took the sandbox over): `TestsSupersededError`.
   */
  fenceEpoch?: number;
}

/**
 * A verify attempt found the sandbox taken over by a later one: its verify fence
 * (`VERIFY_FENCE_FILE`) holds `fence`, above this attempt's `epoch`. Nothing was started or
 * staged; the verification is the later attempt's.
 */
export class TestsSupersededError extends Error {
  override readonly name = "TestsSupersededError";
  constructor(
    readonly fence: number,
    readonly epoch: number,
  ) {
    super(
      `a later verify attempt (epoch ${fence}) took the sandbox over from this one (epoch ${epoch}); it did not start its tests`,
    );
  }
}

/** Options of `SandboxProvider.create`. */
export interface CreateOptions {
  /** Stop the create (see `SandboxProvider.create`). */
  signal?: AbortSignal;
}

/** A sandbox as `list` reports it. */
export interface SandboxInfo {
  handle: SandboxHandle;
  labels: Record<string, string>;
  running: boolean;
  createdAt: number;
}

/** A sandbox's named volume that no container uses (`listUnusedVolumes`). */
export interface UnusedVolumeInfo {
  name: string;
  labels: Record<string, string>;
  /** Epoch ms; NaN when the daemon did not say. */
  createdAt: number;
}

/**
 * Where model-directed commands run. Implementations: `DockerSandboxProvider`,
 * `BubblewrapSandboxProvider`; tests may use an in-memory one.
 *
 * Errors are `FleetError`s: `provider_unavailable` (retryable: daemon down, 5xx, timeout),
 * `sandbox_lost` (the sandbox is gone), `invalid_task` (missing image, invalid spec: final),
 * `isolation_refused` (final).
 */
export interface SandboxProvider {
  readonly name: ProviderName;
  /** This deployment's id (`LABEL_INSTANCE`), set on what it creates; undefined: none. */
  readonly instance?: string | undefined;
  /** Where this provider's sandboxes live (e.g. `unix:///var/run/docker.sock`). */
  readonly endpoint: string;
  /**
   * Create and start the sandbox. Aborted by `signal` (its worker shutting down, so that its
   * seed is handed back rather than held past the shutdown budget), it stops waiting and throws
   * retryable `provider_unavailable`; whatever it made by then is removed or left carrying its
   * labels, where `find` (the seed delivered again), a close and the janitor's label sweep find
   * it: the caller records its teardown intent before the create (DESIGN §2 rule 9).
   */
  create(spec: SandboxSpecInput, options?: CreateOptions): Promise<SandboxHandle>;
  /** Find a rollout's sandbox by label (for re-delivered seeds); `null` if none. */
  find(rolloutId: string, owner: SandboxHandle["owner"]): Promise<SandboxHandle | null>;
  exec(handle: SandboxHandle, argv: string[], options: ExecOptions): Promise<ExecResult>;
  /**
   * Write files (relative paths) under `dir` (absolute), creating directories. With `replace`,
   * whatever `dir` held is removed first, in the same step, and the put fails (final
   * `invalid_task`) when something there cannot be removed: `dir` then holds exactly `files`.
   */
  put(handle: SandboxHandle, dir: string, files: FileSet, options?: PutOptions): Promise<void>;
  /** Read one file; `null` if it does not exist. Capped at `maxBytes` (default 1 MiB). */
  get(handle: SandboxHandle, path: string, options?: { maxBytes?: number }): Promise<string | null>;
  /**
   * The isolation probe (DESIGN §5). Throws final `isolation_refused`, final `sandbox_lost` when
   * the sandbox no longer exists (destroyed, its PID 1 gone), or retryable `provider_unavailable`.
   */
  probe(handle: SandboxHandle, options?: { timeoutMs?: number }): Promise<ProbeReport>;
  /** Kill every process of `user` in the sandbox and confirm none remains. */
  killProcesses(handle: SandboxHandle, user?: string, options?: KillOptions): Promise<CleanupReceipt>;
  /** Destroy the sandbox and its volumes. Idempotent: already gone is a confirmed cleanup. */
  destroy(handle: SandboxHandle): Promise<CleanupReceipt>;
  /** Sandboxes carrying all of `labels` (plus `fleet.managed=true`). */
  list(labels?: Record<string, string>): Promise<SandboxInfo[]>;
  /** Whether the sandbox still exists and runs. */
  alive(handle: SandboxHandle): Promise<boolean>;
  /**
   * Remove this provider's helper containers (Docker's kill-sweep reapers) that are not running
   * and older than `olderThanMs`: one created but never started (its worker died between the
   * calls) does not remove itself. Returns how many went. For the janitor.
   */
  removeStaleHelpers?(olderThanMs: number): Promise<number>;
  /**
   * This provider's sandbox volumes (labelled as their sandbox: `fleet.managed=true`, its scope)
   * that no container uses: a destroy removes the container, then its volumes, so one cut off
   * between the two leaves the volume, which no container label leads back to. For the janitor.
   */
  listUnusedVolumes?(): Promise<UnusedVolumeInfo[]>;
  /**
   * Remove such a volume, unless a container uses it (false: the daemon refused). One gone
   * already counts as removed.
   */
  removeUnusedVolume?(name: string): Promise<boolean>;
  close?(): Promise<void>;
}
