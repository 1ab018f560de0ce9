import { SandboxSpec, type SandboxSpecInput } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import {
  buildContainerConfig,
  DEFAULT_SANDBOX_LIMITS,
  isTmpfsPath,
  KEEPALIVE_USER,
  reaperLabels,
  sandboxMemoryMb,
  sandboxName,
} from "./container-config.ts";

const base: SandboxSpecInput = {
  image: "img:1",
  rolloutId: "r1",
  owner: "resources",
  expiresAt: 1_700_000_000_000,
};
const config = (over: Partial<SandboxSpecInput> = {}) =>
  buildContainerConfig(SandboxSpec.parse({ ...base, ...over }));

describe("buildContainerConfig", () => {
  it("is hardened by default", () => {
    const c = config();
    const h = c.HostConfig!;
    expect(c.name).toBe("fleet-r1-resources");
    expect(c.User).toBe(KEEPALIVE_USER);
    expect(c.Entrypoint).toEqual(["sleep", "infinity"]);
    expect(h.NetworkMode).toBe("none");
    expect(h.CapDrop).toEqual(["ALL"]);
    expect(h.CapAdd).toBeUndefined();
    expect(h.SecurityOpt).toEqual(["no-new-privileges"]);
    expect(h.ReadonlyRootfs).toBe(true);
    expect(h.PidsLimit).toBe(256);
    // 1 GiB for the processes, plus the tmpfs mounts' caps (4 × 256 MiB, the 1 GiB workspace,
    // 64 MiB of /dev/shm, the verify fence's 1 MiB): their files are memory in the same cgroup;
    // plus the kernel memory of as many inodes as they may hold (256 per MiB, 1.5 KiB each: 3/8
    // of their size, rounded up), plus the IPC objects' 8 MiB.
    const tmpfsMb = 4 * 256 + 1024 + 64 + 1;
    expect(h.Memory).toBe((1024 + tmpfsMb + Math.ceil((tmpfsMb * 3) / 8) + 8) * 1024 * 1024);
    expect(h.MemorySwap).toBe(h.Memory);
    expect(h.ShmSize).toBeUndefined();
    expect(h.Sysctls).toMatchObject({
      "kernel.shm_rmid_forced": "1",
      "kernel.msgmni": "32",
      "kernel.sem": "250 32000 32 128",
      "fs.mqueue.queues_max": "16",
    });
    expect(h.NanoCpus).toBe(1e9);
    expect(h.Init).toBe(true);
    expect(h.Privileged).toBe(false);
    expect(h.PidMode).toBeUndefined();
    expect(h.Binds).toBeUndefined();
    expect(Object.keys(h.Tmpfs!).sort()).toEqual([
      "/dev/shm",
      "/logs",
      "/run/fleet",
      "/solution",
      "/tests",
      "/tmp",
      "/workspace",
    ]);
    // The verify fence: nobody's (the keepalive's user: the tests, root, cannot write it), nothing run from it.
    expect(h.Tmpfs!["/run/fleet"]).toBe(
      "rw,noexec,nosuid,nodev,size=1m,nr_inodes=256,uid=65534,gid=65534,mode=0755",
    );
    // Every tmpfs caps its inodes with its size: empty files use no pages, only kernel memory.
    for (const [path, options] of Object.entries(h.Tmpfs!)) {
      const size = Number(/size=(\d+)m/.exec(options)?.[1]);
      expect(size, path).toBeGreaterThan(0);
      expect(options, path).toContain(`nr_inodes=${size * 256}`);
    }
    // No setuid binary or device node on a writable mount; nothing executable in /dev/shm.
    for (const [path, options] of Object.entries(h.Tmpfs!)) {
      expect(options.split(","), path).toEqual(expect.arrayContaining(["nosuid", "nodev"]));
    }
    expect(h.Tmpfs!["/dev/shm"]!.split(",")).toContain("noexec");
    // Where tests and solutions are staged belongs to root, not writable by the agent.
    expect(h.Tmpfs!["/tests"]).toMatch(/,mode=0755$/);
    expect(h.Tmpfs!["/solution"]).toMatch(/,mode=0755$/);
    expect(h.Tmpfs!["/tmp"]).toMatch(/,mode=1777$/);
    // Its own IPC namespace (never the host's or another container's), and under host memory
    // pressure a sandbox goes before the fleet's own processes.
    expect(h.IpcMode).toBe("private");
    expect(h.OomScoreAdj).toBeGreaterThan(0);
    expect(h.Tmpfs!["/tests"]).toMatch(/size=256m/);
    expect(h.Tmpfs!["/dev/shm"]).toMatch(/size=64m.*mode=1777/);
    expect(h.Mounts).toEqual([]);
    expect(c.Labels).toEqual({
      "fleet.managed": "true",
      "fleet.rollout": "r1",
      "fleet.owner": "resources",
      "fleet.expires": "1700000000000",
    });
  });

  it("puts an uncapped workspace (diskMb null) on a labelled named volume, which copies up the image's /workspace", () => {
    const c = buildContainerConfig(SandboxSpec.parse(base), { ...DEFAULT_SANDBOX_LIMITS, diskMb: null });
    const h = c.HostConfig!;
    expect(Object.keys(h.Tmpfs!)).not.toContain("/workspace");
    // No workspace tmpfs to make room for in the memory limit.
    expect(h.Memory).toBe(
      (1024 + (4 * 256 + 64 + 1) + Math.ceil(((4 * 256 + 64 + 1) * 3) / 8) + 8) * 1024 * 1024,
    );
    expect(h.Mounts).toEqual([
      {
        Type: "volume",
        Source: "fleet-r1-resources-workspace",
        Target: "/workspace",
        VolumeOptions: { Labels: c.Labels },
      },
    ]);
  });

  it("never mounts anything from the host, least of all the docker socket", () => {
    const c = config({ options: { memoryMb: 2048, readOnlyRoot: false, diskMb: 100 } });
    const h = c.HostConfig!;
    expect(h.Binds).toBeUndefined();
    expect(h.Mounts!.every((m) => m.Type !== "bind")).toBe(true);
    expect(JSON.stringify(c)).not.toContain("docker.sock");
  });

  it("relaxes each default only through its option", () => {
    const h = config({
      options: {
        memoryMb: 2048,
        cpus: 2.5,
        pidsLimit: 1000,
        tmpfsMb: 32,
        readOnlyRoot: false,
        pidMode: "host",
      },
      network: "fleet-gateway",
    }).HostConfig!;
    expect(h.Memory).toBe(
      (2048 + (4 * 32 + 1024 + 64 + 1) + Math.ceil(((4 * 32 + 1024 + 64 + 1) * 3) / 8) + 8) * 1024 * 1024,
    );
    expect(h.MemorySwap).toBe(h.Memory);
    expect(h.NanoCpus).toBe(2.5e9);
    expect(h.PidsLimit).toBe(1000);
    expect(h.Tmpfs!["/tmp"]).toMatch(/size=32m/);
    expect(h.ReadonlyRootfs).toBe(false);
    expect(h.PidMode).toBe("host");
    expect(h.NetworkMode).toBe("fleet-gateway");
    // Untouched defaults stay hardened.
    expect(h.CapDrop).toEqual(["ALL"]);
    expect(h.SecurityOpt).toEqual(["no-new-privileges"]);
  });

  it("caps the workspace with an agent-owned tmpfs of the container's own when diskMb is set (no volume)", () => {
    const h = config({ options: { diskMb: 100 } }).HostConfig!;
    expect(h.Tmpfs!["/workspace"]).toBe(
      "rw,exec,nosuid,nodev,size=100m,nr_inodes=25600,uid=1000,gid=1000,mode=0755",
    );
    expect(h.Mounts).toEqual([]);
  });

  it("sets a PidMode only to share the host's (which the probe refuses): a private one is Docker's default", () => {
    expect(config({ options: { pidMode: "private" } }).HostConfig!).not.toHaveProperty("PidMode");
    expect(config().HostConfig!).not.toHaveProperty("PidMode");
  });

  it("caps the workspace by default (an unbounded volume would let a disk filler fill the host)", () => {
    expect(config().HostConfig!.Tmpfs!["/workspace"]).toMatch(/,size=1024m,/);
  });
});

