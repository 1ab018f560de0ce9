import { readFile } from "node:fs/promises";
import { FleetError } from "@fleet/contracts";

/** Environment variable holding credential `name`: `FLEET_CREDENTIAL_<NAME>` (non-alphanumerics → `_`). */
export function credentialEnvName(name: string): string {
  return `FLEET_CREDENTIAL_${name.toUpperCase().replace(/[^A-Z0-9]/g, "_")}`;
}

/**
 * Resolve credential *names* to values inside the worker (DESIGN §2 rule 8): from the worker's
 * own environment (`FLEET_CREDENTIAL_<NAME>`), else from a JSON secrets file
 * (`{ "<name>": "<value>" }`, read once). Jobs and records only ever carry the name. Every value
 * handed out is added to `known`, so the logger can scrub it from any line.
 */
export function createCredentialResolver(options: {
  env: Record<string, string | undefined>;
  file?: string | null;
  known?: Set<string>;
}): (name: string) => Promise<string> {
  let fileValues: Promise<Record<string, unknown>> | null = null;
  const fromFile = async (name: string): Promise<string | undefined> => {
    if (!options.file) return undefined;
    fileValues ??= readFile(options.file, "utf8").then(
      (text) => JSON.parse(text) as Record<string, unknown>,
      (err: unknown) => {
        fileValues = null; // retry the read next time
        throw FleetError.retryable(
          "provider_unavailable",
          `cannot read the credentials file: ${(err as Error).message}`,
        );
      },
    );
    const v = (await fileValues)[name];
    return typeof v === "string" ? v : undefined;
  };
  return async (name) => {
    const value = options.env[credentialEnvName(name)] ?? (await fromFile(name));
    if (!value) {
      throw FleetError.nonRetryable(
        "agent_error",
        `credential "${name}" is not configured on this worker (set ${credentialEnvName(name)} or FLEET_CREDENTIALS_FILE)`,
      );
    }
    options.known?.add(value);
    return value;
  };
}
