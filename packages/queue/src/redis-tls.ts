import { createPrivateKey, type KeyObject, X509Certificate } from "node:crypto";
import { readFileSync } from "node:fs";
import { createSecureContext, type SecureContextOptions } from "node:tls";
import { createLogger, type Logger, type LoggerOptions, MIN_SECRET_FRAGMENT } from "@fleet/telemetry";

/**
 * How the fleet's TLS connections to Redis (`rediss://`, `rediss-cluster://`, `rediss-sentinel://`)
 * check the server's certificate, and the certificate they present (a Redis with
 * `tls-auth-clients yes`, Redis's default, asks every client for one). Ignored for a URL without
 * TLS (the config refuses that pair).
 */
export interface RedisTls {
  /**
   * The certificate authorities (PEM) to trust, in place of Node's public roots, for a private
   * CA (`FLEET_REDIS_TLS_CA_FILE`).
   */
  ca?: string;
  /** The fleet's client certificate (PEM, `FLEET_REDIS_TLS_CERT_FILE`), with its `key`. */
  cert?: string;
  /** Its private key (PEM, `FLEET_REDIS_TLS_KEY_FILE`). */
  key?: string;
  /** The key's passphrase, when it is encrypted (`FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE`). */
  passphrase?: string;
}

/** The config's TLS files for Redis (null where unset). */
export interface RedisTlsFiles {
  redisTlsCaFile: string | null;
  redisTlsCertFile: string | null;
  redisTlsKeyFile: string | null;
  redisTlsKeyPassphraseFile?: string | null;
}

const PEM_CERTIFICATE = /-----BEGIN CERTIFICATE-----[\s\S]*?-----END CERTIFICATE-----/g;
const PEM_ENCRYPTED_KEY = /-----BEGIN ENCRYPTED PRIVATE KEY-----|Proc-Type: 4,ENCRYPTED/;

/**
 * The `RedisTls` of the config's files (`FLEET_REDIS_TLS_CA_FILE`, `FLEET_REDIS_TLS_CERT_FILE`,
 * `FLEET_REDIS_TLS_KEY_FILE`, `FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE`), read and checked now, so
 * that a wrong file stops the start with its name rather than every connection with an
 * OpenSSL code: a file that cannot be read; a certificate file with no certificate, or one that
 * does not parse or is cut short; a client certificate past its end; a key that does not parse,
 * is encrypted with no passphrase given, or does not open with the one given; a key that is not
 * the certificate's; anything else Node's TLS would refuse at a connect. The passphrase is its
 * file's first line (as openssl's `-passin file:`).
 */
export function readRedisTls(config: RedisTlsFiles): RedisTls {
  const tls = readAndCheckFiles(config);
  // What Node's TLS itself would refuse at a connect: thrown there, it ends an ioredis connection
  // for good (no retry), so a file `watchRedisTls` took mid-write must never get that far.
  const context = (variable: string, options: SecureContextOptions) => {
    try {
      createSecureContext(options);
    } catch (err) {
      throw new Error(`${variable}: Node's TLS refuses what it holds: ${messageOf(err)}`);
    }
  };
  if (tls.ca !== undefined) context("FLEET_REDIS_TLS_CA_FILE", { ca: tls.ca });
  if (tls.cert !== undefined)
    context("FLEET_REDIS_TLS_CERT_FILE", { cert: tls.cert, key: tls.key, passphrase: tls.passphrase });
  return tls;
}

