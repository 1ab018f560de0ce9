import { readFile } from "node:fs/promises";
import { CredentialName, FleetError, normalizeBaseUrl } from "@fleet/contracts";

/**
 * Environment variable holding credential `name`: `FLEET_CREDENTIAL_<NAME>` (upper-cased,
 * non-alphanumerics → `_`). An environment variable cannot tell `my-key`, `my.key`, `My_Key`
 * apart, so neither does the fleet: a name is one credential with every name that shares its
 * variable, in the secrets file too (`createCredentialResolver`).
 */
export function credentialEnvName(name: string): string {
  return `FLEET_CREDENTIAL_${name.toUpperCase().replace(/[^A-Z0-9]/g, "_")}`;
}

/** Environment variable naming the base URLs credential `name` may be sent to (comma-separated). */
export function credentialBaseUrlEnvName(name: string): string {
  return `${credentialEnvName(name)}_BASE_URL`;
}

interface FileEntry {
  value?: string;
  baseUrls: string[];
}

/** The secrets file's entries, by the variable their name shares (`credentialEnvName`). */
type FileEntries = Map<string, FileEntry>;

/**
 * Resolve credential *names* to values inside the worker (DESIGN §2 rule 8), for one upstream:
 * a credential is handed out only for a base URL the operator bound it to, so a submitter who
 * names a credential cannot have it sent anywhere else.
 *
 * - Value: the worker's own environment (`FLEET_CREDENTIAL_<NAME>`), else a JSON secrets file
 *   (`FLEET_CREDENTIALS_FILE`: `{ "<name>": { "value": "...", "baseUrls": ["..."] } }`, read once).
 *   Either is found by the name's variable, so `my-key`, `my.key` and `MY_KEY` name one credential
 *   (the file's entry and the environment's alike); a file naming one credential twice is refused.
 * - Allowed base URLs: `FLEET_CREDENTIAL_<NAME>_BASE_URL` (comma-separated), else the file's
 *   `baseUrls`. None configured: the credential is refused for every URL (fail closed).
 *
 * Jobs and records only ever carry the name. Every value handed out is added to `known`, so the
 * logger can scrub it from any line. Errors never quote the file's text.
 */
export function createCredentialResolver(options: {
  env: Record<string, string | undefined>;
  file?: string | null;
  known?: Set<string>;
  /**
   * Told why the secrets file is refused, naming what the rollout's reason may not (the two
   * names of one credential): for the worker's log, the operator's to read.
   */
  onRefused?: (why: string) => void;
}): (name: string, baseUrl: string) => Promise<string> {
  let fileEntries: Promise<FileEntries> | null = null;
  const loadFile = (file: string): Promise<FileEntries> => {
    fileEntries ??= readFile(file, "utf8")
      .then(
        (text) => {
          try {
            return parseCredentialsFile(text);
          } catch (err) {
            if (err instanceof CredentialsFileRefused) options.onRefused?.(err.forOperator);
            throw err;
          }
        },
        (err: unknown) => {
          throw FleetError.retryable(
            "provider_unavailable",
            `cannot read the credentials file: ${(err as NodeJS.ErrnoException).code ?? "read error"}`,
          );
        },
      )
      .catch((err: unknown) => {
        fileEntries = null; // read it again next time (the operator may fix it)
        throw err;
      });
    return fileEntries;
  };
  // Empty or whitespace only is unset, as for every other variable (`parseConfig`): compose's
  // `FLEET_CREDENTIAL_X: ${X:-}` must not hide the secrets file's entry for X.
  const fromEnv = (variable: string): string | undefined => {
    const value = options.env[variable];
    return value === undefined || value.trim() === "" ? undefined : value;
  };
  return async (name, baseUrl) => {
    const fromFile = options.file ? (await loadFile(options.file)).get(credentialEnvName(name)) : undefined;
    const raw = fromEnv(credentialEnvName(name)) ?? fromFile?.value;
    // Sent as `Authorization: Bearer <value>`: the usual trailing newline of a secret made from a
    // file is dropped (fetch would drop it too, and then no redactor would find the value as
    // stored); anything else a header cannot carry is refused, without quoting it.
    const value = raw?.trim();
    if (value && !/^[\x21-\x7e]+$/.test(value)) {
      throw FleetError.nonRetryable(
        "agent_error",
        `credential "${name}" holds characters an HTTP header cannot carry (spaces or control characters inside it); fix its value on this worker`,
      );
    }
    if (!value) {
      throw FleetError.nonRetryable(
        "agent_error",
        `credential "${name}" is not configured on this worker (set ${credentialEnvName(name)} or FLEET_CREDENTIALS_FILE)`,
      );
    }
    const boundEnv = fromEnv(credentialBaseUrlEnvName(name));
    const allowed = (boundEnv !== undefined ? boundEnv.split(",") : (fromFile?.baseUrls ?? []))
      .map(normalizeBaseUrl)
      .filter((u): u is string => u !== null);
    const wanted = normalizeBaseUrl(baseUrl);
    if (wanted === null || !allowed.includes(wanted)) {
      throw FleetError.nonRetryable(
        "agent_error",
        allowed.length === 0
          ? `credential "${name}" is bound to no upstream on this worker (set ${credentialBaseUrlEnvName(name)}), so it is sent nowhere`
          : // Not the upstreams it is bound to: a submitter learns nothing of the operator's setup.
            `credential "${name}" is not bound to ${wanted ?? "an invalid URL"} on this worker (${credentialBaseUrlEnvName(name)})`,
      );
    }
    options.known?.add(value);
    if (raw !== value) options.known?.add(raw!);
    return value;
  };
}

