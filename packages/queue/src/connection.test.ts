import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createSecureContext, type SecureContextOptions } from "node:tls";
import { type Cluster, ReplyError } from "ioredis";
import { describe, expect, it } from "vitest";
import {
  connectionErrorFields,
  connectRedis,
  createAppLogging,
  createRedis,
  parseClusterUrl,
  parseSentinelUrl,
  readRedisTls,
  reconnectOnReadOnly,
  redisTlsSecrets,
  tlsFailureHint,
} from "./connection.ts";
import { encryptTestKey, fleetTlsFiles, makeTestCertificates } from "./testing/tls.ts";

describe("reconnectOnReadOnly", () => {
  it.each([
    ["READONLY You can't write against a read only replica.", 1],
    // Full, loading, a script's error that quotes the word: the same server will answer again.
    ["OOM command not allowed when used memory > 'maxmemory'.", false],
    ["LOADING Redis is loading the dataset in memory", false],
    ["ERR user_script:1: READONLY quoted by a script", false],
  ] as const)("%s → %s", (message, expected) => {
    expect(reconnectOnReadOnly(new ReplyError(message))).toBe(expected);
  });

  it("is createRedis's unless the caller says otherwise", () => {
    const redis = createRedis("redis://127.0.0.1:1", { lazyConnect: true });
    const own = () => 2 as const;
    const overridden = createRedis("redis://127.0.0.1:1", { lazyConnect: true, reconnectOnError: own });
    expect(redis.options.reconnectOnError).toBe(reconnectOnReadOnly);
    // A duplicate (a BullMQ worker's blocking connection) keeps it.
    expect(redis.duplicate().options.reconnectOnError).toBe(reconnectOnReadOnly);
    expect(overridden.options.reconnectOnError).toBe(own);
    redis.disconnect();
    overridden.disconnect();
  });
});