function readAndCheckFiles(config: RedisTlsFiles): RedisTls {
  const read = (variable: string, file: string): string => {
    try {
      return readFileSync(file, "utf8");
    } catch (err) {
      throw new Error(`${variable}: cannot read ${JSON.stringify(file)}: ${messageOf(err)}`);
    }
  };
  const certificates = (variable: string, file: string | null) => {
    if (file === null) return null;
    const text = read(variable, file);
    const blocks = text.match(PEM_CERTIFICATE) ?? [];
    if (blocks.length === 0) throw new Error(`${variable}: ${JSON.stringify(file)} holds no PEM certificate`);
    const begun = text.split("-----BEGIN CERTIFICATE-----").length - 1;
    if (begun > blocks.length)
      throw new Error(
        `${variable}: ${JSON.stringify(file)} holds a certificate cut short (${begun} begun, ${blocks.length} ended: a file still being written?)`,
      );
    const parsed = blocks.map((block, i) => {
      try {
        return new X509Certificate(block);
      } catch (err) {
        const which = blocks.length > 1 ? `certificate ${i + 1} of ${blocks.length}` : "its certificate";
        throw new Error(`${variable}: ${JSON.stringify(file)}: ${which} cannot be read: ${messageOf(err)}`);
      }
    });
    return { text, first: parsed[0]! };
  };
  const ca = certificates("FLEET_REDIS_TLS_CA_FILE", config.redisTlsCaFile);
  const cert = certificates("FLEET_REDIS_TLS_CERT_FILE", config.redisTlsCertFile);
  // Past its end, Redis refuses every handshake (a "certificate expired" alert, at each retry).
  if (cert && Date.parse(cert.first.validTo) < Date.now())
    throw new Error(
      `FLEET_REDIS_TLS_CERT_FILE: the certificate in ${JSON.stringify(config.redisTlsCertFile)} expired on ${new Date(cert.first.validTo).toISOString()}`,
    );
  const tls: RedisTls = {};
  if (ca) tls.ca = ca.text;
  if (cert) tls.cert = cert.text;
  const keyFile = config.redisTlsKeyFile;
  if (keyFile === null) return tls;
  const key = read("FLEET_REDIS_TLS_KEY_FILE", keyFile);
  if (!/-----BEGIN [A-Z ]*PRIVATE KEY-----/.test(key))
    throw new Error(`FLEET_REDIS_TLS_KEY_FILE: ${JSON.stringify(keyFile)} holds no PEM private key`);
  tls.key = key;
  const passphraseFile = config.redisTlsKeyPassphraseFile ?? null;
  // The first line, as openssl's `-passin file:` reads it (its `\r` kept); a line that then does
  // not open the key is tried without its `\r` (a file saved with CRLF endings).
  const passphrases: string[] = [];
  if (passphraseFile !== null) {
    const line = read("FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE", passphraseFile).split("\n")[0]!;
    if (line.replace(/\r$/, "") === "")
      throw new Error(
        `FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: ${JSON.stringify(passphraseFile)} has an empty first line (the passphrase)`,
      );
    passphrases.push(...new Set([line, line.replace(/\r$/, "")]));
  }
  let keyObject: KeyObject | null = null;
  let failure: unknown = null;
  for (const passphrase of passphrases.length > 0 ? passphrases : [""]) {
    try {
      keyObject = createPrivateKey({ key, format: "pem", passphrase });
      if (passphraseFile !== null) tls.passphrase = passphrase;
      break;
    } catch (err) {
      failure ??= err;
    }
  }
  if (keyObject === null) {
    const code = (failure as { code?: unknown } | null)?.code;
    const where = JSON.stringify(keyFile);
    // An encrypted key that a wrong (or no) passphrase does not open fails as a bad decrypt,
    // or, when the wrong key happens to pass the padding check (1 in 256 for CBC), as garbage
    // that does not decode: either way a passphrase matter, unless OpenSSL lacks the cipher.
    if (!PEM_ENCRYPTED_KEY.test(key) || code === "ERR_OSSL_EVP_UNSUPPORTED")
      throw new Error(
        `FLEET_REDIS_TLS_KEY_FILE: ${where}: its private key cannot be read: ${messageOf(failure)}${
          code === "ERR_OSSL_EVP_UNSUPPORTED"
            ? " (a cipher OpenSSL 3 no longer reads, such as DES: convert the key, e.g. `openssl pkcs8 -topk8 -v2 aes256`)"
            : ""
        }`,
      );
    throw new Error(
      passphraseFile === null
        ? `FLEET_REDIS_TLS_KEY_FILE: ${where} is encrypted: name a file holding its passphrase in FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE`
        : `FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: the passphrase in ${JSON.stringify(passphraseFile)} does not open the key in ${where} (FLEET_REDIS_TLS_KEY_FILE)`,
    );
  }
  if (cert && !cert.first.checkPrivateKey(keyObject))
    throw new Error(
      `FLEET_REDIS_TLS_KEY_FILE: the key in ${JSON.stringify(keyFile)} is not the key of the certificate in ${JSON.stringify(config.redisTlsCertFile)} (FLEET_REDIS_TLS_CERT_FILE)`,
    );
  return tls;
}

/** When the (first) certificate in `pem` expires, in Unix seconds. */
export function certificateExpirySeconds(pem: string): number {
  return Date.parse(new X509Certificate(pem).validTo) / 1000;
}

