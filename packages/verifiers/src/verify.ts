import { randomBytes } from "node:crypto";
import { capText, endedBySignal, FleetError, fileModes, isFleetError, tailWithin } from "@fleet/contracts";
import {
  AGENT_UID,
  AGENT_USER,
  fenceCheck,
  OPS_CWD,
  OPS_ENV,
  ROOT_USER,
  SANDBOX_PATHS,
  scrubScratch,
  TestsSupersededError,
} from "@fleet/sandbox";
import { matchAnswer } from "./match.ts";
import { MAX_REWARD_FILE_BYTES, parseReward, parseRewardJson } from "./reward-file.ts";
import type { Verdict, VerifyContext } from "./verdict.ts";

/** The verifier's own log directory, cleared before every verification. */
const VERIFIER_LOGS = `${SANDBOX_PATHS.logs}/verifier`;
/** Where tests may leave a reward (a number in [0, 1]) that wins over their exit status. */
export const REWARD_FILE = `${VERIFIER_LOGS}/reward.txt`;
/**
 * The tests' runner's mark that it starts the tests in this sandbox: a later attempt's runner
 * that finds it (root's regular file: never the agent's, which cannot make one) runs nothing. A
 * dot file, so that tests that clear /logs the usual way (`rm -rf /logs/*`) leave it.
 */
export const TESTS_STARTED_MARK = `${SANDBOX_PATHS.logs}/.fleet-tests-started`;

/**
 * Why a verify is masked when an earlier attempt's runner started the tests in its sandbox
 * (`TESTS_STARTED_MARK`): they ran, and were cut short before a verdict was stored (a worker
 * stopped or died under them, the provider failed, Redis refused the verdict). What they changed
 * there (/tmp, /logs, the workspace) stays, and tests run again would grade another sandbox than
 * the one the agent left: a rolling restart graded a reference solution 0. Never graded (rule 6).
 */
export const TESTS_CUT_SHORT =
  "an earlier verify attempt's tests ran in this sandbox and were cut short before their verdict was stored (a worker stopped or died under them, the sandbox provider failed, Redis refused the verdict): what they changed there stays, so they are not run again on it";
/**
 * Harbor's other reward file, read when there is no `REWARD_FILE`: a JSON object whose `reward`
 * is a number in [0, 1] (its other numeric fields are kept in the verdict's details).
 */
export const REWARD_JSON_FILE = `${VERIFIER_LOGS}/reward.json`;
/** Cap for each of the stdout/stderr tails kept in verdict details (characters). */
export const MAX_DETAIL_CHARS = 2000;
/** Reward files up to this size come back with the tests' exec; a larger one is read on its own. */
const INLINE_REWARD_BYTES = 1024;

/**
 * Grade one run. `tests`: stage the task's tests at /tests and run /tests/test.sh as root (no
 * capabilities) in /workspace (or / when the agent made it unenterable), by the interpreter its
 * `#!` line names (with its option), else with bash; the reward file (`reward.txt`, else
 * `reward.json`) wins, else exit 0 → 1.0, non-zero → 0.0.
 * `match`: compare the answer (exact, trimmed; or regex, full match); no answer → 0.
 *
 * Tests that time out or are killed for memory grade the agent's work as the tests left it (0
 * unless a reward file says otherwise; `details.source` "timeout" for a timeout).
 *
 * @throws FleetError `verifier_error` (masked, never a zero) when the reward file is malformed or
 * the provider fails (retryable when the provider error was);
 * `deadline_exceeded` when the rollout's deadline leaves no time or cuts the tests short;
 * `invalid_task` for a task that cannot be graded (no tests/test.sh, bad regex).
 */
export async function verify(ctx: VerifyContext): Promise<Verdict> {
  const { verifier } = ctx.task;
  switch (verifier.kind) {
    case "match":
      return matchAnswer(verifier, ctx.run);
    case "tests":
      return runTests(ctx);
    default:
      return assertNever(verifier);
  }
}

function assertNever(x: never): never {
  throw new Error(`unhandled verifier kind: ${JSON.stringify(x)}`);
}

