import { rmSync } from "node:fs";
import { readFile } from "node:fs/promises";
import {
  CliConfig,
  ConfigError,
  parseConfig,
  unknownFleetVariables,
  unknownVariableMessage,
} from "@fleet/config";
import { loadSuite, taskDigest } from "@fleet/tasks";
import { type CliContext, openPartials } from "./context.ts";
import { commandName, EXIT, runCli } from "./program.ts";
import type { ProgressStream } from "./progress.ts";
import { PipeOutput } from "./stdout.ts";

// The only file of the CLI that reads the environment.
let defaults: CliConfig & CliDefaults;
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
 * FLEET_URL and FLEET_TOKEN, checked. A variable the command's option may override (`--url`,
 * `--token` among the words) refuses nothing here when it is bad: the command refuses it unless it
 * did get the option (`defaults.unless`), so a stale FLEET_URL does not stop `fleet --url … status`.
 */
function readDefaults(env: NodeJS.ProcessEnv, argv: readonly string[]): CliConfig & CliDefaults {
  try {
    return parseConfig(CliConfig, env);
  } catch (err) {
    const given = (flag: string) => argv.some((a) => a === flag || a.startsWith(`${flag}=`));
    const overridden = { ...env };
    const unless: NonNullable<CliDefaults["unless"]> = {};
    const message = err instanceof Error ? err.message : String(err);
    if (given("--url") && "FLEET_URL" in env) {
      delete overridden.FLEET_URL;
      unless.url = message;
    }
    if (given("--token") && "FLEET_TOKEN" in env) {
      delete overridden.FLEET_TOKEN;
      unless.token = message;
    }
    if (Object.keys(unless).length === 0) throw err;
    return { ...parseConfig(CliConfig, overridden), unless };
  }
}

type CliDefaults = Pick<CliContext["defaults"], "unless">;

const interrupt = new AbortController();
/** The signal that interrupted the command: its exit is 128 + its number (130 for Ctrl-C, 143 for a SIGTERM). */
let interruptedBy: "SIGINT" | "SIGTERM" | null = null;
let interruptedAt = 0;
// Listened to for good: with no listener left, a second signal killed the process where it stood,
// its `--out` partial file left behind, no exit code or note of what it submitted; and `npx fleet`
// (npm passes a Ctrl-C on to the CLI, which had it already from the terminal) gets two for one.
// So a repeat within a second is that same Ctrl-C; a later one stops at once, removing the partial
// files, for a command whose stop hangs.
for (const signal of ["SIGINT", "SIGTERM"] as const) {
  process.on(signal, () => {
    if (interruptedBy === null) {
      interruptedBy = signal;
      interruptedAt = performance.now();
      interrupt.abort();
      return;
    }
    if (performance.now() - interruptedAt < 1000) return;
    for (const partial of openPartials) rmSync(partial, { force: true });
    process.stderr.write("interrupted again; stopping now\n");
    process.exit(interruptedBy === "SIGTERM" ? 143 : EXIT.interrupted);
  });
}
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

// A write error other than a closed pipe (stdout on a full disk, an I/O error) fails the command:
// writeText throws it at the next write (a submit stops there, naming what it admitted), and the
// last write's, which comes after the command is done, is said below. Unheard, its 'error' event
// was an uncaught exception, a submission cut off mid-way without a word of what it had admitted.
for (const out of [stdout, stderr]) out.on("error", () => {});

let code = await runCli(process.argv.slice(2), {
  stdout,
  stderr,
  defaults,
  readFile: (path) => readFile(path, "utf8"),
  loadSuite: (dir, options) => loadSuite(dir, options),
  digestOf: taskDigest,
  signal: interrupt.signal,
});
// The last writes to stdout end after the command: an exit 0 would claim output that was lost.
await new Promise<void>((resolve) => stdout.end(() => resolve()));
if (stdout.errored && code === EXIT.ok) {
  process.stderr.write(`error: cannot write the output: ${stdout.errored.message}\n`);
  code = EXIT.error;
}
// Interrupted by a SIGTERM (a CI job's timeout, `kill`, a supervisor), as shells and supervisors
// read it: 143, not Ctrl-C's 130.
process.exitCode = code === EXIT.interrupted && interruptedBy === "SIGTERM" ? 143 : code;
