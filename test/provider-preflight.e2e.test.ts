import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import type { AddressInfo } from "node:net";
import { connect, createServer, type Server, type Socket } from "node:net";
import { hostname, tmpdir } from "node:os";
import { join } from "node:path";
import { RolloutRequest } from "@fleet/contracts";
import { testsTamperRisk } from "@fleet/pipeline";
import {
  admit,
  createKeys,
  createRedis,
  freeLoopbackPort,
  LocalRedisServer,
  RolloutStore,
  StageQueues,
} from "@fleet/queue";
import { DockerSandboxProvider } from "@fleet/sandbox";
import { afterAll, describe, expect, it, vi } from "vitest";
import { APP_MAIN, REPO_ROOT } from "../scripts/lib/fleet-processes.ts";
import { dropPrefix, IMAGE, REDIS_URL, testPrefix } from "./helpers/env.ts";

/** Run an app's main.ts as its own process; resolves with its exit code and output. */
function runApp(
  kind: keyof typeof APP_MAIN,
  env: Record<string, string>,
  started?: (kill: () => void, output: () => string) => void,
) {
  const child = spawn(process.execPath, ["--import", "tsx", APP_MAIN[kind]], {
    cwd: REPO_ROOT,
    env: { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: process.env.HOME ?? "/root", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  child.stdout.on("data", (d: Buffer) => (output += d.toString()));
  child.stderr.on("data", (d: Buffer) => (output += d.toString()));
  // A backstop for an app that hangs: past the longest scenario here (the janitor's waits add up
  // to two minutes on a loaded host), under the e2e tests' own 300 s.
  const killer = setTimeout(() => child.kill("SIGKILL"), 240_000);
  started?.(
    () => child.kill("SIGTERM"),
    () => output,
  );
  return new Promise<{ code: number | null; output: string }>((resolve) =>
    child.on("exit", (code) => {
      clearTimeout(killer);
      resolve({ code, output });
    }),
  );
}

/** A unix socket at `path` that relays every connection to the Docker daemon at `dockerHost`. */
async function relayTo(path: string, dockerHost: string): Promise<Server> {
  const target = new URL(dockerHost);
  const server = createServer((client: Socket) => {
    const daemon =
      target.protocol === "unix:" ? connect(target.pathname) : connect(Number(target.port), target.hostname);
    client.pipe(daemon).pipe(client);
    client.on("error", () => daemon.destroy());
    daemon.on("error", () => client.destroy());
  });
  await new Promise<void>((resolve) => server.listen(path, resolve));
  return server;
}

/** Admit one oracle rollout of a no-op task (accepted at `now`); its id. */
async function admitOne(store: RolloutStore, queues: StageQueues, now = Date.now()): Promise<string> {
  const task = {
    id: `preflight-${randomUUID().slice(0, 6)}`,
    instruction: "noop",
    image: "img",
    solution: { "solve.sh": "true\n" },
    tests: { "test.sh": "exit 0\n" },
  };
  const { ids } = await admit(
    store,
    queues,
    { requests: [RolloutRequest.parse({ task, agent: { harness: "oracle" } })], batch: false },
    { maxTaskBytes: 1 << 20, now },
  );
  return ids[0]!;
}

describe("a worker that cannot reach its sandbox provider", () => {
  const prefix = testPrefix("preflight");
  const redis = createRedis(REDIS_URL);

  afterAll(async () => {
    await dropPrefix(REDIS_URL, prefix);
    redis.disconnect();
  });

  it("a stage worker refuses to start, saying what to set, and takes no stage job (nothing masked)", async () => {
    const store = new RolloutStore(redis, prefix);
    const queues = new StageQueues(redis, prefix);
    const ids = [await admitOne(store, queues)];
    // A daemon address nothing listens on: what compose gives a worker without DOCKER_HOST is a
    // socket that is not there; both fail the same way.
    const port = await freeLoopbackPort();
    const env = {
      REDIS_URL,
      FLEET_PREFIX: prefix,
      DOCKER_HOST: `tcp://127.0.0.1:${port}`,
      FLEET_PROVIDER_WAIT_MS: "1500",
    };
    const { code, output } = await runApp("resources", env);
    expect(code, output).toBe(1);
    expect(output).toContain("refusing to start: no sandbox provider");
    expect(output).toContain(`cannot reach the docker sandbox provider at tcp://127.0.0.1:${port}`);
    expect(output).toContain("DOCKER_HOST");
    const seed = await queues.queues.seed.getJob(`${ids[0]}.seed`);
    expect(seed?.attemptsMade).toBe(0);
    expect(await seed?.getState()).toBe("waiting");
    expect((await store.get(ids[0]!))?.status).toBe("accepted");
    await queues.close();
  });

  it("a stage worker whose Docker daemon hangs (takes the connection, never answers) exits 1 as soon as it gives up waiting, not when its call's 30 s run out", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-hung-daemon-"));
    const socket = join(dir, "docker.sock");
    const held: Socket[] = [];
    const daemon = createServer((s) => {
      held.push(s);
      s.on("error", () => {});
    });
    await new Promise<void>((resolve) => daemon.listen(socket, resolve));
    let output = () => "";
    let refusedAt = 0;
    const watch = setInterval(() => {
      if (!refusedAt && output().includes("refusing to start: no sandbox provider")) refusedAt = Date.now();
    }, 20);
    try {
      const { code, output: said } = await runApp(
        "resources",
        { REDIS_URL, FLEET_PREFIX: prefix, DOCKER_HOST: `unix://${socket}`, FLEET_PROVIDER_WAIT_MS: "1000" },
        (_kill, o) => {
          output = o;
        },
      );
      const exitedAt = Date.now();
      expect(code, said).toBe(1);
      expect(said).toContain("refusing to start: no sandbox provider");
      expect(held.length).toBeGreaterThan(0);
      // Its call to the daemon, in flight, used to hold the process until the API timeout (30 s).
      expect(refusedAt).toBeGreaterThan(0);
      expect(exitedAt - refusedAt, said).toBeLessThan(10_000);
    } finally {
      clearInterval(watch);
      for (const s of held) s.destroy();
      daemon.close();
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("on bubblewrap, a rootfs that is not one, or a bwrap that is not there, refuses the start, saying which", async () => {
    const empty = await mkdtemp(join(tmpdir(), "fleet-preflight-rootfs-"));
    try {
      const base = {
        REDIS_URL,
        FLEET_PREFIX: prefix,
        FLEET_SANDBOX_PROVIDER: "bubblewrap",
        FLEET_STATE_DIR: empty,
        FLEET_PROVIDER_WAIT_MS: "1000",
      };
      const rootfs = await runApp("agent", { ...base, FLEET_BWRAP_ROOTFS: empty });
      expect(rootfs.code, rootfs.output).toBe(1);
      expect(rootfs.output).toContain("refusing to start: no sandbox provider");
      expect(rootfs.output).toContain(`the rootfs ${empty} has no usr/bin/setpriv`);
      const host = await runApp("agent", { ...base, FLEET_BWRAP_ROOTFS: "/" });
      expect(host.code, host.output).toBe(1);
      expect(host.output).toContain("FLEET_BWRAP_ROOTFS is / (the host's own root)");
    } finally {
      await rm(empty, { recursive: true, force: true });
    }
  });

  it("on bubblewrap, an app of another host than the one whose apps hold the fleet refuses the start, naming both", async () => {
    const stateDir = await mkdtemp(join(tmpdir(), "fleet-preflight-host-"));
    const other = `${prefix.slice(0, -1)}-host}`;
    const redis = createRedis(REDIS_URL);
    try {
      // Another host's apps run this fleet (their claim, renewed while they run).
      await redis.set(createKeys(other).sandboxHost(), "bwrap://elsewhere", "PX", 60_000);
      for (const kind of ["agent", "janitor"] as const) {
        const refused = await runApp(kind, {
          REDIS_URL,
          FLEET_PREFIX: other,
          FLEET_SANDBOX_PROVIDER: "bubblewrap",
          FLEET_BWRAP_ROOTFS: stateDir,
          FLEET_STATE_DIR: stateDir,
        });
        expect(refused.code, refused.output).toBe(1);
        expect(refused.output).toContain(
          `refusing to start: this bubblewrap fleet's sandboxes are on bwrap://elsewhere, not this host (bwrap://${hostname()})`,
        );
      }
      expect(await redis.get(createKeys(other).sandboxHost())).toBe("bwrap://elsewhere");
    } finally {
      await redis.del(createKeys(other).sandboxHost());
      redis.disconnect();
      await rm(stateDir, { recursive: true, force: true });
    }
  });

  it("a janitor that cannot reach its provider starts anyway: says so (log, fleet_sandbox_provider_up 0), closes rollouts past their deadline meanwhile, and sweeps its sandboxes once the daemon answers", async () => {
    const store = new RolloutStore(redis, prefix);
    const queues = new StageQueues(redis, prefix);
    // Accepted 3 hours ago: past its deadline and the watchdog's grace, with no stage closing it.
    const overdue = await admitOne(store, queues, Date.now() - 3 * 3_600_000);
    // A sandbox of this fleet (its scope is the prefix) whose rollout is unknown: an orphan.
    const docker = new DockerSandboxProvider({ scope: prefix });
    const orphan = await docker.create({
      image: IMAGE,
      rolloutId: `orphan-${randomUUID().slice(0, 8)}`,
      owner: "resources",
      expiresAt: Date.now() + 3_600_000,
    });
    // The janitor's daemon address: nothing there yet (as a daemon that is down, or not up yet).
    const dir = await mkdtemp(join(tmpdir(), "fleet-preflight-janitor-"));
    const socket = join(dir, "docker.sock");
    const metricsPort = await freeLoopbackPort();
    const gauge = async () =>
      /^fleet_sandbox_provider_up(?:\{[^}]*\})? (\d)$/m.exec(
        await fetch(`http://127.0.0.1:${metricsPort}/metrics`).then((r) => r.text()),
      )?.[1];
    let kill = () => {};
    let output = () => "";
    let exited = false;
    const running = runApp(
      "janitor",
      {
        REDIS_URL,
        FLEET_PREFIX: prefix,
        DOCKER_HOST: `unix://${socket}`,
        FLEET_JANITOR_INTERVAL_MS: "300",
        FLEET_ORPHAN_GRACE_MS: "1000",
        FLEET_METRICS_PORT: String(metricsPort),
      },
      (k, o) => {
        kill = k;
        output = o;
      },
    ).finally(() => (exited = true));
    let proxy: Server | null = null;
    try {
      // Started (it used to wait FLEET_PROVIDER_WAIT_MS, then exit 1), saying what is wrong.
      await vi.waitFor(() => expect(output()).toContain('"msg":"janitor started"'), {
        timeout: 30_000,
        interval: 100,
      });
      expect(output()).toContain(`"endpoint":"unix://${socket}"`);
      expect(output()).toContain("sandbox provider not reachable; the janitor runs its Redis-only steps");
      await vi.waitFor(async () => expect(await gauge()).toBe("0"), { timeout: 10_000, interval: 100 });
      // Its Redis-only duty goes on: the overdue rollout is failed (masked) and its close enqueued.
      await vi.waitFor(
        async () => {
          const rec = await store.get(overdue!);
          expect(rec?.failure?.failureKind).toBe("deadline_exceeded");
          expect(await queues.queues.close.getJob(`${overdue}.close`)).toBeDefined();
        },
        { timeout: 30_000, interval: 200 },
      );
      expect(exited, output()).toBe(false);
      expect(await docker.alive(orphan)).toBe(true);
      expect(await gauge()).toBe("0");
      // The daemon answers at that address (a relay to this host's daemon): the janitor finds it
      // by itself and does its Docker duties: the orphan goes.
      proxy = await relayTo(socket, process.env.DOCKER_HOST ?? "unix:///var/run/docker.sock");
      await vi.waitFor(async () => expect(await docker.alive(orphan)).toBe(false), {
        timeout: 60_000,
        interval: 200,
      });
      expect(output()).toContain("sandbox provider answers again");
      expect(await gauge()).toBe("1");
      expect(exited, output()).toBe(false);
    } finally {
      kill();
      await running;
      proxy?.close();
      await docker.destroy(orphan);
      await queues.close();
      await rm(dir, { recursive: true, force: true });
    }
    expect((await running).code, output()).toBe(0);
  });

  it("while it waits for the provider, its metrics say the provider is down (an alert sees it; its heartbeat is fresh)", async () => {
    const [dockerPort, metricsPort] = [await freeLoopbackPort(), await freeLoopbackPort()];
    let kill = () => {};
    const running = runApp(
      "verifier",
      {
        REDIS_URL,
        FLEET_PREFIX: prefix,
        DOCKER_HOST: `tcp://127.0.0.1:${dockerPort}`,
        FLEET_PROVIDER_WAIT_MS: "30000",
        FLEET_METRICS_PORT: String(metricsPort),
      },
      (k) => (kill = k),
    );
    let scraped = "";
    await vi.waitFor(
      async () => {
        scraped = await fetch(`http://127.0.0.1:${metricsPort}/metrics`).then((r) => r.text());
        expect(scraped).toMatch(/^fleet_sandbox_provider_up(\{[^}]*\})? 0$/m);
      },
      { timeout: 20_000, interval: 200 },
    );
    expect(scraped).toMatch(/^fleet_worker_heartbeat_timestamp_seconds\{[^}]*\} \d/m);
    kill();
    await running;
  });

  it("a metrics or HTTP port in use, or a bad variable, refuses the start in one line naming the variable (no stack trace)", async () => {
    const taken = createServer();
    await new Promise<void>((r) => taken.listen(0, "127.0.0.1", () => r()));
    try {
      const port = (taken.address() as AddressInfo).port;
      const busy = await runApp("agent", {
        REDIS_URL,
        FLEET_PREFIX: prefix,
        FLEET_METRICS_PORT: String(port),
      });
      expect(busy.code, busy.output).toBe(1);
      expect(busy.output).toContain(`refusing to start: FLEET_METRICS_PORT ${port} is in use on 127.0.0.1`);
      expect(busy.output).not.toMatch(/^\s+at /m);
      const http = await runApp("dispatcher", {
        REDIS_URL,
        FLEET_PREFIX: prefix,
        FLEET_HTTP_HOST: "127.0.0.1",
        FLEET_HTTP_PORT: String(port),
      });
      expect(http.code, http.output).toBe(1);
      expect(http.output).toContain(`refusing to start: FLEET_HTTP_PORT ${port} is in use on 127.0.0.1`);
    } finally {
      taken.close();
    }
    for (const kind of ["janitor", "dispatcher"] as const) {
      const bad = await runApp(kind, { REDIS_URL, FLEET_PREFIX: "walk" });
      expect(bad.code, bad.output).toBe(1);
      expect(bad.output).toContain("refusing to start:");
      expect(bad.output).toContain("FLEET_PREFIX: must start with a hash tag in braces");
      expect(bad.output).not.toMatch(/^\s+at /m);
    }
  });

  it("a metrics or HTTP host it cannot listen on refuses the start naming the variable", async () => {
    const metrics = await runApp("agent", {
      REDIS_URL,
      FLEET_PREFIX: prefix,
      FLEET_METRICS_PORT: "0",
      FLEET_METRICS_HOST: "no-such-host.invalid",
    });
    // ENOTFOUND from a resolver that answers; EAI_AGAIN on a machine with none to ask.
    expect(metrics.code, metrics.output).toBe(1);
    expect(metrics.output).toMatch(
      /^refusing to start: FLEET_METRICS_HOST no-such-host\.invalid: .*(ENOTFOUND|EAI_AGAIN)/m,
    );
    const http = await runApp("dispatcher", {
      REDIS_URL,
      FLEET_PREFIX: prefix,
      FLEET_HTTP_PORT: "0",
      // TEST-NET-3: no interface of this host has it.
      FLEET_HTTP_HOST: "203.0.113.7",
    });
    expect(http.code, http.output).toBe(1);
    expect(http.output).toMatch(/^refusing to start: FLEET_HTTP_HOST 203\.0\.113\.7: .*EADDRNOTAVAIL/m);
  });

  it("an agent worker whose FLEET_CREDENTIALS_FILE cannot be read, is not JSON or names one credential twice refuses the start, not quoting it", async () => {
    const dir = await mkdtemp(join(tmpdir(), "fleet-preflight-creds-"));
    try {
      const missing = await runApp("agent", {
        REDIS_URL,
        FLEET_PREFIX: prefix,
        FLEET_CREDENTIALS_FILE: join(dir, "missing.json"),
      });
      expect(missing.code, missing.output).toBe(1);
      expect(missing.output).toContain(
        `refusing to start: FLEET_CREDENTIALS_FILE ${join(dir, "missing.json")}: cannot read the credentials file: ENOENT`,
      );
      const file = join(dir, "secrets.json");
      await writeFile(file, '{"default": sk-live-SUPERSECRET}');
      const broken = await runApp("agent", { REDIS_URL, FLEET_PREFIX: prefix, FLEET_CREDENTIALS_FILE: file });
      expect(broken.code, broken.output).toBe(1);
      expect(broken.output).toContain(
        `refusing to start: FLEET_CREDENTIALS_FILE ${file}: the credentials file is not valid JSON`,
      );
      expect(broken.output).not.toContain("SUPERSECRET");
      // Two names of one credential (one variable, FLEET_CREDENTIAL_MY_KEY): which a rollout got
      // would hang on its spelling.
      await writeFile(
        file,
        JSON.stringify({ "my-key": { value: "sk-live-SUPERSECRET" }, "my.key": { value: "sk-live-OTHER" } }),
      );
      const twice = await runApp("agent", { REDIS_URL, FLEET_PREFIX: prefix, FLEET_CREDENTIALS_FILE: file });
      expect(twice.code, twice.output).toBe(1);
      expect(twice.output).toContain(
        `refusing to start: FLEET_CREDENTIALS_FILE ${file}: the credentials file names one credential twice: "my-key" and "my.key" are both FLEET_CREDENTIAL_MY_KEY`,
      );
      expect(twice.output).not.toMatch(/SUPERSECRET|sk-live-OTHER/);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("a verifier worker with FLEET_REQUIRE_PTRACE_SCOPE refuses to start where the kernel lets the agent's code tamper with the tests (warns without it); starts where it does not", async () => {
    const env = { REDIS_URL, FLEET_PREFIX: prefix, FLEET_REQUIRE_PTRACE_SCOPE: "true" };
    const risk = testsTamperRisk();
    if (risk !== null) {
      const refused = await runApp("verifier", env);
      expect(refused.code, refused.output).toBe(1);
      expect(refused.output).toContain(
        `refusing to start: FLEET_REQUIRE_PTRACE_SCOPE is set and the sandboxes' kernel: ${risk}`,
      );
      expect(refused.output).not.toContain("worker started");
    } else {
      const started = await runApp("verifier", env, (kill, output) => {
        const poll = setInterval(() => {
          if (output().includes("worker started")) {
            clearInterval(poll);
            kill();
          }
        }, 100);
      });
      expect(started.code, started.output).toBe(0);
      expect(started.output).not.toContain("FLEET_REQUIRE_PTRACE_SCOPE is set");
    }
  });

  it("a misspelt FLEET_ variable is warned of at start, naming the closest known one (not refused)", async () => {
    const typos = { FLEET_CONCURENCY: "64", FLEET_LOGLEVEL: "debug" };
    const expected = [
      "FLEET_CONCURENCY is not a variable of the fleet: it is ignored (did you mean FLEET_CONCURRENCY?)",
      "FLEET_LOGLEVEL is not a variable of the fleet: it is ignored (did you mean FLEET_LOG_LEVEL?)",
    ];
    // Each app ends early on its own (an address it cannot listen on): the warnings come first,
    // at start. (A janitor without its sandbox provider no longer ends: it starts without it.)
    const dispatcher = await runApp("dispatcher", {
      REDIS_URL,
      FLEET_PREFIX: prefix,
      FLEET_HTTP_PORT: "0",
      FLEET_HTTP_HOST: "203.0.113.7",
      ...typos,
    });
    const janitor = await runApp("janitor", {
      REDIS_URL,
      FLEET_PREFIX: prefix,
      FLEET_METRICS_PORT: "0",
      FLEET_METRICS_HOST: "203.0.113.7",
      ...typos,
    });
    expect(janitor.code, janitor.output).toBe(1);
    for (const { output } of [dispatcher, janitor]) {
      const warnings = output
        .split("\n")
        .filter((l) => l.startsWith("{"))
        .map((l) => JSON.parse(l) as { level: number; msg: string })
        .filter((l) => l.msg.includes("is not a variable of the fleet"));
      expect(
        warnings.map((w) => w.msg),
        output,
      ).toEqual(expected);
      expect(warnings.every((w) => w.level === 40)).toBe(true);
    }
  });

  it("a dispatcher started before its Redis waits for it, saying so and naming REDIS_URL, and serves once Redis answers", async () => {
    const [redisPort, httpPort] = [await freeLoopbackPort(), await freeLoopbackPort()];
    const dir = await mkdtemp(join(tmpdir(), "fleet-preflight-redis-"));
    let kill = () => {};
    let output = () => "";
    const running = runApp(
      "dispatcher",
      {
        REDIS_URL: `redis://127.0.0.1:${redisPort}`,
        FLEET_PREFIX: prefix,
        FLEET_HTTP_HOST: "127.0.0.1",
        FLEET_HTTP_PORT: String(httpPort),
      },
      (k, o) => {
        kill = k;
        output = o;
      },
    );
    let redis: LocalRedisServer | null = null;
    try {
      // It waits (it used to exit 1 here), and says why, naming REDIS_URL and the error.
      const waiting = /"err":"[^"]*ECONNREFUSED[^"]*".*"msg":"cannot reach Redis \(REDIS_URL\) yet/;
      await vi.waitFor(() => expect(output()).toMatch(waiting), { timeout: 30_000, interval: 100 });
      expect(output()).not.toContain("refusing to start");
      // Redis comes up on the port: the dispatcher starts and answers.
      redis = await LocalRedisServer.start({ dir, port: redisPort });
      await vi.waitFor(
        async () => expect((await fetch(`http://127.0.0.1:${httpPort}/healthz`)).status).toBe(200),
        { timeout: 60_000, interval: 200 },
      );
    } finally {
      kill();
      const { code } = await running;
      await redis?.kill();
      await rm(dir, { recursive: true, force: true });
      expect(code, output()).toBe(0);
    }
  });
});
