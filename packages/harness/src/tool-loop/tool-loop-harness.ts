import { lookup as dnsLookup } from "node:dns/promises";
import { isIP } from "node:net";
import {
  type AgentSpec,
  capText,
  FleetError,
  isFleetError,
  isLinkLocalAddress,
  isLinkLocalUrl,
  normalizeBaseUrl,
  wholeSlice,
  withUsage,
} from "@fleet/contracts";
import { capRefusal, readCallUsage, UsageMeter } from "@fleet/gateway";
import { AGENT_USER, SANDBOX_PATHS } from "@fleet/sandbox";
import { FLEET_DIR, INSTRUCTION_ENV, INSTRUCTION_FILE, MAX_OUTPUT_CHARS } from "../constants.ts";
import type { Harness, HarnessContext, HarnessDeps, HarnessOutcome } from "../harness.ts";
import { answerFields, capTail, providerStep } from "../run-command.ts";
import {
  BASH_TOOL,
  formatToolResult,
  MAX_COMMAND_BYTES,
  parseBashArguments,
  TOOL_EXEC_OUTPUT_BYTES,
  TOOL_LOOP_SYSTEM_PROMPT,
} from "./bash-tool.ts";
import {
  callChatCompletion,
  DEFAULT_RETRY_POLICY,
  MAX_REQUEST_BYTES,
  type RetryPolicy,
} from "./chat-client.ts";
import { type ChatMessage, readAssistantTurn, type ToolCall } from "./chat-types.ts";
import { redactor, Transcript } from "./transcript.ts";

type ToolLoopAgent = Extract<AgentSpec, { harness: "tool-loop" }>;

/** Most tool calls of one answer that run (and go back in the history); the rest are dropped, and the model told. */
export const MAX_TOOL_CALLS_PER_TURN = 64;
/** Most characters of one answer's text kept in the history sent back. */
export const MAX_HISTORY_CONTENT_CHARS = 256 * 1024;

/** Why an episode ended. All but `deadline` end with exit code 0; `deadline` is -1 (graded). */
export type ToolLoopStop = "answer" | "max_steps" | "token_cap" | "context_length" | "refused" | "deadline";

export interface ToolLoopHarnessOptions {
  /** Backoff between attempts of one model call. @defaultValue DEFAULT_RETRY_POLICY */
  retry?: Partial<RetryPolicy>;
  /** See `ChatCallInput.gatewayTimeoutMinMs`. */
  gatewayTimeoutMinMs?: number;
}

/**
 * The `tool-loop` harness: an OpenAI-compatible chat-completions loop run by the worker, whose
 * one tool, `bash`, executes in the rollout's sandbox as the agent user in /workspace.
 *
 * - A step is one model call plus the tool calls it made. The episode ends when the model
 *   answers without tool calls (its content is the answer), after `maxSteps` steps, when the
 *   rollout's token cap (`agent.maxTokens`) is reached, when the model refuses the conversation
 *   as too long for its context or (after answering an earlier call) refuses it outright with a
 *   400/413/422 (`refused`), or at the agent's deadline. All are graded; only the deadline
 *   gives exit code -1 (`timedOut`). The answer is otherwise the last assistant text, or `null`.
 * - Each tool command runs under min(`toolTimeoutS`, time left); its exit envelope and capped
 *   output tails go back to the model.
 * - Model calls are retried on 429/5xx/connection errors with jittered backoff (honouring
 *   `Retry-After`) inside the one deadline, as is an attempt with no answer within
 *   `ATTEMPT_TIMEOUT_MS`; an endpoint that failed and never answered usefully until the deadline
 *   throws final `provider_unavailable` (the rollout is masked, not scored 0). Other 4xx on a
 *   first call (bad credential, unknown model) throw final `agent_error`.
 * - The credential (resolved by name through `deps.resolveCredential`) is sent only as
 *   `Authorization: Bearer` to `model.baseUrl`; it is redacted from the transcript and errors.
 */
export class ToolLoopHarness implements Harness {
  readonly name = "tool-loop";
  private readonly retry: RetryPolicy;
  private readonly gatewayTimeoutMinMs: number | undefined;

  constructor(
    private readonly agent: ToolLoopAgent,
    private readonly deps: HarnessDeps = {},
    options: ToolLoopHarnessOptions = {},
  ) {
    this.retry = { ...DEFAULT_RETRY_POLICY, ...options.retry };
    this.gatewayTimeoutMinMs = options.gatewayTimeoutMinMs;
  }

