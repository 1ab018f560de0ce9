import { readFile } from "node:fs/promises";
import {
  CliConfig,
  ConfigError,
  parseConfig,
  unknownFleetVariables,
  unknownVariableMessage,
} from "@fleet/config";
import { loadSuite, taskDigest } from "@fleet/tasks";
import { commandName, runCli } from "./program.ts";
import type { ProgressStream } from "./progress.ts";
import { PipeOutput } from "./stdout.ts";

// The only file of the CLI that reads the environment.
let defaults: CliConfig;
try {
  defaults = readDefaults(process.env, process.argv.slice(2));
} catch (err) {
  process.stderr.write(`${err instanceof ConfigError ? err.message : String(err)}\n`);
  process.exit(2);
}
// A misspelt FLEET_URL or FLEET_TOKEN would be ignored without a word.
for (const unknown of unknownFleetVariables(process.env)) {
  process.stderr.write(`warning: ${unknownVariableMessage(unknown)}\n`);
}

/**
 * FLEET_URL and FLEET_TOKEN, checked. A variable the command's flag overrides (`--url`,
 * `--token`) refuses nothing when it is bad: a stale FLEET_URL does not stop `fleet --url … status`.
 */
function readDefaults(env: NodeJS.ProcessEnv, argv: readonly string[]): CliConfig {
  try {
    return parseConfig(CliConfig, env);
  } catch (err) {
    const given = (flag: string) => argv.some((a) => a === flag || a.startsWith(`${flag}=`));
    const overridden = { ...env };
    if (given("--url")) delete overridden.FLEET_URL;
    if (given("--token")) delete overridden.FLEET_TOKEN;
    if (Object.keys(overridden).length === Object.keys(env).length) throw err;
    return parseConfig(CliConfig, overridden);
  }
}

const interrupt = new AbortController();
process.once("SIGINT", () => interrupt.abort());
process.once("SIGTERM", () => interrupt.abort());
// `fleet results ... | head`: a reader that goes away is not an error. `results` and `status`
// only print, so they stop there with 0. `submit` and `cancel` change the fleet: they finish
// (stopping between chunks would leave a submission half made, with exit 0), print nothing more
// to stdout, and exit with the code the work earned.
const printsOnly = ["results", "status"].includes(commandName(process.argv.slice(2)) ?? "");
const stdout = new PipeOutput(process.stdout, () => {
  if (printsOnly) process.exit(0);
});
// `fleet ... 2>&1 | head`: stderr goes away with that reader too. Its writes (notes, progress) are
// then dropped as stdout's are, and the work goes on: unheard, the EPIPE was an uncaught exception
// (exit 1 after a whole submission, or a `--wait` ended in the middle).
const stderr = Object.defineProperties(new PipeOutput(process.stderr, () => {}), {
  isTTY: { get: () => process.stderr.isTTY },
  columns: { get: () => process.stderr.columns },
}) as PipeOutput & ProgressStream;

const code = await runCli(process.argv.slice(2), {
  stdout,
  stderr,
  defaults,
  readFile: (path) => readFile(path, "utf8"),
  loadSuite: (dir, options) => loadSuite(dir, options),
  digestOf: taskDigest,
  signal: interrupt.signal,
});
process.exitCode = code;
