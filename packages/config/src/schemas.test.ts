import { describe, expect, it } from "vitest";
import { ConfigError, parseConfig } from "./parse.ts";
import { CliConfig, DispatcherConfig, JanitorConfig, WorkerConfig } from "./schemas.ts";
import { parseWorkerConfig } from "./worker.ts";

function errorOf(fn: () => unknown): ConfigError {
  try {
    fn();
  } catch (err) {
    if (err instanceof ConfigError) return err;
    throw err;
  }
  throw new Error("expected a ConfigError");
}

describe("DispatcherConfig", () => {
  it("applies every default on an empty environment", () => {
    expect(parseConfig(DispatcherConfig, {})).toEqual({
      redisUrl: "redis://127.0.0.1:6379",
      prefix: "{fleet}",
      logLevel: "info",
      shutdownTimeoutMs: 30_000,
      resultTtlMs: 7 * 24 * 3600 * 1000,
      acceptRedisWriteLoss: false,
      redisTlsCaFile: null,
      redisTlsCertFile: null,
      redisTlsKeyFile: null,
      redisTlsKeyPassphraseFile: null,
      redisTlsReloadMs: 60000,
      httpPort: 8080,
      httpHost: "127.0.0.1",
      apiTokens: { tokens: [], adminTokens: [] },
      maxBacklog: 100_000,
      maxTaskBytes: 10 * 1024 * 1024,
      maxBodyBytes: 32 * 1024 * 1024,
      maxJsonBatchBytes: 2 * 1024 * 1024,
      requestTimeoutMs: 300_000,
      sandboxCeiling: {},
    });
  });

  it("reads every variable", () => {
    const cfg = parseConfig(DispatcherConfig, {
      REDIS_URL: "rediss://r.example:6380/2",
      FLEET_PREFIX: "{test-1}",
      FLEET_LOG_LEVEL: "DEBUG",
      FLEET_SHUTDOWN_TIMEOUT_MS: "5000",
      FLEET_RESULT_TTL_S: "0",
      FLEET_REDIS_ACCEPT_WRITE_LOSS: "true",
      FLEET_REDIS_TLS_CA_FILE: " /etc/fleet/redis-ca.pem ",
      FLEET_REDIS_TLS_CERT_FILE: "/etc/fleet/client.pem",
      FLEET_REDIS_TLS_KEY_FILE: "/etc/fleet/client.key",
      FLEET_HTTP_PORT: "0",
      FLEET_HTTP_HOST: "0.0.0.0",
      FLEET_API_TOKENS: " t1 , admin:boss,,t1 ",
      FLEET_MAX_BACKLOG: "10",
      FLEET_MAX_TASK_BYTES: "2048",
      FLEET_MAX_BODY_BYTES: "65536",
      FLEET_MAX_JSON_BATCH_BYTES: "4096",
      FLEET_HTTP_REQUEST_TIMEOUT_MS: "45000",
      FLEET_SANDBOX_MAX_MEMORY_MB: "4096",
    });
    expect(cfg).toEqual({
      redisUrl: "rediss://r.example:6380/2",
      prefix: "{test-1}",
      logLevel: "debug",
      shutdownTimeoutMs: 5000,
      resultTtlMs: 0,
      acceptRedisWriteLoss: true,
      redisTlsCaFile: "/etc/fleet/redis-ca.pem",
      redisTlsCertFile: "/etc/fleet/client.pem",
      redisTlsKeyFile: "/etc/fleet/client.key",
      redisTlsKeyPassphraseFile: null,
      redisTlsReloadMs: 60000,
      httpPort: 0,
      httpHost: "0.0.0.0",
      apiTokens: { tokens: ["t1", "boss"], adminTokens: ["boss"] },
      maxBacklog: 10,
      maxTaskBytes: 2048,
      maxBodyBytes: 65536,
      maxJsonBatchBytes: 4096,
      requestTimeoutMs: 45_000,
      sandboxCeiling: { memoryMb: 4096 },
    });
  });

  it("FLEET_MAX_BODY_BYTES unset follows a raised FLEET_MAX_TASK_BYTES (a task within its limit is not refused as too large a body)", () => {
    const MiB = 1024 * 1024;
    expect(parseConfig(DispatcherConfig, {}).maxBodyBytes).toBe(32 * MiB);
    expect(parseConfig(DispatcherConfig, { FLEET_MAX_TASK_BYTES: String(64 * MiB) }).maxBodyBytes).toBe(
      65 * MiB,
    );
    // Set, it is what it says.
    expect(
      parseConfig(DispatcherConfig, { FLEET_MAX_TASK_BYTES: String(64 * MiB), FLEET_MAX_BODY_BYTES: "65536" })
        .maxBodyBytes,
    ).toBe(65536);
  });

  it("FLEET_RESULT_TTL_S is 0 or at least two days", () => {
    expect(parseConfig(DispatcherConfig, { FLEET_RESULT_TTL_S: "172800" }).resultTtlMs).toBe(172_800_000);
    expect(() => parseConfig(DispatcherConfig, { FLEET_RESULT_TTL_S: "3600" })).toThrow(
      /FLEET_RESULT_TTL_S: must be 0 \(keep for good\) or at least 172800/,
    );
  });

  it("FLEET_PREFIX starts with a hash tag in braces (one Redis Cluster slot), said with the variable's name", () => {
    expect(parseConfig(DispatcherConfig, { FLEET_PREFIX: "{eval}:run2" }).prefix).toBe("{eval}:run2");
    for (const bad of ["walk", "eval{x}", "{}x"]) {
      expect(() => parseConfig(WorkerConfig, { FLEET_PREFIX: bad })).toThrow(
        /FLEET_PREFIX: must start with a hash tag in braces/,
      );
    }
  });

  it("FLEET_TOKEN (the CLI's) must be printable ASCII without spaces: it goes into an HTTP header", () => {
    expect(parseConfig(CliConfig, { FLEET_TOKEN: " tok-1 " }).token).toBe("tok-1");
    expect(() => parseConfig(CliConfig, { FLEET_TOKEN: "tok€" })).toThrow(
      /FLEET_TOKEN: must be printable ASCII/,
    );
  });

  it("treats empty values as unset", () => {
    expect(parseConfig(DispatcherConfig, { FLEET_HTTP_PORT: "", REDIS_URL: "  " }).httpPort).toBe(8080);
  });

  it.each([
    ["redis-sentinel://s1:26379,s2:26379/mymaster", true],
    ["redis-sentinel://u:pw@s1/mymaster/2", true],
    ["redis-sentinel://s1:26379", false], // no master named
    ["redis-sentinel://s1:26379/m/x", false], // a database that is not a number
    ["redis-sentinel://s1:26379/m?db=1", false],
    ["redis-sentinel://u:pw@s1/m/2?sentinelPassword=s%2Fp&sentinelUsername=w", true],
    ["redis-sentinel://s1/m?sentinelPassword=a&sentinelPassword=b", false], // twice
    ["redis-sentinel://s1/m?sentinelPassword=%zz", false],
    ["redis-sentinel://s1/m?", false],
    ["redis-sentinel://s1/m?sentinelPassword=p@ss", false], // a raw @ in the query (%40)
    ["redis-sentinel://s1/m?sentinelPassword=p%40ss", true],
    ["redis-sentinel://s1:26379/m%zz", false], // a name that does not decode
    ["rediss-sentinel://s1:26379,s2:26379/mymaster", true], // TLS
    ["rediss-sentinel://u:pw@s1/m/2?sentinelPassword=p%40ss", true],
    ["rediss-sentinel://s1:26379", false],
    ["redisss-sentinel://s1:26379/m", false],
    ["redis-sentinel://s1:/m", false], // a `:` without a port (the queue's parser refuses it at start)
    ["redis-sentinel://[::1]:26379,s2/m", true],
  ])("REDIS_URL %s: accepted %s", (url, ok) => {
    const parsed = () => parseConfig(DispatcherConfig, { REDIS_URL: url });
    if (ok) expect(parsed().redisUrl).toBe(url);
    else expect(errorOf(parsed).message).toContain("or redis-sentinel://host:port,host:port/mastername");
  });

  it("refuses FLEET_REDIS_TLS_CA_FILE with a REDIS_URL that speaks no TLS (plain TCP without a word), in every app", () => {
    const ca = "/etc/fleet/redis-ca.pem";
    for (const url of ["redis://r:6379", "redis-cluster://a:1,b:2", "redis-sentinel://s:26379/m"]) {
      const env = { REDIS_URL: url, FLEET_REDIS_TLS_CA_FILE: ca };
      for (const parse of [
        () => parseConfig(DispatcherConfig, env),
        () => parseConfig(JanitorConfig, env),
        () => parseWorkerConfig("agent", env),
      ]) {
        expect(errorOf(parse).message, url).toMatch(
          /FLEET_REDIS_TLS_CA_FILE: is set, but REDIS_URL speaks no TLS: use rediss:\/\//,
        );
      }
    }
    for (const url of [
      "rediss://r:6380",
      "REDISS://r:6380",
      "rediss-cluster://a:1,b:2",
      "rediss-sentinel://s/m",
    ]) {
      expect(
        parseConfig(DispatcherConfig, { REDIS_URL: url, FLEET_REDIS_TLS_CA_FILE: ca }).redisTlsCaFile,
      ).toBe(ca);
    }
    // A client certificate and key likewise; and each needs the other.
    const plainMtls = {
      REDIS_URL: "redis://r",
      FLEET_REDIS_TLS_CERT_FILE: "/c",
      FLEET_REDIS_TLS_KEY_FILE: "/k",
    };
    expect(errorOf(() => parseConfig(DispatcherConfig, plainMtls)).message).toMatch(
      /FLEET_REDIS_TLS_CERT_FILE: is set, but REDIS_URL speaks no TLS.*FLEET_REDIS_TLS_KEY_FILE: is set/s,
    );
    for (const [env, missing] of [
      [{ FLEET_REDIS_TLS_CERT_FILE: "/c" }, "FLEET_REDIS_TLS_KEY_FILE"],
      [{ FLEET_REDIS_TLS_KEY_FILE: "/k" }, "FLEET_REDIS_TLS_CERT_FILE"],
    ] as const) {
      expect(
        errorOf(() => parseWorkerConfig("verifier", { REDIS_URL: "rediss://r", ...env })).message,
      ).toContain(`${missing}: must be set with the other`);
    }
    expect(
      parseConfig(JanitorConfig, {
        REDIS_URL: "rediss://r",
        FLEET_REDIS_TLS_CERT_FILE: "/c",
        FLEET_REDIS_TLS_KEY_FILE: "/k",
      }),
    ).toMatchObject({
      redisTlsCertFile: "/c",
      redisTlsKeyFile: "/k",
      redisTlsCaFile: null,
      redisTlsKeyPassphraseFile: null,
    });
    // An encrypted key's passphrase file: with the key, over TLS; never alone, never over plain TCP.
    expect(
      parseConfig(JanitorConfig, {
        REDIS_URL: "rediss://r",
        FLEET_REDIS_TLS_CERT_FILE: "/c",
        FLEET_REDIS_TLS_KEY_FILE: "/k",
        FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: "/p",
      }).redisTlsKeyPassphraseFile,
    ).toBe("/p");
    expect(
      errorOf(() =>
        parseWorkerConfig("agent", { REDIS_URL: "rediss://r", FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: "/p" }),
      ).message,
    ).toContain(
      "FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: is set without FLEET_REDIS_TLS_KEY_FILE, the encrypted key it opens",
    );
    expect(
      errorOf(() =>
        parseConfig(DispatcherConfig, { ...plainMtls, FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: "/p" }),
      ).message,
    ).toContain("FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: is set, but REDIS_URL speaks no TLS");
    // Unset (or empty) with a plain URL: nothing to say.
    expect(
      parseConfig(JanitorConfig, { REDIS_URL: "redis://r", FLEET_REDIS_TLS_CA_FILE: "" }).redisTlsCaFile,
    ).toBeNull();
  });

  it("names every bad variable in one error", () => {
    const err = errorOf(() =>
      parseConfig(DispatcherConfig, {
        REDIS_URL: "http://nope",
        FLEET_HTTP_PORT: "80a",
        FLEET_MAX_BACKLOG: "0",
        FLEET_LOG_LEVEL: "loud",
        FLEET_API_TOKENS: "admin:,secret-value",
      }),
    );
    expect(err.name).toBe("ConfigError");
    expect(err.issues.map((i) => i.variable).sort()).toEqual(
      ["FLEET_API_TOKENS", "FLEET_HTTP_PORT", "FLEET_LOG_LEVEL", "FLEET_MAX_BACKLOG", "REDIS_URL"].sort(),
    );
    expect(err.message).toContain('FLEET_HTTP_PORT: must be a port number from 0 to 65535 (got "80a")');
    expect(err.message).toContain("REDIS_URL: must be a URL starting with redis:// or rediss://");
    expect(err.message).toContain("FLEET_API_TOKENS: has an empty token after 'admin:' (value hidden)");
    expect(err.message).not.toContain("secret-value");
  });

  it("refuses a FLEET_API_TOKENS set to commas only (auth would be off); unset or empty stays auth off", () => {
    // ",": e.g. `$A,$B` with both unset.
    for (const bad of [",", " , ", ",,", " ,\t, "]) {
      const err = errorOf(() => parseConfig(DispatcherConfig, { FLEET_API_TOKENS: bad }));
      expect(err.issues).toEqual([
        { variable: "FLEET_API_TOKENS", message: expect.stringContaining("no token") },
      ]);
      expect(err.message).toContain("FLEET_API_TOKENS: is set but holds no token");
      expect(err.message).toContain("(value hidden)");
    }
    for (const off of [undefined, "", "  "]) {
      expect(parseConfig(DispatcherConfig, { FLEET_API_TOKENS: off }).apiTokens).toEqual({
        tokens: [],
        adminTokens: [],
      });
    }
    // Empty entries beside a real token are skipped, as before.
    expect(parseConfig(DispatcherConfig, { FLEET_API_TOKENS: ",a," }).apiTokens.tokens).toEqual(["a"]);
  });

  it("refuses a FLEET_API_TOKENS token no client can send: characters beyond printable ASCII", () => {
    // The CLI refuses such a --token/FLEET_TOKEN, and a header carries no UTF-8 (curl's bytes are
    // read back as latin1): every request with it would be a 401.
    for (const [bad, secret] of [
      ["a1,pässwört", "pässwört"],
      ["admin:t€ken", "t€ken"],
      ["s3cret\u0001", "s3cret"],
    ] as const) {
      const err = errorOf(() => parseConfig(DispatcherConfig, { FLEET_API_TOKENS: bad }));
      expect(err.issues).toEqual([
        { variable: "FLEET_API_TOKENS", message: expect.stringContaining("printable ASCII") },
      ]);
      expect(err.message).toContain("(value hidden)");
      expect(err.message).not.toContain(secret);
    }
    expect(parseConfig(DispatcherConfig, { FLEET_API_TOKENS: "a~!Z9,admin:{x}" }).apiTokens.tokens).toEqual([
      "a~!Z9",
      "{x}",
    ]);
  });

  it("hides the userinfo of a bad REDIS_URL, even one that does not parse", () => {
    const cases = [
      ["redis://:s3cr#t@redis:6379", "s3cr", "redis://***@redis:6379"],
      ["redis://admin:pa/ss?w0rd@redis:6379/0", "w0rd", "redis://***@redis:6379/0"],
      ["http://user:hunter2@redis:6379", "hunter2", "http://***@redis:6379"],
      [`redis://:${"x".repeat(100)}#@redis:6379`, "xxx", "redis://***@redis:6379"],
      ["redis-sentinel://s1/m?sentinelPassword=hunter2&x=1", "hunter2", "redis-sentinel://s1/m?***"],
      ["redis-sentinel://u:pw1@s1/m?sentinelPassword=hunter2&", "hunter2", "redis-sentinel://***@s1/m?***"],
      ["redis-sentinel://s1/m?sentinelPassword=hunt@er2", "er2", "redis-sentinel://***"],
      ["http://redis:6379/#s3cr3t", "s3cr3t", "http://redis:6379/#***"],
      ["http://u:p@redis:6379/0#s3cr3t?x", "s3cr3t", "http://***@redis:6379/0#***"],
    ] as const;
    for (const [url, secret, shown] of cases) {
      const err = errorOf(() => parseConfig(DispatcherConfig, { REDIS_URL: url }));
      expect(err.message).toContain("REDIS_URL: must be a URL starting with redis:// or rediss://");
      expect(err.message).toContain(`(got "${shown}")`);
      expect(err.message).not.toContain(secret);
    }
    // Without `//` (URL parsers read these as `scheme://u:p@host`), or with no scheme at all:
    // refused for whatever reason, the password is not echoed.
    for (const [url, secret, shown] of [
      ["redis:/default:s3cr3t@127.0.0.1:6379", "s3cr3t", "redis:/***@127.0.0.1:6379"],
      ["rediss:default:s3cr3t@127.0.0.1:6379", "s3cr3t", "rediss:***@127.0.0.1:6379"],
      ["redis:\\\\default:s3cr3t@127.0.0.1:6379", "s3cr3t", "redis:\\\\***@127.0.0.1:6379"],
      ["default:s3cr3t@127.0.0.1:6379", "s3cr3t", "***@127.0.0.1:6379"],
      [":s3cr3t@127.0.0.1:6379", "s3cr3t", "***@127.0.0.1:6379"],
      // A password in the query (ioredis reads one there), without `//` or a scheme.
      ["redis:/h:6379/0?password=s3cr3t", "s3cr3t", "redis:/h:6379/0?***"],
      ["h:6379?password=s3cr3t", "s3cr3t", "h:6379?***"],
      ["localhost?password=s3cr3t", "s3cr3t", "localhost?***"],
      ["10.0.0.5/0?password=s3cr3t", "s3cr3t", "10.0.0.5/0?***"],
      // A `://` inside the password is no scheme's.
      ["redis:/h?password=s3://cr3t", "cr3t", "redis:/h?***"],
    ] as const) {
      const err = errorOf(() => parseConfig(DispatcherConfig, { REDIS_URL: url }));
      expect(err.message, url).toContain(`REDIS_URL: must`);
      expect(err.message, url).toContain(`(got ${JSON.stringify(shown)})`);
      expect(err.message, url).not.toContain(secret);
    }
    // A value with an `@` but no `user:pass` before it is shown as it is.
    for (const [variable, value] of [["FLEET_PREFIX", "fleet@staging"]] as const) {
      const err = errorOf(() => parseConfig(DispatcherConfig, { [variable]: value }));
      expect(err.message, value).toContain(`(got ${JSON.stringify(value)})`);
    }
  });

  it("refuses a REDIS_URL whose database is not a number (the apps crashed on it with a stack trace)", () => {
    for (const url of [
      "redis://redis:6379/x",
      "redis://redis:6379/1/2",
      "rediss://redis:6379?db=x",
      "redis://redis:6379/-1",
    ]) {
      const err = errorOf(() => parseConfig(DispatcherConfig, { REDIS_URL: url }));
      expect(
        err.issues.map((i) => i.variable),
        url,
      ).toEqual(["REDIS_URL"]);
      expect(err.message).toContain("database");
    }
    for (const url of [
      "redis://redis:6379",
      "redis://redis:6379/",
      "redis://redis:6379/3",
      "redis://redis?db=2",
    ]) {
      expect(parseConfig(DispatcherConfig, { REDIS_URL: url }).redisUrl, url).toBe(url);
    }
  });

  it("rejects ports out of range and non-decimal numbers", () => {
    for (const bad of ["65536", "-1", "1e3", "0x50", "8080.5"]) {
      expect(errorOf(() => parseConfig(DispatcherConfig, { FLEET_HTTP_PORT: bad })).message).toContain(
        "FLEET_HTTP_PORT",
      );
    }
  });
});

