import { type ChildProcess, spawn } from "node:child_process";
import { createWriteStream, mkdirSync, type WriteStream } from "node:fs";
import { constants as osConstants } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { freeLoopbackPort } from "@fleet/queue";

/** The fleet's processes, each a separate `node` running an app's `src/main.ts` through tsx. */
export const APP_MAIN = {
  dispatcher: "apps/dispatcher/src/main.ts",
  resources: "apps/resources-worker/src/main.ts",
  agent: "apps/agent-worker/src/main.ts",
  verifier: "apps/verifier-worker/src/main.ts",
  janitor: "apps/janitor/src/main.ts",
} as const;
export type AppKind = keyof typeof APP_MAIN;

export const REPO_ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");

/**
 * Run a command to its end on this process's terminal (stdin ignored) and resolve its exit code
 * (128 + the signal's number when a signal ended it). Unlike `execFileSync`, it leaves the event
 * loop running meanwhile: a `FleetProcesses` fleet logs through pipes that only this process's
 * event loop drains, and a process whose pipe is full (64 KiB of logs: five minutes of a CLI's
 * status polls in the dispatcher's) stops dead, mid-request, until it is drained.
 */
export function runAttached(
  file: string,
  args: readonly string[],
  env: NodeJS.ProcessEnv,
  signal?: AbortSignal,
): Promise<number> {
  return new Promise((resolveExit, reject) => {
    // `signal`: the command is stopped (SIGTERM) and the promise rejects with the signal's reason.
    const child = spawn(file, args, { env, stdio: ["ignore", "inherit", "inherit"], signal });
    child.once("error", (err) => reject(signal?.aborted ? signal.reason : err));
    child.once("exit", (code, signal) =>
      resolveExit(code ?? 128 + (signal ? (osConstants.signals[signal] ?? 0) : 0)),
    );
  });
}

export interface FleetProcessOptions {
  redisUrl: string;
  prefix: string;
  replicas?: Partial<Record<AppKind, number>>;
  /** Extra environment for every process (e.g. FLEET_LOCK_DURATION_MS for fast failover). */
  env?: Record<string, string>;
  /** Extra environment for one kind of process, over `env`. */
  envOf?: Partial<Record<AppKind, Record<string, string>>>;
  /** Where each process's output goes (`<kind>-<i>.log`). */
  logDir: string;
  token?: string;
}

export interface FleetProcess {
  kind: AppKind;
  index: number;
  child: ChildProcess;
  log: WriteStream;
  /** Resolves when the process exited and its output is in `log`. */
  exited: Promise<number | null>;
  /**
   * Port of the process's metrics server, from its "metrics server listening" log line (workers
   * and janitor started with FLEET_METRICS_PORT; `0` picks a free one). The dispatcher serves
   * `/metrics` on `url` instead.
   */
  metricsPort?: number;
}

/**
 * Start the dispatcher, the three stage workers and the janitor as separate processes against
 * one Redis under one prefix; wait until the dispatcher answers and every worker logged that it
 * started.
 */
export class FleetProcesses {
  /** The first dispatcher's URL. */
  readonly url: string;
  /** Each dispatcher's URL, by its index: every replica listens on a port of its own. */
  readonly urls: string[];
  readonly token: string;
  readonly procs: FleetProcess[] = [];
  private readonly baseEnv: Record<string, string>;

  private constructor(
    private readonly options: FleetProcessOptions,
    private readonly ports: number[],
  ) {
    this.urls = ports.map((port) => `http://127.0.0.1:${port}`);
    this.url = this.urls[0]!;
    this.token = options.token ?? "fleet-dev-token";
    this.baseEnv = {
      PATH: process.env.PATH ?? "/usr/bin:/bin",
      HOME: process.env.HOME ?? "/root",
      ...(process.env.DOCKER_HOST ? { DOCKER_HOST: process.env.DOCKER_HOST } : {}),
      REDIS_URL: options.redisUrl,
      FLEET_PREFIX: options.prefix,
      FLEET_HTTP_HOST: "127.0.0.1",
      FLEET_API_TOKENS: this.token,
      FLEET_LOG_LEVEL: "info",
      // Under the 60 s a process has to be ready: a worker whose sandbox provider never answers
      // says so and exits, and the start fails with its reason rather than a bare "not ready".
      FLEET_PROVIDER_WAIT_MS: "45000",
      ...options.env,
    };
  }

