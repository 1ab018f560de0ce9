import { type ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Redis } from "ioredis";
import { freePort } from "../../../scripts/lib/fleet-processes.ts";

export interface PrivateRedisOptions {
  /** `always` makes a SIGKILL lose nothing; `everysec` is Redis's default. @defaultValue "always" */
  appendfsync?: "always" | "everysec";
}

/**
 * A redis-server of the test's own (free port, own directory, AOF, noeviction), so that
 * restarting it disturbs no other test using the shared Redis.
 */
export class PrivateRedis {
  private proc: ChildProcess | null = null;
  private exited: Promise<void> = Promise.resolve();
  restarts = 0;

  private constructor(
    readonly port: number,
    readonly dir: string,
    private readonly options: PrivateRedisOptions,
  ) {}

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  static async start(options: PrivateRedisOptions = {}): Promise<PrivateRedis> {
    const dir = mkdtempSync(join(tmpdir(), "fleet-chaos-redis-"));
    const redis = new PrivateRedis(await freePort(), dir, options);
    await redis.launch();
    return redis;
  }

  private async launch(): Promise<void> {
    const args = [
      "--bind",
      "127.0.0.1",
      "--port",
      String(this.port),
      "--dir",
      this.dir,
      "--appendonly",
      "yes",
      "--appendfsync",
      this.options.appendfsync ?? "always",
      "--maxmemory-policy",
      "noeviction",
      "--save",
      "",
      "--logfile",
      join(this.dir, "redis.log"),
    ];
    const proc = spawn("redis-server", args, { stdio: "ignore" });
    this.proc = proc;
    this.exited = new Promise((resolve) => proc.once("exit", () => resolve()));
    await this.waitReady();
  }

  /** Until PING answers and the AOF is loaded. */
  private async waitReady(timeoutMs = 20_000): Promise<void> {
    const end = Date.now() + timeoutMs;
    for (;;) {
      const client = new Redis(this.url, {
        lazyConnect: true,
        maxRetriesPerRequest: 0,
        retryStrategy: () => null,
      });
      client.on("error", () => undefined);
      try {
        await client.connect();
        const info = await client.info("persistence");
        if (/loading:0/.test(info)) return;
      } catch {
        // not up yet
      } finally {
        client.disconnect();
      }
      if (Date.now() > end) throw new Error(`private redis on ${this.port} did not come up; see ${this.dir}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  /**
   * Stop the server (`SIGTERM`: Redis flushes its AOF and exits; `SIGKILL`: a crash), keep it
   * down for `downMs`, start it again on the same port and directory.
   */
  async restart(options: { signal?: "SIGTERM" | "SIGKILL"; downMs?: number } = {}): Promise<void> {
    await this.stopProcess(options.signal ?? "SIGTERM");
    if (options.downMs) await new Promise((r) => setTimeout(r, options.downMs));
    await this.relaunch();
  }

  /** Crash the server (SIGKILL) and keep it down until `relaunch`. */
  async crash(): Promise<void> {
    await this.stopProcess("SIGKILL");
  }

  /** Start it again on the same port and directory, after `crash`. */
  async relaunch(): Promise<void> {
    await this.launch();
    this.restarts++;
  }

  private async stopProcess(signal: NodeJS.Signals): Promise<void> {
    const proc = this.proc;
    if (!proc || proc.exitCode !== null || proc.signalCode !== null) return;
    proc.kill(signal);
    await this.exited;
    this.proc = null;
  }

  async stop(): Promise<void> {
    await this.stopProcess("SIGTERM");
    rmSync(this.dir, { recursive: true, force: true });
  }
}