describe("WorkerConfig", () => {
  it("defaults per kind and leaves metrics off unless a port is set", () => {
    const cfg = parseWorkerConfig("agent", {});
    expect(cfg).toMatchObject({
      kind: "agent",
      workerId: null,
      sandboxProvider: "docker",
      dockerHost: null,
      dockerCertPath: null,
      metricsPort: null,
      metricsHost: "127.0.0.1",
      concurrency: 8,
      credentialsFile: null,
      gatewaySubnetPool: null,
      gatewayMaxCallsPerMinute: 120,
      shutdownTimeoutMs: 30_000,
      providerProbeMs: 2_000,
    });
  });

  it("turns the provider breaker off, or probes at another interval", () => {
    expect(parseWorkerConfig("resources", {}).providerProbeMs).toBe(2_000);
    expect(parseWorkerConfig("agent", { FLEET_PROVIDER_BREAKER: "false" }).providerProbeMs).toBeNull();
    expect(parseWorkerConfig("agent", { FLEET_PROVIDER_PROBE_MS: "500" }).providerProbeMs).toBe(500);
    expect(() => parseWorkerConfig("agent", { FLEET_PROVIDER_PROBE_MS: "10" })).toThrow(
      /FLEET_PROVIDER_PROBE_MS/,
    );
  });

  it("lists the model endpoints a tool-loop agent without a credential may call, or none (any)", () => {
    expect(parseWorkerConfig("agent", {}).modelBaseUrls).toBeNull();
    expect(
      parseWorkerConfig("agent", {
        FLEET_MODEL_BASE_URLS: " http://vllm:8000/v1 , https://api.example.test/v1,",
      }).modelBaseUrls,
    ).toEqual(["http://vllm:8000/v1", "https://api.example.test/v1"]);
    // A URL of another scheme (a typo of http) could never match a model's baseUrl: every such
    // rollout would fail, where the variable's error says what is wrong at start.
    for (const bad of ["not a url", " , ", "htp://vllm:8000/v1", "http://vllm:8000/v1,file:///etc/passwd"]) {
      expect(() => parseWorkerConfig("agent", { FLEET_MODEL_BASE_URLS: bad }), bad).toThrow(
        /FLEET_MODEL_BASE_URLS/,
      );
    }
  });

  it("bounds the rollouts seeded ahead at 16 by default, another number, or not at all (0)", () => {
    expect(parseWorkerConfig("resources", {}).seedAhead).toBe(16);
    expect(parseWorkerConfig("resources", { FLEET_SEED_AHEAD: "64" }).seedAhead).toBe(64);
    expect(parseWorkerConfig("resources", { FLEET_SEED_AHEAD: "0" }).seedAhead).toBeNull();
    expect(() => parseWorkerConfig("resources", { FLEET_SEED_AHEAD: "-1" })).toThrow(/FLEET_SEED_AHEAD/);
  });

  it("reads worker variables; the app's kind wins over the environment's", () => {
    const cfg = parseWorkerConfig("verifier", {
      FLEET_WORKER_KIND: "agent",
      FLEET_SANDBOX_PROVIDER: "bubblewrap",
      FLEET_BWRAP_ROOTFS: "/srv/rootfs",
      DOCKER_HOST: "tcp://10.0.0.2:2376",
      DOCKER_CERT_PATH: "/certs",
      FLEET_METRICS_PORT: "9464",
      FLEET_METRICS_HOST: "0.0.0.0",
      FLEET_CONCURRENCY: "3",
      FLEET_ALLOW_HOST_EXECUTION: "No",
      FLEET_CREDENTIALS_FILE: "/run/secrets/fleet.json",
      FLEET_WORKER_ID: "verifier-7",
    });
    expect(cfg).toMatchObject({
      kind: "verifier",
      sandboxProvider: "bubblewrap",
      dockerHost: "tcp://10.0.0.2:2376",
      dockerCertPath: "/certs",
      metricsPort: 9464,
      metricsHost: "0.0.0.0",
      concurrency: 3,
      credentialsFile: "/run/secrets/fleet.json",
      workerId: "verifier-7",
    });
  });

  it("reads the sandbox ceiling (FLEET_SANDBOX_MAX_*) alike in workers and the dispatcher: none by default, never below the sandbox default", () => {
    const env = {
      FLEET_SANDBOX_MAX_MEMORY_MB: "8192",
      FLEET_SANDBOX_MAX_CPUS: "2.5",
      FLEET_SANDBOX_MAX_PIDS: "1024",
      FLEET_SANDBOX_MAX_DISK_MB: "4096",
      FLEET_SANDBOX_MAX_TMPFS_MB: "512",
    };
    const ceiling = { memoryMb: 8192, cpus: 2.5, pidsLimit: 1024, diskMb: 4096, tmpfsMb: 512 };
    for (const parse of [
      (e: Record<string, string>) => parseWorkerConfig("resources", e),
      (e: Record<string, string>) => parseConfig(DispatcherConfig, e),
    ]) {
      expect(parse({}).sandboxCeiling).toEqual({});
      expect(parse(env).sandboxCeiling).toEqual(ceiling);
      expect(parse({ FLEET_SANDBOX_MAX_CPUS: "1" }).sandboxCeiling).toEqual({ cpus: 1 });
      // Below what a task asking nothing gets (every sandbox would be over it), or not a number.
      const low = errorOf(() =>
        parse({ FLEET_SANDBOX_MAX_MEMORY_MB: "512", FLEET_SANDBOX_MAX_CPUS: "lots" }),
      );
      expect(low.issues.map((i) => i.variable)).toEqual([
        "FLEET_SANDBOX_MAX_MEMORY_MB",
        "FLEET_SANDBOX_MAX_CPUS",
      ]);
      expect(low.message).toContain(
        "FLEET_SANDBOX_MAX_MEMORY_MB: must be a whole number from 1024 (the sandbox default, which a task asking nothing gets) to 65536",
      );
      expect(low.message).toContain("FLEET_SANDBOX_MAX_CPUS: must be a number from 1 (the sandbox default");
      expect(() => parse({ FLEET_SANDBOX_MAX_PIDS: "2.5" })).toThrow(
        /FLEET_SANDBOX_MAX_PIDS: must be a whole number/,
      );
    }
  });

  it("refuses bubblewrap without FLEET_BWRAP_ROOTFS, in workers and the janitor, naming the variable", () => {
    for (const parse of [
      (env: Record<string, string>) => parseWorkerConfig("agent", env),
      (env: Record<string, string>) => parseConfig(JanitorConfig, env),
    ]) {
      const err = errorOf(() => parse({ FLEET_SANDBOX_PROVIDER: "bubblewrap", FLEET_BWRAP_ROOTFS: " " }));
      expect(err.issues.map((i) => i.variable)).toEqual(["FLEET_BWRAP_ROOTFS"]);
      expect(err.message).toMatch(/FLEET_BWRAP_ROOTFS: must be set with FLEET_SANDBOX_PROVIDER=bubblewrap/);
      expect(
        parse({ FLEET_SANDBOX_PROVIDER: "bubblewrap", FLEET_BWRAP_ROOTFS: "/srv/rootfs" }),
      ).toMatchObject({
        bwrapRootfs: "/srv/rootfs",
      });
    }
  });

  it("reads the gateway's calls per minute, and refuses one that is not a positive integer", () => {
    expect(
      parseWorkerConfig("agent", { FLEET_GATEWAY_MAX_CALLS_PER_MINUTE: "600" }).gatewayMaxCallsPerMinute,
    ).toBe(600);
    for (const bad of ["0", "-1", "1.5", "lots"]) {
      expect(() => parseWorkerConfig("agent", { FLEET_GATEWAY_MAX_CALLS_PER_MINUTE: bad }), bad).toThrow(
        /FLEET_GATEWAY_MAX_CALLS_PER_MINUTE/,
      );
    }
  });

  it("reads a gateway subnet pool, and refuses one that is not an IPv4 CIDR or is smaller than its networks", () => {
    expect(
      parseWorkerConfig("agent", { FLEET_GATEWAY_SUBNET_POOL: "10.213.0.0/16" }).gatewaySubnetPool,
    ).toEqual({
      base: "10.213.0.0/16",
      prefix: 28,
    });
    expect(
      parseWorkerConfig("agent", {
        FLEET_GATEWAY_SUBNET_POOL: "10.9.0.0/20",
        FLEET_GATEWAY_SUBNET_PREFIX: "26",
      }).gatewaySubnetPool,
    ).toEqual({ base: "10.9.0.0/20", prefix: 26 });
    for (const [pool, variable] of [
      ["10.213.0.0", "FLEET_GATEWAY_SUBNET_POOL"],
      ["10.213.0.300/16", "FLEET_GATEWAY_SUBNET_POOL"],
      ["10.0.0.0/4", "FLEET_GATEWAY_SUBNET_POOL"],
      // Not also "FLEET_GATEWAY_SUBNET_PREFIX: must be at least the pool's own /31".
      ["10.213.0.0/31", "FLEET_GATEWAY_SUBNET_POOL"],
      // A /30 holds no network of the longest prefix (/29): the pool's error, not a prefix it cannot take.
      ["10.213.0.0/30", "FLEET_GATEWAY_SUBNET_POOL"],
      ["10.213.0.0/29", "FLEET_GATEWAY_SUBNET_PREFIX"],
    ] as const) {
      const err = errorOf(() => parseWorkerConfig("agent", { FLEET_GATEWAY_SUBNET_POOL: pool }));
      expect(
        err.issues.map((i) => i.variable),
        pool,
      ).toEqual([variable]);
    }
  });

  it("takes an empty DOCKER_HOST or DOCKER_CERT_PATH as unset", () => {
    expect(parseWorkerConfig("agent", { DOCKER_HOST: "", DOCKER_CERT_PATH: " " })).toMatchObject({
      dockerHost: null,
      dockerCertPath: null,
    });
  });

  it("refuses FLEET_ALLOW_HOST_EXECUTION=true (there is no host execution: no host fallback, DESIGN §2 rule 4), naming the variable", () => {
    for (const value of ["true", "1", "YES", "on"]) {
      const err = errorOf(() => parseWorkerConfig("agent", { FLEET_ALLOW_HOST_EXECUTION: value }));
      expect(
        err.issues.map((i) => i.variable),
        value,
      ).toEqual(["FLEET_ALLOW_HOST_EXECUTION"]);
      expect(err.message).toContain(
        "FLEET_ALLOW_HOST_EXECUTION: must be false: this build has no host execution",
      );
    }
    for (const value of ["false", "0", "no", "off", ""]) {
      expect(() => parseWorkerConfig("agent", { FLEET_ALLOW_HOST_EXECUTION: value }), value).not.toThrow();
    }
  });

  it("accepts metrics port 0 (a free port)", () => {
    expect(parseWorkerConfig("resources", { FLEET_METRICS_PORT: "0" }).metricsPort).toBe(0);
  });

  it("rejects an unknown provider, a bad boolean and zero concurrency", () => {
    const err = errorOf(() =>
      parseWorkerConfig("agent", {
        FLEET_SANDBOX_PROVIDER: "podman",
        FLEET_ALLOW_HOST_EXECUTION: "maybe",
        FLEET_CONCURRENCY: "0",
      }),
    );
    expect(err.issues.map((i) => i.variable).sort()).toEqual([
      "FLEET_ALLOW_HOST_EXECUTION",
      "FLEET_CONCURRENCY",
      "FLEET_SANDBOX_PROVIDER",
    ]);
    expect(err.message).toContain("FLEET_ALLOW_HOST_EXECUTION: must be true or false");
    expect(err.message).toContain('FLEET_SANDBOX_PROVIDER: must be one of docker, bubblewrap (got "podman")');
  });

  it("refuses a lock duration or stalled interval under 1000 ms (seconds typed as ms)", () => {
    expect(parseWorkerConfig("agent", {})).toMatchObject({
      lockDurationMs: 30_000,
      stalledIntervalMs: 15_000,
    });
    const err = errorOf(() =>
      parseWorkerConfig("agent", { FLEET_LOCK_DURATION_MS: "30", FLEET_STALLED_INTERVAL_MS: "999" }),
    );
    expect(err.issues.map((i) => i.variable).sort()).toEqual([
      "FLEET_LOCK_DURATION_MS",
      "FLEET_STALLED_INTERVAL_MS",
    ]);
    expect(err.message).toContain(
      'FLEET_LOCK_DURATION_MS: must be a whole number of milliseconds from 1000 to 2147483647 (got "30")',
    );
    expect(err.message).toContain(
      'FLEET_STALLED_INTERVAL_MS: must be a whole number of milliseconds from 1000 to 2147483647 (got "999")',
    );
    expect(
      parseWorkerConfig("agent", { FLEET_LOCK_DURATION_MS: "1000", FLEET_STALLED_INTERVAL_MS: "1000" }),
    ).toMatchObject({ lockDurationMs: 1000, stalledIntervalMs: 1000 });
  });

  it("needs a kind when parsed directly", () => {
    expect(errorOf(() => parseConfig(WorkerConfig, {})).message).toContain(
      "FLEET_WORKER_KIND: must be set (resources, agent or verifier)",
    );
    expect(parseConfig(WorkerConfig, { FLEET_WORKER_KIND: "resources" }).kind).toBe("resources");
  });
});

