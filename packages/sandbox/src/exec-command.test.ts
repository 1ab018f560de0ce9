import { FleetError } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { deadlineArgv, envList, execOutcome, formatSeconds, parseNumericUser } from "./exec-command.ts";

/** Each of `calls` throws a final invalid_task FleetError whose message matches `message`. */
function expectFinalInvalidTask(calls: readonly (() => unknown)[], message?: RegExp | string): void {
  for (const bad of calls) {
    try {
      bad();
      expect.unreachable();
    } catch (e) {
      expect(e).toBeInstanceOf(FleetError);
      expect([(e as FleetError).kind, (e as FleetError).retryable]).toEqual(["invalid_task", false]);
      if (typeof message === "string") expect((e as FleetError).message).toContain(message);
      else if (message) expect((e as FleetError).message).toMatch(message);
    }
  }
}

describe("deadlineArgv", () => {
  it("wraps the command in timeout -k", () => {
    expect(deadlineArgv(["sh", "-c", "x"], 2500)).toEqual([
      "/usr/bin/timeout",
      "-k",
      "2",
      "2.5",
      "sh",
      "-c",
      "x",
    ]);
    expect(deadlineArgv(["true"], 60_000, 5)).toEqual(["/usr/bin/timeout", "-k", "5", "60", "true"]);
  });

  it("refuses an empty command and non-finite deadlines as final invalid_task", () => {
    for (const bad of [() => deadlineArgv([], 1000), () => deadlineArgv(["x"], Number.POSITIVE_INFINITY)]) {
      expect(bad).toThrow(FleetError);
      try {
        bad();
      } catch (e) {
        expect([(e as FleetError).kind, (e as FleetError).retryable]).toEqual(["invalid_task", false]);
      }
    }
    expect(() => deadlineArgv(["x"], 0)).toThrow(/positive/);
  });

  it("refuses a NUL byte in the command or its environment as a clear final error, not a crash", () => {
    expectFinalInvalidTask(
      [() => deadlineArgv(["sh", "-c", "echo a\0b"], 1000), () => envList({ A: "x\0y" })],
      "NUL",
    );
  });
});

describe("an argument or environment entry no exec can take", () => {
  it("is refused as a clear final error (over 128 KiB a string, E2BIG), not a spawn failure a provider masks: a command agent admitted before admission bounded its argv still reaches the exec", () => {
    const big = "x".repeat(128 * 1024);
    expectFinalInvalidTask(
      [() => deadlineArgv(["echo", big], 1000), () => envList({ A: big.slice(2) })],
      /131072 bytes/,
    );
    // At the bound, taken: 131,071 bytes and its NUL.
    const most = "z".repeat(128 * 1024 - 1);
    expect(deadlineArgv(["echo", most], 1000).at(-1)).toBe(most);
    expect(envList({ A: most.slice(2) })).toEqual([`A=${most.slice(2)}`]);
  });
});

describe("formatSeconds", () => {
  it("never rounds a deadline to 0 (which would disable it)", () => {
    expect(formatSeconds(0.2)).toBe("0.001");
    expect(formatSeconds(1)).toBe("0.001");
    expect(formatSeconds(1234)).toBe("1.234");
    expect(formatSeconds(3000)).toBe("3");
  });
});

describe("execOutcome", () => {
  it("maps timeout's codes at the deadline to -1 timedOut", () => {
    expect(execOutcome(124, 2050, 2000)).toEqual({ exitCode: -1, timedOut: true });
    expect(execOutcome(137, 4100, 2000)).toEqual({ exitCode: -1, timedOut: true });
  });

  it("keeps a command's own 124/137 before the deadline", () => {
    expect(execOutcome(124, 10, 2000)).toEqual({ exitCode: 124, timedOut: false });
    expect(execOutcome(137, 10, 2000)).toEqual({ exitCode: 137, timedOut: false });
    expect(execOutcome(3, 5000, 2000)).toEqual({ exitCode: 3, timedOut: false });
  });
});

describe("parseNumericUser / envList", () => {
  it("parses uid[:gid]", () => {
    expect(parseNumericUser("1000:1000")).toEqual({ uid: 1000, gid: 1000 });
    expect(parseNumericUser("0")).toEqual({ uid: 0, gid: 0 });
    expect(parseNumericUser("agent")).toBeNull();
  });

  it("formats env and refuses bad names", () => {
    expect(envList({ A: "1", B_2: "x=y" })).toEqual(["A=1", "B_2=x=y"]);
    expect(envList({})).toBeUndefined();
    expect(() => envList({ "A=B": "1" })).toThrow(/invalid environment variable name/);
  });
});
