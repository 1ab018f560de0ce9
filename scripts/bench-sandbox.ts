/**
 * Sandbox latency benchmark: create / exec(`true`) / destroy through `DockerSandboxProvider`,
 * against a raw dockerode loop doing the same Docker calls with the same container config, in
 * the same run, interleaved (alternating which goes first). Prints p50/p95 of both and the
 * provider/raw ratio (target: ≤ 1.1×). Beside them, what a verify delivered again pays before it
 * stages its tests: the provider's fenced root sweep (`killProcesses` as root with a verify epoch:
 * the fence raised as nobody, then every root process swept), against the provider's own exec.
 *
 *   npx tsx scripts/bench-sandbox.ts [--n 30] [--execs 5] [--image rollout-fleet/base:latest]
 */
import { parseArgs } from "node:util";
import { SandboxSpec, type SandboxSpecInput } from "@fleet/contracts";
import {
  buildContainerConfig,
  CappedBuffer,
  DockerSandboxProvider,
  DockerStreamDemuxer,
  deadlineArgv,
  LABEL_MANAGED,
  LABEL_ROLLOUT,
  ROOT_USER,
  workspaceVolumeName,
} from "@fleet/sandbox";
import Dockerode from "dockerode";
import { percentile, positiveInt } from "./lib/bench-stats.ts";

