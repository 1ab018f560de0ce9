import { spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { REPO_ROOT } from "../../scripts/lib/fleet-processes.ts";

/**
 * docker-compose.yml checked with the compose tool itself (`config` validates and resolves the
 * file; no image is pulled or built: there is no registry here). Compose v2 (`docker compose`)
 * when present, else v1 (`docker-compose`, Debian's package, which .ci/run installs).
 */
const BASE = join(REPO_ROOT, "docker-compose.yml");
const SOCKET = join(REPO_ROOT, "docker-compose.docker-socket.yml");
const SANDBOX_HOST = join(REPO_ROOT, "docker-compose.sandbox-host.yml");
const WORKERS = ["resources-worker", "agent-worker", "verifier-worker", "janitor"] as const;
const APPS = ["dispatcher", ...WORKERS] as const;

function composeCommand(): string[] | null {
  if (spawnSync("docker", ["compose", "version"], { stdio: "ignore" }).status === 0)
    return ["docker", "compose"];
  if (spawnSync("docker-compose", ["version"], { stdio: "ignore" }).status === 0) return ["docker-compose"];
  return null;
}
const compose = composeCommand();
if (!compose) {
  console.warn(
    "\n!!! test/ops/compose.test.ts SKIPPED: neither `docker compose` nor `docker-compose` (apt-get install -y docker-compose); .ci/run installs it\n",
  );
}

interface Service {
  image?: string;
  command?: string[];
  environment?: Record<string, string | null>;
  ports?: unknown[];
  volumes?: (string | { source?: string; target?: string; read_only?: boolean })[];
  container_name?: string;
  group_add?: unknown[];
  depends_on?: unknown;
}

/** `compose config` of the given files, as JSON (v1 prints YAML: converted with its own PyYAML). */
function config(files: string[], env: Record<string, string | undefined>) {
  const args = [
    ...compose!.slice(1),
    "--project-directory",
    REPO_ROOT,
    ...files.flatMap((f) => ["-f", f]),
    "config",
  ];
  const isV2 = compose![0] === "docker";
  const r = spawnSync(compose![0]!, isV2 ? [...args, "--format", "json"] : args, {
    cwd: REPO_ROOT,
    env: { PATH: process.env.PATH, HOME: process.env.HOME, ...env },
    encoding: "utf8",
  });
  if (r.status !== 0)
    return { status: r.status, error: `${r.stdout}${r.stderr}`, services: {} as Record<string, Service> };
  let json = r.stdout;
  if (!isV2) {
    // Debian's python3, whose python3-yaml docker-compose v1 brings in (not whichever python3
    // comes first on PATH: a pyenv one may have no yaml).
    const py = spawnSync(
      "/usr/bin/python3",
      ["-c", "import sys, json, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"],
      {
        input: r.stdout,
        encoding: "utf8",
      },
    );
    expect(py.status, py.stderr).toBe(0);
    json = py.stdout;
  }
  return {
    status: 0,
    error: "",
    services: (JSON.parse(json) as { services: Record<string, Service> }).services,
  };
}

/** `source:target` of each volume (v1 spells them `src:dst:rw`, v2 as objects). */
const mounts = (s: Service) =>
  (s.volumes ?? []).map((v) =>
    typeof v === "string" ? v.replace(/:(rw|ro)$/, "") : `${v.source}:${v.target}`,
  );

describe.skipIf(!compose)("docker-compose.yml", () => {
  const env = { FLEET_API_TOKENS: "tok,admin:boss" };

  it("defines redis (AOF, noeviction), the dispatcher, the four workers, the janitor and Prometheus", () => {
    const { status, error, services } = config([BASE], env);
    expect(error).toBe("");
    expect(status).toBe(0);
    expect(Object.keys(services).sort()).toEqual([...APPS, "prometheus", "redis"].sort());

    const redis = services.redis!.command!.join(" ");
    expect(redis).toContain("--appendonly yes");
    expect(redis).toContain("--maxmemory-policy noeviction");
    // A limit, or noeviction never applies (Redis grows until the host's OOM killer takes it).
    expect(redis).toContain("--maxmemory 4gb");
    const sized = config([BASE], { ...env, FLEET_REDIS_MAXMEMORY: "512mb" });
    expect(sized.services.redis!.command!.join(" ")).toContain("--maxmemory 512mb");
    expect(mounts(services.redis!).some((m) => m.endsWith(":/data"))).toBe(true);

    for (const app of APPS) {
      const s = services[app]!;
      // The one app image, running the app's own main.ts with tsx as node's loader (the `tsx`
      // command SIGKILLs an app that answers a relayed SIGTERM late: mid-shutdown).
      expect(s.command?.slice(0, 3)).toEqual(["node", "--import", "tsx"]);
      expect(existsSync(join(REPO_ROOT, s.command![3]!)), `${app}: ${s.command![3]}`).toBe(true);
      expect(s.command![3]).toBe(`apps/${app}/src/main.ts`);
      expect(s.environment?.REDIS_URL).toBe("redis://redis:6379");
      expect(s.depends_on).toBeDefined();
    }
    expect(services.dispatcher!.environment?.FLEET_API_TOKENS).toBe("tok,admin:boss");
    expect(services.dispatcher!.environment?.FLEET_HTTP_HOST).toBe("0.0.0.0");
  });

  it("gives every app a stop grace period longer than its shutdown timeout (no SIGKILL mid hand-back)", () => {
    const { services } = config([BASE], env);
    for (const app of APPS) {
      const s = services[app] as { stop_grace_period?: string; environment?: Record<string, string> };
      const grace = /^(\d+)s$/.exec(s.stop_grace_period ?? "");
      expect(grace, `${app}: stop_grace_period ${s.stop_grace_period}`).not.toBeNull();
      const timeoutMs = Number(s.environment?.FLEET_SHUTDOWN_TIMEOUT_MS);
      expect(timeoutMs, app).toBeGreaterThan(0);
      expect(Number(grace![1]) * 1000, app).toBeGreaterThan(timeoutMs);
    }
  });

  it("workers are scalable (no fixed name, no host port), expose metrics, and do not get the Docker socket by default", () => {
    const { services } = config([BASE], env);
    for (const w of WORKERS) {
      const s = services[w]!;
      expect(s.container_name, w).toBeUndefined();
      expect(s.ports ?? [], w).toEqual([]);
      expect(s.environment?.FLEET_METRICS_PORT, w).toBe("9464");
      expect(s.environment?.FLEET_METRICS_HOST, w).toBe("0.0.0.0");
    }
    for (const [name, s] of Object.entries(services)) {
      expect({ name, socket: mounts(s).some((m) => m.includes("docker.sock")) }).toEqual({
        name,
        socket: false,
      });
    }
  });

  it("Prometheus loads the fleet's alert rules and scrapes every app by its service name", () => {
    const { services } = config([BASE], env);
    const prom = services.prometheus!;
    expect(mounts(prom).some((m) => m.endsWith("configs/prometheus:/etc/prometheus"))).toBe(true);
    expect(prom.command).toContain("--config.file=/etc/prometheus/prometheus.yml");
    const scrape = readFileSync(join(REPO_ROOT, "configs/prometheus/prometheus.yml"), "utf8");
    expect(scrape).toMatch(/rule_files:\s*\n\s*- alerts\.yml/);
    for (const app of APPS) expect(scrape).toMatch(new RegExp(`names: \\[${app}\\]`));
  });

  it("the opt-in override gives the workers and the janitor (only) the host's Docker socket", () => {
    const { status, error, services } = config([BASE, SOCKET], env);
    expect(error).toBe("");
    expect(status).toBe(0);
    for (const w of WORKERS) {
      expect(mounts(services[w]!), w).toContain("/var/run/docker.sock:/var/run/docker.sock");
      expect(services[w]!.environment?.DOCKER_HOST, w).toBe("unix:///var/run/docker.sock");
      expect(services[w]!.group_add, w).toBeDefined();
    }
    for (const other of ["dispatcher", "prometheus", "redis"]) {
      expect(
        mounts(services[other]!).some((m) => m.includes("docker.sock")),
        other,
      ).toBe(false);
    }
  });

  it("takes no Docker daemon from the shell: an exported DOCKER_HOST (which compose itself obeys) reaches no app", () => {
    const { status, error, services } = config([BASE], { ...env, DOCKER_HOST: "unix:///nowhere.sock" });
    expect(error).toBe("");
    expect(status).toBe(0);
    for (const w of WORKERS) {
      expect(services[w]!.environment?.DOCKER_HOST ?? "", w).toBe("");
      expect(services[w]!.environment?.DOCKER_CERT_PATH ?? "", w).toBe("");
    }
  });

  it("the sandbox-host override gives the workers and the janitor (only) the sandbox host's daemon and its certificates, read-only at /certs; it refuses without them", () => {
    const sandboxHost = {
      ...env,
      FLEET_SANDBOX_DOCKER_HOST: "tcp://sandbox-host:2376",
      FLEET_SANDBOX_DOCKER_CERT_DIR: "/etc/fleet/docker-certs",
    };
    const { status, error, services } = config([BASE, SANDBOX_HOST], sandboxHost);
    expect(error).toBe("");
    expect(status).toBe(0);
    for (const w of WORKERS) {
      expect(services[w]!.environment?.DOCKER_HOST, w).toBe("tcp://sandbox-host:2376");
      expect(services[w]!.environment?.DOCKER_CERT_PATH, w).toBe("/certs");
      expect(mounts(services[w]!), w).toContain("/etc/fleet/docker-certs:/certs");
      const certs = (services[w]!.volumes ?? []).find((v) =>
        typeof v === "string" ? v.includes(":/certs") : v.target === "/certs",
      );
      expect(typeof certs === "string" ? certs.endsWith(":ro") : certs?.read_only, w).toBe(true);
    }
    for (const other of ["dispatcher", "prometheus", "redis"]) {
      expect(services[other]!.environment?.DOCKER_HOST ?? "", other).toBe("");
      expect(
        mounts(services[other]!).some((m) => m.endsWith(":/certs")),
        other,
      ).toBe(false);
    }
    for (const missing of ["FLEET_SANDBOX_DOCKER_HOST", "FLEET_SANDBOX_DOCKER_CERT_DIR"]) {
      const r = config([BASE, SANDBOX_HOST], { ...sandboxHost, [missing]: undefined });
      expect(r.status, missing).not.toBe(0);
      expect(r.error, missing).toContain(missing);
    }
  });

  it("refuses to start without API tokens", () => {
    const r = config([BASE], {});
    expect(r.status).not.toBe(0);
    expect(r.error).toContain("FLEET_API_TOKENS");
  });
});
