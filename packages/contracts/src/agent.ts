import { z } from "zod";
import { Seconds } from "./bounded.ts";

/** Name of a credential the agent worker resolves; never the value (DESIGN §2 rule 8). */
export const CredentialName = z
  .string()
  .regex(/^[A-Za-z0-9_.-]{1,64}$/, "must be a credential name (letters, digits, '_', '.', '-')");

/**
 * An environment variable name that conventionally holds a secret (`OPENAI_API_KEY`, `HF_TOKEN`,
 * `AWS_SECRET_ACCESS_KEY`, `DB_PASSWORD`, ...): refused in `agent.env` (DESIGN §2 rule 8). A
 * heuristic on names, not values, kept narrow: a key that is not a credential (`SORT_KEY`,
 * `CACHE_KEY`) and a tokenizer's special tokens (`PAD_TOKEN`, `EOS_TOKEN`) pass.
 */
export function looksLikeCredential(name: string): boolean {
  // A numbered or staged copy (`OPENAI_API_KEY_2`, `HF_TOKEN2`) is the same kind of name.
  const n = name.toUpperCase().replace(/_?\d+$/, "");
  if (/(?:^|_)(?:PAD|EOS|BOS|UNK|SEP|CLS|MASK|START|END|MAX|MIN|NUM|SPECIAL)_TOKENS?$/.test(n)) return false;
  return (
    /(?:^|_)(?:API_?KEY|APIKEY|SECRET_?KEY|SECRET_ACCESS_KEY|ACCESS_KEY|PRIVATE_KEY|SECRET|PASSWD|CREDENTIALS?|TOKEN)$/.test(
      n,
    ) ||
    /PASSWORD$/.test(n) ||
    // A model provider's key by its vendor's name (`OPENAI_KEY`), unlike a `SORT_KEY`.
    /(?:^|_)(?:OPENAI|ANTHROPIC|CLAUDE|GEMINI|GOOGLE|AZURE|AZURE_OPENAI|HF|HUGGINGFACE|COHERE|MISTRAL|GROQ|TOGETHER|DEEPSEEK|XAI|OPENROUTER|FIREWORKS|REPLICATE|PERPLEXITY|GITHUB|GH|WANDB)_KEY$/.test(
      n,
    )
  );
}

/**
 * An OpenAI-compatible base URL (`…/v1`): http(s), with no credentials, query or fragment in it
 * (a `?` would swallow the `/chat/completions` the fleet appends and let a request pick any path).
 */
/** A base URL compared as the fleet sends it: parsed, without trailing slashes (null if invalid). */
export function normalizeBaseUrl(url: string): string | null {
  try {
    return new URL(url.trim()).href.replace(/\/+$/, "");
  } catch {
    return null;
  }
}

/**
 * Whether an address (IPv4, or IPv6 without brackets) is link-local or a cloud's metadata
 * service, never a model endpoint: 169.254.0.0/16, fe80::/10, either of the first as an
 * IPv4-mapped IPv6 address, AWS's IPv6 metadata address (fd00:ec2::254), Alibaba Cloud's
 * (100.100.100.200), Oracle Cloud's (192.0.0.192).
 */
export function isLinkLocalAddress(address: string): boolean {
  const a = address.toLowerCase();
  return (
    /^169\.254\.\d+\.\d+$/.test(a) ||
    /^fe[89ab][0-9a-f]:/.test(a) ||
    /^::ffff:(169\.254\.\d+\.\d+|a9fe:[0-9a-f]{1,4})$/.test(a) ||
    a === "fd00:ec2::254" ||
    a === "100.100.100.200" ||
    a === "192.0.0.192"
  );
}

/** Names of cloud metadata services (they resolve to a link-local address only inside the cloud). */
const METADATA_HOSTS = new Set(["metadata.google.internal", "metadata.goog"]);

/**
 * Whether a URL's host is a link-local or metadata address, or a metadata service's name (see
 * `isLinkLocalAddress`). A name that resolves to one is not seen here: resolve it too.
 */
export function isLinkLocalUrl(url: string): boolean {
  let host: string;
  try {
    host = new URL(url).hostname.replace(/^\[|\]$/g, "").toLowerCase();
  } catch {
    return false;
  }
  return isLinkLocalAddress(host) || METADATA_HOSTS.has(host.replace(/\.$/, ""));
}

export const ModelBaseUrl = z.url().superRefine((text, ctx) => {
  let url: URL;
  try {
    url = new URL(text);
  } catch {
    return; // z.url() reported it
  }
  const problem =
    url.protocol !== "http:" && url.protocol !== "https:"
      ? "must be http or https"
      : url.username !== "" || url.password !== ""
        ? "must not carry credentials (name one with `credential`)"
        : url.search !== "" || text.includes("?")
          ? "must not have a query"
          : url.hash !== "" || text.includes("#")
            ? "must not have a fragment"
            : // Told up front (422), not when a worker refuses to call it: the workers' model
              // calls never look up an address written in the URL (modelFetch), relying on this.
              isLinkLocalUrl(text)
              ? "must not be a link-local or metadata address (a cloud's metadata service)"
              : null;
  if (problem) ctx.addIssue({ code: "custom", message: problem });
});

/** Whether the agent borrows the task sandbox (default) or gets one of its own. */
export const SandboxMode = z.enum(["borrow", "own"]);

/** The model a call names (sent to the upstream as it is): not blank. */
const ModelName = z
  .string()
  .min(1)
  .refine((name) => name.trim() !== "", "must not be blank");

