import { execFileSync } from "node:child_process";
import { copyFileSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import { join } from "node:path";

/** A test's own certificate authority and a server certificate it signed, as files in a directory. */
export interface TestCertificates {
  /** The CA's certificate (PEM file), what a client trusts (`FLEET_REDIS_TLS_CA_FILE`). */
  caFile: string;
  /** Its text. */
  ca: string;
  /** The server's certificate, for 127.0.0.1 and localhost, and its key. */
  certFile: string;
  keyFile: string;
  /** A client's certificate the CA signed, and its key (for a Redis that asks clients for one). */
  clientCertFile: string;
  clientKeyFile: string;
}

/**
 * A CA and a server certificate for 127.0.0.1 and localhost that it signed (or for the names in
 * `subjectAltName`, e.g. `DNS:localhost` alone), made with `openssl` (on PATH) in `dir`; valid for
 * `days` (default two).
 */
export function makeTestCertificates(
  dir: string,
  options: { subjectAltName?: string; days?: number } = {},
): TestCertificates {
  const days = String(options.days ?? 2);
  const at = (name: string) => join(dir, name);
  const openssl = (...args: string[]) =>
    execFileSync("openssl", args, { stdio: ["ignore", "ignore", "pipe"] });
  openssl(
    ...["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", days, "-subj", "/CN=fleet test CA"],
    ...["-keyout", at("ca.key"), "-out", at("ca.crt")],
  );
  openssl(
    ...["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1"],
    ...["-keyout", at("server.key"), "-out", at("server.csr")],
  );
  writeFileSync(
    at("server.ext"),
    `subjectAltName=${options.subjectAltName ?? "IP:127.0.0.1,DNS:localhost"}\n`,
  );
  openssl(
    ...["x509", "-req", "-in", at("server.csr"), "-CA", at("ca.crt"), "-CAkey", at("ca.key")],
    ...["-CAcreateserial", "-days", days, "-extfile", at("server.ext"), "-out", at("server.crt")],
  );
  openssl(
    ...["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=rollout-fleet"],
    ...["-keyout", at("client.key"), "-out", at("client.csr")],
  );
  openssl(
    ...["x509", "-req", "-in", at("client.csr"), "-CA", at("ca.crt"), "-CAkey", at("ca.key")],
    ...["-CAcreateserial", "-days", days, "-out", at("client.crt")],
  );
  return {
    clientCertFile: at("client.crt"),
    clientKeyFile: at("client.key"),
    caFile: at("ca.crt"),
    ca: readFileSync(at("ca.crt"), "utf8"),
    certFile: at("server.crt"),
    keyFile: at("server.key"),
  };
}

/**
 * `redis-server` arguments (or, without the dashes, config lines) for a TLS port `port` serving
 * `certs`' server certificate; clients are asked for one of their own, signed by the CA, only
 * with `authClients` (Redis's default; off here unless asked).
 */
export function tlsServerArgs(
  certs: TestCertificates,
  port: number,
  options: { authClients?: boolean } = {},
): string[] {
  // biome-ignore format: one flag per pair
  return [
    "--tls-port", String(port), "--tls-cert-file", certs.certFile, "--tls-key-file", certs.keyFile,
    "--tls-ca-cert-file", certs.caFile, "--tls-auth-clients", options.authClients ? "yes" : "no",
  ];
}

/** The TLS files of a fleet (as its config names them) that trusts `certs`' CA and, with `client`, presents its client certificate. */
export function fleetTlsFiles(
  certs: TestCertificates,
  options: { client?: boolean } = {},
): { redisTlsCaFile: string; redisTlsCertFile: string | null; redisTlsKeyFile: string | null } {
  return {
    redisTlsCaFile: certs.caFile,
    redisTlsCertFile: options.client ? certs.clientCertFile : null,
    redisTlsKeyFile: options.client ? certs.clientKeyFile : null,
  };
}

/**
 * `keyFile`'s key encrypted with `passphrase` (AES-256) into `outFile`, as PKCS#8
 * (`BEGIN ENCRYPTED PRIVATE KEY`) or, with `traditional`, OpenSSL's older form
 * (`Proc-Type: 4,ENCRYPTED`); with `openssl` on PATH.
 */
export function encryptTestKey(
  keyFile: string,
  outFile: string,
  passphrase: string,
  options: { traditional?: boolean } = {},
): string {
  const args = options.traditional
    ? ["rsa", "-traditional", "-aes256"]
    : ["pkcs8", "-topk8", "-v2", "aes256"];
  execFileSync("openssl", [...args, "-in", keyFile, "-passout", `pass:${passphrase}`, "-out", outFile], {
    stdio: ["ignore", "ignore", "pipe"],
  });
  return outFile;
}

/** `to` replaced by a copy of `from` at once (a rename), as a rotation writes it: never read half written. */
export function replaceFile(from: string, to: string): void {
  copyFileSync(from, `${to}.new`);
  renameSync(`${to}.new`, to);
}
