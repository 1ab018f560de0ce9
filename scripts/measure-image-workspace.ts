/**
 * What a Docker create costs when the task's image carries its own /workspace files (which the
 * provider reads from the image before the start and stages after it): this process's peak RSS
 * and the create's time, for an image with `--mib` MiB of random bytes in /workspace (built on
 * the base image, tagged by size, kept). Run it at two revisions to compare.
 *
 *   npx tsx scripts/measure-image-workspace.ts [--mib 300] [--n 3] [--image rollout-fleet/base:latest]
 */
import { execFileSync } from "node:child_process";
import { parseArgs } from "node:util";
import { DockerSandboxProvider } from "@fleet/sandbox";
import { positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({
  options: {
    mib: { type: "string", default: "300" },
    n: { type: "string", default: "3" },
    image: { type: "string", default: process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest" },
  },
});
const MIB = positiveInt(values.mib, "--mib");
const N = positiveInt(values.n, "--n");
const image = `fleet-bench/workspace-${MIB}m`;

try {
  execFileSync("docker", ["image", "inspect", image], { stdio: "ignore" });
} catch {
  execFileSync("docker", ["build", "-q", "-t", image, "-"], {
    input: `FROM ${values.image}\nRUN mkdir -p /workspace && head -c ${MIB * 1024 * 1024} /dev/urandom > /workspace/big.bin\n`,
    stdio: ["pipe", "ignore", "inherit"],
  });
}

const provider = new DockerSandboxProvider({ scope: `measure${process.pid}` });
const rssMib = () => Math.round(process.resourceUsage().maxRSS / 1024);
console.log(`image ${image}: ${MIB} MiB in /workspace; peak RSS before the first create ${rssMib()} MiB`);
for (let i = 0; i < N; i++) {
  const started = performance.now();
  const h = await provider.create({
    rolloutId: `measure-${process.pid}-${i}`,
    owner: "resources",
    image,
    network: "none",
    expiresAt: Date.now() + 600_000,
  });
  const ms = performance.now() - started;
  try {
    const r = await provider.exec(h, ["sh", "-c", "wc -c < /workspace/big.bin"], { deadlineMs: 30_000 });
    if (Number(r.stdout.trim()) !== MIB * 1024 * 1024) throw new Error(`staged ${r.stdout.trim()} bytes`);
  } finally {
    await provider.destroy(h);
  }
  console.log(`create ${i + 1}: ${Math.round(ms)} ms; peak RSS so far ${rssMib()} MiB`);
}