/**
 * The tests' exec, as root in /workspace (one exec for what took three). It reads a nonce from
 * stdin (never in argv or the environment, where the processes the tests start could read it),
 * and on the next line the verify attempt's epoch (`VerifyContext.fenceEpoch`; an empty line for
 * none). When the sandbox's verify fence (`VERIFY_FENCE_FILE`) holds a higher one, a later
 * attempt took the sandbox over: it reports `superseded <epoch>` and starts nothing. Else it:
 * 1. clears /logs/verifier and proves it gone: root has no CAP_FOWNER, so a directory the agent
 *    planted in the sticky, world-writable /logs cannot be removed, and grading on top of it
 *    could be gamed; if that fails, reports `prepare <why>` and stops; else writes `<nonce> ready`
 *    as the first line of stderr (the output cap keeps the head and the end: it is always seen);
 * 2. empties /solution (the oracle agent's reference solution: tests that lean on it would pass
 *    the oracle and fail every other agent), then runs /tests/test.sh (stdin /dev/null) as the
 *    kernel would run it as a program, by its `#!` line's interpreter and option (a
 *    `#!/bin/bash -e` keeps its `-e`, a `#!/usr/bin/env python3` test runs in Python), or with
 *    bash when it has none;
 * 3. reports the reward file, `reward.txt` or else `reward.json`: `none`, `reward <bytes> [json]`
 *    followed by its content (up to `INLINE_REWARD_BYTES`), `irregular [json]` (no regular file:
 *    a FIFO, a device), or `unreadable [json]` (too large, or not readable by root: read apart);
 * and exits with the tests' status. Reports go to stderr after the tests' own output, each as a
 * line `<nonce> <report>` after a newline; `parseRunReport` takes them off again. A runner that
 * never reported (the cap keeps the output's end, where the report is) is graded by its exit
 * status: the tests' processes, the agent's code among them, could have killed it and left a
 * reward behind.
 */
