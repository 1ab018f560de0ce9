import { defineConfig } from "vitest/config";

// Three projects, run one after another (sequence.groupOrder): fast unit tests beside the code,
// integration tests that need a real Redis and/or Docker daemon (*.int.test.ts), and
// whole-fleet end-to-end tests under test/. Integration and e2e files run one at a time: they
// share one Docker daemon and two cores.
export default defineConfig({
  test: {
    reporters: process.env.CI
      ? ["default", ["json", { outputFile: "test-artifacts/vitest.json" }]]
      : ["default"],
    projects: [
      {
        test: {
          name: "unit",
          include: ["packages/*/src/**/*.test.ts", "apps/*/src/**/*.test.ts"],
          exclude: ["**/*.int.test.ts", "**/node_modules/**"],
          // Not vitest's 5 s: unit files run in parallel on two cores, and a few tests take 2-3 s
          // alone (2,000 key decryptions, five CLI processes); one took 7.4 s beside other work.
          testTimeout: 30_000,
          sequence: { groupOrder: 0 },
        },
      },
      {
        test: {
          name: "integration",
          include: ["packages/*/src/**/*.int.test.ts", "apps/*/src/**/*.int.test.ts"],
          testTimeout: 120_000,
          hookTimeout: 120_000,
          fileParallelism: false,
          sequence: { groupOrder: 1 },
        },
      },
      {
        test: {
          name: "e2e",
          include: ["test/**/*.test.ts"],
          exclude: ["**/node_modules/**"],
          testTimeout: 300_000,
          hookTimeout: 300_000,
          fileParallelism: false,
          sequence: { groupOrder: 2 },
        },
      },
    ],
  },
});
