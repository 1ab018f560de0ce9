import { z } from "zod";
import { AgentSpec } from "./agent.ts";
import { CappedText, Seconds } from "./bounded.ts";
import { FailureKind, FailureRecord, Stage, Usage } from "./failure.ts";
import { JsonObject } from "./json-object.ts";
import { CleanupReceipt, ExecResult, ProbeReport, SandboxHandle, SandboxOptions } from "./sandbox.ts";
import { TaskRef } from "./task.ts";

/** What a rollout id is made of (`RolloutId`). */
const ROLLOUT_ID = /^[A-Za-z0-9_-]{1,64}$/;

export const RolloutId = z.string().regex(ROLLOUT_ID, "must be a rollout id");

/** One rollout request (DESIGN §9). */
export const RolloutRequest = z.strictObject({
  task: TaskRef,
  agent: AgentSpec,
  /** Whole-rollout budget from acceptance; retries share it. Defaults from the task's timeouts. */
  deadlineS: Seconds.optional(),
  sandbox: SandboxOptions.optional(),
  /** Free JSON echoed into the result (no `__proto__` key: `JsonObject`). */
  metadata: JsonObject.superRefine(refuseInexactNumbers).optional(),
});
export type RolloutRequest = z.infer<typeof RolloutRequest>;

/**
 * Metadata is echoed as it was read, so a number that JSON parsing could not read exactly is
 * refused, with where and what to send instead: one past a double's range (1e400 reads as
 * Infinity, which JSON writes back as null), and an integer past 2^53 (a step counter, a token
 * id), already rounded (12345678901234567890 reads back 12345678901234567000; two such values
 * would even hash alike, a different request taken for a replay). Numbers of 1e21 and more
 * (written and read back in exponent form, floats) are left alone.
 */
function refuseInexactNumbers(value: Record<string, unknown>, ctx: z.RefinementCtx): void {
  const walk = (v: unknown, path: PropertyKey[], depth: number): void => {
    if (typeof v === "number") {
      // 1e400 reads as Infinity, which JSON writes back as null: refused, not echoed as null.
      if (!Number.isFinite(v)) {
        ctx.addIssue({
          code: "custom",
          path,
          message: "must be a finite number (1e309 and up do not fit in one)",
        });
        return;
      }
      // Below 1e21 JSON writes such a number back as all its digits (an integer literal it no
      // longer is); from 1e21 up in exponent form, as a float: left alone (6e23 is 6e23).
      if (Number.isInteger(v) && !Number.isSafeInteger(v) && Math.abs(v) < 1e21) {
        ctx.addIssue({
          code: "custom",
          path,
          message: `${v} is an integer beyond 2^53, which JSON numbers cannot hold exactly: send it as a string`,
        });
      }
      return;
    }
    if (depth > 64 || v === null || typeof v !== "object") return;
    for (const [k, x] of Object.entries(v)) walk(x, [...path, Array.isArray(v) ? Number(k) : k], depth + 1);
  };
  walk(value, [], 0);
}
export type RolloutRequestInput = z.input<typeof RolloutRequest>;

/**
 * Largest `metadata` a request may carry, in bytes of JSON (admission refuses more: 422). It is
 * copied into the result, which is kept within 16 KiB by cutting free text; numbers and keys
 * cannot be cut, so an unbounded `metadata` (e.g. token ids) would push out the result's own
 * fields. Keep bulk data on the client side, keyed by the rollout id.
 */
export const MAX_METADATA_BYTES = 4096;

/**
 * Why `metadata` is over `MAX_METADATA_BYTES` as JSON, or `null`: for a client to refuse before
 * it sends what admission would refuse.
 */
export function metadataOverLimit(
  metadata: Record<string, unknown>,
): { bytes: number; message: string } | null {
  let bytes: number;
  try {
    bytes = Buffer.byteLength(JSON.stringify(metadata));
  } catch (err) {
    // Nested past the stack JSON.stringify recurses on (thousands of levels: tens of KB at the
    // least, over the limit whatever it holds); a RangeError here crashed the CLI with its stack.
    if (!(err instanceof RangeError)) throw err;
    return {
      bytes: Number.POSITIVE_INFINITY,
      message: `metadata nests too deeply to be written as JSON, far over the limit of ${MAX_METADATA_BYTES} bytes; keep bulk data on the client, keyed by the rollout id`,
    };
  }
  if (bytes <= MAX_METADATA_BYTES) return null;
  return {
    bytes,
    message: `metadata is ${bytes} bytes of JSON, over the limit of ${MAX_METADATA_BYTES}; keep bulk data on the client, keyed by the rollout id`,
  };
}

