import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import type { Registry } from "prom-client";

export interface MetricsServerOptions {
  registry: Registry;
  /** `0` picks a free port (see the returned `port`). */
  port: number;
  /** @defaultValue `"127.0.0.1"` (use `0.0.0.0` in a container that Prometheus scrapes) */
  host?: string;
}

export interface MetricsServer {
  /** The port actually bound. */
  port: number;
  host: string;
  /** Stop listening and drop open connections. Idempotent. */
  close(): Promise<void>;
}

/**
 * A tiny HTTP server for a worker's metrics: `GET /metrics` (Prometheus text format) and
 * `GET /healthz`. Anything else is 404, any other method 405.
 */
export async function startMetricsServer(options: MetricsServerOptions): Promise<MetricsServer> {
  const { registry } = options;
  const host = options.host ?? "127.0.0.1";
  const server = createServer((req, res) => {
    const path = (req.url ?? "/").split("?")[0];
    if (req.method !== "GET" && req.method !== "HEAD") {
      res.writeHead(405, { allow: "GET, HEAD", "content-type": "text/plain" }).end("method not allowed\n");
      return;
    }
    if (path === "/healthz") {
      res.writeHead(200, { "content-type": "application/json" }).end('{"status":"ok"}\n');
      return;
    }
    if (path !== "/metrics") {
      res.writeHead(404, { "content-type": "text/plain" }).end("not found\n");
      return;
    }
    registry.metrics().then(
      (text) => {
        res.writeHead(200, { "content-type": registry.contentType }).end(req.method === "HEAD" ? "" : text);
      },
      (err: unknown) => {
        res
          .writeHead(500, { "content-type": "text/plain" })
          .end(`metrics collection failed: ${err instanceof Error ? err.message : String(err)}\n`);
      },
    );
  });
  server.keepAliveTimeout = 5_000;
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(options.port, host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const port = (server.address() as AddressInfo).port;
  let closing: Promise<void> | undefined;
  return {
    port,
    host,
    close() {
      closing ??= new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
        server.closeAllConnections();
      });
      return closing;
    },
  };
}
