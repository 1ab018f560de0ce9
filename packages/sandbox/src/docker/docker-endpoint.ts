import type Dockerode from "dockerode";

/** The Docker endpoint used when none is given. */
export const DEFAULT_DOCKER_ENDPOINT = "unix:///var/run/docker.sock";

/** How to reach a Docker daemon: an endpoint URL (`DOCKER_HOST` syntax) and/or dockerode options. */
export interface DockerConnection extends Dockerode.DockerOptions {
  /** `unix:///path/docker.sock`, `tcp://host:2375`, `http(s)://host:port`. Wins over socketPath/host. */
  endpoint?: string;
}

/** Turn a `DOCKER_HOST`-style URL into dockerode options. */
export function dockerOptionsFromEndpoint(endpoint: string): Dockerode.DockerOptions {
  if (endpoint.startsWith("unix://")) {
    const socketPath = endpoint.slice("unix://".length);
    if (!socketPath) throw new RangeError(`docker endpoint has no socket path: ${endpoint}`);
    return { socketPath };
  }
  if (endpoint.startsWith("/")) return { socketPath: endpoint };
  const url = new URL(endpoint.includes("://") ? endpoint : `tcp://${endpoint}`);
  const tls = url.protocol === "https:" || url.port === "2376";
  if (!["tcp:", "http:", "https:"].includes(url.protocol)) {
    throw new RangeError(
      `unsupported docker endpoint: ${endpoint} (use unix://, tcp://, http:// or https://)`,
    );
  }
  return { host: url.hostname, port: url.port || (tls ? "2376" : "2375"), protocol: tls ? "https" : "http" };
}

/** Resolve a connection to dockerode options and the canonical endpoint string handles carry. */
export function resolveDockerConnection(connection: DockerConnection = {}): {
  options: Dockerode.DockerOptions;
  endpoint: string;
} {
  const { endpoint, ...rest } = connection;
  let options: Dockerode.DockerOptions;
  if (endpoint !== undefined) options = { ...rest, ...dockerOptionsFromEndpoint(endpoint) };
  else if (rest.socketPath !== undefined || rest.host !== undefined) options = rest;
  else options = { ...rest, ...dockerOptionsFromEndpoint(DEFAULT_DOCKER_ENDPOINT) };
  return { options, endpoint: endpointOf(options) };
}

export function endpointOf(options: Dockerode.DockerOptions): string {
  if (options.host !== undefined) {
    const scheme = options.protocol === "https" ? "https" : options.protocol === "ssh" ? "ssh" : "tcp";
    return `${scheme}://${options.host}${options.port === undefined ? "" : `:${options.port}`}`;
  }
  return `unix://${options.socketPath ?? "/var/run/docker.sock"}`;
}
