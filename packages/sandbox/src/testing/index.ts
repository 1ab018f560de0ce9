// Test support, not for production code: an in-memory provider for unit tests, and a base rootfs
// plus a capability check for bubblewrap tests.
import { type FleetError, isFleetError } from "@fleet/contracts";

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
 * What an agent would leave to be masked instead of graded: a loop in its own session killing
 * every process of its uid, a kill sweep run as that uid included. Prints `started`.
 */
export const KILL_EVERY_SWEEP_ARGV = [
  "bash",
  "-c",
  "setsid bash -c 'while :; do kill -9 -1; done' >/dev/null 2>&1 < /dev/null & echo started",
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
export const REFORKING_CHAIN_ARGV = [
  "bash",
  "-c",
  "echo started; setsid bash -c 'h() { kill -9 -1; echo >> /tmp/chain; h & exit; }; h' >/dev/null 2>&1 < /dev/null &",
];
