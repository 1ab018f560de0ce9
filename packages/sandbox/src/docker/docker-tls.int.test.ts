import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer, type Server } from "node:https";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { TLSSocket } from "node:tls";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { dockerConnectionFromEnv } from "./docker-endpoint.ts";
import { DockerSandboxProvider } from "./docker-sandbox-provider.ts";

// A stand-in for a Docker daemon run with --tlsverify on loopback: https, our own CA, and a
// client certificate required. It answers the one call `list()` makes.
const dir = mkdtempSync(join(tmpdir(), "docker-tls-"));
const certs = join(dir, "client");
let server: Server;
let endpoint: string;
const clients: string[] = [];

/** What a daemon run with --tlsverify uses: its certificate, our CA, and a client certificate required. */
function daemonTls() {
  return {
    key: readFileSync(join(dir, "server-key.pem")),
    cert: readFileSync(join(dir, "server.pem")),
    ca: readFileSync(join(dir, "ca.pem")),
    requestCert: true,
    rejectUnauthorized: true,
  };
}

function openssl(...args: string[]): void {
  execFileSync("openssl", args, { cwd: dir, stdio: "pipe" });
}

beforeAll(async () => {
  openssl(
    "req",
    "-x509",
    "-newkey",
    "rsa:2048",
    "-nodes",
    "-days",
    "1",
    "-keyout",
    "ca-key.pem",
    "-out",
    "ca.pem",
    "-subj",
    "/CN=test-ca",
  );
  writeFileSync(join(dir, "san.cnf"), "subjectAltName=IP:127.0.0.1\n");
  for (const [name, cn, ext] of [
    ["server", "127.0.0.1", ["-extfile", "san.cnf"]],
    ["client", "fleet-worker", []],
  ] as const) {
    openssl(
      "req",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-keyout",
      `${name}-key.pem`,
      "-out",
      `${name}.csr`,
      "-subj",
      `/CN=${cn}`,
    );
    openssl(
      "x509",
      "-req",
      "-in",
      `${name}.csr`,
      "-CA",
      "ca.pem",
      "-CAkey",
      "ca-key.pem",
      "-CAcreateserial",
      "-days",
      "1",
      "-out",
      `${name}.pem`,
      ...ext,
    );
  }
  // DOCKER_CERT_PATH layout: ca.pem, cert.pem, key.pem.
  execFileSync("mkdir", ["-p", certs]);
  writeFileSync(join(certs, "ca.pem"), readFileSync(join(dir, "ca.pem")));
  writeFileSync(join(certs, "cert.pem"), readFileSync(join(dir, "client.pem")));
  writeFileSync(join(certs, "key.pem"), readFileSync(join(dir, "client-key.pem")));

  server = createServer(daemonTls(), (req, res) => {
    clients.push(String((req.socket as TLSSocket).getPeerCertificate().subject?.CN ?? "?"));
    res.writeHead(200, { "content-type": "application/json" });
    res.end(req.url?.startsWith("/containers/json") ? "[]" : "{}");
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  endpoint = `https://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

afterAll(async () => {
  await new Promise<void>((resolve) => server.close(() => resolve()));
  rmSync(dir, { recursive: true, force: true });
});

describe("a Docker daemon over TLS (DOCKER_HOST + DOCKER_CERT_PATH)", () => {
  it("verifies the daemon with ca.pem and authenticates with cert.pem/key.pem", async () => {
    const provider = new DockerSandboxProvider({ docker: dockerConnectionFromEnv(endpoint, certs) });
    expect(await provider.list()).toEqual([]);
    expect(clients).toEqual(["fleet-worker"]);
  });

  it("without DOCKER_CERT_PATH the daemon cannot be reached (no client certificate, unknown CA)", async () => {
    const provider = new DockerSandboxProvider({ docker: dockerConnectionFromEnv(endpoint, null) });
    await expect(provider.list()).rejects.toMatchObject({ kind: "provider_unavailable" });
  });

  it("a sandbox on another daemon over TLS (its handle's endpoint) is reached with the same certificates", async () => {
    // A second daemon of the fleet, with the same CA and the same demand for a client certificate.
    const seen: string[] = [];
    const other = createServer(daemonTls(), (req, res) => {
      seen.push(`${(req.socket as TLSSocket).getPeerCertificate().subject?.CN ?? "?"} ${req.url}`);
      res.writeHead(200, { "content-type": "application/json" });
      res.end(JSON.stringify({ Id: "c1", State: { Running: true } }));
    });
    await new Promise<void>((resolve) => other.listen(0, "127.0.0.1", resolve));
    try {
      const provider = new DockerSandboxProvider({ docker: dockerConnectionFromEnv(endpoint, certs) });
      const handle = {
        provider: "docker" as const,
        endpoint: `https://127.0.0.1:${(other.address() as AddressInfo).port}`,
        id: "c1",
        name: "fleet-r1-resources",
        rolloutId: "r1",
        owner: "resources" as const,
        volumes: [],
      };
      expect(await provider.alive(handle)).toBe(true);
      expect(seen).toEqual([expect.stringMatching(/^fleet-worker \/(v[\d.]+\/)?containers\/c1\/json/)]);
    } finally {
      await new Promise<void>((resolve) => other.close(() => resolve()));
    }
  });

  it("a DOCKER_CERT_PATH that does not exist is a clear error", () => {
    expect(() => dockerConnectionFromEnv(endpoint, join(dir, "nope"))).toThrow(
      /DOCKER_CERT_PATH .* does not exist/,
    );
  });
});
