import { setFlagsFromString } from "node:v8";
import { createContext, Script } from "node:vm";
import {
  capText,
  comparableAnswer,
  type ExecResult,
  FleetError,
  matchExpectedProblem,
  matchPattern,
  type VerifierSpec,
} from "@fleet/contracts";
import type { Verdict } from "./verdict.ts";

type MatchSpec = Extract<VerifierSpec, { kind: "match" }>;

/** How long one regex match may run before the answer counts as not matching. */
export const REGEX_TIMEOUT_MS = 1000;

// A match that backtracks past V8's bound (50,000 backtracks) goes on in V8's linear-time engine,
// where the pattern allows it (no backreference, no lookaround, no counted repetition over 16, in
// Node 20's V8): it then finishes, with the same answer. Without it, a pattern whose first
// alternative backtracks catastrophically runs out of its time before trying a later one that
// matches, and a correct answer scored 0; how far it got depended on the host's load. Set at
// load, before any pattern of a task is compiled.
setFlagsFromString("--enable-experimental-regexp-engine-on-excessive-backtracks");

/** The match, compiled once; each call sets `pattern` and `answer` in the one context. */
const MATCH = new Script("pattern.test(answer)");
const matchContext = createContext({ pattern: /$^/, answer: "" });

/**
 * Grade a final answer against `expected` (both `comparableAnswer`: NFC, LF line ends, trimmed
 * of white space and zero-width characters): `exact` compares them; `regex` requires the
 * pattern (trimmed too: a TOML multi-line string ends in a newline no trimmed answer could
 * match) to match the whole trimmed answer (`matchPattern`). A missing (`null`) answer scores 0,
 * and so does one kept cut (`answerTruncated`: over `MAX_ANSWER_CHARS`).
 *
 * @throws FleetError `invalid_task` (final) when `expected` cannot grade (`matchExpectedProblem`:
 * blank, not a valid regular expression, or a pattern an empty answer matches).
 */
export function matchAnswer(
  spec: MatchSpec,
  run: { answer: string | null; answerTruncated?: boolean; exec: ExecResult },
): Verdict {
  const problem = matchExpectedProblem(spec);
  if (problem !== undefined) throw FleetError.nonRetryable("invalid_task", `verifier expected ${problem}`);
  const answer = run.answer === null ? null : comparableAnswer(run.answer);
  let matched = false;
  let regexTimedOut = false;
  // Cut (longer than MAX_ANSWER_CHARS): what is kept is not the answer, and a verdict on a part
  // could go either way (a pattern its head fails that the whole meets, or the reverse): 0.
  const truncated = run.answerTruncated === true;
  if (answer !== null && !truncated) {
    if (spec.mode === "exact") {
      matched = answer === comparableAnswer(spec.expected);
    } else {
      const pattern = matchPattern(spec.expected);
      // The pattern is the task's, the answer the agent's: a pattern that backtracks
      // catastrophically on this answer must not freeze the worker. One the linear-time engine
      // cannot run (above) may still use the whole budget: past it, no match, as tests that hang
      // on the agent's work are graded (a mask would let a policy trade its wrong answers for
      // masks); `regexTimedOut` in the details says so.
      try {
        Object.assign(matchContext, { pattern, answer });
        matched = MATCH.runInContext(matchContext, { timeout: REGEX_TIMEOUT_MS }) as boolean;
      } catch (err) {
        if ((err as { code?: string }).code !== "ERR_SCRIPT_EXECUTION_TIMEOUT") throw err;
        regexTimedOut = true;
      }
    }
  }
  return {
    reward: matched ? 1 : 0,
    details: {
      kind: "match",
      source: "match",
      mode: spec.mode,
      matched,
      expected: capText(spec.expected, 500),
      answer: answer === null ? null : capText(answer, 1000),
      ...(regexTimedOut ? { regexTimedOut: true } : {}),
      ...(truncated ? { answerTruncated: true } : {}),
      agentExitCode: run.exec.exitCode,
      agentTimedOut: run.exec.timedOut,
    },
  };
}
