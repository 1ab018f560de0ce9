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
