import { SandboxSpec } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { bwrapArgv, nsenterArgv, unsupportedSpec } from "./bwrap-args.ts";

const layout = { rootfs: "/r", workspaceDir: "/s/ws", hostname: "sandbox", tmpfsMb: 16, infoFd: 3 };

describe("bwrapArgv", () => {
  it("unshares every namespace but the user one, mounts the rootfs read-only and drops all capabilities", () => {
    const argv = bwrapArgv(layout);
    const joined = argv.join(" ");
    for (const flag of [
      "--unshare-pid",
      "--unshare-net",
      "--unshare-ipc",
      "--unshare-uts",
      "--unshare-cgroup-try",
    ]) {
      expect(argv).toContain(flag);
    }
    expect(argv).not.toContain("--die-with-parent");
    expect(joined).toContain("--ro-bind /r /");
    expect(joined).toContain("--bind /s/ws /workspace");
    expect(joined).toContain("--cap-drop ALL");
    expect(joined).toContain("--perms 0755 --size 16777216 --tmpfs /tests");
    expect(joined).toContain("--perms 1777 --size 16777216 --tmpfs /logs");
    expect(argv.slice(-2)).toEqual(["sleep", "infinity"]);
    // /proc/sys read-only, a /dev/shm, and the keepalive as nobody.
    expect(joined).toContain("--proc /proc --ro-bind /proc/bus /proc/bus");
    expect(joined).toContain("--ro-bind /proc/sys /proc/sys");
    expect(joined).toContain("--perms 1777 --size 67108864 --tmpfs /dev/shm");
    expect(joined).toContain("-- setpriv --reuid 65534 --regid 65534 --clear-groups --no-new-privs");
  });

  it("masks host kernel files in /proc after mounting it, as Docker does, skipping what this kernel lacks", () => {
    const argv = bwrapArgv(layout);
    const joined = argv.join(" ");
    const proc = argv.indexOf("--proc");
    for (const masked of ["--dev-bind /dev/null /proc/keys", "--dev-bind /dev/null /proc/timer_list"]) {
      expect(joined).toContain(masked);
      expect(argv.indexOf(masked.split(" ")[2]!)).toBeGreaterThan(proc);
    }
    expect(joined).toContain("--perms 0555 --tmpfs /proc/acpi --remount-ro /proc/acpi");
    expect(joined).toContain("--ro-bind /proc/sysrq-trigger /proc/sysrq-trigger");
    const without = bwrapArgv({
      ...layout,
      procHas: (p) => p !== "/proc/keys" && p !== "/proc/sysrq-trigger",
    });
    expect(without).not.toContain("/proc/keys");
    expect(without).not.toContain("/proc/sysrq-trigger");
    expect(without).toContain("/proc/timer_list");
  });

  it("binds the verify fence's directory at /run/fleet only when given one (a rootfs with the mount point)", () => {
    expect(bwrapArgv(layout)).not.toContain("/run/fleet");
    const joined = bwrapArgv({ ...layout, fenceDir: "/s/fence" }).join(" ");
    expect(joined).toContain("--bind /s/fence /run/fleet");
    // After the rootfs: a bind before it would be hidden under it.
    expect(joined.indexOf("--bind /s/fence")).toBeGreaterThan(joined.indexOf("--ro-bind /r /"));
  });

  it("shares the host PID namespace only when asked (so the probe can refuse it)", () => {
    expect(bwrapArgv({ ...layout, hostPid: true })).not.toContain("--unshare-pid");
  });
});

describe("nsenterArgv", () => {
  const files = {
    pid: "/proc/7/fd/20",
    mount: "/proc/7/fd/21",
    net: "/proc/7/fd/22",
    ipc: "/proc/7/fd/23",
    uts: "/proc/7/fd/24",
    cgroup: "/proc/7/fd/25",
    root: "/proc/7/fd/26",
  };
  it("joins namespaces and root by the files given, never by a pid", () => {
    const argv = nsenterArgv(files, { uid: "1000", gid: "1000" }, "/tmp", ["true"]);
    expect(argv.slice(0, argv.indexOf("--"))).toEqual([
      "--pid=/proc/7/fd/20",
      "--mount=/proc/7/fd/21",
      "--net=/proc/7/fd/22",
      "--ipc=/proc/7/fd/23",
      "--uts=/proc/7/fd/24",
      "--cgroup=/proc/7/fd/25",
      "--root=/proc/7/fd/26",
    ]);
    expect(argv).not.toContain("--target");
  });

  it("enters the sandbox's namespaces and root, then drops to the user without capabilities", () => {
    const argv = nsenterArgv(files, { uid: "1000", gid: "1000" }, "/tmp", ["timeout", "1", "true"]);
    expect(argv).toEqual(expect.arrayContaining(["--no-new-privs"]));
    expect(argv.join(" ")).toContain("setpriv --reuid 1000 --regid 1000 --clear-groups");
    expect(argv.join(" ")).toContain("--bounding-set -all --inh-caps -all");
    expect(argv.slice(-6)).toEqual(["-i", "--chdir=/tmp", "--", "timeout", "1", "true"]);
  });

  it("gives the command's environment to env inside, after setpriv, never before it", () => {
    const argv = nsenterArgv(
      files,
      { uid: "1000", gid: "1000" },
      "/w",
      ["true"],
      ["PATH=/w", "LD_PRELOAD=/w/x"],
    );
    const env = argv.indexOf("env");
    expect(argv.indexOf("setpriv")).toBeLessThan(env);
    expect(argv.indexOf("PATH=/w")).toBeGreaterThan(env);
    expect(argv.slice(env)).toEqual(["env", "-i", "--chdir=/w", "--", "PATH=/w", "LD_PRELOAD=/w/x", "true"]);
  });
});

describe("unsupportedSpec", () => {
  const base = { image: "i", rolloutId: "r", owner: "resources", expiresAt: 1 } as const;
  it("accepts the default spec and refuses networks and writable roots", () => {
    expect(unsupportedSpec(SandboxSpec.parse(base))).toBeNull();
    expect(unsupportedSpec(SandboxSpec.parse({ ...base, network: "gw" }))).toMatch(/network/);
    expect(unsupportedSpec(SandboxSpec.parse({ ...base, options: { readOnlyRoot: false } }))).toMatch(
      /writable root/,
    );
  });
});