export const BatchRequest = z.strictObject({
  rollouts: z.array(RolloutRequest).min(1, "a batch needs at least one rollout"),
});
export type BatchRequest = z.infer<typeof BatchRequest>;

export const TerminalStatus = z.enum(["completed", "masked", "failed", "cancelled"]);
export type TerminalStatus = z.infer<typeof TerminalStatus>;
export const RolloutStatus = z.enum([
  "accepted",
  "seeded",
  "ran",
  "verified",
  "closing",
  ...TerminalStatus.options,
]);
export type RolloutStatus = z.infer<typeof RolloutStatus>;

const TERMINAL: ReadonlySet<string> = new Set(TerminalStatus.options);

export function isTerminal(status: RolloutStatus): status is TerminalStatus {
  // A set lookup: this runs on every stage job (a zod parse there cost more than the check).
  return TERMINAL.has(status);
}

/** What a stage job carries: the rollout id and nothing else (no task, no secrets). */
export const StageName = z.enum(["seed", "run", "verify", "close"]);
export type StageName = z.infer<typeof StageName>;
export const StageJob = z.strictObject({ rolloutId: RolloutId });
export type StageJob = z.infer<typeof StageJob>;

/**
 * `StageJob.parse`, for every stage job a worker takes: a payload as the fleet enqueues it (a
 * plain object holding a valid `rolloutId` and nothing else) is checked by hand, with the same
 * pattern, without zod's parse; anything else goes to `StageJob.parse`, which answers it (or
 * throws) exactly as before.
 */
export function parseStageJob(data: unknown): StageJob {
  if (typeof data === "object" && data !== null && Object.getPrototypeOf(data) === Object.prototype) {
    const keys = Object.keys(data);
    const rolloutId = (data as { rolloutId?: unknown }).rolloutId;
    if (
      keys.length === 1 &&
      keys[0] === "rolloutId" &&
      typeof rolloutId === "string" &&
      ROLLOUT_ID.test(rolloutId)
    ) {
      return { rolloutId };
    }
  }
  return StageJob.parse(data);
}

export const SeedReceipt = z.object({
  handle: SandboxHandle,
  probe: ProbeReport,
  createMs: z.number().nonnegative(),
  probeMs: z.number().nonnegative(),
  stageMs: z.number().nonnegative(),
  reused: z.boolean(),
  at: z.number().int(),
});
export type SeedReceipt = z.infer<typeof SeedReceipt>;

export const RunReceipt = z.object({
  /** Exit envelope: command code, -1 killed at its deadline, -2 sandbox/provider failure. */
  exec: ExecResult,
  /** The agent's final answer (for `match` verifiers). */
  answer: z.string().nullable(),
  /**
   * The answer was longer than `MAX_ANSWER_CHARS` and is kept cut (`keptAnswer`): a match
   * verifier grades it 0, since no verdict on a part is one on the whole. Absent in a receipt
   * stored by an earlier version.
   */
  answerTruncated: z.boolean().optional(),
  transcript: CappedText.nullable().default(null),
  usage: Usage.nullable(),
  cleanup: CleanupReceipt,
  /** The agent's own sandbox, when it owned one (released before verify). */
  ownedSandbox: z.object({ handle: SandboxHandle, released: CleanupReceipt }).nullable(),
  startedAt: z.number().int(),
  stoppedAt: z.number().int(),
  attempts: z.number().int().positive(),
  /**
   * The agent exited 0 while its model upstream was failing (its last call through the gateway an
   * infrastructure failure; why): its work is graded, and a reward below 1 is masked
   * (`provider_unavailable`), since a working upstream might have done better (DESIGN §2 rule 6).
   */
  upstreamFailing: z.string().nullable().optional(),
  at: z.number().int(),
});
export type RunReceipt = z.infer<typeof RunReceipt>;

export const VerifyReceipt = z.object({
  reward: z.number(),
  details: z.record(z.string(), z.unknown()),
  startedAt: z.number().int(),
  at: z.number().int(),
});
export type VerifyReceipt = z.infer<typeof VerifyReceipt>;

