// Test support, not for production code: an in-memory provider for unit tests, and a base rootfs
// plus a capability check for bubblewrap tests.
import { setTimeout as delay } from "node:timers/promises";
import { type CleanupReceipt, type FleetError, isFleetError, type SandboxHandle } from "@fleet/contracts";
import { AGENT_USER, ROOT_USER, type SandboxProvider } from "../provider.ts";

export * from "../bubblewrap/test-rootfs.ts";
export * from "./in-memory-provider.ts";
export * from "./memory-firewall.ts";

/**
 * The FleetError `run` (a promise, or a function called now) fails with; throws when it does not
 * fail, or fails with anything else.
 */
export async function fleetError(run: Promise<unknown> | (() => unknown)): Promise<FleetError> {
  try {
    await (typeof run === "function" ? run() : run);
  } catch (err) {
    if (isFleetError(err)) return err as FleetError;
    throw new Error(`expected a FleetError, got ${String(err)}`, { cause: err });
  }
  throw new Error("expected the call to fail");
}

/**
 * Starts, as root in `h`, eight processes of the tests' kind (root without capabilities, running
 * the agent's code) that watch for a kill sweep: each takes the sweep's stdout with
 * `pidfd_getfd`, or opens it through `/proc/<pid>/fd/1` where that is refused (Docker's seccomp
 * profile gates `pidfd_getfd` on CAP_SYS_PTRACE); the same uid needs no capability beyond the
 * sweep's own. It writes
 * `remaining=0` there and kills the sweep. Returns how many of them live, counted by nobody
 * (the sandbox's keepalive uid), whom they cannot reach: 8 once started.
 */
export async function startRootSweepForgers(
  provider: SandboxProvider,
  h: SandboxHandle,
): Promise<() => Promise<number>> {
  const forger = String.raw`
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
done = set(os.listdir('/proc'))
open('/tmp/ready.%d' % os.getpid(), 'w').close()
while True:
    for d in os.listdir('/proc'):
        if not d.isdigit() or d in done: continue
        try:
            c = open('/proc/%s/cmdline' % d, 'rb').read()
            if not c.startswith(b'/bin/sh\0-c\0') or b'remaining=' not in c: continue
            done.add(d)
            try:
                fd = libc.syscall(438, os.pidfd_open(int(d)), 1, 0)
                if fd < 0: fd = os.open('/proc/%s/fd/1' % d, os.O_WRONLY)
                os.write(fd, b'remaining=0\n')
            finally:
                os.kill(int(d), signal.SIGKILL)
        except OSError: pass
`;
  await provider.put(h, "/tmp", { "forger.py": forger }, { user: ROOT_USER });
  const start = await provider.exec(
    h,
    [
      "sh",
      "-c",
      "for i in 1 2 3 4 5 6 7 8; do setsid -f python3 /tmp/forger.py >/dev/null 2>&1 </dev/null; done; until [ $(ls /tmp | grep -c '^ready[.]') -ge 8 ]; do sleep 0.05; done; echo ready",
    ],
    { deadlineMs: 20_000, user: ROOT_USER },
  );
  if (start.stdout !== "ready\n") throw new Error(`the forgers did not start: ${JSON.stringify(start)}`);
  return async () => {
    const r = await provider.exec(
      h,
      ["sh", "-c", "ps -eo uid=,stat=,args= | grep -c '^ *0 [^Z]*python3 /tmp/forger.py'"],
      { deadlineMs: 10_000, user: "65534:65534" },
    );
    return Number(r.stdout.trim());
  };
}

/** What `settledWithin` gives for a promise still pending at its end. */
export const STILL_PENDING = Symbol("still pending");

/**
 * How `p` settled within `ms` (`{ value }` or `{ err }`), or `STILL_PENDING`: for a call that
 * must settle, tested without hanging the test when it does not.
 */
