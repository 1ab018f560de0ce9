import type { z } from "zod";

/** Variables whose values are never echoed in an error message (a URL's userinfo never is either). */
const SECRET_VARIABLES = new Set(["FLEET_API_TOKENS", "FLEET_TOKEN"]);

/**
 * `scheme://user:pass@host…?query#fragment` → `scheme://***@host…?***`. Heuristic, so it works on
 * a URL that does not parse (a password with `#`, `/` or `?`): everything between its leading
 * `scheme://` and the last `@`, and the query or fragment after that (a Sentinel URL's `sentinelPassword`; a
 * token pasted after a `#`). A URL written without `//` (`http:/u:p@h`, `https:u:p@h`,
 * `http:\\u:p@h`, which URL parsers read as `http://u:p@h`), or with no scheme, is hidden alike
 * when it holds a `user:pass@`.
 */
export function redactUserinfo(value: string): string {
  const lead = /^\s*[a-z][a-z0-9+.-]*:\/\//i.exec(value);
  let at = value.lastIndexOf("@");
  let start: number;
  if (lead !== null) start = lead[0].length;
  else {
    // Userinfo (a `:` before its last `@`) is hidden after the scheme when a `user:pass` follows
    // it, else from the start (`default:pass@host`: no telling a scheme from a user); a query or
    // fragment (`redis:/h?password=…`, `localhost?password=…`: ioredis reads a password there)
    // as a URL's is. Any other value is shown as it is (`fleet@staging`).
    const userinfo = at !== -1 && value.slice(0, at).includes(":");
    if (!userinfo && !/[?#]/.test(value)) return value;
    const scheme = /^\s*[a-z][a-z0-9+.-]*:[/\\]*/i.exec(value);
    if (!userinfo) {
      at = -1;
      start = 0;
    } else start = scheme !== null && value.slice(scheme[0].length, at).includes(":") ? scheme[0].length : 0;
  }
  // An `@` after a query's `name=` (a Sentinel URL's password) may not end the userinfo at all.
  const q0 = value.indexOf("?", start);
  if (q0 !== -1 && q0 < at && value.slice(q0, at).includes("=")) return `${value.slice(0, start)}***`;
  const hostAt = Math.max(at, start);
  const q = value.slice(hostAt).search(/[?#]/);
  const tail = q === -1 ? value.slice(hostAt) : `${value.slice(hostAt, hostAt + q + 1)}***`;
  return `${value.slice(0, start)}${at < start ? "" : "***"}${tail}`;
}

export interface ConfigIssue {
  /** The environment variable at fault. */
  variable: string;
  message: string;
}

/** Every bad variable at once, so an operator fixes them in one go. */
export class ConfigError extends Error {
  override readonly name = "ConfigError";
  readonly issues: ConfigIssue[];

  constructor(issues: ConfigIssue[], env: Record<string, string | undefined>) {
    const lines = issues.map(({ variable, message }) => {
      // Redact before cutting at 80 characters, or a long password could lose its `@`.
      const raw = env[variable];
      const value = raw === undefined ? undefined : redactUserinfo(raw);
      const shown =
        value === undefined
          ? ""
          : SECRET_VARIABLES.has(variable)
            ? " (value hidden)"
            : ` (got ${JSON.stringify(value.length > 80 ? `${value.slice(0, 80)}…` : value)})`;
      return `  - ${variable}: ${message}${shown}`;
    });
    super(`invalid configuration:\n${lines.join("\n")}`);
    this.issues = issues;
  }
}

/**
 * Parse `env` with one of this package's schemas. Empty and whitespace-only values count as
 * unset (so `FOO=` in a compose file means "use the default"). Throws one `ConfigError` naming
 * every bad variable.
 */
export function parseConfig<S extends z.ZodType>(
  schema: S,
  env: Record<string, string | undefined>,
): z.output<S> {
  const cleaned: Record<string, string> = {};
  for (const [key, value] of Object.entries(env)) {
    if (value !== undefined && value.trim() !== "") cleaned[key] = value;
  }
  const result = schema.safeParse(cleaned);
  if (result.success) return result.data;
  const issues: ConfigIssue[] = [];
  for (const issue of result.error.issues) {
    const variable = issue.path.length > 0 ? String(issue.path[0]) : "(environment)";
    if (!issues.some((i) => i.variable === variable && i.message === issue.message)) {
      issues.push({ variable, message: issue.message });
    }
  }
  throw new ConfigError(issues, env);
}