  async run(ctx: HarnessContext): Promise<HarnessOutcome> {
    const { agent } = this;
    const started = Date.now();
    const apiKey = await this.resolveCredential();
    this.checkEndpoint(apiKey !== null);
    await refuseLinkLocalHost(this.agent.model.baseUrl);
    // Reports (errors, the stop reason, the transcript) lose any long part of the key too; the
    // graded answer only the key itself (whether a part was cut would tell the policy which).
    const redact = redactor(apiKey, { fragments: true });
    const redactAnswer = redactor(apiKey);
    const transcript = new Transcript(redact);
    const meter = new UsageMeter();
    const url = `${agent.model.baseUrl.replace(/\/+$/, "")}/chat/completions`;

    await providerStep(ctx, "write the instruction file", () =>
      ctx.provider.put(
        ctx.handle,
        FLEET_DIR,
        { "instruction.md": ctx.task.instruction },
        { user: AGENT_USER },
      ),
    );
    // The agent's time starts now, its episode prepared (`agentStarts`).
    const deadlineMs = ctx.agentStarts?.() ?? ctx.deadlineMs;
    if (Date.now() >= deadlineMs) {
      // Its time went on preparing the episode (a slow daemon, a slow lookup): no model call was
      // made, so there is nothing of the agent's to grade. Masked (retried while the rollout's
      // deadline allows), never a 0, as the command harness does.
      throw FleetError.retryable(
        "provider_unavailable",
        `the agent's time ran out before its first model call (preparing the episode took ${Date.now() - started} ms); nothing of the agent ran`,
      );
    }

    const messages: ChatMessage[] = [
      { role: "system", content: TOOL_LOOP_SYSTEM_PROMPT },
      { role: "user", content: ctx.task.instruction },
    ];
    transcript.add({ role: "user", content: ctx.task.instruction });

    let lastText: string | null = null;
    let finalText: string | null = null;
    /** Every tool-call id in the history: each call's stays its own (`readAssistantTurn`). */
    const toolCallIds = new Set<string>();
    let stop: ToolLoopStop = "max_steps";
    let stopDetail = `${agent.maxSteps} steps used`;

    try {
      steps: for (let step = 1; step <= agent.maxSteps; step++) {
        const refusal = capRefusal({ calls: 0, tokens: meter.totalTokens }, { maxTokens: agent.maxTokens });
        if (refusal?.code === "usage_unreported") {
          // The endpoint reports no usage, so the rollout's cap cannot hold: the endpoint's
          // shortcoming (as the gateway counts it), not the agent's; masked, never graded.
          throw FleetError.nonRetryable("provider_unavailable", refusal.message);
        }
        if (refusal) {
          stop = "token_cap";
          stopDetail = refusal.message;
          break;
        }
        const result = await callChatCompletion({
          url,
          apiKey,
          body: this.requestBody(messages, meter.totalTokens),
          deadlineMs,
          signal: ctx.signal,
          retry: this.retry,
          ...(this.gatewayTimeoutMinMs === undefined
            ? {}
            : { gatewayTimeoutMinMs: this.gatewayTimeoutMinMs }),
          redact,
          onProbe: () =>
            meter.note(
              `a one-token probe request after a 403 at model call ${step}, to tell a refused key from a refused request (not counted)`,
            ),
          onFailedAttempt: () => meter.recordFailure(),
          ...(this.deps.onModelRequest ? { onAttempt: this.deps.onModelRequest } : {}),
          onRetry: ({ attempt, status, reason, waitMs }) => {
            transcript.add({ event: "retry", step, attempt, status, reason, waitMs });
          },
          // Every call before this one was answered (the loop stops at any other outcome).
          answeredBefore: step > 1,
        });
        if (result.kind === "deadline") {
          stop = "deadline";
          stopDetail = `the agent's deadline came during model call ${step}`;
          // The endpoint may still finish and bill a call this episode gave up on mid-flight: its
          // tokens unknown, the totals too (a gap, never an undercount that looks whole).
          if (result.inFlight) {
            meter.recordAbandoned("agent");
            meter.note(`model call ${step} abandoned at the deadline (usage unknown)`);
          }
          break;
        }
        if (result.kind === "refused") {
          // An answer over the size bound was generated, and likely billed, unread.
          if (result.unread) meter.recordAbandoned("unread");
          else meter.recordFailure();
          stop = "refused";
          stopDetail = `the model endpoint refused the conversation at call ${step}: ${result.message}`;
          break;
        }
        if (result.kind === "context_length" || result.kind === "too_large") {
          // (`too_large`: the conversation is past what one call sends, so never sent.)
          const why =
            result.kind === "too_large"
              ? `the request is ${result.bytes} bytes, more than the ${MAX_REQUEST_BYTES} one model call sends`
              : result.message;
          if (step === 1) {
            // Before the agent did anything: the task's instruction (or the completion tokens
            // asked for) does not fit this model, the spec's mismatch, not a policy's failure.
            throw FleetError.nonRetryable(
              "agent_error",
              `the model cannot take the episode's first request: ${why}`,
            );
          }
          if (result.kind === "context_length") meter.recordFailure();
          stop = "context_length";
          stopDetail =
            result.kind === "too_large"
              ? `the conversation grew too long: ${why}`
              : `the model refused the conversation as too long: ${why}`;
          break;
        }
        const callUsage = readCallUsage(result.body);
        meter.record(callUsage);
        // One answer may hold millions of tool calls (a 32 MiB response): at most
        // MAX_TOOL_CALLS_PER_TURN are read, run and go back in the history; the model is told of
        // the rest.
        const turn = readAssistantTurn(result.body, step, MAX_TOOL_CALLS_PER_TURN, toolCallIds);
        if (turn === null) {
          // Unreachable in practice: callChatCompletion only returns bodies with a choice.
          throw FleetError.nonRetryable("agent_error", "model answer has no assistant message");
        }
        if (turn.content !== null && turn.content.trim() !== "") lastText = turn.content;
        const dropped = turn.totalToolCalls - turn.toolCalls.length;
        messages.push({
          role: "assistant",
          content: turn.content === null ? null : capText(turn.content, MAX_HISTORY_CONTENT_CHARS),
          // As the history the endpoint gets back: arguments that are not a JSON object (cut off at
          // max_tokens, say) become "{}" and a missing name "unknown", since some servers re-parse
          // them and would refuse every later call; the tool result tells the model what was wrong.
          ...(turn.toolCalls.length > 0 ? { tool_calls: turn.toolCalls.map(historyCall) } : {}),
        });
        transcript.add({
          step,
          role: "assistant",
          content: turn.content,
          ...(turn.toolCalls.length > 0
            ? {
                toolCalls: turn.toolCalls.map((c) => ({
                  id: c.id,
                  name: c.function.name,
                  arguments: c.function.arguments,
                })),
              }
            : {}),
          finishReason: turn.finishReason,
          usage: callUsage.usageMissing
            ? null
            : {
                prompt: callUsage.promptTokens,
                completion: callUsage.completionTokens,
                cached: callUsage.cachedTokens,
              },
        });
        if (turn.toolCalls.length === 0) {
          finalText = turn.content;
          stop = "answer";
          stopDetail = "the model answered without tool calls";
          break;
        }

        for (const call of turn.toolCalls) {
          const remaining = Math.floor(deadlineMs - Date.now());
          if (remaining <= 0) {
            stop = "deadline";
            stopDetail = `the agent's deadline came before tool call ${call.id}`;
            break steps;
          }
          const content = await this.runTool(
            ctx,
            call.function.name,
            call.function.arguments,
            remaining,
            apiKey,
          );
          if (dropped > 0 && call === turn.toolCalls[turn.toolCalls.length - 1]) {
            content.text += `\n(note: ${dropped} more tool call(s) in this answer were not run; at most ${MAX_TOOL_CALLS_PER_TURN} run per answer)`;
          }
          messages.push({ role: "tool", tool_call_id: call.id, content: content.text });
          transcript.add({
            step,
            role: "tool",
            toolCallId: call.id,
            ...content.facts,
            content: content.text,
          });
          // A call that timed out with less time left than the tool's own timeout was stopped by
          // the deadline, whatever the clock says just after: a timer may fire a millisecond
          // before Date.now() reaches the deadline, and the episode must not go on to a model
          // call it has no time for.
          const deadlineStopped =
            content.facts.timedOut === true && remaining < this.agent.toolTimeoutS * 1000;
          if (deadlineStopped || Date.now() >= deadlineMs) {
            stop = "deadline";
            stopDetail = `the agent's deadline came during tool call ${call.id}`;
            break steps;
          }
        }
      }
    } catch (err) {
      // A failure mid-episode (the endpoint gone, the sandbox lost) still reports what the
      // episode's calls spent: the run is masked or failed, its cost is a fact all the same.
      const spent = meter.summary();
      const usage = spent.calls > 0 || spent.gaps.length > 0 ? spent : null;
      // An error of no kind (a library's, a bug's) keeps it too: taken as the stage runner
      // takes any such error (a retryable `provider_unavailable`), with the spend on it. (An
      // abort stays as it is: the worker's stop or hand-back.)
      const kinded =
        usage === null || isFleetError(err) || ctx.signal.aborted
          ? err
          : FleetError.retryable("provider_unavailable", capText(err), err);
      throw withUsage(kinded, usage);
    }

    transcript.add({ event: "stop", reason: stop, detail: stopDetail });
    // The final message is the answer; an episode stopped early is graded on the last text.
    const answerText = stop === "answer" ? finalText : lastText;
    const kept = answerText === null ? null : answerFields(redactAnswer(answerText));
    const answer = kept?.answer ?? null;
    const stdout = answer ?? "";
    return {
      exec: {
        exitCode: stop === "deadline" ? -1 : 0,
        timedOut: stop === "deadline",
        stdout: capTail(stdout),
        stderr: stop === "answer" ? "" : capTail(redact(`tool-loop stopped (${stop}): ${stopDetail}`)),
        stdoutTruncated: stdout.length > MAX_OUTPUT_CHARS,
        stderrTruncated: false,
        durationMs: Date.now() - started,
        oomKilled: false,
      },
      answer,
      ...(kept?.answerTruncated ? { answerTruncated: true } : {}),
      transcript: transcript.toString(),
      usage: meter.summary(),
    };
  }

