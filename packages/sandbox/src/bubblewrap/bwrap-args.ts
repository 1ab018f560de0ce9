import type { SandboxSpec } from "@fleet/contracts";
import { FENCE_MOUNT, KEEPALIVE_USER, SHM_MB, TMPFS_MOUNTS } from "../docker/container-config.ts";
import { SANDBOX_PATHS, STANDARD_PATH } from "../provider.ts";

/** The PATH every exec gets (Docker's default for Debian images). */
export const SANDBOX_PATH_ENV = STANDARD_PATH;

/** What `bwrapArgv` needs to build one sandbox's `bwrap` command line. */
export interface BwrapLayout {
  /** Host directory holding the unpacked base rootfs; mounted read-only at `/`. */
  rootfs: string;
  /** Host directory bound read-write at `/workspace` (owned by the agent uid). */
  workspaceDir: string;
  /** The sandbox's hostname (its UTS namespace is private). */
  hostname: string;
  /** Size of each tmpfs in MiB. */
  tmpfsMb: number;
  /** File descriptor bwrap writes its JSON info (`child-pid`) to. */
  infoFd: number;
  /** Share the host's PID namespace (only so the probe can be shown to refuse it). */
  hostPid?: boolean;
  /**
   * Whether a `/proc` path exists on this kernel (bwrap cannot mount over one that does not).
   * @defaultValue every path exists
   */
  procHas?: (path: string) => boolean;
  /**
   * Host directory (the keepalive user's, 0755) bound read-write at the verify fence's mount
   * point (`FENCE_MOUNT`), when the rootfs has one (bwrap cannot make one in a read-only root).
   * A bind, not a tmpfs: bwrap makes its tmpfs mounts root's, and the tests run as root. Without
   * it the sandbox has no fence, and a verify delivered again waits out the tests of the attempt
   * before it, as before there was one.
   */
  fenceDir?: string;
}

/**
 * Host kernel files in `/proc` the sandbox sees empty, as Docker masks them (`maskedPaths`; its
 * `/sys/firmware` is not here: the sandbox has no `/sys`). Uid 0 inside is the host's root, so
 * without this the tests (run as root) and the agent's code they run read the host's keyrings
 * (`/proc/keys`) and kernel timers (`/proc/timer_list`).
 */
export const MASKED_PROC_FILES = [
  "/proc/kcore",
  "/proc/keys",
  "/proc/latency_stats",
  "/proc/timer_list",
  "/proc/timer_stats",
  "/proc/sched_debug",
] as const;
export const MASKED_PROC_DIRS = ["/proc/acpi", "/proc/asound", "/proc/scsi"] as const;
/**
 * Read-only, as Docker has them (`readonlyPaths`): bwrap leaves the new /proc's `sys` writable (its
 * own check of it fails), and root here could set host-wide kernel settings
 * (kernel.core_pattern: a command run as the host's root); `sysrq-trigger` takes no capability,
 * only its file's owner (a write could reboot the host). Per-namespace values still read as the
 * reader's own.
 */
export const READ_ONLY_PROC_PATHS = [
  "/proc/bus",
  "/proc/fs",
  "/proc/irq",
  "/proc/sys",
  "/proc/sysrq-trigger",
] as const;

/**
 * `bwrap` arguments for a sandbox: every namespace but the user one private (the caller is
 * root, so uids inside are the host's), the rootfs read-only, fresh `/proc` (host kernel files in
 * it masked or read-only, as Docker has them),
 * a minimal `/dev` with a `/dev/shm` tmpfs,
 * size-capped tmpfs for `/tmp`, `/tests`, `/solution`, `/logs`, the workspace bound read-write,
 * every capability dropped, and `sleep infinity` as nobody as the child of bwrap's PID-1 reaper.
 */
export function bwrapArgv(layout: BwrapLayout): string[] {
  // The Docker provider's scratch mounts, at the same modes (and counted alike in the memory limit).
  const tmpfs = (path: string, mode: string, mb = layout.tmpfsMb) => [
    "--perms",
    mode,
    "--size",
    String(mb * 1024 * 1024),
    "--tmpfs",
    path,
  ];
  const procHas = layout.procHas ?? (() => true);
  return [
    ...(layout.hostPid ? [] : ["--unshare-pid"]),
    "--unshare-net",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--hostname",
    layout.hostname,
    "--ro-bind",
    layout.rootfs,
    "/",
    "--proc",
    "/proc",
    ...READ_ONLY_PROC_PATHS.filter(procHas).flatMap((p) => ["--ro-bind", p, p]),
    // `--dev-bind`, as Docker binds it: bwrap's other binds are nodev, where opening /dev/null is
    // EACCES rather than empty. Writing to it writes to /dev/null.
    ...MASKED_PROC_FILES.filter(procHas).flatMap((p) => ["--dev-bind", "/dev/null", p]),
    ...MASKED_PROC_DIRS.filter(procHas).flatMap((p) => ["--perms", "0555", "--tmpfs", p, "--remount-ro", p]),
    "--dev",
    "/dev",
    // POSIX message queues of the sandbox's own IPC namespace, at Docker's path: without the
    // mount they still exist (mq_open) but no probe or scrub sees them, and an interrupted run's
    // queues reached its rerun.
    "--mqueue",
    "/dev/mqueue",
    // A /dev/shm like Docker's (bwrap's --dev has only a root-owned 0755 directory there):
    // POSIX shared memory (Python's multiprocessing locks) works for the agent too.
    ...tmpfs("/dev/shm", "1777", SHM_MB),
    ...TMPFS_MOUNTS.flatMap((m) => tmpfs(m.path, m.mode)),
    ...(layout.fenceDir ? ["--bind", layout.fenceDir, FENCE_MOUNT.path] : []),
    "--bind",
    layout.workspaceDir,
    SANDBOX_PATHS.workspace,
    "--chdir",
    SANDBOX_PATHS.workspace,
    "--new-session",
    "--cap-drop",
    "ALL",
    // Only for the keepalive's setpriv below: its switch to nobody clears them.
    "--cap-add",
    "CAP_SETUID",
    "--cap-add",
    "CAP_SETGID",
    "--info-fd",
    String(layout.infoFd),
    "--",
    // The keepalive runs as nobody, as Docker's does (`KEEPALIVE_USER`): as root, the tests (root
    // without capabilities) and the agent's code they run could kill it, ending the sandbox,
    // and turn a failing grade into a `sandbox_lost` mask.
    ...keepaliveArgv(),
  ];
}

