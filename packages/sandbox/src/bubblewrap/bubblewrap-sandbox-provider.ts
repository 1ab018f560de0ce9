import { execFile, spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import {
  closeSync,
  existsSync,
  constants as fsConstants,
  fstatSync,
  openSync,
  readdirSync,
  readFileSync,
  readlinkSync,
  renameSync,
  statSync,
  writeFileSync,
  writeSync,
} from "node:fs";
import {
  access,
  chmod,
  chown,
  type FileHandle,
  link,
  lstat,
  mkdir,
  open,
  readdir,
  rename,
  rm,
  stat,
  writeFile,
} from "node:fs/promises";
import { hostname, constants as osConstants, totalmem } from "node:os";
import { basename, dirname, join, resolve } from "node:path";
import { promisify } from "node:util";
import {
  beforeStart,
  type CleanupReceipt,
  type ExecOptions,
  type ExecResult,
  type FileSet,
  FleetError,
  isFleetError,
  Millis,
  type ProbeReport,
  type SandboxHandle,
  type SandboxSpecInput,
  withTimeout,
} from "@fleet/contracts";
import type { Logger } from "@fleet/telemetry";
import {
  DEFAULT_SANDBOX_LIMITS,
  FENCE_MOUNT,
  isTmpfsPath,
  KEEPALIVE_IDS,
  KEEPALIVE_USER,
  SHM_MB,
  sandboxLabels,
  sandboxName,
  TMPFS_MOUNTS,
} from "../docker/container-config.ts";
import { deadlineArgv, envList, execOutcome, parseNumericUser } from "../exec-command.ts";
import {
  assertCoreutilsTimeout,
  assertIsolated,
  bySchema,
  checkProviderDefaults,
  DEFAULT_EXEC_DEFAULTS,
  type DefaultCheck,
  delay,
  EXEC_DEFAULTS_CHECKS,
  type ExecCall,
  type ExecDefaults,
  endWithStdin,
  execResult,
  extractViaExec,
  findSandbox,
  getTarget,
  hostProbeFacts,
  killProcessesViaExec,
  parseExecOptions,
  parseSandboxSpec,
  planPut,
  probeExecCall,
  probeStdout,
  readViaExec,
  SANDBOX_LIMITS_CHECKS,
  sentinelProbeLine,
  TIMEOUT_PROBE_LINE,
  WORKSPACE_PROBE_LINE,
} from "../exec-ops.ts";
import { execOutputBuffers } from "../output.ts";
import {
  AGENT_USER,
  type CreateOptions,
  type KillOptions,
  LABEL_MANAGED,
  LABEL_OWNER,
  LABEL_ROLLOUT,
  LABEL_SCOPE,
  madeByAnotherInstance,
  type PutOptions,
  ROOT_USER,
  SANDBOX_PATHS,
  type SandboxInfo,
  type SandboxProvider,
} from "../provider.ts";
import { SCRATCH_PROBE_LINE } from "../scratch.ts";
import {
  bwrapArgv,
  HOST_HELPER_ENV,
  NSENTER_PROC_ENTRIES,
  type NsenterFiles,
  nsenterArgv,
  SANDBOX_PATH_ENV,
  unsupportedSpec,
} from "./bwrap-args.ts";
import {
  cgroupOomKills,
  cgroupProcesses,
  createSandboxCgroups,
  freezerState,
  HOST_BASH,
  moveIntoCgroups,
  removeCgroups,
  type SandboxCgroup,
  sandboxCgroupDirs,
  sandboxExecArgv,
} from "./cgroup.ts";

/** Provider-wide defaults; every field optional in the constructor. */
export interface BubblewrapSandboxDefaults extends ExecDefaults {
  /** Size of each tmpfs (`/tmp`, `/tests`, `/solution`, `/logs`). @defaultValue 256 */
  tmpfsMb: number;
  /** Memory limit (cgroup v1 memory controller, swap included), where enforceable. @defaultValue 1024 */
  memoryMb: number;
  /** Process limit (cgroup v1 pids controller), where enforceable. @defaultValue 256 */
  pidsLimit: number;
  /** How long `create` waits for bwrap to report its sandbox's PID 1. @defaultValue 10_000 */
  startTimeoutMs: number;
}

export const DEFAULT_BUBBLEWRAP_SANDBOX_DEFAULTS: Readonly<BubblewrapSandboxDefaults> = Object.freeze({
  ...DEFAULT_EXEC_DEFAULTS,
  tmpfsMb: DEFAULT_SANDBOX_LIMITS.tmpfsMb,
  memoryMb: DEFAULT_SANDBOX_LIMITS.memoryMb,
  pidsLimit: DEFAULT_SANDBOX_LIMITS.pidsLimit,
  startTimeoutMs: 10_000,
});

const BUBBLEWRAP_DEFAULTS_CHECKS: Readonly<Record<keyof BubblewrapSandboxDefaults, DefaultCheck>> =
  Object.freeze({
    ...EXEC_DEFAULTS_CHECKS,
    tmpfsMb: SANDBOX_LIMITS_CHECKS.tmpfsMb,
    memoryMb: SANDBOX_LIMITS_CHECKS.memoryMb,
    pidsLimit: SANDBOX_LIMITS_CHECKS.pidsLimit,
    startTimeoutMs: bySchema(Millis),
  });

export interface BubblewrapSandboxProviderOptions {
  /** Host directory of the unpacked base rootfs (see `unpackRootfs`), mounted read-only at `/`. */
  rootfs: string;
  /**
   * Where sandbox state (`<name>.json`) and per-sandbox directories (the workspace) live; any
   * process on the host pointed at the same directory sees the same sandboxes.
   * Apps pass `${FLEET_STATE_DIR:-/var/lib/rollout-fleet}/bwrap`.
   */
  stateDir: string;
  logger?: Logger;
  defaults?: Partial<BubblewrapSandboxDefaults>;
  /** This fleet's name (`LABEL_SCOPE`): set on every sandbox created; `list`/`find` see only these. */
  scope?: string;
  /** This deployment's id (`LABEL_INSTANCE`): set on every sandbox created. */
  instance?: string;
  /** `bwrap` executable. @defaultValue "bwrap" */
  bwrapPath?: string;
  /** `nsenter` executable (util-linux). @defaultValue "nsenter" */
  nsenterPath?: string;
}

/** What every exec runs from the rootfs (`nsenterArgv`, `deadlineArgv`), by its path there. */
const ROOTFS_NEEDS = ["usr/bin/setpriv", "usr/bin/env", "usr/bin/timeout", "bin/sh"] as const;

/** Whether `file` is an executable: a path as it is, a bare name on the sandbox PATH. */
async function onPath(file: string): Promise<boolean> {
  const candidates = file.includes("/") ? [file] : SANDBOX_PATH_ENV.split(":").map((d) => join(d, file));
  for (const candidate of candidates) {
    try {
      await access(candidate, fsConstants.X_OK);
      return true;
    } catch {}
  }
  return false;
}

/** What a sandbox's state file holds: enough for any process on the host to reach it. */
interface BwrapState {
  version: 1;
  id: string;
  name: string;
  rolloutId: string;
  owner: SandboxHandle["owner"];
  labels: Record<string, string>;
  /** The `bwrap` process we spawned (its own session and process group). */
  bwrapPid: number;
  /**
   * The sandbox's PID 1 as a host pid (bwrap's `child-pid`), the target of `nsenter`; 0 while the
   * sandbox starts (the state is written before bwrap is spawned, so a creator that dies during
   * the start leaves a state that `list`, `destroy` and the next `create` find: its processes are
   * then found by `SANDBOX_ID_ENV` in their environment).
   */
  initPid: number;
  /** `/proc/<pid>/stat` start times, so a recycled pid is never mistaken for the sandbox. */
  bwrapStart: string;
  initStart: string;
  workspaceDir: string;
  /** The sandbox's cgroups (memory, pids) and the limits that could not be enforced. */
  cgroups: SandboxCgroup[];
  unenforced: string[];
  createdAt: number;
  expiresAt: number;
}

interface RunOptions extends ExecCall {
  env?: Readonly<Record<string, string>>;
  cwd?: string | undefined;
  /** Run outside the sandbox's cgroups (the kill sweep must start even at the pids limit). */
  outsideCgroups?: boolean;
  /** Keep the output's last half-cap too (commands); not for the provider's own reads. */
  keepTail?: boolean;
}

/**
 * Set in bwrap's environment to the state's id: bwrap, its PID 1 (a fork of it, in a session of
 * its own) and the keepalive inherit it, so a sandbox whose creator died before learning its PID 1
 * can still be found and killed. Commands run in the sandbox never see it (`env -i`).
 */
export const SANDBOX_ID_ENV = "FLEET_BWRAP_SANDBOX_ID";

/** How long output is still read after the command exited while something holds its pipes. */
const EXIT_DRAIN_MS = 200;

/** How often an exec's host-side `nsenter` is looked at, to resume it once stopped (see `run`). */
const NSENTER_RESUME_MS = 100;

/**
 * `SandboxProvider` on bubblewrap, for hosts without a Docker daemon. A sandbox is a detached
 * `bwrap` process tree (private pid/net/ipc/uts/cgroup/mount namespaces, read-only rootfs,
 * tmpfs staging mounts, a bound workspace directory, no capabilities) whose state is a JSON
 * file under `stateDir`; `exec` enters it with `nsenter` + the sandbox's own `setpriv`.
 * Needs root on the host (uids inside are the host's; no user namespace). Memory, CPU, pids and
 * workspace-size limits are not enforced (see README).
 */
export class BubblewrapSandboxProvider implements SandboxProvider {
  readonly name = "bubblewrap" as const;
  readonly endpoint: string;
  readonly defaults: Readonly<BubblewrapSandboxDefaults>;
  readonly scope: string | undefined;
  readonly instance: string | undefined;
  readonly rootfs: string;
  readonly stateDir: string;
  private readonly logger: Logger | undefined;
  private readonly bwrapPath: string;
  private readonly nsenterPath: string;
  private passwd: Map<string, { uid: string; gid: string; home: string }> | null = null;

  constructor(options: BubblewrapSandboxProviderOptions) {
    if (!options.rootfs || !options.stateDir) {
      throw FleetError.nonRetryable("invalid_task", "the bubblewrap provider needs a rootfs and a stateDir");
    }
    this.rootfs = options.rootfs;
    this.stateDir = options.stateDir;
    this.scope = options.scope || undefined;
    this.instance = options.instance || undefined;
    this.logger = options.logger;
    this.defaults = Object.freeze({ ...DEFAULT_BUBBLEWRAP_SANDBOX_DEFAULTS, ...options.defaults });
    checkProviderDefaults("bubblewrap", this.defaults, BUBBLEWRAP_DEFAULTS_CHECKS);
    this.bwrapPath = options.bwrapPath ?? "bwrap";
    this.nsenterPath = options.nsenterPath ?? "nsenter";
    this.endpoint = `bwrap://${hostname()}`;
  }

  /** Whether the rootfs has the verify fence's mount point, a directory: looked at once. */
  private fenceMount: boolean | undefined;
  private rootfsHasFenceMount(): boolean {
    if (this.fenceMount === undefined) {
      try {
        this.fenceMount = statSync(join(this.rootfs, FENCE_MOUNT.path)).isDirectory();
      } catch {
        this.fenceMount = false;
      }
    }
    return this.fenceMount;
  }

  async create(input: SandboxSpecInput, options: CreateOptions = {}): Promise<SandboxHandle> {
    const { signal } = options;
    // Stopped (its worker shutting down): between its steps, and while it waits for the sandbox
    // to start. What it made by then is removed as for a create that failed (all of it on this
    // host, at once: no daemon to wait on).
    const stopIfAsked = () => {
      if (signal?.aborted) {
        throw FleetError.retryable(
          "provider_unavailable",
          `the create of a sandbox for rollout ${input.rolloutId} was stopped`,
        );
      }
    };
    stopIfAsked();
    const spec = parseSandboxSpec(input);
    const unsupported = unsupportedSpec(spec);
    if (unsupported) {
      throw FleetError.nonRetryable("invalid_task", `the bubblewrap provider cannot give ${unsupported}`);
    }
    const tmpfsMb = spec.options.tmpfsMb ?? this.defaults.tmpfsMb;
    // The processes' memory plus the tmpfs mounts' caps, whose files are charged to the same
    // cgroup: a full tmpfs is ENOSPC for its writer, not an OOM kill of the whole sandbox.
    const memoryMb =
      (spec.options.memoryMb ?? this.defaults.memoryMb) + TMPFS_MOUNTS.length * tmpfsMb + SHM_MB;
    // More than the host has is no limit: its agent could take the memory of the host and every
    // other sandbox on it. Refused as the Docker provider does (final, the task's options).
    const hostMb = Math.floor(totalmem() / 2 ** 20);
    if (memoryMb > hostMb) {
      throw FleetError.nonRetryable(
        "invalid_task",
        `the sandbox's memory limit (${memoryMb} MiB: its memoryMb plus what its tmpfs mounts may hold, from the task's sandbox options) is more than the sandbox host has (${hostMb} MiB)`,
      );
    }
    // The host's preflight, as `list` (a worker's start) runs it: a host that lost a tool since,
    // or a provider used without that start, fails here with the host's fault (retryable: another
    // host can run the rollout), not with a sandbox nothing can exec in or whose root is the host's.
    const problem = await this.hostProblem();
    if (problem !== null) throw FleetError.retryable("provider_unavailable", problem);
    const name = sandboxName(spec.rolloutId, spec.owner, this.scope);
    const existing = await this.readState(name);
    if (existing) {
      if (
        existing.labels[LABEL_SCOPE] !== this.scope ||
        madeByAnotherInstance(existing.labels, this.instance)
      ) {
        // Another fleet's (or, unscoped, any fleet's; or another deployment's with this scope, a
        // rollout id both were given): neither ours to take over nor to remove.
        throw FleetError.nonRetryable(
          "invalid_task",
          `sandbox name ${name} is taken by a sandbox that is not this fleet's`,
        );
      }
      if (
        existing.rolloutId === spec.rolloutId &&
        existing.owner === spec.owner &&
        this.stateAlive(existing)
      ) {
        this.logger?.info({ sandbox: name }, "sandbox already existed; reusing it");
        return this.handleOf(existing);
      }
      await this.destroyState(existing); // a dead leftover of a re-delivered create
    }

    await mkdir(this.stateDir, { recursive: true, mode: 0o700 });
    // Its directory and cgroups are named by its id as well as its name: a stale create of the
    // same rollout (a redelivered seed) can never bind, fill or remove the newer one's.
    const id = randomUUID();
    const dir = join(this.stateDir, `${name}-${id.slice(0, 8)}`);
    const workspaceDir = join(dir, "workspace");
    const fenceDir = this.rootfsHasFenceMount() ? join(dir, "fence") : undefined;
    // The Docker provider's labels, so the janitor reads both providers' sandboxes alike.
    const labels = sandboxLabels(spec, this.scope, this.instance);
    const args = bwrapArgv({
      rootfs: this.rootfs,
      workspaceDir,
      hostname: "sandbox",
      tmpfsMb,
      infoFd: 3,
      hostPid: spec.options.pidMode === "host",
      // This host's /proc is the same kernel's as the sandbox's.
      procHas: (path) => existsSync(path),
      ...(fenceDir ? { fenceDir } : {}),
    });
    // Written before anything is made (no pids yet), again once bwrap runs and once the sandbox
    // is ready: a creator that dies at any point leaves something to find and destroy. Each
    // write after the first checks the name is still this create's (a newer create or a destroy
    // took it otherwise: this one then kills what it started and fails).
    const cgroupName = `${name}-${id.slice(0, 8)}`;
    const state: BwrapState = {
      version: 1,
      id,
      name,
      rolloutId: spec.rolloutId,
      owner: spec.owner,
      labels,
      bwrapPid: 0,
      initPid: 0,
      bwrapStart: "",
      initStart: "",
      workspaceDir,
      // The ones it will make, before they are made (a creator that dies in between leaves them
      // to the next destroy); the ones made once they are.
      cgroups: sandboxCgroupDirs(cgroupName),
      unenforced: [],
      createdAt: Date.now(),
      expiresAt: spec.expiresAt,
    };
    const stillOurs = (current: BwrapState | null) => {
      if (current?.id !== id) {
        throw FleetError.retryable("provider_unavailable", `sandbox ${name} was taken over while it started`);
      }
    };
    let written = false;
    try {
      await this.writeState(state);
      written = true;
      stopIfAsked();
      // Root's alone, whatever the state directory's mode (an operator's `mkdir -p` makes it
      // 0755), and whatever this process's umask: what the sandbox leaves in its workspace is no
      // host user's to reach. Root in the sandbox (the tests, running the agent's code) makes a
      // program there setuid root, which a host user ran as root by its host path; the sandbox
      // itself enters its workspace by the bind, never through this directory.
      await mkdir(dir, { mode: 0o700 });
      await chmod(dir, 0o700);
      await mkdir(workspaceDir, { mode: 0o755 });
      const [uid, gid] = AGENT_USER.split(":").map(Number) as [number, number];
      await chown(workspaceDir, uid, gid);
      // Whatever this process's umask (mkdir's mode is masked by it): bwrap, root without
      // capabilities by then, enters it for --chdir, and so do the tests, as root.
      await chmod(workspaceDir, 0o755);
      if (fenceDir) {
        await mkdir(fenceDir);
        await chown(fenceDir, KEEPALIVE_IDS.uid, KEEPALIVE_IDS.gid);
        // Whatever this process's umask: root in the sandbox (no capabilities) must enter it.
        await chmod(fenceDir, Number.parseInt(FENCE_MOUNT.mode, 8));
      }
      const { cgroups, missing } = await createSandboxCgroups(cgroupName, {
        memoryMb,
        pidsLimit: spec.options.pidsLimit ?? this.defaults.pidsLimit,
      });
      state.cgroups = cgroups;
      state.unenforced = [...missing.map((m) => `${m.split(" ")[0]} limit (${m})`), "cpus", "workspace size"];
      stillOurs(await this.readState(name));
      await this.writeState(state);
      stopIfAsked();
      const { bwrapPid, initPid, detach, drained } = await this.spawnBwrap(
        args,
        join(dir, "bwrap.log"),
        state,
        (pid) => {
          state.bwrapPid = pid;
          state.bwrapStart = startTime(pid) ?? "";
          stillOurs(this.readStateSync(name));
          this.writeStateSync(state);
        },
      );
      try {
        await this.waitUntilReady(name, initPid, join(dir, "bwrap.log"), drained, stopIfAsked);
      } finally {
        detach();
      }
      await moveIntoCgroups(cgroups, [bwrapPid, initPid, ...childrenOf(initPid)]);
      const initStart = startTime(initPid);
      if (initStart === null) {
        throw FleetError.retryable("provider_unavailable", `sandbox ${name} died while it started`);
      }
      state.initPid = initPid;
      state.initStart = initStart;
      stillOurs(await this.readState(name));
      await this.writeState(state);
      // A destroy (a worker closing the rollout, or a newer create of the name) may have read the
      // state before this write, killed the sandbox and removed its files, which the write then
      // put back: its handle would be a dead sandbox's, whose first exec is a final
      // `sandbox_lost` for a create a retry gets right. Its files go, and the create fails.
      if (!this.stateAlive(state)) {
        throw FleetError.retryable("provider_unavailable", `sandbox ${name} was destroyed while it started`);
      }
    } catch (err) {
      // A newer create (or a destroy) that took the name removes this one's directory as a dead
      // leftover: what failed then (its bwrap log, its workspace) failed for that, and says so.
      // Not a create whose own first write failed (a full disk): no state of its was there to take.
      const current =
        !isFleetError(err) && written ? await this.readState(name).catch(() => undefined) : undefined;
      const takenOver = current !== undefined && current?.id !== id;
      await this.destroyState(state).catch((e: unknown) =>
        this.logger?.warn(
          { sandbox: name, err: String(e) },
          "could not clean up a sandbox that failed to start",
        ),
      );
      if (isFleetError(err)) throw err;
      if (takenOver) {
        throw FleetError.retryable(
          "provider_unavailable",
          `sandbox ${name} was taken over while it started`,
          err,
        );
      }
      throw FleetError.retryable(
        "provider_unavailable",
        `sandbox ${name} failed to start: ${String(err)}`,
        err,
      );
    }
    this.logger?.debug(
      { sandbox: name, initPid: state.initPid, rolloutId: spec.rolloutId },
      "sandbox created",
    );
    return this.handleOf(state);
  }

  /**
   * Start bwrap in its own session (it outlives this process) and read its PID 1 from `--info-fd`.
   * `spawned` gets bwrap's pid synchronously, before anything else can happen to this process.
   *
   * bwrap's output (why a start failed) comes through pipes this process copies to `logPath`, up
   * to `BWRAP_LOG_MAX_BYTES`, until `detach()` (the sandbox ready, or its start failed) closes
   * them. Not the log file itself: the sandbox's PID 1 keeps bwrap's stdout and stderr, and root
   * in the sandbox (the tests, running the agent's code) can write to `/proc/1/fd/1`, which grew
   * a host file without bound. Past `detach()` such a write fails (EPIPE).
   */
  private spawnBwrap(
    args: string[],
    logPath: string,
    state: Pick<BwrapState, "id" | "name">,
    spawned: (pid: number) => void,
  ): Promise<{ bwrapPid: number; initPid: number; detach(): void; drained(): Promise<void> }> {
    const { name } = state;
    const log = openSync(logPath, "a");
    const child = spawn(this.bwrapPath, args, {
      detached: true,
      stdio: ["ignore", "pipe", "pipe", "pipe"],
      env: { PATH: SANDBOX_PATH_ENV, [SANDBOX_ID_ENV]: state.id },
    });
    let logged = 0;
    let logOpen = true;
    const copy = (chunk: Buffer) => {
      if (!logOpen || logged >= BWRAP_LOG_MAX_BYTES) return;
      const part = chunk.subarray(0, BWRAP_LOG_MAX_BYTES - logged);
      logged += part.length;
      try {
        writeSync(log, part);
      } catch {}
    };
    const output = [child.stdout!, child.stderr!];
    for (const stream of output) stream.on("data", copy);
    // Both pipes read to their end (every writer gone: bwrap and the sandbox's PID 1 exited).
    const ended = Promise.all(
      output.map((stream) => new Promise<void>((resolve) => stream.once("close", () => resolve()))),
    );
    /** Once bwrap's output is all in the log, or 1 s at most (a writer may live on). */
    const drained = () => Promise.race([ended.then(() => undefined), delay(1_000)]);
    const detach = () => {
      for (const stream of output) stream.destroy();
      if (logOpen) {
        logOpen = false;
        closeSync(log);
      }
    };
    try {
      if (child.pid !== undefined) spawned(child.pid);
    } catch (err) {
      detach();
      throw err;
    }
    const info = child.stdio[3] as NodeJS.ReadableStream & { destroy(): void };
    return new Promise((resolve, reject) => {
      let text = "";
      let settled = false;
      const fail = (message: string, err?: unknown) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        info.destroy();
        if (child.pid !== undefined) killQuietly(-child.pid);
        detach();
        let logText = "";
        try {
          logText = readFileSync(logPath, "utf8").slice(-2000).trim();
        } catch {}
        const detail = `${message}${logText ? `: ${logText}` : ""}`;
        reject(
          // The host's, not the task's: retried (and held by the breaker, whose probe says so).
          (err as NodeJS.ErrnoException | undefined)?.code === "ENOENT"
            ? FleetError.retryable("provider_unavailable", `bwrap is not installed: ${detail}`, err)
            : FleetError.retryable("provider_unavailable", `sandbox ${name} failed to start: ${detail}`, err),
        );
      };
      const timer = setTimeout(
        () => fail("bwrap did not report its child pid in time"),
        this.defaults.startTimeoutMs,
      );
      child.once("error", (err) => fail(String(err), err));
      // On `close`, once its output is all copied to the log (`exit` may come before it).
      child.once("close", (code, signal) => fail(`bwrap exited (${code ?? signal})`));
      // Read the info to its end: bwrap closes the fd after writing it, and must not get a
      // SIGPIPE from a reader that left early (its child would then wait forever).
      info.on("data", (chunk: Buffer) => {
        text += chunk.toString("utf8");
      });
      info.once("end", () => {
        const m = /"child-pid"\s*:\s*(\d+)/.exec(text);
        if (!m || child.pid === undefined) {
          fail(`bwrap closed its info fd without a child pid: ${text.slice(0, 200)}`);
          return;
        }
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        child.removeAllListeners("close");
        child.unref();
        resolve({ bwrapPid: child.pid, initPid: Number(m[1]), detach, drained });
      });
    });
  }

  /**
   * bwrap reports its child's pid before that child has built the sandbox's mounts; the sandbox is
   * ready (and safe to `nsenter`) once the keepalive `sleep` has been exec'd.
   */
  private async waitUntilReady(
    name: string,
    initPid: number,
    logPath: string,
    drained: () => Promise<void>,
    /** Throws when the create was told to stop (see `create`). */
    stopIfAsked: () => void = () => {},
  ): Promise<void> {
    const until = performance.now() + this.defaults.startTimeoutMs;
    for (let attempt = 0; ; attempt++) {
      stopIfAsked();
      if ([initPid, ...childrenOf(initPid)].some((pid) => commOf(pid) === "sleep")) return;
      const died = startTime(initPid) === null;
      if (died || performance.now() >= until) {
        // What bwrap said as it died may still be in its pipes (`spawnBwrap`).
        if (died) await drained();
        // Why is in bwrap's log (a rootfs that is not there, a mount that failed, no `setpriv` in
        // it), which goes with the sandbox's directory when the failed start is cleaned up.
        let log = "";
        try {
          log = readFileSync(logPath, "utf8").slice(-2000).trim();
        } catch {}
        throw FleetError.retryable(
          "provider_unavailable",
          `sandbox ${name} ${died ? "exited before its keepalive started" : "did not start its keepalive in time"}${log ? `: ${log}` : ""}`,
        );
      }
      await delay(Math.min(2 * 2 ** attempt, 50));
    }
  }

  async find(rolloutId: string, owner: SandboxHandle["owner"]): Promise<SandboxHandle | null> {
    return findSandbox(
      (labels) => this.list(labels),
      { [LABEL_ROLLOUT]: rolloutId, [LABEL_OWNER]: owner },
      sandboxName(rolloutId, owner, this.scope),
      this.instance,
    );
  }

  async exec(handle: SandboxHandle, argv: string[], options: ExecOptions): Promise<ExecResult> {
    const o = parseExecOptions(options, this.defaults);
    let state: BwrapState;
    try {
      state = await this.liveState(handle);
    } catch (err) {
      // Nothing was spawned yet.
      throw beforeStart(err);
    }
    // The OOM-kill count only grows: this exec was OOM-killed only if it grew while it ran (an
    // OOM kill the agent caused earlier must not turn a later plain SIGKILL into a mask).
    const oomBefore = cgroupOomKills(state.cgroups ?? []);
    // A command's output keeps its end as well as its start (see `CappedBuffer`).
    const { rawExitCode, ...out } = await this.run(state, argv, { ...o, keepTail: true });
    if (rawExitCode === -1 || out.timedOut) {
      // The host-side timer fired, or the command timed out. In a sandbox frozen from outside
      // (its processes SIGSTOPped, a cgroup freezer) the in-sandbox `timeout` could not fire, or
      // fired on a command that could not run: the sandbox failed under the
      // command, which did not run out of its time (masked, never a timeout graded 0), as Docker
      // reports a paused container. Told by what nothing inside can stop: the sandbox's PID 1
      // together with its keepalive (nobody's), and the host's freezer (see `frozenFromOutside`):
      // code under test that stops the `timeout` process itself, even with PID 1, still gets a
      // timeout. Here only, for the commands run for callers, as in the Docker provider. Asked of
      // a command's own timeout too: its `timeout` may have run on while the rest was stopped (an
      // outside stop that reached it first: `run` resumes an nsenter stopped with it).
      const frozen = frozenFromOutside(state.initPid);
      if (frozen !== null) {
        throw FleetError.nonRetryable(
          "sandbox_lost",
          `sandbox ${state.name} ${frozen} while a command ran (its own deadline could not fire)`,
        );
      }
    }
    if (rawExitCode === 137 && !out.timedOut) {
      const oomAfter = cgroupOomKills(state.cgroups ?? []);
      out.oomKilled = oomAfter !== null && oomAfter > (oomBefore ?? 0);
    }
    return out;
  }

  /** One command in the sandbox: nsenter → setpriv → env → timeout → argv, output capped. */
  private async run(
    state: BwrapState,
    argv: readonly string[],
    o: RunOptions,
  ): Promise<ExecResult & { rawExitCode: number }> {
    const cmd = deadlineArgv(argv, o.deadlineMs, this.defaults.killGraceS);
    const user = this.resolveUser(o.user);
    const env: Record<string, string> = { PATH: SANDBOX_PATH_ENV, HOME: user.home, HOSTNAME: "sandbox" };
    for (const kv of envList(o.env) ?? []) {
      const i = kv.indexOf("=");
      env[kv.slice(0, i)] = kv.slice(i + 1);
    }
    // By descriptors opened here and checked to be the sandbox's, not by its pid: between the
    // liveness check and nsenter's own open of /proc/<pid>/ns, the sandbox's PID 1 could die and
    // its pid go to a host process, whose namespaces (the host's) the command would run in.
    const pinned = pinSandbox(state);
    // The command's environment goes to `env` inside, after setpriv; the host side gets none of it.
    const args = nsenterArgv(
      pinned.files,
      user,
      o.cwd ?? SANDBOX_PATHS.workspace,
      cmd,
      Object.entries(env).map(([k, v]) => `${k}=${v}`),
      o.keepCaps ?? [],
    );
    const { stdout, stderr } = execOutputBuffers(o.maxOutputBytes, o.keepTail);
    const safetyMs = o.deadlineMs + this.defaults.killGraceS * 1000 + this.defaults.execSlackMs;
    const started = performance.now();

    const exit = await new Promise<{ code: number | null; hostTimedOut: boolean }>((resolve, reject) => {
      const [file, ...fileArgs] = sandboxExecArgv(o.outsideCgroups ? [] : (state.cgroups ?? []), [
        this.nsenterPath,
        ...args,
      ]);
      let child: ReturnType<typeof spawn>;
      try {
        child = spawn(file!, fileArgs, {
          env: HOST_HELPER_ENV,
          stdio: [o.stdin === null ? "ignore" : "pipe", "pipe", "pipe"],
          // In a session of its own, like the sandbox: a signal to the worker's process group (a
          // Ctrl-C in its terminal) must not kill the command and be taken for its exit (130).
          // Its deadline kills it explicitly.
          detached: true,
        });
      } catch (err) {
        // Refused before anything started (Node throws some spawn failures, not as an 'error'
        // event): the sandbox's descriptors closed. E2BIG, arguments and environment over what
        // an exec takes, no attempt can change (final); anything else is the host's (retryable).
        pinned.close();
        const code = (err as NodeJS.ErrnoException).code;
        reject(
          code === "E2BIG"
            ? FleetError.nonRetryable(
                "invalid_task",
                `the command's arguments and environment are more than an exec takes (E2BIG, ${argBytes(args)} bytes): put long content in a file`,
                err,
              )
            : FleetError.retryable(
                "provider_unavailable",
                `nsenter into ${state.name} failed: ${String(err)}`,
                err,
              ),
        );
        return;
      }
      let hostTimedOut = false;
      let settled = false;
      let drain: NodeJS.Timeout | undefined;
      const settle = (code: number | null) => {
        if (settled) return;
        settled = true;
        pinned.close();
        clearTimeout(timer);
        clearInterval(resume);
        clearTimeout(drain);
        child.stdout!.destroy();
        child.stderr!.destroy();
        resolve({ code, hostTimedOut });
      };
      const timer = setTimeout(() => {
        hostTimedOut = true;
        child.kill("SIGKILL");
        settle(null);
      }, safetyMs);
      // nsenter (util-linux) waits for the command with WUNTRACED: when the command stops, it
      // stops itself, and resumes the command only once something resumes it. A kill sweep's
      // SIGSTOP, or an agent stopping its own `timeout`, left it stopped on the host, where
      // nothing in the sandbox sees it: the command's deadline waited for the timer above
      // (seconds past the agent's overrun budget), and a command the sweep killed was never
      // reaped, so the sandbox's PID 1 could not exit and its destroy failed. Resumed here; not
      // in a sandbox stopped or frozen from outside, whose exec ends at the timer, lost.
      // The keepalive looked for once (a scan of every host process's parent), not on every
      // tick while the sandbox stays stopped: that scan, each 100 ms per exec pending, kept a
      // worker's event loop busy most of the time on a host of a few thousand processes.
      let keepalives: readonly number[] | undefined;
      const keepalivesOnce = () => (keepalives ??= keepalivesOf(state.initPid));
      const resume = setInterval(() => {
        if (
          child.pid === undefined ||
          !isStopped(child.pid) ||
          frozenFromOutside(state.initPid, keepalivesOnce) !== null
        )
          return;
        try {
          process.kill(child.pid, "SIGCONT");
        } catch {}
      }, NSENTER_RESUME_MS);
      child.stdout!.on("data", (c: Buffer) => stdout.write(c));
      child.stderr!.on("data", (c: Buffer) => stderr.write(c));
      child.once("error", (err) => {
        if (settled) return;
        settled = true;
        pinned.close();
        clearTimeout(timer);
        clearInterval(resume);
        reject(
          FleetError.retryable(
            "provider_unavailable",
            `nsenter into ${state.name} failed: ${String(err)}`,
            err,
          ),
        );
      });
      const codeOf = (code: number | null, signal: NodeJS.Signals | null) =>
        code ?? (signal ? 128 + signalNumber(signal) : null);
      // Normally the pipes close with the command; a background process the command left
      // behind may hold them open, so after the exit only a short drain is waited for.
      child.once("exit", (code, signal) => {
        drain = setTimeout(() => settle(codeOf(code, signal)), EXIT_DRAIN_MS);
      });
      child.once("close", (code, signal) => settle(codeOf(code, signal)));
      if (o.stdin !== null) {
        child.stdin!.on("error", () => undefined); // the command may not read its stdin
        endWithStdin(child.stdin!, o.stdin);
      }
    }).finally(() => pinned.close()); // closed at the latest here (a spawn that threw)
    const durationMs = performance.now() - started;
    if (exit.hostTimedOut || exit.code === null) {
      this.logger?.warn({ sandbox: state.name, deadlineMs: o.deadlineMs }, "exec outlived its deadline");
      return execResult(-1, true, stdout, stderr, durationMs, -1);
    }
    if (exit.code !== 0 && !this.stateAlive(state)) {
      throw FleetError.nonRetryable("sandbox_lost", `sandbox ${state.name} is gone (its PID 1 exited)`);
    }
    const outcome = execOutcome(exit.code, durationMs, o.deadlineMs);
    return execResult(outcome.exitCode, outcome.timedOut, stdout, stderr, durationMs, exit.code);
  }

  /** `uid[:gid]` or a name in the rootfs's `/etc/passwd` → ids and home directory. */
  private resolveUser(user: string): { uid: string; gid: string; home: string } {
    const passwd = this.readPasswd();
    const ids = parseNumericUser(user);
    if (ids) {
      const entry = [...passwd.values()].find((e) => e.uid === String(ids.uid));
      return { uid: String(ids.uid), gid: String(ids.gid), home: entry?.home ?? "/" };
    }
    const entry = passwd.get(user);
    if (!entry) throw FleetError.nonRetryable("invalid_task", `unknown user in the sandbox: ${user}`);
    return entry;
  }

  private readPasswd(): Map<string, { uid: string; gid: string; home: string }> {
    if (this.passwd) return this.passwd;
    const map = new Map<string, { uid: string; gid: string; home: string }>();
    try {
      for (const line of readFileSync(join(this.rootfs, "etc/passwd"), "utf8").split("\n")) {
        const [name, , uid, gid, , home] = line.split(":");
        if (name && uid && gid) map.set(name, { uid, gid, home: home || "/" });
      }
    } catch (err) {
      this.logger?.warn({ err, rootfs: this.rootfs }, "cannot read the rootfs's /etc/passwd");
    }
    this.passwd = map;
    return map;
  }

  async put(handle: SandboxHandle, dir: string, files: FileSet, options: PutOptions = {}): Promise<void> {
    const plan = planPut(dir, files, options.user, this.defaults.execUser);
    const state = await this.liveState(handle);
    // Extract inside the sandbox, as the user: the host never follows a path the agent controls.
    await extractViaExec((argv, o) => this.run(state, argv, o), plan, options);
  }

  async get(
    handle: SandboxHandle,
    path: string,
    options: { maxBytes?: number } = {},
  ): Promise<string | null> {
    const maxBytes = options.maxBytes ?? this.defaults.maxOutputBytes;
    const target = getTarget(path);
    const state = await this.liveState(handle);
    // Root has no capabilities inside (no DAC override): a file only its owner may read needs the agent.
    const users = isTmpfsPath(target)
      ? [ROOT_USER, this.defaults.execUser]
      : [this.defaults.execUser, ROOT_USER];
    return readViaExec((argv, o) => this.run(state, argv, o), target, users, maxBytes);
  }

  async probe(handle: SandboxHandle, options: { timeoutMs?: number } = {}): Promise<ProbeReport> {
    const timeoutMs = options.timeoutMs ?? this.defaults.probeTimeoutMs;
    const started = performance.now();
    const { pidNs: hostPidNs, netNs: hostNetNs, sentinelPid, sentinelCmdline } = hostProbeFacts();
    const script = [
      "readlink /proc/self/ns/pid",
      "readlink /proc/self/ns/net",
      "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ' '; echo",
      sentinelProbeLine(sentinelPid),
      WORKSPACE_PROBE_LINE,
      SCRATCH_PROBE_LINE,
      TIMEOUT_PROBE_LINE,
    ].join("; ");
    let stdout: string;
    let state: BwrapState;
    try {
      state = await this.liveState(handle);
      const r = await this.run(state, ["sh", "-c", script], probeExecCall(timeoutMs));
      stdout = probeStdout(r, timeoutMs);
    } catch (err) {
      if (isFleetError(err) && err.kind === "sandbox_lost") throw err;
      const message = err instanceof Error ? err.message : String(err);
      throw FleetError.retryable(
        "provider_unavailable",
        `isolation probe of ${handle.name} failed: ${message}`,
        err,
      );
    }
    const [
      pidNs = "",
      netNs = "",
      ifaces = "",
      sentinel = "",
      workspace = "",
      scratch = "",
      timeoutKind = "",
    ] = stdout.split("\n").map((l) => l.trim());
    const interfaces = ifaces.split(/\s+/).filter(Boolean);
    const checks = {
      pidNamespaceDiffers: pidNs !== "" && pidNs !== hostPidNs,
      netNamespaceDiffers: netNs !== "" && netNs !== hostNetNs,
      onlyLoopback: interfaces.length === 1 && interfaces[0] === "lo",
      hostSentinelInvisible: sentinel === "" || sentinel !== sentinelCmdline,
    };
    const detail =
      `sandbox pid ns ${pidNs || "?"} vs host ${hostPidNs}; net ns ${netNs || "?"} vs host ${hostNetNs}; ` +
      `interfaces: ${interfaces.join(",") || "none"}; host pid ${sentinelPid} ${sentinel ? "visible" : "invisible"}; ` +
      `limits enforced: ${(state.cgroups ?? []).map((cg) => cg.controller).join(", ") || "none"}; ` +
      `not enforced: ${(state.unenforced ?? []).join(", ") || "none"}`;
    const isolated = assertIsolated(handle.name, checks, detail);
    assertCoreutilsTimeout(handle.name, timeoutKind);
    return {
      isolated,
      checks,
      detail,
      durationMs: performance.now() - started,
      workspaceEmpty: workspace === "empty",
      scratchClean: scratch === "clean",
    };
  }

  async killProcesses(
    handle: SandboxHandle,
    user: string = AGENT_USER,
    options: KillOptions = {},
  ): Promise<CleanupReceipt> {
    // The sweep runs outside the sandbox's cgroups so it can start even at the pids limit, and a
    // sandbox found gone is a confirmed receipt. For a uid other than root's it runs as root in
    // the sandbox's namespaces holding CAP_KILL and no other capability (`rootSweep`): nothing of
    // that uid can signal or outrun it (a sweep run as the uid itself could be killed by the
    // agent's own `kill -9 -1` loop, and the rollout masked instead of graded), and from the
    // sandbox's PID namespace it also sees processes in namespaces the agent nested inside it.
    // A sweep of root's own processes (the tests') keeps CAP_KILL as well, so that the tests'
    // root, holding none, can neither read nor write its output (`rootSweep`).
    return killProcessesViaExec(
      async (argv, o) =>
        this.run(await this.liveState(handle), argv, {
          ...o,
          outsideCgroups: true,
        }),
      user,
      this.defaults.killRounds,
      () => false,
      { ...options, rootSweep: true },
    );
  }

  async destroy(handle: SandboxHandle): Promise<CleanupReceipt> {
    this.checkHandle(handle);
    const state = await this.readState(handle.name);
    if (!state || (handle.id && state.id !== handle.id)) {
      // Nothing of ours by that name (or a newer sandbox took the name): already gone.
      if (!state) await this.removeLeftoverDirs(handle.name);
      return { confirmed: true, scope: "sandbox", at: Date.now(), alreadyGone: true, remaining: 0 };
    }
    // Already gone only when nothing of it ran, which this destroy would have killed (the janitor
    // counts it removed otherwise): not only when it was not alive. One still starting (its
    // creator died, or is still at it) is not, yet its bwrap and PID 1 may run; nor one whose PID 1
    // died and cannot finish exiting, while an exec's host side (stopped) holds a command of it.
    const wasAlive = await this.destroyState(state);
    this.logger?.debug({ sandbox: handle.name, alreadyGone: !wasAlive }, "sandbox destroyed");
    return { confirmed: true, scope: "sandbox", at: Date.now(), alreadyGone: !wasAlive, remaining: 0 };
  }

  /**
   * Kill the sandbox's PID 1 (which takes its whole PID namespace) and bwrap's group; remove its
   * files. A sandbox still starting (no PID 1 recorded) is killed by its id in the environment of
   * its processes. True if anything of it still ran (and was killed).
   */
  private async destroyState(state: BwrapState): Promise<boolean> {
    const starting = state.initPid === 0;
    const initAlive = () => state.initPid > 0 && sameProcess(state.initPid, state.initStart);
    const bwrapAlive = () => state.bwrapPid > 0 && sameProcess(state.bwrapPid, state.bwrapStart);
    // While it starts, its processes by their mark; always, the host side of its execs: one
    // whose worker is gone, an `nsenter` left stopped, holds the command it never reaps, and PID
    // 1 cannot exit while it does. Found in its cgroups (those entering another PID namespace:
    // not anything else there, as one put there from outside is left, and blocks the removal),
    // and, on a host without cgroups, as the host processes whose children go into its PID
    // namespace (read from PID 1 before it is killed; held open meanwhile, so that its number
    // cannot pass to a new sandbox's namespace while this one is still being destroyed).
    let held: ReturnType<typeof holdPidNamespace> = null;
    let namespace: string | null = null;
    let ran = false;
    const marked = () => [
      ...(starting ? processesWithEnv(SANDBOX_ID_ENV, state.id) : []),
      ...cgroupProcesses(state.cgroups ?? []).filter(entersAnotherPidNamespace),
      ...(namespace === null ? [] : processesEntering(namespace)),
    ];
    try {
      // (In the try: a look at PID 1 that throws, /proc unreadable, still closes what is held.)
      held = initAlive() ? holdPidNamespace(state.initPid) : null;
      namespace = held !== null && initAlive() ? held.namespace : null;
      const until = performance.now() + 10_000;
      for (let attempt = 0; ; attempt++) {
        const others = marked();
        if (!initAlive() && !bwrapAlive() && others.length === 0) break;
        ran = true;
        for (const pid of others) killQuietly(pid);
        if (initAlive()) killQuietly(state.initPid);
        if (bwrapAlive()) killQuietly(-state.bwrapPid);
        if (performance.now() >= until) {
          throw FleetError.retryable("provider_unavailable", `sandbox ${state.name} did not die within 10 s`);
        }
        await delay(Math.min(5 * 2 ** attempt, 100));
      }
    } finally {
      held?.close();
    }
    const left = await removeCgroups(state.cgroups ?? []);
    if (left.length > 0) {
      // Something still lives in them (a process stuck in the kernel, or one put there from
      // outside): not torn down. The state stays, so a retry (the teardown ledger) finds it.
      throw FleetError.retryable(
        "provider_unavailable",
        `sandbox ${state.name}: cgroups still in use, not removed: ${left.join("; ")}`,
      );
    }
    // Its directory is its own (named by its id; a sandbox made before that, by its name alone);
    // the state file only while it is still its own: a newer create may have taken the name.
    await removeTree(dirname(state.workspaceDir));
    await this.removeStateIfOwn(state);
    return ran;
  }

  /**
   * Remove the name's state file if it still is `state`'s. Reading it and then removing it would
   * race a newer create of the same name, which another process may run meanwhile (a redelivered
   * create taking over while the create it took over from cleans up after itself): the newer
   * one's state written between the read and the removal would be removed, and its sandbox left
   * running with nothing to find it by. So the file is moved aside (atomically) before it is
   * judged, and put back if it turns out to be another sandbox's.
   */
  private async removeStateIfOwn(state: BwrapState): Promise<void> {
    if ((await this.readState(state.name))?.id !== state.id) return;
    const path = this.statePath(state.name);
    const aside = `${path}.${process.pid}.${state.id.slice(0, 8)}.removing`;
    try {
      await rename(path, aside);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") return; // removed meanwhile
      throw err;
    }
    let text = "";
    try {
      text = (await readStateFile(aside)) ?? "";
    } catch {}
    if (parseState(text, state.name)?.id !== state.id) {
      // Not ours: back in place, unless its owner has written it again since (that write stands).
      await link(aside, path).catch((err: NodeJS.ErrnoException) => {
        if (err.code !== "EEXIST") throw err;
      });
      this.logger?.warn({ sandbox: state.name }, "the name was taken over while its sandbox was removed");
    }
    await rm(aside, { force: true });
  }

  /** Directories of a name with no state file (`<name>`, `<name>-<id>`): nothing runs in them. */
  private async removeLeftoverDirs(name: string): Promise<void> {
    let entries: string[];
    try {
      entries = await readdir(this.stateDir);
    } catch {
      return;
    }
    // A create of the name may have begun since the caller found no state: its directory, made
    // after its state is written, is its sandbox's (the workspace it stages into), not a leftover.
    // Read after the listing, so any such directory listed has its state there by now.
    let current: BwrapState | null;
    try {
      current = await this.readState(name);
    } catch {
      return; // unreadable: nothing removed (a later destroy or sweep may)
    }
    const spared = current ? basename(dirname(current.workspaceDir)) : null;
    for (const entry of entries) {
      if (entry === spared) continue;
      if (
        entry === name ||
        (entry.startsWith(`${name}-`) && /^[0-9a-f]{8}$/.test(entry.slice(name.length + 1)))
      ) {
        await removeTree(join(this.stateDir, entry));
      }
    }
  }

  /**
   * What this host lacks to make sandboxes (root, `bwrap` and `nsenter` on the sandbox PATH, a
   * rootfs holding what every exec runs), or null. Asked by `list`, so a worker on a host that
   * lacks one refuses to start (`waitForProvider`) and its breaker holds jobs, rather than failing
   * or masking every rollout it takes; and by `create`, before anything is made. Never throws.
   */
  async hostProblem(): Promise<string | null> {
    if (process.getuid?.() !== 0) return "the bubblewrap provider needs root on the host";
    for (const [what, file] of [
      ["bwrap", this.bwrapPath],
      ["nsenter", this.nsenterPath],
      // The host side of every exec (`sandboxExecArgv`).
      ["bash", HOST_BASH],
    ] as const) {
      if (!(await onPath(file)))
        return `${what} (${file}) is not installed: no executable on ${SANDBOX_PATH_ENV}`;
    }
    // By what it is, not its name: a symlink to / (or a bind mount of it) is the host's root too,
    // which would hand every sandbox the host's files (its secrets, other sandboxes' workspaces).
    if (resolve(this.rootfs) === "/" || (await sameDirectory(this.rootfs, "/"))) {
      return `FLEET_BWRAP_ROOTFS is / (the host's own root), not a rootfs${resolve(this.rootfs) === "/" ? "" : `: ${this.rootfs} leads there`}`;
    }
    for (const tool of ROOTFS_NEEDS) {
      try {
        // There, not followed: a link in the rootfs may be absolute (busybox's `/bin/busybox`),
        // which the host would resolve in its own root.
        await lstat(join(this.rootfs, tool));
      } catch {
        return `the rootfs ${this.rootfs} has no ${tool} (give FLEET_BWRAP_ROOTFS an unpacked base rootfs: packages/sandbox/README.md)`;
      }
    }
    return this.stateDirProblem();
  }

  /** Set once the state directory took a file: checked again only until then. */
  private stateDirWritable = false;

  /**
   * Whether a sandbox's state can be written to the state directory (made if missing): a probe
   * file written and removed, within 5 s. Without
   * this a worker with a read-only or missing `FLEET_STATE_DIR` started healthy (nothing to list)
   * and failed every seed until the rollouts' deadlines.
   */
  private async stateDirProblem(): Promise<string | null> {
    if (this.stateDirWritable) return null;
    const probe = join(this.stateDir, `.probe-${process.pid}-${randomUUID().slice(0, 8)}`);
    const attempt = (async () => {
      await mkdirEach(this.stateDir);
      await writeFile(probe, "", { mode: 0o600 });
      await rm(probe, { force: true });
    })();
    try {
      await withTimeout(attempt, 5_000, "no answer within 5 s");
      this.stateDirWritable = true;
      return null;
    } catch (err) {
      return `the state directory ${this.stateDir} (FLEET_STATE_DIR/bwrap) cannot be written: ${err instanceof Error ? err.message : String(err)}`;
    }
  }

  async list(labels: Record<string, string> = {}): Promise<SandboxInfo[]> {
    const problem = await this.hostProblem();
    if (problem !== null) throw FleetError.retryable("provider_unavailable", problem);
    let names: string[];
    try {
      names = await readdir(this.stateDir);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") return [];
      throw FleetError.retryable("provider_unavailable", `cannot read ${this.stateDir}: ${String(err)}`, err);
    }
    const want: Record<string, string> = {
      [LABEL_MANAGED]: "true",
      ...(this.scope ? { [LABEL_SCOPE]: this.scope } : {}),
      ...labels,
    };
    await this.removeStrayWrites(names);
    const out: SandboxInfo[] = [];
    // State files only, each written as a regular file and renamed into place: another entry
    // named `*.json` (a directory, a FIFO an operator left there) is none, and reading it failed
    // the whole list (EISDIR) or never answered (a FIFO no one writes), which hid every sandbox
    // from the janitor and kept the worker from starting. Each told by its own lstat, not by
    // readdir's entry types: where the filesystem gives none (ext2 without filetype, XFS with
    // ftype=0) Node lstats every entry itself, and one gone meanwhile (any worker's state write
    // renamed into place) failed the whole readdir with ENOENT, read as no state directory: an
    // empty list, every sandbox hidden.
    for (const file of names.filter((n) => n.endsWith(".json")).sort()) {
      if (!(await this.isStateFile(file))) continue;
      const state = await this.readState(file.slice(0, -".json".length));
      if (!state) continue;
      if (!Object.entries(want).every(([k, v]) => state.labels[k] === v)) continue;
      out.push({
        handle: this.handleOf(state),
        labels: { ...state.labels },
        running: this.stateAlive(state),
        createdAt: state.createdAt,
      });
    }
    return out;
  }

  /** Whether the state directory's entry `file` is a regular file (false once it is gone). */
  private async isStateFile(file: string): Promise<boolean> {
    try {
      return (await lstat(join(this.stateDir, file))).isFile();
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") return false;
      throw FleetError.retryable(
        "provider_unavailable",
        `cannot read sandbox state ${file}: ${String(err)}`,
        err,
      );
    }
  }

  /**
   * Clear up the files of state writes whose process died before it finished them (a SIGKILLed
   * worker), each left for good otherwise. A temporary file it wrote and never renamed is removed:
   * nothing reads it (the sandbox is found by its state file, or by its id in its processes'
   * environment). A state file it moved aside to remove is put back where no state file is (it may
   * be a newer sandbox's, taken for its own), else removed: put back, a sandbox of it that is gone
   * is swept as any other. Only a file a minute old whose writer no longer runs: another worker on
   * this host may be writing its own.
   */
  private async removeStrayWrites(names: readonly string[]): Promise<void> {
    const cutoff = Date.now() - STRAY_WRITE_AGE_MS;
    for (const name of names) {
      const m = STRAY_WRITE.exec(name);
      if (!m) continue;
      const pid = Number(m[2]);
      // Its writer alive, or not known to be gone (its /proc unreadable): not stray.
      if (pid === process.pid || startTimeOrAlive(pid) !== null) continue;
      const file = join(this.stateDir, name);
      try {
        if ((await lstat(file)).mtimeMs > cutoff) continue;
        if (m[3] === "removing") {
          const restored = await link(file, join(this.stateDir, `${m[1]}.json`)).then(
            () => true,
            () => false, // a state file is there: the name's now
          );
          if (restored) this.logger?.warn({ file }, "put back a state file its worker died removing");
        }
        await rm(file, { force: true });
        this.logger?.info({ file }, "removed a state write its worker did not finish (it died)");
      } catch {}
    }
  }

  async alive(handle: SandboxHandle): Promise<boolean> {
    this.checkHandle(handle);
    const state = await this.readState(handle.name);
    return state !== null && (!handle.id || state.id === handle.id) && this.stateAlive(state);
  }

  async close(): Promise<void> {}

  /** The state of a handle's sandbox, which must still run; else final `sandbox_lost`. */
  private async liveState(handle: SandboxHandle): Promise<BwrapState> {
    this.checkHandle(handle);
    const state = await this.readState(handle.name);
    if (!state || (handle.id && state.id !== handle.id)) {
      throw FleetError.nonRetryable("sandbox_lost", `sandbox ${handle.name} is gone (no state)`);
    }
    if (!this.stateAlive(state)) {
      throw FleetError.nonRetryable("sandbox_lost", `sandbox ${handle.name} is gone (its PID 1 exited)`);
    }
    return state;
  }

  /**
   * Ready and its PID 1 still runs (a sandbox still starting is not alive, nor one whose PID 1
   * is exiting: killed, it stays until every process of its namespace is reaped, commands run
   * through `nsenter` included, so a command it killed reads as still in a live sandbox).
   */
  private stateAlive(state: BwrapState): boolean {
    if (state.initPid <= 0 || state.initStart === "") return false;
    const init = processStat(state.initPid);
    return init !== null && init.start === state.initStart && !init.exiting;
  }

  private checkHandle(handle: SandboxHandle): void {
    if (handle.provider !== "bubblewrap") {
      throw FleetError.nonRetryable(
        "invalid_task",
        `a ${handle.provider} sandbox handle given to the bubblewrap provider`,
      );
    }
    if (handle.endpoint !== this.endpoint && handle.endpoint !== "") {
      throw FleetError.retryable(
        "provider_unavailable",
        `sandbox ${handle.name} lives on ${handle.endpoint}, not on this host (${this.endpoint})`,
      );
    }
    if (!/^[A-Za-z0-9][A-Za-z0-9_.-]*$/.test(handle.name)) {
      throw FleetError.nonRetryable("invalid_task", `invalid sandbox name: ${handle.name}`);
    }
  }

  private handleOf(state: BwrapState): SandboxHandle {
    return {
      provider: "bubblewrap",
      endpoint: this.endpoint,
      id: state.id,
      name: state.name,
      rolloutId: state.rolloutId,
      owner: state.owner,
      volumes: [],
    };
  }

  private statePath(name: string): string {
    return join(this.stateDir, `${name}.json`);
  }

  private async readState(name: string): Promise<BwrapState | null> {
    let text: string | null;
    try {
      text = await readStateFile(this.statePath(name));
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") return null;
      throw FleetError.retryable(
        "provider_unavailable",
        `cannot read sandbox state ${name}: ${String(err)}`,
        err,
      );
    }
    return text === null ? null : parseState(text, name);
  }

  private async writeState(state: BwrapState): Promise<void> {
    const tmp = this.stateTmpPath(state.name);
    await writeFile(tmp, stateText(state), { mode: 0o600 });
    await rename(tmp, this.statePath(state.name));
  }

  /** `readState`, synchronously (null also when unreadable: the caller then treats the name as lost). */
  private readStateSync(name: string): BwrapState | null {
    try {
      const text = readStateFileSync(this.statePath(name));
      return text === null ? null : parseState(text, name);
    } catch {
      return null;
    }
  }

  /** `writeState`, synchronously: for the moment between spawning bwrap and anything else. */
  private writeStateSync(state: BwrapState): void {
    const tmp = this.stateTmpPath(state.name);
    writeFileSync(tmp, stateText(state), { mode: 0o600 });
    renameSync(tmp, this.statePath(state.name));
  }

  /**
   * A temporary file of this write alone: two creates of one name in one process (a seed
   * redelivered to the worker still running it) write at once, and with one path per process one's
   * rename took the other's file and the other's found nothing (ENOENT).
   */
  private stateTmpPath(name: string): string {
    return `${this.statePath(name)}.${process.pid}.${randomUUID().slice(0, 8)}.tmp`;
  }
}

