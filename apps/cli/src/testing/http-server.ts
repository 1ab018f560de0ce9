import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

/** A request the test server received, body read in full. */
export interface RecordedRequest {
  method: string;
  path: string;
  headers: IncomingMessage["headers"];
  body: string;
}

export type Handler = (req: RecordedRequest, res: ServerResponse) => void | Promise<void>;

export interface TestServer {
  url: string;
  requests: RecordedRequest[];
  /**
   * While true, the server acts as unreachable: every connection and request is cut without an
   * answer (the client sees a connection failure), counted in `dropped`.
   */
  down: boolean;
  readonly dropped: number;
  /**
   * The next this many connections are reset (RST) as soon as they are made, as a dispatcher not
   * listening yet refuses them: the client sees the failure at once, counting down to 0. (A
   * connection `down` cuts can leave the client waiting for its timeout.)
   */
  refuse: number;
  /** Route `METHOD /path` to a handler; unrouted requests get 404 with the API's error body. */
  on(method: string, path: string, handler: Handler): void;
  close(): Promise<void>;
}

/** Reply with JSON. */
export function json(
  res: ServerResponse,
  status: number,
  body: unknown,
  headers: Record<string, string> = {},
): void {
  res.writeHead(status, { "content-type": "application/json", ...headers }).end(JSON.stringify(body));
}

/** Reply with the dispatcher's error body. */
export function apiError(
  res: ServerResponse,
  status: number,
  code: string,
  message: string,
  details?: unknown,
): void {
  json(res, status, { error: { code, message, details: details ?? null } });
}

/** A real HTTP server on 127.0.0.1 (ephemeral port) standing in for the dispatcher. */
export async function startTestServer(): Promise<TestServer> {
  const routes = new Map<string, Handler>();
  const requests: RecordedRequest[] = [];
  const state = { down: false, dropped: 0, refuse: 0 };
  const server = createServer((req, res) => {
    if (state.down) {
      state.dropped++;
      req.socket.destroy();
      return;
    }
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => {
      const recorded: RecordedRequest = {
        method: req.method ?? "",
        path: req.url ?? "",
        headers: req.headers,
        body: Buffer.concat(chunks).toString("utf8"),
      };
      requests.push(recorded);
      const handler = routes.get(`${recorded.method} ${recorded.path}`);
      if (handler === undefined) {
        apiError(res, 404, "not_found", `no route ${recorded.method} ${recorded.path}`);
        return;
      }
      Promise.resolve(handler(recorded, res)).catch((err: unknown) => {
        if (!res.headersSent) apiError(res, 500, "internal", String(err));
        else res.destroy();
      });
    });
  });
  server.on("connection", (socket) => {
    if (state.refuse > 0) {
      state.refuse--;
      socket.resetAndDestroy();
      return;
    }
    if (state.down) {
      state.dropped++;
      socket.destroy();
    }
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    requests,
    get down() {
      return state.down;
    },
    set down(value: boolean) {
      state.down = value;
    },
    get dropped() {
      return state.dropped;
    },
    get refuse() {
      return state.refuse;
    },
    set refuse(value: number) {
      state.refuse = value;
    },
    on(method, path, handler) {
      routes.set(`${method} ${path}`, handler);
    },
    close() {
      return new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections();
      });
    },
  };
}
