import { type ChildProcess, execFile, spawn } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { type TestCertificates, tlsServerArgs } from "./tls.ts";

/**
 * Test-only: a Redis Cluster of `redis-server` processes on loopback, for simulating the fleet's
 * scale-out (DESIGN §8). Needs `redis-server` and `redis-cli` on PATH.
 */
export interface LoopbackRedisCluster {
  /** The masters' ports. */
  readonly ports: number[];
  /** With `tls`: the masters' TLS ports, in the same order (else empty). */
  readonly tlsPorts: number[];
  /** `redis-cluster://127.0.0.1:P1,127.0.0.1:P2,...` (with `tls`: `rediss-cluster://` to the TLS ports) */
  readonly url: string;
  /** `redis-cli -p <port> <args>` on one node; resolves its stdout. */
  cli(port: number, ...args: string[]): Promise<string>;
  /** Kill every node and delete its data directory. */
  stop(): Promise<void>;
}

const run = promisify(execFile);

/** A port free for both the node and its cluster bus (port + 10000). */
async function freePort(): Promise<number> {
  const listen = (port: number) =>
    new Promise<number | null>((resolve) => {
      const s = createServer();
      s.once("error", () => resolve(null));
      s.listen(port, "127.0.0.1", () => {
        const p = (s.address() as { port: number }).port;
        s.close(() => resolve(p));
      });
    });
  for (;;) {
    const port = 20_000 + Math.floor(Math.random() * 20_000);
    if ((await listen(port)) !== null && (await listen(port + 10_000)) !== null) return port;
  }
}

async function waitFor(what: string, check: () => Promise<boolean>, timeoutMs = 20_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  for (;;) {
    if (await check().catch(() => false)) return;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

const cli = async (port: number, ...args: string[]) =>
  (await run("redis-cli", ["-h", "127.0.0.1", "-p", String(port), ...args])).stdout;

/**
 * Start a Redis Cluster of `masters` (default 3, no replicas) on loopback, durable as the fleet
 * requires (AOF, noeviction), in a temp dir that `stop` removes; resolves once every node
 * reports `cluster_state:ok`. With `tls`, each node also serves TLS (`certs`' server certificate)
 * on a port of its own, its cluster bus speaks TLS, and the URL names the TLS ports (the plain
 * ones stay for `cli`).
 */
export async function startLoopbackRedisCluster(
  options: {
    masters?: number;
    tls?: TestCertificates;
    /** A name each node announces itself by (`cluster-announce-hostname`), handed out instead of its IP; the URL uses it. */
    announceHostname?: string;
  } = {},
): Promise<LoopbackRedisCluster> {
  const masters = options.masters ?? 3;
  const dir = mkdtempSync(join(tmpdir(), "fleet-cluster-"));
  const ports: number[] = [];
  const tlsPorts: number[] = [];
  while (ports.length < masters) {
    const p = await freePort();
    if (!ports.includes(p)) ports.push(p);
  }
  while (options.tls && tlsPorts.length < masters) {
    const p = await freePort();
    if (!ports.includes(p) && !tlsPorts.includes(p)) tlsPorts.push(p);
  }
  const children: ChildProcess[] = ports.map((port, i) => {
    mkdirSync(join(dir, String(port)));
    const tls = options.tls ? [...tlsServerArgs(options.tls, tlsPorts[i]!), "--tls-cluster", "yes"] : [];
    const host = options.announceHostname;
    // biome-ignore format: one flag per pair
    const named = host === undefined ? [] : [
      "--cluster-announce-hostname", host, "--cluster-preferred-endpoint-type", "hostname",
    ];
    // biome-ignore format: one flag per pair
    return spawn("redis-server", [
      "--port", String(port), "--bind", "127.0.0.1", "--dir", join(dir, String(port)),
      "--cluster-enabled", "yes", "--cluster-config-file", join(dir, `nodes-${port}.conf`),
      "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction", "--save", "",
      ...tls, ...named,
    ], { stdio: "ignore" });
  });
  const stop = async () => {
    await Promise.all(
      children.map(
        (c) =>
          new Promise<void>((resolve) => {
            if (c.exitCode !== null || c.signalCode !== null) return resolve();
            c.once("exit", () => resolve());
            c.kill("SIGKILL");
          }),
      ),
    );
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    for (const port of ports)
      await waitFor(`redis on ${port}`, async () => (await cli(port, "ping")).includes("PONG"));
    await run("redis-cli", [
      "--cluster",
      "create",
      ...ports.map((p) => `127.0.0.1:${p}`),
      "--cluster-replicas",
      "0",
      "--cluster-yes",
    ]);
    for (const port of ports) {
      await waitFor(`cluster_state:ok on ${port}`, async () =>
        (await cli(port, "cluster", "info")).includes("cluster_state:ok"),
      );
    }
  } catch (err) {
    await stop();
    throw err;
  }
  const host = options.announceHostname ?? "127.0.0.1";
  const url = options.tls
    ? `rediss-cluster://${tlsPorts.map((p) => `${host}:${p}`).join(",")}`
    : `redis-cluster://${ports.map((p) => `${host}:${p}`).join(",")}`;
  return { ports, tlsPorts, url, cli, stop };
}
