import {
  FleetError,
  RolloutRequest,
  type SandboxHandle,
  type SandboxSpecInput,
  type TaskContent,
} from "@fleet/contracts";
import { stageJobId } from "@fleet/queue";
import { execResult, InMemorySandboxProvider } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { createLogger } from "@fleet/telemetry";
import { afterEach, beforeAll, describe, expect, it, vi } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { NO_OP_AGENT_AND_VERIFIER, until } from "./testing/no-op-stages.ts";

/** A logger whose lines (JSON) go into `lines`, from `level` up. */
function loggerInto(lines: string[], level: "info" | "warn") {
  return createLogger({ name: "test", level, destination: { write: (l: string) => lines.push(l) } });
}

/** A no-op agent whose run ends once `opened` settles (the verify it leads to waits for the test's set-up). */
function agentDoneOnceOpen(opened: Promise<void>): NonNullable<PipelineDeps["createHarness"]> {
  return (agent) => ({
    name: agent.harness,
    run: async () => {
      await opened;
      return { exec: execResult(), answer: null, transcript: null, usage: null };
    },
  });
}

describe("stage workers at a concurrency above ten", () => {
  let fleet: InProcessFleet | undefined;

  /**
   * A fleet (concurrency 2, warnings logged into `lines`) whose agent runs until it is stopped
   * (the real harness kills its exec on the signal; `onStop` told), or with `stops: false` never
   * ends (a hung daemon under its exec). Resolves to a latch opened once the agent runs.
   */
  const fleetWhoseAgent = async (
    lines: string[],
    o: { onStop?: () => void; stops?: boolean; provider?: InMemorySandboxProvider } = {},
  ) => {
    const running = latch();
    fleet = await startInProcessFleet({
      provider: o.provider ?? new InMemorySandboxProvider(),
      concurrency: 2,
      deps: {
        logger: loggerInto(lines, "warn"),
        createHarness: (agent) => ({
          name: agent.harness,
          run: (ctx) => {
            running.open();
            return new Promise((_resolve, reject) => {
              if (o.stops === false) return;
              ctx.signal?.addEventListener("abort", () => {
                o.onStop?.();
                reject(ctx.signal?.reason);
              });
            });
          },
        }),
      },
    });
    return { running, f: fleet };
  };
  const warnings: Error[] = [];
  const onWarning = (w: Error) => warnings.push(w);
  let task: TaskContent;
  beforeAll(async () => {
    task = (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "hello-file")!;
  });
  afterEach(async () => {
    process.off("warning", onWarning);
    await fleet?.close();
  });

  it("run twelve agents at once with no listener-leak warning (each run listens for the worker's shutdown)", async () => {
    process.on("warning", onWarning);
    const n = 12;
    let running = 0;
    const allRunning = latch();
    const createHarness: NonNullable<PipelineDeps["createHarness"]> = (agent) => ({
      name: agent.harness,
      async run() {
        // Every run stays in flight until all twelve are: twelve listeners at once.
        if (++running === n) allRunning.open();
        await allRunning.opened;
        return { exec: execResult(), answer: null, transcript: null, usage: null };
      },
    });
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      concurrency: n,
      deps: { createHarness, verify: async () => ({ reward: 1, details: { kind: "test" } }) },
    });
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const ids = await fleet.submit(Array.from({ length: n }, () => request));
    const results = await fleet.waitForResults(ids, 60_000);
    expect(running).toBe(n);
    expect(results.map((r) => r.status)).toEqual(Array(n).fill("completed"));
    expect(warnings.map((w) => `${w.name}: ${w.message}`)).toEqual([]);
  });

  it("log one line per stage job, with the rollout's id: a rollout can be traced across the processes", async () => {
    const lines: string[] = [];
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      deps: {
        ...NO_OP_AGENT_AND_VERIFIER,
        logger: loggerInto(lines, "info"),
      },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await fleet.waitForResults([id!], 30_000);
    const doneLines = () =>
      lines
        .map((l) => JSON.parse(l) as Record<string, unknown>)
        .filter((l) => l.msg === "stage job done" && l.rolloutId === id);
    // The close's line is written after its result is stored, which the wait above may see first.
    await vi.waitFor(() => expect(doneLines().map((l) => l.stage)).toContain("close"), { timeout: 10_000 });
    const done = doneLines();
    expect(done.map((l) => [l.stage, l.outcome, l.attempt])).toEqual([
      ["seed", "ok", 1],
      ["run", "ok", 1],
      ["verify", "ok", 1],
      ["close", "ok", 1],
    ]);
    expect(done.every((l) => typeof l.ms === "number")).toBe(true);
  });

  it("a verify that must wait out an earlier attempt's tests hands its job back until then: no attempt spent, its slot free for other rollouts", async () => {
    const lines: string[] = [];
    const noted = latch();
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      concurrency: 1,
      deps: {
        ...NO_OP_AGENT_AND_VERIFIER,
        logger: loggerInto(lines, "info"),
        createHarness: agentDoneOnceOpen(noted.opened),
      },
    });
    const { store, queues } = fleet.deps;
    const request = RolloutRequest.parse({ task, agent: { harness: "oracle" } });
    const [a] = await fleet.submit([request]);
    // An earlier verify of A noted its tests (30 s budget + 15 s grace) 39 s ago, then its worker
    // died: 6 s of them left when A's verify begins, which it must wait out.
    const notedAt = Date.now() - 39_000;
    const waitEnds = notedAt + task.timeouts.verifierS * 1000 + 15_000;
    await store.begin(a!, "verify", Date.now(), { verifyToken: "attempt-that-died" });
    expect(await store.noteVerifyWork(a!, notedAt, "attempt-that-died")).toBe("noted");
    noted.open();
    const jobA = async () => queues.queues.verify.getJob(stageJobId(a!, "verify"));
    await until("A's verify is handed back until the earlier tests are over", async () => {
      const job = await jobA();
      return (await job?.getState()) === "delayed";
    });
    expect((await jobA())!.attemptsMade).toBe(0);
    // The only verify slot takes another rollout meanwhile (asleep in it, A would hold it).
    const [b] = await fleet.submit([request]);
    const [resultB] = await fleet.waitForResults([b!], 30_000);
    expect(resultB!.status).toBe("completed");
    const [resultA] = await fleet.waitForResults([a!], 60_000);
    expect(resultA).toMatchObject({ status: "completed", reward: 1 });
    // B went through the one slot while A waited (asleep in it, A would have finished first),
    // and A's verify started nothing before the earlier tests' time was over.
    expect(resultB!.finishedAt!).toBeLessThan(resultA!.finishedAt!);
    expect(resultA!.finishedAt!).toBeGreaterThanOrEqual(waitEnds);
    const said = lines.map((l) => JSON.parse(l) as { msg: string; rolloutId?: string; until?: number });
    const deferred = said.filter((l) => l.rolloutId === a && /until a later time/.test(l.msg));
    expect(deferred.length).toBeGreaterThanOrEqual(1);
    expect(deferred[0]!.until).toBe(waitEnds);
    // Verified once the wait was over, on its first attempt.
    const done = said.find(
      (l) => l.rolloutId === a && l.msg === "stage job done" && (l as { stage?: string }).stage === "verify",
    );
    expect(done).toMatchObject({ outcome: "ok", attempt: 1 });
  });

  it("a verify handed back until a time on the fleet's clock (Redis's) waits that long on this host's clock, 60 s behind it", async () => {
    const fleetNow = () => Date.now() + 60_000;
    const noted = latch();
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      concurrency: 1,
      deps: {
        ...NO_OP_AGENT_AND_VERIFIER,
        now: fleetNow,
        createHarness: agentDoneOnceOpen(noted.opened),
      },
    });
    const { store, queues } = fleet.deps;
    const [a] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    // An earlier attempt's tests, noted 39 s ago on the fleet's clock: 6 s of them left.
    await store.begin(a!, "verify", fleetNow(), { verifyToken: "attempt-that-died" });
    expect(await store.noteVerifyWork(a!, fleetNow() - 39_000, "attempt-that-died")).toBe("noted");
    noted.open();
    const jobA = async () => queues.queues.verify.getJob(stageJobId(a!, "verify"));
    await until("A's verify is handed back", async () => (await (await jobA())?.getState()) === "delayed");
    // About 6 s, not the 66 s this host's clock reads to the fleet's time.
    expect((await jobA())!.delay).toBeLessThanOrEqual(10_000);
  });

  /**
   * A fleet whose verify grades until it is stopped, as the real verifier's provider calls do
   * (they throw `cancelled` with the signal's reason), with one rollout verifying; warnings in `lines`.
   */
  async function verifyingUntilStopped(lines: string[]): Promise<string> {
    const verifying = latch();
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      concurrency: 2,
      deps: {
        logger: loggerInto(lines, "warn"),
        createHarness: NO_OP_AGENT_AND_VERIFIER.createHarness,
        verify: (ctx) => {
          verifying.open();
          return new Promise((_resolve, reject) => {
            ctx.signal?.addEventListener("abort", () =>
              reject(FleetError.nonRetryable("cancelled", "verification stopped: aborted")),
            );
          });
        },
      },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await verifying.opened;
    return id!;
  }

  it("hand a verify still grading back to the queue at shutdown, no attempt spent, not cancelled", async () => {
    const lines: string[] = [];
    const id = await verifyingUntilStopped(lines);
    await fleet!.workers!.close(4_000);
    // A move back that failed says why (else only the state below shows it, as `active`).
    expect(lines.filter((l) => /could not hand the job back/.test(l))).toEqual([]);
    const job = await fleet!.deps.queues.queues.verify.getJob(stageJobId(id, "verify"));
    expect(await job!.getState()).toBe("waiting");
    expect(job!.attemptsMade).toBe(0);
    const rec = await fleet!.deps.store.get(id);
    expect(rec?.failure).toBeNull();
    expect(rec?.status).toBe("ran");
  });

  /**
   * Start a fleet on `provider`, submit one rollout, wait until `stuck` opens (a provider call that
   * never answers, or only once stopped, on a daemon slow to answer), and close the workers: they
   * close within their budget, the stage's job back in its queue, `attemptsMade` attempts spent, no
   * failure recorded. An agent-owned sandbox (`own`) takes a task graded on the agent's output
   * (one graded by tests in the task's sandbox cannot see an own sandbox's work: refused at
   * admission). The rollout's id and record.
   */
  async function handedBackAtShutdown(
    provider: InMemorySandboxProvider,
    stuck: { opened: Promise<void> },
    stage: "seed" | "run",
    opts: { own?: boolean; attemptsMade?: number; workerOptions?: { providerBreaker: false } } = {},
  ) {
    fleet = await startInProcessFleet({
      provider,
      deps: { logger: loggerInto([], "warn") },
      ...(opts.workerOptions ? { workerOptions: opts.workerOptions } : {}),
    });
    const submitted = opts.own
      ? (await loadSuite(EXAMPLE_SUITE_DIR)).find((t) => t.id === "sum-answer")!
      : task;
    const agent = opts.own ? { harness: "oracle", sandbox: "own" } : { harness: "oracle" };
    const [id] = await fleet.submit([RolloutRequest.parse({ task: submitted, agent })]);
    await stuck.opened;
    expect(await fleet.workers!.close(4_000)).toEqual({ closed: true, abandoned: 0 });
    const job = await fleet.deps.queues.queues[stage].getJob(stageJobId(id!, stage));
    expect(await job!.getState()).toBe("waiting");
    expect(job!.attemptsMade).toBe(opts.attemptsMade ?? 0);
    const rec = await fleet.deps.store.get(id!);
    expect(rec?.failure).toBeNull();
    return { id: id!, rec: rec!, ledger: fleet.deps.ledger };
  }

  /** A provider whose create of `owner`'s sandbox ends only when asked to stop, as the real providers' creates do on their signal; `stopped` counts those stops. */
  function createUntilStopped(owner: SandboxHandle["owner"], creating: { open(): void }) {
    return new (class extends InMemorySandboxProvider {
      stopped = 0;
      override create(spec: SandboxSpecInput, options: { signal?: AbortSignal } = {}) {
        if (spec.owner !== owner) return super.create(spec, options);
        creating.open();
        return new Promise<SandboxHandle>((_resolve, reject) => {
          options.signal?.addEventListener("abort", () => {
            this.stopped++;
            reject(FleetError.retryable("provider_unavailable", "sandbox create stopped"));
          });
        });
      }
    })();
  }

  it("hand a seed whose sandbox create is still in flight back to the queue at shutdown, no attempt spent, its teardown intent kept", async () => {
    const creating = latch();
    const provider = createUntilStopped("resources", creating);
    const { id, rec, ledger } = await handedBackAtShutdown(provider, creating, "seed");
    expect(provider.stopped).toBe(1);
    expect(rec.status).toBe("accepted");
    // The intent recorded before the create stays: the next delivery (or a close, or the janitor)
    // finds by its labels whatever the stopped create made.
    expect((await ledger.sandboxesOf(id)).resources).toMatchObject({ rolloutId: id, handle: null });
  });

  it("hand a seed whose isolation probe is still in flight back to the queue at shutdown, no attempt spent, no receipt stored, its teardown intent kept", async () => {
    const probing = latch();
    // A probe on a daemon slow to answer (its calls take no signal): it never ends here.
    const provider = new (class extends InMemorySandboxProvider {
      override probe(): Promise<never> {
        probing.open();
        return new Promise(() => {});
      }
    })();
    const { id, rec, ledger } = await handedBackAtShutdown(provider, probing, "seed");
    expect(rec.status).toBe("accepted");
    expect(rec.receipts.seed ?? null).toBeNull();
    // The sandbox made stays for the next delivery to find by its labels and replace.
    expect((await ledger.sandboxesOf(id)).resources).toMatchObject({ rolloutId: id, handle: null });
  });

  it("hand a seed delivered again whose look for its earlier attempt's sandbox is still in flight back to the queue at shutdown, no further attempt spent", async () => {
    const finding = latch();
    let creates = 0;
    // The first attempt's create fails (retried); the next delivery looks for what it left, on a
    // daemon slow to answer (`find` takes no signal): it never ends here.
    const provider = new (class extends InMemorySandboxProvider {
      override async create(spec: SandboxSpecInput, options: { signal?: AbortSignal } = {}) {
        if (++creates === 1) throw FleetError.retryable("provider_unavailable", "daemon blip");
        return super.create(spec, options);
      }
      override find(): Promise<never> {
        finding.open();
        return new Promise(() => {});
      }
    })();
    const { rec } = await handedBackAtShutdown(provider, finding, "seed", {
      attemptsMade: 1,
      workerOptions: { providerBreaker: false },
    });
    expect(rec.receipts.seed ?? null).toBeNull();
  });

  it("hand a run whose own sandbox's create is still in flight back to the queue at shutdown, no attempt spent, its launch claim given back", async () => {
    const creating = latch();
    // The task's sandbox is made at once; the agent's own (`sandbox: "own"`) never.
    const provider = createUntilStopped("agent", creating);
    const { id, rec, ledger } = await handedBackAtShutdown(provider, creating, "run", { own: true });
    expect(provider.stopped).toBe(1);
    expect(rec.status).toBe("seeded");
    // Nothing launched: the next delivery is a first launch, not a rerun after an agent ran.
    expect(rec.launches ?? 0).toBe(0);
    // The own sandbox's intent, recorded before its create, stays for the next delivery's replace.
    expect((await ledger.sandboxesOf(id)).agent).toMatchObject({ rolloutId: id, handle: null });
  });

  it("hand a run whose look for an earlier attempt's own sandbox is still in flight back to the queue at shutdown, no attempt spent, its launch claim given back", async () => {
    const finding = latch();
    // The agent's own sandbox looked for (an earlier attempt's) on a daemon slow to answer
    // (`find` takes no signal): it never ends here.
    const provider = new (class extends InMemorySandboxProvider {
      override find(rolloutId: string, owner: SandboxHandle["owner"]) {
        if (owner !== "agent") return super.find(rolloutId, owner);
        finding.open();
        return new Promise<never>(() => {});
      }
    })();
    const { rec } = await handedBackAtShutdown(provider, finding, "run", { own: true });
    expect(rec.launches ?? 0).toBe(0);
  });

  it("hand a run whose own sandbox's isolation probe is still in flight back to the queue at shutdown, no attempt spent, its launch claim given back", async () => {
    const probing = latch();
    // The task's sandbox is probed at once; the agent's own on a daemon slow to answer (its
    // calls take no signal): its probe never ends here.
    const provider = new (class extends InMemorySandboxProvider {
      override probe(handle: SandboxHandle) {
        if (handle.owner !== "agent") return super.probe(handle);
        probing.open();
        return new Promise<never>(() => {});
      }
    })();
    const { id, rec, ledger } = await handedBackAtShutdown(provider, probing, "run", { own: true });
    expect(rec.status).toBe("seeded");
    expect(rec.launches ?? 0).toBe(0);
    // The own sandbox stays on the ledger, its handle attached, for the next delivery's replace.
    expect((await ledger.sandboxesOf(id)).agent?.handle).toMatchObject({ owner: "agent" });
  });

  it("a hand-back whose move back to the queue fails is said plainly (BullMQ drops its error while closing)", async () => {
    const lines: string[] = [];
    const id = await verifyingUntilStopped(lines);
    // The job's lock lapsed before the hand-back (its worker paused or cut off past the lock's
    // duration): the move back to the queue is refused, and the job stays active until a stalled
    // check takes it back.
    await fleet!.redis.del(`${fleet!.prefix}:verify:${stageJobId(id, "verify")}:lock`);
    await fleet!.workers!.close(4_000);
    const job = await fleet!.deps.queues.queues.verify.getJob(stageJobId(id, "verify"));
    expect(await job!.getState()).toBe("active");
    const said = lines.map((l) => JSON.parse(l) as { msg: string; err?: string; rolloutId?: string });
    const failed = said.find((l) => /could not hand the job back/.test(l.msg));
    expect(failed?.rolloutId).toBe(id);
    expect(failed?.err).toMatch(/lock/i);
  });

  it("a job whose lock lapsed under its worker is said plainly (a warning naming the takeover), not as a bare worker error", async () => {
    const verifying = latch();
    const release = latch();
    const lines: string[] = [];
    fleet = await startInProcessFleet({
      provider: new InMemorySandboxProvider(),
      concurrency: 1,
      deps: {
        logger: loggerInto(lines, "warn"),
        verify: async () => {
          verifying.open();
          await release.opened;
          return { reward: 1, details: { kind: "test" } };
        },
      },
    });
    const [id] = await fleet.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await verifying.opened;
    // As when its worker was paused or cut off past the lock's duration: the lock is gone.
    await fleet.redis.del(`${fleet.prefix}:verify:${stageJobId(id!, "verify")}:lock`);
    release.open();
    const said = () => lines.map((l) => JSON.parse(l) as { level: number; msg: string; err?: string });
    await until("the lapsed lock to be logged", () => said().some((l) => /lock .* lapsed/.test(l.msg)));
    const lapsed = said().find((l) => /lock .* lapsed/.test(l.msg))!;
    expect(lapsed.level).toBe(40);
    expect(lapsed.err).toMatch(/lock/i);
    expect(said().filter((l) => l.msg === "worker error" && /lock/i.test(l.err ?? ""))).toEqual([]);
  });

  it("a run job its own worker takes again after its lock lapsed stalls once: the later delivery's lock is renewed after the first delivery ends (one lapse used to stall it until BullMQ failed it, the rollout masked)", async () => {
    let agentRuns = 0;
    let kills = 0;
    const provider = new InMemorySandboxProvider(async (call) => {
      if (call.argv[1] !== "/solution/solve.sh") return {};
      agentRuns++;
      const killsBefore = kills;
      // An agent working for 8 s (longer than two locks), unless its processes are killed.
      const end = Date.now() + 8_000;
      await until("the agent's work or its kill", () => Date.now() >= end || kills > killsBefore, 20_000);
      return execResult(kills > killsBefore ? { exitCode: 137 } : {});
    });
    const kill = provider.killProcesses.bind(provider);
    provider.killProcesses = async (handle) => {
      kills++;
      return kill(handle);
    };
    fleet = await startInProcessFleet({
      provider,
      concurrency: 3,
      workerOptions: { lockDurationMs: 3_000, stalledIntervalMs: 1_000 },
      deps: { verify: NO_OP_AGENT_AND_VERIFIER.verify },
    });
    const [id] = await fleet.submit([
      RolloutRequest.parse({ task, agent: { harness: "oracle" }, deadlineS: 600 }),
    ]);
    const runJob = `${fleet.prefix}:run:${stageJobId(id!, "run")}`;
    await until("the agent to start", () => agentRuns === 1);
    // As when this process was paused, or cut off from Redis, past the lock's duration.
    await fleet.redis.del(`${runJob}:lock`);
    const [result] = await fleet.waitForResults([id!], 60_000);
    expect(result).toMatchObject({ status: "completed", reward: 1 });
    // Taken again once (the first launch stopped), and never stalled again.
    expect(agentRuns).toBe(2);
    expect(await fleet.redis.hget(runJob, "stc")).toBe("1");
  });

  it("hand a run back at shutdown in good time while a supervisor check hangs on Redis", async () => {
    const lines: string[] = [];
    let stoppedAt = 0;
    const { running, f } = await fleetWhoseAgent(lines, {
      onStop: () => {
        stoppedAt = Date.now();
        if (!fleet) throw new Error("no fleet started");
      },
    });
    const [id] = await f.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await running.opened;
    // The supervisor asks an idle stage's queue about its backlog; Redis does not answer (an
    // outage: the main connection queues commands until it is back).
    const seedQueue = f.deps.queues.queues.seed;
    const checking = latch();
    seedQueue.isPaused = () => {
      checking.open();
      return new Promise<boolean>(() => undefined);
    };
    void f.workers!.check();
    await checking.opened;
    const closing = Date.now();
    expect(await f.workers!.close(8_000)).toEqual({ closed: true, abandoned: 0 });
    const job = await f.deps.queues.queues.run.getJob(stageJobId(id!, "run"));
    expect(await job!.getState()).toBe("waiting");
    expect(job!.attemptsMade).toBe(0);
    // Handed back at half the budget, in time: the hung check did not spend the budget first
    // (the workers were not force-closed at its end).
    // Asked to stop at about half the 8 s budget, not at its end (a bound on the order of events,
    // with 2 s of margin either way: a loaded machine may delay the stop by a second).
    expect(stoppedAt - closing).toBeLessThan(6_000);
    const said = lines.map((l) => JSON.parse(l).msg as string);
    expect(said).toContain("jobs still running at shutdown; handing them back");
    expect(said.filter((m) => m.startsWith("shutdown budget spent"))).toEqual([]);
  });

  it("a run handed back at shutdown whose agent's stop is not confirmed says so (its processes may outlive the worker)", async () => {
    const lines: string[] = [];
    const provider = new InMemorySandboxProvider();
    provider.killProcesses = async () => ({
      confirmed: false,
      scope: "processes",
      at: Date.now(),
      alreadyGone: false,
      remaining: 2,
      detail: "2 process(es) still alive",
    });
    const { running, f } = await fleetWhoseAgent(lines, { provider });
    const [id] = await f.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await running.opened;
    expect(await f.workers!.close(4_000)).toEqual({ closed: true, abandoned: 0 });
    const job = await f.deps.queues.queues.run.getJob(stageJobId(id!, "run"));
    expect(await job!.getState()).toBe("waiting");
    const said = lines.map((l) => JSON.parse(l) as { msg: string; rolloutId?: string; remaining?: number });
    expect(said.find((l) => l.msg.includes("not confirmed stopped"))).toMatchObject({
      rolloutId: id,
      remaining: 2,
    });
  });

  it("a run that cannot be handed back within the shutdown budget is counted abandoned, not taken for a clean stop", async () => {
    const lines: string[] = [];
    // An agent whose stop never lands (a hung daemon under its exec).
    const { running, f } = await fleetWhoseAgent(lines, { stops: false });
    const [id] = await f.submit([RolloutRequest.parse({ task, agent: { harness: "oracle" } })]);
    await running.opened;
    expect(await f.workers!.close(3_000)).toEqual({ closed: false, abandoned: 1 });
    const said = lines.map((l) => JSON.parse(l) as { msg: string; abandoned?: number });
    expect(said.find((l) => l.msg.startsWith("shutdown budget spent"))).toMatchObject({ abandoned: 1 });
    // Left active with its lock: delivered again once the lock lapses.
    const job = await f.deps.queues.queues.run.getJob(stageJobId(id!, "run"));
    expect(await job!.getState()).toBe("active");
  });
});