describe("JanitorConfig", () => {
  it("has interval and grace defaults", () => {
    expect(parseConfig(JanitorConfig, {})).toMatchObject({ intervalMs: 10_000, orphanGraceMs: 120_000 });
  });

  it("requires durations to be positive, finite and within a timer's range", () => {
    for (const bad of ["0", "-5", "Infinity", "NaN", "2147483648", "1.5"]) {
      const err = errorOf(() => parseConfig(JanitorConfig, { FLEET_ORPHAN_GRACE_MS: bad }));
      expect(err.issues).toEqual([
        { variable: "FLEET_ORPHAN_GRACE_MS", message: expect.stringContaining("positive whole number") },
      ]);
    }
    expect(parseConfig(JanitorConfig, { FLEET_ORPHAN_GRACE_MS: "1" }).orphanGraceMs).toBe(1);
    expect(parseConfig(JanitorConfig, { FLEET_ORPHAN_GRACE_MS: "2147483647" }).orphanGraceMs).toBe(
      2147483647,
    );
  });

  it("refuses a janitor interval under 100 ms", () => {
    for (const bad of ["0", "1", "99"]) {
      expect(errorOf(() => parseConfig(JanitorConfig, { FLEET_JANITOR_INTERVAL_MS: bad })).message).toContain(
        `FLEET_JANITOR_INTERVAL_MS: must be a whole number of milliseconds from 100 to 2147483647 (got "${bad}")`,
      );
    }
    expect(parseConfig(JanitorConfig, { FLEET_JANITOR_INTERVAL_MS: "100" }).intervalMs).toBe(100);
  });

  it("starts whatever the workers' own sandbox variables say (FLEET_SANDBOX_MAX_*, FLEET_PROVIDER_WAIT_MS): it reads none of them, and the workers refuse a bad one", () => {
    // One environment file for the whole fleet: a bad worker-only value is the workers' error.
    const workersOnly = {
      FLEET_SANDBOX_MAX_MEMORY_MB: "512",
      FLEET_SANDBOX_MAX_CPUS: "lots",
      FLEET_SANDBOX_MAX_PIDS: "2.5",
      FLEET_SANDBOX_MAX_DISK_MB: "-1",
      FLEET_SANDBOX_MAX_TMPFS_MB: "0",
      FLEET_PROVIDER_WAIT_MS: "0",
    };
    const janitor = parseConfig(JanitorConfig, workersOnly);
    expect(janitor).toEqual(parseConfig(JanitorConfig, {}));
    expect(janitor).not.toHaveProperty("sandboxCeiling");
    expect(janitor).not.toHaveProperty("providerWaitMs");
    expect(errorOf(() => parseWorkerConfig("resources", workersOnly)).issues.map((i) => i.variable)).toEqual(
      Object.keys(workersOnly),
    );
    // What it does read of the sandbox provider's is still checked.
    expect(errorOf(() => parseConfig(JanitorConfig, { FLEET_SANDBOX_PROVIDER: "podman" })).message).toContain(
      "FLEET_SANDBOX_PROVIDER: must be one of docker, bubblewrap",
    );
  });
});