/** A command-line argument or environment value: no process can be given a NUL byte. */
const NoNulString = z.string().refine((v) => !v.includes("\0"), "must not contain a NUL byte");

/**
 * Bytes of one argument or environment entry (`NAME=value`) an exec takes, its terminating NUL
 * included: Linux's MAX_ARG_STRLEN. A longer one is refused by the kernel (E2BIG) before the
 * command starts, on every attempt.
 */
export const MAX_EXEC_STRING_BYTES = 128 * 1024;
/**
 * Bytes a command agent's argv and env may take together (each string with its NUL): half the
 * 2 MiB a Linux exec takes with the default 8 MiB stack (ARG_MAX), the rest left for the
 * fleet's own wrapper (`timeout`, the sandbox's entry) and environment (a model gateway's).
 */
export const MAX_COMMAND_ARGS_BYTES = 1024 * 1024;

/**
 * Why an exec cannot take `text` as one argument or environment entry (`MAX_EXEC_STRING_BYTES`),
 * or `undefined` when it can: at admission (a command agent) and at each exec (one admitted
 * before the bound, or any other caller's).
 */
export function execStringProblem(text: string): string | undefined {
  // At most 3 bytes a UTF-16 unit: a short string needs no count (every exec's every argument).
  if (text.length * 3 < MAX_EXEC_STRING_BYTES) return undefined;
  const bytes = Buffer.byteLength(text) + 1;
  return bytes > MAX_EXEC_STRING_BYTES
    ? `is ${bytes} bytes with its NUL, over the ${MAX_EXEC_STRING_BYTES} bytes Linux takes in one argument or environment entry (E2BIG): put long content in a file (the task's workspace, or the image)`
    : undefined;
}

const common = {
  /** Display name in results; defaults to the harness name. */
  name: z.string().min(1).max(100).optional(),
  sandbox: SandboxMode.default("borrow"),
  /** Overrides the task's agent timeout; still bounded by the rollout deadline. */
  timeoutS: Seconds.optional(),
};

export const OracleAgent = z.strictObject({ harness: z.literal("oracle"), ...common });

export const CommandAgent = z
  .strictObject({
    harness: z.literal("command"),
    ...common,
    argv: z
      .array(
        NoNulString.superRefine((arg, ctx) => {
          const problem = execStringProblem(arg);
          if (problem) ctx.addIssue({ code: "custom", message: problem });
        }),
      )
      .min(1, "argv must name a command")
      .max(4096, "argv has at most 4096 items"),
    env: z
      .record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/), NoNulString)
      .superRefine((env, ctx) => {
        for (const [name, value] of Object.entries(env)) {
          const problem = execStringProblem(`${name}=${value}`);
          if (problem) ctx.addIssue({ code: "custom", path: [name], message: problem });
          if (looksLikeCredential(name)) {
            ctx.addIssue({
              code: "custom",
              path: [name],
              message:
                "looks like a credential: a rollout is stored in Redis, so it carries credential names, never values (use model.credential)",
            });
          }
        }
      })
      .default({}),
    /**
     * Give the command a model through the per-rollout gateway. `baseUrl` is required: the worker's
     * credential is bound to an upstream, and the API can tell a missing one up front (422).
     */
    model: z
      .strictObject({
        name: ModelName,
        baseUrl: ModelBaseUrl,
        credential: CredentialName,
        /** Calls the gateway forwards for this rollout; past it a call gets 429 `call_cap_exceeded`. */
        maxCalls: z.number().int().positive().optional(),
        /** Tokens (prompt + completion) after which no call starts (429 `token_cap_exceeded`). */
        maxTokens: z.number().int().positive().optional(),
      })
      .optional(),
  })
  .superRefine((agent, ctx) => {
    // All of them in one exec: past ARG_MAX the kernel refuses it (E2BIG), each string fitting.
    let bytes = 0;
    for (const arg of agent.argv) bytes += Buffer.byteLength(arg) + 1;
    for (const [name, value] of Object.entries(agent.env)) bytes += Buffer.byteLength(`${name}=${value}`) + 1;
    if (bytes > MAX_COMMAND_ARGS_BYTES) {
      ctx.addIssue({
        code: "custom",
        path: ["argv"],
        message: `argv and env take ${bytes} bytes together, over the ${MAX_COMMAND_ARGS_BYTES} bytes a command agent's exec may take (E2BIG past Linux's ARG_MAX): put long content in a file (the task's workspace, or the image)`,
      });
    }
  });

export const ModelSpec = z.strictObject({
  baseUrl: ModelBaseUrl,
  name: ModelName,
  temperature: z.number().min(0).max(2).optional(),
  topP: z.number().gt(0).max(1).optional(),
  maxTokens: z.number().int().positive().optional(),
});

export const ToolLoopAgent = z.strictObject({
  harness: z.literal("tool-loop"),
  ...common,
  model: ModelSpec,
  credential: CredentialName.optional(),
  maxSteps: z.number().int().positive().max(1000).default(30),
  maxTokens: z.number().int().positive().optional(),
  toolTimeoutS: Seconds.default(60),
});

export const AgentSpec = z.discriminatedUnion("harness", [OracleAgent, CommandAgent, ToolLoopAgent]);
export type AgentSpec = z.infer<typeof AgentSpec>;
export type AgentSpecInput = z.input<typeof AgentSpec>;

export function agentName(agent: AgentSpec): string {
  return agent.name ?? agent.harness;
}
