/** What a redacted value is replaced with (pino's own censor string, so all redactions look alike). */
export const REDACTED = "[Redacted]";

/**
 * Key names whose values are secrets wherever they appear, compared after lower-casing and
 * dropping `_` and `-` (so `apiKey`, `api_key`, `API-KEY` all match). Exact matches only:
 * `promptTokens` is a count, not a secret.
 */
export const SECRET_KEYS: ReadonlySet<string> = new Set([
  "apikey",
  "xapikey",
  "token",
  "tokens",
  "admintokens",
  "accesstoken",
  "refreshtoken",
  "idtoken",
  "apitoken",
  "authtoken",
  "bearertoken",
  "sessiontoken",
  "secretkey",
  "secretaccesskey",
  "password",
  "passwd",
  "sentinelpassword",
  "secret",
  "clientsecret",
  "authorization",
  "proxyauthorization",
  "cookie",
  "setcookie",
  "credentialvalue",
  "privatekey",
]);

/**
 * pino `redact` paths (fast-redact syntax), applied on top of the deep key walk in
 * `redactSecretFields` so the documented paths hold even for objects the walk does not enter.
 */
export const REDACT_PATHS: readonly string[] = [
  "apiKey",
  "api_key",
  "token",
  "password",
  "secret",
  "authorization",
  "credentialValue",
  "*.apiKey",
  "*.api_key",
  "*.token",
  "*.password",
  "*.secret",
  "*.authorization",
  "*.credentialValue",
  "headers.authorization",
  "headers.cookie",
  "*.headers.authorization",
  "*.headers.cookie",
];

export function isSecretKey(key: string): boolean {
  return SECRET_KEYS.has(key.toLowerCase().replace(/[-_]/g, ""));
}

const MAX_DEPTH = 10;

/**
 * A copy of `value` with every secret-named field (any depth, see `SECRET_KEYS`) replaced by
 * `REDACTED`. Plain objects, arrays, Errors and other class instances are walked (an instance
 * becomes a plain object of its own enumerable fields, what its JSON would write); a URL becomes
 * its href without credentials (`redactUrl`), and every string has the credentials of the URLs in
 * it redacted, wherever they stand in it (`redactUrlCredentials`); an object written by its own `toJSON` (a Date, a Buffer) or a typed array is kept as it is.
 * Never mutates its input. Cycles are kept as cycles. An object or array nested deeper than
 * `MAX_DEPTH` is not walked: it becomes `"[Object]"` or `"[Array]"` (as pino's depth-limited
 * serializer writes one), never passed on unredacted.
 */
export function redactSecretFields<T>(value: T, options: RedactFieldsOptions = {}): T {
  return walk(value, 0, new WeakMap(), options.serialized) as T;
}

export interface RedactFieldsOptions {
  /**
   * Fields of the top-level object that a serializer writes (pino's, by field name: `err`, and
   * Fastify's `req` and `res`): a class instance there is kept as it is, for its serializer,
   * which reads what its prototype's getters give (a Fastify request's `method` and `url`). An
   * Error there is still walked (it keeps its prototype). @defaultValue none
   */
  serialized?: ReadonlySet<string>;
}

function walk(
  value: unknown,
  depth: number,
  seen: WeakMap<object, unknown>,
  serialized?: ReadonlySet<string>,
): unknown {
  if (typeof value === "string") return redactUrlCredentials(value);
  if (value === null || typeof value !== "object") return value;
  const done = seen.get(value);
  if (done !== undefined) return done;
  if (value instanceof URL) return redactUrl(value);
  if (Array.isArray(value)) {
    if (depth > MAX_DEPTH) return "[Array]";
    const out: unknown[] = [];
    seen.set(value, out);
    for (const item of value) out.push(walk(item, depth + 1, seen));
    return out;
  }
  const proto = Object.getPrototypeOf(value) as object | null;
  const isError = value instanceof Error;
  const instance = isInstance(value);
  // What JSON writes through the object's own toJSON (a Date's string, a Buffer's bytes), and a
  // typed array's elements: no fields of it to redact.
  if (instance && (typeof (value as { toJSON?: unknown }).toJSON === "function" || ArrayBuffer.isView(value)))
    return value;
  if (depth > MAX_DEPTH) return "[Object]";
  // Errors keep their prototype (so serializers still see an Error) and their non-enumerable
  // `message`/`stack`/`cause`/`errors`; own enumerable fields, `cause` and `errors` are walked.
  // Any other instance (a client's options, a Map) becomes a plain object of its own enumerable
  // fields: what JSON writes of it, and what pino's `*.password` paths could reach only one level down.
  const out = isError
    ? (Object.create(proto, Object.getOwnPropertyDescriptors(value)) as Record<string, unknown>)
    : ({} as Record<string, unknown>);
  seen.set(value, out);
  for (const [key, field] of Object.entries(value)) {
    out[key] =
      isSecretKey(key) && field !== undefined
        ? REDACTED
        : serialized?.has(key) && isInstance(field)
          ? field
          : walk(field, depth + 1, seen);
  }
  if (isError) {
    const cause = (value as Error).cause;
    if (cause !== undefined) {
      Object.defineProperty(out, "cause", {
        value: walk(cause, depth + 1, seen),
        enumerable: false,
        writable: true,
        configurable: true,
      });
    }
    // An AggregateError's `errors` (own, not enumerable), which pino's serializer writes out as
    // `aggregateErrors`: walked like `cause`, or each inner error's fields would go out as they are.
    const errors = Object.getOwnPropertyDescriptor(value, "errors");
    if (errors !== undefined && !errors.enumerable && "value" in errors) {
      Object.defineProperty(out, "errors", { ...errors, value: walk(errors.value, depth + 1, seen) });
    }
  }
  return out;
}