describe("CliConfig", () => {
  it("defaults to the local dispatcher without a token", () => {
    expect(parseConfig(CliConfig, {})).toEqual({ url: "http://127.0.0.1:8080", token: null });
  });

  it("reads FLEET_URL and FLEET_TOKEN, and hides the token in errors", () => {
    expect(parseConfig(CliConfig, { FLEET_URL: "https://fleet.example/", FLEET_TOKEN: "abc" })).toEqual({
      url: "https://fleet.example",
      token: "abc",
    });
    const err = errorOf(() => parseConfig(CliConfig, { FLEET_URL: "ftp://x" }));
    expect(err.message).toContain("FLEET_URL: must be a URL starting with http:// or https://");
  });

  it("refuses a FLEET_URL on a port fetch never connects to (the Fetch standard's bad ports)", () => {
    for (const url of ["http://127.0.0.1:6000", "https://fleet.example:6667/", "http://h:10080"]) {
      const err = errorOf(() => parseConfig(CliConfig, { FLEET_URL: url }));
      expect(err.message).toContain("FLEET_URL: names a port that fetch and browsers refuse to connect to");
    }
    // The scheme's default port (an empty one) and ports next to bad ones are fine.
    for (const url of ["http://h", "https://h:443", "http://h:6001", "http://h:8080"]) {
      expect(parseConfig(CliConfig, { FLEET_URL: url }).url).toBe(url);
    }
  });

  it("refuses a FLEET_URL with credentials (fetch refuses it), a query or a fragment (the API's paths go after it); takes one with a path", () => {
    const creds = errorOf(() => parseConfig(CliConfig, { FLEET_URL: "https://bob:hunter2@fleet.example" }));
    expect(creds.message).toContain("FLEET_URL: must not hold credentials");
    expect(creds.message).not.toContain("hunter2");
    for (const url of ["http://h:8080/?x=1", "http://h:8080/#top", "http://h:8080/api?"]) {
      const err = errorOf(() => parseConfig(CliConfig, { FLEET_URL: url }));
      expect(err.message, url).toContain("FLEET_URL: must not have a query (?…) or a fragment (#…)");
    }
    expect(parseConfig(CliConfig, { FLEET_URL: "https://proxy.example/fleet/" }).url).toBe(
      "https://proxy.example/fleet",
    );
  });

  it("hides the userinfo of a bad FLEET_URL, even one that does not parse", () => {
    for (const [url, shown] of [
      ["https://bob:hun#ter2@fleet.example", "https://***@fleet.example"],
      ["ftp://bob:hunter2@fleet.example/", "ftp://***@fleet.example/"],
    ]) {
      const err = errorOf(() => parseConfig(CliConfig, { FLEET_URL: url }));
      expect(err.message).toContain(
        `FLEET_URL: must be a URL starting with http:// or https:// (got "${shown}")`,
      );
      expect(err.message).not.toContain("ter2");
    }
  });
});
