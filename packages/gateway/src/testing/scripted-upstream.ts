import { createServer, type IncomingHttpHeaders } from "node:http";
import type { AddressInfo } from "node:net";

/**
 * Test support (not for production): a scripted OpenAI-compatible upstream on 127.0.0.1 that
 * answers each `POST …/chat/completions` with the next scripted reply and records every request.
 */

/**
 * One scripted answer: `body` sent as JSON, or `rawBody` as it is. `destroy` drops the
 * connection without an HTTP answer.
 */
export type ScriptedReply =
  | { status?: number; body?: unknown; rawBody?: string; headers?: Record<string, string>; delayMs?: number }
  | { destroy: true };

export interface RecordedRequest {
  method: string;
  path: string;
  headers: IncomingHttpHeaders;
  body: unknown;
}

export interface ScriptedUpstream {
  /** `http://127.0.0.1:<port>` */
  readonly url: string;
  /** `<url>/v1`, what a client or the gateway uses as its base URL. */
  readonly baseUrl: string;
  readonly requests: RecordedRequest[];
  /** Append replies to the script. */
  push(...replies: ScriptedReply[]): void;
  close(): Promise<void>;
}

export interface ChatReplyInput {
  content?: string | null;
  /** `bash` commands the model calls (one tool call each). */
  bash?: string[];
  /** `usage` of the response; `null` leaves it out entirely. */
  usage?: { prompt: number; completion: number; cached?: number } | null;
}

let callCounter = 0;

/** A chat.completion body: assistant content and/or `bash` tool calls, with usage. */
export function chatReply(input: ChatReplyInput): { status: number; body: unknown } {
  const toolCalls = (input.bash ?? []).map((command) => ({
    id: `call_${++callCounter}`,
    type: "function",
    function: { name: "bash", arguments: JSON.stringify({ command }) },
  }));
  const usage =
    input.usage === null
      ? undefined
      : (() => {
          const u = input.usage ?? { prompt: 10, completion: 5 };
          return {
            prompt_tokens: u.prompt,
            completion_tokens: u.completion,
            total_tokens: u.prompt + u.completion,
            ...(u.cached === undefined ? {} : { prompt_tokens_details: { cached_tokens: u.cached } }),
          };
        })();
  return {
    status: 200,
    body: {
      id: `chatcmpl-${callCounter}`,
      object: "chat.completion",
      created: 0,
      model: "scripted",
      choices: [
        {
          index: 0,
          finish_reason: toolCalls.length > 0 ? "tool_calls" : "stop",
          message: {
            role: "assistant",
            content: input.content ?? null,
            ...(toolCalls.length > 0 ? { tool_calls: toolCalls } : {}),
          },
        },
      ],
      ...(usage === undefined ? {} : { usage }),
    },
  };
}

/** An OpenAI-style error reply. */
export function errorReply(status: number, code: string, message: string, headers?: Record<string, string>) {
  return { status, body: { error: { message, type: "invalid_request_error", code } }, headers };
}

export async function startScriptedUpstream(initial: ScriptedReply[] = []): Promise<ScriptedUpstream> {
  const script = [...initial];
  const requests: RecordedRequest[] = [];
  const timers = new Set<NodeJS.Timeout>();
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      const text = Buffer.concat(chunks).toString("utf8");
      let body: unknown = text;
      try {
        body = text === "" ? null : JSON.parse(text);
      } catch {
        // keep the raw text
      }
      requests.push({ method: req.method ?? "", path: req.url ?? "", headers: req.headers, body });
      const reply = script.shift() ?? { status: 500, body: { error: { message: "script exhausted" } } };
      if ("destroy" in reply) {
        req.socket.destroy();
        return;
      }
      const send = (): void => {
        res.writeHead(reply.status ?? 200, { "content-type": "application/json", ...reply.headers });
        res.end(reply.rawBody ?? (reply.body === undefined ? "" : JSON.stringify(reply.body)));
      };
      if (!reply.delayMs) return send();
      const timer = setTimeout(() => {
        timers.delete(timer);
        if (!res.destroyed) send();
      }, reply.delayMs);
      timers.add(timer);
    });
  });
  await new Promise<void>((resolve) => server.listen({ host: "127.0.0.1", port: 0 }, resolve));
  const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
  return {
    url,
    baseUrl: `${url}/v1`,
    requests,
    push: (...replies) => script.push(...replies),
    close: () =>
      new Promise<void>((resolve) => {
        for (const t of timers) clearTimeout(t);
        timers.clear();
        server.close(() => resolve());
        server.closeAllConnections();
      }),
  };
}
