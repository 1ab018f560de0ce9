import { z } from "zod";
import { CappedText, Millis } from "./bounded.ts";

export const ProviderName = z.enum(["docker", "bubblewrap"]);
export type ProviderName = z.infer<typeof ProviderName>;

/**
 * Per-task relaxations of the hardened sandbox defaults. Strict: an unknown option is a final
 * `invalid_task` error, never silently ignored.
 */
export const SandboxOptions = z.strictObject({
  memoryMb: z.number().int().min(16).max(65536).optional(),
  /**
   * At least 0.01: Docker refuses less, and a value that rounds to 0 nano-CPUs would mean no CPU
   * limit at all.
   */
  cpus: z.number().min(0.01, "must be at least 0.01 (a hundredth of a CPU)").max(64).optional(),
  pidsLimit: z.number().int().min(8).max(32768).optional(),
  /**
   * Size of the writable workspace, where the provider can enforce it (Docker: also 256 files or
   * directories per MiB, an average of 4 KiB each).
   */
  diskMb: z.number().int().min(1).max(1_048_576).optional(),
  /** Size of each scratch tmpfs (`/tmp`, `/tests`, `/solution`, `/logs`; Docker: 256 inodes per MiB). */
  tmpfsMb: z.number().int().min(1).max(65536).optional(),
  readOnlyRoot: z.boolean().optional(),
  /** `host` exists only so the isolation probe can be proven to refuse it. */
  pidMode: z.enum(["private", "host"]).optional(),
});
export type SandboxOptions = z.infer<typeof SandboxOptions>;

/**
 * What a sandbox gets of each limit its task's `sandbox` options leave unset (the providers'
 * hardened defaults, `DEFAULT_SANDBOX_LIMITS` in @fleet/sandbox).
 */
export const DEFAULT_SANDBOX_SIZES = Object.freeze({
  memoryMb: 1024,
  cpus: 1,
  pidsLimit: 256,
  tmpfsMb: 256,
  diskMb: 1024,
});

/**
 * The operator's ceiling on what a task's `sandbox` options may ask, per option, and the variable
 * that sets it (dispatcher and workers read the same ones). Unset: the schema's own bound.
 */
export const SANDBOX_CEILING_VARS = Object.freeze({
  memoryMb: "FLEET_SANDBOX_MAX_MEMORY_MB",
  cpus: "FLEET_SANDBOX_MAX_CPUS",
  pidsLimit: "FLEET_SANDBOX_MAX_PIDS",
  diskMb: "FLEET_SANDBOX_MAX_DISK_MB",
  tmpfsMb: "FLEET_SANDBOX_MAX_TMPFS_MB",
});
export type SandboxCeiling = Partial<Record<keyof typeof SANDBOX_CEILING_VARS, number>>;

/**
 * Each option of `options` that asks for more than `ceiling` allows, with what it asks, the
 * ceiling and the variable that sets it. Empty when within it.
 */
export function sandboxOverCeiling(
  options: SandboxOptions | undefined,
  ceiling: SandboxCeiling,
): { path: string; message: string }[] {
  const over: { path: string; message: string }[] = [];
  for (const key of Object.keys(SANDBOX_CEILING_VARS) as (keyof SandboxCeiling)[]) {
    const asked = options?.[key];
    const max = ceiling[key];
    if (asked !== undefined && max !== undefined && asked > max) {
      over.push({
        path: `sandbox.${key}`,
        message: `asks for ${asked}, more than this fleet allows (${SANDBOX_CEILING_VARS[key]}=${max})`,
      });
    }
  }
  return over;
}

/** `sandboxOverCeiling`'s findings as one line, for a 422's message or a failed rollout's reason. */
export function describeOverCeiling(over: { path: string; message: string }[]): string {
  return over.map((o) => `${o.path} ${o.message}`).join("; ");
}

/** Everything a provider needs to create a sandbox. */
export const SandboxSpec = z.strictObject({
  image: z.string().min(1),
  rolloutId: z.string().min(1),
  /** Who destroys it (DESIGN §2 rule 11). */
  owner: z.enum(["resources", "agent"]),
  /** Epoch ms after which the janitor may reap it. */
  expiresAt: z.number().int().positive(),
  options: SandboxOptions.default({}),
  /** `none` (default) or the name of an internal network (model gateway access). */
  network: z.string().min(1).default("none"),
});
export type SandboxSpec = z.infer<typeof SandboxSpec>;
export type SandboxSpecInput = z.input<typeof SandboxSpec>;

