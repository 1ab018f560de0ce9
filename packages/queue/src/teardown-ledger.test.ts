import { describe, expect, it } from "vitest";
import { readRolloutSandboxes } from "./teardown-ledger.ts";
import { sandboxEntry } from "./testing/sandbox-entry.ts";

describe("readRolloutSandboxes", () => {
  it("reads a rollout's registry entries; one torn or of another shape is named unreadable, never thrown", () => {
    const agent = sandboxEntry("r1", "agent");
    expect(readRolloutSandboxes(null, JSON.stringify(agent))).toEqual({
      resources: null,
      agent,
      unreadable: [],
    });
    // Torn JSON, and another release's shape (no provider, a handle of its own kind).
    expect(
      readRolloutSandboxes('{"key":', JSON.stringify({ key: agent.key, sandbox: { id: "c1" } })),
    ).toEqual({
      resources: null,
      agent: null,
      unreadable: ["resources", "agent"],
    });
  });
});
