import { execFile } from "node:child_process";
import { fileURLToPath } from "node:url";

/** `bin/fleet.js`, the `fleet` command `npx fleet` runs. */
export const FLEET_BIN = fileURLToPath(new URL("../../bin/fleet.js", import.meta.url));

/** Run the `fleet` command with `args`, in an environment of `env` and PATH only; its exit code and output. */
export function runFleet(
  args: string[],
  env: Record<string, string>,
): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(
      process.execPath,
      [FLEET_BIN, ...args],
      { env: { PATH: process.env.PATH ?? "", ...env } },
      (err, stdout, stderr) =>
        resolve({ code: err === null ? 0 : typeof err.code === "number" ? err.code : -1, stdout, stderr }),
    );
  });
}