describe("parseSentinelUrl", () => {
  it("takes the sentinels (26379 by default), the master's name, its database and credentials", () => {
    expect(parseSentinelUrl("redis-sentinel://s1,s2:26380/mymaster")).toEqual({
      sentinels: [
        { host: "s1", port: 26379 },
        { host: "s2", port: 26380 },
      ],
      name: "mymaster",
      redisOptions: {},
    });
    expect(parseSentinelUrl("redis-sentinel://u:p%40ss@[::1]:5000/m%20x/3/")).toEqual({
      sentinels: [{ host: "::1", port: 5000 }],
      name: "m x",
      redisOptions: { username: "u", password: "p@ss", db: 3 },
    });
  });

  it("takes a password's `?`, `/` and `@` as they are (the credentials end at the last @), as the cluster URL's parser always did", () => {
    expect(parseSentinelUrl("redis-sentinel://:p?a/s@s@s1/m").redisOptions).toEqual({ password: "p?a/s@s" });
    expect(parseClusterUrl("redis-cluster://:pa?ss@h:1").redisOptions).toEqual({ password: "pa?ss" });
  });

  it.each([
    ["redis-sentinel://u:s3cret@s1/m%zz", /names its master/],
    ["redis-sentinel://u:s3%zzcret@s1/m", /bad %-encoding in the credentials/],
    ["redis-sentinel://u:s3cret@s1:x/m", /bad Redis Sentinel "s1:x"/],
    ["redis-cluster://u:s3cret@a:1?x=1", /takes no database or query/],
  ])("refuses %s, showing no password", (url, why) => {
    const err = (() => {
      try {
        return url.startsWith("redis-cluster") ? parseClusterUrl(url) : parseSentinelUrl(url);
      } catch (e) {
        return e as Error;
      }
    })() as Error;
    expect(err.message).toMatch(why);
    expect(err.message).not.toContain("s3");
    expect(err.message).toContain("***@");
  });

  it.each(["redis-sentinel://s1:26379", "redis-sentinel://s1:26379/", "redis-sentinel://s1:26379/m/x"])(
    "refuses %s: no master named",
    (url) => {
      expect(() => parseSentinelUrl(url)).toThrow(/names its master/);
    },
  );

  it("takes the sentinels' own credentials from the query, %-decoded (a `+` stays a `+`)", () => {
    expect(
      parseSentinelUrl("redis-sentinel://u:p@s1/m/2?sentinelUsername=watch%20er&sentinelPassword=s%26p+x="),
    ).toEqual({
      sentinels: [{ host: "s1", port: 26379 }],
      name: "m",
      redisOptions: { username: "u", password: "p", db: 2 },
      sentinelUsername: "watch er",
      sentinelPassword: "s&p+x=",
    });
    expect(parseSentinelUrl("redis-sentinel://s1/m?sentinelPassword=").sentinelPassword).toBe("");
  });

  it.each([
    ["redis-sentinel://s1/m?db=1", /sets only sentinelUsername and sentinelPassword, each once \(got "db"\)/],
    ["redis-sentinel://s1/m?sentinelPassword=s3cret&sentinelPassword=s3", /each once/],
    ["redis-sentinel://s1/m?sentinelPassword=s3%zz", /bad %-encoding in the sentinelPassword/],
    ["redis-sentinel://s1:x/m?sentinelPassword=s3cret", /bad Redis Sentinel "s1:x"/],
  ])("refuses the query of %s, showing no password", (url, why) => {
    let err: Error | undefined;
    try {
      parseSentinelUrl(url);
    } catch (e) {
      err = e as Error;
    }
    expect(err?.message).toMatch(why);
    expect(err?.message).not.toContain("s3");
    expect(err?.message).toContain("/m?***");
  });

  it.each([
    "redis-sentinel://s1/m?sentinelPassword=p@ss3",
    "redis-sentinel://u:pw@s1/m?sentinelPassword=x@h2:1/m2s3",
    "redis-sentinel://s1/m?sentinelUsername=a@b&sentinelPassword=s3",
  ])(
    "refuses a raw @ in the query of %s (it would pass for the credentials' end), showing nothing past the scheme",
    (url) => {
      let err: Error | undefined;
      try {
        parseSentinelUrl(url);
      } catch (e) {
        err = e as Error;
      }
      expect(err?.message).toBe(
        'write a "@" in a Redis Sentinel URL\'s query as %40: "redis-sentinel://***"',
      );
      expect(parseSentinelUrl(url.replace(/@(?=[^@]*$)/, "%40")).sentinels).toHaveLength(1);
    },
  );

  it("createRedis connects through the sentinels, ready for BullMQ (no retry limit, READONLY reconnects)", () => {
    const redis = createRedis("redis-sentinel://127.0.0.1:1/m", { lazyConnect: true });
    expect(redis.options).toMatchObject({
      sentinels: [{ host: "127.0.0.1", port: 1 }],
      name: "m",
      failoverDetector: true,
      maxRetriesPerRequest: null,
      reconnectOnError: reconnectOnReadOnly,
    });
    expect(redis.duplicate().options).toMatchObject({ name: "m", failoverDetector: true });
    redis.disconnect();
    const authed = createRedis("redis-sentinel://127.0.0.1:1/m?sentinelPassword=sp", { lazyConnect: true });
    expect(authed.options).toMatchObject({ sentinelPassword: "sp" });
    expect(authed.options.password ?? null).toBeNull();
    authed.disconnect();
  });

  it("rediss-sentinel:// speaks TLS to the sentinels and to the master they name; redis-sentinel:// to neither", () => {
    expect(parseSentinelUrl("rediss-sentinel://u:p@s1/m/1?sentinelPassword=sp")).toEqual({
      sentinels: [{ host: "s1", port: 26379 }],
      name: "m",
      redisOptions: { username: "u", password: "p", db: 1, tls: {} },
      sentinelPassword: "sp",
      sentinelTLS: {},
      enableTLSForSentinelMode: true,
    });
    const plain = parseSentinelUrl("redis-sentinel://s1/m");
    expect(plain).not.toHaveProperty("sentinelTLS");
    expect(plain.redisOptions).not.toHaveProperty("tls");
    expect(() => parseSentinelUrl("rediss-sentinel://s1")).toThrow(
      /rediss-sentinel:\/\/host:26379\/mymaster/,
    );
    // A CA given: both sides check against it; a duplicate (a BullMQ worker's) keeps it.
    const redis = createRedis("rediss-sentinel://127.0.0.1:1/m", { lazyConnect: true }, { ca: "PEM" });
    expect(redis.options).toMatchObject({
      tls: { ca: "PEM" },
      sentinelTLS: { ca: "PEM" },
      enableTLSForSentinelMode: true,
    });
    expect(redis.duplicate().options).toMatchObject({ tls: { ca: "PEM" }, sentinelTLS: { ca: "PEM" } });
    redis.disconnect();
    // A client certificate goes to both sides too.
    const mtls = createRedis(
      "rediss-sentinel://127.0.0.1:1/m",
      { lazyConnect: true },
      { cert: "C", key: "K" },
    );
    expect(mtls.options).toMatchObject({
      tls: { cert: "C", key: "K" },
      sentinelTLS: { cert: "C", key: "K" },
    });
    mtls.disconnect();
    // Ignored for a URL without TLS.
    const noTls = createRedis("redis-sentinel://127.0.0.1:1/m", { lazyConnect: true }, { ca: "PEM" });
    expect(noTls.options.tls).toBeUndefined();
    expect(noTls.options.sentinelTLS).toBeUndefined();
    noTls.disconnect();
  });
});

