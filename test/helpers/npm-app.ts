import { type ChildProcessByStdio, spawn } from "node:child_process";
import type { Readable } from "node:stream";
import { REPO_ROOT } from "../../scripts/lib/fleet-processes.ts";

/**
 * An app started the README's way (`npm start -w <workspace>`), with only what it needs of this
 * process's environment (PATH, HOME, DOCKER_HOST), metrics off, info logs, and `env` on top; its
 * output (stdout and stderr) gathered in `output()`.
 */
export function npmStart(
  workspace: string,
  env: Record<string, string>,
  /** In a process group of its own (npm's id), as a terminal runs it: a Ctrl-C goes to all of it. */
  options: { group?: boolean } = {},
): { npm: ChildProcessByStdio<null, Readable, Readable>; output: () => string } {
  const npm = spawn("npm", ["start", "-w", workspace], {
    cwd: REPO_ROOT,
    env: {
      PATH: process.env.PATH ?? "/usr/bin:/bin",
      HOME: process.env.HOME ?? "/root",
      ...(process.env.DOCKER_HOST ? { DOCKER_HOST: process.env.DOCKER_HOST } : {}),
      FLEET_METRICS_PORT: "0",
      FLEET_LOG_LEVEL: "info",
      ...env,
    },
    stdio: ["ignore", "pipe", "pipe"],
    ...(options.group ? { detached: true } : {}),
  });
  let output = "";
  npm.stdout.on("data", (d: Buffer) => (output += d.toString()));
  npm.stderr.on("data", (d: Buffer) => (output += d.toString()));
  return { npm, output: () => output };
}
