import { existsSync, readFileSync } from "node:fs";
import { mkdir, rmdir, writeFile } from "node:fs/promises";
import { join } from "node:path";

/** The cgroup v1 controllers a bubblewrap sandbox is limited by, when the host lets us. */
export type CgroupController = "memory" | "pids";

export interface SandboxCgroup {
  controller: CgroupController;
  /** Absolute path of the sandbox's cgroup directory. */
  dir: string;
}

const V1_ROOT = "/sys/fs/cgroup";

/**
 * Where this process sits in each cgroup v1 hierarchy (`/proc/self/cgroup`). Sandbox cgroups
 * are made below it, so whatever limits the host puts on the fleet still hold for them.
 */
function ownCgroupPath(controller: CgroupController): string | null {
  try {
    for (const line of readFileSync("/proc/self/cgroup", "utf8").split("\n")) {
      const [, controllers, path] = line.split(":");
      if (controllers?.split(",").includes(controller) && path !== undefined) return path;
    }
  } catch {}
  return null;
}

/**
 * The cgroup directories `createSandboxCgroups(name)` makes on this host (one per controller
 * whose v1 hierarchy it has). Recorded in the sandbox's state before they are made, so that a
 * creator that dies in between leaves them to the next destroy, not behind for good.
 */
export function sandboxCgroupDirs(name: string): SandboxCgroup[] {
  const dirs: SandboxCgroup[] = [];
  for (const controller of ["memory", "pids"] as const) {
    const own = ownCgroupPath(controller);
    const base = join(V1_ROOT, controller);
    if (own !== null && existsSync(join(base, "cgroup.procs"))) {
      dirs.push({ controller, dir: join(base, own, "fleet-bwrap", name) });
    }
  }
  return dirs;
}

/**
 * Create the sandbox's memory and pids cgroups (cgroup v1) and set their limits. Returns the
 * ones made, and why any could not be (a read-only or absent hierarchy: that limit is then not
 * enforced). cgroup v2-only hosts get none (not implemented).
 */
export async function createSandboxCgroups(
  name: string,
  limits: { memoryMb: number; pidsLimit: number },
): Promise<{ cgroups: SandboxCgroup[]; missing: string[] }> {
  const cgroups: SandboxCgroup[] = [];
  const missing: string[] = [];
  const plan: Array<[CgroupController, Array<[string, string]>]> = [
    [
      "memory",
      [
        ["memory.limit_in_bytes", String(limits.memoryMb * 1024 * 1024)],
        ["memory.memsw.limit_in_bytes", String(limits.memoryMb * 1024 * 1024)],
      ],
    ],
    ["pids", [["pids.max", String(limits.pidsLimit)]]],
  ];
  const dirs = sandboxCgroupDirs(name);
  for (const [controller, files] of plan) {
    const dir = dirs.find((d) => d.controller === controller)?.dir;
    if (dir === undefined) {
      missing.push(`${controller} (no cgroup v1 hierarchy)`);
      continue;
    }
    try {
      await mkdir(dir, { recursive: true });
      for (const [file, value] of files) {
        if (file === "memory.memsw.limit_in_bytes" && !existsSync(join(dir, file))) continue;
        await writeFile(join(dir, file), value);
      }
      cgroups.push({ controller, dir });
    } catch (err) {
      await rmdir(dir).catch(() => undefined);
      missing.push(`${controller} (${(err as NodeJS.ErrnoException).code ?? String(err)})`);
    }
  }
  return { cgroups, missing };
}

/** Move host pids into every cgroup (their later children follow). */
export async function moveIntoCgroups(
  cgroups: readonly SandboxCgroup[],
  pids: readonly number[],
): Promise<void> {
  for (const cg of cgroups) {
    for (const pid of pids) await writeFile(join(cg.dir, "cgroup.procs"), String(pid));
  }
}

/** The host shell `sandboxExecArgv` runs (the bubblewrap provider's host check asks for it). */
export const HOST_BASH = "/bin/bash";

