import { REDIS_HOST_PORT } from "@fleet/contracts";
import { z } from "zod";

/** Largest delay a Node timer honours; longer ones fire at once. */
export const MAX_TIMER_MS = 2_147_483_647;

const WHOLE = /^\d+$/;

/** A whole number from an env string, within `[min, max]`. */
export function intVar(min: number, max: number, message?: string) {
  const range = message ?? `must be a whole number from ${min} to ${max}`;
  return z
    .string()
    .trim()
    .regex(WHOLE, range)
    .transform(Number)
    .pipe(z.number().int().min(min, range).max(max, range));
}

/** A decimal number from an env string (`1`, `2.5`, `.5`), within `[min, max]`. */
export function numberVar(min: number, max: number, message: string) {
  return z
    .string()
    .trim()
    .regex(/^(?:\d+(?:\.\d*)?|\.\d+)$/, message)
    .transform(Number)
    .pipe(z.number().min(min, message).max(max, message));
}

/** A TCP port; `0` asks the OS for a free one. */
export const portVar = () => intVar(0, 65_535, "must be a port number from 0 to 65535");

/**
 * A duration in milliseconds: finite, at least `min` (positive by default) and within what a Node
 * timer can wait.
 */
export const durationMsVar = (min = 1) =>
  intVar(
    min,
    MAX_TIMER_MS,
    min === 1
      ? `must be a positive whole number of milliseconds (at most ${MAX_TIMER_MS})`
      : `must be a whole number of milliseconds from ${min} to ${MAX_TIMER_MS}`,
  );

const TRUE = new Set(["1", "true", "yes", "on"]);
const FALSE = new Set(["0", "false", "no", "off"]);

/** `true|false|1|0|yes|no|on|off`, case-insensitive. */
export const boolVar = () =>
  z
    .string()
    .trim()
    .toLowerCase()
    .refine((s) => TRUE.has(s) || FALSE.has(s), "must be true or false (also 1/0, yes/no, on/off)")
    .transform((s) => TRUE.has(s));

/**
 * The Fetch standard's "bad ports": Node's `fetch` (the CLI's client) and browsers (Bull Board)
 * refuse to connect to them, whatever listens there, so a dispatcher URL naming one can never be
 * reached.
 */
export const FETCH_BLOCKED_PORTS: ReadonlySet<number> = new Set([
  1, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23, 25, 37, 42, 43, 53, 69, 77, 79, 87, 95, 101, 102, 103, 104,
  109, 110, 111, 113, 115, 117, 119, 123, 135, 137, 139, 143, 161, 179, 389, 427, 465, 512, 513, 514, 515,
  526, 530, 531, 532, 540, 548, 554, 556, 563, 587, 601, 636, 989, 990, 993, 995, 1719, 1720, 1723, 2049,
  3659, 4045, 4190, 5060, 5061, 6000, 6566, 6665, 6666, 6667, 6668, 6669, 6679, 6697, 10080,
]);

/** The port of an http(s) URL that `fetch` refuses to connect to (`FETCH_BLOCKED_PORTS`), or null. */
export function fetchBlockedPort(url: string): number | null {
  let port: string;
  try {
    port = new URL(url).port;
  } catch {
    return null;
  }
  // An empty port is the scheme's default (80, 443): never a blocked one.
  return port !== "" && FETCH_BLOCKED_PORTS.has(Number(port)) ? Number(port) : null;
}

/** What a URL naming a blocked port is told (`fetchBlockedPort`). */
export const FETCH_BLOCKED_PORT_MESSAGE =
  "names a port that fetch and browsers refuse to connect to (one of the Fetch standard's bad ports, such as 6000, 6667 or 10080): no client can reach a dispatcher there; run it on another port";

/**
 * What is wrong with an http(s) URL as the dispatcher's base URL, beyond its scheme, or
 * undefined: a port `fetch` refuses (`FETCH_BLOCKED_PORT_MESSAGE`); credentials (`fetch` refuses
 * a URL holding them on every attempt, which read as a dispatcher that is down); a query or a
 * fragment (the API's paths go after the base: every request would miss its route). A path is
 * fine (a dispatcher behind a proxy under a prefix).
 */
export function dispatcherUrlProblem(url: string): string | undefined {
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    return undefined; // the scheme's check says it
  }
  if (fetchBlockedPort(url) !== null) return FETCH_BLOCKED_PORT_MESSAGE;
  if (parsed.username !== "" || parsed.password !== "") {
    return "must not hold credentials (user:password@): fetch refuses such a URL; give the API token as FLEET_TOKEN or --token";
  }
  if (parsed.search !== "" || parsed.hash !== "" || /[?#]/.test(url)) {
    return "must not have a query (?…) or a fragment (#…): the API's paths are added after it";
  }
  return undefined;
}

/**
 * At a server's start: a warning when it is to listen on a port `fetch` and browsers refuse
 * (`FETCH_BLOCKED_PORTS`). Not a refusal: curl and most other clients still connect, but the
 * fleet CLI and Bull Board in a browser never will. Returns whether it warned.
 */
export function warnFetchBlockedPort(
  variable: string,
  port: number,
  logger: { warn(obj: object, msg: string): void },
): boolean {
  if (!FETCH_BLOCKED_PORTS.has(port)) return false;
  logger.warn(
    { variable, port },
    `${variable}=${port} is a port fetch and browsers refuse to connect to (one of the Fetch standard's bad ports): the fleet CLI and Bull Board in a browser cannot reach this server; choose another port`,
  );
  return true;
}

/** A URL whose scheme is one of `protocols` (e.g. `["redis:", "rediss:"]`). */
export function urlVar(protocols: readonly string[]) {
  const message = `must be a URL starting with ${protocols.map((p) => `${p}//`).join(" or ")}`;
  return z
    .string()
    .trim()
    .refine((s) => {
      try {
        return protocols.includes(new URL(s).protocol);
      } catch {
        return false;
      }
    }, message);
}

