// Test support, not for production code: an in-memory provider for unit tests, and a base rootfs
// plus a capability check for bubblewrap tests.
export * from "../bubblewrap/test-rootfs.ts";
export * from "./in-memory-provider.ts";
export * from "./memory-firewall.ts";

/**
 * What an agent would leave to be masked instead of graded: a loop in its own session killing
 * every process of its uid, a kill sweep run as that uid included. Prints `started`.
 */
export const KILL_EVERY_SWEEP_ARGV = [
  "bash",
  "-c",
  "setsid bash -c 'while :; do kill -9 -1; done' >/dev/null 2>&1 < /dev/null & echo started",
];
