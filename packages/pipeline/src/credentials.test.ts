import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { createCredentialResolver, credentialEnvName } from "./credentials.ts";

describe("credential resolver", () => {
  it("reads FLEET_CREDENTIAL_<NAME> first, then the secrets file, and remembers what it handed out", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cred-"));
    const file = join(dir, "secrets.json");
    writeFileSync(file, JSON.stringify({ default: "from-file", other: "other-value" }));
    const known = new Set<string>();
    const resolve = createCredentialResolver({ env: { FLEET_CREDENTIAL_DEFAULT: "from-env" }, file, known });
    expect(await resolve("default")).toBe("from-env");
    expect(await resolve("other")).toBe("other-value");
    expect([...known].sort()).toEqual(["from-env", "other-value"]);
    expect(credentialEnvName("my-model.key")).toBe("FLEET_CREDENTIAL_MY_MODEL_KEY");
  });

  it("an unknown name is a final agent_error that names the name and no value", async () => {
    const resolve = createCredentialResolver({ env: { FLEET_CREDENTIAL_A: "secret-a" } });
    const err: unknown = await resolve("missing").then(
      () => null,
      (e: unknown) => e,
    );
    expect(err).toMatchObject({ name: "FleetError", kind: "agent_error", retryable: false });
    const message = err instanceof Error ? err.message : "";
    expect(message).toContain("missing");
    expect(message).not.toContain("secret-a");
  });
});
