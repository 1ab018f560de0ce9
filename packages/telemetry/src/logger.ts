import { hostname } from "node:os";
import pino, { type DestinationStream, type Level, type Logger } from "pino";
import {
  REDACT_PATHS,
  REDACTED,
  redactSecretFields,
  redactUrlCredentials,
  secretRedactor,
} from "./redact.ts";

export type { Logger } from "pino";
export type LogLevel = Level | "silent";

export interface LoggerOptions {
  /** Logged as `name` on every line (the app or component). */
  name: string;
  /** @defaultValue `"info"` */
  level?: LogLevel;
  /** Where lines go. @defaultValue stdout (pino's default destination) */
  destination?: DestinationStream;
  /**
   * Known secret values (e.g. resolved credentials) scrubbed from every serialized line,
   * wherever they appear, including inside messages. Pass a `Set` to add secrets later (only
   * add: the redactor is prepared again when the set's size changes, so a swap is missed).
   */
  secrets?: ReadonlySet<string> | readonly string[];
  /** Fields bound to every line (e.g. `{ worker: "agent-1" }`). */
  base?: Record<string, unknown>;
}

/**
 * A pino logger that never writes a secret-shaped field: fields named like `apiKey`,
 * `api_key`, `token`, `password`, `secret`, `authorization`, `credentialValue` (any depth, see
 * `SECRET_KEYS`) are replaced with `[Redacted]`; the credentials of every URL on the serialized
 * line (its userinfo, secret-named query parameters), messages and serializers' output included,
 * are redacted; and known secret values are scrubbed from it.
 */
export function createLogger(options: LoggerOptions): Logger {
  const secrets = options.secrets;
  // Fields a serializer writes, this logger's and its children's (Fastify adds `req` and `res`):
  // their class instances go to the serializer as they are (see `redactSecretFields`).
  const serialized = new Set<string>(["err"]);
  // The whole line, after every serializer: the credentials of a URL in a message, an error's
  // message or stack, or what a serializer wrote (Fastify's `req.url`, with its `?token=`), which
  // the field walk never sees; and known secrets, parts of one too (no agent reads the logs): an
  // upstream quoting a key back.
  const known = secrets === undefined ? null : liveRedactor(secrets);
  const streamWrite = (line: string) => {
    const out = redactUrlCredentials(line);
    return known === null ? out : known(out);
  };
  const logger = pino(
    {
      name: options.name,
      level: options.level ?? "info",
      base: { pid: process.pid, hostname: hostname(), ...options.base },
      redact: { paths: [...REDACT_PATHS], censor: REDACTED },
      serializers: { err: serializeError },
      formatters: {
        log: (object) => redactSecretFields(object, { serialized }),
        bindings: (bindings) => redactSecretFields(bindings),
      },
      hooks: { streamWrite },
    },
    // Synchronous stdout by default, so the last lines before a crash or exit are not lost.
    options.destination ?? pino.destination({ dest: 1, sync: true }),
  );
  // Children are made from their parent's prototype chain, so every child's child comes here too.
  const child = logger.child;
  logger.child = function (this: Logger, bindings, childOptions) {
    for (const key of Object.keys(childOptions?.serializers ?? {})) serialized.add(key);
    return child.call(this, bindings, childOptions);
  } as typeof child;
  return logger;
}

/** Longest error message or stack logged; the rest is cut (an error can quote a whole payload). */
export const MAX_ERROR_TEXT = 4000;

/**
 * pino's error serializer, minus payloads: ioredis puts the failed command on its errors
 * (`err.command = { name, args }`), and its args can be a whole task (10 MiB). Only the command's
 * name is kept; the message and stack are capped.
 */
function serializeError(err: unknown): unknown {
  const out = pino.stdSerializers.err(err as Error) as unknown as Record<string, unknown>;
  if (out === null || typeof out !== "object") return out;
  const command = out.command as { name?: unknown } | undefined;
  if (command && typeof command === "object") out.command = { name: command.name };
  for (const k of ["message", "stack"] as const) {
    const v = out[k];
    if (typeof v === "string" && v.length > MAX_ERROR_TEXT)
      out[k] = `${v.slice(0, MAX_ERROR_TEXT)}…[truncated]`;
  }
  return out;
}

/**
 * A fragment redactor over `secrets`, prepared again only when the set changed size (secrets are
 * added as they are resolved, never taken out), not for every line.
 */
function liveRedactor(secrets: ReadonlySet<string> | readonly string[]): (line: string) => string {
  let prepared: { size: number; redact: (line: string) => string } | null = null;
  return (line) => {
    const size = "size" in secrets ? secrets.size : secrets.length;
    if (prepared?.size !== size) {
      prepared = { size, redact: secretRedactor(secrets, REDACTED, { fragments: true }) };
    }
    return prepared.redact(line);
  };
}

/**
 * For an app's `main` that failed to start (bad configuration, Redis refused, a port in use): its
 * message on stderr, one error rather than a stack trace (the stack with `FLEET_LOG_LEVEL` debug
 * or trace in `env`), and exit 1.
 */
export function onStartFailure(env: Record<string, string | undefined>): (err: unknown) => never {
  const debug = /^(debug|trace)$/i.test(env.FLEET_LOG_LEVEL?.trim() ?? "");
  return (err) => {
    const text = err instanceof Error ? (debug && err.stack ? err.stack : err.message) : String(err);
    process.stderr.write(`refusing to start: ${text}\n`);
    process.exit(1);
  };
}

/**
 * Whether a shutdown signal that comes while the app is stopping (since `stoppingSince`, ms) is the
 * first one sent again rather than a second Ctrl-C: one within a second of it. `npm start` passes
 * on the SIGINT that the terminal sent its whole process group, the app included, so a single
 * Ctrl-C reaches the app twice, moments apart; taken for a second signal, it cut every graceful
 * stop short.
 */
export function isRepeatedSignal(stoppingSince: number, now = Date.now()): boolean {
  return now - stoppingSince < 1_000;
}

/** A listen's failures that say its host is wrong: not resolvable, or no address of this machine. */
const HOST_ERRORS = new Set(["ENOTFOUND", "EAI_AGAIN", "EAI_FAIL", "EAI_NONAME", "EADDRNOTAVAIL"]);

/**
 * A listen's failure for a port in use (EADDRINUSE), said with the variable that set the port
 * (and `hint`); for a host it cannot listen on, with `hostVariable` when given; any other failure
 * as it was.
 */
export function portInUse(
  variable: string,
  port: number,
  host: string,
  hint = "",
  hostVariable?: string,
): (err: unknown) => never {
  return (err) => {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "EADDRINUSE") throw new Error(`${variable} ${port} is in use on ${host}${hint}`);
    if (hostVariable && code !== undefined && HOST_ERRORS.has(code)) {
      throw new Error(`${hostVariable} ${host}: cannot listen there (${(err as Error).message})`);
    }
    throw err;
  };
}