describe("sandboxMemoryMb", () => {
  it("is 3938 MiB for the default limits, the figure the README, configs/fleet.env.example and the sandbox README give to size hosts by", () => {
    // 1024 for processes + tmpfs caps (4 × 256 scratch, 1024 workspace, 64 /dev/shm, 1 fence:
    // 2113) + their inodes' kernel memory (ceil(2113 × 256 × 1.5 KiB) = 793) + 8 of IPC objects.
    expect(sandboxMemoryMb(DEFAULT_SANDBOX_LIMITS)).toBe(3938);
    expect(config().HostConfig?.Memory).toBe(3938 * 2 ** 20);
  });
});

describe("reaperLabels", () => {
  it("marks a reaper fleet.managed (every container the fleet makes is), with no owner: never a sandbox to list", () => {
    expect(reaperLabels("r-1", "{f}")).toEqual({
      "fleet.managed": "true",
      "fleet.reaper": "true",
      "fleet.rollout": "r-1",
      "fleet.scope": "{f}",
    });
  });
});

describe("sandboxName", () => {
  it("is deterministic and Docker-safe", () => {
    expect(sandboxName("abc_1-2", "agent")).toBe("fleet-abc_1-2-agent");
    const odd = sandboxName("a b/c", "resources");
    expect(odd).toMatch(/^fleet-a_b_c-[0-9a-f]{12}-resources$/);
    expect(sandboxName("a b/c", "resources")).toBe(odd);
    expect(sandboxName("a_b/c", "resources")).not.toBe(odd);
  });

  it("with a scope, is distinct per fleet and still deterministic", () => {
    const a = sandboxName("r1", "agent", "{fleet-a}");
    expect(a).toMatch(/^fleet-s[0-9a-f]{8}-r1-agent$/);
    expect(sandboxName("r1", "agent", "{fleet-a}")).toBe(a);
    expect(sandboxName("r1", "agent", "{fleet-b}")).not.toBe(a);
    expect(sandboxName("r1", "agent")).not.toBe(a);
    expect(sandboxName("a b/c", "resources", "{fleet-a}")).toMatch(
      /^fleet-s[0-9a-f]{8}-a_b_c-[0-9a-f]{12}-resources$/,
    );
    expect(
      buildContainerConfig(SandboxSpec.parse({ ...base, owner: "agent" }), undefined, "{fleet-a}").name,
    ).toBe(sandboxName(base.rolloutId, "agent", "{fleet-a}"));
  });
});

describe("mount helpers", () => {
  it("knows which paths are tmpfs", () => {
    expect(isTmpfsPath("/tests")).toBe(true);
    expect(isTmpfsPath("/logs/verifier")).toBe(true);
    expect(isTmpfsPath("/testsuite")).toBe(false);
  });
});
