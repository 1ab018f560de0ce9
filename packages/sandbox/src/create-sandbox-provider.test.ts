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