  static async start(options: FleetProcessOptions): Promise<FleetProcesses> {
    mkdirSync(options.logDir, { recursive: true });
    const replicas = { dispatcher: 1, resources: 1, agent: 1, verifier: 1, janitor: 1, ...options.replicas };
    const ports: number[] = [];
    // Told apart as they are taken: a port is free until its dispatcher listens on it.
    while (ports.length < Math.max(1, replicas.dispatcher)) {
      const port = await freeLoopbackPort();
      if (!ports.includes(port)) ports.push(port);
    }
    const fleet = new FleetProcesses(options, ports);
    const starting: Promise<void>[] = [];
    for (const kind of Object.keys(APP_MAIN) as AppKind[]) {
      for (let i = 0; i < replicas[kind]; i++) starting.push(fleet.spawn(kind, i));
    }
    try {
      await Promise.all(starting);
    } catch (err) {
      await fleet.stop();
      throw err;
    }
    return fleet;
  }

  /** Start one process and wait until it is ready. */
  async spawn(kind: AppKind, index: number): Promise<void> {
    const log = createWriteStream(join(this.options.logDir, `${kind}-${index}.log`), { flags: "a" });
    // A write the log refuses (ended, the disk full) loses that output, not the test process.
    log.on("error", () => undefined);
    const child = spawn(process.execPath, ["--import", "tsx", APP_MAIN[kind]], {
      cwd: REPO_ROOT,
      env: {
        ...this.baseEnv,
        ...this.options.envOf?.[kind],
        FLEET_WORKER_ID: `${kind}-${index}`,
        // A dispatcher's port is its index's, also when it is started again.
        ...(kind === "dispatcher" ? { FLEET_HTTP_PORT: String(this.dispatcherPort(index)) } : {}),
      },
      stdio: ["ignore", "pipe", "pipe"],
    });
    // Resolved once its output is in its log: its pipes drained ("close": its last lines, such as
    // a shutdown's "stopped", come after "exit" at times) and the log's writes done. At most 2 s
    // after "exit" for the pipes: a process it started may hold them open.
    const exited = new Promise<number | null>((r) => {
      child.once("exit", (code) => {
        let done = false;
        const logged = () => {
          if (done) return;
          done = true;
          clearTimeout(late);
          log.write("", () => r(code));
        };
        const late = setTimeout(logged, 2_000);
        child.once("close", logged);
      });
      // A process that could not be started (EAGAIN, EMFILE on a loaded host) emits "error" and
      // may never emit "exit": it is over, and says so in its log.
      child.once("error", (err) => {
        if (child.pid !== undefined) return;
        log.write(`could not start: ${err.message}\n`, () => r(null));
      });
    });
    const proc: FleetProcess = { kind, index, child, log, exited };
    this.procs.push(proc);
    const ready = kind === "dispatcher" ? /listening|Server listening/i : /worker started|janitor started/;
    await new Promise<void>((resolveReady, reject) => {
      let buffered = "";
      // Its last output, in the error of a start that failed (CI shows the error, not the log):
      // kept until it is ready, not for the rest of its life.
      let tail = "";
      let waiting = true;
      const keep = (chunk: Buffer) => {
        if (waiting) tail = (tail + chunk.toString("utf8")).slice(-1_000);
      };
      const lastOutput = () =>
        tail.trim() ? `; its last output: ${tail.trim().split("\n").slice(-3).join(" | ").slice(-600)}` : "";
      const timer = setTimeout(
        () => reject(new Error(`${kind}-${index} not ready in 60 s; see ${log.path}${lastOutput()}`)),
        60_000,
      );
      const onData = (chunk: Buffer) => {
        log.write(chunk);
        keep(chunk);
        if (buffered !== null) {
          buffered += chunk.toString("utf8");
          if (proc.metricsPort === undefined) {
            const line = /^.*"metrics server listening".*$/m.exec(buffered)?.[0];
            if (line) proc.metricsPort = Number(/"port":(\d+)/.exec(line)?.[1]) || undefined;
          }
          if (ready.test(buffered)) {
            waiting = false;
            clearTimeout(timer);
            buffered = "";
            resolveReady();
          }
        }
      };
      child.stdout?.on("data", onData);
      child.stderr?.on("data", (chunk: Buffer) => {
        log.write(chunk);
        keep(chunk);
      });
      void exited.then((code) => {
        clearTimeout(timer);
        reject(
          new Error(
            `${kind}-${index} exited with ${code} before it was ready; see ${log.path}${lastOutput()}`,
          ),
        );
      });
    });
  }

