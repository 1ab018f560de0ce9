import { describe, expect, it } from "vitest";
import {
  KNOWN_FLEET_VARIABLES,
  unknownFleetVariables,
  unknownVariableMessage,
  warnUnknownVariables,
} from "./unknown-variables.ts";

describe("unknownFleetVariables", () => {
  it("names each FLEET_ variable no app reads, with the closest known name when one is close", () => {
    const env = {
      FLEET_CONCURENCY: "64", // a letter left out
      FLEET_HTTP_PROT: "9000", // two swapped
      FLEET_LOGLEVEL: "debug", // an underscore left out
      FLEET_API_TOKEN: "t", // the plural's s
      FLEET_REDIS_URL: "redis://r:6379", // an app's variable with the prefix
      FLEET_CREDENTAL_OPENAI: "sk", // a credential's prefix misspelt
      FLEET_SOMETHING_ELSE: "1", // nothing close
      FLEET_LOCK_DURATION: "60000", // a duration without its unit (3 edits)
      FLEET_RESULT_TTL: "0", // seconds, likewise
      FLEET_RESULT_TTL_SECONDS: "0", // another spelling of the unit
      FLEET_SHUTDOWN_TIMEOUT_SEC: "30", // another unit than the variable's
    };
    expect(unknownFleetVariables(env)).toEqual([
      { variable: "FLEET_API_TOKEN", suggestion: "FLEET_API_TOKENS" },
      { variable: "FLEET_CONCURENCY", suggestion: "FLEET_CONCURRENCY" },
      { variable: "FLEET_CREDENTAL_OPENAI", suggestion: "FLEET_CREDENTIAL_OPENAI" },
      { variable: "FLEET_HTTP_PROT", suggestion: "FLEET_HTTP_PORT" },
      { variable: "FLEET_LOCK_DURATION", suggestion: "FLEET_LOCK_DURATION_MS" },
      { variable: "FLEET_LOGLEVEL", suggestion: "FLEET_LOG_LEVEL" },
      { variable: "FLEET_REDIS_URL", suggestion: "REDIS_URL" },
      { variable: "FLEET_RESULT_TTL", suggestion: "FLEET_RESULT_TTL_S" },
      { variable: "FLEET_RESULT_TTL_SECONDS", suggestion: "FLEET_RESULT_TTL_S" },
      { variable: "FLEET_SHUTDOWN_TIMEOUT_SEC", suggestion: "FLEET_SHUTDOWN_TIMEOUT_MS" },
      { variable: "FLEET_SOMETHING_ELSE", suggestion: null },
    ]);
  });

  it("knows every app's variables (one environment serves them all), the tooling's, and the credential family", () => {
    const env: Record<string, string> = {
      // The dispatcher's, a worker's, the janitor's, the CLI's.
      FLEET_HTTP_PORT: "8080",
      FLEET_CONCURRENCY: "4",
      FLEET_ORPHAN_GRACE_MS: "1000",
      FLEET_TOKEN: "t",
      FLEET_URL: "http://x",
      // docker compose's and the tests'.
      FLEET_AGENT_CONCURRENCY: "8",
      FLEET_BASE_IMAGE: "img",
      // An agent worker's credentials, by name.
      FLEET_CREDENTIAL_MY_MODEL_KEY: "sk",
      FLEET_CREDENTIAL_MY_MODEL_KEY_BASE_URL: "https://api",
      // Not ours at all.
      REDIS_URL: "redis://r",
      PATH: "/bin",
      MY_FLEET_THING: "x",
    };
    expect(unknownFleetVariables(env)).toEqual([]);
    for (const name of [
      "FLEET_PREFIX",
      "FLEET_MAX_BODY_BYTES",
      "FLEET_SEED_AHEAD",
      "FLEET_JANITOR_INTERVAL_MS",
    ])
      expect(KNOWN_FLEET_VARIABLES.has(name), name).toBe(true);
    expect(KNOWN_FLEET_VARIABLES.has("REDIS_URL")).toBe(false);
  });

  it("warns once per unknown variable, naming it and the closest known one", () => {
    const lines: Array<{ obj: object; msg: string }> = [];
    warnUnknownVariables(
      { FLEET_CONCURENCY: "64", FLEET_PREFIX: "{f}" },
      { warn: (obj, msg) => lines.push({ obj, msg }) },
    );
    expect(lines).toEqual([
      {
        obj: { variable: "FLEET_CONCURENCY", didYouMean: "FLEET_CONCURRENCY" },
        msg: "FLEET_CONCURENCY is not a variable of the fleet: it is ignored (did you mean FLEET_CONCURRENCY?)",
      },
    ]);
    // A duration's unit is said: 30 meant as seconds is not 30 ms.
    expect(
      unknownVariableMessage({
        variable: "FLEET_SHUTDOWN_TIMEOUT_SEC",
        suggestion: "FLEET_SHUTDOWN_TIMEOUT_MS",
      }),
    ).toBe(
      "FLEET_SHUTDOWN_TIMEOUT_SEC is not a variable of the fleet: it is ignored (did you mean FLEET_SHUTDOWN_TIMEOUT_MS, in milliseconds?)",
    );
    expect(unknownVariableMessage({ variable: "FLEET_X", suggestion: null })).toBe(
      "FLEET_X is not a variable of the fleet: it is ignored",
    );
  });
});
