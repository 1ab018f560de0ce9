import { defineConfig } from "vitest/config";

// `npm run test:chaos`: the big chaos run (test/chaos/chaos.e2e.test.ts with the full profile:
// 200 oracle rollouts, 12 SIGKILLs over every worker kind, a Redis restart, a 20 s Docker
// outage) plus the other fault tests under test/chaos/. `npm test` runs the small profile.
// FLEET_CHAOS_REAL_DOCKERD=1 also restarts the real dockerd (disturbs everyone on the host).
export default defineConfig({
  test: {
    include: ["test/chaos/**/*.test.ts"],
    env: { FLEET_CHAOS_PROFILE: "full" },
    testTimeout: 1_800_000,
    hookTimeout: 300_000,
    fileParallelism: false,
  },
});