export const RUN_TESTS_SCRIPT = `# The runner's own commands (find, rm, stat, cat, wc) from the read-only root's directories, not
# the image's PATH, which may lead through a directory the agent writes (a venv in /workspace):
# run as root, an agent's \`cat\` would report its own reward. The tests get the image's PATH.
tests_path=$PATH; PATH=${OPS_ENV.PATH}; export PATH
IFS= read -r nonce && [ \${#nonce} -eq 32 ] || exit 4
report() { printf '\\n%s %s\\n' "$nonce" "$*" >&2; }
# Taken over: a later attempt raised the fence past this one's epoch before it swept the sandbox.
# Read before anything here touches the sandbox; a runner that read it before that sweep is one
# of the processes the sweep kills.
IFS= read -r epoch || epoch=
${fenceCheck("epoch", 'report superseded "$f"; exit 5')}
# This runner's start time and its own line (it and its parents), taken before the tests: what
# reap may never kill. Builtins only.
line=; read -r -d '' line 2>/dev/null < /proc/$$/stat; set -- \${line##*) }; mine=\${20:-0}
keep=" "; p=$$
while [ "$p" -gt 0 ] 2>/dev/null; do
  keep="$keep$p "
  line=; read -r -d '' line 2>/dev/null < /proc/$p/stat; [ -n "$line" ] || break
  set -- \${line##*) }; p=\${2:-0}
done
# Kill what the tests left running (started since this runner, so never the sandbox's own
# processes; not this runner nor its parents), in rounds until a round finds none new, counting
# each stray once. One already dying is no stray: exiting (PF_EXITING), or with a SIGKILL pending
# (which a fatal signal the tests sent and did not wait for, a "kill $server", becomes at once): it
# can run none of its own code again.
strays=0; seen=" "
reap() {
  local line p f n round l v dying
  [ "$mine" -gt 0 ] 2>/dev/null || return 0 # no start time of its own: nothing is safe to kill
  for round in 1 2 3 4 5 6 7 8 9 10; do
    n=0
    for f in /proc/[0-9]*/stat; do
      p=\${f#/proc/}; p=\${p%/stat}
      case "$keep$seen" in *" $p "*) continue ;; esac
      line=; read -r -d '' line 2>/dev/null < "$f"; [ -n "$line" ] || continue
      set -- \${line##*) }
      [ "$1" = Z ] && continue
      [ "\${20:-0}" -lt "$mine" ] 2>/dev/null && continue
      dying=0
      case "$7" in *[!0-9]* | "") ;; *) [ $(($7 & 4)) -ne 0 ] && dying=1 ;; esac
      while [ "$dying" = 0 ] && IFS= read -r l; do
        case "$l" in
          SigPnd:* | ShdPnd:*) v=\${l##*[[:space:]]}
            case "$v" in *[!0-9a-fA-F]* | "") ;; *) [ $((0x$v & 256)) -ne 0 ] && dying=1 ;; esac ;;
        esac
      done 2>/dev/null < "/proc/$p/status"
      kill -9 "$p" 2>/dev/null || continue
      [ "$dying" = 1 ] && continue
      seen="$seen$p "; n=$((n + 1))
    done
    strays=$((strays + n))
    [ "$n" -eq 0 ] && break
  done
}
# Tests an earlier attempt's runner started here (its mark, below: a regular file of root's, which
# the agent cannot make): what they changed in the sandbox stays, and tests run again on it would
# grade another sandbox than the agent left. Nothing runs. (Checked first: what those tests left
# in /logs, a directory root cannot search, would fail the scan for the agent's files below.)
m=${TESTS_STARTED_MARK}
if [ -f "$m" ] && [ ! -L "$m" ] && [ -O "$m" ]; then report rerun; exit 6; fi
# Nothing of the agent's may be left in /logs, the tmpfs the reward is written to: an agent that
# filled it (its space, or its inodes but one) would decide whether the tests' reward lands.
# Root has no capability to remove it (the sticky /logs): the agent's uid does, then this again.
if ! a=$(find ${SANDBOX_PATHS.logs} -mindepth 1 -user ${AGENT_UID} -prune 2>&1) || [ -n "$a" ]; then
  report prepare "the agent left files in ${SANDBOX_PATHS.logs}"; exit 3
fi
d=${VERIFIER_LOGS}
rm -rf "$d" 2>/dev/null
if [ -e "$d" ] || [ -L "$d" ]; then
  report prepare "cannot clear $d (owned by uid $(stat -c %u "$d"))"; exit 3
fi
mkdir -p "$d" || { report prepare "cannot create $d"; exit 3; }
rm -rf "$m" 2>/dev/null
: > "$m" || { report prepare "cannot mark the tests started ($m)"; exit 3; }
printf '%s ready\\n' "$nonce" >&2
s=${SANDBOX_PATHS.solution}
[ -d "$s" ] && rm -rf "$s"/* "$s"/.[!.]* "$s"/..?* 2>/dev/null
# The tests start in the workspace. The runner itself starts in / (root here has no capability to
# enter an agent's 0700 workspace): a workspace the agent made unenterable gets its tests run from
# /, and graded, not a runner that could not start (a mask the agent chose).
cd ${SANDBOX_PATHS.workspace} 2>/dev/null
t=${SANDBOX_PATHS.tests}/test.sh
first=; IFS= read -r first < "$t"
case "$first" in
  '#!'*)
    # The kernel's reading of a #! line: the interpreter, then the rest as one argument.
    line=\${first#??}; line=\${line#"\${line%%[![:space:]]*}"}
    interp=\${line%%[[:space:]]*}; arg=\${line#"$interp"}
    arg=\${arg#"\${arg%%[![:space:]]*}"}; arg=\${arg%"\${arg##*[![:space:]]}"}
    # An interpreter the image does not have (#!/usr/bin/env python3 without python), or a
    # directory (which -x passes): the task's image, not the agent's work, so never a 0 for every agent.
    if [ -n "$interp" ] && { [ ! -x "$interp" ] || [ -d "$interp" ]; }; then report interpreter "$interp"; exit 3; fi
    if [ "\${interp##*/}" = env ]; then
      prog=\${arg#-S}; prog=\${prog#"\${prog%%[![:space:]]*}"}; prog=\${prog%%[[:space:]]*}
      case "$prog" in
        "" | -* | *=*) ;;
        *) PATH=$tests_path command -v "$prog" > /dev/null 2>&1 || { report interpreter "$prog"; exit 3; } ;;
      esac
    fi
    if [ -z "$interp" ]; then PATH=$tests_path /bin/bash "$t"
    elif [ -n "$arg" ]; then PATH=$tests_path "$interp" "$arg" "$t"
    else PATH=$tests_path "$interp" "$t"
    fi < /dev/null ;;
  *) PATH=$tests_path /bin/bash "$t" < /dev/null ;;
esac
rc=$?
# Kill and count what the tests left running. (What ended before the tests did is not seen, nor
# what exits in the moments reap takes to find it: tests that run the agent's code reap before
# they write their reward, as the example suite's do. No freeze of every process first: under
# bubblewrap a SIGSTOP to all the runner may signal stops the exec's own plumbing.)
reap
# Processes the tests started were still running when the tests ended: any of them, the agent's
# code among them (root too), may have written the reward file.
if [ "$strays" -gt 0 ]; then report strays "$strays"; exit $rc; fi
f=${REWARD_FILE}; kind=
if [ ! -e "$f" ] || [ -d "$f" ]; then f=${REWARD_JSON_FILE}; kind=json; fi
if [ ! -e "$f" ] || [ -d "$f" ]; then report none
elif [ ! -f "$f" ]; then report irregular $kind
elif [ -r "$f" ] && n=$(wc -c < "$f") && n=$((n)) && [ "$n" -le ${INLINE_REWARD_BYTES} ]; then
  report reward "$n" $kind; cat "$f" >&2
else report unreadable $kind
fi
exit $rc`;