/** A state write's temporary file (`stateTmpPath`) or a state file moved aside to be removed (`removeStateIfOwn`): its writer's pid. */
const STRAY_WRITE = /^([A-Za-z0-9][A-Za-z0-9_.-]*)\.json\.(\d+)\.[0-9a-f]{8}\.(tmp|removing)$/;
/** How old a stray write must be before `list` removes it. */
const STRAY_WRITE_AGE_MS = 60_000;

/**
 * How a state file is opened: never blocking (a FIFO's plain open waits for a writer), never
 * through a symlink. Whether it is one is then told by the descriptor opened, not by the path,
 * which may be swapped meanwhile.
 */
const STATE_OPEN_FLAGS = fsConstants.O_RDONLY | fsConstants.O_NONBLOCK | fsConstants.O_NOFOLLOW;

/**
 * A state file's text; null where what is at its path is no regular file (a FIFO, a directory, a
 * symlink an operator left there named `<name>.json`), which is no state, as a torn one is none:
 * every state write renames a regular file into place. `list` skips such an entry by its own
 * lstat; a read by name (`create`, `destroy`, `get`) read it, and a FIFO's read never answered,
 * holding that sandbox's create and destroy for good.
 */
async function readStateFile(path: string): Promise<string | null> {
  let file: FileHandle;
  try {
    file = await open(path, STATE_OPEN_FLAGS);
  } catch (err) {
    if (notRegularOpen(err)) return null;
    throw err;
  }
  try {
    return (await file.stat()).isFile() ? await file.readFile("utf8") : null;
  } finally {
    await file.close();
  }
}