describe("TLS to a standalone Redis or a cluster (a CA of FLEET_REDIS_TLS_CA_FILE)", () => {
  it("rediss:// checks against the CA given, else Node's roots; redis:// never speaks TLS", async () => {
    const withCa = createRedis("rediss://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect(withCa.options.tls).toEqual({ ca: "PEM" });
    withCa.disconnect();
    const roots = createRedis("rediss://127.0.0.1:1", { lazyConnect: true });
    expect(roots.options.tls).toEqual({});
    roots.disconnect();
    // The scheme in capitals is TLS all the same (ioredis alone would speak plain TCP to it).
    const upper = createRedis("REDISS://127.0.0.1:1", { lazyConnect: true });
    expect(upper.options.tls).toEqual({});
    upper.disconnect();
    // A caller's own TLS options win.
    const own = createRedis(
      "rediss://127.0.0.1:1",
      { lazyConnect: true, tls: { servername: "r" } },
      { ca: "PEM" },
    );
    expect(own.options.tls).toEqual({ servername: "r" });
    own.disconnect();
    const plain = createRedis("redis://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect(plain.options.tls).toBeUndefined();
    plain.disconnect();
    const cluster = connectRedis("rediss-cluster://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect((cluster as Cluster).options.redisOptions?.tls).toEqual({ ca: "PEM" });
    // Seed nodes kept by name over TLS (the certificate names them), and so are a duplicate's.
    const lookup = (cluster as Cluster).options.dnsLookup;
    expect(lookup).toBeTypeOf("function");
    const looked = await new Promise((resolve) => lookup!("redis-0.example", (_err, a) => resolve(a)));
    expect(looked).toBe("redis-0.example");
    const dup = (cluster as Cluster).duplicate();
    expect(dup.options.redisOptions?.tls).toEqual({ ca: "PEM" });
    expect(dup.options.dnsLookup).toBe(lookup);
    dup.disconnect();
    cluster.disconnect();
    const plainCluster = connectRedis("redis-cluster://127.0.0.1:1", { lazyConnect: true }, { ca: "PEM" });
    expect((plainCluster as Cluster).options.redisOptions?.tls).toBeUndefined();
    expect((plainCluster as Cluster).options.dnsLookup).not.toBe(lookup);
    plainCluster.disconnect();
  });

  it("readRedisTls reads the TLS files, refusing one it cannot read or that holds no PEM of its kind, naming its variable", () => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-ca-"));
    try {
      const certs = makeTestCertificates(dir);
      const text = (file: string) => readFileSync(file, "utf8");
      const at = (name: string, content: string) => {
        writeFileSync(join(dir, name), content);
        return join(dir, name);
      };
      const none = { redisTlsCaFile: null, redisTlsCertFile: null, redisTlsKeyFile: null };
      expect(readRedisTls({ ...none, redisTlsCaFile: certs.caFile })).toEqual({ ca: certs.ca });
      expect(readRedisTls(none)).toEqual({});
      expect(readRedisTls(fleetTlsFiles(certs, { client: true }))).toEqual({
        ca: certs.ca,
        cert: text(certs.clientCertFile),
        key: text(certs.clientKeyFile),
      });
      // A bundle of CAs, each one read.
      const bundle = at("bundle.pem", certs.ca + text(certs.certFile));
      expect(readRedisTls({ ...none, redisTlsCaFile: bundle }).ca).toBe(text(bundle));
      expect(() => readRedisTls({ ...none, redisTlsCaFile: join(dir, "missing.pem") })).toThrow(
        /^FLEET_REDIS_TLS_CA_FILE: cannot read ".*missing\.pem": ENOENT/,
      );
      expect(() => readRedisTls({ ...none, redisTlsCaFile: certs.clientKeyFile })).toThrow(
        /^FLEET_REDIS_TLS_CA_FILE: ".*client\.key" holds no PEM certificate$/,
      );
      const cut = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
      expect(() => readRedisTls({ ...none, redisTlsCaFile: at("cut.pem", cut) })).toThrow(
        /^FLEET_REDIS_TLS_CA_FILE: ".*cut\.pem": its certificate cannot be read: /,
      );
      expect(() => readRedisTls({ ...none, redisTlsCaFile: at("half.pem", certs.ca + cut) })).toThrow(
        /^FLEET_REDIS_TLS_CA_FILE: ".*half\.pem": certificate 2 of 2 cannot be read: /,
      );
      const client = {
        ...none,
        redisTlsCertFile: certs.clientCertFile,
        redisTlsKeyFile: certs.clientKeyFile,
      };
      expect(() => readRedisTls({ ...client, redisTlsCertFile: certs.clientKeyFile })).toThrow(
        /^FLEET_REDIS_TLS_CERT_FILE: ".*client\.key" holds no PEM certificate$/,
      );
      expect(() => readRedisTls({ ...client, redisTlsKeyFile: certs.caFile })).toThrow(
        /^FLEET_REDIS_TLS_KEY_FILE: ".*ca\.crt" holds no PEM private key$/,
      );
      const badKey = at("bad.key", "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n");
      expect(() => readRedisTls({ ...client, redisTlsKeyFile: badKey })).toThrow(
        /^FLEET_REDIS_TLS_KEY_FILE: ".*bad\.key": its private key cannot be read: /,
      );
      // Expired: Redis would reset every handshake.
      execFileSync(
        "openssl",
        // biome-ignore format: one flag per pair
        ["x509", "-req", "-in", join(dir, "client.csr"), "-CA", certs.caFile, "-CAkey", join(dir, "ca.key"),
          "-CAcreateserial", "-days", "-1", "-out", join(dir, "expired.crt")],
        { stdio: "ignore" },
      );
      expect(() => readRedisTls({ ...client, redisTlsCertFile: join(dir, "expired.crt") })).toThrow(
        /^FLEET_REDIS_TLS_CERT_FILE: the certificate in ".*expired\.crt" expired on \d{4}-\d\d-\d\dT/,
      );
      // Another certificate's key: every connection would fail in OpenSSL ("key values mismatch").
      expect(() => readRedisTls({ ...client, redisTlsKeyFile: certs.keyFile })).toThrow(
        /^FLEET_REDIS_TLS_KEY_FILE: the key in ".*server\.key" is not the key of the certificate in ".*client\.crt" \(FLEET_REDIS_TLS_CERT_FILE\)$/,
      );
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("createAppLogging: the TLS files read, and a logger that scrubs their key and passphrase from every line", () => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-logging-"));
    try {
      const certs = makeTestCertificates(dir);
      const passphrase = "a passphrase long enough";
      const key = encryptTestKey(certs.clientKeyFile, join(dir, "encrypted.key"), passphrase);
      writeFileSync(join(dir, "passphrase"), `${passphrase}\n`);
      const lines: string[] = [];
      const { logger, secrets, tls } = createAppLogging(
        { name: "test", level: "info", destination: { write: (line: string) => lines.push(line) } },
        {
          redisTlsCaFile: certs.caFile,
          redisTlsCertFile: certs.clientCertFile,
          redisTlsKeyFile: key,
          redisTlsKeyPassphraseFile: join(dir, "passphrase"),
        },
      );
      expect(tls).toMatchObject({ ca: certs.ca, passphrase, key: readFileSync(key, "utf8") });
      expect([...secrets]).toEqual(redisTlsSecrets(tls));
      const keyLine = tls.key!.split("\n")[3]!;
      logger.warn({ err: `could not open it with ${passphrase}` }, `the key: ${keyLine}`);
      secrets.add("a credential resolved later");
      logger.info("a credential resolved later");
      expect(lines).toHaveLength(2);
      expect(lines.join("")).not.toContain(passphrase);
      expect(lines.join("")).not.toContain(keyLine.slice(0, 20));
      expect(lines.join("")).not.toContain("a credential resolved later");
      expect(JSON.parse(lines[0]!)).toMatchObject({ err: "could not open it with [Redacted]" });
      // A bad file stops it before any logger exists.
      expect(() =>
        createAppLogging(
          { name: "test" },
          { redisTlsCaFile: null, redisTlsCertFile: certs.clientCertFile, redisTlsKeyFile: key },
        ),
      ).toThrow(/is encrypted/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("tlsFailureHint: a failed TLS handshake (trust, name, client certificate) gets a hint; other errors none", () => {
    const withCode = (code: string) => Object.assign(new Error(code), { code });
    for (const code of [
      "ERR_SSL_TLSV13_ALERT_CERTIFICATE_REQUIRED",
      "ERR_SSL_TLSV1_ALERT_DECRYPT_ERROR",
      "SELF_SIGNED_CERT_IN_CHAIN",
      "DEPTH_ZERO_SELF_SIGNED_CERT",
      "UNABLE_TO_VERIFY_LEAF_SIGNATURE",
      "CERT_HAS_EXPIRED",
      "ERR_TLS_CERT_ALTNAME_INVALID",
    ]) {
      expect(tlsFailureHint(withCode(code)), code).toMatch(/^the TLS handshake with Redis failed: check /);
      expect(connectionErrorFields(withCode(code))).toEqual({
        err: code,
        hint: tlsFailureHint(withCode(code)),
      });
    }
    for (const err of [withCode("ECONNREFUSED"), withCode("ECONNRESET"), new Error("NOAUTH"), null, "x"]) {
      expect(tlsFailureHint(err)).toBeNull();
    }
    expect(connectionErrorFields(withCode("ECONNREFUSED"))).toEqual({ err: "ECONNREFUSED" });
  });

  it("an encrypted key opens with FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE's first line; without it, or with a wrong one, the start is refused; both are secrets", () => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-key-"));
    try {
      const certs = makeTestCertificates(dir);
      const client = {
        redisTlsCaFile: null,
        redisTlsCertFile: certs.clientCertFile,
        redisTlsKeyFile: certs.clientKeyFile,
      };
      const at = (name: string, content: string) => {
        writeFileSync(join(dir, name), content);
        return join(dir, name);
      };
      const passphrase = at("passphrase", "correct horse battery\r\nsecond line\n");
      const empty = at("empty", "\nhunter2\n");
      const wrong = at("wrong", "hunter2\n");
      for (const traditional of [false, true]) {
        const encrypted = encryptTestKey(
          certs.clientKeyFile,
          join(dir, `client-${traditional}.key`),
          "correct horse battery",
          { traditional },
        );
        expect(readFileSync(encrypted, "utf8")).toMatch(
          traditional ? /Proc-Type: 4,ENCRYPTED/ : /ENCRYPTED PRIVATE KEY/,
        );
        const tls = readRedisTls({
          ...client,
          redisTlsKeyFile: encrypted,
          redisTlsKeyPassphraseFile: passphrase,
        });
        expect(tls).toEqual({
          cert: readFileSync(certs.clientCertFile, "utf8"),
          key: readFileSync(encrypted, "utf8"),
          passphrase: "correct horse battery",
        });
        // What ioredis hands to tls.connect: the key opens with it.
        const redis = createRedis("rediss://127.0.0.1:1", { lazyConnect: true }, tls);
        expect(createSecureContext(redis.options.tls as SecureContextOptions)).toBeDefined();
        redis.disconnect();
        expect(redisTlsSecrets(tls)).toEqual([tls.key, "correct horse battery"]);
        expect(() => readRedisTls({ ...client, redisTlsKeyFile: encrypted })).toThrow(
          /^FLEET_REDIS_TLS_KEY_FILE: ".*\.key" is encrypted: name a file holding its passphrase in FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE$/,
        );
        expect(() =>
          readRedisTls({ ...client, redisTlsKeyFile: encrypted, redisTlsKeyPassphraseFile: wrong }),
        ).toThrow(
          /^FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: the passphrase in ".*wrong" does not open the key in ".*\.key" \(FLEET_REDIS_TLS_KEY_FILE\)$/,
        );
        expect(() =>
          readRedisTls({ ...client, redisTlsKeyFile: encrypted, redisTlsKeyPassphraseFile: empty }),
        ).toThrow(/^FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: ".*empty" has an empty first line/);
      }
      // A key in the clear needs none.
      expect(redisTlsSecrets(readRedisTls(client))).toEqual([readFileSync(certs.clientKeyFile, "utf8")]);
      expect(
        redisTlsSecrets(readRedisTls({ ...client, redisTlsCertFile: null, redisTlsKeyFile: null })),
      ).toEqual([]);
      // A key encrypted with openssl's `-passout file:` of a CRLF file: its `\r` is the passphrase's.
      const withCr = encryptTestKey(certs.clientKeyFile, join(dir, "cr.key"), "crlf passphrase\r");
      const crlf = at("crlf", "crlf passphrase\r\n");
      expect(
        readRedisTls({ ...client, redisTlsKeyFile: withCr, redisTlsKeyPassphraseFile: crlf }).passphrase,
      ).toBe("crlf passphrase\r");
      // A passphrase too short to scrub without mangling the lines (a word) is not a secret to the logger.
      const short = encryptTestKey(certs.clientKeyFile, join(dir, "short.key"), "redis");
      const tls = readRedisTls({
        ...client,
        redisTlsKeyFile: short,
        redisTlsKeyPassphraseFile: at("short", "redis\n"),
      });
      expect(tls.passphrase).toBe("redis");
      expect(redisTlsSecrets(tls)).toEqual([tls.key]);
      // DES (OpenSSL 3 reads it no more): said so, not taken for a wrong passphrase.
      execFileSync(
        "openssl",
        // biome-ignore format: one flag per pair
        ["rsa", "-in", certs.clientKeyFile, "-traditional", "-des", "-passout", "pass:correct horse battery",
          "-out", join(dir, "des.key"), "-provider", "legacy", "-provider", "default"],
        { stdio: "ignore" },
      );
      expect(() =>
        readRedisTls({
          ...client,
          redisTlsKeyFile: join(dir, "des.key"),
          redisTlsKeyPassphraseFile: passphrase,
        }),
      ).toThrow(
        /^FLEET_REDIS_TLS_KEY_FILE: ".*des\.key": its private key cannot be read: .*unsupported \(a cipher OpenSSL 3 no longer reads, such as DES: convert the key/,
      );
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
