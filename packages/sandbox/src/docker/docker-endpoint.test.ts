import { describe, expect, it } from "vitest";
import {
  DEFAULT_DOCKER_ENDPOINT,
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
});
