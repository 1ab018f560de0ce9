import { execResult } from "@fleet/sandbox/testing";
import type { PipelineDeps } from "../deps.ts";
import type { Latch } from "./latch.ts";

/** An agent and a verifier that do nothing and succeed at once (tests of the stage machinery). */
export const NO_OP_AGENT_AND_VERIFIER: Pick<PipelineDeps, "createHarness" | "verify"> = {
  createHarness: (agent) => ({
    name: agent.harness,
    run: async () => ({ exec: execResult(), answer: null, transcript: null, usage: null }),
  }),
  verify: async () => ({ reward: 1, details: { kind: "test" } }),
};

/** Poll a condition every 25 ms until it holds (never a fixed sleep); fails after `timeoutMs`. */
export async function until(
  what: string,
  probe: () => Promise<boolean> | boolean,
  timeoutMs = 30_000,
): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await probe())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

/** A harness that opens `working`, runs until its signal tells it to stop, then throws `error()`. */
export function untilStopped(working: Latch, error: () => Error): NonNullable<PipelineDeps["createHarness"]> {
  return (agent) => ({
    name: agent.harness,
    run: async (ctx) => {
      working.open();
      await new Promise((resolve) => ctx.signal?.addEventListener("abort", resolve, { once: true }));
      throw error();
    },
  });
}