export const CloseReceipt = z.object({
  cleanup: CleanupReceipt.nullable(),
  teardown: z.enum(["confirmed", "pending"]),
  at: z.number().int(),
});
export type CloseReceipt = z.infer<typeof CloseReceipt>;

/**
 * Milliseconds: `queuedMs` from admission to the seed's start, each stage's from its start to
 * its stored receipt, `closeMs` to the finish, `totalMs` admission to finish. `null` for a stage
 * that stored no receipt (it never started, or was stopped first: a cancel during the run leaves
 * `runMs` null), never a guess (DESIGN §2 rule 12).
 */
export const Timings = z.object({
  queuedMs: z.number().nonnegative().nullable(),
  seedMs: z.number().nonnegative().nullable(),
  runMs: z.number().nonnegative().nullable(),
  verifyMs: z.number().nonnegative().nullable(),
  closeMs: z.number().nonnegative().nullable(),
  totalMs: z.number().nonnegative().nullable(),
  /**
   * The agent's last launch, from its start to its confirmed stop (`runMs` spans the run stage,
   * a rerun's wait for its re-delivery included). Null without a run receipt, and in a result
   * stored by an earlier version.
   */
  agentMs: z.number().nonnegative().nullable().default(null),
});
export type Timings = z.infer<typeof Timings>;

/** A result line (JSONL / `GET /v1/rollouts/:id`). */
export const RolloutResult = z.object({
  id: RolloutId,
  batchId: z.string().nullable(),
  taskId: z.string(),
  taskDigest: z.string(),
  agent: z.string(),
  status: RolloutStatus,
  reward: z.number().nullable(),
  mask: z.boolean(),
  failureKind: FailureKind.nullable(),
  stage: Stage,
  reason: CappedText.nullable(),
  teardown: z.enum(["confirmed", "pending"]).nullable(),
  exitCode: z.number().int().nullable(),
  usage: Usage.nullable(),
  /**
   * How many times the agent was launched: 0 when it never was, more than 1 when it was run
   * again (its worker died mid-run, or its sandbox provider failed under it). Null in a result
   * stored by an earlier version.
   */
  agentLaunches: z.number().int().nonnegative().nullable().default(null),
  timings: Timings,
  details: z.record(z.string(), z.unknown()).nullable(),
  failures: z.array(FailureRecord),
  metadata: z.record(z.string(), z.unknown()).nullable(),
  createdAt: z.number().int(),
  finishedAt: z.number().int().nullable(),
});
export type RolloutResult = z.infer<typeof RolloutResult>;

/**
 * `GET /v1/rollouts/:id/trajectory`: what the agent did, as its run stored it. The result says how
 * it was graded; this is what to read (or train on) beside it.
 */
export const RolloutTrajectory = z.object({
  id: z.string(),
  status: RolloutStatus,
  /** The agent's display name (as in results) and its harness. */
  agent: z.string(),
  harness: z.string(),
  /**
   * The agent's run, once the run stage stored it; null before, and when it never was (the
   * rollout failed, was cancelled or masked before its run ended: a masked run is run again or
   * ends the rollout, and keeps nothing of its own).
   */
  run: z
    .object({
      exitCode: z.number().int(),
      timedOut: z.boolean(),
      oomKilled: z.boolean(),
      durationMs: z.number(),
      /** The agent's output, its last bytes when it wrote more than the run keeps (`…Truncated`). */
      stdout: z.string(),
      stderr: z.string(),
      stdoutTruncated: z.boolean(),
      stderrTruncated: z.boolean(),
      /** Its final answer (for `match` verifiers), or null. */
      answer: z.string().nullable(),
      /**
       * The tool-loop harness's transcript: JSON lines (messages, tool calls and their results,
       * retries, the stop), its last lines when longer than the harness keeps; null for others.
       */
      transcript: z.string().nullable(),
      usage: Usage.nullable(),
      startedAt: z.number().int(),
      stoppedAt: z.number().int(),
      /** Launches of the agent this run took (more than 1: it was run again). */
      attempts: z.number().int(),
    })
    .nullable(),
});
export type RolloutTrajectory = z.infer<typeof RolloutTrajectory>;
