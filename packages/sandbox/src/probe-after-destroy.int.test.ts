// One check, run against each real provider: they must agree on what a probe of a sandbox that
// no longer exists is (DESIGN §2 rule 6: a lost sandbox is `sandbox_lost`, masked, never scored;
// never a retryable `provider_unavailable`, which would retry a seed against a sandbox that is gone).
import { randomUUID } from "node:crypto";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { classifyFailure } from "@fleet/contracts";
import { afterAll, describe, expect, it } from "vitest";
import { BubblewrapSandboxProvider } from "./bubblewrap/bubblewrap-sandbox-provider.ts";
import { bwrapUnavailable, testRootfs } from "./bubblewrap/test-rootfs.ts";
import { DockerSandboxProvider } from "./docker/docker-sandbox-provider.ts";
import type { SandboxProvider } from "./provider.ts";
import { fleetError } from "./testing/index.ts";

const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const RUN = `pad-${randomUUID().slice(0, 8)}`;
const bwrap = bwrapUnavailable();
if (bwrap) console.warn(`skipping the bubblewrap case: ${bwrap}`);

const stateDirs: string[] = [];
afterAll(async () => {
  for (const dir of stateDirs) await rm(dir, { recursive: true, force: true });
});

const providers: { name: string; skip: boolean; make: () => Promise<SandboxProvider>; image: string }[] = [
  { name: "docker", skip: false, make: async () => new DockerSandboxProvider({ scope: RUN }), image: IMAGE },
  {
    name: "bubblewrap",
    skip: bwrap !== null,
    make: async () => {
      const stateDir = await mkdtemp(join(tmpdir(), "fleet-probe-after-destroy-"));
      stateDirs.push(stateDir);
      return new BubblewrapSandboxProvider({ rootfs: await testRootfs(), stateDir, scope: RUN });
    },
    image: "base",
  },
];

describe.each(providers)("$name: probe after destroy", ({ skip, make, image }) => {
  it.skipIf(skip)(
    "a probe of a destroyed sandbox is sandbox_lost (final, masked), never provider_unavailable",
    async () => {
      const provider = await make();
      const handle = await provider.create({
        image,
        rolloutId: `${RUN}-${randomUUID().slice(0, 6)}`,
        owner: "resources",
        expiresAt: Date.now() + 600_000,
      });
      try {
        expect((await provider.probe(handle)).isolated).toBe(true);
      } finally {
        expect((await provider.destroy(handle)).confirmed).toBe(true);
      }
      expect(await provider.alive(handle)).toBe(false);
      const err = await fleetError(provider.probe(handle));
      expect([err.kind, err.retryable], err.message).toEqual(["sandbox_lost", false]);
      expect(classifyFailure(err.kind).outcome).toBe("mask");
      await provider.close?.();
    },
  );
});