/**
 * The keepalive: `sleep infinity` as nobody with no_new_privs (setuid to nobody clears its
 * effective and permitted sets; without CAP_SETPCAP `--bounding-set -all` may leave SETUID/SETGID
 * in its bounding set, which nothing it runs can use).
 */
export function keepaliveArgv(): string[] {
  const [uid, gid] = KEEPALIVE_USER.split(":") as [string, string];
  return [
    "setpriv",
    "--reuid",
    uid,
    "--regid",
    gid,
    "--clear-groups",
    "--no-new-privs",
    "--bounding-set",
    "-all",
    "--inh-caps",
    "-all",
    "--",
    "sleep",
    "infinity",
  ];
}

/**
 * What `nsenter` joins, by path: each namespace and the root directory (`/proc/<pid>/fd/<n>` of
 * descriptors the worker holds, so they are the sandbox's and no process's that took its pid).
 */
export interface NsenterFiles {
  pid: string;
  mount: string;
  net: string;
  ipc: string;
  uts: string;
  cgroup: string;
  root: string;
}

/** The `/proc/<pid>/` entries behind each of `NsenterFiles`. */
export const NSENTER_PROC_ENTRIES: Readonly<Record<keyof NsenterFiles, string>> = {
  pid: "ns/pid",
  mount: "ns/mnt",
  net: "ns/net",
  ipc: "ns/ipc",
  uts: "ns/uts",
  cgroup: "ns/cgroup",
  root: "root",
};

/**
 * The host command that runs `argv` inside a sandbox: `nsenter` joins the namespaces and root of
 * the sandbox's PID 1 (`target`: files of them the worker holds, never its pid, which a host
 * process may have taken by the time nsenter opens it); the sandbox's own `setpriv` then switches to
 * `user`, clears supplementary groups, sets no_new_privs and empties the bounding and inheritable
 * capability sets (so even uid 0 ends with no capability after the next execve), and `env -i
 * --chdir` enters `cwd` with exactly `env` (`K=V` entries). `argv` is expected to be
 * deadline-wrapped already (`deadlineArgv`).
 *
 * The command's environment is given here, to `env`, after every privileged step: the host
 * process itself runs with `HOST_HELPER_ENV` only, so nothing a caller sets (PATH, LD_PRELOAD,
 * ...) reaches `nsenter` or `setpriv`, which run with full capabilities.
 */
export function nsenterArgv(
  target: NsenterFiles,
  user: { uid: string; gid: string },
  cwd: string,
  argv: readonly string[],
  env: readonly string[] = [],
  /** Capabilities kept in the bounding set (e.g. `kill`, for root's kill sweep); none by default. */
  keepCaps: readonly string[] = [],
): string[] {
  const joins = (Object.keys(NSENTER_PROC_ENTRIES) as Array<keyof NsenterFiles>).map(
    (k) => `--${k}=${target[k]}`,
  );
  return [
    ...joins,
    "--",
    "setpriv",
    "--reuid",
    user.uid,
    "--regid",
    user.gid,
    "--clear-groups",
    "--no-new-privs",
    "--bounding-set",
    ["-all", ...keepCaps.map((c) => `+${c}`)].join(","),
    "--inh-caps",
    "-all",
    "--",
    "env",
    "-i",
    `--chdir=${cwd}`,
    "--",
    // Assignments after `--` still are assignments; the first word without `=` is the command
    // (the deadline's `timeout`).
    ...env,
    ...argv,
  ];
}

/**
 * The whole environment of the host processes that enter a sandbox (`nsenter`, then `setpriv`
 * inside), whatever the command's own environment is.
 */
export const HOST_HELPER_ENV: Readonly<Record<string, string>> = { PATH: SANDBOX_PATH_ENV };

/** Whether a sandbox spec asks for something this provider cannot give; the reason, or null. */
export function unsupportedSpec(spec: SandboxSpec): string | null {
  if (spec.network !== "none")
    return `network '${spec.network}' (bubblewrap sandboxes have no network but loopback)`;
  if (spec.options.readOnlyRoot === false) return "a writable root (the rootfs is shared read-only)";
  return null;
}
