export { PTRACE_SCOPE_FILE, testsTamperRisk } from "./host-check.ts";
export { matchAnswer } from "./match.ts";
export { parseReward } from "./reward-file.ts";
export type { Verdict, VerifyContext } from "./verdict.ts";
export {
  capTail,
  MAX_DETAIL_CHARS,
  REWARD_FILE,
  REWARD_JSON_FILE,
  RUN_TESTS_ARGV,
  TESTS_CUT_SHORT,
  TESTS_STARTED_MARK,
  verify,
} from "./verify.ts";