/** Enough to find a sandbox again from any worker: provider, endpoint and id. */
export const SandboxHandle = z.strictObject({
  provider: ProviderName,
  /** Where the sandbox lives (e.g. the Docker endpoint), so another host can reach it. */
  endpoint: z.string(),
  id: z.string().min(1),
  name: z.string().min(1),
  rolloutId: z.string().min(1),
  owner: z.enum(["resources", "agent"]),
  /** Extra resources destroyed with the sandbox (e.g. its workspace volume). */
  volumes: z.array(z.string()).default([]),
  /**
   * The daemon's own id, for an endpoint every host names alike (a local `unix://` socket): a
   * worker on another host, whose socket leads to another daemon, refuses the handle instead of
   * taking a 404 there for the sandbox being gone.
   */
  daemon: z.string().min(1).optional(),
});
export type SandboxHandle = z.infer<typeof SandboxHandle>;

export const ExecOptions = z.strictObject({
  deadlineMs: Millis,
  env: z.record(z.string(), z.string()).default({}),
  cwd: z.string().optional(),
  /** `uid[:gid]` or a name; defaults to the sandbox's unprivileged user. */
  user: z.string().optional(),
  stdin: z.string().optional(),
  /** Cap for stdout and for stderr, each. */
  maxOutputBytes: z
    .number()
    .int()
    .positive()
    .default(1024 * 1024),
});
export type ExecOptions = z.input<typeof ExecOptions>;

/**
 * One command's outcome. `exitCode` follows the envelope of DESIGN §2 rule 6: the command's
 * own code, `-1` when killed at its deadline (`timedOut`).
 */
/**
 * An exec's exit code that says it was ended by a signal (128 + n, for the signals 1 to 64), or
 * by the provider (-1). Not 128 or 193 to 255: a program's own code (`exit -1` is 255).
 */
export function endedBySignal(exitCode: number): boolean {
  return (exitCode > 128 && exitCode <= 128 + MAX_SIGNAL) || exitCode < 0;
}

/** Linux's highest signal number (SIGRTMAX). */
const MAX_SIGNAL = 64;

export const ExecResult = z.object({
  exitCode: z.number().int(),
  timedOut: z.boolean(),
  stdout: z.string(),
  stderr: z.string(),
  stdoutTruncated: z.boolean(),
  stderrTruncated: z.boolean(),
  durationMs: z.number().nonnegative(),
  oomKilled: z.boolean().default(false),
});
export type ExecResult = z.infer<typeof ExecResult>;

/** Positive proof that something was stopped or removed. */
export const CleanupReceipt = z.object({
  confirmed: z.boolean(),
  /** What was cleaned: `processes` (a borrower's harness), `sandbox` (owner's destroy). */
  scope: z.enum(["processes", "sandbox"]),
  at: z.number().int().nonnegative(),
  /** Already gone before we acted (idempotent destroy). */
  alreadyGone: z.boolean().default(false),
  remaining: z.number().int().nonnegative().default(0),
  detail: CappedText.optional(),
  /** A root sweep asked to raise the sandbox's verify fence did (`KillOptions.fenceEpoch`). */
  fenced: z.boolean().optional(),
});
export type CleanupReceipt = z.infer<typeof CleanupReceipt>;

export const ProbeReport = z.object({
  isolated: z.boolean(),
  checks: z.record(z.string(), z.boolean()),
  detail: CappedText,
  durationMs: z.number().nonnegative(),
  /**
   * /workspace held nothing when probed (before the task's files are staged): the task's files
   * are then the whole starting state, and a run restarted after an interrupted one can be put
   * back to it. False when the image brought files there; absent when not observed.
   */
  workspaceEmpty: z.boolean().optional(),
  /**
   * The root filesystem was read-only and nothing in the scratch directories (/tmp, /logs,
   * /dev/shm, /dev/mqueue) belonged to the agent's uid when probed: whatever the agent leaves outside the
   * workspace is then its own doing, in scratch, and a restarted run can remove all of it. False
   * with a writable root or when the image brought such files; absent when not observed.
   */
  scratchClean: z.boolean().optional(),
});
export type ProbeReport = z.infer<typeof ProbeReport>;