  /**
   * The worker POSTs to the agent's `model.baseUrl` from the host, and quotes part of a refusal
   * in the result: without a credential (whose binding limits where it goes) only to the
   * operator's endpoints when listed, and never to a link-local host (a cloud's metadata service).
   */
  private checkEndpoint(credentialed: boolean): void {
    const { baseUrl } = this.agent.model;
    if (isLinkLocalUrl(baseUrl)) {
      throw FleetError.nonRetryable("agent_error", "model.baseUrl is a link-local address; refused");
    }
    const allowed = this.deps.modelEndpoints;
    if (credentialed || !allowed) return;
    const wanted = normalizeBaseUrl(baseUrl);
    if (wanted === null || !allowed.map(normalizeBaseUrl).includes(wanted)) {
      throw FleetError.nonRetryable(
        "agent_error",
        `model.baseUrl ${wanted ?? "(invalid)"} is not one of this worker's model endpoints (FLEET_MODEL_BASE_URLS)`,
      );
    }
  }

  /** The credential's value, resolved by name in the worker; `null` when the agent names none. */
  private async resolveCredential(): Promise<string | null> {
    const name = this.agent.credential;
    if (name === undefined) return null;
    const resolve = this.deps.resolveCredential;
    if (resolve === undefined) {
      throw FleetError.nonRetryable(
        "agent_error",
        `tool-loop agent names credential "${name}" but this worker cannot resolve credentials`,
      );
    }
    try {
      return await resolve(name, this.agent.model.baseUrl);
    } catch (err) {
      if (isFleetError(err)) throw err;
      throw FleetError.nonRetryable(
        "agent_error",
        `credential "${name}" could not be resolved: ${err instanceof Error ? err.message : String(err)}`,
      );
    }
  }