/** `readStateFile`, synchronously (a blocked read here held the whole worker). */
function readStateFileSync(path: string): string | null {
  let fd: number;
  try {
    fd = openSync(path, STATE_OPEN_FLAGS);
  } catch (err) {
    if (notRegularOpen(err)) return null;
    throw err;
  }
  try {
    return fstatSync(fd).isFile() ? readFileSync(fd, "utf8") : null;
  } finally {
    closeSync(fd);
  }
}

/** An open refused for what the path is: a symlink (`O_NOFOLLOW`), a socket. */
function notRegularOpen(err: unknown): boolean {
  const code = (err as NodeJS.ErrnoException).code;
  return code === "ELOOP" || code === "ENXIO";
}

/** A state file's content, or null for a torn or foreign file (not a sandbox of that name). */
function parseState(text: string, name: string): BwrapState | null {
  try {
    const state = JSON.parse(text) as BwrapState;
    return state.version === 1 && state.name === name ? state : null;
  } catch {
    return null;
  }
}

function stateText(state: BwrapState): string {
  return `${JSON.stringify(state, null, 2)}\n`;
}

/** The most of bwrap's own output a sandbox's log keeps (see `spawnBwrap`). */
const BWRAP_LOG_MAX_BYTES = 64 * 1024;

/** Whether a failed read of `/proc/<pid>/…` says the process is gone (and not that this process could not read). */
function procGone(err: unknown): boolean {
  const code = (err as NodeJS.ErrnoException).code;
  return code === "ENOENT" || code === "ESRCH";
}

