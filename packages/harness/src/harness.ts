import type { AgentSpec, ExecResult, SandboxHandle, TaskContent, Usage } from "@fleet/contracts";
import type { SandboxProvider } from "@fleet/sandbox";

/** Everything a harness needs for one run. */
export interface HarnessContext {
  /**
   * The sandbox provider. The agent acts in the sandbox only through `exec`; `put` is for the
   * harness's own setup outside /workspace (the instruction file, the oracle's solution), which a
   * new launch writes again. The run stage counts the execs that may have started (see
   * `FleetError.nothingStarted`): a run that failed before any did ran nothing of the agent.
   */
  provider: SandboxProvider;
  /** The sandbox the agent works in (borrowed from the resources stage, or its own). */
  handle: SandboxHandle;
  task: TaskContent;
  agent: AgentSpec;
  /**
   * Absolute epoch ms by which the agent's command must have stopped, counted from the run's
   * start: the bound of the harness's own setup (`agentStarts` moves it for the agent itself).
   */
  deadlineMs: number;
  /**
   * Called by the harness once its own setup is done (the instruction file, the oracle's
   * solution), just before the agent's command or first model call: the agent's deadline counted
   * from then (its own budget from now, never past the rollout's). Setup on a slow daemon is not
   * the agent's time: counted against its budget, it turned a correct agent into a graded
   * `agent_timeout`. Absent: `deadlineMs` stands.
   */
  agentStarts?: () => number;
  /** Abort: the harness stops waiting and throws; the caller kills the sandbox processes. */
  signal: AbortSignal;
  /** Extra environment for the agent's command (e.g. a model gateway URL); never secrets in logs. */
  env?: Record<string, string>;
}

/** What one run produced. What the harness could not observe is `null`, never a zero. */
export interface HarnessOutcome {
  /**
   * The exit envelope: the command's own code, or `-1` with `timedOut` when stopped at its
   * deadline. `stdout`/`stderr` are bounded tails (see `MAX_OUTPUT_CHARS`).
   */
  exec: ExecResult;
  /** The agent's final answer (stdout, as `keptAnswer` keeps it), for `match` verifiers. */
  answer: string | null;
  /** The answer was cut (longer than `MAX_ANSWER_CHARS`): a match verifier grades it 0. */
  answerTruncated?: boolean;
  /** A transcript of model calls, where the harness keeps one. */
  transcript: string | null;
  /** Model usage, where the harness observed any; `null` when nothing was observed. */
  usage: Usage | null;
}

/**
 * Runs an agent inside a sandbox. Errors: a provider `FleetError` (`sandbox_lost`,
 * `provider_unavailable`) propagates unchanged (the run stage maps it to exit code -2); a task
 * the harness cannot run is `invalid_task`; an abort throws the signal's reason (a `FleetError`)
 * or `FleetError("cancelled")`.
 */
export interface Harness {
  readonly name: AgentSpec["harness"];
  run(ctx: HarnessContext): Promise<HarnessOutcome>;
}

/** What harnesses may need from their host worker. */
export interface HarnessDeps {
  /**
   * Resolve a credential *name* to its value inside the worker (DESIGN §2 rule 8). Used by the
   * model-calling harnesses (tool-loop, command with a model); oracle and command ignore it.
   */
  /**
   * The value of credential `name`, for a call to `baseUrl` only: the worker hands a credential
   * out just for the upstreams its operator bound it to, and refuses (final) any other.
   */
  resolveCredential?: (name: string, baseUrl: string) => Promise<string>;
  /**
   * The model endpoints (base URLs) a tool-loop agent naming no credential may call from this
   * worker (`FLEET_MODEL_BASE_URLS`); null or absent: any. With a credential, its binding decides.
   * A link-local host (a cloud's metadata service) is refused either way.
   */
  modelEndpoints?: readonly string[] | null;
  /**
   * Called as the harness itself sends a request to the agent's model (the tool loop's calls,
   * from the worker; a command's go through the gateway from inside the sandbox), before its
   * answer: from then on the run may have spent, whatever comes of the request.
   */
  onModelRequest?: () => void;
}
