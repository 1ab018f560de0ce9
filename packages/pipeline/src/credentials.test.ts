import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { checkCredentialsFile, createCredentialResolver, credentialEnvName } from "./credentials.ts";

const UPSTREAM = "http://127.0.0.1:8000/v1";

async function failure(p: Promise<unknown>): Promise<{ kind: string; retryable: boolean; message: string }> {
  const err = await p.then(
    () => null,
    (e: unknown) => e,
  );
  expect(err).toMatchObject({ name: "FleetError" });
  return err as { kind: string; retryable: boolean; message: string };
}

describe("credential resolver", () => {
  it("reads FLEET_CREDENTIAL_<NAME> first, then the secrets file, and remembers what it handed out", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cred-"));
    const file = join(dir, "secrets.json");
    writeFileSync(
      file,
      JSON.stringify({
        default: { value: "from-file", baseUrls: [UPSTREAM] },
        other: { value: "other-value", baseUrls: [`${UPSTREAM}/`] },
      }),
    );
    const known = new Set<string>();
    const resolve = createCredentialResolver({
      env: { FLEET_CREDENTIAL_DEFAULT: "from-env", FLEET_CREDENTIAL_DEFAULT_BASE_URL: UPSTREAM },
      file,
      known,
    });
    expect(await resolve("default", UPSTREAM)).toBe("from-env");
    expect(await resolve("other", `${UPSTREAM}//`)).toBe("other-value");
    expect([...known].sort()).toEqual(["from-env", "other-value"]);
    expect(credentialEnvName("my-model.key")).toBe("FLEET_CREDENTIAL_MY_MODEL_KEY");
  });

  it("an empty FLEET_CREDENTIAL_<NAME> or _BASE_URL is unset (as compose passes an unset one): the secrets file's entry applies", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cred-"));
    const file = join(dir, "secrets.json");
    writeFileSync(file, JSON.stringify({ default: { value: "from-file", baseUrls: [UPSTREAM] } }));
    const resolve = createCredentialResolver({
      env: { FLEET_CREDENTIAL_DEFAULT: "", FLEET_CREDENTIAL_DEFAULT_BASE_URL: " " },
      file,
    });
    expect(await resolve("default", UPSTREAM)).toBe("from-file");
  });

  it("hands a credential out only for a base URL it is bound to; unbound, for none", async () => {
    const known = new Set<string>();
    const resolve = createCredentialResolver({
      env: {
        FLEET_CREDENTIAL_A: "secret-a",
        FLEET_CREDENTIAL_A_BASE_URL: `${UPSTREAM}, https://api.example.test/v1`,
        FLEET_CREDENTIAL_B: "secret-b",
      },
      known,
    });
    expect(await resolve("a", "https://api.example.test/v1/")).toBe("secret-a");
    for (const url of ["http://attacker.test/v1", "http://127.0.0.1:8000/v1/../../latest", "not a url"]) {
      const err = await failure(resolve("a", url));
      expect([err.kind, err.retryable], url).toEqual(["agent_error", false]);
      expect(err.message).toContain("is not bound to");
      expect(err.message).not.toContain("secret-a");
      // Nor where it is bound: a submitter learns nothing of the operator's upstreams.
      expect(err.message).not.toContain("api.example.test");
    }
    const unbound = await failure(resolve("b", UPSTREAM));
    expect(unbound.message).toContain("FLEET_CREDENTIAL_B_BASE_URL");
    expect([...known]).toEqual(["secret-a"]);
  });

  it("a value's surrounding whitespace is dropped (and both forms redacted); a value a header cannot carry is refused unquoted", async () => {
    const known = new Set<string>();
    const resolve = createCredentialResolver({
      env: {
        FLEET_CREDENTIAL_K8S: "sk-from-a-file\n",
        FLEET_CREDENTIAL_K8S_BASE_URL: UPSTREAM,
        FLEET_CREDENTIAL_BAD: "sk-two\nlines",
        FLEET_CREDENTIAL_BAD_BASE_URL: UPSTREAM,
      },
      known,
    });
    expect(await resolve("k8s", UPSTREAM)).toBe("sk-from-a-file");
    expect([...known].sort()).toEqual(["sk-from-a-file", "sk-from-a-file\n"]);
    const err = await failure(resolve("bad", UPSTREAM));
    expect([err.kind, err.retryable]).toEqual(["agent_error", false]);
    expect(err.message).toContain("cannot carry");
    expect(err.message).not.toContain("sk-two");
  });

  it("an unknown name is a final agent_error that names the name and no value", async () => {
    const resolve = createCredentialResolver({ env: { FLEET_CREDENTIAL_A: "secret-a" } });
    const err = await failure(resolve("missing", UPSTREAM));
    expect([err.kind, err.retryable]).toEqual(["agent_error", false]);
    expect(err.message).toContain("missing");
    expect(err.message).not.toContain("secret-a");
  });

  it("a name is one credential with every name of its variable (case, '-', '.', '_'), in the secrets file as in the environment", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cred-"));
    const file = join(dir, "secrets.json");
    writeFileSync(
      file,
      JSON.stringify({
        "team-a.key": { value: "from-file", baseUrls: [UPSTREAM] },
        // No rollout can name it (not a credential name): it shares no one's variable.
        "team a key": { value: "unreachable", baseUrls: [UPSTREAM] },
      }),
    );
    const resolve = createCredentialResolver({
      env: { FLEET_CREDENTIAL_OTHER_KEY: "from-env", FLEET_CREDENTIAL_OTHER_KEY_BASE_URL: UPSTREAM },
      file,
    });
    for (const name of ["team-a.key", "TEAM_A_KEY", "Team.A-Key"]) {
      expect(await resolve(name, UPSTREAM), name).toBe("from-file");
    }
    for (const name of ["other-key", "other.key", "OTHER_KEY"]) {
      expect(await resolve(name, UPSTREAM), name).toBe("from-env");
    }
    // The environment's variable stands for the file's entry of every such name.
    const overridden = createCredentialResolver({ env: { FLEET_CREDENTIAL_TEAM_A_KEY: "from-env" }, file });
    expect(await overridden("Team.A-Key", UPSTREAM)).toBe("from-env");
  });

  it("refuses a secrets file naming one credential twice ('my-key' and 'my.key'), at the agent worker's start (naming both) and when resolving (naming neither: a submitter reads it), never a value", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cred-"));
    const file = join(dir, "secrets.json");
    writeFileSync(
      file,
      JSON.stringify({
        "my-key": { value: "sk-dash-SECRET", baseUrls: [UPSTREAM] },
        other: { value: "sk-other", baseUrls: [UPSTREAM] },
        "my.key": { value: "sk-dot-SECRET", baseUrls: [UPSTREAM] },
      }),
    );
    const refusal =
      '"my-key" and "my.key" are both FLEET_CREDENTIAL_MY_KEY (a credential name\'s case and its "-", "." and "_" do not tell credentials apart)';
    const start = await checkCredentialsFile(file).then(
      () => null,
      (e: Error) => e.message,
    );
    expect(start ?? "(started: no refusal)").toContain(
      `FLEET_CREDENTIALS_FILE ${file}: the credentials file names one credential twice: ${refusal}`,
    );
    expect(start).not.toContain("SECRET");
    const told: string[] = [];
    const resolve = createCredentialResolver({ env: {}, file, onRefused: (why) => told.push(why) });
    for (const name of ["my-key", "other"]) {
      const err = await failure(resolve(name, UPSTREAM));
      expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
      // The rollout's failure reason, which its submitter reads: no name of the operator's either.
      expect(err.message).toBe(
        "the credentials file names one credential twice (two of its names share one FLEET_CREDENTIAL_ variable); the agent worker's log says which",
      );
    }
    // The worker's log names both, for the operator (the start's check passed before a change).
    expect(told).toEqual([
      `the credentials file names one credential twice: ${refusal}; keep one`,
      `the credentials file names one credential twice: ${refusal}; keep one`,
    ]);
    // One kept: read again, as any fix of the file.
    writeFileSync(file, JSON.stringify({ "my-key": { value: "sk-dash-SECRET", baseUrls: [UPSTREAM] } }));
    await checkCredentialsFile(file);
    expect(await resolve("my.key", UPSTREAM)).toBe("sk-dash-SECRET");
  });

  it("a secrets file that is not JSON is refused without quoting it, and read again once fixed", async () => {
    const dir = mkdtempSync(join(tmpdir(), "cred-"));
    const file = join(dir, "secrets.json");
    writeFileSync(file, '{"openai": sk-live-SUPERSECRET}');
    const resolve = createCredentialResolver({ env: {}, file });
    const err = await failure(resolve("openai", UPSTREAM));
    expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
    expect(err.message).not.toContain("SUPERSECRET");
    writeFileSync(file, JSON.stringify({ openai: { value: "sk-live-SUPERSECRET", baseUrls: [UPSTREAM] } }));
    expect(await resolve("openai", UPSTREAM)).toBe("sk-live-SUPERSECRET");
  });
});