/**
 * A read of a process's `/proc` entry that failed for this process's own reason (out of file
 * descriptors, EMFILE; out of memory): retryable `provider_unavailable`, never taken for the
 * process gone, which would confirm a stop while the agent runs on (DESIGN §2 rule 2).
 */
function procUnreadable(path: string, err: unknown): FleetError {
  return FleetError.retryable("provider_unavailable", `cannot read ${path}: ${(err as Error).message}`, err);
}

/**
 * Field 22 of `/proc/<pid>/stat` (start time in clock ticks), or null when gone or a zombie.
 *
 * @throws FleetError `provider_unavailable` (retryable) when the file cannot be read for another
 * reason than the process being gone (`procUnreadable`).
 */
function startTime(pid: number): string | null {
  return processStat(pid)?.start ?? null;
}

/**
 * `startTime`'s read of `/proc/<pid>/stat`, with whether the process has begun to exit (field 9,
 * its flags, holds `PF_EXITING`: a killed PID 1 of a PID namespace stays so, not yet a zombie,
 * until every other process of the namespace is gone). Null when gone or a zombie.
 *
 * @throws FleetError `provider_unavailable`, as `startTime`.
 */
function processStat(pid: number): { start: string; exiting: boolean } | null {
  const path = `/proc/${pid}/stat`;
  let stat: string;
  try {
    stat = readFileSync(path, "latin1");
  } catch (err) {
    if (procGone(err)) return null;
    throw procUnreadable(path, err);
  }
  const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  if (fields[0] === "Z" || fields[0] === "X" || fields[19] === undefined) return null;
  const flags = Number(fields[6]);
  return { start: fields[19], exiting: Number.isInteger(flags) && (flags & PF_EXITING) !== 0 };
}

