import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { LocalRedisServer } from "@fleet/queue";

export interface PrivateRedisOptions {
  /** `always` makes a SIGKILL lose nothing; `everysec` is Redis's default. @defaultValue "always" */
  appendfsync?: "always" | "everysec";
}

/**
 * A redis-server of the test's own (free port, own directory, AOF, noeviction), so that
 * restarting it disturbs no other test using the shared Redis.
 */
export class PrivateRedis {
  restarts = 0;

  private constructor(
    private readonly server: LocalRedisServer,
    readonly dir: string,
  ) {}

  get port(): number {
    return this.server.port;
  }

  get url(): string {
    return this.server.url;
  }

  static async start(options: PrivateRedisOptions = {}): Promise<PrivateRedis> {
    const dir = mkdtempSync(join(tmpdir(), "fleet-chaos-redis-"));
    const server = await LocalRedisServer.start({
      dir,
      args: ["--appendfsync", options.appendfsync ?? "always"],
    });
    return new PrivateRedis(server, dir);
  }

  /**
   * Stop the server (`SIGTERM`: Redis flushes its AOF and exits; `SIGKILL`: a crash), keep it
   * down for `downMs`, start it again on the same port and directory.
   */
  async restart(options: { signal?: "SIGTERM" | "SIGKILL"; downMs?: number } = {}): Promise<void> {
    await this.server.kill(options.signal ?? "SIGTERM");
    if (options.downMs) await new Promise((r) => setTimeout(r, options.downMs));
    await this.relaunch();
  }

  /** Crash the server (SIGKILL) and keep it down until `relaunch`. */
  async crash(): Promise<void> {
    await this.server.kill("SIGKILL");
  }

  /** Start it again on the same port and directory, after `crash`. */
  async relaunch(): Promise<void> {
    await this.server.relaunch();
    this.restarts++;
  }

  async stop(): Promise<void> {
    await this.server.kill("SIGTERM");
    rmSync(this.dir, { recursive: true, force: true });
  }
}
