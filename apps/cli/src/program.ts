import { dispatcherUrlProblem, redactUserinfo, TOKEN_CHARS } from "@fleet/config";
import { MIN_DURATION_S } from "@fleet/contracts";
import { DEFAULT_MAX_TASK_BYTES } from "@fleet/tasks";
import { Command, CommanderError, InvalidArgumentError, Option } from "commander";
import pkg from "../package.json" with { type: "json" };
import { FleetClient, isApiError } from "./client.ts";
import { cancelCommand } from "./commands/cancel.ts";
import { resultsCommand } from "./commands/results.ts";
import { statusCommand } from "./commands/status.ts";
import { type FollowOptions, submitCommand } from "./commands/submit.ts";
import { trajectoryCommand } from "./commands/trajectory.ts";
import { watchCommand } from "./commands/watch.ts";
import { type CliContext, OutputError } from "./context.ts";
import { DEFAULT_MAX_REQUEST_BYTES, UsageError } from "./requests.ts";

/** Exit codes: 0 ok; 1 API, output-file or unexpected error; 2 bad usage; 130 interrupted (Ctrl-C; 143 for a SIGTERM, set by main.ts). */
/** Commander's message for an option's refused value: `… argument '<value>' is invalid. …`. */
const REFUSED_ARGUMENT = /(argument ')([\s\S]*)(' is invalid)/;
/** Commander's message for a mistyped option given with `=`: its value (`--tokenn=<token>`) is not shown. */
const UNKNOWN_OPTION_VALUE = /(unknown option '[^'=\s]*=)[\s\S]*'/;

export const EXIT = { ok: 0, error: 1, usage: 2, interrupted: 130 } as const;

interface ConnectionOptions {
  url: string;
  token?: string;
}

function positiveInt(value: string): number {
  if (!/^\d+$/.test(value.trim()) || Number(value) < 1)
    throw new InvalidArgumentError("must be a positive whole number");
  // Past 2^53 a number is no longer the one given (it went on as 100000000000000000000 for
  // 99999999999999999999, and was echoed so).
  if (!Number.isSafeInteger(Number(value)))
    throw new InvalidArgumentError(`must be at most ${Number.MAX_SAFE_INTEGER}`);
  return Number(value);
}

/** The longest timer Node keeps (a longer one fires at once: a poll every millisecond). */
const MAX_TIMER_MS = 2_147_483_647;

function pollIntervalMs(value: string): number {
  const n = positiveInt(value);
  if (n > MAX_TIMER_MS) throw new InvalidArgumentError(`must be at most ${MAX_TIMER_MS} ms (about 24 days)`);
  return n;
}

function positiveSeconds(value: string): number {
  const n = Number(value);
  if (value.trim() === "" || !Number.isFinite(n) || n <= 0) {
    throw new InvalidArgumentError("must be a finite, positive number of seconds");
  }
  return n;
}

/** A rollout duration: as the API takes it (at least 1 s: less could run nothing). */
function durationSeconds(value: string): number {
  const n = positiveSeconds(value);
  if (n < MIN_DURATION_S) throw new InvalidArgumentError(`must be at least ${MIN_DURATION_S} second`);
  return n;
}

/** Chunk keys are `<base>-<n>` (and `<base>-<n>.<from>-<to>`), at most 200 printable ASCII characters. */
function idempotencyBase(value: string): string {
  if (!/^[\x21-\x7e]{1,160}$/.test(value)) {
    throw new InvalidArgumentError("must be 1 to 160 printable ASCII characters, without spaces");
  }
  return value;
}

function httpUrl(value: string): string {
  let ok = false;
  try {
    const url = new URL(value);
    ok = url.protocol === "http:" || url.protocol === "https:";
  } catch {
    // fall through
  }
  if (!ok) throw new InvalidArgumentError("must be an http:// or https:// URL");
  // fetch would refuse it on every attempt (a bad port, credentials), retried as if the dispatcher
  // were down; or every request would miss its route (a query, a fragment).
  const problem = dispatcherUrlProblem(value);
  if (problem !== undefined) throw new InvalidArgumentError(problem);
  return value.replace(/\/+$/, "");
}

