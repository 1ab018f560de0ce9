import { readFileSync } from "node:fs";
import { join } from "node:path";
import {
  CliConfig,
  DispatcherConfig,
  JanitorConfig,
  parseConfig,
  parseWorkerConfig,
  unknownFleetVariables,
  variablesOf,
  WorkerConfig,
} from "@fleet/config";
import { describe, expect, it } from "vitest";
import { REPO_ROOT } from "../../scripts/lib/fleet-processes.ts";

/** configs/fleet.env.example: every variable the apps read, with values each app accepts. */
const FILE = join(REPO_ROOT, "configs/fleet.env.example");
const LINE = /^(#)?([A-Z][A-Z0-9_]*)=(.*)$/;

function entries(): { name: string; value: string; set: boolean }[] {
  return readFileSync(FILE, "utf8")
    .split("\n")
    .map((l) => LINE.exec(l))
    .filter((m) => m !== null)
    .map((m) => ({ name: m[2]!, value: m[3]!, set: m[1] === undefined }));
}

describe("configs/fleet.env.example", () => {
  const all = entries();
  const set = Object.fromEntries(all.filter((e) => e.set).map((e) => [e.name, e.value]));

  it("names every variable the apps read, and only those (plus credential pairs)", () => {
    const known = new Set(
      [WorkerConfig, JanitorConfig, DispatcherConfig, CliConfig].flatMap((schema) => variablesOf(schema)),
    );
    const names = all.map((e) => e.name);
    expect([...known].filter((k) => !names.includes(k))).toEqual([]);
    expect(names.filter((n) => !known.has(n) && !n.startsWith("FLEET_CREDENTIAL_"))).toEqual([]);
    expect(new Set(names).size).toBe(names.length);
  });

  it("holds no variable an app would warn of as unknown at start", () => {
    expect(unknownFleetVariables(Object.fromEntries(all.map((e) => [e.name, e.value])))).toEqual([]);
  });

  it("its values, and each commented example switched on, parse for every app", () => {
    const parseAll = (env: Record<string, string>) => {
      parseConfig(DispatcherConfig, env);
      parseConfig(JanitorConfig, env);
      parseConfig(CliConfig, env);
      for (const kind of ["resources", "agent", "verifier"] as const) parseWorkerConfig(kind, env);
    };
    parseAll(set);
    // The defaults it states are the schemas' own.
    expect(parseConfig(DispatcherConfig, set)).toEqual(parseConfig(DispatcherConfig, {}));
    expect(parseConfig(JanitorConfig, set)).toEqual(parseConfig(JanitorConfig, {}));
    expect(parseWorkerConfig("agent", set)).toEqual(parseWorkerConfig("agent", {}));
    expect(parseConfig(CliConfig, set)).toEqual(parseConfig(CliConfig, {}));
    for (const e of all.filter((x) => !x.set && !x.name.startsWith("FLEET_CREDENTIAL_"))) {
      const env = { ...set, [e.name]: e.value };
      if (e.name === "FLEET_BWRAP_ROOTFS") env.FLEET_SANDBOX_PROVIDER = "bubblewrap";
      // Redis's TLS files go with a URL that speaks TLS; a client certificate with its key.
      if (e.name.startsWith("FLEET_REDIS_TLS_")) env.REDIS_URL = "rediss://127.0.0.1:6380";
      if (e.name === "FLEET_REDIS_TLS_CERT_FILE")
        env.FLEET_REDIS_TLS_KEY_FILE = "/etc/rollout-fleet/redis-client.key";
      if (e.name === "FLEET_REDIS_TLS_KEY_FILE" || e.name === "FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE")
        env.FLEET_REDIS_TLS_CERT_FILE = "/etc/rollout-fleet/redis-client.pem";
      // A passphrase with the key it opens.
      if (e.name === "FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE")
        env.FLEET_REDIS_TLS_KEY_FILE = "/etc/rollout-fleet/redis-client.key";
      expect(() => parseAll(env), e.name).not.toThrow();
    }
  });
});
