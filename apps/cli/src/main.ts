import { readFile } from "node:fs/promises";
import { CliConfig, ConfigError, parseConfig } from "@fleet/config";
import { loadSuite, taskDigest } from "@fleet/tasks";
import { runCli } from "./program.ts";

// The only file of the CLI that reads the environment.
let defaults: CliConfig;
try {
  defaults = parseConfig(CliConfig, process.env);
} catch (err) {
  process.stderr.write(`${err instanceof ConfigError ? err.message : String(err)}\n`);
  process.exit(2);
}

const interrupt = new AbortController();
process.once("SIGINT", () => interrupt.abort());
process.once("SIGTERM", () => interrupt.abort());
// `fleet results ... | head`: a closed pipe is not an error.
process.stdout.on("error", (err: NodeJS.ErrnoException) => {
  if (err.code === "EPIPE") process.exit(0);
  throw err;
});

const code = await runCli(process.argv.slice(2), {
  stdout: process.stdout,
  stderr: process.stderr,
  defaults,
  readFile: (path) => readFile(path, "utf8"),
  loadSuite: (dir) => loadSuite(dir),
  digestOf: taskDigest,
  signal: interrupt.signal,
});
process.exitCode = code;
