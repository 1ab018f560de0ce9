import { type ChildProcess, spawn } from "node:child_process";
import { createServer } from "node:net";
import { join } from "node:path";
import { Redis } from "ioredis";

/** A TCP port on loopback that nothing listened on a moment ago (another process may take it since). */
export async function freeLoopbackPort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const address = srv.address();
      const port = typeof address === "object" && address ? address.port : 0;
      srv.close(() => resolve(port));
    });
  });
}

export interface LocalRedisOptions {
  /** Its data directory (AOF, log). */
  dir: string;
  /** A fixed port; by default a free one, chosen again when another process takes it first. */
  port?: number;
  /**
   * More `redis-server` arguments. They come after the fleet's durability settings (AOF fsynced
   * on every write, `noeviction`) and win over them: `["--appendfsync", "everysec"]`.
   */
  args?: readonly string[];
  /** Its own process group: a Ctrl-C to this process's group does not reach it (see `scripts/demo.ts`). */
  detached?: boolean;
  /** How long it may take to answer PING with its AOF loaded. @defaultValue 20 s */
  readyTimeoutMs?: number;
}

/** The fleet's durability settings (what `assertRedisDurable` asks of a Redis). */
const DURABLE_ARGS = [
  ...["--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction"],
] as const;

/**
 * A `redis-server` of this process's own, on loopback: the demo's embedded Redis, and the tests'
 * that must not disturb the shared one (restart it, fill it, configure it wrongly). Needs
 * `redis-server` on PATH. On a port chosen for it, a server that exits because another process
 * took the port first is started again on another.
 */
export class LocalRedisServer {
  private proc: ChildProcess | null = null;
  private exited: Promise<void> = Promise.resolve();
  private stderr = "";

  private constructor(
    private port_: number,
    private readonly options: LocalRedisOptions,
  ) {}

  get port(): number {
    return this.port_;
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port_}`;
  }

  /** Its process, while it runs. */
  get process(): ChildProcess | null {
    return this.proc;
  }

  /** Start one and wait until it answers with its AOF loaded. */
  static async start(options: LocalRedisOptions): Promise<LocalRedisServer> {
    for (let tries = 1; ; tries++) {
      const server = new LocalRedisServer(options.port ?? (await freeLoopbackPort()), options);
      try {
        await server.launch();
        return server;
      } catch (err) {
        // Taken between our check and its bind: another port, a few times.
        if (options.port !== undefined || !(err instanceof PortTakenError) || tries >= 5) throw err;
      }
    }
  }

  /** Start it again on the same port and directory (after `kill`). */
  async relaunch(): Promise<void> {
    await this.launch();
  }

  /** Stop it (`SIGTERM`: it flushes its AOF and exits; `SIGKILL`: a crash) and wait for its exit. */
  async kill(signal: NodeJS.Signals = "SIGKILL"): Promise<void> {
    const proc = this.proc;
    if (!proc || proc.exitCode !== null || proc.signalCode !== null) return;
    proc.kill(signal);
    await this.exited;
    this.proc = null;
  }

  private async launch(): Promise<void> {
    // biome-ignore format: one flag per pair
    const args = [
      "--bind", "127.0.0.1", "--port", String(this.port_), "--dir", this.options.dir, "--save", "",
      "--logfile", join(this.options.dir, "redis.log"),
      ...DURABLE_ARGS, ...(this.options.args ?? []),
    ];
    const proc = spawn("redis-server", args, {
      // stderr: what it says when it cannot start (before its log file is open).
      stdio: ["ignore", "ignore", "pipe"],
      ...(this.options.detached ? { detached: true } : {}),
    });
    this.proc = proc;
    this.stderr = "";
    proc.stderr?.setEncoding("utf8");
    proc.stderr?.on("data", (chunk: string) => {
      this.stderr = (this.stderr + chunk).slice(-2_000);
    });
    let ended = false;
    this.exited = new Promise((resolve) =>
      proc.once("close", () => {
        ended = true;
        resolve();
      }),
    );
    const failed = new Promise<never>((_, reject) => proc.once("error", reject));
    failed.catch(() => undefined);
    await Promise.race([this.waitReady(() => ended), failed]);
  }

  /**
   * Until it answers with its AOF loaded: it, not a server another process started on the port
   * (its process id); one that exited first fails it.
   */
  private async waitReady(ended: () => boolean): Promise<void> {
    const end = Date.now() + (this.options.readyTimeoutMs ?? 20_000);
    for (;;) {
      if (ended()) {
        this.proc = null;
        if (!(await isFree(this.port_))) throw new PortTakenError(this.port_);
        const said = this.stderr.trim();
        throw new Error(
          `redis-server on port ${this.port_} exited at start${said ? `: ${said}` : ""}; see ${this.options.dir}/redis.log`,
        );
      }
      // Bounded: what listens on the port may not be a Redis, and never answer.
      const client = new Redis(this.url, {
        lazyConnect: true,
        maxRetriesPerRequest: 0,
        retryStrategy: () => null,
        enableReadyCheck: false, // the INFO below is the check, bounded
        connectTimeout: 1_000,
        commandTimeout: 1_000,
      });
      client.on("error", () => undefined);
      try {
        await client.connect();
        const info = await client.info();
        if (info.includes(`process_id:${this.proc?.pid}\r`) && /loading:0/.test(info)) return;
      } catch {
        // not up yet
      } finally {
        client.disconnect();
      }
      if (Date.now() > end) {
        await this.kill();
        throw new Error(
          `redis-server on port ${this.port_} did not come up; see ${this.options.dir}/redis.log`,
        );
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }
}

class PortTakenError extends Error {
  constructor(port: number) {
    super(`port ${port} was taken before redis-server could bind it`);
  }
}

/** Whether nothing listens on the loopback port now. */
async function isFree(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const srv = createServer();
    srv.once("error", () => resolve(false));
    srv.listen(port, "127.0.0.1", () => srv.close(() => resolve(true)));
  });
}
