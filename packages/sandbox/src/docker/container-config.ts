import { createHash } from "node:crypto";
import { DEFAULT_SANDBOX_SIZES, type SandboxSpec } from "@fleet/contracts";
import type Dockerode from "dockerode";
import { parseNumericUser } from "../exec-command.ts";
import {
  AGENT_USER,
  LABEL_EXPIRES,
  LABEL_INSTANCE,
  LABEL_MANAGED,
  LABEL_OWNER,
  LABEL_ROLLOUT,
  LABEL_SCOPE,
  SANDBOX_PATHS,
  VERIFY_FENCE_DIR,
} from "../provider.ts";

/**
 * The user of the container's main process (`sleep infinity` under docker-init): `nobody`, so
 * that killing every process of the agent's uid never kills the keepalive.
 */
export const KEEPALIVE_USER = "65534:65534";
/** `KEEPALIVE_USER`'s uid and gid. */
export const KEEPALIVE_IDS = parseNumericUser(KEEPALIVE_USER)!;

/** Hardened limits every sandbox gets unless its spec's `options` relax them. */
export interface SandboxLimits {
  /**
   * Memory for the sandbox's processes. The cgroup's limit is this plus the tmpfs mounts' caps
   * (see `sandboxMemoryMb`): their files are memory too, and a sandbox whose tmpfs pages alone
   * reached the limit would be OOM-killed whole (a full workspace would lose the sandbox, and mask
   * the agent's own failure) instead of its writer getting ENOSPC. Swap is capped to the same.
   * @defaultValue 1024
   */
  memoryMb: number;
  /** @defaultValue 1 */
  cpus: number;
  /** @defaultValue 256 */
  pidsLimit: number;
  /** Size of each tmpfs (`/tmp`, `/tests`, `/solution`, `/logs`). @defaultValue 256 */
  tmpfsMb: number;
  /** @defaultValue true */
  readOnlyRoot: boolean;
  /**
   * Size cap of the workspace: a size-capped tmpfs mount, agent-owned, 0755 (a disk filler gets
   * ENOSPC; its pages count against the sandbox's memory, whose limit has room for them). A mount of the container's own, not a
   * volume: nothing to remove at destroy, and nothing a daemon restarted with live-restore keeps
   * counting as mounted (such volumes could not be removed until the next restart). `null`: a
   * plain local volume on the daemon's disk, which copies up the image's /workspace, with no cap
   * at all (the local driver cannot enforce one on a directory, and `--storage-opt size` needs
   * xfs with project quotas): opt in only where the host disk is guarded otherwise.
   * @defaultValue 1024
   */
  diskMb: number | null;
}

export const DEFAULT_SANDBOX_LIMITS: Readonly<SandboxLimits> = Object.freeze({
  ...DEFAULT_SANDBOX_SIZES,
  readOnlyRoot: true,
});

/**
 * The tmpfs mounts of every sandbox. `/tests` and `/solution` belong to root (0755) so the agent
 * cannot plant files where tests are staged later; `/tmp` and `/logs` are world-writable (sticky).
 * When the image has the directory, Docker's tmpfs copy-up gives the mount that directory's
 * mode instead (the base image's match these).
 */
export const TMPFS_MOUNTS: ReadonlyArray<{ path: string; mode: string }> = [
  { path: "/tmp", mode: "1777" },
  { path: SANDBOX_PATHS.tests, mode: "0755" },
  { path: SANDBOX_PATHS.solution, mode: "0755" },
  { path: SANDBOX_PATHS.logs, mode: "1777" },
];

/**
 * The verify fence's mount (`VERIFY_FENCE_DIR`): the keepalive user's (nobody), 0755, one small
 * file in it, written only as that user. Not a scratch mount: nothing else is written there.
 */
export const FENCE_MOUNT = { path: VERIFY_FENCE_DIR, mode: "0755", mb: 1 } as const;

/**
 * The sandbox's memory limit in MiB: `memoryMb` for its processes, plus everything an agent can
 * leave behind that no process holds and that counts against the same cgroup:
 * - the caps of its tmpfs mounts (a capped workspace and `/dev/shm` included): their files;
 * - the kernel memory of their inodes (`INODES_PER_MB`, `INODE_KMEM_BYTES`): empty files use no
 *   data pages, so a size cap alone does not bound them, and millions of them would fill the cgroup;
 * - the System V and POSIX message queues and semaphores `IPC_SYSCTLS` allow (`IPC_MB`); System V
 *   shared memory goes with the last process attached to it (`kernel.shm_rmid_forced`).
 * So a full tmpfs is ENOSPC for its writer, never an OOM kill of everything in the sandbox, and
 * the tests still have `memoryMb` to run in whatever the agent left: an agent cannot make
 * verification fail for memory (and be masked) instead of being graded.
 */
export function sandboxMemoryMb(limits: Pick<SandboxLimits, "memoryMb" | "tmpfsMb" | "diskMb">): number {
  const tmpfsMb = TMPFS_MOUNTS.length * limits.tmpfsMb + (limits.diskMb ?? 0) + SHM_MB + FENCE_MOUNT.mb;
  return (
    limits.memoryMb + tmpfsMb + Math.ceil((tmpfsMb * INODES_PER_MB * INODE_KMEM_BYTES) / 2 ** 20) + IPC_MB
  );
}