  private requestBody(messages: ChatMessage[], tokensUsed: number | null): Record<string, unknown> {
    const { model, maxTokens: cap } = this.agent;
    // The model's per-call limit, never more than the rollout's cap has left. Without one no
    // limit is sent: what the cap has left can be far more than the model's context takes, which
    // it would refuse (the cap then holds between calls, the last call may pass it).
    const left = cap !== undefined && tokensUsed !== null ? cap - tokensUsed : undefined;
    const maxTokens =
      model.maxTokens === undefined || left === undefined ? model.maxTokens : Math.min(model.maxTokens, left);
    return {
      model: model.name,
      messages,
      tools: [BASH_TOOL],
      tool_choice: "auto",
      stream: false,
      ...(model.temperature === undefined ? {} : { temperature: model.temperature }),
      ...(model.topP === undefined ? {} : { top_p: model.topP }),
      ...(maxTokens === undefined ? {} : { max_tokens: maxTokens }),
    };
  }

  /** Run one tool call; the text goes back to the model, the facts into the transcript. */
  private async runTool(
    ctx: HarnessContext,
    name: string,
    args: string,
    remainingMs: number,
    apiKey: string | null,
  ): Promise<{ text: string; facts: Record<string, unknown> }> {
    if (name !== BASH_TOOL.function.name) {
      return {
        text: `error: unknown tool "${capText(name, MAX_HISTORY_NAME_CHARS)}"; the only tool is bash`,
        facts: { error: "unknown_tool" },
      };
    }
    const parsed = parseBashArguments(args);
    if ("error" in parsed) return { text: parsed.error, facts: { error: "bad_arguments" } };
    // An upstream (or a proxy before it) that echoes the request's Authorization header into an
    // answer would have the sandbox run, and keep, the operator's credential: never run. (The key
    // whole only: refusing on parts of it would tell the policy which characters are the key's.)
    if (apiKey && parsed.command.includes(apiKey)) {
      return {
        text: "error: the command was not run: it contains the model endpoint's credential",
        facts: { error: "credential_in_command" },
      };
    }
    const limitMs = Math.min(this.agent.toolTimeoutS * 1000, remainingMs);
    const result = await providerStep(ctx, "run a bash tool call", () =>
      ctx.provider.exec(ctx.handle, ["bash", "-c", parsed.command], {
        deadlineMs: Math.max(1, Math.floor(limitMs)),
        cwd: SANDBOX_PATHS.workspace,
        user: AGENT_USER,
        env: { ...ctx.env, [INSTRUCTION_ENV]: INSTRUCTION_FILE },
        maxOutputBytes: TOOL_EXEC_OUTPUT_BYTES,
      }),
    );
    return {
      text: formatToolResult(result, Math.round(limitMs / 100) / 10),
      facts: {
        exitCode: result.exitCode,
        timedOut: result.timedOut,
        durationMs: Math.round(result.durationMs),
      },
    };
  }
}