/**
 * `--token`: sent as an HTTP header value, so printable ASCII only (else a usage error, not an
 * unreachable dispatcher). Refused with a UsageError, not Commander's InvalidArgumentError: that
 * one's message quotes the refused value, and a token is a secret (FLEET_TOKEN's says "value hidden").
 */
function tokenOption(): Option {
  return new Option("--token <token>", "API bearer token (env FLEET_TOKEN; prefer the env var)").argParser(
    (value: string) => {
      if (!TOKEN_CHARS.test(value)) {
        throw new UsageError(
          "--token: must be printable ASCII without spaces (it goes into an HTTP header) (value hidden)",
        );
      }
      return value;
    },
  );
}

/** `--url` and `--token` on every command; flags win over `FLEET_URL` / `FLEET_TOKEN`. */
function withConnection(cmd: Command, ctx: CliContext): Command {
  return cmd
    .addOption(
      new Option("--url <url>", "dispatcher base URL (env FLEET_URL)")
        .default(ctx.defaults.url)
        .argParser(httpUrl),
    )
    .addOption(tokenOption())
    .hook("preAction", (command) => {
      // A bad variable let go for an option the command did not get after all (`defaults.unless`).
      const unless = ctx.defaults.unless;
      for (const name of ["url", "token"] as const) {
        const error = unless?.[name];
        if (error !== undefined && command.getOptionValueSource(name) !== "cli") throw new UsageError(error);
      }
    });
}

function clientFor(opts: ConnectionOptions, ctx: CliContext): FleetClient {
  return new FleetClient({
    ...ctx.client,
    url: opts.url,
    token: opts.token ?? ctx.defaults.token,
    signal: ctx.signal,
    onRetry: ({ attempt, maxAttempts, delayMs, reason }) => {
      const of = Number.isFinite(maxAttempts) ? `/${maxAttempts}` : "";
      ctx.stderr.write(`${reason}; retrying in ${(delayMs / 1000).toFixed(1)}s (attempt ${attempt}${of})\n`);
    },
  });
}

/**
 * What to say after "interrupted" when Ctrl-C stops a command: what it leaves behind. `submit`
 * names the batches it submitted (`batchIds`, as they are admitted); the commands that only read
 * or follow a batch cancelled nothing.
 */
export function interruptedNote(command: string, ids: readonly string[] = []): string {
  const unique = [...new Set(ids)];
  const named = unique.join(" ");
  switch (command) {
    case "submit":
      if (unique.length === 0) return "interrupted; no batch was confirmed submitted";
      return (
        `interrupted; submitted rollouts keep running on the dispatcher in ${unique.length === 1 ? "batch" : "batches"} ${named} ` +
        `(\`fleet status ${unique[0]}\` shows ${unique.length === 1 ? "it" : "one"}, \`fleet watch ${named}\` follows ${unique.length === 1 ? "it" : "them"}, ` +
        `\`fleet cancel <batchId>\` stops one)`
      );
    case "watch":
      return `interrupted; nothing was cancelled: the batches keep running (\`fleet watch ${named}\` follows them again)`;
    case "status":
    case "results":
      return `interrupted; nothing was cancelled: batch ${named} keeps running if it was`;
    case "trajectory":
      return `interrupted; nothing was cancelled: rollout ${named} keeps running if it was`;
    case "cancel":
      return `interrupted; the cancel of ${named} may or may not have reached the dispatcher (\`fleet cancel ${named}\` again is safe)`;
    default:
      return "interrupted";
  }
}

/**
 * The `fleet` command tree. Commands report their exit code through `setExitCode`, and what an
 * interruption would leave behind through `setInterruptedNote` (see `interruptedNote`).
 */