/** The size of a sandbox's `/dev/shm` (Docker's default, set explicitly since it counts in `sandboxMemoryMb`). */
export const SHM_MB = 64;

/**
 * Inodes per MiB of each tmpfs (`nr_inodes`): an average of 4 KiB per file, so a 1 GiB workspace
 * holds 262,144 files and directories. Without a cap a tmpfs allows about one per page of RAM on
 * the host, millions, each pinning kernel memory charged to the sandbox.
 */
export const INODES_PER_MB = 256;

/**
 * Kernel memory one tmpfs inode pins with its dentry: measured about 960 bytes for a short name,
 * 1,480 for a 255-byte one (a name too long for the dentry's own buffer takes an allocation of
 * its own).
 */
export const INODE_KMEM_BYTES = 1536;

/**
 * IPC objects outlive the processes that made them: bounded here, in the sandbox's own IPC
 * namespace, and counted in `sandboxMemoryMb` (`IPC_MB`). System V message queues: 32 of up to
 * 16 KiB; semaphores: 128 sets of up to 250, 32,000 in all; POSIX message queues: 16 of up to
 * 10 messages of 8 KiB. System V shared memory is removed once no process is attached to it.
 */
export const IPC_SYSCTLS: Readonly<Record<string, string>> = Object.freeze({
  "kernel.shm_rmid_forced": "1",
  "kernel.msgmni": "32",
  "kernel.msgmnb": "16384",
  "kernel.sem": "250 32000 32 128",
  "fs.mqueue.queues_max": "16",
  "fs.mqueue.msg_max": "10",
  "fs.mqueue.msgsize_max": "8192",
});

/** What the objects `IPC_SYSCTLS` allows can hold, with room for their kernel structures. */
export const IPC_MB = 8;

/** Docker tmpfs options: its size cap and the inode cap that goes with it. */
function tmpfsCaps(sizeMb: number): string {
  return `size=${sizeMb}m,nr_inodes=${sizeMb * INODES_PER_MB}`;
}

/** The verify fence's Docker tmpfs: nobody's (the keepalive's user), not executable. */
const FENCE_TMPFS = `rw,noexec,nosuid,nodev,${tmpfsCaps(FENCE_MOUNT.mb)},uid=${KEEPALIVE_IDS.uid},gid=${KEEPALIVE_IDS.gid},mode=${FENCE_MOUNT.mode}`;

/** Whether `path` (absolute) lies on one of the sandbox's tmpfs mounts. */
export function isTmpfsPath(path: string): boolean {
  return TMPFS_MOUNTS.some((m) => path === m.path || path.startsWith(`${m.path}/`));
}

const NAME_SAFE = /^[A-Za-z0-9][A-Za-z0-9_.-]*$/;

/**
 * `fleet-<rolloutId>-<owner>`, or with a scope (`LABEL_SCOPE`) `fleet-<scopeTag>-<rolloutId>-<owner>`:
 * deterministic, so a re-delivered create finds the container it made before, and distinct per
 * fleet, so two fleets sharing a daemon whose rollout ids coincide (ids derive from idempotency
 * keys) never take each other's sandbox for their own. A rollout id Docker would not accept as
 * a name is sanitised and suffixed with a short hash of the original, so two ids never share a name.
 */
export function sandboxName(rolloutId: string, owner: SandboxSpec["owner"], scope?: string): string {
  return `${scope ? `fleet-${scopeTag(scope)}-` : "fleet-"}${dockerSafeId(rolloutId)}-${owner}`;
}

/**
 * A rollout id as it goes into Docker names: itself when Docker accepts it, else sanitised and
 * suffixed with a short hash of the original, so two ids never share a name.
 */
export function dockerSafeId(rolloutId: string): string {
  if (NAME_SAFE.test(rolloutId) && rolloutId.length <= 100) return rolloutId;
  const hash = createHash("sha256").update(rolloutId).digest("hex").slice(0, 12);
  return `${rolloutId.replace(/[^A-Za-z0-9_.-]/g, "_").slice(0, 80)}-${hash}`;
}

/** A scope in Docker names: `s` + 8 hex chars of its sha256 (a scope is a Redis key prefix, e.g. `{fleet}`). */
export function scopeTag(scope: string): string {
  return `s${createHash("sha256").update(scope).digest("hex").slice(0, 8)}`;
}

const [AGENT_UID, AGENT_GID = AGENT_UID] = AGENT_USER.split(":");

/** The sandbox's workspace volume (uncapped workspaces only, `diskMb: null`), destroyed with it. */
export function workspaceVolumeName(containerName: string): string {
  return `${containerName}-workspace`;
}

