import { type ChildProcess, spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { Redis } from "ioredis";
import { freeLoopbackPort } from "../local-redis.ts";
import { type TestCertificates, tlsServerArgs } from "./tls.ts";

async function poll(what: string, check: () => Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check().catch(() => false))) {
    if (Date.now() > end) throw new Error(`timed out waiting until ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/**
 * A Redis Sentinel of a test's own on loopback (`redis-server --sentinel`), watching the master
 * on `masterPort` as `name` with a quorum of one. `admin` is a connection to it. With `password`,
 * it asks its clients for that password (`requirepass`), and `url` carries it. With `tls`, it
 * also listens for TLS on `tlsPort`, speaks TLS to the master (whose `masterPort` is then its TLS
 * one), and `url` is a `rediss-sentinel://` to that port; `admin` stays on the plain one.
 */
export class LocalSentinel {
  private constructor(
    private readonly proc: ChildProcess,
    readonly port: number,
    readonly name: string,
    readonly admin: Redis,
    readonly password: string | null,
    readonly tlsPort: number | null,
  ) {}

  static async start(
    dir: string,
    masterPort: number,
    name = "fleetmaster",
    options: { password?: string; tls?: TestCertificates } = {},
  ): Promise<LocalSentinel> {
    const password = options.password ?? null;
    const port = await freeLoopbackPort();
    const tlsPort = options.tls ? await freeLoopbackPort() : null;
    const tlsLines: string[] = [];
    if (options.tls && tlsPort !== null) {
      const args = tlsServerArgs(options.tls, tlsPort);
      for (let i = 0; i < args.length; i += 2) tlsLines.push(`${args[i]!.slice(2)} ${args[i + 1]}`);
      tlsLines.push("tls-replication yes");
    }
    const conf = join(dir, `sentinel-${port}.conf`);
    // Its config file must be writable: a sentinel records what it learns there.
    writeFileSync(
      conf,
      [
        `port ${port}`,
        "bind 127.0.0.1",
        `dir ${dir}`,
        `logfile ${join(dir, `sentinel-${port}.log`)}`,
        `sentinel monitor ${name} 127.0.0.1 ${masterPort} 1`,
        // Only the failovers a test asks for (`failOver`): one of its own, after a master slow to
        // answer for 2 s (fsyncs under a loaded CI host), promoted the old master mid-resync, its
        // data flushed, and every record was lost (the CI failures of the Sentinel failover test).
        `sentinel down-after-milliseconds ${name} 60000`,
        `sentinel failover-timeout ${name} 10000`,
        ...(password === null ? [] : [`requirepass "${password}"`]),
        ...tlsLines,
        "",
      ].join("\n"),
    );
    const proc = spawn("redis-server", [conf, "--sentinel"], { stdio: "ignore" });
    // Not started (no redis-server): said by the wait below, not as an unheard 'error'.
    proc.on("error", () => undefined);
    const admin = new Redis({
      port,
      host: "127.0.0.1",
      lazyConnect: true,
      retryStrategy: () => 50,
      ...(password === null ? {} : { password }),
    });
    admin.on("error", () => undefined);
    const sentinel = new LocalSentinel(proc, port, name, admin, password, tlsPort);
    try {
      await poll(`the sentinel on ${port} answers`, async () => (await admin.ping()) === "PONG");
    } catch (err) {
      await sentinel.stop();
      throw err;
    }
    return sentinel;
  }

  get url(): string {
    const auth = this.password === null ? "" : `?sentinelPassword=${encodeURIComponent(this.password)}`;
    if (this.tlsPort !== null) return `rediss-sentinel://127.0.0.1:${this.tlsPort}/${this.name}${auth}`;
    return `redis-sentinel://127.0.0.1:${this.port}/${this.name}${auth}`;
  }

  /** The port of the master it names now. */
  async masterPort(): Promise<number> {
    const [, port] = (await this.admin.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", this.name)) as string[];
    return Number(port);
  }

  /**
   * A failover it runs (`SENTINEL FAILOVER`), once it knows a replica to promote; resolves when
   * it names the new master.
   */
  async failOver(): Promise<number> {
    const before = await this.masterPort();
    await poll("the sentinel knows a replica it can promote", async () => {
      const replicas = (await this.admin.call("SENTINEL", "REPLICAS", this.name)) as string[][];
      return replicas.some((fields) => {
        const flags = fields[fields.indexOf("flags") + 1] ?? "";
        const link = fields[fields.indexOf("master-link-status") + 1];
        return flags === "slave" && link === "ok";
      });
    });
    await this.admin.call("SENTINEL", "FAILOVER", this.name);
    await poll("the sentinel names the new master", async () => (await this.masterPort()) !== before);
    return this.masterPort();
  }

  async stop(): Promise<void> {
    this.admin.disconnect();
    if (this.proc.exitCode !== null || this.proc.signalCode !== null || this.proc.pid === undefined) return;
    const exited = new Promise((r) => this.proc.once("exit", r));
    this.proc.kill("SIGKILL");
    // A SIGKILL ends it; bounded all the same, so a cleanup never hangs a test run.
    await Promise.race([exited, new Promise((r) => setTimeout(r, 5_000).unref())]);
  }
}
