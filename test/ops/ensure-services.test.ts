import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import { REPO_ROOT } from "../../scripts/lib/fleet-processes.ts";

/**
 * scripts/ensure-services.sh on a machine that has everything already (as CI's has by now): it
 * must find it all and install nothing, also on the PATH a non-root Debian user has (no sbin,
 * where dockerd and debootstrap live). It said "missing: docker.io debootstrap" there.
 */
describe("ensure-services.sh", () => {
  it("installs nothing when everything is there, even on a PATH without sbin", () => {
    const run = spawnSync("bash", [join(REPO_ROOT, "scripts/ensure-services.sh")], {
      env: {
        ...process.env,
        PATH: "/usr/local/bin:/usr/bin:/bin",
        REDIS_URL: process.env.REDIS_URL ?? "redis://127.0.0.1:6379",
      },
      encoding: "utf8",
      timeout: 240_000,
    });
    expect(run.stderr).not.toMatch(/installing|missing:/);
    expect(run.status, run.stderr).toBe(0);
    expect(run.stdout).toMatch(/^export FLEET_BASE_IMAGE=rollout-fleet\/base:\S+$/m);
  });
});