/** Whether `value` is an object of a class other than Object, Array, Error or URL. */
function isInstance(value: unknown): boolean {
  if (value === null || typeof value !== "object") return false;
  if (Array.isArray(value) || value instanceof Error || value instanceof URL) return false;
  const proto = Object.getPrototypeOf(value) as object | null;
  return proto !== Object.prototype && proto !== null;
}

/**
 * A URL as its JSON (`href`) would write it, minus credentials: its userinfo (`user:password@`,
 * or a token as the user) and the values of secret-named query parameters (`?api_key=`) become
 * `REDACTED`. As a string: a URL object left in a logged object has its `href` written out, and
 * pino's redact paths, reading its `password` off a copy, throw.
 */
function redactUrl(url: URL): string {
  return `${urlHead(url)}${redactQuery(url.search)}${url.hash}`;
}

/**
 * `text` with the credentials of every URL in it redacted, wherever it stands (the whole string,
 * or inside a message: "connect to https://u:p@host failed"): a URL's userinfo (`user:password@`,
 * or a token as the user) and the value of each secret-named query or fragment parameter
 * (`?api_key=`, `&token=`, `#access_token=`; also in a request target without a scheme,
 * `/v1/x?token=`) become `REDACTED`. The rest of the text is kept as it was, byte for byte (no
 * URL is normalised). Works on serialized JSON too (a logged line): a JSON escape (`\"`) is read
 * as one character, so a replacement never splits one. Cheap for most strings: one without `://`
 * and without `=` is not scanned.
 */
export function redactUrlCredentials(text: string): string {
  let out = text;
  if (out.includes("://")) out = out.replace(URL_AUTHORITY, redactAuthority);
  if (out.includes("=")) out = out.replace(URL_PARAMETER, redactParameter);
  return out;
}

/**
 * A scheme (from its first character only: a match tried at each letter of a long word would
 * take time quadratic in its length), `//`, then the authority: up to whitespace (a JSON `\n`, `\t` too), a quote, or the
 * `/`, `?` or `#` that ends it (another backslash escape, `\"`, taken as one character). Its
 * userinfo is what comes before its last `@`.
 */
