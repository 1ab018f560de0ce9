import { connect, createServer, type Server, type Socket } from "node:net";

/**
 * A TCP forwarder on loopback standing for a name that moves: what a Redis URL's host name, a
 * cloud provider's endpoint or a sentinel-less load balancer does at a failover. New connections
 * go to the current target; connections made before `retarget` stay on the old one, as a TCP
 * connection to a re-pointed DNS name does.
 */
export class TcpProxy {
  private constructor(
    private readonly server: Server,
    private readonly sockets: Set<Socket>,
    private readonly setTarget: (port: number) => void,
    readonly port: number,
  ) {}

  /** Listen on a free loopback port, forwarding to `127.0.0.1:targetPort`. */
  static async start(targetPort: number): Promise<TcpProxy> {
    const sockets = new Set<Socket>();
    let target = targetPort;
    const server = createServer((client) => {
      const upstream = connect(target, "127.0.0.1");
      for (const s of [client, upstream]) {
        sockets.add(s);
        s.once("close", () => sockets.delete(s));
      }
      client.pipe(upstream);
      upstream.pipe(client);
      // Either side going ends both, as a dropped connection would.
      client.once("error", () => upstream.destroy());
      upstream.once("error", () => client.destroy());
      client.once("close", () => upstream.destroy());
      upstream.once("close", () => client.destroy());
    });
    const port = await new Promise<number>((resolve, reject) => {
      server.once("error", reject);
      server.listen(0, "127.0.0.1", () => {
        const address = server.address();
        resolve(typeof address === "object" && address ? address.port : 0);
      });
    });
    return new TcpProxy(
      server,
      sockets,
      (p) => {
        target = p;
      },
      port,
    );
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  /** Connections made from now on go to `targetPort`; open ones stay where they are. */
  retarget(targetPort: number): void {
    this.setTarget(targetPort);
  }

  /** Stop listening and drop every forwarded connection. */
  async close(): Promise<void> {
    for (const s of this.sockets) s.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}