/** The kernel's `PF_EXITING` task flag: set as a process starts to exit (`do_exit`). */
const PF_EXITING = 0x4;

/** `startTime`, with a process whose `/proc` cannot be read taken for alive (`""`). */
function startTimeOrAlive(pid: number): string | null {
  try {
    return startTime(pid);
  } catch {
    return "";
  }
}

/**
 * Open the namespaces and root of the sandbox's PID 1, then check it still is that process: the
 * descriptors are then the sandbox's whatever becomes of its pid. `files` names them for `nsenter`
 * by this process's `/proc/<pid>/fd` (Node opens them close-on-exec: no command inherits them);
 * `close` once nsenter is done. A PID 1 gone is final `sandbox_lost` (nothing was started).
 */
function pinSandbox(state: BwrapState): { files: NsenterFiles; close(): void } {
  const fds: number[] = [];
  const close = () => {
    for (const fd of fds.splice(0)) {
      try {
        closeSync(fd);
      } catch {}
    }
  };
  const files: Partial<NsenterFiles> = {};
  let alive: boolean;
  try {
    for (const [key, entry] of Object.entries(NSENTER_PROC_ENTRIES) as Array<[keyof NsenterFiles, string]>) {
      const path = `/proc/${state.initPid}/${entry}`;
      let fd: number;
      try {
        fd = openSync(path, "r");
      } catch (err) {
        // Gone (ENOENT, ESRCH): told below. Anything else (EMFILE) is this process's, not the
        // sandbox's: a kill sweep must not take it for a sandbox gone, and its agent stopped.
        if (procGone(err)) break;
        throw procUnreadable(path, err);
      }
      fds.push(fd);
      files[key] = `/proc/${process.pid}/fd/${fd}`;
    }
    alive =
      fds.length === Object.keys(NSENTER_PROC_ENTRIES).length && sameProcess(state.initPid, state.initStart);
  } catch (err) {
    close();
    throw beforeStart(err);
  }
  if (!alive) {
    close();
    throw beforeStart(
      FleetError.nonRetryable("sandbox_lost", `sandbox ${state.name} is gone (its PID 1 exited)`),
    );
  }
  return { files: files as NsenterFiles, close };
}

