import { afterEach, describe, expect, it, vi } from "vitest";
import { freshErrors } from "./worker.ts";

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