/**
 * Host argv prefix that sets the command's umask to 022, as Docker's exec does, and puts it into
 * the cgroups before it `exec`s the rest (a process started from outside, like `nsenter`, does
 * not inherit the sandbox's cgroups). The umask is not the worker's: one under a strict umask
 * (077) would otherwise give the agent's files and the directories staging makes mode 600/700,
 * which the tests (root without capabilities, so no DAC override) cannot read: a correct agent
 * graded 0. It also makes the command (and all it starts) the OOM killer's first pick in the
 * sandbox's memory cgroup, before the sandbox's PID 1 and keepalive: an agent that filled the
 * cgroup (kernel memory its tmpfs inodes pin, which no tmpfs size bounds under bwrap) had PID 1
 * killed, the sandbox lost and its rollout masked, a mask the agent chose. (Raised, since
 * lowering PID 1's takes CAP_SYS_RESOURCE, which a worker in a container may not have.)
 * First it closes every descriptor above the three standard ones: the worker's own are
 * close-on-exec, but one the worker inherited is not (a pipe or file its launcher, CI runner or
 * supervisor left open), and nsenter, setpriv and the command would inherit it: the agent could
 * write to a host file or read the host's `/` through it. (bash, for `{f}>&-`: dash takes
 * single-digit descriptors only.)
 */
export function sandboxExecArgv(cgroups: readonly SandboxCgroup[], argv: readonly string[]): string[] {
  const script =
    // biome-ignore lint/suspicious/noTemplateCurlyInString: bash's parameter expansion, not a template
    'for f in /proc/$$/fd/*; do f=${f##*/}; [ "$f" -gt 2 ] && exec {f}>&-; done; umask 022; echo 1000 > /proc/self/oom_score_adj 2>/dev/null; n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || { echo "cannot join cgroup $1" >&2; exit 125; }; shift; n=$((n-1)); done; exec "$@"';
  return [
    HOST_BASH,
    // Never the host's ~/.bashrc: bash reads it when its stdin is a socket (Node's pipes are),
    // taking itself for a remote shell.
    "--norc",
    "--noprofile",
    "-c",
    script,
    "sh",
    String(cgroups.length),
    ...cgroups.map((cg) => join(cg.dir, "cgroup.procs")),
    ...argv,
  ];
}

/**
 * How many processes the memory cgroup's OOM killer has killed in the sandbox so far (a count
 * that only grows: compare two readings), or null without a memory cgroup.
 */
export function cgroupOomKills(cgroups: readonly SandboxCgroup[]): number | null {
  const memory = cgroups.find((cg) => cg.controller === "memory");
  if (!memory) return null;
  try {
    const m = /oom_kill (\d+)/.exec(readFileSync(join(memory.dir, "memory.oom_control"), "utf8"));
    return m === null ? null : Number(m[1]);
  } catch {
    return null;
  }
}

/**
 * The state (`THAWED`, `FREEZING`, `FROZEN`) of the cgroup v1 freezer a host process is in, or
 * null without one (no v1 freezer hierarchy; cgroup v2's freezer is not looked at).
 */
export function freezerState(pid: number): string | null {
  try {
    for (const line of readFileSync(`/proc/${pid}/cgroup`, "utf8").split("\n")) {
      const [, controllers, path] = line.split(":");
      if (!controllers?.split(",").includes("freezer") || path === undefined) continue;
      return readFileSync(join(V1_ROOT, "freezer", path, "freezer.state"), "utf8").trim();
    }
  } catch {}
  return null;
}

/**
 * The host pids in the sandbox's cgroups (none without cgroups, or once they are gone): its own
 * processes, and the host side of each exec (`sandboxExecArgv` puts `nsenter` there).
 */
export function cgroupProcesses(cgroups: readonly SandboxCgroup[]): number[] {
  const pids = new Set<number>();
  for (const cg of cgroups) {
    try {
      for (const line of readFileSync(join(cg.dir, "cgroup.procs"), "utf8").split("\n")) {
        if (/^\d+$/.test(line)) pids.add(Number(line));
      }
    } catch {}
  }
  return [...pids];
}

/** Remove the (by now empty) cgroups; returns the ones that could not be removed. */
export async function removeCgroups(cgroups: readonly SandboxCgroup[]): Promise<string[]> {
  const left: string[] = [];
  for (const cg of cgroups) {
    for (let attempt = 0; ; attempt++) {
      try {
        await rmdir(cg.dir);
        break;
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code === "ENOENT") break;
        if (code !== "EBUSY" || attempt >= 20) {
          left.push(`${cg.dir}: ${code ?? String(err)}`);
          break;
        }
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
    }
  }
  return left;
}
