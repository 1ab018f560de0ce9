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