function messageOf(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/**
 * What of `tls` must never be written anywhere, for a logger's secret scrubber: the client key,
 * and its passphrase unless it is shorter than `MIN_SECRET_FRAGMENT` (10) characters. Replacing
 * so short a string wherever it stands (a word, a number) would mangle the lines, and nothing
 * logs it.
 */
export function redisTlsSecrets(tls: RedisTls): string[] {
  const secrets = tls.key ? [tls.key] : [];
  if (tls.passphrase && tls.passphrase.length >= MIN_SECRET_FRAGMENT) secrets.push(tls.passphrase);
  return secrets;
}

/** An app's logger and its Redis TLS settings, from `createAppLogging`. */
export interface AppLogging {
  logger: Logger;
  /**
   * The values its logger scrubs from every line: the Redis TLS key and passphrase
   * (`redisTlsSecrets`) from the start; the app adds the others it comes to hold (credentials).
   */
  secrets: Set<string>;
  /** The config's Redis TLS files, read (`readRedisTls`). */
  tls: RedisTls;
}

/**
 * An app's start: its Redis TLS files read and checked (`readRedisTls`, which throws on a bad
 * one), then its logger, which scrubs their secrets from every line it writes.
 */
export function createAppLogging(options: Omit<LoggerOptions, "secrets">, files: RedisTlsFiles): AppLogging {
  const tls = readRedisTls(files);
  const secrets = new Set(redisTlsSecrets(tls));
  return { logger: createLogger({ ...options, secrets }), secrets, tls };
}

/**
 * What to check when `err` (a connection's error) is a failed TLS handshake: a certificate the
 * client does not trust, a name it does not match, a client certificate Redis wants and did not
 * get or does not accept. Null for any other error. Such a failure is the configuration's, not an
 * outage: it lasts until a file or a certificate changes.
 */
export function tlsFailureHint(err: unknown): string | null {
  const code = (err as { code?: unknown } | null)?.code;
  if (typeof code !== "string") return null;
  if (!/^ERR_SSL_|^ERR_TLS_|CERT|SELF_SIGNED|^UNABLE_TO_/.test(code)) return null;
  return "the TLS handshake with Redis failed: check that FLEET_REDIS_TLS_CA_FILE holds the CA that signed Redis's certificate, that the certificate names the host in REDIS_URL, and, for a Redis that asks clients for a certificate (tls-auth-clients yes, its default), FLEET_REDIS_TLS_CERT_FILE and FLEET_REDIS_TLS_KEY_FILE signed by a CA it trusts";
}

/**
 * The error behind `err`: a Redis Cluster that could not be reached reports "Failed to refresh
 * slots cache." (ioredis's `ClusterAllFailedError`), its last node's own error (a refused
 * password, a failed TLS handshake, a refused connection) in `lastNodeError`. Else `err`.
 */
export function connectionCause(err: Error): Error {
  const last = (err as { lastNodeError?: unknown }).lastNodeError;
  return last instanceof Error ? last : err;
}

/** The fields a warning about `err` carries: its message (and its cluster node's), and a TLS failure's hint. */
export function connectionErrorFields(err: Error): { err: string; hint?: string } {
  const cause = connectionCause(err);
  const message = cause === err ? err.message : `${err.message} (its last node's error: ${cause.message})`;
  const hint = tlsFailureHint(cause);
  return hint ? { err: message, hint } : { err: message };
}

/** What `watchRedisTls` logs with (a pino logger fits). */
export interface RedisTlsWatchLogger {
  info(obj: object, msg: string): void;
  warn(obj: object, msg: string): void;
}

/**
 * Keep `tls` (what `readRedisTls(files)` returned, handed to `connectRedis`/`createRedis`) up to
 * date with its files, so that a certificate rotated in place (cert-manager, Vault, a renewed
 * file) needs no restart. The files are read again every `intervalMs` (default a minute); when
 * what they hold changed and passes `readRedisTls`'s checks, `tls` is updated in place: every
 * connection made from it (its duplicates, BullMQ's, a cluster's nodes) presents and trusts the
 * new ones at its next connect. Open connections keep their session. Files that cannot be used
 * (half written, a key for another certificate, a certificate past its end) leave `tls` as it
 * was, with a warning once per reason. The new key and passphrase go to `secrets` (the logger's);
 * `certificateExpiry` is told when the client certificate in use expires (Unix seconds), now
 * and after each change (an app's `fleet_redis_tls_cert_expiry_timestamp_seconds`; alert
 * `FleetRedisTlsCertExpiring`: a renewal that never came, or was not taken).
 * Returns a function that stops watching; the timer holds no process open. No files, no watch.
 */
export function watchRedisTls(
  files: RedisTlsFiles,
  tls: RedisTls,
  options: {
    logger: RedisTlsWatchLogger;
    secrets?: Set<string>;
    intervalMs?: number;
    certificateExpiry?: (unixSeconds: number) => void;
  },
): () => void {
  if (files.redisTlsCaFile === null && files.redisTlsCertFile === null && files.redisTlsKeyFile === null)
    return () => undefined;
  const tellExpiry = () => {
    if (tls.cert !== undefined) options.certificateExpiry?.(certificateExpirySeconds(tls.cert));
  };
  tellExpiry();
  const fields = ["ca", "cert", "key", "passphrase"] as const;
  let warned = "";
  const check = () => {
    let next: RedisTls;
    try {
      next = readRedisTls(files);
    } catch (err) {
      const message = messageOf(err);
      if (message !== warned) {
        options.logger.warn(
          { err: message },
          "the Redis TLS files cannot be used as they are now; connections go on with the ones read before",
        );
      }
      warned = message;
      return;
    }
    warned = "";
    const changed = fields.filter((field) => next[field] !== tls[field]);
    if (changed.length === 0) return;
    for (const secret of redisTlsSecrets(next)) options.secrets?.add(secret);
    for (const field of fields) {
      if (next[field] === undefined) delete tls[field];
      else tls[field] = next[field];
    }
    options.logger.info(
      { changed },
      "the Redis TLS files changed; connections present and trust the new ones from their next connect",
    );
    tellExpiry();
  };
  const timer = setInterval(check, options.intervalMs ?? 60_000).unref();
  return () => clearInterval(timer);
}