export function settledWithin<T>(
  p: Promise<T>,
  ms: number,
): Promise<{ value: T } | { err: unknown } | typeof STILL_PENDING> {
  return Promise.race([
    p.then(
      (value) => ({ value }),
      (err: unknown) => ({ err }),
    ),
    delay(ms, STILL_PENDING, { ref: false }),
  ]);
}

/**
 * What an agent would leave to be masked instead of graded: a loop in its own session killing
 * every process of its uid, a kill sweep run as that uid included. Prints `started` first: the
 * loop kills the shell that starts it too, on a loaded host before it printed afterwards.
 */
export const KILL_EVERY_SWEEP_ARGV = [
  "bash",
  "-c",
  "echo started; setsid bash -c 'while :; do kill -9 -1; done' >/dev/null 2>&1 < /dev/null & wait",
];

/**
 * Python that creates empty files (1,000 to a directory) in each of `bases` (made first) until the
 * filesystem refuses one (its inode cap, or memory) or `untilS` seconds pass, and prints how many
 * it made: what an agent leaves to fill a sandbox with what no process holds. `nameWidth` pads
 * every name with zeros to that many characters (255: the most kernel memory per file).
 */
export function fillWithEmptyFilesPy(
  bases: readonly string[],
  options: { nameWidth?: number; untilS?: number } = {},
): string {
  const width = options.nameWidth ?? 1;
  return `import os, time
end = time.time() + ${options.untilS ?? 3600}
total = 0
for base in ${JSON.stringify(bases)}:
    n = 0
    try:
        os.makedirs(base, exist_ok=True)
        while time.time() < end:
            d = f"{base}/{n // 1000:0${width}d}"
            if n % 1000 == 0:
                os.mkdir(d)
            os.close(os.open(f"{d}/{n:0${width}d}", os.O_CREAT | os.O_WRONLY, 0o600))
            n += 1
    except OSError:
        pass
    total += n
print(total)
`;
}

/**
 * An agent that outruns a sweep that lists its processes and then signals them: a chain in its
 * own session whose every process kills every other of its uid (a sweep of that uid included),
 * adds a line to `/tmp/chain`, starts the next and exits, so its pid changes all the time. Prints
 * `started` first (the chain kills the shell that starts it).
 */
const REFORKING_CHAIN_ARGV = [
  "bash",
  "-c",
  "echo started; setsid bash -c 'h() { kill -9 -1; echo >> /tmp/chain; h & exit; }; h' >/dev/null 2>&1 < /dev/null &",
];

/**
 * Starts that chain in `h`, waits (up to 10 s) until it has added 100 links and (10 s more) is
 * seen adding more, sweeps the agent's uid (`killProcesses`), then reads the chain's length for a
 * second and at least three times:
 * `grew` (it ran right before the sweep), the sweep's `receipt`, and the lengths read after it
 * (all one number once nothing of the chain runs).
 */
export async function sweepReforkingChain(
  provider: SandboxProvider,
  h: SandboxHandle,
): Promise<{ started: boolean; grew: boolean; receipt: CleanupReceipt; after: number[] }> {
  const start = await provider.exec(h, REFORKING_CHAIN_ARGV, { deadlineMs: 10_000 });
  const links = async () => {
    const r = await provider.exec(h, ["sh", "-c", "wc -l < /tmp/chain"], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    return Number(r.stdout.trim());
  };
  const until = Date.now() + 10_000;
  while ((await links()) < 100 && Date.now() < until);
  const before = await links();
  const growing = Date.now() + 10_000;
  while ((await links()) === before && Date.now() < growing);
  const grew = (await links()) > Math.max(before, 99);
  const receipt = await provider.killProcesses(h, AGENT_USER);
  const after: number[] = [];
  // A second and at least three reads: each is an exec, which may take most of a second on a
  // loaded host, and one read alone would always look still.
  const watchUntil = Date.now() + 1_000;
  while (Date.now() < watchUntil || after.length < 3) after.push(await links());
  return { started: start.stdout.includes("started"), grew, receipt, after };
}