/**
 * Why the sandbox whose PID 1 is `pid` cannot run, stopped from outside (SIGSTOP, a tracer) or
 * in a frozen cgroup v1 freezer, or null when it can (or is gone: that is told elsewhere).
 * Stopped means its PID 1 and its keepalive both: root in the sandbox (the tests, and the agent's
 * code they run) can stop PID 1 itself (its init's shield is only against signals: a ptrace
 * attach, same uid and PID 1 holding no capability, then a detach with SIGSTOP, leaves it `T`
 * with no tracer), but not the keepalive, which runs as nobody. The freezer is the host's.
 */
function frozenFromOutside(
  pid: number,
  keepalives: () => readonly number[] = () => keepalivesOf(pid),
): string | null {
  if (isStopped(pid) && keepalives().some(isStopped)) {
    return `was stopped from outside (its PID 1, host pid ${pid}, and its keepalive are stopped)`;
  }
  const freezer = freezerState(pid);
  return freezer === "FROZEN" || freezer === "FREEZING"
    ? `was frozen from outside (its PID 1's cgroup freezer is ${freezer})`
    : null;
}

/**
 * A process's PID namespace (`pid:[<inode>]`), opened (which keeps it, and its number, alive
 * until `close`), or null when it cannot be read.
 */
function holdPidNamespace(pid: number): { namespace: string; close(): void } | null {
  let fd: number;
  try {
    fd = openSync(`/proc/${pid}/ns/pid`, "r");
  } catch {
    return null;
  }
  try {
    return { namespace: readlinkSync(`/proc/self/fd/${fd}`), close: () => closeSync(fd) };
  } catch {
    closeSync(fd);
    return null;
  }
}

