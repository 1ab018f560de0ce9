import type { SandboxHandle } from "@fleet/contracts";
import { FleetError } from "@fleet/contracts";
import { parseNumericUser } from "./exec-command.ts";
import { AGENT_USER, OPS_CWD, OPS_ENV, SANDBOX_PATHS, type SandboxProvider } from "./provider.ts";

/**
 * Besides the workspace, the directories an agent can write to in every provider's sandbox (the
 * root filesystem is read-only; `/tests` and `/solution` belong to root), POSIX message queues
 * included. Those a sandbox lacks are skipped. SysV IPC objects are not files: `SYSV_IPC_OF`
 * covers them.
 */
export const SCRATCH_DIRS: readonly string[] = ["/tmp", SANDBOX_PATHS.logs, "/dev/shm", "/dev/mqueue"];

/** The agent's numeric uid (`AGENT_USER`'s). */
export const AGENT_UID = parseNumericUser(AGENT_USER)!.uid;

/**
 * Sets `o` to the mount options of `/` (the last mount there, the one on top). Read from
 * mountinfo, not `[ -w / ]`: busybox's `test` answers "writable" to root on a read-only mount.
 */
const ROOT_MOUNT_OPTIONS = `o=; while read -r _ _ _ _ mp opts _; do [ "$mp" = / ] && o=$opts; done < /proc/self/mountinfo`;

/**
 * A shell function: `sysv_ipc_of <uid>` prints `-m <id>`, `-q <id>` or `-s <id>` (`ipcrm`'s flags)
 * for every SysV shared memory segment, message queue and semaphore set in the sandbox's IPC
 * namespace that `uid` owns or created. A sandbox's IPC namespace lives as long as the sandbox,
 * so these outlast the agent's processes like files in /tmp do. (Column layouts of
 * /proc/sysvipc/{shm,msg,sem}: uid and cuid are the 8th and 10th fields, the 5th and 7th for sem.)
 */
const SYSV_IPC_OF = `sysv_ipc_of() { for t in shm:m msg:q sem:s; do f=/proc/sysvipc/\${t%%:*}; [ -r "$f" ] || continue; if [ "$t" = sem:s ]; then while read -r _ id _ _ u _ c _; do if [ "$u" = "$1" ] || [ "$c" = "$1" ]; then echo "-s $id"; fi; done < "$f"; else while read -r _ id _ _ _ _ _ u _ c _; do if [ "$u" = "$1" ] || [ "$c" = "$1" ]; then echo "-\${t#*:} $id"; fi; done < "$f"; fi; done; }`;

/**
 * The probe script's line saying whether the agent's only writable places besides the workspace
 * are the scratch directories and nothing there is the agent uid's yet: `clean`, or `dirty` when
 * the root filesystem is writable, or a scratch directory holds anything of the agent's uid or
 * cannot be searched. Run as root before the task is staged: in a clean sandbox, whatever of the
 * agent's turns up outside the workspace later is in scratch and is the agent's own doing.
 */
export const SCRATCH_PROBE_LINE = `s=clean; ${ROOT_MOUNT_OPTIONS}; case ",$o," in *,ro,*) ;; *) s=dirty ;; esac; for d in ${SCRATCH_DIRS.join(" ")}; do [ -d "$d" ] || continue; if ! l=$(find "$d" -mindepth 1 -user ${AGENT_UID} 2>/dev/null) || [ -n "$l" ]; then s=dirty; fi; done; ${SYSV_IPC_OF}; [ -z "$(sysv_ipc_of ${AGENT_UID})" ] || s=dirty; echo $s`;

/**
 * Run as the agent with the scratch directories as arguments: remove everything the caller's
 * uid owns in them (directories it made unreadable are opened up first; find's pre-order visits a
 * directory before its entries) and its SysV IPC objects, then prove none is left. Exit 3, naming
 * what is left or what could not be searched, otherwise (no `ipcrm` in the image included).
 */
const SCRUB_SCRATCH = `uid=$(id -u)
${SYSV_IPC_OF}
sysv_ipc_of "$uid" | while read -r flag id; do ipcrm "$flag" "$id" 2>/dev/null; done
left=$(sysv_ipc_of "$uid")
if [ -n "$left" ]; then
  echo "cannot remove SysV IPC objects: $(printf '%s\\n' "$left" | head -n 5 | tr '\\n' ' ')" >&2; exit 3
fi
for d in "$@"; do
  [ -d "$d" ] || continue
  # Opened up in one walk: chmod -R opens each directory before it reads it, relative to its
  # parent, so a chain nested past PATH_MAX opens too (a chmod given full paths could not: the
  # chain's depths past 4096 bytes stayed shut and the rollout was masked at the agent's choice).
  # Someone else's files it cannot change, and does not try to follow links.
  chmod -R u+rwx "$d" 2>/dev/null
  # Then, where chmod -R left any shut (another chmod), a depth at a time, many directories to a
  # chmod (one chmod each took 9 ms: tens of thousands of mode-000 directories outlasted the
  # scrub's minute), then one at a time for what is nested deeper than those rounds reach.
  n=0
  while [ "$n" -lt 16 ] && [ -n "$(find "$d" -mindepth 1 -type d -user "$uid" ! -perm -700 -print -quit 2>/dev/null)" ]; do
    find "$d" -mindepth 1 -type d -user "$uid" ! -perm -700 -exec chmod u+rwx {} + 2>/dev/null
    n=$((n + 1))
  done
  find "$d" -mindepth 1 -type d -user "$uid" ! -perm -700 -exec chmod u+rwx {} \\; 2>/dev/null
  find "$d" -mindepth 1 -user "$uid" -delete 2>/dev/null
  if ! left=$(find "$d" -mindepth 1 -user "$uid" 2>&1); then
    echo "cannot search $d: $(printf '%s\\n' "$left" | head -n 3 | tr '\\n' ' ')" >&2; exit 3
  fi
  if [ -n "$left" ]; then
    echo "cannot clear $d, left: $(printf '%s\\n' "$left" | head -n 5 | tr '\\n' ' ')" >&2; exit 3
  fi
done`;

/**
 * Remove what `user` (the agent) left in the scratch directories (`dirs`, all of them by
 * default), for a run that starts again after an interrupted one: its notes in /tmp must not
 * reach the new run. Fails closed: anything of the user's left, or a directory that cannot be
 * searched, is a retryable `sandbox_lost`.
 */
export async function scrubScratch(
  provider: SandboxProvider,
  handle: SandboxHandle,
  user: string = AGENT_USER,
  dirs: readonly string[] = SCRATCH_DIRS,
): Promise<void> {
  const r = await provider.exec(handle, ["/bin/sh", "-c", SCRUB_SCRATCH, "sh", ...dirs], {
    cwd: OPS_CWD,
    env: { ...OPS_ENV },
    user,
    deadlineMs: 60_000,
    maxOutputBytes: 16 * 1024,
  });
  if (r.exitCode !== 0) {
    throw FleetError.retryable(
      "sandbox_lost",
      `could not clear ${user}'s files from ${dirs.join(", ")} (exit ${r.exitCode}${r.timedOut ? ", timed out" : ""}): ${r.stderr.trim()}`,
    );
  }
}
