import { createServer, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import {
  type AgentSpecInput,
  type FileSet,
  FleetError,
  type SandboxHandle,
  type Usage,
  withUsage,
} from "@fleet/contracts";
import { chatReply } from "@fleet/gateway/testing";
import type { PutOptions } from "@fleet/sandbox";
import { InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterEach, describe, expect, it, vi } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { isHandBack } from "./hand-back.ts";
import { runStageJob } from "./stage-runner.ts";
import { cancelAndClose, type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { untilStopped } from "./testing/no-op-stages.ts";

const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });

/** Answer a model request with a chat completion ("done", `chatReply`'s usage). */
function answerDone(res: ServerResponse): void {
  const { status, body } = chatReply({ content: "done" });
  res.writeHead(status, { "content-type": "application/json" });
  res.end(JSON.stringify(body));
}

/**
 * A run handed back (its worker shut down) before its agent ran a command in the sandbox gives
 * its launch claim back only when nothing of the agent can have spent (`pipeline.int`: "a run
 * handed back at shutdown before its agent ran anything …"): its harness sent no request to its
 * model, and it reports no spend. A tool loop's request may be billed though it failed or was cut
 * off, which leaves no usage to tell: such a launch keeps its claim, so its spend is kept for a
 * cancel's result, or the next launch says it as a gap (rule 12: a gap, never a silent undercount).
 */