const { values } = parseArgs({
  options: {
    n: { type: "string", default: "30" },
    execs: { type: "string", default: "5" },
    warmup: { type: "string", default: "3" },
    image: { type: "string", default: process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest" },
    socket: { type: "string", default: "/var/run/docker.sock" },
  },
});
const N = positiveInt(values.n, "--n");
const EXECS = positiveInt(values.execs, "--execs");
const WARMUP = Number(values.warmup);
const IMAGE = values.image;
const RUN = `bench${process.pid}`;

const docker = new Dockerode({ socketPath: values.socket });
const provider = new DockerSandboxProvider({ docker: { socketPath: values.socket } });

type Op = "create" | "exec" | "destroy";
type Samples = Record<Op, number[]>;
const samples: Record<"provider" | "raw", Samples> = {
  provider: { create: [], exec: [], destroy: [] },
  raw: { create: [], exec: [], destroy: [] },
};
/** Raw execs of `timeout -k 2 30 true`: what the provider's deadline wrapper costs by itself. */
const rawWrappedExec: number[] = [];
/** The provider's fenced root sweeps (a verify delivered again, before it stages its tests). */
const fencedSweep: number[] = [];

let seq = 0;
function spec(kind: string): SandboxSpecInput {
  return {
    image: IMAGE,
    rolloutId: `${RUN}-${kind}-${++seq}`,
    owner: "resources",
    expiresAt: Date.now() + 600_000,
  };
}

async function providerRound(record: boolean): Promise<void> {
  const s = samples.provider;
  let t = performance.now();
  const h = await provider.create(spec("p"));
  if (record) s.create.push(performance.now() - t);
  try {
    for (let i = 0; i < EXECS; i++) {
      t = performance.now();
      const r = await provider.exec(h, ["true"], { deadlineMs: 30_000 });
      if (r.exitCode !== 0) throw new Error(`provider exec exited ${r.exitCode}: ${r.stderr}`);
      if (record) s.exec.push(performance.now() - t);
    }
    t = performance.now();
    const swept = await provider.killProcesses(h, ROOT_USER, { quickMs: 5_000, fenceEpoch: seq });
    if (!swept.confirmed || swept.fenced !== true) {
      throw new Error(`the fenced root sweep did not confirm: ${JSON.stringify(swept)}`);
    }
    if (record) fencedSweep.push(performance.now() - t);
  } finally {
    t = performance.now();
    await provider.destroy(h);
    if (record) s.destroy.push(performance.now() - t);
  }
}

async function rawRound(record: boolean): Promise<void> {
  const s = samples.raw;
  const config = buildContainerConfig(SandboxSpec.parse(spec("r")));
  let t = performance.now();
  const container = await docker.createContainer(config);
  await container.start();
  if (record) s.create.push(performance.now() - t);
  try {
    for (let i = 0; i < 2 * EXECS; i++) {
      // Alternate plain `true` (the raw baseline) with the provider's deadline-wrapped command.
      const wrapped = i % 2 === 1;
      t = performance.now();
      const exec = await container.exec({
        Cmd: wrapped ? deadlineArgv(["true"], 30_000) : ["true"],
        AttachStdout: true,
        AttachStderr: true,
        User: "1000:1000",
      });
      const socket = await exec.start({ hijack: true, stdin: false });
      const demux = new DockerStreamDemuxer(new CappedBuffer(1 << 20), new CappedBuffer(1 << 20));
      await new Promise<void>((resolve, reject) => {
        socket.on("data", (c: Buffer) => demux.push(c));
        socket.once("end", resolve);
        socket.once("close", resolve);
        socket.once("error", reject);
      });
      socket.destroy();
      const info = await exec.inspect();
      if (info.ExitCode !== 0) throw new Error(`raw exec exited ${info.ExitCode}`);
      if (record) (wrapped ? rawWrappedExec : s.exec).push(performance.now() - t);
    }
  } finally {
    t = performance.now();
    await container.remove({ force: true, v: true });
    // Only an uncapped workspace (`diskMb: null`) has a volume; the capped one is a tmpfs.
    for (const m of config.HostConfig?.Mounts ?? [])
      if (m.Type === "volume") await docker.getVolume(m.Source!).remove();
    if (record) s.destroy.push(performance.now() - t);
  }
}

async function cleanup(): Promise<void> {
  const left = await docker.listContainers({ all: true, filters: { label: [`${LABEL_MANAGED}=true`] } });
  for (const c of left.filter((c) => (c.Labels[LABEL_ROLLOUT] ?? "").startsWith(`${RUN}-`))) {
    await docker.getContainer(c.Id).remove({ force: true, v: true });
    const name = (c.Names[0] ?? "").replace(/^\//, "");
    await docker
      .getVolume(workspaceVolumeName(name))
      .remove()
      .catch(() => undefined);
  }
}

async function main(): Promise<void> {
  await docker.getImage(IMAGE).inspect();
  console.log(
    `sandbox bench: image ${IMAGE}, ${N} rounds (+${WARMUP} warm-up), ${EXECS} exec(s) per sandbox`,
  );
  for (let i = 0; i < WARMUP; i++) {
    await providerRound(false);
    await rawRound(false);
  }
  for (let i = 0; i < N; i++) {
    // Alternate the order so neither side always runs on a warmer daemon.
    if (i % 2 === 0) {
      await providerRound(true);
      await rawRound(true);
    } else {
      await rawRound(true);
      await providerRound(true);
    }
  }

  const fmt = (ms: number) => ms.toFixed(1).padStart(8);
  const ratio = (a: number, b: number) => `${(a / b).toFixed(2)}x`.padStart(7);
  console.log("");
  console.log("op        samples | provider p50   p95 (ms) |      raw p50   p95 (ms) | ratio p50   p95");
  const verdicts: string[] = [];
  for (const op of ["create", "exec", "destroy"] as const) {
    const p = samples.provider[op];
    const r = samples.raw[op];
    const [p50, p95, r50, r95] = [percentile(p, 50), percentile(p, 95), percentile(r, 50), percentile(r, 95)];
    console.log(
      `${op.padEnd(9)} ${String(p.length).padStart(7)} | ${fmt(p50)} ${fmt(p95)}      | ${fmt(r50)} ${fmt(r95)}      | ${ratio(p50, r50)} ${ratio(p95, r95)}`,
    );
    verdicts.push(`${op} ${p50 / r50 <= 1.1 ? "ok" : "over"} (${(p50 / r50).toFixed(2)}x)`);
  }
  const [w50, w95] = [percentile(rawWrappedExec, 50), percentile(rawWrappedExec, 95)];
  const [e50, e95] = [percentile(samples.raw.exec, 50), percentile(samples.raw.exec, 95)];
  console.log(
    `${"exec+wrap".padEnd(9)} ${String(rawWrappedExec.length).padStart(7)} |   (raw loop running \`timeout -k 2 30 true\`) ${fmt(w50)} ${fmt(w95)}      | ${ratio(w50, e50)} ${ratio(w95, e95)}`,
  );
  const [f50, f95] = [percentile(fencedSweep, 50), percentile(fencedSweep, 95)];
  const [x50, x95] = [percentile(samples.provider.exec, 50), percentile(samples.provider.exec, 95)];
  console.log(
    `${"fenced".padEnd(9)} ${String(fencedSweep.length).padStart(7)} | ${fmt(f50)} ${fmt(f95)}      |   (the provider's fenced root sweep, against its exec)   | ${ratio(f50, x50)} ${ratio(f95, x95)}`,
  );
  console.log(`\ntarget provider/raw p50 <= 1.1x: ${verdicts.join(", ")}`);
}

try {
  await main();
} finally {
  await cleanup();
}