const URL_AUTHORITY = /(?<![a-z0-9+.-])([a-z][a-z0-9+.-]*:\/\/)((?:\\[^\snrtbf]|[^\s/?#"\\])*)/gi;

/** A query or fragment parameter, `?name=value`, `&name=value`, `#name=value` (escapes as above). */
const URL_PARAMETER = /([?&#])([^=&#?\s"\\]+)=((?:\\[^\snrtbf]|[^&#\s"\\])*)/g;

function redactAuthority(match: string, scheme: string, authority: string): string {
  const at = authority.lastIndexOf("@");
  return at > 0 ? `${scheme}${REDACTED}${authority.slice(at)}` : match;
}

function redactParameter(match: string, sep: string, name: string, value: string): string {
  return value !== "" && value !== REDACTED && isSecretKey(decodeName(name))
    ? `${sep}${name}=${REDACTED}`
    : match;
}

/** A query parameter's name decoded (`+` as a space, `%5F` as `_`), or as written if malformed. */
function decodeName(name: string): string {
  try {
    return decodeURIComponent(name.replace(/\+/g, " "));
  } catch {
    return name;
  }
}

/** What comes before a URL's query, its userinfo (only a URL with a host has one, after `//`) as `REDACTED`. */
function urlHead(url: URL): string {
  const copy = new URL(url.href);
  const auth = copy.username !== "" || copy.password !== "";
  copy.username = "";
  copy.password = "";
  copy.search = "";
  copy.hash = "";
  const from = copy.protocol.length + 2;
  return auth ? `${copy.href.slice(0, from)}${REDACTED}@${copy.href.slice(from)}` : copy.href;
}

/** A URL's query (`search`, with its `?`) with the values of secret-named parameters as `REDACTED`. */
function redactQuery(search: string): string {
  return search
    .split("&")
    .map((pair, i) => {
      const eq = pair.indexOf("=");
      if (eq < 0) return pair;
      const name = pair.slice(i === 0 ? 1 : 0, eq);
      return isSecretKey(decodeName(name)) ? `${pair.slice(0, eq)}=${REDACTED}` : pair;
    })
    .join("&");
}

/**
 * The shortest run of a secret's characters that a fragment redactor (`{ fragments: true }`)
 * removes wherever it appears: an upstream that echoes a key it refused often quotes part of it
 * ("Partial: sk-abc…"), and a long enough part is as good as a leak. A masked echo (a few
 * characters, stars, the last four) stays. @defaultValue 10
 */
export const MIN_SECRET_FRAGMENT = 10;

export interface SecretRedactorOptions {
  /**
   * Also remove every run of at least `MIN_SECRET_FRAGMENT` characters of a secret. Only for
   * text no agent can see the result of (logs, stored reasons, transcripts): where the redacted
   * text goes back to what produced it, whether a run was removed tells it the run is part of
   * the secret, and it could rebuild the secret piece by piece. @defaultValue false
   */
  fragments?: boolean;
}

/**
 * Replace every occurrence of each known secret value in `text` with `replacement` (`REDACTED`),
 * longest first, and with `fragments` every run of at least `MIN_SECRET_FRAGMENT` of its
 * characters. Also covers each secret's JSON-escaped form, so it works on serialized JSON.
 * Empty strings are ignored.
 */
export function redactSecrets(
  text: string,
  secrets: Iterable<string>,
  replacement: string = REDACTED,
  options: SecretRedactorOptions = {},
): string {
  return secretRedactor(secrets, replacement, options)(text);
}

/** `redactSecrets` for one set of secrets, prepared once (e.g. a logger's, for every line). */
export function secretRedactor(
  secrets: Iterable<string>,
  replacement: string = REDACTED,
  options: SecretRedactorOptions = {},
): (text: string) => string {
  const forms = new Set<string>();
  for (const secret of secrets) {
    if (typeof secret !== "string" || secret.length === 0) continue;
    forms.add(secret);
    const escaped = JSON.stringify(secret).slice(1, -1);
    if (escaped !== secret) forms.add(escaped);
  }
  const k = MIN_SECRET_FRAGMENT;
  const whole = [...forms]
    .filter((f) => !options.fragments || f.length < k)
    .sort((a, b) => b.length - a.length);
  const exact = (text: string): string => {
    let out = text;
    for (const form of whole) if (out.includes(form)) out = out.split(form).join(replacement);
    return out;
  };
  if (!options.fragments) return exact;
  // Each long form's windows of k characters, and where they start in it.
  const grams = new Map<string, { form: string; at: number }[]>();
  for (const form of forms) {
    if (form.length < k) continue;
    for (let at = 0; at + k <= form.length; at++) {
      const gram = form.slice(at, at + k);
      const list = grams.get(gram);
      if (list) list.push({ form, at });
      else grams.set(gram, [{ form, at }]);
    }
  }
  if (grams.size === 0) return exact;
  return (text) => {
    // Scanning left to right, the first window that matches starts the longest run there.
    let out = "";
    let from = 0;
    for (let i = 0; i + k <= text.length; ) {
      const hits = grams.get(text.slice(i, i + k));
      if (!hits) {
        i++;
        continue;
      }
      let end = i + k;
      for (const { form, at } of hits) {
        let n = k;
        while (i + n < text.length && at + n < form.length && text[i + n] === form[at + n]) n++;
        end = Math.max(end, i + n);
      }
      out += text.slice(from, i) + replacement;
      from = end;
      i = end;
    }
    return exact(out + text.slice(from));
  };
}
