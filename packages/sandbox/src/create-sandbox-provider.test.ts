import { isFleetError } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { BubblewrapSandboxProvider } from "./bubblewrap/bubblewrap-sandbox-provider.ts";
import { createSandboxProvider } from "./create-sandbox-provider.ts";
import { DockerSandboxProvider } from "./docker/docker-sandbox-provider.ts";

describe("createSandboxProvider", () => {
  it("builds the docker provider for its endpoint", () => {
    const p = createSandboxProvider({ provider: "docker", docker: { endpoint: "unix:///tmp/x.sock" } });
    expect(p).toBeInstanceOf(DockerSandboxProvider);
    expect([p.name, p.endpoint]).toEqual(["docker", "unix:///tmp/x.sock"]);
  });

  it("passes the fleet's scope to either provider (the janitor must never reap another fleet's sandboxes)", () => {
    const docker = createSandboxProvider({
      provider: "docker",
      docker: { endpoint: "unix:///tmp/x.sock" },
      scope: "{fleet-a}",
    });
    expect((docker as DockerSandboxProvider).scope).toBe("{fleet-a}");
    const bwrap = createSandboxProvider({
      provider: "bubblewrap",
      bubblewrap: { rootfs: "/nonexistent/rootfs", stateDir: "/nonexistent/state" },
      scope: "{fleet-a}",
    });
    expect(bwrap).toBeInstanceOf(BubblewrapSandboxProvider);
    expect((bwrap as BubblewrapSandboxProvider).scope).toBe("{fleet-a}");
  });

  it("refuses invalid provider defaults at construction, saying which (final), where every exec would fail as the task's invalid_task: either provider", () => {
    const refusal = (make: () => unknown) => {
      try {
        make();
      } catch (e) {
        return isFleetError(e) ? [e.kind, e.retryable, e.message] : e;
      }
      return "constructed";
    };
    const docker = (defaults: Record<string, unknown>) => () =>
      createSandboxProvider({ provider: "docker", docker: { endpoint: "unix:///tmp/x.sock" }, defaults });
    const bwrap = (defaults: Record<string, unknown>) => () =>
      createSandboxProvider({
        provider: "bubblewrap",
        bubblewrap: { rootfs: "/nonexistent/rootfs", stateDir: "/nonexistent/state", defaults },
      });
    expect(refusal(docker({ maxOutputBytes: 0 }))).toEqual([
      "invalid_task",
      false,
      expect.stringMatching(/^invalid docker provider defaults: maxOutputBytes: /),
    ]);
    expect(refusal(bwrap({ maxOutputBytes: 1.5 }))).toEqual([
      "invalid_task",
      false,
      expect.stringMatching(/^invalid bubblewrap provider defaults: maxOutputBytes: /),
    ]);
    for (const bad of [
      { probeTimeoutMs: Number.NaN },
      { killGraceS: 0 },
      { execSlackMs: -1 },
      { killRounds: 0 },
      { execUser: "" },
      { memoryMb: 0 },
      { pidsLimit: undefined },
      { maxOutputByte: 4 }, // a typo: no default of either
    ]) {
      const key = Object.keys(bad)[0];
      expect(refusal(docker(bad)), key).toEqual(["invalid_task", false, expect.stringContaining(`${key}: `)]);
      expect(refusal(bwrap(bad)), key).toEqual(["invalid_task", false, expect.stringContaining(`${key}: `)]);
    }
    expect(refusal(docker({ apiTimeoutMs: Number.POSITIVE_INFINITY, cpus: 0 }))).toEqual([
      "invalid_task",
      false,
      expect.stringMatching(/cpus: .*; apiTimeoutMs: |apiTimeoutMs: .*; cpus: /),
    ]);
    expect(refusal(bwrap({ startTimeoutMs: -5 }))).toEqual([
      "invalid_task",
      false,
      expect.stringContaining("startTimeoutMs: "),
    ]);
    // Valid ones, and Docker's uncapped workspace (diskMb: null), still build.
    expect(refusal(docker({ maxOutputBytes: 4, diskMb: null, killGraceS: 15, apiTimeoutMs: 2_000 }))).toBe(
      "constructed",
    );
    expect(
      refusal(bwrap({ maxOutputBytes: 4, killGraceS: 0.5, execSlackMs: 0, startTimeoutMs: 120_000 })),
    ).toBe("constructed");
  });

  it("refuses a provider it cannot offer with a final error (no host fallback)", () => {
    for (const provider of ["bubblewrap", "host"] as const) {
      try {
        createSandboxProvider({ provider: provider as "bubblewrap" });
        expect.unreachable();
      } catch (e) {
        expect(isFleetError(e)).toBe(true);
        expect((e as { retryable: boolean }).retryable).toBe(false);
      }
    }
  });
});