/**
 * No startup files (a shell whose stdin is a socket, as bubblewrap's, would read ~/.bashrc and
 * could print before the ready line or change what the tests see).
 */
export const RUN_TESTS_ARGV = ["/bin/bash", "--norc", "--noprofile", "-c", RUN_TESTS_SCRIPT, "fleet-verify"];

/** What the tests' exec reported after the tests ran (see `RUN_TESTS_SCRIPT`). */
export type RunReport =
  | { kind: "prepare"; reason: string }
  | { kind: "none" }
  /** The reward file's content; `json`: it is `reward.json` (there was no `reward.txt`). */
  | { kind: "reward"; text: string; json: boolean }
  /** Processes the tests started were still running when they ended (`count` of them, killed). */
  | { kind: "strays"; count: number }
  /** test.sh's `#!` interpreter is not in the image (`name`): nothing ran. */
  | { kind: "interpreter"; name: string }
  /** No regular file (a FIFO, a device, a link to one): nothing to read (`json`: reward.json). */
  | { kind: "irregular"; json: boolean }
  /** A later verify attempt took the sandbox over (its fence holds `epoch`): nothing started. */
  | { kind: "superseded"; epoch: number }
  /** An earlier attempt's runner started the tests in this sandbox (`TESTS_STARTED_MARK`): nothing started. */
  | { kind: "rerun" }
  /** Unreadable, too large, or its size does not match: read the file (`json`: reward.json) apart. */
  | { kind: "read"; json: boolean }
  /**
   * No report line at all: the runner was killed before it reported (graded by the exit status),
   * or something wrote past its report (the output cap keeps the end, where it is: graded 0, as
   * for strays).
   */
  | { kind: "missing" };

/**
 * Split the tests' stderr into their own output and the script's lines. `ready`: the line
 * `<nonce> ready` (first of the script's own, so near the head the output cap keeps; a shell
 * warning may come before it) proves /logs/verifier was cleared and the tests started; without it
 * nothing may be graded. The report is the last `\n<nonce> ` line (`missing` without one); when
 * the inline reward's size does not match, the reward file is read apart.
 */
export function parseRunReport(
  raw: string,
  nonce: string,
): { stderr: string; ready: boolean; report: RunReport } {
  const line = `${nonce} ready\n`;
  const after = raw.indexOf(`\n${line}`);
  const at = raw.startsWith(line) ? 0 : after < 0 ? -1 : after + 1;
  const ready = at >= 0;
  const rest = ready ? raw.slice(0, at) + raw.slice(at + line.length) : raw;
  const { stderr, report } = lastReport(rest, nonce);
  return { stderr, ready, report };
}