/**
 * A secrets file refused for what it holds: `message`, a rollout's failure reason, names nothing
 * of the operator's; `forOperator` does (the worker's start, its log).
 */
class CredentialsFileRefused extends FleetError {
  constructor(
    message: string,
    readonly forOperator: string,
  ) {
    super("provider_unavailable", message, { retryable: true });
  }
}

/**
 * At an agent worker's start: the secrets file `FLEET_CREDENTIALS_FILE` names can be read and is
 * the expected JSON; otherwise an error naming the variable and why (never quoting the file).
 * Unchecked, a typo in its path was found only by the rollouts naming a credential, each retried
 * and then masked `provider_unavailable`.
 */
export async function checkCredentialsFile(file: string): Promise<void> {
  try {
    parseCredentialsFile(await readFile(file, "utf8"));
  } catch (err) {
    const reason =
      err instanceof CredentialsFileRefused
        ? err.forOperator
        : err instanceof FleetError
          ? err.message
          : `cannot read the credentials file: ${(err as NodeJS.ErrnoException).code ?? "read error"}`;
    throw new Error(`FLEET_CREDENTIALS_FILE ${file}: ${reason}`);
  }
}

/**
 * The secrets file's entries, by their name's variable; a file that is not the expected JSON is
 * refused without quoting it, and so is one with two names of one variable (`my-key` and
 * `my.key`): which of the two a rollout gets would depend on how it spelt the name, and an
 * operator's `FLEET_CREDENTIAL_MY_KEY` would stand for both. A name no rollout can give (not a
 * credential name: `my key`, `a/b`) is left out: no rollout reached it before either, and folded
 * it must not answer one (`my-key`) now.
 */
function parseCredentialsFile(text: string): FileEntries {
  let data: unknown;
  try {
    data = JSON.parse(text);
  } catch {
    // Not the parser's message: it quotes the text around the error, secrets included.
    throw FleetError.retryable("provider_unavailable", "the credentials file is not valid JSON");
  }
  if (typeof data !== "object" || data === null || Array.isArray(data)) {
    throw FleetError.retryable("provider_unavailable", "the credentials file must hold a JSON object");
  }
  const out: FileEntries = new Map();
  const names = new Map<string, string>();
  for (const [name, entry] of Object.entries(data)) {
    if (!CredentialName.safeParse(name).success) continue;
    let parsed: FileEntry;
    if (typeof entry === "string") parsed = { value: entry, baseUrls: [] };
    else if (typeof entry === "object" && entry !== null) {
      const e = entry as { value?: unknown; baseUrls?: unknown };
      parsed = {
        value: typeof e.value === "string" ? e.value : undefined,
        baseUrls: Array.isArray(e.baseUrls)
          ? e.baseUrls.filter((u): u is string => typeof u === "string")
          : [],
      };
    } else continue;
    const variable = credentialEnvName(name);
    const other = names.get(variable);
    if (other !== undefined) {
      // Never a value; the names only for the operator (the worker's start, its log): at a
      // rollout's resolve the message is its failure's reason, which its submitter reads, and a
      // submitter learns nothing of the operator's setup (a file changed after the start).
      throw new CredentialsFileRefused(
        "the credentials file names one credential twice (two of its names share one FLEET_CREDENTIAL_ variable); the agent worker's log says which",
        `the credentials file names one credential twice: "${other}" and "${name}" are both ${variable} (a credential name's case and its "-", "." and "_" do not tell credentials apart); keep one`,
      );
    }
    names.set(variable, name);
    out.set(variable, parsed);
  }
  return out;
}
