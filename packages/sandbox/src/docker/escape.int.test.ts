import { execFile } from "node:child_process";
import { randomBytes } from "node:crypto";
import { readFileSync, rmSync, writeFileSync } from "node:fs";
import { promisify } from "node:util";
import type { SandboxHandle, SandboxSpecInput } from "@fleet/contracts";
import Dockerode from "dockerode";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { AGENT_USER, LABEL_ROLLOUT, LABEL_SCOPE, ROOT_USER, SANDBOX_PATHS } from "../provider.ts";
import { DEFAULT_SANDBOX_LIMITS } from "./container-config.ts";
import { DockerSandboxProvider } from "./docker-sandbox-provider.ts";

/**
 * What a hostile agent tries from inside a sandbox made with the hardened defaults: see the
 * host's processes, read the host's files, reach the network, gain a capability, exhaust
 * memory, disk or pids. Each attempt must fail (or be contained and recorded), and meanwhile
 * another sandbox and the host keep serving.
 */
const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const RUN = `esc${process.pid}${Date.now().toString(36)}`;
const SCOPE = `{escape-${RUN}}`;
const docker = new Dockerode({ socketPath: "/var/run/docker.sock" });
const provider = new DockerSandboxProvider({ docker: { socketPath: "/var/run/docker.sock" }, scope: SCOPE });
const made: SandboxHandle[] = [];
let counter = 0;

async function sandbox(over: Partial<SandboxSpecInput> = {}): Promise<SandboxHandle> {
  const h = await provider.create({
    image: IMAGE,
    rolloutId: `${RUN}-${++counter}`,
    owner: "resources",
    expiresAt: Date.now() + 600_000,
    ...over,
  });
  made.push(h);
  return h;
}

/** Run a shell script in the sandbox (as the agent unless `user` says otherwise). */
async function sh(h: SandboxHandle, script: string, user = AGENT_USER, deadlineMs = 30_000) {
  return provider.exec(h, ["sh", "-c", script], { deadlineMs, user });
}

async function py(h: SandboxHandle, code: string, user = AGENT_USER) {
  return provider.exec(h, ["python3", "-c", code], { deadlineMs: 30_000, user });
}

/** Meanwhile the fleet keeps serving: an ordinary exec in another sandbox succeeds (within its deadline). */
async function otherSandboxServes(h: SandboxHandle): Promise<void> {
  const r = await sh(h, "echo still-serving; id -u");
  expect([r.exitCode, r.stdout]).toEqual([0, "still-serving\n1000\n"]);
}

let bystander: SandboxHandle;
let target: SandboxHandle;

beforeAll(async () => {
  await docker.getImage(IMAGE).inspect();
  bystander = await sandbox();
  target = await sandbox();
});

afterAll(async () => {
  for (const h of made) await provider.destroy(h);
  const left = await docker.listContainers({ all: true, filters: { label: [`${LABEL_SCOPE}=${SCOPE}`] } });
  const vols = (await docker.listVolumes({ filters: { label: [`${LABEL_SCOPE}=${SCOPE}`] } })).Volumes ?? [];
  expect(left.map((c) => c.Names[0])).toEqual([]);
  expect(vols.map((v) => v.Name)).toEqual([]);
});