export function createProgram(
  ctx: CliContext,
  setExitCode: (code: number) => void,
  setInterruptedNote: (note: string) => void = () => {},
): Command {
  const program = new Command("fleet")
    .description("Submit and follow LLM-agent rollouts on a rollout-fleet dispatcher.")
    .version(pkg.version)
    .showHelpAfterError("(add --help for usage)")
    .exitOverride()
    .configureOutput({
      writeOut: (s) => ctx.stdout.write(s),
      writeErr: (s) => ctx.stderr.write(s),
      // Commander quotes a refused argument: a URL's password (`--url http://u:p@…`) is not echoed.
      // Its own form is read to the last quote (a password may hold a `'`); any other, quoted.
      outputError: (s, write) =>
        write(
          UNKNOWN_OPTION_VALUE.test(s)
            ? s.replace(UNKNOWN_OPTION_VALUE, (_m, option: string) => `${option}***'`)
            : REFUSED_ARGUMENT.test(s)
              ? s.replace(
                  REFUSED_ARGUMENT,
                  (_m, a: string, url: string, b: string) => `${a}${redactUserinfo(url)}${b}`,
                )
              : s.replace(
                  /'([a-z][a-z0-9+.-]*:(?:\/\/|[^']*@)[^']*)'/gi,
                  (_m, url: string) => `'${redactUserinfo(url)}'`,
                ),
        ),
    })
    // `--url`/`--token` before the command too (`fleet --url … submit …`, as with docker or
    // kubectl), handed to the command; given after it as well, the command's own win.
    .addOption(new Option("--url <url>", "dispatcher base URL (env FLEET_URL)").argParser(httpUrl))
    .addOption(tokenOption())
    .hook("preSubcommand", (root, sub) => {
      for (const name of ["url", "token"]) {
        const value: unknown = root.getOptionValue(name);
        if (value !== undefined && sub.getOptionValueSource(name) !== "cli") {
          sub.setOptionValueWithSource(name, value, "cli");
        }
      }
    });

  withConnection(
    program
      .command("submit")
      .description(
        "Submit a task suite × an agent as a batch; print the batch id (with --wait, follow it to the end)",
      )
      .requiredOption("--suite <dir>", "task suite directory (or a single task directory)")
      .requiredOption("--agent <agent>", "'oracle', a JSON file holding an agent spec, or inline agent JSON")
      .addOption(new Option("--repeat <n>", "rollouts per task").default(1).argParser(positiveInt))
      .option("--task <id...>", "only these task ids (repeatable)")
      .addOption(
        new Option(
          "--rerun <results.jsonl>",
          "submit again the masked rollouts of this results file (each with its task, from --suite, and its metadata)",
        ).conflicts("repeat"),
      )
      .addOption(
        new Option("--deadline <seconds>", "whole-rollout deadline in seconds").argParser(durationSeconds),
      )
      .option("--metadata <json>", "JSON object echoed into every result (plus the repeat index)")
      .option("--wait", "follow progress until every rollout is finished, then summarise")
      .option("--out <file>", "with --wait: write the results as JSONL to this file")
      .option("--json", "with --wait: print the summary as one JSON object")
      .addOption(
        new Option("--max-request-bytes <n>", "largest POST body; bigger submissions go as several batches")
          .default(DEFAULT_MAX_REQUEST_BYTES)
          .argParser(positiveInt),
      )
      .addOption(
        new Option(
          "--max-task-bytes <n>",
          "largest task the suite may hold, as the dispatcher's FLEET_MAX_TASK_BYTES (which still decides)",
        )
          .default(DEFAULT_MAX_TASK_BYTES)
          .argParser(positiveInt),
      )
      .option(
        "--inline-tasks",
        "send the full task in every row instead of a digest after its first chunk",
        false,
      )
      .addOption(
        new Option("--poll-interval <ms>", "with --wait: status poll interval")
          .default(1000)
          .argParser(pollIntervalMs),
      )
      .addOption(
        new Option(
          "--backlog-wait <seconds>",
          "while the fleet's backlog is full, keep offering the rest this long",
        )
          .default(1800)
          .argParser(positiveInt),
      )
      .addOption(
        new Option(
          "--outage-wait <seconds>",
          "with --wait: keep submitting and waiting through a dispatcher outage (unreachable, 429/502/503/504) this long",
        )
          .default(600)
          .argParser(positiveSeconds),
      )
      .addOption(
        new Option(
          "--wait-timeout <seconds>",
          "with --wait: stop waiting after this long, exit 1 (the batches keep running); default: until they finish",
        ).argParser(positiveSeconds),
      )
      .addOption(
        new Option(
          "--idempotency-key <base>",
          "derive each chunk's Idempotency-Key from this (<base>-<n>); re-run with the base a failed submit printed to finish it without duplicates",
        ).argParser(idempotencyBase),
      )
      .addHelpText(
        "after",
        `
Examples:
  fleet submit --suite packages/tasks/suites/example --agent oracle --wait --out results.jsonl
  fleet submit --suite ./suite --agent agent.json --repeat 8 --task hello-file --task sum-answer
  fleet submit --suite ./suite --agent '{"harness":"command","argv":["sh","-c","echo 42"]}'
  fleet submit --suite ./suite --agent agent.json --rerun results.jsonl --wait --out rerun.jsonl

If a chunk's POST fails in a way that may have admitted it (5xx, timeout), the error names its
Idempotency-Key and the base to re-run with: --idempotency-key <base>.

Exit status: 0 when submitted (with --wait: when every rollout is finished, even if some
failed); 1 on an API error, an --out file that cannot be written, or (with --wait) fewer
results than rollouts or batches not finished after --wait-timeout; 2 on bad usage; 130 when
interrupted (143 by a SIGTERM; the batch keeps running).`,
      ),
    ctx,
  ).action(async (opts: Parameters<typeof submitCommand>[1] & ConnectionOptions, cmd: Command) => {
    // What only --wait uses, given without it: said, not ignored (a submit without --wait fails
    // fast on an outage and polls nothing), as --out, --json and --wait-timeout are.
    for (const [name, flag] of [
      ["pollInterval", "--poll-interval"],
      ["outageWait", "--outage-wait"],
    ] as const) {
      if (!opts.wait && cmd.getOptionValueSource(name) === "cli") {
        throw new UsageError(
          `${flag} needs --wait (without it, a submit polls nothing and fails fast on an outage)`,
        );
      }
    }
    setInterruptedNote(interruptedNote("submit"));
    setExitCode(
      await submitCommand(clientFor(opts, ctx), opts, ctx, (ids) =>
        setInterruptedNote(interruptedNote("submit", ids)),
      ),
    );
  });

  withConnection(
    program
      .command("status")
      .description("Show a batch's progress: rollouts by status, and how many are done")
      .argument("<batchId>", "batch id printed by `fleet submit`")
      .option("--json", "print the API's JSON"),
    ctx,
  ).action(async (batchId: string, opts: { json?: boolean } & ConnectionOptions) => {
    setInterruptedNote(interruptedNote("status", [batchId]));
    setExitCode(await statusCommand(clientFor(opts, ctx), batchId, opts, ctx));
  });

  withConnection(
    program
      .command("watch")
      .description(
        "Follow batches already submitted to the end (progress bar), then summarise; --out writes their results",
      )
      .argument("<batchId...>", "batch ids printed by `fleet submit`")
      .option("--out <file>", "write the results as JSONL to this file")
      .option("--json", "print the summary as one JSON object")
      .addOption(
        new Option("--poll-interval <ms>", "status poll interval").default(1000).argParser(pollIntervalMs),
      )
      .addOption(
        new Option(
          "--outage-wait <seconds>",
          "keep waiting through a dispatcher outage (unreachable, 429/502/503/504) this long",
        )
          .default(600)
          .argParser(positiveSeconds),
      )
      .addOption(
        new Option(
          "--wait-timeout <seconds>",
          "stop waiting after this long, exit 1 (the batches keep running); default: until they finish",
        ).argParser(positiveSeconds),
      ),
    ctx,
  ).action(async (batchIds: string[], opts: FollowOptions & ConnectionOptions) => {
    setInterruptedNote(interruptedNote("watch", [...new Set(batchIds)]));
    setExitCode(await watchCommand(clientFor(opts, ctx), batchIds, opts, ctx));
  });

  withConnection(
    program
      .command("results")
      .description("Write a batch's finished results as JSONL (stdout, or --out)")
      .argument("<batchId>", "batch id printed by `fleet submit`")
      .option("--out <file>", "write to this file instead of stdout"),
    ctx,
  ).action(async (batchId: string, opts: { out?: string } & ConnectionOptions) => {
    setInterruptedNote(interruptedNote("results", [batchId]));
    setExitCode(await resultsCommand(clientFor(opts, ctx), batchId, opts, ctx));
  });

  withConnection(
    program
      .command("trajectory")
      .description("Show what a rollout's agent did: its output, answer, transcript (tool-loop) and usage")
      .argument("<rolloutId>", "rollout id (the `id` of a result line: `fleet results`, `--out`)")
      .option("--json", "print the API's JSON"),
    ctx,
  ).action(async (rolloutId: string, opts: { json?: boolean } & ConnectionOptions) => {
    setInterruptedNote(interruptedNote("trajectory", [rolloutId]));
    setExitCode(await trajectoryCommand(clientFor(opts, ctx), rolloutId, opts, ctx));
  });

  withConnection(
    program
      .command("cancel")
      .description("Cancel a rollout, or every unfinished rollout of a batch")
      .argument("<id>", "rollout id or batch id (tried in that order)"),
    ctx,
  ).action(async (id: string, opts: ConnectionOptions) => {
    setInterruptedNote(interruptedNote("cancel", [id]));
    setExitCode(await cancelCommand(clientFor(opts, ctx), id, ctx));
  });

  return program;
}

