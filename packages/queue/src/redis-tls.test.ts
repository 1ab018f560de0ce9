import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createSecureContext, type SecureContextOptions } from "node:tls";
import { describe, expect, it } from "vitest";
import { createRedis } from "./connection.ts";
import {
  connectionCause,
  connectionErrorFields,
  createAppLogging,
  readRedisTls,
  redisTlsSecrets,
  tlsFailureHint,
} from "./redis-tls.ts";
import { encryptTestKey, fleetTlsFiles, makeTestCertificates } from "./testing/tls.ts";

describe("the Redis TLS files (FLEET_REDIS_TLS_*)", () => {
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
      // Read while being written (a rotation, `watchRedisTls`): a chain's second certificate cut
      // short; a combined certificate-and-key file's key cut short (Node's TLS refuses it at a
      // connect, which would end the connection for good).
      const chain = at("chain.pem", text(certs.clientCertFile) + certs.ca.slice(0, 300));
      expect(() => readRedisTls({ ...client, redisTlsCertFile: chain })).toThrow(
        /^FLEET_REDIS_TLS_CERT_FILE: ".*chain\.pem" holds a certificate cut short \(2 begun, 1 ended: a file still being written\?\)$/,
      );
      expect(() =>
        readRedisTls({ ...none, redisTlsCaFile: at("cab.pem", certs.ca + certs.ca.slice(0, 300)) }),
      ).toThrow(/^FLEET_REDIS_TLS_CA_FILE: ".*cab\.pem" holds a certificate cut short/);
      const combined = at(
        "combined.pem",
        `${text(certs.clientCertFile)}${text(certs.clientKeyFile).slice(0, 200)}`,
      );
      expect(() => readRedisTls({ ...client, redisTlsCertFile: combined })).toThrow(
        /^FLEET_REDIS_TLS_CERT_FILE: Node's TLS refuses what it holds: .*bad end line/,
      );
      // Expired: Redis would refuse every handshake.
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

  it("connectionErrorFields: a Cluster's wrapped error says its last node's error, and that error's TLS hint", () => {
    // ioredis's ClusterAllFailedError: "Failed to refresh slots cache.", the node's in `lastNodeError`.
    const wrapped = (lastNodeError: Error) =>
      Object.assign(new Error("Failed to refresh slots cache."), {
        name: "ClusterAllFailedError",
        lastNodeError,
      });
    const tls = Object.assign(new Error("self-signed certificate in certificate chain"), {
      code: "SELF_SIGNED_CERT_IN_CHAIN",
    });
    expect(connectionErrorFields(wrapped(tls))).toEqual({
      err: "Failed to refresh slots cache. (its last node's error: self-signed certificate in certificate chain)",
      hint: tlsFailureHint(tls),
    });
    expect(connectionErrorFields(wrapped(new Error("WRONGPASS invalid username-password pair")))).toEqual({
      err: "Failed to refresh slots cache. (its last node's error: WRONGPASS invalid username-password pair)",
    });
    expect(connectionCause(wrapped(tls))).toBe(tls);
    expect(connectionCause(tls)).toBe(tls);
  });

  it("a traditional encrypted key under many wrong passphrases is always said to be the passphrase's fault: one in 256 passes CBC's padding check and fails as a key that does not decode (a CI run saw it)", () => {
    const dir = mkdtempSync(join(tmpdir(), "fleet-key-"));
    try {
      const certs = makeTestCertificates(dir);
      const encrypted = encryptTestKey(
        certs.clientKeyFile,
        join(dir, "client.key"),
        "correct horse battery",
        {
          traditional: true,
        },
      );
      const file = join(dir, "wrong");
      for (let i = 0; i < 2000; i++) {
        writeFileSync(file, `wrong passphrase ${i}\n`);
        expect(() =>
          readRedisTls({
            redisTlsCaFile: null,
            redisTlsCertFile: certs.clientCertFile,
            redisTlsKeyFile: encrypted,
            redisTlsKeyPassphraseFile: file,
          }),
        ).toThrow(/^FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: the passphrase in ".*wrong" does not open the key/);
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
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