describe("a run handed back before its agent's first command", () => {
  let fleet: InProcessFleet | undefined;
  let upstream: Server | undefined;
  afterEach(async () => {
    upstream?.closeAllConnections();
    upstream?.close();
    upstream = undefined;
    await fleet?.close();
    fleet = undefined;
  });

  /** A model endpoint on loopback answering each request (by its number from 1) with `answer`. */
  async function modelEndpoint(answer: (n: number, res: ServerResponse) => void) {
    const seen = { requests: 0 };
    upstream = createServer((req, res) => {
      req.resume();
      answer(++seen.requests, res);
    });
    await new Promise<void>((r) => upstream!.listen(0, "127.0.0.1", r));
    const baseUrl = `http://127.0.0.1:${(upstream.address() as AddressInfo).port}/v1`;
    return { seen, baseUrl };
  }

  /** A fleet without workers and a seeded rollout of `hello-file` for `agent`. */
  async function seeded(
    agent: AgentSpecInput,
    deps: Partial<PipelineDeps> = {},
    provider = new InMemorySandboxProvider(),
  ): Promise<string> {
    fleet = await startInProcessFleet({ provider, startWorkers: false, deps });
    const task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
    const [id] = (await fleet.submit([{ task, agent }])) as [string];
    expect(await runStageJob("seed", job(id), fleet.deps)).toBe("ok");
    return id;
  }

  /** The run stage, handed back at its worker's shutdown once `ready` holds. */
  async function handedBack(id: string, ready: () => Promise<void>, deps = fleet!.deps) {
    const shutdown = new AbortController();
    const run = runStageJob("run", job(id), deps, { signal: shutdown.signal }).catch((e: unknown) => e);
    await ready();
    shutdown.abort();
    expect(isHandBack(await run)).toBe(true);
  }

  it("a harness whose only spend is a gap (a failed model attempt) keeps its claim: a cancel before the next delivery reports the gap", async () => {
    // What the tool loop's error carries after a failed first attempt (a 5xx, or one with no
    // answer in time, which the upstream may have billed): no call, a gap.
    const spent: Usage = {
      calls: 0,
      promptTokens: 0,
      completionTokens: 0,
      cachedTokens: 0,
      gaps: ["1 failed upstream attempt not counted (usage unknown)"],
    };
    const id = await seeded({ harness: "oracle" }, { stopPollMs: 600_000 });
    const working = latch();
    const createHarness = untilStopped(working, () =>
      withUsage(FleetError.retryable("cancelled", "harness stopped: shutdown"), spent),
    );
    await handedBack(id, () => working.opened, { ...fleet!.deps, createHarness });
    expect(await cancelAndClose(fleet!, id)).toBe("ok");
    expect(await fleet!.deps.store.getResult(id)).toMatchObject({ status: "cancelled", usage: spent });
  });

  it("the tool loop, its first call failed (503) and its retry in flight at the shutdown: a cancel before the next delivery reports a usage", async () => {
    const { seen, baseUrl } = await modelEndpoint((n, res) => {
      if (n > 1) return; // the retry: in flight at the shutdown
      res.writeHead(503, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { message: "overloaded" } }));
    });
    const id = await seeded({ harness: "tool-loop", model: { baseUrl, name: "m" } }, { stopPollMs: 600_000 });
    await handedBack(id, () =>
      vi.waitFor(() => expect(seen.requests).toBe(2), { timeout: 20_000, interval: 20 }),
    );
    expect(await cancelAndClose(fleet!, id)).toBe("ok");
    const result = (await fleet!.deps.store.getResult(id))!;
    // Two requests reached the model endpoint: not a rollout that spent nothing and launched nothing.
    expect(result.status).toBe("cancelled");
    expect(result.usage).not.toBeNull();
    expect(result.agentLaunches).toBe(1);
  });

  it("the tool loop, its first call in flight at the shutdown: the next launch's receipt says the earlier launch's gap", async () => {
    const { seen, baseUrl } = await modelEndpoint((n, res) => {
      if (n > 1) answerDone(res); // the first: in flight at the shutdown (the upstream generates, and bills)
    });
    const id = await seeded({ harness: "tool-loop", model: { baseUrl, name: "m" } });
    await handedBack(id, () =>
      vi.waitFor(() => expect(seen.requests).toBe(1), { timeout: 20_000, interval: 20 }),
    );
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    const receipt = (await fleet!.deps.store.get(id))!.receipts.run!;
    // Two requests reached the upstream: the receipt does not read as the whole spend.
    expect(receipt.usage!.gaps.join("\n")).toMatch(/earlier launch/);
  });

  it("a tool loop handed back before its first request to its model (writing its instruction) gives the launch back: the next delivery is a first launch, not a rerun that masks", async () => {
    const { seen, baseUrl } = await modelEndpoint((_n, res) => answerDone(res));
    // The instruction's write hangs until the shutdown (a slow daemon).
    const provider = new (class extends InMemorySandboxProvider {
      block = true;
      readonly putting = latch();
      override async put(handle: SandboxHandle, dir: string, files: FileSet, options?: PutOptions) {
        if (this.block && dir === "/tmp/fleet") {
          this.putting.open();
          await new Promise(() => undefined);
        }
        return super.put(handle, dir, files, options);
      }
    })();
    provider.block = false;
    const id = await seeded({ harness: "tool-loop", model: { baseUrl, name: "m" } }, {}, provider);
    // An image whose /workspace could not be put back: a rerun would be masked.
    const key = fleet!.deps.store.keys.rollout(id);
    const seedReceipt = (await fleet!.deps.store.get(id))!.receipts.seed!;
    seedReceipt.probe.workspaceEmpty = false;
    await fleet!.redis.hset(key, "r:seed", JSON.stringify(seedReceipt));
    provider.block = true;
    await handedBack(id, () => provider.putting.opened);
    expect(seen.requests).toBe(0);
    expect(await fleet!.redis.hget(key, "fence")).toBeNull();
    provider.block = false;
    expect(await runStageJob("run", job(id), fleet!.deps)).toBe("ok");
    expect((await fleet!.deps.store.get(id))!.receipts.run!.attempts).toBe(1);
  });

  it("a rerun handed back before its command keeps its claim (it cannot go back) and what it says it spent, with the earlier launch's gap, for a cancel's result", async () => {
    const zero: Usage = { calls: 0, promptTokens: 0, completionTokens: 0, cachedTokens: 0, gaps: [] };
    const id = await seeded({ harness: "command", argv: ["sh", "-c", "echo ran"] }, { stopPollMs: 600_000 });
    // The first launch ran its command, and was handed back at a shutdown.
    const ran = latch();
    const first: PipelineDeps["createHarness"] = (agent) => ({
      name: agent.harness,
      run: async (ctx) => {
        await ctx.provider.exec(ctx.handle, ["true"], { deadlineMs: Date.now() + 10_000 });
        ran.open();
        await new Promise((resolve) => ctx.signal?.addEventListener("abort", resolve, { once: true }));
        throw withUsage(FleetError.retryable("cancelled", "harness stopped"), zero);
      },
    });
    await handedBack(id, () => ran.opened, { ...fleet!.deps, createHarness: first });
    // The second (a rerun) is handed back before its command, reporting nothing spent.
    const starting = latch();
    const second = untilStopped(starting, () =>
      withUsage(FleetError.retryable("cancelled", "harness stopped"), zero),
    );
    await handedBack(id, () => starting.opened, { ...fleet!.deps, createHarness: second });
    expect(await cancelAndClose(fleet!, id)).toBe("ok");
    const result = (await fleet!.deps.store.getResult(id))!;
    expect(result.agentLaunches).toBe(2);
    expect(result.usage?.gaps.join("\n")).toMatch(/1 earlier launch/);
  });
});