/** The global options that take a value (`fleet --url <url> <command> ...`). */
const GLOBAL_VALUE_OPTIONS = new Set(["--url", "--token"]);

/**
 * The command `argv` names (without the node and script paths): its first word that is no option
 * nor a global option's value (`fleet --url http://h:8080 results b-1` → `results`).
 */
export function commandName(argv: readonly string[]): string | undefined {
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (GLOBAL_VALUE_OPTIONS.has(arg)) i++;
    else if (!arg.startsWith("-")) return arg;
  }
  return undefined;
}

/** Run `fleet` with `argv` (without the node and script paths); resolves to the exit code. */
export async function runCli(argv: readonly string[], ctx: CliContext): Promise<number> {
  let exitCode: number = EXIT.ok;
  let interrupted = interruptedNote("");
  const program = createProgram(
    ctx,
    (code) => {
      exitCode = code;
    },
    (note) => {
      interrupted = note;
    },
  );
  try {
    await program.parseAsync([...argv], { from: "user" });
    return exitCode;
  } catch (err) {
    return reportError(err, ctx, interrupted);
  }
}

function reportError(err: unknown, ctx: CliContext, interrupted: string): number {
  if (err instanceof CommanderError) {
    // Commander already printed the help, version or usage error.
    return err.code === "commander.helpDisplayed" || err.code === "commander.version" ? EXIT.ok : EXIT.usage;
  }
  if (ctx.signal.aborted) {
    ctx.stderr.write(`${interrupted}\n`);
    return EXIT.interrupted;
  }
  if (err instanceof UsageError) {
    ctx.stderr.write(`error: ${err.message}\n`);
    return EXIT.usage;
  }
  if (err instanceof OutputError) {
    ctx.stderr.write(`error: ${err.message}\n`);
    return EXIT.error;
  }
  if (isApiError(err)) {
    const status = err.status === 0 ? "" : ` (HTTP ${err.status})`;
    ctx.stderr.write(`error: ${err.code}: ${err.message}${status}\n`);
    if (err.status === 401) {
      ctx.stderr.write(
        "  hint: set FLEET_TOKEN (or pass --token) to one of the dispatcher's FLEET_API_TOKENS\n",
      );
    }
    if (err.details !== null && err.details !== undefined) {
      const details = JSON.stringify(err.details);
      ctx.stderr.write(`  details: ${details.length > 2000 ? `${details.slice(0, 2000)}…` : details}\n`);
    }
    return EXIT.error;
  }
  ctx.stderr.write(`error: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
  return EXIT.error;
}