/** The processes outside PID namespace `namespace` whose children go into it (`nsenter --pid`). */
function processesEntering(namespace: string): number[] {
  const out: number[] = [];
  for (const pid of hostPids()) {
    try {
      if (readlinkSync(`/proc/${pid}/ns/pid_for_children`) !== namespace) continue;
      if (readlinkSync(`/proc/${pid}/ns/pid`) !== namespace) out.push(pid);
    } catch {}
  }
  return out;
}

/** Whether a process's children go into a PID namespace other than this process's (`nsenter --pid`). */
function entersAnotherPidNamespace(pid: number): boolean {
  try {
    return readlinkSync(`/proc/${pid}/ns/pid_for_children`) !== readlinkSync("/proc/self/ns/pid");
  } catch {
    return false;
  }
}

/** Stopped (`T`) or in a tracing stop (`t`); false when gone. */
function isStopped(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
    const state = stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3);
    return state === "T" || state === "t";
  } catch {
    return false;
  }
}

/**
 * The keepalive among the children of a sandbox's PID 1: `sleep infinity` with every uid
 * `KEEPALIVE_USER`'s (nothing the sandbox runs can take that uid: no capability, no_new_privs).
 */
function keepalivesOf(initPid: number): number[] {
  const uid = KEEPALIVE_USER.split(":")[0];
  return childrenOf(initPid).filter((child) => {
    try {
      if (readFileSync(`/proc/${child}/cmdline`, "latin1") !== "sleep\0infinity\0") return false;
      const uids = /^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)/m.exec(
        readFileSync(`/proc/${child}/status`, "latin1"),
      );
      return uids?.slice(1).every((u) => u === uid) ?? false;
    } catch {
      return false;
    }
  });
}

