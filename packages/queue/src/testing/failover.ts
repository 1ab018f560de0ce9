import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Redis } from "ioredis";
import { createRedis } from "../connection.ts";
import { freeLoopbackPort, LocalRedisServer } from "../local-redis.ts";
import { TcpProxy } from "./tcp-proxy.ts";
import { type TestCertificates, tlsServerArgs } from "./tls.ts";

async function poll(what: string, check: () => Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting until ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

function field(info: string, name: string): string | undefined {
  return new RegExp(`^${name}:(\\S+)`, "m").exec(info)?.[1];
}

/** `redis-server` arguments for a master a test's replica syncs from: the first sync at once, not 5 s later. */
export const REPLICATION_ARGS = ["--repl-diskless-sync-delay", "0"] as const;

/** Make `replica` (an admin connection to it) a replica of the Redis on loopback `masterPort`, in sync. */
export async function replicate(replica: Redis, masterPort: number): Promise<void> {
  await replica.call("REPLICAOF", "127.0.0.1", String(masterPort));
  await poll(
    `the replica's link to port ${masterPort} is up`,
    async () => field(await replica.info("replication"), "master_link_status") === "up",
  );
}

/**
 * A manual failover from the master `from` to its replica `to` (admin connections to each), as a
 * managed Redis does one: writes paused on `from` until `to` has every one of them, `to`
 * promoted, the name clients use (`proxy`) moved to `to`, and `from` made `to`'s replica. Clients
 * connected before stay connected to `from`: their writes get `READONLY` from now on.
 */
export async function failOver(from: Redis, to: Redis, toPort: number, proxy: TcpProxy): Promise<void> {
  // Paused longer than the wait below may take: a pause that lapsed would let writes in unseen.
  await from.call("CLIENT", "PAUSE", "30000", "WRITE");
  try {
    const offset = Number(field(await from.info("replication"), "master_repl_offset"));
    await poll(
      "the replica has every write",
      async () => Number(field(await to.info("replication"), "master_repl_offset")) >= offset,
    );
    await to.call("REPLICAOF", "NO", "ONE");
    proxy.retarget(toPort);
    await from.call("REPLICAOF", "127.0.0.1", String(toPort));
  } finally {
    await from.call("CLIENT", "UNPAUSE");
  }
}

/**
 * Two Redis servers of a test's own behind one name: `a` the master, `b` its replica in sync,
 * and `proxy` (the name: `url`) leading to `a`; `failOver()` moves the name to `b` and demotes
 * `a` (see `failOver`). `adminA` and `adminB` are connections of the test's straight to each.
 */
export class FailoverPair {
  private readonly connections: Redis[] = [];

  private constructor(
    readonly a: LocalRedisServer,
    readonly b: LocalRedisServer,
    readonly adminA: Redis,
    readonly adminB: Redis,
    readonly proxy: TcpProxy,
    private readonly dir: string,
    /** With `tls`: the TLS port each serves beside its plain one (the admins' and the proxy's). */
    readonly tlsPorts: { a: number; b: number } | null = null,
  ) {}

  /**
   * With `tls`, each also serves TLS (`certs`' server certificate, no client certificate asked)
   * on a port of its own, and B replicates from A over it (`tls-replication yes`), announcing
   * its TLS port: what a sentinel started with `tls` watches and hands out.
   */
  static async start(options: { tls?: TestCertificates } = {}): Promise<FailoverPair> {
    const dir = mkdtempSync(join(tmpdir(), "fleet-failover-"));
    const started: LocalRedisServer[] = [];
    const admins: Redis[] = [];
    try {
      const tlsPorts = options.tls ? { a: await freeLoopbackPort(), b: await freeLoopbackPort() } : null;
      for (const name of ["a", "b"] as const) {
        mkdirSync(join(dir, name));
        const tlsArgs =
          options.tls && tlsPorts
            ? [...tlsServerArgs(options.tls, tlsPorts[name]), "--tls-replication", "yes"]
            : [];
        started.push(
          await LocalRedisServer.start({ dir: join(dir, name), args: [...REPLICATION_ARGS, ...tlsArgs] }),
        );
      }
      const [a, b] = started as [LocalRedisServer, LocalRedisServer];
      admins.push(new Redis(a.url), new Redis(b.url));
      const [adminA, adminB] = admins as [Redis, Redis];
      await replicate(adminB, tlsPorts ? tlsPorts.a : a.port);
      return new FailoverPair(a, b, adminA, adminB, await TcpProxy.start(a.port), dir, tlsPorts);
    } catch (err) {
      for (const c of admins) c.disconnect();
      await Promise.all(started.map((s) => s.kill()));
      rmSync(dir, { recursive: true, force: true });
      throw err;
    }
  }

  /** A fleet connection (`createRedis`) through the name; `stop` closes it. */
  connect(): Redis {
    const conn = createRedis(this.url);
    conn.on("error", () => undefined);
    this.connections.push(conn);
    return conn;
  }

  /** The name the fleet is given. */
  get url(): string {
    return this.proxy.url;
  }

  failOver(): Promise<void> {
    return failOver(this.adminA, this.adminB, this.b.port, this.proxy);
  }

  async stop(): Promise<void> {
    for (const conn of this.connections.splice(0)) conn.disconnect();
    this.adminA.disconnect();
    this.adminB.disconnect();
    await this.proxy.close();
    await Promise.all([this.a.kill(), this.b.kill()]);
    rmSync(this.dir, { recursive: true, force: true });
  }
}
