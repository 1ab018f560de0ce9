import { FleetError } from "@fleet/contracts";
import { ReplyError } from "ioredis";
import { afterEach, describe, expect, it, vi } from "vitest";
import { RedisHoldError } from "./hand-back.ts";
import { bullmqFailureReason, freshErrors } from "./worker.ts";

describe("freshErrors", () => {
  afterEach(() => vi.useRealTimers());

  it("lets each distinct error through once per window: an outage's repeated error is one line, not one per reconnect", () => {
    vi.useFakeTimers();
    const fresh = freshErrors(30_000);
    expect(fresh("connect ECONNREFUSED")).toBe(true);
    for (let i = 0; i < 24; i++) expect(fresh("connect ECONNREFUSED")).toBe(false);
    expect(fresh("READONLY You can't write against a read only replica.")).toBe(true);
    expect(fresh("connect ECONNREFUSED")).toBe(true); // another came in between
    vi.advanceTimersByTime(29_999);
    expect(fresh("connect ECONNREFUSED")).toBe(false);
    vi.advanceTimersByTime(1);
    expect(fresh("connect ECONNREFUSED")).toBe(true);
  });
});

describe("bullmqFailureReason", () => {
  const refused = new ReplyError("OOM command not allowed when used memory > 'maxmemory'.");
  it.each([
    [
      "BullMQ's own failure",
      new Error("job stalled more than allowable limit"),
      /^the run job failed in BullMQ: job stalled more than allowable limit \(its workers kept dying on it\)$/,
    ],
    [
      "a hold whose move back failed, on the last attempt",
      new RedisHoldError(`the fleet's Redis cannot serve now: ${refused.message}`, { cause: refused }),
      /^the run job's last attempt was refused by the fleet's Redis and not held for it \(held 30 times already, or the move back failed\): the fleet's Redis cannot serve now: OOM /,
    ],
    [
      "a raw refusal (a begin's) whose move back failed",
      refused,
      /^the run job's last attempt was refused by the fleet's Redis and not held for it \(held 30 times already, or the move back failed\): OOM /,
    ],
    [
      "a plain error before the stage began",
      new Error("the begin broke"),
      /^the run job's last attempt failed before its stage began: the begin broke$/,
    ],
  ])("%s", (_what, err, expected) => {
    expect(bullmqFailureReason("run", err)).toMatch(expected);
  });

  it("never calls a final failure a refusal, whatever its words", () => {
    const finalErr = new FleetError("agent_error", "upstream said: Connection is closed.", {
      retryable: false,
    });
    expect(bullmqFailureReason("run", finalErr)).toMatch(/failed before its stage began/);
  });
});