/**
 * Refuse a base URL whose host name resolves to a link-local or metadata address (a name made to
 * point at a cloud's metadata service). A name that does not resolve is left to the call, which
 * fails on its own. A name that resolves elsewhere now and to such an address later (DNS
 * rebinding) is refused at its connection: every model call goes through `modelFetch`.
 */
export async function refuseLinkLocalHost(
  baseUrl: string,
  lookup: (host: string) => Promise<Array<{ address: string }>> = (host) => dnsLookup(host, { all: true }),
): Promise<void> {
  let host: string;
  try {
    host = new URL(baseUrl).hostname.replace(/^\[|\]$/g, "");
  } catch {
    return;
  }
  if (isIP(host) !== 0) return; // an address: isLinkLocalUrl has judged it
  const addresses = await lookup(host).catch(() => []);
  const bad = addresses.find((a) => isLinkLocalAddress(a.address));
  if (bad) {
    throw FleetError.nonRetryable(
      "agent_error",
      `model.baseUrl's host ${host} resolves to a link-local address (${bad.address}); refused`,
    );
  }
}

/** Longest tool-call name and id kept in the history (and quoted back). */
const MAX_HISTORY_NAME_CHARS = 256;

/**
 * A tool call as it is sent back in the history (see where it is used): arguments that are not a
 * JSON object, or longer than any command the bash tool takes, become "{}"; the name is capped
 * (an id over 256 characters was replaced when the answer was read).
 */
function historyCall(call: ToolCall): ToolCall {
  let args = call.function.arguments;
  if (Buffer.byteLength(args) > MAX_COMMAND_BYTES + 1024) args = "{}";
  else {
    try {
      const parsed: unknown = JSON.parse(args);
      if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) args = "{}";
    } catch {
      args = "{}";
    }
  }
  return {
    ...call,
    // Cut between characters (`wholeSlice`): half an emoji is text an endpoint may refuse.
    function: {
      name: wholeSlice(call.function.name, 0, MAX_HISTORY_NAME_CHARS) || "unknown",
      arguments: args,
    },
  };
}
