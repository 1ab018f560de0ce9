import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import {
  DEFAULT_DOCKER_ENDPOINT,
  dockerConnectionFromEnv,
  dockerOptionsFromEndpoint,
  resolveDockerConnection,
} from "./docker-endpoint.ts";

describe("docker endpoints", () => {
  it("parses DOCKER_HOST syntax", () => {
    expect(dockerOptionsFromEndpoint("unix:///run/d.sock")).toEqual({ socketPath: "/run/d.sock" });
    expect(dockerOptionsFromEndpoint("tcp://10.0.0.5:2375")).toEqual({
      host: "10.0.0.5",
      port: "2375",
      protocol: "http",
    });
    expect(dockerOptionsFromEndpoint("tcp://h:2376")).toMatchObject({ protocol: "https" });
    expect(() => dockerOptionsFromEndpoint("ftp://h")).toThrow(/unsupported/);
  });

  it("names the endpoint handles carry", () => {
    expect(resolveDockerConnection().endpoint).toBe(DEFAULT_DOCKER_ENDPOINT);
    expect(resolveDockerConnection({ socketPath: "/x.sock" }).endpoint).toBe("unix:///x.sock");
    expect(resolveDockerConnection({ endpoint: "tcp://h:2375" }).endpoint).toBe("tcp://h:2375");
  });

  it("keeps an explicit :443 or :80 (the URL API drops a scheme's default port); no port is Docker's 2376/2375", () => {
    expect(dockerOptionsFromEndpoint("https://docker.example:443")).toEqual({
      host: "docker.example",
      port: "443",
      protocol: "https",
    });
    expect(dockerOptionsFromEndpoint("http://docker.example:80")).toMatchObject({
      port: "80",
      protocol: "http",
    });
    expect(dockerOptionsFromEndpoint("https://u:p@[fd00::1]:443/")).toMatchObject({ port: "443" });
    expect(dockerOptionsFromEndpoint("https://docker.example")).toMatchObject({ port: "2376" });
    expect(dockerOptionsFromEndpoint("http://docker.example")).toMatchObject({ port: "2375" });
    expect(dockerOptionsFromEndpoint("https://docker.example:8443")).toMatchObject({ port: "8443" });
  });

  it("a handle made on a TLS daemon at :443 names :443, and is looked up there by another worker (not :2376)", () => {
    const certs = mkdtempSync(join(tmpdir(), "docker-certs-"));
    try {
      writeFileSync(join(certs, "ca.pem"), "not really a CA");
      for (const dockerHost of ["https://docker.example:443", "tcp://docker.example:443"]) {
        // The creating worker: the endpoint its handles carry.
        const made = resolveDockerConnection(dockerConnectionFromEnv(dockerHost, certs));
        expect(made.options, dockerHost).toMatchObject({
          host: "docker.example",
          port: "443",
          protocol: "https",
        });
        expect(made.endpoint, dockerHost).toBe("https://docker.example:443");
        // Another worker reaching the handle's daemon (the provider's lookup by handle.endpoint).
        const lookedUp = resolveDockerConnection({ endpoint: made.endpoint });
        expect(lookedUp.options, dockerHost).toMatchObject({
          host: "docker.example",
          port: "443",
          protocol: "https",
        });
        expect(lookedUp.endpoint).toBe(made.endpoint);
      }
    } finally {
      rmSync(certs, { recursive: true, force: true });
    }
  });

  it("with DOCKER_CERT_PATH, speaks TLS to a tcp:// daemon on any port, not only 2376", () => {
    const certs = mkdtempSync(join(tmpdir(), "docker-certs-"));
    try {
      writeFileSync(join(certs, "ca.pem"), "not really a CA");
      for (const host of ["tcp://sandbox-host:2376", "tcp://sandbox-host:12376", "sandbox-host:2377"]) {
        const { options, endpoint } = resolveDockerConnection(dockerConnectionFromEnv(host, certs));
        expect(options, host).toMatchObject({ protocol: "https", host: "sandbox-host" });
        expect(endpoint, host).toMatch(/^https:\/\/sandbox-host:\d+$/);
      }
      // Without certificates a plain daemon stays plain.
      expect(resolveDockerConnection(dockerConnectionFromEnv("tcp://h:2375", null)).options.protocol).toBe(
        "http",
      );
    } finally {
      rmSync(certs, { recursive: true, force: true });
    }
  });
});