function lastReport(stderr: string, nonce: string): { stderr: string; report: RunReport } {
  const at = stderr.lastIndexOf(`\n${nonce} `);
  if (at < 0) return { stderr, report: { kind: "missing" } };
  const own = stderr.slice(0, at);
  const rest = stderr.slice(at + nonce.length + 2);
  const eol = rest.indexOf("\n");
  const line = eol < 0 ? rest : rest.slice(0, eol);
  const body = eol < 0 ? "" : rest.slice(eol + 1);
  const [kind = "", ...words] = line.split(" ");
  switch (kind) {
    case "prepare":
      return { stderr: own, report: { kind: "prepare", reason: words.join(" ") } };
    case "none":
      return { stderr: own, report: { kind: "none" } };
    case "superseded":
      return { stderr: own, report: { kind: "superseded", epoch: Number(words[0]) || 0 } };
    case "rerun":
      return { stderr: own, report: { kind: "rerun" } };
    case "strays":
      return { stderr: own, report: { kind: "strays", count: Number(words[0]) || 1 } };
    case "interpreter":
      return { stderr: own, report: { kind: "interpreter", name: words.join(" ") } };
    case "irregular":
      return { stderr: own, report: { kind: "irregular", json: words[0] === "json" } };
    case "reward": {
      const json = words[1] === "json";
      return {
        stderr: own,
        report:
          Buffer.byteLength(body) === Number(words[0])
            ? { kind: "reward", text: body, json }
            : { kind: "read", json },
      };
    }
    default:
      return { stderr: own, report: { kind: "read", json: words[0] === "json" } };
  }
}