describe("sandbox escape attempts (Docker provider, hardened defaults)", () => {
  it("cannot see the host's processes", async () => {
    const hostCmdline = readFileSync("/proc/self/cmdline", "latin1").replaceAll("\0", " ").trim();
    for (const user of [AGENT_USER, ROOT_USER]) {
      const r = await sh(
        target,
        `ls -d /proc/[0-9]* | wc -l; tr '\\000' ' ' < /proc/1/cmdline; echo; cat /proc/${process.pid}/cmdline 2>/dev/null | tr '\\000' ' '; echo; ps -eo args=`,
        user,
      );
      expect(r.exitCode).toBe(0);
      const [count, pid1, samePid, ...ps] = r.stdout.split("\n");
      // Only the sandbox's own: docker-init, the keepalive, this shell and its children.
      expect(Number(count)).toBeLessThan(10);
      expect(pid1).toMatch(/^\/sbin\/docker-init -- sleep infinity/);
      expect(samePid?.trim()).not.toBe(hostCmdline);
      const all = ps.join("\n");
      expect(all).not.toContain("vitest");
      expect(all).not.toMatch(/dockerd|containerd|redis-server|node /);
    }
  });

  it("cannot read the host's files (a sentinel written on the host's /tmp is not there)", async () => {
    const secret = randomBytes(16).toString("hex");
    const path = `/tmp/fleet-escape-sentinel-${RUN}`;
    writeFileSync(path, secret);
    try {
      for (const user of [AGENT_USER, ROOT_USER]) {
        const r = await sh(
          target,
          `cat ${path} 2>&1; echo "--"; grep -rls --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev ${secret} / 2>/dev/null; echo "--"; test -e /var/run/docker.sock && echo SOCKET; cat /proc/self/mountinfo`,
          user,
          60_000,
        );
        const [cat = "", found = "", rest = ""] = r.stdout.split("--\n");
        expect(cat).toMatch(/No such file/);
        expect(found.trim()).toBe("");
        expect(r.stdout).not.toContain(secret);
        expect(rest).not.toContain("SOCKET");
        // No host directory is bind-mounted in (only Docker's hostname/hosts/resolv.conf, its init).
        const binds = rest
          .split("\n")
          .map((l) => l.split(" ")[4])
          .filter(
            (mnt): mnt is string =>
              mnt !== undefined &&
              !/^\/(etc\/(hostname|hosts|resolv\.conf)|(usr\/)?sbin\/docker-init)?$/.test(mnt),
          );
        for (const mnt of binds)
          expect(mnt).toMatch(/^\/(workspace|tmp|tests|solution|logs|proc|sys|dev|run\/fleet)(\/|$)/);
      }
    } finally {
      rmSync(path, { force: true });
    }
  });

  it("cannot reach the network: loopback only, no route, no DNS", async () => {
    const r = await py(
      target,
      [
        "import socket",
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))",
        "for host, port in [('1.1.1.1', 53), ('8.8.8.8', 443), ('172.17.0.1', 2375), ('169.254.169.254', 80)]:",
        "  try:",
        "    socket.create_connection((host, port), timeout=2).close(); print(host, 'CONNECTED')",
        "  except OSError as e:",
        "    print(host, 'blocked')",
        "try:",
        "  socket.getaddrinfo('registry.npmjs.org', 443); print('DNS RESOLVED')",
        "except OSError:",
        "  print('dns blocked')",
      ].join("\n"),
    );
    expect(r.exitCode, r.stderr).toBe(0);
    expect(r.stdout.split("\n")[0]).toBe("['lo']");
    expect(r.stdout).not.toContain("CONNECTED");
    expect(r.stdout).not.toContain("DNS RESOLVED");
    expect(r.stdout.match(/blocked/g)).toHaveLength(5);
  });

  it("cannot gain a capability: no raw socket, no mount, no chown to root, no setuid, no user namespace", async () => {
    for (const user of [AGENT_USER, ROOT_USER]) {
      const status = await sh(
        target,
        "grep -E '^(CapEff|CapPrm|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status",
        user,
      );
      expect(status.stdout).toMatch(/CapEff:\s+0{16}/);
      expect(status.stdout).toMatch(/CapPrm:\s+0{16}/);
      expect(status.stdout).toMatch(/CapBnd:\s+0{16}/);
      expect(status.stdout).toMatch(/NoNewPrivs:\s+1/);

      const raw = await py(
        target,
        "import socket\ntry:\n  socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); print('RAW OK')\nexcept PermissionError:\n  print('PermissionError')",
        user,
      );
      expect(raw.stdout.trim()).toBe("PermissionError");

      const mount = await sh(target, "mount -t tmpfs none /tmp 2>&1; echo rc=$?", user);
      expect(mount.stdout).toMatch(/rc=[1-9]/);

      const ns = await sh(
        target,
        "unshare -Urm true 2>&1; echo rc=$?; unshare -p -f true 2>&1; echo rc=$?",
        user,
      );
      expect(ns.stdout).not.toMatch(/rc=0/);
    }
    // The agent cannot hand a file to root, and root (without CAP_CHOWN) cannot take it.
    const agentChown = await sh(
      target,
      "echo x > /workspace/mine && chown 0:0 /workspace/mine 2>&1; echo rc=$?",
    );
    expect(agentChown.stdout).toMatch(/rc=[1-9]/);
    const rootChown = await sh(target, "chown 0:0 /workspace/mine 2>&1; echo rc=$?", ROOT_USER);
    expect(rootChown.stdout).toMatch(/rc=[1-9]/);
    const owner = await sh(target, "stat -c %u /workspace/mine");
    expect(owner.stdout.trim()).toBe("1000");
    // setuid binaries do not elevate (no-new-privileges): su cannot become root.
    const su = await sh(target, "echo | su -c id root 2>&1; echo rc=$?");
    expect(su.stdout).toMatch(/rc=[1-9]/);
    expect(su.stdout).not.toMatch(/uid=0/);
  });

  it("a memory hog is OOM-killed and recorded, while another sandbox keeps serving", async () => {
    const hog = await sandbox({ options: { memoryMb: 64, tmpfsMb: 8, diskMb: 8 } });
    const eating = provider.exec(
      hog,
      ["python3", "-c", "x = []\nwhile True:\n  x.append(bytearray(16 * 1024 * 1024))"],
      { deadlineMs: 60_000 },
    );
    await otherSandboxServes(bystander);
    const r = await eating;
    expect(r).toMatchObject({ exitCode: 137, timedOut: false, oomKilled: true });
    // Only the hog died: the sandbox itself is still there and usable.
    expect(await provider.alive(hog)).toBe(true);
    expect((await sh(hog, "echo alive")).stdout).toBe("alive\n");
  });

  it("a disk filler is stopped by its quota in the workspace, /tmp and /dev/shm; the root is read-only", async () => {
    // The default workspace is capped too (an uncapped volume would fill the daemon's disk).
    expect(DEFAULT_SANDBOX_LIMITS.diskMb).not.toBeNull();
    const filler = await sandbox({ options: { diskMb: 32, tmpfsMb: 16 } });
    const r = await sh(
      filler,
      [
        "for d in /workspace /tmp /dev/shm; do",
        '  dd if=/dev/zero of="$d/fill" bs=1M count=256 2>&1 | grep -o "No space left on device" | head -1',
        '  echo "$d $(( $(stat -c %s "$d/fill") / 1048576 ))"',
        "done",
        'for d in / /home /var/tmp /usr; do echo x > "$d/x" 2>/dev/null && echo "$d WRITABLE"; done; echo done',
      ].join("\n"),
      AGENT_USER,
      60_000,
    );
    const lines = r.stdout.split("\n");
    expect(lines.filter((l) => l === "No space left on device")).toHaveLength(3);
    const size = (d: string) => Number(lines.find((l) => l.startsWith(`${d} `))?.split(" ")[1]);
    expect(size("/workspace")).toBeLessThanOrEqual(32);
    expect(size("/tmp")).toBeLessThanOrEqual(16);
    expect(size("/dev/shm")).toBeLessThanOrEqual(64);
    expect(r.stdout).not.toContain("WRITABLE");
    await otherSandboxServes(bystander);
    // The workspace stays the agent's, as with a plain volume.
    expect((await sh(filler, "stat -c '%u:%g %a' /workspace")).stdout.trim()).toBe("1000:1000 755");
  });

  it("a workspace filled to a cap as large as the memory is ENOSPC, not an OOM kill of the sandbox: the tests still run", async () => {
    // Tmpfs pages are memory: were they charged against `memoryMb` alone, filling the workspace
    // would OOM-kill everything in the sandbox (or every later exec), and the agent's own doing
    // would be masked as a lost sandbox instead of graded.
    const full = await sandbox({ options: { memoryMb: 64, diskMb: 64, tmpfsMb: 16 } });
    const r = await sh(
      full,
      [
        "for d in /workspace /tmp /logs; do",
        '  dd if=/dev/zero of="$d/fill" bs=1M count=128 2>&1 | grep -o "No space left on device" | head -1',
        "done",
        "echo filled",
      ].join("\n"),
      AGENT_USER,
      60_000,
    );
    expect(r).toMatchObject({ exitCode: 0, oomKilled: false });
    expect(r.stdout.split("\n").filter((l) => l === "No space left on device")).toHaveLength(3);
    expect(r.stdout).toContain("filled");
    expect(await provider.alive(full)).toBe(true);
    // What the verifier does next: stage files as root, then run a test using some memory.
    await provider.put(full, SANDBOX_PATHS.tests, { "test.sh": "echo graded\n" });
    const tests = await sh(
      full,
      "python3 -c 'b = bytearray(32 * 1024 * 1024)' && sh /tests/test.sh",
      ROOT_USER,
      60_000,
    );
    expect(tests).toMatchObject({ exitCode: 0, oomKilled: false, stdout: "graded\n" });
  });

  it("a fork bomb is contained by the pids limit; the host and another sandbox keep serving", async () => {
    const bombed = await sandbox({ options: { pidsLimit: 64 } });
    const bomb = provider
      .exec(
        bombed,
        ["python3", "-c", "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"],
        {
          deadlineMs: 8_000,
        },
      )
      .catch((err: unknown) => err);
    const container = docker.getContainer(bombed.id);
    for (let i = 0; ; i++) {
      const stats = await container.stats({ stream: false, "one-shot": true });
      if ((stats.pids_stats?.current ?? 0) >= 60) break;
      if (i > 100) throw new Error("the fork bomb never reached the pids limit");
      await new Promise((r) => setTimeout(r, 100));
    }
    const stats = await container.stats({ stream: false, "one-shot": true });
    expect(stats.pids_stats?.current ?? 0).toBeLessThanOrEqual(64);
    await otherSandboxServes(bystander);
    const { stdout } = await promisify(execFile)("sh", ["-c", "echo host-alive"], { timeout: 5_000 });
    expect(stdout).toBe("host-alive\n");
    const result = await bomb;
    expect(result).toMatchObject({ exitCode: -1, timedOut: true });
    const receipt = await provider.destroy(bombed);
    expect(receipt).toMatchObject({ confirmed: true, scope: "sandbox" });
  });

  it("another fleet on the same daemon cannot see, adopt or reap this fleet's sandboxes", async () => {
    const other = new DockerSandboxProvider({
      docker: { socketPath: "/var/run/docker.sock" },
      scope: `{other-${RUN}}`,
    });
    const mine = await provider.list({ [LABEL_ROLLOUT]: target.rolloutId });
    expect(mine.map((s) => s.handle.id)).toEqual([target.id]);
    expect(await other.list({ [LABEL_ROLLOUT]: target.rolloutId })).toEqual([]);
    expect(await other.find(target.rolloutId, "resources")).toBeNull();
    expect((await other.list()).some((s) => s.labels[LABEL_SCOPE] === SCOPE)).toBe(false);
    const info = await docker.getContainer(target.id).inspect();
    expect(info.Config.Labels?.[LABEL_SCOPE]).toBe(SCOPE);
  });
});