/** Defaults overlaid with the spec's relaxations (each option replaces exactly one default). */
export function effectiveLimits(spec: SandboxSpec, defaults: Readonly<SandboxLimits>): SandboxLimits {
  const o = spec.options;
  return {
    memoryMb: o.memoryMb ?? defaults.memoryMb,
    cpus: o.cpus ?? defaults.cpus,
    pidsLimit: o.pidsLimit ?? defaults.pidsLimit,
    tmpfsMb: o.tmpfsMb ?? defaults.tmpfsMb,
    readOnlyRoot: o.readOnlyRoot ?? defaults.readOnlyRoot,
    diskMb: o.diskMb ?? defaults.diskMb,
  };
}

/**
 * The labels of a sandbox (and its volume); `scope` adds `fleet.scope` (see `LABEL_SCOPE`),
 * `instance` `fleet.instance` (`LABEL_INSTANCE`).
 */
export function sandboxLabels(spec: SandboxSpec, scope?: string, instance?: string): Record<string, string> {
  return {
    [LABEL_MANAGED]: "true",
    [LABEL_ROLLOUT]: spec.rolloutId,
    [LABEL_OWNER]: spec.owner,
    [LABEL_EXPIRES]: String(spec.expiresAt),
    ...(scope ? { [LABEL_SCOPE]: scope } : {}),
    ...(instance ? { [LABEL_INSTANCE]: instance } : {}),
  };
}

/** Marks the kill-sweep reaper containers: `fleet.managed` too (DESIGN §9), but no `fleet.owner`, so `list` never takes one for a sandbox. */
export const LABEL_REAPER = "fleet.reaper";

/** The labels of a kill-sweep reaper beside a rollout's sandbox. */
export function reaperLabels(rolloutId: string, scope?: string): Record<string, string> {
  return {
    [LABEL_MANAGED]: "true",
    [LABEL_REAPER]: "true",
    [LABEL_ROLLOUT]: rolloutId,
    ...(scope ? { [LABEL_SCOPE]: scope } : {}),
  };
}

/**
 * The Docker create request for a sandbox: hardened by default (no network, no capabilities,
 * no-new-privileges, read-only root, tmpfs scratch and workspace, pids/memory/CPU limits,
 * an init, no host mounts). Pure; the benchmark's raw loop uses the same request.
 */
export function buildContainerConfig(
  spec: SandboxSpec,
  defaults: Readonly<SandboxLimits> = DEFAULT_SANDBOX_LIMITS,
  scope?: string,
  instance?: string,
): Dockerode.ContainerCreateOptions {
  const limits = effectiveLimits(spec, defaults);
  const name = sandboxName(spec.rolloutId, spec.owner, scope);
  const labels = sandboxLabels(spec, scope, instance);
  const memoryBytes = sandboxMemoryMb(limits) * 1024 * 1024;
  const tmpfs: Record<string, string> = {};
  // `exec`: Docker's tmpfs default is noexec, and tests and solutions are scripts run from there.
  for (const m of TMPFS_MOUNTS)
    tmpfs[m.path] = `rw,exec,nosuid,nodev,${tmpfsCaps(limits.tmpfsMb)},mode=${m.mode}`;
  tmpfs[FENCE_MOUNT.path] = FENCE_TMPFS;
  // Docker's own /dev/shm (ShmSize) takes no inode cap: the sandbox gets a tmpfs of its own there.
  tmpfs["/dev/shm"] = `rw,noexec,nosuid,nodev,${tmpfsCaps(SHM_MB)},mode=1777`;

  // Capped: a tmpfs of its own, like the scratch directories (Docker copies no image files into
  // it, only the directory's mode: the provider stages them). Uncapped: a named volume, which
  // copies them up.
  const capped = limits.diskMb !== null;
  if (capped) {
    tmpfs[SANDBOX_PATHS.workspace] =
      `rw,exec,nosuid,nodev,${tmpfsCaps(limits.diskMb!)},uid=${AGENT_UID},gid=${AGENT_GID},mode=0755`;
  }
  const mounts: Dockerode.MountSpec[] = capped
    ? []
    : [
        {
          Type: "volume",
          Source: workspaceVolumeName(name),
          Target: SANDBOX_PATHS.workspace,
          VolumeOptions: { Labels: labels },
        },
      ];

  return {
    name,
    Image: spec.image,
    // Our keepalive whatever the image's ENTRYPOINT/CMD say.
    Entrypoint: ["sleep", "infinity"],
    User: KEEPALIVE_USER,
    WorkingDir: SANDBOX_PATHS.workspace,
    Hostname: "sandbox",
    Labels: labels,
    HostConfig: {
      NetworkMode: spec.network === "none" ? "none" : spec.network,
      CapDrop: ["ALL"],
      SecurityOpt: ["no-new-privileges"],
      ReadonlyRootfs: limits.readOnlyRoot,
      Tmpfs: tmpfs,
      Mounts: mounts,
      PidsLimit: limits.pidsLimit,
      Sysctls: { ...IPC_SYSCTLS },
      Memory: memoryBytes,
      MemorySwap: memoryBytes,
      NanoCpus: Math.round(limits.cpus * 1e9),
      Init: true,
      IpcMode: "private",
      Privileged: false,
      // Under host memory pressure, sandboxes go before the fleet's own processes.
      OomScoreAdj: 500,
      ...(spec.options.pidMode === "host" ? { PidMode: "host" } : {}),
    },
  };
}