async function runTests(ctx: VerifyContext): Promise<Verdict> {
  const { provider, handle, task } = ctx;
  if (task.tests["test.sh"] === undefined) {
    throw FleetError.nonRetryable("invalid_task", `task "${task.id}" has no tests/test.sh to verify with`);
  }
  const ownMs = task.timeouts.verifierS * 1000;
  const leftAt = (at: number) =>
    ctx.deadlineMs === undefined ? Number.POSITIVE_INFINITY : ctx.deadlineMs - at;
  if (leftAt(Date.now()) <= 0)
    throw new FleetError("deadline_exceeded", "the rollout deadline passed before verification");

  // Exactly the task's tests: whatever a previous attempt left in /tests goes in the same step.
  await ctx.onSandboxWork?.("stage");
  try {
    await step(ctx, "stage the tests", () =>
      provider.put(handle, SANDBOX_PATHS.tests, task.tests, {
        user: ROOT_USER,
        modes: fileModes(task, "tests"),
        replace: true,
        ...(ctx.fenceEpoch !== undefined ? { fenceEpoch: ctx.fenceEpoch } : {}),
      }),
    );
  } catch (err) {
    if (!ctx.signal?.aborted) await ctx.onStagingFailed?.().catch(() => undefined);
    throw err;
  }
  // The tests' budget (`timeouts.verifierS`) is theirs from here: copying them in (many files,
  // on a loaded host) takes none of it.
  // (Started again after a scrub of the agent's leftovers in /logs: its time, as the copying's,
  // is none of the tests'; thousands of mode-000 directories took it all, and the runner's second
  // start found no time left.)
  let leftMs = 0;
  let cutByRollout = false;
  let endsAt = 0;
  const startBudget = () => {
    const started = Date.now();
    leftMs = leftAt(started);
    if (leftMs <= 0)
      throw new FleetError("deadline_exceeded", "the rollout deadline passed before the tests started");
    cutByRollout = leftMs < ownMs;
    endsAt = started + Math.min(ownMs, leftMs);
  };
  startBudget();
  const remaining = (): number => Math.max(1, Math.floor(endsAt - Date.now()));
  const runOnce = async () => {
    const nonce = randomBytes(16).toString("hex");
    await ctx.onSandboxWork?.("tests");
    const ran = await step(ctx, "run the tests", () =>
      provider.exec(handle, RUN_TESTS_ARGV, {
        deadlineMs: remaining(),
        // The runner enters the workspace itself (see RUN_TESTS_SCRIPT).
        cwd: OPS_CWD,
        user: ROOT_USER,
        stdin: `${nonce}\n${ctx.fenceEpoch ?? ""}\n`,
      }),
    );
    const parsed = parseRunReport(ran.stderr, nonce);
    if (!parsed.ready && parsed.report.kind === "superseded") {
      throw new TestsSupersededError(parsed.report.epoch, ctx.fenceEpoch ?? 0);
    }
    if (!parsed.ready && parsed.report.kind === "rerun") {
      throw FleetError.nonRetryable("verifier_error", TESTS_CUT_SHORT);
    }
    return { ran, ...parsed };
  };
  let { ran, stderr, ready, report } = await runOnce();
  if (!ready && !ran.timedOut && report.kind === "prepare") {
    // Root here cannot remove what the agent left in the sticky /logs (a planted
    // /logs/verifier, a /logs filled up): the agent's uid can. Its processes are confirmed
    // gone, so everything of its uid there is leftovers: removed, then the tests run once
    // more. An agent cannot choose to be masked, nor to pass, this way. (Its files elsewhere in
    // scratch, /tmp, stay: tests may look at what it left there.)
    await step(ctx, "clear the agent's files from /logs", () =>
      scrubScratch(provider, handle, AGENT_USER, [SANDBOX_PATHS.logs]),
    );
    startBudget();
    ({ ran, stderr, ready, report } = await runOnce());
  }
  const result = { ...ran, stderr };
  if (!ready && result.timedOut && !cutByRollout) {
    // Out of time before the tests even started (the runner never read its nonce, or never got
    // /logs/verifier clean): nothing of the agent's was judged, so nothing is graded.
    throw FleetError.retryable(
      "verifier_error",
      capText(
        `the tests' runner did not start within the tests' ${Math.round(ownMs / 1000)} s (its start shares the tests' budget: [verifier] timeout_sec)${stderr.trim() ? `: ${stderr.trim()}` : ""}`,
        600,
      ),
    );
  }
  if (!ready && ran.exitCode === 127) {
    // Not found: the image has no bash (which runs the runner, as it runs solve.sh and the
    // tool-loop's commands). Nothing a retry fixes: the task's image.
    throw FleetError.nonRetryable(
      "invalid_task",
      capText(
        `the sandbox image cannot run the tests' runner (exit 127; the fleet runs it, and solve.sh, with bash): ${stderr.trim()}`,
        600,
      ),
    );
  }
  if (!ready && !result.timedOut) {
    // /logs/verifier still not clean after the agent's leftovers went: final; a runner that never
    // said it started (its stdin lost, say) may do better on a retry, and is masked once the
    // attempts run out.
    if (report.kind === "prepare") {
      throw FleetError.nonRetryable(
        "verifier_error",
        capText(`could not prepare a clean /logs/verifier: ${report.reason}`, 600),
      );
    }
    throw FleetError.retryable(
      "verifier_error",
      capText(`the tests' runner did not start (exit ${ran.exitCode}): ${stderr.trim()}`, 600),
    );
  }

  if (report.kind === "interpreter") {
    throw FleetError.nonRetryable(
      "invalid_task",
      capText(
        `tests/test.sh's #! line names ${report.name}, which the sandbox image does not have: install it in the image, or drop the #! line (bash runs it then)`,
        600,
      ),
    );
  }
  const details: Record<string, unknown> = {
    kind: "tests",
    exitCode: result.exitCode,
    timedOut: result.timedOut,
    durationMs: result.durationMs,
    stdoutTail: capTail(result.stdout),
    stderrTail: capTail(result.stderr),
    agentExitCode: ctx.run.exec.exitCode,
  };
  if (result.timedOut) {
    const limit = Math.round(Math.min(ownMs, leftMs) / 1000);
    if (cutByRollout) {
      throw new FleetError("deadline_exceeded", `the rollout deadline cut the tests short after ${limit} s`);
    }
    // Tests run the agent's work: code that hangs them is the agent's failure, graded 0 as the
    // tests would grade code that fails them (Terminal-Bench and SWE-bench count a timeout as
    // unresolved). Masking it would drop exactly those rollouts from training, so a policy would
    // lose nothing by making its failures hang. Tests too slow for their own budget show up as
    // 0 for the reference solution too: validate a suite with the oracle agent.
    return {
      reward: 0,
      details: { ...details, source: "timeout", reason: `the tests did not finish within ${limit} s` },
    };
  }
  // Killed for memory: the tests' own verdict stands (a killed test fails), as for a timeout.
  // What ran out of memory runs the agent's work (its code under test, or what it left in the
  // sandbox), and masking it would let a policy trade its failures for masks; an OOM-kill count
  // also only grows, so it cannot even tell the tests' OOM from one the agent caused earlier.
  // Tests too big for the sandbox's memory show up as 0 for the oracle agent too.
  if (result.oomKilled) details.oomKilled = true;

  // Processes the tests started outlived them: the agent's code runs in the tests as root, and
  // what it started may have written the reward file at any time until the runner killed it, the
  // moment the tests ended included. Neither the file nor the exit status (which a test script
  // that writes its reward last leaves at 0) is the tests' verdict then: graded 0, never masked
  // (a mask would be the agent's to take). Tests of a task must wait for what they start: the
  // oracle agent's 0 shows a suite whose tests do not.
  if (report.kind === "strays") {
    return {
      reward: 0,
      details: {
        ...details,
        source: "stray_processes",
        strays: report.count,
        reason: `${report.count} process(es) the tests started were still running when the tests ended (killed); the reward file is not trusted`,
      },
    };
  }
  // Tests or runner killed by a signal (exit 128 + n), or a runner that never reported: something
  // the tests ran killed them (the agent's code runs as root too), after it may have written the
  // reward file. The report is printed last and the output cap keeps the output's end, so a
  // flood never hides it (one missing from a cut output: below). That file is then not the
  // tests' verdict: the exit status is (a killed test failed).
  const killed = endedBySignal(ran.exitCode);
  if (!killed && report.kind === "missing" && ran.stderrTruncated) {
    // The runner reported last and the cap keeps the output's end: a report cut away means
    // something wrote past it, i.e. processes the tests started outlived them and the runner's
    // reap. As for strays: neither the reward file nor the exit status (a test script that writes
    // its reward last exits 0 whatever it found) is the tests' verdict. Graded 0, never masked.
    return {
      reward: 0,
      details: {
        ...details,
        source: "stray_processes",
        reason:
          "something wrote past the runner's report (its output was cut there): processes the tests started outlived them; neither the reward file nor the exit status is trusted",
      },
    };
  }
  if (killed || report.kind === "missing") {
    return {
      reward: result.exitCode === 0 ? 1 : 0,
      details: {
        ...details,
        source: "exit_code",
        reason: killed
          ? `the tests ended with a signal's status (exit ${ran.exitCode}: killed by signal ${ran.exitCode - 128}, or a command of theirs that was, as \`wait\` on a killed server returns); a reward file is not trusted`
          : "the tests' runner was killed before it reported; the reward file is not trusted",
      },
    };
  }
  // A reward file that is no regular file (a FIFO would block its reader, /dev/zero never end):
  // no reward to read. Beside tests that failed, the exit status grades, as for one no one may
  // read; tests that passed and left it mask.
  if (report.kind === "irregular") {
    const what = `the tests left ${report.json ? "reward.json" : "reward.txt"} as no regular file (a FIFO, a device, or a link to one)`;
    if (result.exitCode === 0) throw FleetError.nonRetryable("verifier_error", `${what}: no reward to read`);
    return {
      reward: 0,
      details: { ...details, source: "exit_code", reason: `${what}; the exit status grades` },
    };
  }
  let rewardText: string | null;
  const json = (report.kind === "reward" || report.kind === "read") && report.json;
  try {
    rewardText =
      report.kind === "reward"
        ? report.text
        : report.kind === "none"
          ? null
          : await step(ctx, "read the reward file", () =>
              // One byte past the most a reward file may hold: a longer one is refused whole, not
              // graded by its first bytes.
              provider.get(handle, json ? REWARD_JSON_FILE : REWARD_FILE, {
                maxBytes: MAX_REWARD_FILE_BYTES + 1,
              }),
            );
  } catch (err) {
    // A reward file no one may read (not the provider failing to read it): beside tests that
    // failed, as one that is no number below (the agent's code under test may have made it so).
    if (result.exitCode === 0 || !unreadableFile(err)) throw err;
    return {
      reward: 0,
      details: {
        ...details,
        source: "exit_code",
        reason: "the tests failed and left a reward file that cannot be read; the exit status grades",
      },
    };
  }
  if (rewardText !== null) {
    let reward: number;
    let fields: Record<string, number> | undefined;
    try {
      if (json) ({ reward, fields } = parseRewardJson(rewardText));
      else reward = parseReward(rewardText);
    } catch (err) {
      // Tests that failed, and a reward file that is no number: the tests' agent code (root
      // too) may have written it, and a mask here would let a policy trade its failures for
      // masks. The exit status grades (a failed test is 0); a malformed reward beside tests
      // that passed is the grader's fault, masked.
      if (result.exitCode === 0) throw err;
      return {
        reward: 0,
        details: {
          ...details,
          source: "exit_code",
          reason: json
            ? "the tests failed and left a reward.json without a reward in [0, 1]; the exit status grades"
            : "the tests failed and left a reward file that is not a number in [0, 1]; the exit status grades",
          rewardText: capText(rewardText.trim(), 100),
          ...(json ? { rewardFile: "reward.json" } : {}),
        },
      };
    }
    return {
      reward,
      details: {
        ...details,
        source: "reward_file",
        rewardText: capText(rewardText.trim(), 100),
        ...(json ? { rewardFile: "reward.json", rewards: fields } : {}),
      },
    };
  }
  return { reward: result.exitCode === 0 ? 1 : 0, details: { ...details, source: "exit_code" } };
}