/** Live processes whose environment holds `name=value` (root reads every `/proc/<pid>/environ`). */
function processesWithEnv(name: string, value: string): number[] {
  const entry = `${name}=${value}`;
  const out: number[] = [];
  for (const pid of hostPids()) {
    try {
      if (!readFileSync(`/proc/${pid}/environ`, "latin1").split("\0").includes(entry)) continue;
      if (startTime(pid) !== null) out.push(pid);
    } catch {}
  }
  return out;
}

function commOf(pid: number): string | null {
  try {
    return readFileSync(`/proc/${pid}/comm`, "latin1").trim();
  } catch {
    return null;
  }
}

/** Direct children of a process (a /proc scan: `task/<tid>/children` is not always there). */
function childrenOf(pid: number): number[] {
  return hostPids().filter((n) => parentOf(n) === pid);
}

/** The pids in this process's `/proc` (none when it cannot be listed). */
function hostPids(): number[] {
  try {
    return readdirSync("/proc")
      .filter((n) => /^\d+$/.test(n))
      .map(Number);
  } catch {
    return [];
  }
}

function parentOf(pid: number): number | null {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "latin1");
    return Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]);
  } catch {
    return null;
  }
}

/** The process `pid` started at `start` still runs (an unknown start never matches: a pid is reused). */
function sameProcess(pid: number, start: string): boolean {
  return pid > 0 && start !== "" && startTime(pid) === start;
}

/** Whether two paths (links followed) are the same directory; false when either cannot be read. */
async function sameDirectory(a: string, b: string): Promise<boolean> {
  try {
    const [sa, sb] = await Promise.all([stat(a), stat(b)]);
    return sa.isDirectory() && sa.dev === sb.dev && sa.ino === sb.ino;
  } catch {
    return false;
  }
}

/**
 * Remove a sandbox's directory tree (`rm -rf`). Node's `rm` walks it by full paths, so a tree the
 * agent made deeper than PATH_MAX in its workspace (`mkdir d; cd d` in a loop) is ENAMETOOLONG
 * there, every time: the sandbox could never be reported torn down. coreutils `rm` walks by
 * directory descriptors, at any depth; it runs with `HOST_HELPER_ENV` (and the sandbox's
 * processes are dead by now: nothing moves the tree under it).
 */
async function removeTree(path: string): Promise<void> {
  try {
    await rm(path, { recursive: true, force: true });
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENAMETOOLONG") throw err;
    await promisify(execFile)("rm", ["-rf", "--one-file-system", "--", path], { env: HOST_HELPER_ENV });
  }
}

function killQuietly(pid: number): void {
  try {
    process.kill(pid, "SIGKILL");
  } catch {}
}

function signalNumber(signal: NodeJS.Signals): number {
  return osConstants.signals[signal] ?? 9;
}

/**
 * `mkdir -p` one directory at a time: Node's recursive `mkdir` never answers under `/proc` (and
 * goes on using a core there after its caller gave up), a plain one fails at once.
 */
async function mkdirEach(dir: string): Promise<void> {
  const parts = resolve(dir)
    .split("/")
    .filter((p) => p !== "");
  for (let i = 1; i <= parts.length; i++) {
    try {
      await mkdir(`/${parts.slice(0, i).join("/")}`, { mode: 0o700 });
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
    }
  }
}

/** Bytes an exec takes for `args` (each with its NUL), as E2BIG counts them. */
function argBytes(args: readonly string[]): number {
  let bytes = 0;
  for (const a of args) bytes += Buffer.byteLength(a) + 1;
  return bytes;
}
