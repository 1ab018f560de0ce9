/** The subset of the OpenAI chat-completions wire format the tool loop speaks. */

export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

export type ChatMessage =
  | { role: "system"; content: string }
  | { role: "user"; content: string }
  | { role: "assistant"; content: string | null; tool_calls?: ToolCall[] }
  | { role: "tool"; tool_call_id: string; content: string };

/** The assistant message of a response, read defensively (servers differ in what they send). */
export interface AssistantTurn {
  content: string | null;
  /** The first `maxCalls` of the answer's tool calls. */
  toolCalls: ToolCall[];
  /** How many tool calls the answer held, those past `maxCalls` included. */
  totalToolCalls: number;
  finishReason: string | null;
}

/** Text of a message `content` that may be a string or an array of text parts. */
function textOf(content: unknown): string | null {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    const parts = content
      .map((p) => (typeof p === "object" && p !== null ? (p as { text?: unknown }).text : undefined))
      .filter((t): t is string => typeof t === "string");
    return parts.length > 0 ? parts.join("") : null;
  }
  return null;
}

/**
 * Tool-call arguments the endpoint sent as a JSON value rather than a string, as text. A value
 * nested too deep to write back (a model's, or a hostile endpoint's, thousands of nested arrays)
 * becomes text that is no JSON object: the tool tells the model its arguments were unreadable.
 */
function argumentsText(args: unknown): string {
  try {
    return JSON.stringify(args ?? {});
  } catch {
    return "(arguments nested too deep to read)";
  }
}

/**
 * The first choice's assistant turn, or `null` when the body has none (a malformed answer). Only
 * the first `maxCalls` tool calls are read: one answer may list millions (a 32 MiB body of `{}`s),
 * and an object built for each would take gigabytes.
 *
 * `usedIds`: the tool-call ids of the episode's earlier answers; the ids read are added to it.
 * A call whose id is already used (servers that number calls per answer, `call_0`, repeat them)
 * gets one of its own, as a missing one does: results go back by id, and with two calls of one
 * id nothing in the history says which result answers which (some endpoints refuse it outright).
 */
export function readAssistantTurn(
  body: unknown,
  step: number,
  maxCalls = Number.POSITIVE_INFINITY,
  usedIds: Set<string> = new Set(),
): AssistantTurn | null {
  const choices =
    typeof body === "object" && body !== null ? (body as { choices?: unknown }).choices : undefined;
  const first = Array.isArray(choices) ? (choices[0] as unknown) : undefined;
  const message =
    typeof first === "object" && first !== null ? (first as { message?: unknown }).message : undefined;
  if (typeof message !== "object" || message === null) return null;
  const m = message as { content?: unknown; tool_calls?: unknown };
  const allCalls: unknown[] = Array.isArray(m.tool_calls) ? m.tool_calls : [];
  const toolCalls: ToolCall[] = allCalls.slice(0, maxCalls).map((c: unknown, i: number) => {
    const call = (typeof c === "object" && c !== null ? c : {}) as {
      id?: unknown;
      function?: { name?: unknown; arguments?: unknown };
    };
    const args = call.function?.arguments;
    // An id is echoed in the history and every tool result: a missing, absurd or used one is
    // replaced (by one no call of the episode has, should an id given look like ours).
    let id =
      typeof call.id === "string" && call.id !== "" && call.id.length <= 256 && !usedIds.has(call.id)
        ? call.id
        : `call_${step}_${i + 1}`;
    for (let n = 2; usedIds.has(id); n++) id = `call_${step}_${i + 1}_${n}`;
    usedIds.add(id);
    return {
      id,
      type: "function",
      function: {
        name: typeof call.function?.name === "string" ? call.function.name : "",
        arguments: typeof args === "string" ? args : argumentsText(args),
      },
    };
  });
  const finish = (first as { finish_reason?: unknown }).finish_reason;
  return {
    content: textOf(m.content),
    toolCalls,
    totalToolCalls: allCalls.length,
    finishReason: typeof finish === "string" ? finish : null,
  };
}