/**
 * A Redis URL: `redis://` / `rediss://`, a Redis Cluster's seed nodes as
 * `redis-cluster://[user:pass@]host:port,host:port` (`rediss-cluster://` for TLS), or Redis
 * Sentinels and the name of the master they watch as
 * `redis-sentinel://[user:pass@]host:port,host:port/mymaster[/db][?sentinelUsername=…&sentinelPassword=…]`
 * (the master's credentials before the hosts, the sentinels' own in the query;
 * `rediss-sentinel://` for TLS to the sentinels and the master).
 */
export function redisUrlVar() {
  const message =
    "must be a URL starting with redis:// or rediss:// (or redis-cluster://host:port,host:port, or redis-sentinel://host:port,host:port/mastername[?sentinelPassword=…, a @ in it as %40]; rediss-cluster:// and rediss-sentinel:// for TLS)";
  return z
    .string()
    .trim()
    .refine((s) => {
      const cluster = /^rediss?-cluster:\/\/(?:[^@/]*@)?([^@/?#]+)\/?$/i.exec(s);
      const sentinel =
        /^rediss?-sentinel:\/\/(?:[^@/]*@)?([^@/?#]+)\/([^/?#]+)(?:\/\d+)?\/?(?:\?([^#@]*))?$/i.exec(s);
      const nodes = (cluster ?? sentinel)?.[1];
      try {
        if (nodes === undefined) return ["redis:", "rediss:"].includes(new URL(s).protocol);
        if (sentinel) {
          decodeURIComponent(sentinel[2]!); // the master's name: throws if badly encoded
          // The sentinels' own credentials, each at most once (see the queue's parseSentinelUrl).
          const keys = sentinel[3] === undefined ? [] : sentinel[3].split("&");
          const seen = new Set<string>();
          for (const pair of keys) {
            const [key = "", ...value] = pair.split("=");
            if (!["sentinelUsername", "sentinelPassword"].includes(key) || seen.has(key)) return false;
            seen.add(key);
            decodeURIComponent(value.join("="));
          }
        }
        // Each `host[:port]` as the queue's parser takes it.
        return nodes
          .split(",")
          .every((node) => REDIS_HOST_PORT.test(node.trim()) && new URL(`redis://${node}`).hostname !== "");
      } catch {
        return false;
      }
    }, message)
    .refine((s) => {
      // ioredis SELECTs what the path (or `?db=`) says: anything but a number crashed the app.
      let url: URL;
      try {
        url = new URL(s);
      } catch {
        return true; // said above
      }
      if (!["redis:", "rediss:"].includes(url.protocol)) return true;
      const db = url.searchParams.get("db");
      return /^\/?\d*$/.test(url.pathname) && (db === null || /^\d+$/.test(db));
    }, "must name its database as a whole number, such as redis://host:6379/0, or none");
}

/** A non-empty string without whitespace (names, ids, prefixes, hosts). */
export const wordVar = () => z.string().trim().regex(/^\S+$/, "must not contain whitespace");

export const LogLevel = z.enum(["fatal", "error", "warn", "info", "debug", "trace", "silent"], {
  error: "must be one of fatal, error, warn, info, debug, trace, silent",
});
export type LogLevel = z.infer<typeof LogLevel>;

/** Parsed `FLEET_API_TOKENS`: every accepted token, and the subset marked `admin:`. */
export interface ApiTokens {
  /** All tokens that authenticate, admin ones included (without the `admin:` prefix). */
  tokens: string[];
  /** Tokens that may also act in Bull Board. */
  adminTokens: string[];
}

/** `tok1,admin:tok2` → `{ tokens: ["tok1", "tok2"], adminTokens: ["tok2"] }`. */
export function parseApiTokens(value: string): ApiTokens {
  const tokens: string[] = [];
  const adminTokens: string[] = [];
  for (const raw of value.split(",")) {
    const entry = raw.trim();
    if (entry.length === 0) continue;
    const admin = entry.startsWith("admin:");
    const token = admin ? entry.slice("admin:".length) : entry;
    if (!tokens.includes(token)) tokens.push(token);
    if (admin && !adminTokens.includes(token)) adminTokens.push(token);
  }
  return { tokens, adminTokens };
}

export const apiTokensVar = () =>
  z
    .string()
    .superRefine((value, ctx) => {
      const entries = value.split(",").map((raw) => raw.trim());
      for (const entry of entries) {
        const token = entry.startsWith("admin:") ? entry.slice("admin:".length) : entry;
        if (entry.length > 0 && token.length === 0) {
          ctx.addIssue({ code: "custom", message: "has an empty token after 'admin:'" });
        } else if (/\s/.test(token)) {
          ctx.addIssue({ code: "custom", message: "has a token containing whitespace" });
        } else if (entry.length > 0 && !/^[\x21-\x7e]+$/.test(token)) {
          // A header cannot carry it (UTF-8 bytes come back as latin1) and the fleet CLI refuses
          // it: every request with it would be a 401.
          ctx.addIssue({
            code: "custom",
            message: "has a token with characters other than printable ASCII, which no client can send",
          });
        }
      }
      // Set but holding only commas (`,`, or `$A,$B` with both unset): no token would turn auth
      // off, so refuse it. An empty value is unset (no tokens: auth off, on purpose).
      if (value.trim() !== "" && entries.every((entry) => entry.length === 0)) {
        ctx.addIssue({
          code: "custom",
          message: "is set but holds no token (only commas); unset it to turn auth off",
        });
      }
    })
    .transform(parseApiTokens);
