import type { RolloutTrajectory } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { formatTrajectory, printable } from "./trajectory.ts";

const run: NonNullable<RolloutTrajectory["run"]> = {
  exitCode: 0,
  timedOut: false,
  oomKilled: false,
  durationMs: 1234,
  stdout: "out line\n",
  stderr: "",
  stdoutTruncated: false,
  stderrTruncated: false,
  answer: null,
  transcript: null,
  usage: null,
  startedAt: 1,
  stoppedAt: 2,
  attempts: 1,
};
const base = { id: "r-1", status: "completed" as const, agent: "cmd", harness: "command" };

describe("formatTrajectory", () => {
  it("says no run is stored when there is none", () => {
    expect(formatTrajectory({ ...base, status: "masked", run: null })).toBe(
      "rollout r-1: masked, agent cmd (harness command)\n" +
        "no run stored: the agent has not finished its run, or the rollout ended before it did\n",
    );
  });

  it("heads each part, leaves out empty ones, and says what was cut and how the run ended", () => {
    const text = formatTrajectory({
      ...base,
      run: {
        ...run,
        exitCode: -1,
        timedOut: true,
        attempts: 2,
        stderr: "tail of a long stderr",
        stderrTruncated: true,
        answer: "42",
        transcript: '{"role":"user"}\n{"event":"stop"}',
        usage: {
          calls: 3,
          promptTokens: 10,
          completionTokens: null,
          cachedTokens: null,
          gaps: ["call 2 failed"],
        },
      },
    });
    expect(text).toBe(
      "rollout r-1: completed, agent cmd (harness command)\n" +
        "run: exit -1, in 1.2 s, 2 launches, killed at its deadline\n" +
        'answer: "42"\n' +
        "usage: 3 model calls, 10 prompt + ? completion tokens (gaps: call 2 failed)\n" +
        "--- stdout ---\nout line\n" +
        "--- stderr (its last part only) ---\ntail of a long stderr\n" +
        '--- transcript (JSON lines) ---\n{"role":"user"}\n{"event":"stop"}\n',
    );
  });

  it("shows what a terminal would act on escaped, in every part, and keeps newlines and tabs", () => {
    const text = formatTrajectory({
      ...base,
      agent: "a\u001b]0;pwned\u0007",
      run: {
        ...run,
        stdout: "ok\tdone\n\u001b[2J\u001b[1A\rhidden\u0008\n",
        stderr: "\u009b31m red\u202eevil\u2066",
        answer: "\u009b1m",
        transcript: '{"out":"\u001b[0m"}',
      },
    });
    expect(text).toBe(
      "rollout r-1: completed, agent a\\x1b]0;pwned\\x07 (harness command)\n" +
        "run: exit 0, in 1.2 s, 1 launch\n" +
        'answer: "\\x9b1m"\n' +
        "--- stdout ---\nok\tdone\n\\x1b[2J\\x1b[1A\\x0dhidden\\x08\n" +
        "--- stderr ---\n\\x9b31m red\\u202eevil\\u2066\n" +
        '--- transcript (JSON lines) ---\n{"out":"\\x1b[0m"}\n',
    );
    expect(printable("plain text, ünïcode ✓\n")).toBe("plain text, ünïcode ✓\n");
  });
});