  private dispatcherPort(index: number): number {
    const port = this.ports[index];
    if (port === undefined) throw new Error(`no dispatcher-${index}: the fleet started ${this.ports.length}`);
    return port;
  }

  of(kind: AppKind): FleetProcess[] {
    return this.procs.filter(
      (p) => p.kind === kind && p.child.exitCode === null && p.child.signalCode === null,
    );
  }

  /** SIGKILL one live process of a kind and start a replacement with the same index. */
  async killAndRestart(kind: AppKind, index = 0): Promise<void> {
    await this.restart(kind, index, "SIGKILL");
  }

  /** Send `signal` to one live process of a kind and wait for it to exit; resolves its exit code. */
  async kill(kind: AppKind, index = 0, signal: NodeJS.Signals = "SIGKILL"): Promise<number | null> {
    const proc = this.of(kind).find((p) => p.index === index);
    if (!proc) throw new Error(`no live ${kind}-${index}`);
    proc.child.kill(signal);
    return proc.exited;
  }

  /** `kill` with `signal`, then start a replacement with the same index and wait until it is ready. */
  async restart(kind: AppKind, index = 0, signal: NodeJS.Signals = "SIGKILL"): Promise<void> {
    await this.kill(kind, index, signal);
    await this.spawn(kind, index);
  }

  /**
   * `runAttached`, stopped and rejected (naming the process and its log) when one of this fleet's
   * processes exits before the command ends, unless `expected()` says the exit was (a Ctrl-C): a
   * worker that died mid-run would leave a CLI's `--wait` waiting for rollouts no one takes, up to
   * their deadlines (an hour), and a dead janitor for good.
   */
  async runWhileUp(
    file: string,
    args: readonly string[],
    env: NodeJS.ProcessEnv,
    expected: () => boolean = () => false,
  ): Promise<number> {
    const died = new AbortController();
    let running = true;
    for (const p of this.procs) {
      if (p.child.exitCode !== null || p.child.signalCode !== null) continue;
      void p.exited.then((code) => {
        if (running && !expected()) {
          died.abort(
            new Error(
              `${p.kind}-${p.index} exited (${code ?? p.child.signalCode}) while the command ran; see ${p.log.path}`,
            ),
          );
        }
      });
    }
    try {
      return await runAttached(file, args, env, died.signal);
    } finally {
      running = false;
    }
  }

  /** SIGTERM every process (bounded graceful shutdown), SIGKILL what is left after `timeoutMs`. */
  async stop(timeoutMs = 20_000): Promise<void> {
    const live = this.procs.filter((p) => p.child.exitCode === null && p.child.signalCode === null);
    for (const p of live) p.child.kill("SIGTERM");
    const timer = setTimeout(() => {
      for (const p of live) p.child.kill("SIGKILL");
    }, timeoutMs);
    // Every process's, not only those live above: one that exited just before may still be
    // writing its last output to its log.
    await Promise.all(this.procs.map((p) => p.exited));
    clearTimeout(timer);
    for (const p of this.procs) p.log.end();
  }
}
