import { existsSync, mkdtempSync, rmSync, unlinkSync } from "node:fs";
import { connect, createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

/**
 * A unix-socket proxy in front of the Docker daemon. The fleet's workers reach Docker only
 * through it (`DOCKER_HOST=unix://<socketPath>`), so `cut()` makes the daemon unreachable for
 * them alone (every open connection dropped, the socket gone: connect fails with ENOENT, as
 * when dockerd is stopped), and `restore()` brings it back. Other users of the daemon are not
 * disturbed. Half-closes pass through, as on a direct connection: an exec's client ends its
 * stdin and still reads the output that follows.
 */
export class DockerProxy {
  readonly socketPath: string;
  private readonly dir: string;
  private server: Server | null = null;
  private readonly open = new Set<Socket>();
  connections = 0;
  outages = 0;

  private constructor(private readonly target: string) {
    this.dir = mkdtempSync(join(tmpdir(), "fleet-docker-proxy-"));
    this.socketPath = join(this.dir, "docker.sock");
  }

  get endpoint(): string {
    return `unix://${this.socketPath}`;
  }

  get isUp(): boolean {
    return this.server !== null;
  }

  static async start(target = "/var/run/docker.sock"): Promise<DockerProxy> {
    const proxy = new DockerProxy(target);
    await proxy.listen();
    return proxy;
  }

  private async listen(): Promise<void> {
    if (existsSync(this.socketPath)) unlinkSync(this.socketPath);
    const server = createServer({ allowHalfOpen: true }, (client) => {
      this.connections++;
      const upstream = connect({ path: this.target, allowHalfOpen: true });
      this.open.add(client);
      this.open.add(upstream);
      const drop = () => {
        client.destroy();
        upstream.destroy();
        this.open.delete(client);
        this.open.delete(upstream);
      };
      client.on("error", drop);
      upstream.on("error", drop);
      client.on("close", drop);
      upstream.on("close", drop);
      client.pipe(upstream);
      upstream.pipe(client);
    });
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(this.socketPath, () => resolve());
    });
    this.server = server;
  }

  /** The daemon goes away: drop every connection and stop accepting. */
  async cut(): Promise<void> {
    const server = this.server;
    if (!server) return;
    this.server = null;
    this.outages++;
    const closed = new Promise<void>((resolve) => server.close(() => resolve()));
    for (const s of this.open) s.destroy();
    this.open.clear();
    await closed;
    if (existsSync(this.socketPath)) unlinkSync(this.socketPath);
  }

  /** The daemon is back. */
  async restore(): Promise<void> {
    if (this.server) return;
    await this.listen();
  }

  async close(): Promise<void> {
    await this.cut();
    rmSync(this.dir, { recursive: true, force: true });
  }
}
