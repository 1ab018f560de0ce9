import { execFile, execFileSync } from "node:child_process";
import { readdirSync, readlinkSync } from "node:fs";
import { rm } from "node:fs/promises";
import {
  createServer as createHttpServer,
  request as httpRequest,
  type IncomingMessage,
  type ServerResponse,
} from "node:http";
import { createServer, type Server, type Socket, connect as tcpConnect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import {
  type CleanupReceipt,
  FleetError,
  isFleetError,
  type SandboxHandle,
  type SandboxSpecInput,
} from "@fleet/contracts";
import Dockerode from "dockerode";
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import { parseSandboxSpec } from "../exec-ops.ts";
import {
  AGENT_USER,
  LABEL_MANAGED,
  LABEL_ROLLOUT,
  ROOT_USER,
  TestsSupersededError,
  VERIFY_FENCE_DIR,
  VERIFY_FENCE_FILE,
} from "../provider.ts";
import { scrubScratch } from "../scratch.ts";
import { SPOOL_IN_MEMORY_BYTES, Spool } from "../spool.ts";
import {
  fillWithEmptyFilesPy,
  fleetError,
  KILL_EVERY_SWEEP_ARGV,
  STILL_PENDING,
  settledWithin,
  startRootSweepForgers,
  sweepReforkingChain,
} from "../testing/index.ts";
import {
  buildContainerConfig,
  DEFAULT_SANDBOX_LIMITS,
  reaperLabels,
  sandboxMemoryMb,
  sandboxName,
  workspaceVolumeName,
} from "./container-config.ts";
import { DockerSandboxProvider, LABEL_REAPER } from "./docker-sandbox-provider.ts";

// Real Docker, the offline base image (scripts/build-base-image.sh).
const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const RUN = `it${process.pid}${Date.now().toString(36)}`;

/**
 * The real daemon behind a proxy on a unix socket of its own: `intercept` answers a request
 * itself or takes it to forward later (`forward`), returning true; otherwise it goes through.
 */
async function dockerProxy(
  name: string,
  intercept: (req: IncomingMessage, res: ServerResponse, forward: () => void) => boolean,
): Promise<{ path: string; close: () => Promise<void> }> {
  const path = join(tmpdir(), `fleet-docker-proxy-${name}-${RUN}.sock`);
  const server = createHttpServer((req, res) => {
    const forward = () => {
      const up = httpRequest(
        { socketPath: "/var/run/docker.sock", method: req.method, path: req.url, headers: req.headers },
        (upRes) => {
          res.writeHead(upRes.statusCode ?? 502, upRes.headers);
          upRes.pipe(res);
        },
      );
      up.on("error", () => res.destroy());
      req.pipe(up);
    };
    if (!intercept(req, res, forward)) forward();
  });
  // A hijacked exec stream (`Connection: Upgrade`) goes through as raw bytes both ways.
  server.on("upgrade", (req: IncomingMessage, client: Socket, head: Buffer) => {
    const up = tcpConnect({ path: "/var/run/docker.sock" }, () => {
      const headers = Object.entries(req.headersDistinct).flatMap(([k, vs]) =>
        (vs ?? []).map((v) => `${k}: ${v}`),
      );
      up.write(`${req.method} ${req.url} HTTP/1.1\r\n${headers.join("\r\n")}\r\n\r\n`);
      up.write(head);
      up.pipe(client);
      client.pipe(up);
    });
    up.on("error", () => client.destroy());
    client.on("error", () => up.destroy());
  });
  await new Promise<void>((resolve) => server.listen(path, resolve));
  return {
    path,
    close: async () => {
      await new Promise((resolve) => server.close(resolve));
      await rm(path, { force: true });
    },
  };
}

/** A proxied request answered as the daemon refuses one (Docker's JSON error body). */
function answerDocker(res: ServerResponse, code: number, message: string): true {
  res.writeHead(code, { "content-type": "application/json" });
  res.end(JSON.stringify({ message }));
  return true;
}
const docker = new Dockerode({ socketPath: "/var/run/docker.sock" });
const provider = new DockerSandboxProvider({ docker: { socketPath: "/var/run/docker.sock" } });
/** Uncapped workspaces (`diskMb: null`): the one kind still on a named volume. */
const uncapped = new DockerSandboxProvider({
  docker: { socketPath: "/var/run/docker.sock" },
  defaults: { diskMb: null },
});

const usedRollouts = new Set<string>();
const live: SandboxHandle[] = [];
let counter = 0;

function spec(over: Partial<SandboxSpecInput> = {}): SandboxSpecInput {
  const rolloutId = `${RUN}-${++counter}`;
  usedRollouts.add(rolloutId);
  return { image: IMAGE, rolloutId, owner: "resources", expiresAt: Date.now() + 600_000, ...over };
}

async function create(over: Partial<SandboxSpecInput> = {}): Promise<SandboxHandle> {
  const s = spec(over);
  if (over.rolloutId) usedRollouts.add(over.rolloutId);
  const h = await provider.create(s);
  live.push(h);
  return h;
}

/** Processes of a uid inside the sandbox, read by root (uid 0 is never the agent). */
async function processesOf(h: SandboxHandle, uid: number): Promise<string[]> {
  const r = await provider.exec(h, ["ps", "-eo", "uid=,pid=,args="], { deadlineMs: 10_000, user: ROOT_USER });
  expect(r.exitCode).toBe(0);
  return r.stdout
    .split("\n")
    .map((l) => l.trim())
    .filter((l) => l.split(/\s+/)[0] === String(uid));
}

beforeAll(async () => {
  await docker.getImage(IMAGE).inspect(); // fails clearly when the base image was not built
});

afterEach(async () => {
  // Whatever a test left (including after a failed assertion) is destroyed here.
  while (live.length > 0) await provider.destroy(live.pop()!);
});

afterAll(async () => {
  const containers = await docker.listContainers({
    all: true,
    filters: { label: [`${LABEL_MANAGED}=true`] },
  });
  const leftovers = containers.filter((c) => usedRollouts.has(c.Labels[LABEL_ROLLOUT] ?? ""));
  const volumes = (await docker.listVolumes({ filters: { label: [`${LABEL_MANAGED}=true`] } })).Volumes ?? [];
  const leftoverVolumes = volumes.filter((v) => usedRollouts.has(v.Labels?.[LABEL_ROLLOUT] ?? ""));
  expect(leftovers.map((c) => c.Names[0])).toEqual([]);
  expect(leftoverVolumes.map((v) => v.Name)).toEqual([]);
});

describe("DockerSandboxProvider (real Docker)", () => {
  describe("one shared sandbox", () => {
    let h: SandboxHandle;
    beforeAll(async () => {
      h = await provider.create(spec());
    });
    afterAll(async () => {
      await provider.destroy(h);
    });

    it("creates a hardened, labelled sandbox whose keepalive runs as nobody", async () => {
      const info = await docker.getContainer(h.id).inspect();
      const hc = info.HostConfig;
      expect(info.State.Running).toBe(true);
      expect(hc.NetworkMode).toBe("none");
      expect(hc.CapDrop).toEqual(["ALL"]);
      expect(hc.SecurityOpt).toEqual(["no-new-privileges"]);
      expect(hc.ReadonlyRootfs).toBe(true);
      expect(hc.PidsLimit).toBe(256);
      expect(hc.Memory).toBe(sandboxMemoryMb(DEFAULT_SANDBOX_LIMITS) * 1024 * 1024);
      expect(hc.Init).toBe(true);
      expect(hc.Binds ?? []).toEqual([]);
      // The capped workspace is a tmpfs of the container's own: no volume to leak.
      expect(info.Mounts.map((m) => [m.Type, m.Destination])).toEqual([]);
      expect(hc.Tmpfs?.["/workspace"]).toMatch(/size=1024m,nr_inodes=262144,uid=1000,gid=1000,mode=0755/);
      expect(h.volumes).toEqual([]);
      const ws = await provider.exec(h, ["stat", "-c", "%u:%g %a", "/workspace"], { deadlineMs: 10_000 });
      expect(ws.stdout.trim()).toBe("1000:1000 755");
      expect(info.Config.Labels).toMatchObject({
        "fleet.managed": "true",
        "fleet.rollout": h.rolloutId,
        "fleet.owner": "resources",
      });
      expect(h.name).toBe(`fleet-${h.rolloutId}-resources`);
      const ps = await provider.exec(h, ["ps", "-o", "uid=,args=", "-p", "1"], { deadlineMs: 10_000 });
      expect(ps.stdout.trim()).toMatch(/^65534\s+\/sbin\/docker-init -- sleep infinity$/);
    });

    it("runs a command as the agent user, with env, cwd and stdin", async () => {
      const r = await provider.exec(
        h,
        ["sh", "-c", 'id -u; id -g; pwd; echo "$GREETING"; cat; echo oops >&2; exit 7'],
        {
          deadlineMs: 10_000,
          env: { GREETING: "hello" },
          cwd: "/tmp",
          stdin: "from stdin\n",
        },
      );
      expect(r).toMatchObject({
        exitCode: 7,
        timedOut: false,
        stdout: "1000\n1000\n/tmp\nhello\nfrom stdin\n",
        stderr: "oops\n",
        stdoutTruncated: false,
        stderrTruncated: false,
        oomKilled: false,
      });
      expect(r.durationMs).toBeGreaterThan(0);
    });

    it("returns when the command exits, though a background process it left holds its output open", async () => {
      // Waiting for the background sleep to close the output would run into the deadline.
      const r = await provider.exec(h, ["sh", "-c", "sleep 30 & echo done"], { deadlineMs: 20_000 });
      expect(r).toMatchObject({ exitCode: 0, timedOut: false, stdout: "done\n" });
      await provider.killProcesses(h);
    });

    it("caps 10 MB of output at maxOutputBytes and says so", async () => {
      const r = await provider.exec(
        h,
        ["sh", "-c", "head -c 10000000 /dev/zero | tr '\\000' a; head -c 3000 /dev/zero | tr '\\000' b >&2"],
        { deadlineMs: 60_000 },
      );
      expect(r.exitCode).toBe(0);
      // Its first and its last half-cap (the end is what a reader wants), the middle said to be cut.
      const half = (1024 * 1024) / 2;
      expect(r.stdout).toBe(
        `${"a".repeat(half)}\n[… ${10_000_000 - 2 * half} bytes cut …]\n${"a".repeat(half)}`,
      );
      expect(r.stdoutTruncated).toBe(true);
      expect(r.stderr).toBe("b".repeat(3000));
      expect(r.stderrTruncated).toBe(false);

      const small = await provider.exec(h, ["sh", "-c", "echo 0123456789"], {
        deadlineMs: 10_000,
        maxOutputBytes: 4,
      });
      expect([small.stdout, small.stdoutTruncated]).toEqual(["01\n[… 7 bytes cut …]\n9\n", true]);
    });

    it("caps a command's output at the provider's default maxOutputBytes when the call names none", async () => {
      const capped = new DockerSandboxProvider({
        docker: { socketPath: "/var/run/docker.sock" },
        defaults: { maxOutputBytes: 4 },
      });
      const r = await capped.exec(h, ["sh", "-c", "echo 0123456789; echo 0123456789 >&2"], {
        deadlineMs: 10_000,
      });
      expect([r.stdout, r.stdoutTruncated, r.stderrTruncated]).toEqual([
        "01\n[… 7 bytes cut …]\n9\n",
        true,
        true,
      ]);
      // A cap the call names still wins.
      const named = await capped.exec(h, ["echo", "0123456789"], { deadlineMs: 10_000, maxOutputBytes: 64 });
      expect([named.stdout, named.stdoutTruncated]).toEqual(["0123456789\n", false]);
    });

    it("returns invalid UTF-8 as U+FFFD", async () => {
      const r = await provider.exec(h, ["printf", "ok \\377\\376 end"], { deadlineMs: 10_000 });
      expect(r.stdout).toBe("ok \uFFFD\uFFFD end");
    });

    it("cannot write to / but can write to /workspace", async () => {
      const root = await provider.exec(h, ["sh", "-c", "echo x > /rootfile"], {
        deadlineMs: 10_000,
        user: ROOT_USER,
      });
      expect(root.exitCode).not.toBe(0);
      expect(root.stderr).toMatch(/Read-only file system/);
      const ws = await provider.exec(h, ["sh", "-c", "echo fine > /workspace/ok && cat /workspace/ok"], {
        deadlineMs: 10_000,
      });
      expect([ws.exitCode, ws.stdout]).toEqual([0, "fine\n"]);
    });

    it("cannot reach a TCP server on the host's 127.0.0.1 nor on the docker bridge gateway", async () => {
      let connections = 0;
      const server: Server = createServer((s) => {
        connections++;
        s.on("error", () => {}); // the control client hangs up at once
        s.end("hello\n");
      });
      await new Promise<void>((resolve) => server.listen(0, "0.0.0.0", resolve));
      try {
        const port = (server.address() as { port: number }).port;
        // Control: the server is reachable from the host, so a failure inside means isolation.
        await new Promise<void>((resolve, reject) => {
          const c = tcpConnect(port, "127.0.0.1", () => {
            c.destroy();
            resolve();
          }).on("error", reject);
        });
        await vi.waitFor(() => expect(connections).toBe(1));
        const bridge = await docker.getNetwork("bridge").inspect();
        const cfg = bridge.IPAM.Config?.[0];
        const gateway = cfg?.Gateway ?? cfg?.Subnet?.replace(/\.0\/\d+$/, ".1") ?? "172.17.0.1";
        const probe =
          "import socket,sys\nfor host in sys.argv[1:]:\n  try:\n    socket.create_connection((host, PORT), timeout=3).close(); print(host, 'CONNECTED')\n  except OSError as e:\n    print(host, 'blocked', e)\n";
        const r = await provider.exec(
          h,
          ["python3", "-c", probe.replace("PORT", String(port)), "127.0.0.1", gateway],
          {
            deadlineMs: 30_000,
          },
        );
        expect(r.exitCode).toBe(0);
        expect(r.stdout).not.toContain("CONNECTED");
        expect(r.stdout.match(/blocked/g)).toHaveLength(2);
        expect(connections).toBe(1);
      } finally {
        await new Promise((resolve) => server.close(resolve));
      }
    });

    it("puts files via tar (agent-owned in the workspace, root's in /tests) and gets them back", async () => {
      await provider.put(h, "/workspace/src/pkg", {
        "a.txt": "alpha",
        "bin/run.sh": "#!/bin/sh\necho ran\n",
      });
      await provider.put(h, "/tests", { "test.sh": "#!/bin/sh\nexit 0\n" });
      const ls = await provider.exec(
        h,
        [
          "sh",
          "-c",
          "stat -c '%u:%g %a %n' /workspace/src/pkg/a.txt /workspace/src/pkg/bin/run.sh /tests/test.sh",
        ],
        { deadlineMs: 10_000 },
      );
      expect(ls.stdout.split("\n").filter(Boolean)).toEqual([
        "1000:1000 644 /workspace/src/pkg/a.txt",
        "1000:1000 755 /workspace/src/pkg/bin/run.sh",
        "0:0 755 /tests/test.sh",
      ]);
      const run = await provider.exec(h, ["/workspace/src/pkg/bin/run.sh"], { deadlineMs: 10_000 });
      expect(run.stdout).toBe("ran\n");
      // The agent cannot plant files where tests are staged.
      const plant = await provider.exec(h, ["sh", "-c", "echo x > /tests/conftest.py"], {
        deadlineMs: 10_000,
      });
      expect(plant.exitCode).not.toBe(0);

      expect(await provider.get(h, "/workspace/src/pkg/a.txt")).toBe("alpha");

      // Single files at the modes given, through the archive API and (/tmp is a tmpfs) the exec path.
      const files = {
        "deploy.sh": "#!/bin/sh\necho deployed\n",
        "key.pem": "k",
        locked: "l",
        tool: "echo t\n",
      };
      const modes = { "deploy.sh": 0o644, "key.pem": 0o600, locked: 0, tool: 0o755 };
      await provider.put(h, "/workspace/moded", files, { modes });
      await provider.put(h, "/tmp/moded", files, { modes });
      const moded = await provider.exec(
        h,
        ["sh", "-c", "cd /workspace/moded && stat -c '%a %n' * && cd /tmp/moded && stat -c '%a %n' *"],
        { deadlineMs: 10_000 },
      );
      expect(moded.stdout.split("\n").filter(Boolean)).toEqual([
        "644 deploy.sh",
        "600 key.pem",
        "0 locked",
        "755 tool",
        "644 deploy.sh",
        "600 key.pem",
        "0 locked",
        "755 tool",
      ]);
      expect(await provider.get(h, "/workspace/src/pkg/a.txt", { maxBytes: 3 })).toBe("alp");
      expect(await provider.get(h, "/workspace/nope.txt")).toBeNull();
      expect(await provider.get(h, "/workspace/src")).toBeNull();

      await provider.put(h, "/logs/verifier", { "reward.txt": "0.75\n" }, { user: ROOT_USER });
      expect(await provider.get(h, "/logs/verifier/reward.txt")).toBe("0.75\n");
      expect(await provider.get(h, "/logs/verifier/missing.txt")).toBeNull();
      // A sparse file of 200 GiB (no space taken): its first bytes, at once (all of it took the
      // exec's minute and failed retryable).
      const sparse = await provider.exec(h, ["truncate", "-s", "200G", "/logs/verifier/sparse.txt"], {
        deadlineMs: 10_000,
        user: ROOT_USER,
      });
      expect(sparse.exitCode).toBe(0);
      const head = await settledWithin(
        provider.get(h, "/logs/verifier/sparse.txt", { maxBytes: 65_537 }),
        20_000,
      );
      expect(head).toEqual({ value: "\0".repeat(65_537) });
    });

    it("put with replace leaves exactly the new files (tmpfs and volume), or fails naming what it could not remove", async () => {
      const list = async (dir: string) =>
        (
          await provider.exec(h, ["sh", "-c", `cd ${dir} && find . -mindepth 1 | sort`], {
            deadlineMs: 10_000,
          })
        ).stdout;
      await provider.put(h, "/tests", { "old.sh": "1", "sub/left.txt": "2" }, { user: ROOT_USER });
      await provider.put(h, "/tests", { "test.sh": "3" }, { user: ROOT_USER, replace: true });
      expect(await list("/tests")).toBe("./test.sh\n");
      await provider.put(h, "/workspace/rep", { "a.txt": "1", "d/b.txt": "2" });
      // A tree the agent made read-only is its own to clear.
      await provider.exec(
        h,
        [
          "sh",
          "-c",
          "mkdir -p /workspace/rep/ro/sub && touch /workspace/rep/ro/sub/f && chmod -R a-w /workspace/rep/ro",
        ],
        {
          deadlineMs: 10_000,
        },
      );
      await provider.put(h, "/workspace/rep", { "c.txt": "3" }, { replace: true });
      expect(await list("/workspace/rep")).toBe("./c.txt\n");
      // No files: the directory is emptied (a task without a workspace, reset for a new run).
      await provider.put(h, "/workspace/rep", {}, { replace: true });
      expect(await list("/workspace/rep")).toBe("");

      // A root-owned file in a sticky directory the agent user cannot remove: refused, kept.
      await provider.exec(h, ["sh", "-c", "mkdir -p /tmp/st && touch /tmp/st/roots && chmod 1777 /tmp/st"], {
        deadlineMs: 10_000,
        user: ROOT_USER,
      });
      const err = await fleetError(provider.put(h, "/tmp/st", { "x.txt": "x" }, { replace: true }));
      expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
      expect(err.message).toContain("left: roots");
      expect(await list("/tmp/st")).toBe("./roots\n");

      // A directory that cannot be listed (nor made listable: root's) is not taken for empty.
      await provider.exec(
        h,
        ["sh", "-c", "mkdir -p /tmp/nr && touch /tmp/nr/conftest.py && chmod 0333 /tmp/nr"],
        { deadlineMs: 10_000, user: ROOT_USER },
      );
      const unlisted = await fleetError(provider.put(h, "/tmp/nr", { "x.txt": "x" }, { replace: true }));
      expect([unlisted.kind, unlisted.message]).toEqual([
        "invalid_task",
        expect.stringContaining("cannot list"),
      ]);
    });

    it("the probe says whether /workspace starts empty (before the task's files are staged)", async () => {
      const fresh = await provider.create(spec());
      try {
        expect((await provider.probe(fresh)).workspaceEmpty).toBe(true);
        await provider.put(fresh, "/workspace", { "from-image.txt": "x" });
        expect((await provider.probe(fresh)).workspaceEmpty).toBe(false);
      } finally {
        await provider.destroy(fresh);
      }
    });

    it("the probe says whether scratch holds agent files; scrubScratch removes exactly the agent's, or fails closed", async () => {
      const fresh = await provider.create(spec());
      const sh = (script: string, user = AGENT_USER) =>
        provider.exec(fresh, ["sh", "-c", script], { deadlineMs: 10_000, user });
      try {
        expect((await provider.probe(fresh)).scratchClean).toBe(true);
        // What an interrupted agent leaves: notes, a tree it locked, a symlink, files in /logs and /dev/shm.
        const left = await sh(
          "echo plan > /tmp/notes && mkdir -p /tmp/d/e && touch /tmp/d/e/f && chmod 000 /tmp/d/e /tmp/d && " +
            "ln -s /etc/passwd /tmp/link && echo x > /logs/x && echo x > /dev/shm/x && touch /dev/mqueue/x",
        );
        expect(left.exitCode, left.stderr).toBe(0);
        expect((await provider.probe(fresh)).scratchClean).toBe(false);
        // Root's files there are not the agent's: they stay.
        expect((await sh("echo keep > /tmp/roots", ROOT_USER)).exitCode).toBe(0);

        await scrubScratch(provider, fresh);
        const after = await sh("find /tmp /logs /dev/shm /dev/mqueue -mindepth 1 | sort", ROOT_USER);
        expect(after.stdout.split("\n").filter(Boolean)).toEqual(["/tmp/roots"]);
        expect((await provider.probe(fresh)).scratchClean).toBe(true);

        // SysV IPC objects live in the sandbox's IPC namespace, not in files. A shared memory
        // segment goes with the last process attached to it (kernel.shm_rmid_forced): ipcmk's is
        // gone when ipcmk exits. A queue and a semaphore set of the agent's are seen and removed;
        // root's stay.
        const ipc = await sh("ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1");
        expect(ipc.exitCode, ipc.stderr).toBe(0);
        expect((await sh("tail -n +2 /proc/sysvipc/shm", ROOT_USER)).stdout).toBe("");
        expect((await provider.probe(fresh)).scratchClean).toBe(false);
        expect((await sh("ipcmk -S 3", ROOT_USER)).exitCode).toBe(0);
        await scrubScratch(provider, fresh);
        const ipcLeft = await sh(
          "cat /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem | grep -vc key",
          ROOT_USER,
        );
        expect(ipcLeft.stdout.trim()).toBe("1");
        // Root's set of 3 (the columns: key, which ipcmk draws at random and may be negative, semid, perms, nsems …).
        expect((await sh("tail -n +2 /proc/sysvipc/sem", ROOT_USER)).stdout).toMatch(
          /^\s*-?\d+\s+\d+\s+\d+\s+3\s/,
        );
        expect((await provider.probe(fresh)).scratchClean).toBe(true);

        // A directory the agent can write into but not search (root's, mode 0733): refused, retryable.
        await sh("mkdir /tmp/blind && chmod 0733 /tmp/blind", ROOT_USER);
        expect((await sh("echo hidden > /tmp/blind/f")).exitCode).toBe(0);
        const err = await fleetError(scrubScratch(provider, fresh));
        expect([err.kind, err.retryable]).toEqual(["sandbox_lost", true]);
        expect(err.message).toContain("cannot search /tmp");
      } finally {
        await provider.destroy(fresh);
      }
      // A writable root: the agent could leave files anywhere, so scratch is never clean.
      const writable = await provider.create(spec({ options: { readOnlyRoot: false } }));
      try {
        expect((await provider.probe(writable)).scratchClean).toBe(false);
      } finally {
        await provider.destroy(writable);
      }
    });

    it("probes isolation: own PID namespace, own PID 1, host invisible", async () => {
      const report = await provider.probe(h);
      expect(report.isolated).toBe(true);
      expect(report.checks).toEqual({
        pidNamespaceDiffers: true,
        pidModeNotHost: true,
        pid1IsSandboxInit: true,
        hostSentinelInvisible: true,
      });
    });

    it("stops an agent that kills every sweep of its own uid, by a reaper beside the sandbox that leaves nothing behind", async () => {
      const start = await provider.exec(h, KILL_EVERY_SWEEP_ARGV, { deadlineMs: 10_000 });
      expect(start.stdout).toContain("started");
      expect((await processesOf(h, 1000)).length).toBeGreaterThanOrEqual(1);
      const receipt = await provider.killProcesses(h, AGENT_USER);
      expect(receipt).toMatchObject({ confirmed: true, remaining: 0, alreadyGone: false });
      expect(receipt.detail).toContain("reaper");
      expect(await processesOf(h, 1000)).toEqual([]);
      expect(await provider.alive(h)).toBe(true);
      // The reaper removes itself (the daemon does, once it exits).
      const reapers = async () =>
        (
          await promisify(execFile)("docker", [
            "ps",
            "-aq",
            "--filter",
            "label=fleet.reaper=true",
            "--filter",
            `label=fleet.rollout=${h.rolloutId}`,
          ])
        ).stdout.trim();
      const until = Date.now() + 15_000;
      while ((await reapers()) !== "" && Date.now() < until) await new Promise((r) => setTimeout(r, 200));
      expect(await reapers()).toBe("");
    });

    // The second case hides from a count too: each watcher's main thread exits while a thread of
    // it watches on, and /proc shows the process a zombie ("Z", with more than one thread).
    it.each([
      ["", false],
      [", its processes zombie leaders whose threads run on", true],
    ] as const)(
      "stops an agent that forges its sweep's report (stops the sweep, writes remaining=0 to its stdout, kills it)%s: only a count by an uid it cannot reach confirms",
      async (_case, hidden) => {
        // The forgery is a race the watchers can lose on a loaded host (the sweep's stop reaches
        // them before one sees its shell): the case is set up again, three times at most, until a
        // watcher forged; the receipt is judged on that one.
        for (let attempt = 1; ; attempt++) {
          const fresh = await provider.create(spec());
          try {
            // Three watchers (the first to see the sweep wins): each stops a sweep's shell as it
            // starts, writes "remaining=0" through /proc/<pid>/fd/1 (a process of its own uid), and
            // kills it; beside them (unless hidden) a sleep, the agent's work that must not outlive the stop.
            const watch = [
              "def watch():",
              "    done = set()",
              "    os.listdir('/proc'); open('/tmp/ready', 'a').write('r')",
              "    while True:",
              "        for p in os.listdir('/proc'):",
              "            if not p.isdigit() or p in done: continue",
              "            try: cmd = open('/proc/%s/cmdline' % p, 'rb').read()",
              "            except Exception: continue",
              "            if b'remaining=' in cmd and cmd.startswith(b'/bin/sh'):",
              "                done.add(p)",
              "                try:",
              "                    os.kill(int(p), signal.SIGSTOP)",
              "                    fd = os.open('/proc/%s/fd/1' % p, os.O_WRONLY)",
              "                    os.write(fd, b'remaining=0\\n'); os.close(fd)",
              "                    os.kill(int(p), signal.SIGKILL)",
              "                    open('/tmp/forged', 'a').write(p + '\\n')",
              "                except Exception: pass",
            ];
            const forger = [
              "import ctypes, os, signal, threading",
              ...watch,
              // The main thread's own exit (SYS_exit: 60 on x86-64, 93 on arm64), not the process's.
              hidden
                ? "threading.Thread(target=watch).start(); ctypes.CDLL(None).syscall({'x86_64': 60, 'aarch64': 93}[os.uname().machine], 0)"
                : "watch()",
            ].join("\n");
            await provider.put(fresh, "/workspace", { "forge.py": forger });
            const sleeper = hidden ? "" : "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & ";
            const start = await provider.exec(
              fresh,
              [
                "bash",
                "-c",
                `for i in 1 2 3; do setsid python3 /workspace/forge.py >/dev/null 2>&1 < /dev/null & done; ${sleeper}echo started`,
              ],
              { deadlineMs: 10_000 },
            );
            expect(start.stdout).toContain("started");
            // All three watching (and the sleep up) before the stop.
            const ready = async () =>
              (await provider.exec(fresh, ["cat", "/tmp/ready"], { deadlineMs: 10_000, user: ROOT_USER }))
                .stdout;
            await vi.waitFor(async () => expect(await ready()).toBe("rrr"), {
              timeout: 10_000,
              interval: 100,
            });
            const agentThreads = async () =>
              (
                await provider.exec(
                  fresh,
                  ["sh", "-c", "ps -eLo uid=,stat= | awk '$1 == 1000 && $2 !~ /^Z/' | wc -l"],
                  {
                    deadlineMs: 10_000,
                    user: ROOT_USER,
                  },
                )
              ).stdout.trim();
            expect(await agentThreads()).toBe(hidden ? "3" : "4");
            const receipt = await provider.killProcesses(fresh, AGENT_USER);
            // The forgery happened (the case is the one meant), and did not stand.
            const forged = await provider.exec(fresh, ["cat", "/tmp/forged"], {
              deadlineMs: 10_000,
              user: ROOT_USER,
            });
            // Every attempt's stop stands; the forged one's was confirmed by the reaper's count.
            expect(receipt).toMatchObject({ confirmed: true, remaining: 0, alreadyGone: false });
            expect(await agentThreads()).toBe("0");
            if (forged.stdout.trim() === "" && attempt < 3) continue;
            expect(forged.stdout.trim()).toMatch(/^\d+/);
            expect(receipt.detail).toContain("reaper");
            return;
          } finally {
            await provider.destroy(fresh);
          }
        }
      },
    );

    it("stops an agent whose every process kills the sweeps of its uid and hands over to a new pid: nothing of it runs once the receipt is confirmed", async () => {
      const fresh = await provider.create(spec());
      try {
        const swept = await sweepReforkingChain(provider, fresh);
        expect([swept.started, swept.grew]).toEqual([true, true]);
        expect(swept.receipt).toMatchObject({ confirmed: true, remaining: 0, alreadyGone: false });
        // The chain added a link every few milliseconds while it ran: none in the second after.
        expect(new Set(swept.after).size).toBe(1);
        expect(await provider.alive(fresh)).toBe(true);
      } finally {
        await provider.destroy(fresh);
      }
    });

    it("a sweep of root's own processes (the tests') kills them all and keeps the sandbox and the sweep's own exec", async () => {
      const start = await provider.exec(
        h,
        [
          "sh",
          "-c",
          "setsid sleep 1000 >/dev/null 2>&1 </dev/null & sleep 1001 >/dev/null 2>&1 </dev/null & echo started",
        ],
        { deadlineMs: 10_000, user: ROOT_USER },
      );
      expect(start.stdout).toBe("started\n");
      const sleeps = async () => (await processesOf(h, 0)).filter((l) => /sleep 100[01]/.test(l));
      expect(await sleeps()).toHaveLength(2);
      const receipt = await provider.killProcesses(h, ROOT_USER);
      expect(receipt).toMatchObject({
        scope: "processes",
        confirmed: true,
        remaining: 0,
        alreadyGone: false,
      });
      expect(await sleeps()).toEqual([]);
      expect(await provider.alive(h)).toBe(true);
      expect((await provider.exec(h, ["true"], { deadlineMs: 10_000 })).exitCode).toBe(0);
    });

    it("a sweep of root's own processes is never confirmed by what the tests' root processes write into its output (its stdout taken with pidfd_getfd or through /proc/<pid>/fd, the sweep then killed)", async () => {
      const fresh = await provider.create(spec());
      try {
        // The tests' code watching for the sweep, to forge its output (`startRootSweepForgers`).
        const forgers = await startRootSweepForgers(provider, fresh);
        expect(await forgers()).toBe(8);
        const receipt = await provider.killProcesses(fresh, ROOT_USER, { quickMs: 5_000 });
        const left = await forgers();
        expect({ confirmed: receipt.confirmed, left: left > 0 ? "some" : "none" }).not.toEqual({
          confirmed: true,
          left: "some",
        });
      } finally {
        await provider.destroy(fresh);
      }
    });

    it("a root sweep given a verify epoch raises the sandbox's fence to it before it kills, never lowers it, and kills nothing once it is above its epoch; neither the tests (root) nor the agent can write the fence", async () => {
      const fence = async () =>
        (await provider.exec(h, ["cat", VERIFY_FENCE_FILE], { deadlineMs: 10_000, user: ROOT_USER })).stdout;
      await provider.exec(h, ["sh", "-c", "sleep 1000 >/dev/null 2>&1 </dev/null & echo started"], {
        deadlineMs: 10_000,
        user: ROOT_USER,
      });
      expect(await provider.killProcesses(h, ROOT_USER, { fenceEpoch: 3 })).toMatchObject({
        confirmed: true,
        fenced: true,
      });
      expect((await processesOf(h, 0)).filter((l) => /sleep 1000/.test(l))).toEqual([]);
      expect(await fence()).toBe("3\n");
      // An older attempt's sweep that lands late leaves the later one's fence, and kills nothing
      // of the later attempt's tests: it stops, superseded.
      await provider.exec(h, ["sh", "-c", "sleep 1001 >/dev/null 2>&1 </dev/null & echo started"], {
        deadlineMs: 10_000,
        user: ROOT_USER,
      });
      const late = await provider.killProcesses(h, ROOT_USER, { fenceEpoch: 2 }).catch((e: unknown) => e);
      expect(late).toBeInstanceOf(TestsSupersededError);
      expect(late).toMatchObject({ fence: 3, epoch: 2 });
      expect((await processesOf(h, 0)).filter((l) => /sleep 1001/.test(l))).toHaveLength(1);
      expect(await fence()).toBe("3\n");
      expect(await provider.killProcesses(h, ROOT_USER, { fenceEpoch: 7 })).toMatchObject({ fenced: true });
      expect(await fence()).toBe("7\n");
      // A sweep asked for no fence says nothing of one.
      expect((await provider.killProcesses(h, ROOT_USER)).fenced).toBeUndefined();
      // The tests run the agent's code as root: a fence they could raise would refuse every
      // later attempt (a mask the agent chose). Neither they nor the agent can write, replace or
      // remove it; both may read it.
      for (const user of [ROOT_USER, AGENT_USER]) {
        const tamper = await provider.exec(
          h,
          [
            "sh",
            "-c",
            `echo 99 > ${VERIFY_FENCE_FILE}; echo 99 > ${VERIFY_FENCE_DIR}/x && mv -f ${VERIFY_FENCE_DIR}/x ${VERIFY_FENCE_FILE}; rm -f ${VERIFY_FENCE_FILE}; cat ${VERIFY_FENCE_FILE}`,
          ],
          { deadlineMs: 10_000, user },
        );
        expect(tamper.stdout).toBe("7\n");
      }
      expect(await fence()).toBe("7\n");
    });

    it("kills every agent process, including ones that left the process group, and keeps the sandbox", async () => {
      const bg = await provider.exec(
        h,
        [
          "sh",
          "-c",
          "setsid sleep 1000 >/dev/null 2>&1 </dev/null & sleep 1000 >/dev/null 2>&1 </dev/null &",
        ],
        {
          deadlineMs: 10_000,
        },
      );
      expect(bg.exitCode).toBe(0);
      expect((await processesOf(h, 1000)).length).toBeGreaterThanOrEqual(2);
      const receipt = await provider.killProcesses(h, AGENT_USER);
      expect(receipt).toMatchObject({
        scope: "processes",
        confirmed: true,
        remaining: 0,
        alreadyGone: false,
      });
      expect(await processesOf(h, 1000)).toEqual([]);
      expect(await provider.alive(h)).toBe(true);
    });
  });

  it("kills the whole process tree at the deadline: exitCode -1, timedOut, no uid 1000 process left", async () => {
    const h = await create();
    const started = Date.now();
    const r = await provider.exec(h, ["sh", "-c", "sleep 1000 & sleep 1000"], { deadlineMs: 2_000 });
    expect(r).toMatchObject({ exitCode: -1, timedOut: true });
    expect(Date.now() - started).toBeLessThan(10_000);
    expect(await processesOf(h, 1000)).toEqual([]);
  });

  it("at the deadline, keeps what a command prints in its kill grace (SIGTERM handled before the SIGKILL)", async () => {
    // The host waits past the in-sandbox deadline by the kill grace: an agent that saves its
    // work on SIGTERM is graded on it, not on output cut at the deadline. A kill grace far longer
    // than the handler's 1 s, so a loaded host cannot SIGKILL it first (bubblewrap's twin of this
    // test once missed "saved" in CI with the default 2 s grace); it still ends at the handler's exit.
    const graceful = new DockerSandboxProvider({
      docker: { socketPath: "/var/run/docker.sock" },
      defaults: { killGraceS: 15 },
    });
    const h = await create();
    const r = await graceful.exec(
      h,
      ["sh", "-c", "trap 'sleep 1; echo saved; exit 3' TERM; echo working; sleep 1000 & wait"],
      { deadlineMs: 1_000 },
    );
    expect(r).toMatchObject({ exitCode: -1, timedOut: true, stdout: "working\nsaved\n" });
  });

  it("contains a fork bomb with the pids limit while the host stays responsive, then destroys it", async () => {
    const h = await create({ options: { pidsLimit: 64 } });
    const container = docker.getContainer(h.id);
    let maxLagMs = 0;
    let last = performance.now();
    const ticker = setInterval(() => {
      const now = performance.now();
      maxLagMs = Math.max(maxLagMs, now - last);
      last = now;
    }, 20);
    try {
      // Every process keeps forking and shrugs off failed forks, so the bomb stays at the limit
      // until the deadline kills its process group.
      const forever = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n";
      const bomb = provider.exec(h, ["python3", "-c", forever], { deadlineMs: 6_000 });
      // Wait until the bomb has filled the sandbox up to its limit...
      await vi.waitFor(
        async () => {
          const stats = await container.stats({ stream: false, "one-shot": true });
          expect(stats.pids_stats?.current ?? 0).toBeGreaterThanOrEqual(60);
          expect(stats.pids_stats?.current ?? 0).toBeLessThanOrEqual(64);
        },
        { timeout: 8_000, interval: 100 },
      );
      // ...and the host still answers meanwhile.
      const { stdout } = await promisify(execFile)("sh", ["-c", "echo host-alive"], { timeout: 5_000 });
      expect(stdout).toBe("host-alive\n");
      const result = await bomb.catch((err: unknown) => err);
      expect(isFleetError(result) ? result : { ...(result as object), stdout: "", stderr: "" }).toMatchObject(
        {
          exitCode: -1,
          timedOut: true,
        },
      );
      expect(maxLagMs).toBeLessThan(2_000);
    } finally {
      clearInterval(ticker);
    }
    const receipt = await provider.destroy(live.pop()!);
    expect(receipt).toMatchObject({ confirmed: true, scope: "sandbox", alreadyGone: false });
    expect(await provider.alive(h)).toBe(false);
  });

  it("a command in a sandbox frozen from outside is sandbox_lost once the host's timer fires, not a timeout (its own deadline could not fire)", async () => {
    const h = await create();
    const running = provider.exec(h, ["sleep", "60"], { deadlineMs: 1_000 }).then(
      (r) => r,
      (e: unknown) => e,
    );
    // Paused only once the command runs: paused while its exec still starts, the exec's `runc
    // init` freezes half-joined and the daemon holds the container's lock for good (no unpause,
    // inspect nor removal answers again). By the whole command line: `pgrep -f "sleep 60"` also
    // matches its own `timeout ... pgrep -f sleep 60` wrapper, and so answered yes at once.
    await vi.waitFor(
      async () => {
        const ps = await provider.exec(h, ["pgrep", "-f", "^sleep 60$"], { deadlineMs: 5_000 });
        expect(ps.exitCode).toBe(0);
      },
      { timeout: 10_000, interval: 50 },
    );
    execFileSync("docker", ["pause", h.id], { stdio: "pipe", timeout: 60_000 });
    try {
      const err = await running;
      expect(isFleetError(err), `expected a FleetError, got ${JSON.stringify(err)}`).toBe(true);
      expect(err).toMatchObject({ kind: "sandbox_lost", retryable: false });
      expect((err as Error).message).toMatch(/was paused/);
    } finally {
      execFileSync("docker", ["unpause", h.id], { stdio: "pipe", timeout: 30_000 });
    }
    // Running again, a command that outlives its deadline is a timeout as before.
    const late = await provider.exec(h, ["sleep", "60"], { deadlineMs: 1_000 });
    expect(late).toMatchObject({ exitCode: -1, timedOut: true });
  });

  it("a command whose sandbox is removed or killed under it is sandbox_lost, never the SIGKILL exit (137) of its own", async () => {
    for (const end of [["kill"], ["rm", "-f"]]) {
      const h = await create();
      const running = provider.exec(h, ["sleep", "60"], { deadlineMs: 30_000 }).then(
        (r) => r,
        (e: unknown) => e,
      );
      await vi.waitFor(
        async () => {
          const ps = await provider.exec(h, ["pgrep", "-f", "^sleep 60$"], { deadlineMs: 5_000 });
          expect(ps.exitCode).toBe(0);
        },
        { timeout: 10_000, interval: 50 },
      );
      execFileSync("docker", [...end, h.id], { stdio: "pipe", timeout: 60_000 });
      const err = await running;
      expect(isFleetError(err), `${end[0]}: expected a FleetError, got ${JSON.stringify(err)}`).toBe(true);
      expect(err).toMatchObject({ kind: "sandbox_lost", retryable: false });
    }
  });

  it("leaves the processes their memory however many files (of the longest names) the agent left on every tmpfs", async () => {
    const memoryMb = 64;
    const h = await create({ options: { memoryMb, tmpfsMb: 16, diskMb: 16 } });
    // Fill every tmpfs to its size cap with one file's data, then to its inode cap with empty
    // files (no data pages, only kernel memory), each name 255 bytes (too long for a dentry's own
    // buffer: the most kernel memory per file).
    const fill = await provider.exec(
      h,
      [
        "python3",
        "-c",
        `import os
for base in ["/workspace", "/tmp", "/logs", "/dev/shm"]:
    try:
        with open(f"{base}/data", "wb") as f:
            while True:
                f.write(b"x" * 65536)
                f.flush()
    except OSError:
        pass
${fillWithEmptyFilesPy(["/workspace", "/tmp", "/logs", "/dev/shm"], { nameWidth: 255 })}`,
      ],
      { deadlineMs: 120_000 },
    );
    expect(fill.exitCode, fill.stderr).toBe(0);
    expect(Number(fill.stdout)).toBeGreaterThan(20_000);
    const free = await provider.exec(
      h,
      [
        "sh",
        "-c",
        "d=/sys/fs/cgroup/memory; if [ -e $d/memory.limit_in_bytes ]; then echo $(( $(cat $d/memory.limit_in_bytes) - $(cat $d/memory.usage_in_bytes) )); else echo $(( $(cat /sys/fs/cgroup/memory.max) - $(cat /sys/fs/cgroup/memory.current) )); fi",
      ],
      { deadlineMs: 10_000 },
    );
    expect(free.exitCode, free.stderr).toBe(0);
    // What the processes were promised is still there (less a little: the shell reading it).
    expect(Number(free.stdout) / 2 ** 20).toBeGreaterThan(memoryMb * 0.95);
  });

  it("flags an OOM kill", async () => {
    // Small tmpfs caps: the memory limit adds them (see sandboxMemoryMb), and 512 MiB must exceed it.
    const h = await create({ options: { memoryMb: 64, tmpfsMb: 8, diskMb: 8 } });
    const r = await provider.exec(h, ["python3", "-c", "x = bytearray(512 * 1024 * 1024)"], {
      deadlineMs: 60_000,
    });
    expect(r).toMatchObject({ exitCode: 137, timedOut: false, oomKilled: true });
    // A later SIGKILL of the sandbox's own making is no OOM kill: the count did not grow.
    const later = await provider.exec(h, ["sh", "-c", "kill -9 $$"], { deadlineMs: 10_000 });
    expect(later).toMatchObject({ exitCode: 137, timedOut: false, oomKilled: false });
    // ...and the next OOM kill is one again.
    const again = await provider.exec(h, ["python3", "-c", "x = bytearray(512 * 1024 * 1024)"], {
      deadlineMs: 60_000,
    });
    expect(again).toMatchObject({ exitCode: 137, oomKilled: true });
  });

  it("refuses pidMode host at the probe as final isolation_refused", async () => {
    const h = await create({ options: { pidMode: "host" } });
    const err = await fleetError(provider.probe(h));
    expect([err.kind, err.retryable]).toEqual(["isolation_refused", false]);
    expect(err.message).toMatch(/pidNamespaceDiffers/);
  });

  it("re-delivered create finds the same sandbox; find() by label", async () => {
    const s = spec();
    const a = await provider.create(s);
    live.push(a);
    const b = await provider.create(s);
    expect(b.id).toBe(a.id);
    expect((await provider.find(s.rolloutId, "resources"))?.id).toBe(a.id);
    expect(await provider.find(s.rolloutId, "agent")).toBeNull();
    expect((await provider.list({ [LABEL_ROLLOUT]: s.rolloutId })).map((i) => i.handle.id)).toEqual([a.id]);
  });

  it("a re-delivered create takes over the container its first attempt made but never started (its worker died in between), and starts it", async () => {
    const s = spec();
    // What the first attempt left: the container, created with the provider's own request, not started.
    const made = await docker.createContainer(buildContainerConfig(parseSandboxSpec(s), provider.defaults));
    const h = await provider.create(s);
    live.push(h);
    expect(h.id).toBe(made.id);
    expect(await provider.alive(h)).toBe(true);
    expect(await provider.exec(h, ["echo", "up"], { deadlineMs: 10_000 })).toMatchObject({
      exitCode: 0,
      stdout: "up\n",
    });
  });

  it.each([
    ["a capped one (its workspace a tmpfs)", false],
    ["an uncapped one (its workspace a volume, removed with it)", true],
  ] as const)(
    "a re-delivered create never takes over a sandbox that ran and stopped, %s: it removes it, fails retryable, and its retry makes it afresh",
    async (_case, uncappedCase) => {
      const maker = uncappedCase ? uncapped : provider;
      const s = spec();
      const first = await maker.create(s);
      live.push(first);
      await maker.put(first, "/workspace", { "work.txt": "the agent's\n" });
      await docker.getContainer(first.id).kill();
      await vi.waitFor(
        async () => expect((await docker.getContainer(first.id).inspect()).State.Running).toBe(false),
        {
          timeout: 10_000,
          interval: 100,
        },
      );
      const err = await fleetError(maker.create(s));
      expect([err.kind, err.retryable]).toEqual(["sandbox_lost", true]);
      await expect(docker.getContainer(first.id).inspect()).rejects.toMatchObject({ statusCode: 404 });
      expect(first.volumes).toHaveLength(uncappedCase ? 1 : 0);
      for (const volume of first.volumes) {
        await expect(docker.getVolume(volume).inspect()).rejects.toMatchObject({ statusCode: 404 });
      }
      const again = await maker.create(s);
      live.push(again);
      expect(again.id).not.toBe(first.id);
      expect((await maker.probe(again)).workspaceEmpty).toBe(true);
    },
  );

  it("the probe refuses a sandbox the daemon reports in the host's PID namespace, whatever its other checks say", async () => {
    // A worker in a container of its own sees a host-PID sandbox's namespace as another one
    // (pidNamespaceDiffers passes there): the daemon's PidMode is what tells. The real daemon,
    // behind a proxy that reports this sandbox's PidMode as "host".
    let asHost = false;
    const proxy = await dockerProxy("pidmode", (req, res) => {
      if (!asHost || req.method !== "GET" || !/\/containers\/[^/]+\/json/.test(req.url ?? "")) return false;
      const up = httpRequest(
        { socketPath: "/var/run/docker.sock", method: "GET", path: req.url, headers: req.headers },
        (upRes) => {
          const chunks: Buffer[] = [];
          upRes.on("data", (c: Buffer) => chunks.push(c));
          upRes.on("end", () => {
            const info = JSON.parse(Buffer.concat(chunks).toString("utf8"));
            info.HostConfig.PidMode = "host";
            res.writeHead(upRes.statusCode ?? 200, { "content-type": "application/json" });
            res.end(JSON.stringify(info));
          });
        },
      );
      up.on("error", () => res.destroy());
      up.end();
      return true;
    });
    const seen = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
    // Made, probed and destroyed through the proxy (a handle names the endpoint that made it).
    const h = await seen.create(spec());
    try {
      expect((await seen.probe(h)).isolated).toBe(true);
      asHost = true;
      const err = await fleetError(seen.probe(h));
      expect([err.kind, err.retryable]).toEqual(["isolation_refused", false]);
      expect(err.message).toMatch(/failed: pidModeNotHost\)/);
    } finally {
      asHost = false;
      await seen.destroy(h);
      await proxy.close();
    }
  });

  it("two fleets sharing the daemon never take each other's sandbox for a rollout id they share", async () => {
    // Rollout ids derive from idempotency keys, so two fleets given the same key share them.
    const socket = { socketPath: "/var/run/docker.sock" };
    const fleetA = new DockerSandboxProvider({ docker: socket, scope: `${RUN}-a` });
    const fleetB = new DockerSandboxProvider({ docker: socket, scope: `${RUN}-b` });
    const s = spec();
    const a = await fleetA.create(s);
    live.push(a);
    const b = await fleetB.create(s);
    live.push(b);
    expect(b.id).not.toBe(a.id);
    expect(b.name).not.toBe(a.name);
    expect((await fleetA.find(s.rolloutId, "resources"))?.id).toBe(a.id);
    expect((await fleetB.find(s.rolloutId, "resources"))?.id).toBe(b.id);
    expect((await fleetB.create(s)).id).toBe(b.id); // a re-delivered create still finds its own
    // One fleet closing its rollout leaves the other's sandbox running.
    expect(await fleetB.destroy(b)).toMatchObject({ confirmed: true, alreadyGone: false });
    expect(await fleetA.alive(a)).toBe(true);

    // A container bearing this fleet's name but another fleet's scope is refused, and left alone.
    const other = spec();
    const foreign = buildContainerConfig(parseSandboxSpec(other), fleetA.defaults, `${RUN}-a`);
    const name = sandboxName(other.rolloutId, "resources", `${RUN}-b`);
    const made = await docker.createContainer({ ...foreign, name });
    try {
      const err = await fleetError(fleetB.create(other));
      expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
      expect(err.message).toMatch(/not this rollout's sandbox/);
      expect((await made.inspect()).Id).toBe(made.id);
    } finally {
      await made.remove({ force: true, v: true });
      await docker
        .getVolume(workspaceVolumeName(foreign.name!))
        .remove()
        .catch(() => undefined);
    }
  });

  it("two deployments with one scope (each its own Redis) given one rollout id: neither finds, takes over nor removes the other's sandbox", async () => {
    const scope = `${RUN}-same`;
    const ours = new DockerSandboxProvider({ scope, instance: "ours" });
    const theirs = new DockerSandboxProvider({ scope, instance: "theirs" });
    const s = spec();
    const made = await theirs.create(s);
    live.push(made);
    expect((await docker.getContainer(made.id).inspect()).Config.Labels).toMatchObject({
      "fleet.scope": scope,
      "fleet.instance": "theirs",
    });
    expect(await ours.find(s.rolloutId, "resources")).toBeNull();
    const err = await fleetError(ours.create(s)); // the name is taken: refused, never adopted
    expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
    expect(err.message).toMatch(/not this rollout's sandbox/);
    expect(await theirs.alive(made)).toBe(true);
    expect((await theirs.find(s.rolloutId, "resources"))?.id).toBe(made.id);
    // Both list it (the janitor judges another deployment's by its expiry only).
    expect((await ours.list({ "fleet.rollout": s.rolloutId })).map((i) => i.handle.id)).toEqual([made.id]);
  });

  it("two deployments with one scope given one rollout id: neither joins the other's gateway network", async () => {
    const scope = `${RUN}-same-net`;
    const ours = new DockerSandboxProvider({ scope, instance: "ours" });
    const s = spec();
    const name = `fleet-gw-it-${RUN}-theirs`;
    await docker.createNetwork({
      Name: name,
      Internal: true,
      Labels: {
        [LABEL_MANAGED]: "true",
        "fleet.network": "gateway",
        [LABEL_ROLLOUT]: s.rolloutId,
        "fleet.scope": scope,
        "fleet.instance": "theirs",
      },
    });
    try {
      const err = await fleetError(ours.create({ ...s, network: name }));
      expect([err.kind, err.retryable]).toEqual(["isolation_refused", false]);
      expect(await ours.find(s.rolloutId, "resources")).toBeNull();
    } finally {
      const joined = await ours.find(s.rolloutId, "resources");
      if (joined) await ours.destroy(joined);
      await docker
        .getNetwork(name)
        .remove()
        .catch(() => undefined);
    }
  });

  it("a container removed between its create and its start is the infrastructure's (retryable), not the task's", async () => {
    // The real daemon behind a proxy that removes the container just before its start goes
    // through: what a re-delivered seed taking over, or a close, does in that window.
    const removedFirst: string[] = [];
    const proxy = await dockerProxy("start-race", (req, _res, forward) => {
      const started = /^\/(?:v[\d.]+\/)?containers\/([^/]+)\/start/.exec(req.url ?? "");
      if (!started || removedFirst.length > 0) return false;
      removedFirst.push(started[1]!);
      execFile("docker", ["rm", "-f", started[1]!], () => forward());
      return true;
    });
    try {
      const racing = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
      const s = spec();
      const err = await fleetError(racing.create(s));
      expect(removedFirst).toHaveLength(1);
      expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
      // Its retry makes the sandbox afresh.
      const h = await racing.create(s);
      try {
        expect(await racing.alive(h)).toBe(true);
      } finally {
        expect(await racing.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: false });
      }
    } finally {
      await proxy.close();
    }
  });

  it("a create told to stop while the daemon holds its start gives up at once (retryable), its container left for its labels to find", async () => {
    // The real daemon behind a proxy that holds every start: a daemon slow to answer (a loaded
    // host), under a seed whose worker is shutting down.
    const held: ServerResponse[] = [];
    const proxy = await dockerProxy("held-start", (req, res) => {
      if (!/^\/(?:v[\d.]+\/)?containers\/[^/]+\/start/.test(req.url ?? "")) return false;
      held.push(res);
      return true;
    });
    try {
      const slow = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
      const s = spec();
      const stop = new AbortController();
      const creating = slow.create(s, { signal: stop.signal });
      await vi.waitFor(() => expect(held).toHaveLength(1), { timeout: 20_000, interval: 20 });
      stop.abort();
      // Well within the API timeout (30 s) the held start would otherwise run to.
      const settled = await settledWithin(creating, 5_000);
      expect(settled).not.toBe(STILL_PENDING);
      const err = settled !== STILL_PENDING && "err" in settled ? settled.err : settled;
      expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
      // Not removed (that would wait on the same slow daemon): the seed's intent covers it, and the
      // next delivery finds it by its labels and replaces it, as a close would destroy it.
      const found = await provider.find(s.rolloutId, "resources");
      expect(found).not.toBeNull();
      expect(await provider.destroy(found!)).toMatchObject({ confirmed: true, alreadyGone: false });
    } finally {
      for (const res of held) res.destroy();
      await proxy.close();
    }
  });

  it("a call whose reply is cut after its headers fails at the API timeout: it never waits for good (the janitor's listing did)", async () => {
    // The daemon's own reply to the listing, its headers and a part of its body, then the
    // connection drops (a daemon restarted mid-reply, a proxy that died).
    let cut = 0;
    const proxy = await dockerProxy("cut-reply", (req, res) => {
      if (req.method !== "GET" || !/\/containers\/json/.test(req.url ?? "")) return false;
      const up = httpRequest(
        { socketPath: "/var/run/docker.sock", method: "GET", path: req.url, headers: req.headers },
        (upRes) => {
          res.writeHead(upRes.statusCode ?? 200, upRes.headers);
          upRes.once("data", (chunk: Buffer) => {
            cut++;
            res.write(chunk.subarray(0, 1), () => res.socket?.destroy());
            upRes.destroy();
          });
        },
      );
      up.on("error", () => res.destroy());
      up.end();
      return true;
    });
    try {
      const cutOff = new DockerSandboxProvider({
        docker: { socketPath: proxy.path },
        // Long enough for the daemon's headers to come first on a loaded host (the cut follows them).
        defaults: { apiTimeoutMs: 3_000 },
      });
      const settled = await settledWithin(cutOff.list(), 20_000);
      expect(cut).toBe(1);
      expect(settled).not.toBe(STILL_PENDING);
      const outcome = settled !== STILL_PENDING && "err" in settled ? settled.err : settled;
      expect(isFleetError(outcome) && [outcome.kind, outcome.retryable]).toEqual([
        "provider_unavailable",
        true,
      ]);
      expect(String((outcome as Error).message)).toMatch(/timed out or was aborted/);
    } finally {
      await proxy.close();
    }
  });

  it("a sandbox that fails to start is removed before a final error; one whose removal fails, or that cannot be seen gone, makes the create retryable", async () => {
    // The real daemon behind a proxy that refuses every start as the image's fault (no `sleep`)
    // and, as the case asks, fails the container's removal and then its inspect.
    const fail = { removal: false, inspect: false };
    let startRefused = false;
    const proxy = await dockerProxy("start-refused", (req, res) => {
      const url = req.url ?? "";
      if (req.method === "POST" && /\/containers\/[^/]+\/start/.test(url)) {
        startRefused = true;
        return answerDocker(
          res,
          400,
          'failed to create task: exec: "sleep": executable file not found in $PATH',
        );
      }
      if (startRefused && fail.removal && req.method === "DELETE" && /\/containers\//.test(url))
        return answerDocker(res, 500, "the daemon failed the removal");
      if (startRefused && fail.inspect && req.method === "GET" && /\/containers\/[^/]+\/json/.test(url))
        return answerDocker(res, 500, "the daemon failed the inspect");
      return false;
    });
    const ofRollout = async (rolloutId: string) =>
      docker.listContainers({ all: true, filters: { label: [`${LABEL_ROLLOUT}=${rolloutId}`] } });
    const refusing = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
    const specs: SandboxSpecInput[] = [];
    const attempt = async (removal: boolean, inspect: boolean) => {
      Object.assign(fail, { removal, inspect });
      startRefused = false;
      const s = spec();
      specs.push(s);
      return { err: await fleetError(refusing.create(s)), left: (await ofRollout(s.rolloutId)).length };
    };
    try {
      const removed = await attempt(false, false);
      expect([removed.err.kind, removed.err.retryable, removed.left]).toEqual(["invalid_task", false, 0]);
      const kept = await attempt(true, false);
      expect([kept.err.kind, kept.err.retryable, kept.left]).toEqual(["provider_unavailable", true, 1]);
      expect(kept.err.message).toMatch(/failed to start .* and could not be removed/s);
      const unseen = await attempt(true, true);
      expect([unseen.err.kind, unseen.err.retryable, unseen.left]).toEqual(["provider_unavailable", true, 1]);
    } finally {
      await proxy.close();
      for (const s of specs)
        for (const c of await ofRollout(s.rolloutId))
          await docker.getContainer(c.Id).remove({ force: true, v: true });
    }
  });

  it("a start the runtime fails on a path of its own (a cgroup file, containerd's socket: 'no such file or directory') is the infrastructure's (retryable), not the image's; one naming the program it could not exec is the image's", async () => {
    let refusal = "";
    const proxy = await dockerProxy("start-runtime-path", (req, res) => {
      if (req.method === "POST" && /\/containers\/[^/]+\/start/.test(req.url ?? ""))
        return answerDocker(res, 500, refusal);
      return false;
    });
    const refusing = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
    const specs: SandboxSpecInput[] = [];
    const outcome = async (message: string) => {
      refusal = message;
      const s = spec();
      specs.push(s);
      const err = await fleetError(refusing.create(s));
      return [err.kind, err.retryable];
    };
    try {
      expect(
        await outcome(
          "failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: error during container init: error setting cgroup config for procHooks process: openat2 /sys/fs/cgroup/system.slice/docker-0123.scope/cpu.max: no such file or directory: unknown",
        ),
      ).toEqual(["provider_unavailable", true]);
      expect(
        await outcome(
          'failed to create task for container: failed to create shim task: connection error: desc = "transport: Error while dialing: dial unix /run/containerd/containerd.sock: connect: no such file or directory": unavailable',
        ),
      ).toEqual(["provider_unavailable", true]);
      // The image's: as the runtime reports an entrypoint it cannot find (by name, by path).
      expect(
        await outcome(
          'failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: exec: "/usr/bin/sleep": stat /usr/bin/sleep: no such file or directory: unknown',
        ),
      ).toEqual(["invalid_task", false]);
      expect(
        await outcome(
          'failed to create shim task: OCI runtime create failed: runc create failed: unable to start container process: exec: "sleep": executable file not found in $PATH: unknown',
        ),
      ).toEqual(["invalid_task", false]);
    } finally {
      await proxy.close();
      for (const s of specs)
        for (const c of await docker.listContainers({
          all: true,
          filters: { label: [`${LABEL_ROLLOUT}=${s.rolloutId}`] },
        }))
          await docker.getContainer(c.Id).remove({ force: true, v: true });
    }
  });

  /**
   * The probe of a sandbox made from the base image with `run` (a Dockerfile RUN) applied: its
   * error, which must be the task's; the image is removed after.
   */
  async function probeErrorOfImage(name: string, run: string): Promise<FleetError> {
    const image = `fleet-test/${name}:${RUN}`;
    execFileSync("docker", ["build", "-q", "-t", image, "-"], {
      input: `FROM ${IMAGE}\nRUN ${run}\n`,
      stdio: ["pipe", "ignore", "pipe"],
      timeout: 120_000,
    });
    try {
      const err = await fleetError(provider.probe(await create({ image })));
      expect([err.kind, err.retryable]).toEqual(["invalid_task", false]);
      return err;
    } finally {
      while (live.length > 0) await provider.destroy(live.pop()!);
      execFileSync("docker", ["rmi", "-f", image], { stdio: "ignore", timeout: 60_000 });
    }
  }

  it("an image that cannot run the fleet's commands (no /usr/bin/timeout) fails its probe as the task's, at once", async () => {
    const err = await probeErrorOfImage("no-timeout", "rm -f /usr/bin/timeout");
    expect(err.message).toMatch(/exit 12[67].*\/usr\/bin\/timeout/);
  });

  it("an image whose /usr/bin/timeout is not coreutils' (busybox's, as in Alpine) fails its probe as the task's, at once", async () => {
    // A stand-in that runs the command as busybox's does, with no deadline semantics of
    // coreutils' (and no --version): the probe itself runs under it.
    const err = await probeErrorOfImage(
      "other-timeout",
      `printf '#!/bin/sh\\nshift 3\\nexec "$@"\\n' > /usr/bin/timeout && chmod 755 /usr/bin/timeout`,
    );
    expect(err.message).toContain("/usr/bin/timeout that is not coreutils'");
    // The fleet's own image passes (coreutils' timeout).
    const ok = await create();
    await expect(provider.probe(ok)).resolves.toMatchObject({ isolated: true });
  });

  /**
   * Run `body` on a sandbox of an image (`fleet-test/<name>`) whose PATH leads through a directory
   * the agent writes (`/workspace/bin`, first); its sandboxes and the image are removed after.
   */
  async function withAgentPathImage(name: string, body: (h: SandboxHandle) => Promise<void>): Promise<void> {
    const image = `fleet-test/${name}:${RUN}`;
    execFileSync("docker", ["build", "-q", "-t", image, "-"], {
      input: `FROM ${IMAGE}\nENV PATH=/workspace/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n`,
      stdio: ["pipe", "ignore", "pipe"],
      timeout: 120_000,
    });
    try {
      await body(await create({ image }));
    } finally {
      while (live.length > 0) await provider.destroy(live.pop()!);
      execFileSync("docker", ["rmi", "-f", image], { stdio: "ignore", timeout: 60_000 });
    }
  }

  /**
   * Put the agent's own programs in `/workspace/bin`, written by the agent, each from the shell
   * text `program` gives for its name (`$t`); fails unless all are there.
   */
  async function plantAgentPrograms(h: SandboxHandle, names: string[], program: string): Promise<void> {
    const plant = await provider.exec(
      h,
      [
        "/bin/sh",
        "-c",
        `set -e; mkdir -p /workspace/bin; for t in ${names.join(" ")}; do ${program} > /workspace/bin/$t; chmod 755 /workspace/bin/$t; done; ls /workspace/bin`,
      ],
      { deadlineMs: 10_000 },
    );
    expect(plant.stdout.split("\n").filter(Boolean).sort(), plant.stderr).toEqual([...names].sort());
  }

  /** The marks the agent's programs that `plantAgentPrograms` put with `MARKING` left: who ran them. */
  async function marksOfAgentPrograms(h: SandboxHandle): Promise<string[]> {
    const marks = await provider.exec(h, ["/bin/ls", "/tmp"], { deadlineMs: 10_000, user: ROOT_USER });
    return marks.stdout.split("\n").filter((l) => l.startsWith("ran-as-"));
  }

  /** A program that leaves a mark saying which uid ran it (`/tmp/ran-as-<uid>`), then runs the real one. */
  const MARKING = `printf '#!/bin/sh\\ntouch /tmp/ran-as-$(id -u)\\nexec %s "$@"\\n' "$(PATH=/usr/bin:/bin command -v $t)"`;

  it("a kill sweep runs none of the agent's programs, though the image's PATH leads through a directory the agent writes", async () => {
    await withAgentPathImage("agent-path", async (h) => {
      // The agent's `sh`, `sleep` and `kill` say the sweep found nothing, and a sleeper of its stays.
      await plantAgentPrograms(h, ["sh", "sleep", "kill"], "printf '#!/bin/sh\\necho remaining=0\\n'");
      await provider.exec(h, ["/bin/sh", "-c", "setsid /bin/sleep 1000 >/dev/null 2>&1 </dev/null &"], {
        deadlineMs: 10_000,
      });
      expect((await processesOf(h, 1000)).filter((l) => l.includes("sleep 1000"))).toHaveLength(1);
      const receipt = await provider.killProcesses(h, AGENT_USER);
      expect(receipt).toMatchObject({ confirmed: true, remaining: 0 });
      expect(await processesOf(h, 1000)).toEqual([]);
    });
  });

  it("a command's SIGKILL exit (137) makes the provider read the OOM count with none of the agent's programs, though the image's PATH leads through a directory the agent writes", async () => {
    await withAgentPathImage("agent-path-oom", async (h) => {
      await plantAgentPrograms(h, ["sh", "cat"], MARKING);
      // The agent's own command ends by SIGKILL: the provider asks whether it was an OOM kill.
      const killed = await provider.exec(h, ["/bin/sh", "-c", "kill -9 $$"], { deadlineMs: 10_000 });
      expect(killed).toMatchObject({ exitCode: 137, oomKilled: false });
      expect(await marksOfAgentPrograms(h)).toEqual([]);
    });
  });

  it("the probe of a sandbox an agent ran in (an own sandbox a re-delivered run takes over) runs none of the agent's programs, though the image's PATH leads through a directory the agent writes", async () => {
    await withAgentPathImage("agent-path-probe", async (h) => {
      await plantAgentPrograms(h, ["sh", "readlink", "tr"], MARKING);
      await expect(provider.probe(h)).resolves.toMatchObject({ isolated: true });
      expect(await marksOfAgentPrograms(h)).toEqual([]);
    });
  });

  it("lists a sandbox volume only once no container uses it, and never removes one in use (the janitor's volume sweep)", async () => {
    const h = await uncapped.create(spec());
    live.push(h);
    const [volume] = h.volumes as [string];
    const unused = async () => (await uncapped.listUnusedVolumes()).map((v) => v.name);
    expect(await unused()).not.toContain(volume);
    // Asked anyway (a container took it between the listing and the removal): refused, kept.
    expect(await uncapped.removeUnusedVolume(volume)).toBe(false);
    await expect(docker.getVolume(volume).inspect()).resolves.toMatchObject({ Name: volume });
    // Its container gone, the volume left (a destroy cut off before its volumes).
    await uncapped.destroy({ ...h, volumes: [] });
    const listed = (await uncapped.listUnusedVolumes()).find((v) => v.name === volume);
    expect(listed?.labels[LABEL_ROLLOUT]).toBe(h.rolloutId);
    expect(Date.now() - listed!.createdAt).toBeLessThan(600_000);
    expect(await uncapped.removeUnusedVolume(volume)).toBe(true);
    expect(await uncapped.removeUnusedVolume(volume)).toBe(true); // gone already
    await expect(docker.getVolume(volume).inspect()).rejects.toMatchObject({ statusCode: 404 });
  });

  it("a create that takes over a sandbox made with a workspace volume (another version, other defaults) removes that volume at destroy", async () => {
    const s = spec();
    const made = await uncapped.create(s);
    expect(made.volumes).toHaveLength(1);
    const h = await provider.create(s); // the name is taken: adopted
    expect([h.id, h.volumes]).toEqual([made.id, made.volumes]);
    await provider.destroy(h);
    await expect(docker.getVolume(made.volumes[0]!).inspect()).rejects.toMatchObject({ statusCode: 404 });
  });

  it("an image with its own /workspace files gets them on the capped workspace (Docker copies none into a tmpfs), the agent's, modes kept", async () => {
    const image = `fleet-test/ws-files:${RUN}`;
    execFileSync("docker", ["build", "-q", "-t", image, "-"], {
      input: `FROM ${IMAGE}\nRUN mkdir -p /workspace/data && echo from-image > /workspace/data/seed.txt && printf '#!/bin/sh\\necho run\\n' > /workspace/run.sh && chmod 750 /workspace/run.sh\n`,
      stdio: ["pipe", "ignore", "pipe"],
      timeout: 120_000,
    });
    try {
      const h = await create({ image });
      expect(h.volumes).toEqual([]);
      const seen = await provider.exec(
        h,
        [
          "sh",
          "-c",
          "cat /workspace/data/seed.txt && stat -c '%U %a' /workspace/run.sh && /workspace/run.sh && df -m /workspace",
        ],
        { deadlineMs: 10_000 },
      );
      expect(seen.exitCode, seen.stderr).toBe(0);
      expect(seen.stdout).toMatch(/^from-image\nagent 750\nrun\n/);
      expect(seen.stdout).toMatch(/tmpfs\s+1024\s/); // still capped
      expect((await provider.probe(h)).workspaceEmpty).toBe(false);
      // A create cut off between its container and its start (its worker died): the one that
      // takes the container over stages the image's files as that create would have, never
      // hands the agent an empty workspace.
      const s = spec({ image });
      const made = await docker.createContainer(
        buildContainerConfig(parseSandboxSpec(s), provider.defaults, provider.scope),
      );
      const taken = await provider.create(s);
      live.push(taken);
      expect(taken.id).toBe(made.id);
      const staged = await provider.exec(taken, ["sh", "-c", "cat /workspace/data/seed.txt"], {
        deadlineMs: 10_000,
      });
      expect(staged.stdout).toBe("from-image\n");
    } finally {
      while (live.length > 0) await provider.destroy(live.pop()!);
      execFileSync("docker", ["rmi", "-f", image], { stdio: "ignore", timeout: 60_000 });
    }
  });

  it("an image's /workspace files past what the spool holds in memory are staged whole, by way of its file", async () => {
    const image = `fleet-test/ws-spooled:${RUN}`;
    const bytes = SPOOL_IN_MEMORY_BYTES + 1024 * 1024;
    execFileSync("docker", ["build", "-q", "-t", image, "-"], {
      input: `FROM ${IMAGE}\nRUN mkdir -p /workspace && head -c ${bytes} /dev/urandom > /workspace/big.bin && echo tail > /workspace/z.txt && cd /workspace && sha256sum big.bin z.txt > /sums\n`,
      stdio: ["pipe", "ignore", "pipe"],
      timeout: 120_000,
    });
    const dispose = Spool.prototype.dispose;
    const disposedOnDisk: boolean[] = [];
    const spy = vi.spyOn(Spool.prototype, "dispose").mockImplementation(function (this: Spool) {
      disposedOnDisk.push(this.onDisk);
      return dispose.call(this);
    });
    const spoolFds = () =>
      readdirSync("/proc/self/fd").filter((fd) => {
        try {
          return readlinkSync(`/proc/self/fd/${fd}`).includes("fleet-spool-");
        } catch {
          return false;
        }
      });
    try {
      const h = await create({ image });
      // It went by way of a file, let go of once staged.
      expect(disposedOnDisk).toEqual([true]);
      expect(spoolFds()).toEqual([]);
      const seen = await provider.exec(h, ["sh", "-c", "cd /workspace && sha256sum -c /sums && ls"], {
        deadlineMs: 20_000,
      });
      expect(seen.exitCode, seen.stdout + seen.stderr).toBe(0);
      expect(seen.stdout).toBe("big.bin: OK\nz.txt: OK\nbig.bin\nz.txt\n");
      // No TMPDIR to spool to: this worker's disk, said so (retryable), the container removed.
      const tmp = process.env.TMPDIR;
      process.env.TMPDIR = `/nonexistent-${RUN}`;
      const s = spec({ image });
      try {
        const err = await fleetError(provider.create(s));
        expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
        expect(err.message).toMatch(
          /could not spool image .*'s \/workspace to this worker's TMPDIR \(\/nonexistent-.*ENOENT/,
        );
      } finally {
        if (tmp === undefined) delete process.env.TMPDIR;
        else process.env.TMPDIR = tmp;
      }
      expect(
        await docker.listContainers({ all: true, filters: { label: [`fleet.rollout=${s.rolloutId}`] } }),
      ).toEqual([]);
    } finally {
      spy.mockRestore();
      while (live.length > 0) await provider.destroy(live.pop()!);
      execFileSync("docker", ["rmi", "-f", image], { stdio: "ignore", timeout: 60_000 });
    }
  });

  /**
   * A create refused for its image (built from `run` on the base image): the task's (final), its
   * container removed; when the daemon fails that removal, the container is still there, so the
   * create is retryable (a final error would have the seed forget its intent and close report it
   * torn down).
   */
  async function expectImageRefused(
    tag: string,
    run: string,
    options: SandboxSpecInput["options"],
    refusedMessage: RegExp,
    keptMessage: RegExp,
  ): Promise<void> {
    const image = `fleet-test/${tag}:${RUN}`;
    execFileSync("docker", ["build", "-q", "-t", image, "-"], {
      input: `FROM ${IMAGE}\nRUN ${run}\n`,
      stdio: ["pipe", "ignore", "pipe"],
      timeout: 120_000,
    });
    const ofRollout = async (rolloutId: string) =>
      docker.listContainers({ all: true, filters: { label: [`${LABEL_ROLLOUT}=${rolloutId}`] } });
    const over = options ? { image, options } : { image };
    const t = spec(over);
    try {
      const s = spec(over);
      const refused = await fleetError(provider.create(s));
      expect([refused.kind, refused.retryable]).toEqual(["invalid_task", false]);
      expect(refused.message).toMatch(refusedMessage);
      expect(await ofRollout(s.rolloutId)).toEqual([]);

      const stuck = new DockerSandboxProvider({ docker: { socketPath: "/var/run/docker.sock" } });
      stuck.destroy = async () => {
        throw FleetError.retryable("provider_unavailable", "the daemon failed the removal");
      };
      const kept = await fleetError(stuck.create(t));
      expect([kept.kind, kept.retryable]).toEqual(["provider_unavailable", true]);
      expect(kept.message).toMatch(keptMessage);
      expect(await ofRollout(t.rolloutId)).toHaveLength(1);
    } finally {
      for (const c of await ofRollout(t.rolloutId)) await docker.getContainer(c.Id).remove({ force: true });
      execFileSync("docker", ["rmi", "-f", image], { stdio: "ignore", timeout: 60_000 });
    }
  }

  it("an image with more in /workspace than the workspace's cap is the task's (final), its container removed; one that cannot be removed makes the create retryable", async () => {
    await expectImageRefused(
      "ws-big",
      "mkdir -p /workspace && head -c 2097152 /dev/zero > /workspace/big.bin",
      { diskMb: 1 },
      /more in \/workspace than the workspace's cap of 1 MiB/,
      /has too much in its image's \/workspace and could not be removed/,
    );
  });

  it("an image whose /workspace files cannot be staged (a device node) is the task's (final), its container removed; one that cannot be removed makes the create retryable", async () => {
    await expectImageRefused(
      "ws-device",
      "mkdir -p /workspace && echo x > /workspace/a.txt && mknod /workspace/null c 1 3",
      undefined,
      /\/workspace/,
      /could not get its image's \/workspace files and could not be removed/,
    );
  });

  it("a paused sandbox's processes are never reported stopped; once it runs again they are", async () => {
    const h = await create();
    await provider.exec(h, ["sh", "-c", "sleep 1000 &"], { deadlineMs: 10_000 });
    execFileSync("docker", ["pause", h.id], { stdio: "pipe", timeout: 60_000 });
    let paused: CleanupReceipt | null = null;
    try {
      // Never "gone", which would let verify start on a sandbox whose agent resumes on unpause:
      // a receipt that confirms nothing (the reaper's kills wait on the frozen processes, cgroup
      // v1), or one that confirms what is true (cgroup v2 delivers a fatal signal to frozen tasks).
      paused = await provider.killProcesses(h);
      expect(paused.alreadyGone).toBe(false);
    } finally {
      execFileSync("docker", ["unpause", h.id], { stdio: "pipe", timeout: 60_000 });
    }
    if (paused?.confirmed) expect(await processesOf(h, 1000)).toEqual([]);
    expect(await provider.killProcesses(h)).toMatchObject({
      confirmed: true,
      alreadyGone: false,
      remaining: 0,
    });
    expect(await processesOf(h, 1000)).toEqual([]);
  });

  it("a handle from another host's local daemon is refused (retryable), never taken for a sandbox gone", async () => {
    const h = await create();
    const own = ((await docker.info()) as { ID: string }).ID;
    expect(h.daemon).toBe(own);
    expect((await provider.find(h.rolloutId, "resources"))?.daemon).toBe(own);
    // The same socket path on another host leads to another daemon, where this container is
    // unknown: its destroy would be a 404, "already gone", and its kill "confirmed".
    const elsewhere = { ...h, daemon: "ANOTHER:HOST:DAEMON" };
    for (const call of [
      () => provider.destroy(elsewhere),
      () => provider.killProcesses(elsewhere),
      () => provider.alive(elsewhere),
      () => provider.exec(elsewhere, ["true"], { deadlineMs: 5_000 }),
      () => provider.get(elsewhere, "/workspace/x"),
    ]) {
      const err = await fleetError(call());
      expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
      expect(err.message).toMatch(/lives on Docker daemon ANOTHER:HOST:DAEMON/);
    }
    expect(await provider.alive(h)).toBe(true); // nothing was done to it
  });

  it("joins no network but its own rollout's internal gateway network, whatever the spec says", async () => {
    for (const network of ["bridge", "host"]) {
      const s = spec({ network });
      const err = await fleetError(provider.create(s));
      expect([err.kind, err.retryable]).toEqual(["isolation_refused", false]);
      expect(await provider.find(s.rolloutId, "resources")).toBeNull();
    }
    // Another container's network namespace (`container:<id>`, no network by that name).
    const neighbour = await create();
    const borrowing = spec({ network: `container:${neighbour.id}` });
    const refused = await fleetError(provider.create(borrowing));
    expect([refused.kind, refused.retryable]).toEqual(["invalid_task", false]);
    expect(await provider.find(borrowing.rolloutId, "resources")).toBeNull();
    // An internal gateway network, but another rollout's; then this rollout's own.
    const s = spec();
    const name = `fleet-gw-it-${RUN}`;
    const made = await docker.createNetwork({
      Name: name,
      Internal: true,
      Labels: {
        [LABEL_MANAGED]: "true",
        "fleet.network": "gateway",
        [LABEL_ROLLOUT]: `${s.rolloutId}-other`,
      },
    });
    try {
      const err = await fleetError(provider.create({ ...s, network: name }));
      expect([err.kind, err.retryable]).toEqual(["isolation_refused", false]);
      await made.remove();
      // This rollout's labels on a network that is not internal (it routes out): refused.
      const open = await docker.createNetwork({
        Name: name,
        Internal: false,
        Labels: { [LABEL_MANAGED]: "true", "fleet.network": "gateway", [LABEL_ROLLOUT]: s.rolloutId },
      });
      const routed = await fleetError(provider.create({ ...s, network: name }));
      expect([routed.kind, routed.retryable]).toEqual(["isolation_refused", false]);
      expect(await provider.find(s.rolloutId, "resources")).toBeNull();
      await open.remove();
      const own = await docker.createNetwork({
        Name: name,
        Internal: true,
        Labels: { [LABEL_MANAGED]: "true", "fleet.network": "gateway", [LABEL_ROLLOUT]: s.rolloutId },
      });
      const h = await provider.create({ ...s, network: name });
      try {
        const info = await docker.getContainer(h.id).inspect();
        expect(Object.keys(info.NetworkSettings.Networks ?? {})).toEqual([name]);
      } finally {
        await provider.destroy(h);
        await own.remove();
      }
    } finally {
      await docker
        .getNetwork(name)
        .remove()
        .catch(() => undefined);
    }
  });

  it("destroys twice without complaint and removes the workspace volume (an uncapped workspace's)", async () => {
    const h = await uncapped.create(spec());
    expect(h.volumes).toHaveLength(1);
    expect(await provider.destroy(h)).toMatchObject({
      confirmed: true,
      alreadyGone: false,
      scope: "sandbox",
    });
    expect(await provider.destroy(h)).toMatchObject({ confirmed: true, alreadyGone: true, scope: "sandbox" });
    await expect(docker.getVolume(h.volumes[0]!).inspect()).rejects.toMatchObject({ statusCode: 404 });
    const lost = await fleetError(provider.exec(h, ["true"], { deadlineMs: 5_000 }));
    expect(lost.kind).toBe("sandbox_lost");
    expect(await provider.killProcesses(h)).toMatchObject({ confirmed: true, alreadyGone: true });
    // A probe of a sandbox that is gone is that sandbox's loss (final, masked; a seed makes another),
    // never a verdict on isolation, as with bubblewrap (probe-after-destroy.int.test.ts).
    const probe = await fleetError(provider.probe(h));
    expect([probe.kind, probe.retryable]).toEqual(["sandbox_lost", false]);
    // Calls on a closed sandbox never bring it back (DESIGN §2 rule 7): a put and a get fail as
    // lost too, and neither the container nor its volume exists after them.
    expect((await fleetError(provider.put(h, "/workspace", { "x.txt": "x" }))).kind).toBe("sandbox_lost");
    expect((await fleetError(provider.get(h, "/workspace/x.txt"))).kind).toBe("sandbox_lost");
    await expect(docker.getContainer(h.id).inspect()).rejects.toMatchObject({ statusCode: 404 });
    await expect(docker.getContainer(h.name).inspect()).rejects.toMatchObject({ statusCode: 404 });
    await expect(docker.getVolume(h.volumes[0]!).inspect()).rejects.toMatchObject({ statusCode: 404 });
  });

  it("a destroy that meets another removal in progress (409) confirms nothing it cannot see gone: an inspect that fails, or a container still there at the API timeout, is retryable", async () => {
    // The real daemon behind a proxy that answers every removal 409 "already in progress" and,
    // as the case asks, fails the inspects that follow.
    const mode = { refuse: false, inspectFails: false };
    const proxy = await dockerProxy("409", (req, res) => {
      const url = req.url ?? "";
      if (mode.refuse && req.method === "DELETE" && /\/containers\//.test(url))
        return answerDocker(res, 409, "removal of container is already in progress");
      if (mode.refuse && mode.inspectFails && req.method === "GET" && /\/containers\/[^/]+\/json/.test(url))
        return answerDocker(res, 500, "the daemon failed the inspect");
      return false;
    });
    // Only the destroy has a short API timeout (the second case waits it out); the sandboxes are
    // made, checked and removed with the usual timeouts, which a loaded host needs for a create.
    // Both providers talk to the proxy: a handle names the endpoint that made it.
    const racing = new DockerSandboxProvider({
      docker: { socketPath: proxy.path },
      defaults: { apiTimeoutMs: 2_000 },
    });
    const viaProxy = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
    const made: SandboxHandle[] = [];
    try {
      for (const inspectFails of [true, false]) {
        Object.assign(mode, { refuse: false, inspectFails });
        const h = await viaProxy.create(spec());
        made.push(h);
        mode.refuse = true;
        const err = await fleetError(racing.destroy(h));
        expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
        mode.refuse = false;
        expect(await viaProxy.alive(h)).toBe(true);
      }
    } finally {
      mode.refuse = false;
      for (const h of made) await viaProxy.destroy(h);
      await proxy.close();
    }
  });

  it("destroys racing each other (a close and the janitor at once) confirm only once the container is gone, and only one says it removed it", async () => {
    // The daemon answers the later removals 409 "removal … already in progress": such a destroy
    // waits for the first one to end rather than confirming a container that is still there, and
    // says it was gone (another's removal did it: counted once, as `confirmed`, not by each).
    let confirmedWhileThere = 0;
    let confirmed = 0;
    let removedByIt = 0;
    for (let i = 0; i < 4; i++) {
      const h = await create();
      await Promise.all(
        [0, 1, 2].map(async () => {
          const receipt = await provider.destroy(h);
          const there = await docker
            .getContainer(h.id)
            .inspect()
            .then(
              () => true,
              (err: { statusCode?: number }) => err.statusCode !== 404,
            );
          if (receipt.confirmed) confirmed++;
          if (receipt.confirmed && there) confirmedWhileThere++;
          if (!receipt.alreadyGone) removedByIt++;
        }),
      );
    }
    expect([confirmed, confirmedWhileThere, removedByIt]).toEqual([12, 0, 4]);
  });

  it("puts and gets through the container's own view of the workspace, a tmpfs Docker's archive API cannot see", async () => {
    const h = await create();
    await provider.put(h, "/workspace", { "task.txt": "staged\n" }, { replace: true });
    const seen = await provider.exec(h, ["cat", "/workspace/task.txt"], { deadlineMs: 10_000 });
    expect(seen).toMatchObject({ exitCode: 0, stdout: "staged\n" });
    expect(await provider.get(h, "/workspace/task.txt")).toBe("staged\n");
    // Why not the archive API (`docker cp` uses it): it reads the container's layers, under the mount.
    expect(() =>
      execFileSync("docker", ["cp", `${h.id}:/workspace/task.txt`, "-"], { stdio: "pipe", timeout: 60_000 }),
    ).toThrow(/Could not find the file/);
  });

  it("gets a file in an agent's 0700 directory (root without capabilities cannot see it), and null for a FIFO", async () => {
    const h = await create();
    const made = await provider.exec(
      h,
      ["sh", "-c", "mkdir -m 700 /workspace/p && echo mine > /workspace/p/f && mkfifo /workspace/fifo"],
      { deadlineMs: 10_000 },
    );
    expect(made.exitCode, made.stderr).toBe(0);
    expect(await provider.get(h, "/workspace/p/f")).toBe("mine\n");
    expect(await provider.get(h, "/workspace/p/none")).toBeNull();
    expect(await provider.get(h, "/workspace/fifo")).toBeNull();
  });

  it("a probe that times out is a retryable provider_unavailable", async () => {
    const h = await create();
    const err = await fleetError(provider.probe(h, { timeoutMs: 1 }));
    expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
    expect(err.message).toMatch(/timed out/);
  });

  it("refuses an unknown sandbox option and a missing image as final invalid_task", async () => {
    const bad = await fleetError(provider.create({ ...spec(), options: { bogus: 1 } as never }));
    expect([bad.kind, bad.retryable]).toEqual(["invalid_task", false]);
    expect(bad.message).toMatch(/bogus/);
    const missing = await fleetError(provider.create(spec({ image: "rollout-fleet/does-not-exist:never" })));
    expect([missing.kind, missing.retryable]).toEqual(["invalid_task", false]);
  });

  it("refuses, as final invalid_task and creating nothing, a sandbox whose memory limit is more than its host has (no limit at all); one within it is made", async () => {
    const { MemTotal } = (await docker.info()) as { MemTotal: number };
    const hostMb = Math.floor(MemTotal / 2 ** 20);
    const s = spec({ options: { memoryMb: hostMb } });
    const refused = await fleetError(provider.create(s));
    expect([refused.kind, refused.retryable]).toEqual(["invalid_task", false]);
    expect(refused.message).toMatch(new RegExp(`more than the sandbox host has \\(${hostMb} MiB\\)`));
    expect(await provider.list({ [LABEL_ROLLOUT]: s.rolloutId })).toEqual([]);
    // The tmpfs caps count: a memoryMb that fits alone, with a workspace that takes the rest, does not.
    const fits = Math.floor(hostMb / 2);
    const withDisk = spec({ options: { memoryMb: fits, diskMb: hostMb - fits } });
    expect((await fleetError(provider.create(withDisk))).kind).toBe("invalid_task");
    const h = await create({ options: { memoryMb: fits } });
    expect(await provider.alive(h)).toBe(true);
    await provider.destroy(h);
  });

  it("a reaper whose report is lost, or a sandbox the daemon cannot inspect for one, never gives a confirmed receipt", async () => {
    // DESIGN §2 rule 2 (close-before-verify): verify needs a positive receipt. The real daemon
    // behind a proxy that, as the case asks, ends every attach (the reaper's report) at once, or
    // fails the sandbox's inspect.
    const mode = { attachEmpty: false, inspectFails: false };
    const proxy = await dockerProxy("reaper", (req, res) => {
      const url = req.url ?? "";
      if (mode.attachEmpty && req.method === "POST" && /\/containers\/[^/]+\/attach/.test(url)) {
        res.writeHead(200, { "content-type": "application/vnd.docker.raw-stream" });
        res.end();
        return true;
      }
      if (mode.inspectFails && req.method === "GET" && /\/containers\/[^/]+\/json/.test(url))
        return answerDocker(res, 500, "the daemon failed the inspect");
      return false;
    });
    const seen = new DockerSandboxProvider({ docker: { socketPath: proxy.path } });
    const h = await seen.create(spec());
    // A reaper whose report was lost still runs its rounds; the daemon removes it once it exits.
    const reapers = () =>
      docker.listContainers({
        all: true,
        filters: { label: ["fleet.reaper=true", `fleet.rollout=${h.rolloutId}`] },
      });
    const noReaper = () =>
      vi.waitFor(async () => expect(await reapers()).toEqual([]), { timeout: 30_000, interval: 200 });
    try {
      for (const which of ["attachEmpty", "inspectFails"] as const) {
        // The last case's reaper gone first: it would kill this case's agent before it starts.
        await noReaper();
        // An agent no sweep of its own uid can stop: only a reaper can.
        const start = await seen.exec(h, KILL_EVERY_SWEEP_ARGV, { deadlineMs: 10_000 });
        expect(start.stdout).toContain("started");
        Object.assign(mode, { attachEmpty: false, inspectFails: false, [which]: true });
        const outcome = await seen.killProcesses(h, AGENT_USER).then(
          (receipt) => ({ confirmed: receipt.confirmed, kind: null }),
          (err: unknown) => ({ confirmed: false, kind: isFleetError(err) ? err.kind : String(err) }),
        );
        expect(outcome.confirmed, which).toBe(false);
        if (which === "inspectFails") expect(outcome.kind).toBe("provider_unavailable");
        Object.assign(mode, { attachEmpty: false, inspectFails: false });
      }
    } finally {
      Object.assign(mode, { attachEmpty: false, inspectFails: false });
      await seen.destroy(h);
      await proxy.close();
      await noReaper();
    }
  });

  it("list never takes a reaper (fleet.managed, no fleet.owner) for a sandbox, so no sweep of sandboxes destroys one at work", async () => {
    const s = spec();
    const h = await create({ rolloutId: s.rolloutId });
    const reaper = await docker.createContainer({
      Image: IMAGE,
      Entrypoint: ["true"],
      Labels: reaperLabels(s.rolloutId),
    });
    try {
      expect((await provider.list({ [LABEL_ROLLOUT]: s.rolloutId })).map((i) => i.handle.id)).toEqual([h.id]);
    } finally {
      await reaper.remove({ force: true });
    }
  });

  it("removeStaleHelpers removes this fleet's reapers that never ran, and nobody else's", async () => {
    const scoped = new DockerSandboxProvider({ docker: { socketPath: "/var/run/docker.sock" }, scope: RUN });
    const make = (scope: string) =>
      execFileSync(
        "docker",
        ["create", "--label", `${LABEL_REAPER}=true`, "--label", `fleet.scope=${scope}`, IMAGE, "true"],
        { timeout: 60_000 },
      )
        .toString()
        .trim();
    const mine = make(RUN);
    const theirs = make(`${RUN}-other`);
    try {
      expect(await scoped.removeStaleHelpers(60_000)).toBe(0); // too young yet
      expect(await scoped.removeStaleHelpers(0)).toBe(1);
      const left = execFileSync(
        "docker",
        ["ps", "-aq", "--no-trunc", "--filter", `label=${LABEL_REAPER}=true`],
        { timeout: 60_000 },
      )
        .toString()
        .split("\n");
      expect(left).not.toContain(mine);
      expect(left).toContain(theirs);
    } finally {
      execFileSync("docker", ["rm", "-f", mine, theirs], { stdio: "ignore", timeout: 60_000 });
    }
  });

  it("a daemon that is not there is a retryable provider_unavailable", async () => {
    const nowhere = new DockerSandboxProvider({ docker: { socketPath: `/tmp/fleet-no-daemon-${RUN}.sock` } });
    const err = await fleetError(nowhere.create(spec()));
    expect([err.kind, err.retryable]).toEqual(["provider_unavailable", true]);
    const fake: SandboxHandle = {
      provider: "docker",
      endpoint: nowhere.endpoint,
      id: "x",
      name: "fleet-x-resources",
      rolloutId: "x",
      owner: "resources",
      volumes: [],
    };
    // The exec was never created: nothing started (the run stage may launch afresh).
    const execErr = await fleetError(nowhere.exec(fake, ["true"], { deadlineMs: 1000 }));
    expect([execErr.kind, execErr.nothingStarted]).toEqual(["provider_unavailable", true]);
    expect((await fleetError(nowhere.destroy(fake))).retryable).toBe(true);
  });
});
