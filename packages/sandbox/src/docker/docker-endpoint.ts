import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
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
  // The URL API drops a scheme's default port (`https://h:443` has port ""): an explicit :443 or
  // :80 is kept, not taken for no port (which means Docker's 2376 for TLS, 2375 without).
  const port = url.port || explicitDefaultPort(endpoint, url) || (tls ? "2376" : "2375");
  return { host: url.hostname, port, protocol: tls ? "https" : "http" };
}

/** `443`/`80` when `endpoint` names its scheme's default port explicitly (`https://h:443`), else "". */
function explicitDefaultPort(endpoint: string, url: URL): string {
  const defaults: Record<string, string> = { "https:": "443", "http:": "80" };
  const port = defaults[url.protocol];
  if (port === undefined) return "";
  // The authority: after `://`, up to the path, query or fragment; its port after the host
  // (a bracketed IPv6 address holds colons of its own) and any userinfo.
  const authority = (endpoint.split("://")[1] ?? "").split(/[/?#]/)[0] ?? "";
  const hostPort = authority.slice(authority.lastIndexOf("@") + 1);
  const m = /:(\d+)$/.exec(hostPort.startsWith("[") ? hostPort.slice(hostPort.indexOf("]") + 1) : hostPort);
  return m !== null && Number(m[1]) === Number(port) ? port : "";
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

/**
 * TLS material for a daemon reached over https (`tcp://host:2376`), as Docker's own client finds
 * it: `ca.pem`, `cert.pem` and `key.pem` in `certPath` (`DOCKER_CERT_PATH`). The CA verifies the
 * daemon; the certificate and key authenticate us to a daemon run with `--tlsverify`. Files
 * missing from the directory are left out; a directory that does not exist is an error.
 */
export function dockerTlsFromCertPath(
  certPath: string,
): Pick<Dockerode.DockerOptions, "ca" | "cert" | "key"> {
  if (!existsSync(certPath)) throw new RangeError(`DOCKER_CERT_PATH ${certPath} does not exist`);
  const read = (name: string) => {
    const file = join(certPath, name);
    return existsSync(file) ? readFileSync(file) : undefined;
  };
  const tls = { ca: read("ca.pem"), cert: read("cert.pem"), key: read("key.pem") };
  if (!tls.ca && !tls.cert && !tls.key) {
    throw new RangeError(`DOCKER_CERT_PATH ${certPath} holds none of ca.pem, cert.pem, key.pem`);
  }
  return Object.fromEntries(Object.entries(tls).filter(([, v]) => v !== undefined));
}

/** The connection a worker's config names: `DOCKER_HOST` and, for TLS, `DOCKER_CERT_PATH`. */
export function dockerConnectionFromEnv(
  dockerHost: string | null,
  certPath: string | null,
): DockerConnection | undefined {
  if (dockerHost === null && certPath === null) return undefined;
  if (dockerHost !== null && certPath !== null) {
    const options = dockerOptionsFromEndpoint(dockerHost);
    // Certificates given: a daemon over TCP is spoken to over TLS whatever its port (only 2376
    // implied it), or they went unused and the client spoke plain HTTP to a TLS port.
    if (options.host !== undefined)
      return { ...options, protocol: "https", ...dockerTlsFromCertPath(certPath) };
  }
  return {
    ...(dockerHost === null ? {} : { endpoint: dockerHost }),
    ...(certPath === null ? {} : dockerTlsFromCertPath(certPath)),
  };
}