/** `step`'s error for a file that is there and that no one may read (the provider's `invalid_task`). */
function unreadableFile(err: unknown): boolean {
  return (
    isFleetError(err) &&
    err.kind === "verifier_error" &&
    isFleetError(err.cause) &&
    err.cause.kind === "invalid_task"
  );
}

/**
 * One provider call, under the abort signal. A provider failure keeps its kind (masked, retried
 * when retryable); anything else becomes `verifier_error` (masked), keeping the cause.
 */
async function step<T>(ctx: VerifyContext, what: string, call: () => Promise<T>): Promise<T> {
  const signal = ctx.signal;
  if (signal?.aborted) throw abortError(signal);
  try {
    const pending = call();
    if (signal === undefined) return await pending;
    pending.catch(() => {});
    return await new Promise<T>((resolve, reject) => {
      const onAbort = (): void => reject(abortError(signal));
      signal.addEventListener("abort", onAbort, { once: true });
      pending.then(resolve, reject).finally(() => signal.removeEventListener("abort", onAbort));
    });
  } catch (err) {
    if (signal?.aborted && err === signal.reason) throw err;
    // A later attempt took the sandbox over: no failure of this verification's, its own end.
    if (err instanceof TestsSupersededError) throw err;
    // The provider's own failures keep their kind: a daemon outage is `provider_unavailable`,
    // a vanished sandbox `sandbox_lost` (both masked), not a verifier crash.
    if (
      isFleetError(err) &&
      (err.kind === "cancelled" ||
        err.kind === "deadline_exceeded" ||
        err.kind === "provider_unavailable" ||
        err.kind === "sandbox_lost")
    ) {
      throw err;
    }
    const message = err instanceof Error ? err.message : String(err);
    throw new FleetError("verifier_error", `verifier failed to ${what}: ${message}`, {
      retryable: isFleetError(err) ? err.retryable : false,
      cause: err,
    });
  }
}

function abortError(signal: AbortSignal): FleetError {
  const reason: unknown = signal.reason;
  if (isFleetError(reason)) return reason;
  const why = reason instanceof Error ? reason.message : reason === undefined ? "aborted" : String(reason);
  return new FleetError("cancelled", `verification stopped: ${why}`, { cause: reason });
}

/**
 * The last `max` characters of `text`, marking the cut at the front; cut between characters
 * (`tailWithin`, shared with the harness's `capTail`), never between a surrogate pair's halves.
 */
export function capTail(text: string, max = MAX_DETAIL_CHARS): string {
  return tailWithin(text, max);
}
