import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import {
  type CleanupReceipt,
  FleetError,
  isTerminal,
  MAX_FIELD_CHARS,
  type RolloutRequestInput,
  RUN_MARGIN_MS,
  type SandboxHandle,
  TaskContent,
  withUsage,
} from "@fleet/contracts";
import { createHarness } from "@fleet/harness";
import { STAGE_CATALOG, STAGES, sandboxKey, stageJobId } from "@fleet/queue";
import {
  DockerSandboxProvider,
  KEEPALIVE_USER,
  KILL_GRACE_S,
  LABEL_ROLLOUT,
  ROOT_USER,
  SANDBOX_PATHS,
  type SandboxProvider,
  VERIFY_FENCE_DIR,
  VERIFY_FENCE_FILE,
} from "@fleet/sandbox";
import { execResult, fillWithEmptyFilesPy } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { RUN_TESTS_ARGV, TESTS_CUT_SHORT, TESTS_STARTED_MARK, verify } from "@fleet/verifiers";
import { UnrecoverableError } from "bullmq";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import type { PipelineDeps } from "./deps.ts";
import { type DeferralError, isDeferral, isHandBack, RedisHoldError } from "./hand-back.ts";
import { janitorTick } from "./janitor.ts";
import { runStageJob } from "./stage-runner.ts";
import { beginOptions, HANDLERS, SUPERSEDED } from "./stages.ts";
import { type InProcessFleet, startInProcessFleet } from "./testing/in-process-fleet.ts";
import { latch } from "./testing/latch.ts";
import { untilStopped } from "./testing/no-op-stages.ts";
import { createStageWorkers } from "./worker.ts";

const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
// Scoped to this file's run: its janitor passes sweep every sandbox their provider lists, and
// must never take another test file's (they run at the same time on the one daemon).
const docker = new DockerSandboxProvider({ scope: `pipeline-test-${process.pid}` });
let suite: TaskContent[];
const byId = (id: string) => {
  const t = suite.find((x) => x.id === id);
  if (!t) throw new Error(`no task ${id}`);
  return { ...t, image: IMAGE };
};

/** A provider whose destroy fails the first `failures` times: the fault injected behind our interface. */
class FlakyDestroyProvider implements SandboxProvider {
  readonly name;
  readonly endpoint;
  failures: number;
  constructor(
    private readonly inner: SandboxProvider,
    failures: number,
  ) {
    this.name = inner.name;
    this.endpoint = inner.endpoint;
    this.failures = failures;
  }
  create = (...a: Parameters<SandboxProvider["create"]>) => this.inner.create(...a);
  find = (...a: Parameters<SandboxProvider["find"]>) => this.inner.find(...a);
  exec = (...a: Parameters<SandboxProvider["exec"]>) => this.inner.exec(...a);
  put = (...a: Parameters<SandboxProvider["put"]>) => this.inner.put(...a);
  get = (...a: Parameters<SandboxProvider["get"]>) => this.inner.get(...a);
  probe = (...a: Parameters<SandboxProvider["probe"]>) => this.inner.probe(...a);
  killProcesses = (...a: Parameters<SandboxProvider["killProcesses"]>) => this.inner.killProcesses(...a);
  list = (...a: Parameters<SandboxProvider["list"]>) => this.inner.list(...a);
  alive = (...a: Parameters<SandboxProvider["alive"]>) => this.inner.alive(...a);
  async destroy(handle: SandboxHandle): Promise<CleanupReceipt> {
    if (this.failures > 0) {
      this.failures--;
      throw new Error("injected destroy failure");
    }
    return this.inner.destroy(handle);
  }
}

/** Logs probes and puts by the sandbox's owner; refuses the agent sandbox's probe when told to. */
class WatchedProvider extends FlakyDestroyProvider {
  readonly calls: string[] = [];
  refuseAgentProbe = false;
  /** The agent sandbox's next probe fails retryably (a probe that timed out). */
  failAgentProbeOnce = false;
  constructor(private readonly watched: SandboxProvider) {
    super(watched, 0);
  }
  override probe = async (...a: Parameters<SandboxProvider["probe"]>) => {
    this.calls.push(`probe ${a[0].owner}`);
    if (this.refuseAgentProbe && a[0].owner === "agent") {
      throw FleetError.nonRetryable("isolation_refused", "refused by the test");
    }
    if (this.failAgentProbeOnce && a[0].owner === "agent") {
      this.failAgentProbeOnce = false;
      throw FleetError.retryable("provider_unavailable", "probe timed out (the test)");
    }
    return this.watched.probe(...a);
  };
  override put = async (...a: Parameters<SandboxProvider["put"]>) => {
    this.calls.push(`put ${a[0].owner} ${a[1]}`);
    return this.watched.put(...a);
  };
}

async function containersOf(ids: string[]): Promise<number> {
  const all = await docker.list();
  return all.filter((s) => ids.includes(s.labels[LABEL_ROLLOUT] ?? "")).length;
}

const oracle = (task: TaskContent): RolloutRequestInput => ({ task, agent: { harness: "oracle" } });

/** `deps` whose agent only counts its launches (and exits 0 at once). */
function countingLaunches(deps: PipelineDeps): { counting: PipelineDeps; launches: () => number } {
  let launched = 0;
  const counting: PipelineDeps = {
    ...deps,
    createHarness: () => ({
      name: "oracle" as const,
      run: async () => {
        launched += 1;
        return { exec: execResult({ exitCode: 0 }), answer: null, transcript: null, usage: null };
      },
    }),
  };
  return { counting, launches: () => launched };
}

describe("pipeline against real Redis and Docker", () => {
  let fleet: InProcessFleet;
  const allIds: string[] = [];

  beforeAll(async () => {
    suite = await loadSuite(EXAMPLE_SUITE_DIR);
    fleet = await startInProcessFleet({ provider: docker, concurrency: 4 });
  });
  afterAll(async () => {
    await fleet.close();
    // Rule: no container of these rollouts is left behind.
    expect(await containersOf(allIds)).toBe(0);
  });

  it("grades every example task's oracle solution 1.0 and leaves no sandbox", async () => {
    const ids = await fleet.submit(suite.map((t) => oracle({ ...t, image: IMAGE })));
    allIds.push(...ids);
    const results = await fleet.waitForResults(ids, 240_000);
    for (const r of results) {
      expect({ task: r.taskId, status: r.status, reward: r.reward, reason: r.reason }).toEqual({
        task: r.taskId,
        status: "completed",
        reward: 1,
        reason: r.taskId === "long-deadline" ? r.reason : null,
      });
      expect(r.teardown).toBe("confirmed");
      expect(r.mask).toBe(false);
      expect(r.timings.totalMs).toBeGreaterThan(0);
    }
    expect(await containersOf(ids)).toBe(0);
  });

  it("grades a wrong answer 0 as completed, not masked", async () => {
    const [id] = await fleet.submit([
      { task: byId("hello-file"), agent: { harness: "command", argv: ["true"] } },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "completed", reward: 0, mask: false, failureKind: null, exitCode: 0 });
  });

  it("an agent's code the tests run as root cannot rewrite the rest of test.sh under bash to pass (the example tests are read whole first)", async () => {
    // Right for a name, wrong without one (the tests want exit 2): 0, unless the rewrite works.
    const greet = [
      "f=/tests/test.sh",
      'if [ -w "$f" ] && grep -q \'agent bash greet.sh Ada\' "$f"; then',
      "  n=$(grep -b -m1 'agent bash greet.sh Ada' \"$f\" | cut -d: -f1)",
      "  line=$(grep -m1 'agent bash greet.sh Ada' \"$f\")",
      // biome-ignore lint/suspicious/noTemplateCurlyInString: shell parameter expansion
      '  head -c $((n + ${#line} + 1)) "$f" > /tmp/.t; printf \'write_reward 1; exit 0\\n\' >> /tmp/.t; cat /tmp/.t > "$f"',
      "fi",
      'echo "Hello, $1!"',
    ].join("\n");
    const [id] = await fleet.submit([
      {
        task: byId("shell-script"),
        agent: { harness: "command", argv: ["bash", "-c", `cat > /workspace/greet.sh <<'X'\n${greet}\nX\n`] },
      },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "completed", reward: 0, mask: false });
  });

  it("an agent that fills its workspace is graded (its writes get ENOSPC), not masked as a lost sandbox", async () => {
    // A workspace cap as large as the memory: the sandbox's memory limit must leave room for a
    // full workspace and the tests after it (a mask here would let a policy trade a failure for one).
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: {
          harness: "command",
          argv: ["sh", "-c", "yes > /workspace/out.txt; echo 'Hello, fleet!' > hello.txt"],
        },
        sandbox: { memoryMb: 64, diskMb: 64, tmpfsMb: 16 },
      },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "completed", reward: 0, mask: false, failureKind: null });
    expect(r!.exitCode).not.toBe(-2);
  });

  it.each([
    ["000", "a leftover process"],
    ["700", "none left"],
  ])(
    "an agent that makes its workspace unenterable to root (chmod %s /workspace, %s) is graded, not masked",
    async (mode, left) => {
      // Root in the sandbox has no capability: it cannot enter a 0700 directory of the agent's.
      // The kill sweep, the tests' staging and runner must not fail on it (a mask, or an
      // ungraded failure, the agent chose); the tests cannot read the work: 0.
      const leftover = left === "none left" ? "" : "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & ";
      const [id] = await fleet.submit([
        {
          task: byId("hello-file"),
          agent: {
            harness: "command",
            argv: ["sh", "-c", `echo 'Hello, fleet!' > hello.txt; ${leftover}chmod ${mode} /workspace`],
          },
        },
      ]);
      allIds.push(id!);
      const [r] = await fleet.waitForResults([id!]);
      expect(r).toMatchObject({ status: "completed", reward: 0, mask: false, failureKind: null });
    },
  );

  it("an agent that fills the sandbox's memory with what no process holds (detached System V shared memory, empty files on every tmpfs) is graded, not masked", async () => {
    // Empty files use no data pages (a tmpfs size cap does not bound them) but pin kernel memory,
    // and a detached System V segment outlives its process unless the IPC namespace removes it:
    // without the inode caps and kernel.shm_rmid_forced, verification would start in a full
    // cgroup, its staging be OOM-killed, and the rollout masked instead of graded 0.
    const fill = `
import ctypes, os
open("/workspace/hello.txt", "w").write("wrong\\n")
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
for _ in range(40):
    sid = libc.shmget(0, 8 << 20, 0o1600)
    if sid < 0:
        break
    addr = libc.shmat(sid, None, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(addr, 1, 8 << 20)
    libc.shmdt(addr)
`;
    const files = fillWithEmptyFilesPy(["/workspace/.f", "/tmp/.f", "/logs/.f", "/dev/shm/.f"]);
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: {
          harness: "command",
          argv: [
            "sh",
            "-c",
            `python3 -c '${fill}'; python3 -c '${files}'; head -c 100000000 /dev/zero > /tmp/last`,
          ],
        },
        sandbox: { memoryMb: 96, diskMb: 16, tmpfsMb: 16 },
      },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!], 240_000);
    expect(r).toMatchObject({ status: "completed", reward: 0, mask: false, failureKind: null });
    expect(r!.exitCode).not.toBe(-2);
  });

  it("an agent that plants as many files as it can in /logs/verifier costs the verification none of its budget's attempts", async () => {
    // Clearing /logs/verifier is part of the tests' budget: with no inode cap on /logs an agent
    // could leave millions of files there, more than the runner can remove before a short budget
    // runs out, and each attempt would fail (masked) instead of grading the agent.
    const plant = fillWithEmptyFilesPy(["/logs/verifier"], { untilS: 20 });
    const [id] = await fleet.submit([
      {
        task: { ...byId("hello-file"), timeouts: { agentS: 60, verifierS: 2 } },
        agent: { harness: "command", argv: ["python3", "-c", plant] },
      },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!], 240_000);
    expect(r).toMatchObject({ status: "completed", reward: 0, mask: false, failureKind: null });
    expect(r!.failures.filter((f) => f.stage === "verify")).toEqual([]);
  });

  it("an agent past its deadline is graded as agent_timeout after its processes are confirmed gone", async () => {
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: { harness: "command", argv: ["sh", "-c", "sleep 1000 & sleep 1000"], timeoutS: 2 },
      },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "completed", reward: 0, failureKind: "agent_timeout", exitCode: -1 });
    const rec = await fleet.deps.store.get(id!);
    const run = rec!.receipts.run!;
    const verify = rec!.receipts.verify!;
    expect(run.cleanup.confirmed).toBe(true);
    expect(run.cleanup.remaining).toBe(0);
    expect(run.cleanup.at).toBeLessThanOrEqual(verify.startedAt);
    expect(run.exec.timedOut).toBe(true);
  });

  it("a sandbox killed from outside mid-run is masked, never scored 0", async () => {
    const [id] = await fleet.submit([
      { task: byId("hello-file"), agent: { harness: "command", argv: ["sleep", "60"] } },
    ]);
    allIds.push(id!);
    await waitFor(async () => (await fleet.deps.store.get(id!))?.times["run:start"] !== undefined);
    const rec = await fleet.deps.store.get(id!);
    const handle = rec!.receipts.seed!.handle;
    await docker.destroy(handle);
    const [r] = await fleet.waitForResults([id!]);
    expect(r!.status).toBe("masked");
    expect(r!.mask).toBe(true);
    expect(r!.reward).toBeNull();
    expect(["sandbox_lost", "provider_unavailable"]).toContain(r!.failureKind);
    expect(r!.exitCode).toBe(-2);
  });

  it("a sandbox killed from outside while the tests run is masked, never scored 0", async () => {
    const task = {
      ...byId("hello-file"),
      id: `killed-in-verify-${Date.now()}`,
      tests: { "test.sh": "#!/bin/bash\nsleep 60\n" },
    };
    const [id] = await fleet.submit([oracle(task)]);
    allIds.push(id!);
    await waitFor(async () => (await fleet.deps.store.get(id!))?.times["verify:start"] !== undefined);
    const handle = (await fleet.deps.store.get(id!))!.receipts.seed!.handle;
    // The tests are running (their sleep is up) when the container is killed, not removed. By
    // the whole command line: `pgrep -f "sleep 60"` matches its own `timeout ... pgrep -f sleep
    // 60` wrapper, so it answers yes before the tests have started.
    await waitFor(async () => {
      const ps = await docker.exec(handle, ["pgrep", "-f", "^sleep 60$"], { deadlineMs: 5_000 });
      return ps.exitCode === 0;
    });
    execFileSync("docker", ["kill", handle.id], { stdio: "pipe", timeout: 60_000 });
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "masked", mask: true, reward: null, failureKind: "sandbox_lost" });
  });

  it("an agent that owns its sandbox releases it before verify; the task sandbox is the resources' to destroy", async () => {
    const [id] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "oracle", sandbox: "own" } },
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
    const run = (await fleet.deps.store.get(id!))!.receipts.run!;
    expect(run.ownedSandbox?.released).toMatchObject({ confirmed: true, scope: "sandbox" });
    expect(run.ownedSandbox!.handle.owner).toBe("agent");
    expect(run.ownedSandbox!.released.at).toBeLessThanOrEqual(run.stoppedAt);
    // The task sandbox was left to its owner: close found it alive and destroyed it itself.
    const close = (await fleet.deps.store.get(id!))!.receipts.close!;
    expect(close.cleanup).toMatchObject({ confirmed: true, scope: "sandbox", alreadyGone: false });
    expect(await containersOf([id!])).toBe(0);
  });

  it("a task whose image does not exist fails as invalid_task at the worker, its teardown confirmed at once", async () => {
    const [id] = await fleet.submit([
      oracle({ ...byId("hello-file"), image: "rollout-fleet/no-such-image:0" }),
    ]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({
      status: "failed",
      failureKind: "invalid_task",
      stage: "seed",
      reward: null,
      mask: false,
      // No sandbox was made: nothing for the janitor, no intent left to wait out.
      teardown: "confirmed",
      // Nothing ran: what was never measured is null, never a zero (rule 12).
      exitCode: null,
      usage: null,
      timings: { runMs: null, verifyMs: null },
    });
    expect(await fleet.deps.ledger.isPending(id!)).toBe(false);
  });

  it("a sandbox sharing the host PID namespace is refused as final isolation_refused", async () => {
    const [id] = await fleet.submit([{ ...oracle(byId("hello-file")), sandbox: { pidMode: "host" } }]);
    allIds.push(id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({ status: "failed", failureKind: "isolation_refused", stage: "seed" });
    expect(r!.failures.filter((f) => f.stage === "seed")).toHaveLength(1); // not retried
  });

  it("cancel mid-run ends cancelled, with close run and no sandbox left", async () => {
    const [id] = await fleet.submit([
      { task: byId("hello-file"), agent: { harness: "command", argv: ["sleep", "60"] } },
    ]);
    allIds.push(id!);
    await waitFor(async () => (await fleet.deps.store.get(id!))?.fence?.startsWith("launched") === true);
    await fleet.deps.store.requestCancel(id!);
    await fleet.deps.store.recordFailure(id!, {
      stage: "run",
      terminal: true,
      failureKind: "cancelled",
      mask: false,
      reason: "cancelled by request",
      at: Date.now(),
    });
    await fleet.deps.queues.enqueue("close", id!);
    const [r] = await fleet.waitForResults([id!]);
    expect(r).toMatchObject({
      status: "cancelled",
      failureKind: "cancelled",
      teardown: "confirmed",
      reward: null,
    });
    expect(await containersOf([id!])).toBe(0);
  });

  it("a run the rollout's deadline would cut before its agent's timeout and the tests is masked before its agent starts, a quick agent as a slow one (rule 6: no mask a policy chooses by being slow)", async () => {
    // hello-file: the agent's 60 s, the tests' 30 s, 8 s to stop and grade, and 10 s before the
    // run starts. A deadline shorter than those 108 s is refused at admission (it could only mask).
    await expect(fleet.submit([{ ...oracle(byId("hello-file")), deadlineS: 107.9 }])).rejects.toMatchObject({
      code: "invalid",
      message: expect.stringMatching(/deadlineS 107\.9 s is shorter than the 108 s a rollout needs/),
    });
    // Admitted with 108 s, then kept waiting 15 s for a worker (no workers run in this fleet; the
    // stages run by hand, the run's clock 15 s on): 93 s left at its start. Started, the oracle
    // would be graded 1.0 and the sleeper cut and masked: masks that only slow agents get.
    const waiting = await startInProcessFleet({ provider: docker, startWorkers: false });
    try {
      const ids = await waiting.submit([
        { ...oracle(byId("hello-file")), deadlineS: 108 },
        { task: byId("hello-file"), agent: { harness: "command", argv: ["sleep", "60"] }, deadlineS: 108 },
      ]);
      const job = (id: string) => ({ data: { rolloutId: id }, attemptsMade: 0, opts: { attempts: 3 } });
      const late = { ...waiting.deps, now: () => Date.now() + 15_000 };
      for (const id of ids) {
        expect(await runStageJob("seed", job(id), waiting.deps)).toBe("ok");
        await expect(runStageJob("run", job(id), late)).rejects.toBeInstanceOf(UnrecoverableError);
        await runStageJob("close", job(id), waiting.deps);
      }
      for (const r of await waiting.deps.store.getResults(ids)) {
        expect(r).toMatchObject({
          status: "masked",
          mask: true,
          failureKind: "deadline_exceeded",
          stage: "run",
          reward: null,
          teardown: "confirmed",
          agentLaunches: 0,
        });
        expect(r!.reason).toMatch(
          /^the rollout's deadline leaves \d+(\.\d)? s, less than the 98 s that the agent's timeout \(60 s\), the tests' \(30 s\) and stopping and grading \(8 s\) need: the agent was not started/,
        );
      }
      expect(await containersOf(ids)).toBe(0);
    } finally {
      await waiting.close();
    }
  });
});

describe("failed teardown is persisted and retried by the janitor", () => {
  it("reports teardown pending, then the janitor confirms it and the reward is unchanged", async () => {
    const flaky = new FlakyDestroyProvider(docker, 1);
    const fleet = await startInProcessFleet({ provider: flaky, deps: { intentGraceMs: 0 } });
    try {
      suite ??= await loadSuite(EXAMPLE_SUITE_DIR);
      const [id] = await fleet.submit([oracle(byId("hello-file"))]);
      const [r] = await fleet.waitForResults([id!]);
      expect(r).toMatchObject({
        status: "completed",
        reward: 1,
        teardown: "pending",
        failureKind: "teardown_failed",
      });
      expect(await fleet.deps.ledger.size()).toBe(1);
      expect(await containersOf([id!])).toBe(1);
      // The ledger entry is due after a backoff; run the janitor as if that time had come.
      const later = { ...fleet.deps, now: () => Date.now() + 10 * 60_000 };
      const report = await janitorTick(later, { orphanGraceMs: 60_000 });
      expect(report.confirmed).toBe(1);
      expect(await fleet.deps.ledger.size()).toBe(0);
      expect(await containersOf([id!])).toBe(0);
      const after = await fleet.deps.store.getResult(id!);
      expect(after).toMatchObject({
        status: "completed",
        reward: 1,
        teardown: "confirmed",
        failureKind: null,
      });
    } finally {
      await fleet.close();
    }
  });
});

describe("no host fallback", () => {
  it("with the sandbox provider unreachable, the rollout is held, masked once past its deadline, and nothing runs on the host", async () => {
    const dead = new DockerSandboxProvider({ docker: { socketPath: "/tmp/fleet-no-daemon-here.sock" } });
    const fleet = await startInProcessFleet({ provider: dead });
    try {
      suite ??= await loadSuite(EXAMPLE_SUITE_DIR);
      const marker = `/tmp/fleet-host-fallback-${Date.now()}`;
      // Timeouts as short as a task has (1 s each), so the shortest deadline it admits is 20 s.
      const quick = { ...byId("hello-file"), timeouts: { agentS: 1, verifierS: 1 } };
      const [id] = await fleet.submit([
        { task: quick, agent: { harness: "command", argv: ["touch", marker] }, deadlineS: 20 },
      ]);
      // The provider breaker holds the seed (no daemon answers a listing either) and stops
      // taking seeds: the rollout waits out its deadline, and the watchdog (the janitor's, run
      // here by hand) closes it, masked.
      await vi.waitFor(
        async () => {
          await janitorTick(fleet.deps, { orphanGraceMs: 60_000, watchdogGraceMs: 0 });
          expect(await fleet.deps.store.getResults([id!])).not.toEqual([null]);
        },
        { timeout: 45_000, interval: 250 },
      );
      const [r] = await fleet.waitForResults([id!], 10_000);
      expect(fleet.workers!.providerDown).toBe(true);
      expect(r).toMatchObject({ status: "masked", mask: true, reward: null, stage: "seed" });
      expect(["provider_unavailable", "deadline_exceeded"]).toContain(r!.failureKind);
      expect(r!.failures.some((f) => f.failureKind === "provider_unavailable")).toBe(true);
      expect(existsSync(marker)).toBe(false);
    } finally {
      await fleet.close();
    }
  });
});

describe("idempotency and fencing without workers", () => {
  let fleet: InProcessFleet;
  beforeAll(async () => {
    suite ??= await loadSuite(EXAMPLE_SUITE_DIR);
    fleet = await startInProcessFleet({ provider: docker, startWorkers: false });
  });
  afterAll(async () => {
    await fleet.close();
    // Each test here closes its rollouts itself and checks that no sandbox is left; one that
    // failed midway left its sandbox, which must not outlive the run.
    for (const s of await docker.list()) await docker.destroy(s.handle);
  });

  const job = (id: string, attemptsMade = 0) => ({
    data: { rolloutId: id },
    attemptsMade,
    opts: { attempts: 3 },
  });

  /** Close the rollout as the resources worker would; its result, and no sandbox left. */
  /** An oracle rollout of hello-file with this test.sh (90 s of budget), seeded and run: its id and sandbox. */
  const ranWithTests = async (name: string, testSh: string) => {
    const task = {
      ...byId("hello-file"),
      id: `${name}-${Date.now()}`,
      timeouts: { agentS: 30, verifierS: 90 },
      tests: { "test.sh": testSh },
    };
    const [id] = await fleet.submit([oracle(task)]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    return { id, handle: (await fleet.deps.store.get(id!))!.receipts.seed!.handle };
  };

  /** How many of root's processes in the sandbox run `sleep <seconds>` (the tests'), as text. */
  const rootSleeping = async (handle: SandboxHandle, seconds: number) =>
    (
      await fleet.deps.provider.exec(
        handle,
        ["sh", "-c", `ps -o args= -u 0 | grep -c '^[s]leep ${seconds}$'`],
        { deadlineMs: 10_000, user: ROOT_USER },
      )
    ).stdout.trim();

  /** The sandbox's verify fence, read as root (the tests' staging and runner read it so). */
  const readFence = (handle: SandboxHandle) =>
    fleet.deps.provider.exec(handle, ["cat", VERIFY_FENCE_FILE], { deadlineMs: 10_000, user: ROOT_USER });

  /**
   * A sandbox whose verify fence cannot be raised: its directory made read-only by its owner, as
   * on a sandbox made before it had one.
   */
  const makeUnfenceable = async (handle: SandboxHandle) => {
    const r = await fleet.deps.provider.exec(handle, ["chmod", "0555", VERIFY_FENCE_DIR], {
      deadlineMs: 10_000,
      user: KEEPALIVE_USER,
    });
    expect(r.exitCode).toBe(0);
  };

  /**
   * A rollout ready to verify, whose tests append a line to /tmp/runs (`runs` reads it), and its
   * first verify attempt A (`a`): it noted its tests and is paused before its runner's exec
   * reaches the sandbox, until `resume` opens.
   */
  const verifyPausedAtRunner = async (name: string) => {
    const { id, handle } = await ranWithTests(name, "#!/bin/sh\necho ran >> /tmp/runs\nexit 0\n");
    const runs = async () =>
      (await fleet.deps.provider.exec(handle, ["cat", "/tmp/runs"], { deadlineMs: 10_000, user: ROOT_USER }))
        .stdout;
    const reached = latch();
    const resume = latch();
    const pausedA = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        exec: async (...a: Parameters<SandboxProvider["exec"]>) => {
          if (a[1] === RUN_TESTS_ARGV) {
            reached.open();
            await resume.opened;
          }
          return fleet.deps.provider.exec(...a);
        },
      }),
    };
    const a = runStageJob("verify", job(id!), pausedA);
    await reached.opened;
    return { id, handle, runs, a, resume };
  };

  /**
   * A later verify attempt, which Redis gives `epoch`, begins, fences the sandbox (its sweep
   * stopping every root process) and starts its tests (a root `sleep <seconds>`).
   */
  const laterAttemptTakesOver = async (id: string, handle: SandboxHandle, epoch: number, seconds: number) => {
    const { store, provider } = fleet.deps;
    expect(
      (await store.begin(id, "verify", Date.now(), { verifyToken: `attempt-${epoch}` })).verifyEpoch,
    ).toBe(epoch);
    expect(await provider.killProcesses(handle, ROOT_USER, { fenceEpoch: epoch })).toMatchObject({
      fenced: true,
    });
    void provider
      .exec(handle, ["sleep", String(seconds)], { deadlineMs: 120_000, user: ROOT_USER })
      .catch(() => undefined);
    await waitFor(async () => (await rootSleeping(handle, seconds)) === "1");
  };

  /**
   * A (`verifyPausedAtRunner`) was fenced out by B (epoch 2), which verified: the fence holds 2,
   * B's verdict is stored and its tests ran once. A wakes: its runner finds the sandbox fenced
   * past its epoch and starts nothing; A stores nothing, fails nothing. The rollout completes.
   */
  const expectFencedOut = async ({
    id,
    handle,
    runs,
    a,
    resume,
  }: Awaited<ReturnType<typeof verifyPausedAtRunner>>) => {
    const fence = await readFence(handle);
    expect(fence.stdout).toBe("2\n");
    const verified = (await fleet.deps.store.get(id!))!.receipts.verify;
    expect(verified).toMatchObject({ reward: 1 });
    expect(await runs()).toBe("ran\n");
    resume.open();
    await a;
    // B's tests ran; A's did not.
    expect(await runs()).toBe("ran\n");
    expect((await fleet.deps.store.get(id!))!.receipts.verify).toEqual(verified);
    expect(await fleet.deps.store.failureLog(id!)).toEqual([]);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  };

  /**
   * A verify delivered again after an earlier attempt's runner started the tests in the sandbox
   * (cut short: handed back, its exec broken, its verdict not stored) masks the rollout,
   * `verifier_error` (`TESTS_CUT_SHORT`: the runner finds that attempt's `TESTS_STARTED_MARK`),
   * and runs no tests again on the sandbox they changed; close reports it.
   */
  const expectCutShort = async (id: string, deps: PipelineDeps = fleet.deps) => {
    await expect(runStageJob("verify", job(id, 1), deps)).rejects.toThrow(TESTS_CUT_SHORT);
    await closeExpecting(id, { status: "masked", failureKind: "verifier_error", reward: null });
  };

  /**
   * The fleet's deps with a provider that notes when tests are staged (`staged`, epoch ms) and
   * which users' processes it was asked to sweep (`swept`).
   */
  const watchStaging = () => {
    const staged: number[] = [];
    const swept: string[] = [];
    /** The sweeps' receipts, as they answered. */
    const sweeps: CleanupReceipt[] = [];
    /** Sweeps (ended) and stagings of the tests (begun), in their order. */
    const order: Array<"swept" | "staged"> = [];
    const deps = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (...a: Parameters<SandboxProvider["put"]>) => {
          if (a[1] === "/tests") {
            staged.push(Date.now());
            order.push("staged");
          }
          return fleet.deps.provider.put(...a);
        },
        killProcesses: async (...a: Parameters<SandboxProvider["killProcesses"]>) => {
          swept.push(a[1] ?? "");
          return fleet.deps.provider
            .killProcesses(...a)
            .then((receipt) => {
              sweeps.push(receipt);
              return receipt;
            })
            .finally(() => order.push("swept"));
        },
      }),
    };
    return { deps, staged, swept, sweeps, order };
  };

  /**
   * A verify delivered again (attempt 1) whose root sweep never answers (a hung daemon: it may
   * yet land) is handed back until its claim on the sweep (30 s) lapses at the earliest, having
   * staged nothing.
   */
  const expectHeldByUnansweredSweep = async (id: string) => {
    const { deps: watching, staged } = watchStaging();
    const hung = {
      ...watching,
      provider: Object.assign(Object.create(watching.provider) as SandboxProvider, {
        killProcesses: (...a: Parameters<SandboxProvider["killProcesses"]>) =>
          a[1] === ROOT_USER ? new Promise<never>(() => undefined) : watching.provider.killProcesses(...a),
      }),
    };
    const began = Date.now();
    const err = await runStageJob("verify", job(id, 1), hung).catch((e: unknown) => e);
    expect(isDeferral(err)).toBe(true);
    expect((err as DeferralError).until).toBeGreaterThanOrEqual(began + 30_000);
    expect(staged).toEqual([]);
  };

  /**
   * `docker`, whose create of `owner`'s sandbox makes it and then throws, as a worker that died
   * before recording its handle; `intentAtCreate` is the sandbox entry (`key`) it found then.
   */
  const diesAfterCreate = (owner: "resources" | "agent", key: string) => {
    let found: unknown = "create never called";
    const provider = Object.assign(Object.create(docker) as SandboxProvider, {
      create: async (...a: Parameters<SandboxProvider["create"]>) => {
        if (a[0].owner !== owner) return docker.create(...a);
        found = await fleet.deps.ledger.getSandbox(key);
        await docker.create(...a);
        throw new Error("the worker died here");
      },
    });
    return { provider, intentAtCreate: () => found };
  };

  const closeExpecting = async (id: string, result: Record<string, unknown>) => {
    await runStageJob("close", job(id), fleet.deps);
    expect(await fleet.deps.store.getResult(id)).toMatchObject(result);
    expect(await containersOf([id])).toBe(0);
  };

  it("no agent process is alive when verify starts: the tests never share the sandbox with the agent (rule 2)", async () => {
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: {
          harness: "command",
          argv: [
            "sh",
            "-c",
            "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & nohup sleep 1001 >/dev/null 2>&1 & sleep 1000",
          ],
          timeoutS: 2,
        },
      },
    ]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    const seen: string[] = [];
    const looking = {
      ...fleet.deps,
      verify: async (ctx: Parameters<typeof verify>[0]) => {
        const ps = await ctx.provider.exec(ctx.handle, ["ps", "-u", "1000", "-o", "pid=,args="], {
          deadlineMs: 10_000,
          user: ROOT_USER,
        });
        seen.push(ps.stdout.trim());
        return verify(ctx);
      },
    };
    expect(await runStageJob("verify", job(id!), looking)).toBe("ok");
    expect(seen).toEqual([""]);
    await closeExpecting(id!, { status: "completed", reward: 0, failureKind: "agent_timeout" });
  });

  it("an agent that stops its own timeout (SIGSTOP) is killed at its deadline and its kill grace all the same, and graded on what it left then", async () => {
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: {
          harness: "command",
          // Its parent is the `timeout` that enforces its deadline, under its own user: stopped,
          // it would run on until the provider's own timer (deadline + grace + 5 s slack).
          argv: ["sh", "-c", "kill -STOP $PPID; sleep 7; printf 'Hello, fleet!\\n' > hello.txt; sleep 100"],
          timeoutS: 2,
        },
      },
    ]);
    for (const stage of ["seed", "run", "verify"] as const) await runStageJob(stage, job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 0, failureKind: "agent_timeout", exitCode: -1 });
    // Ended at its deadline (2 s), the kill grace (2 s) and the sweep's 0.5 s, with Docker calls
    // on either side (seconds on a loaded host), not at the provider's own timer (9 s).
    expect((await fleet.deps.store.getResult(id!))?.timings.agentMs).toBeLessThan(8_000);
  });

  it("an agent that takes all it can past its deadline (it ignores SIGTERM) takes none of the fleet's own time: run with the least budget a run starts with, and 4.1 s of slow staging, its hung tests are graded 0, not cut and masked (rule 6)", async () => {
    const task = {
      ...byId("hello-file"),
      id: `slow-stop-${Date.now()}`,
      timeouts: { agentS: 1, verifierS: 4 },
      // The agent's work hangs the tests: graded 0 when they run out of their own 4 s.
      tests: { "test.sh": "#!/bin/bash\nsleep 100\n" },
    };
    const [id] = await fleet.submit([
      { task, agent: { harness: "command", argv: ["sh", "-c", "trap '' TERM; sleep 100"] }, deadlineS: 600 },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    // The fleet's clock moved on so that the run starts with the least a run needs left (the
    // agent's 1 s, the tests' 4 s and the margin) and 1 s for its setup before the agent starts.
    const deadlineAt = (await fleet.deps.store.get(id!))!.meta.deadlineAt;
    const shift = deadlineAt - ((1 + 4) * 1000 + RUN_MARGIN_MS + 1_000) - Date.now();
    const late = { ...fleet.deps, now: () => Date.now() + shift };
    await runStageJob("run", job(id!), late);
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    const run = (await fleet.deps.store.get(id!))!.receipts.run!;
    expect(run.exec.timedOut).toBe(true);
    // Its overrun: killed at its deadline and the kill grace, not at its deadline.
    expect(run.exec.durationMs).toBeGreaterThanOrEqual(1_000 + KILL_GRACE_S * 1000 - 100);
    // Staging the tests is slow (a loaded host): 4.1 s of the fleet's 5 s. With the margin 5 s,
    // the agent's overrun in it, the tests would start with at most 11 - 3 - 4.1 = 3.9 s left,
    // less than their 4 s: cut by the rollout's deadline, and masked.
    const provider = fleet.deps.provider;
    const slowStaging = new Proxy(provider, {
      get(target, prop) {
        if (prop === "put") {
          return async (...args: Parameters<typeof provider.put>) => {
            if (args[1] === SANDBOX_PATHS.tests) await sleep(4_100);
            return target.put(...args);
          };
        }
        const value: unknown = Reflect.get(target, prop, target);
        return typeof value === "function" ? value.bind(target) : value;
      },
    });
    await runStageJob("verify", job(id!), { ...late, provider: slowStaging });
    await closeExpecting(id!, { status: "completed", reward: 0, failureKind: "agent_timeout", exitCode: -1 });
    expect((await fleet.deps.store.get(id!))!.receipts.verify?.details).toMatchObject({ source: "timeout" });
  });

  it("the deadline's own kill counts from when the agent starts: a slow setup before it (the instruction's put) neither kills nor times out an agent that ends in time", async () => {
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: {
          harness: "command",
          argv: ["sh", "-c", "printf 'Hello, fleet!\\n' > hello.txt"],
          timeoutS: 2,
        },
      },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    // The harness's setup takes longer than the agent's budget and the kill grace.
    const provider = fleet.deps.provider;
    const slowSetup = new Proxy(provider, {
      get(target, prop) {
        if (prop === "put") {
          return async (...args: Parameters<typeof provider.put>) => {
            await sleep(5_000);
            return target.put(...args);
          };
        }
        const value: unknown = Reflect.get(target, prop, target);
        return typeof value === "function" ? value.bind(target) : value;
      },
    });
    await runStageJob("run", job(id!), { ...fleet.deps, provider: slowSetup });
    await runStageJob("verify", job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1, failureKind: null, exitCode: 0 });
  });

  it("tests ended by a signal grade 0 while the sandbox is there, and mask sandbox_lost when it is gone (rule 6)", async () => {
    const ids = await fleet.submit([oracle(byId("hello-file")), oracle(byId("hello-file"))]);
    for (const id of ids)
      for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id), fleet.deps);
    const killedTests = (destroyFirst: boolean) => ({
      ...fleet.deps,
      verify: async (ctx: Parameters<typeof verify>[0]) => {
        if (destroyFirst) await ctx.provider.destroy(ctx.handle);
        return { reward: 0, details: { kind: "tests", exitCode: 137 } };
      },
    });
    const [alive, gone] = ids as [string, string];
    expect(await runStageJob("verify", job(alive), killedTests(false))).toBe("ok");
    await closeExpecting(alive, { status: "completed", reward: 0, mask: false });
    await expect(runStageJob("verify", job(gone, 6), killedTests(true))).rejects.toThrow(/sandbox_lost/);
    await closeExpecting(gone, { status: "masked", reward: null, failureKind: "sandbox_lost" });
  });

  it("a seed whose sandbox dies under its staging is retried in a new one, never failed as the task's (rule 6); under a cancel's close it just ends", async () => {
    // A task with workspace files to stage.
    const [id, cancelled] = await fleet.submit([
      oracle(byId("python-bugfix")),
      oracle(byId("python-bugfix")),
    ]);
    // The staging's exec meets a sandbox going away: runc's exit 126, which reads as the task's.
    const dying = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (...a: Parameters<SandboxProvider["put"]>) => {
          if (a[1] !== "/workspace") return fleet.deps.provider.put(...a);
          await fleet.deps.provider.destroy(a[0]);
          throw FleetError.nonRetryable(
            "invalid_task",
            "staging 1 file(s) into /workspace as 1000:1000 failed (exit 126)",
          );
        },
      }),
    };
    const err = await runStageJob("seed", job(id!), dying).catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: "sandbox_lost", retryable: true });
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    expect(await runStageJob("seed", job(id!, 1), fleet.deps)).toBe("ok");
    for (const stage of ["run", "verify"] as const) await runStageJob(stage, job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1 });

    // A cancel (its dispatcher died before it enqueued close) and the sandbox gone under the
    // staging: no failure, no retry, and close enqueued by the seed.
    const closing = {
      ...dying,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (...a: Parameters<SandboxProvider["put"]>) => {
          if (a[1] !== "/workspace") return fleet.deps.provider.put(...a);
          await fleet.deps.store.requestCancel(cancelled!);
          return dying.provider.put(...a);
        },
      }),
    };
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(cancelled!, "close"))).toBeUndefined();
    expect(await runStageJob("seed", job(cancelled!), closing)).toBe("ok");
    expect((await fleet.deps.store.failureLog(cancelled!)).length).toBe(0);
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(cancelled!, "close"))).toBeDefined();
    await closeExpecting(cancelled!, { status: "cancelled" });
  });

  it("a seed whose new sandbox is gone by its probe (the provider's own final sandbox_lost) is retried in a new one, never masked at once (rule 6)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    // The container is removed from outside between its create and the isolation probe: the
    // provider's probe finds it gone.
    const gone = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        probe: async (h: SandboxHandle) => {
          await fleet.deps.provider.destroy(h);
          return fleet.deps.provider.probe(h);
        },
      }),
    };
    const err = await runStageJob("seed", job(id!), gone).catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: "sandbox_lost", retryable: true });
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    expect(await runStageJob("seed", job(id!, 1), fleet.deps)).toBe("ok");
    for (const stage of ["run", "verify"] as const) await runStageJob(stage, job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a run whose own sandbox is gone by its probe (the provider's own final sandbox_lost) is retried in a new one, as a seed is, never masked at once (rule 6)", async () => {
    const [id] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "oracle", sandbox: "own" } },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    // The agent's own sandbox is removed from outside between its create and its isolation probe.
    const made: SandboxHandle[] = [];
    const gone = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        probe: async (h: SandboxHandle) => {
          made.push(h);
          await fleet.deps.provider.destroy(h);
          return fleet.deps.provider.probe(h);
        },
      }),
    };
    const err = await runStageJob("run", job(id!), gone).catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: "sandbox_lost", retryable: true });
    expect(made.map((h) => h.owner)).toEqual(["agent"]);
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    await runStageJob("verify", job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a run whose own sandbox is gone by its staging (a put into a removed container) is retried in a new one, never masked at once nor failed as the task's (rule 6)", async () => {
    const task = byId("sum-answer");
    expect(Object.keys(task.workspace)).not.toEqual([]); // something to stage
    const [id] = await fleet.submit([{ task, agent: { harness: "oracle", sandbox: "own" } }]);
    await runStageJob("seed", job(id!), fleet.deps);
    // The agent's own sandbox passes its probe, then is removed from outside before staging.
    const staged: SandboxHandle[] = [];
    const gone = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (
          h: SandboxHandle,
          ...rest: Parameters<SandboxProvider["put"]> extends [unknown, ...infer R] ? R : never
        ) => {
          staged.push(h);
          await fleet.deps.provider.destroy(h);
          return fleet.deps.provider.put(h, ...rest);
        },
      }),
    };
    const err = await runStageJob("run", job(id!), gone).catch((e: unknown) => e);
    expect(err).toMatchObject({ kind: "sandbox_lost", retryable: true });
    expect(staged.map((h) => h.owner)).toEqual(["agent"]);
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    await runStageJob("verify", job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("an answer longer than the fleet keeps is graded 0 by a match verifier, though its kept head matches (the whole does not)", async () => {
    const task = {
      ...byId("sum-answer"),
      verifier: { kind: "match" as const, expected: "[^!]+", mode: "regex" as const },
    };
    const [id] = await fleet.submit([
      { task, agent: { harness: "command", argv: ["python3", "-c", "print('a' * 5000 + '!')"] } },
    ]);
    for (const stage of ["seed", "run", "verify"] as const) await runStageJob(stage, job(id!), fleet.deps);
    await closeExpecting(id!, {
      status: "completed",
      reward: 0,
      details: expect.objectContaining({ kind: "match", matched: false, answerTruncated: true }),
    });
  });

  it("close hands an agent's own sandbox it finds (its worker died holding it) to the janitor, never destroys it itself (rule 11)", async () => {
    const task = byId("sum-answer");
    const [id] = await fleet.submit([
      { task, agent: { harness: "command", argv: ["true"], sandbox: "own" } },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    // The agent worker made its own sandbox, recorded it, and died before it released it.
    const deadlineAt = (await fleet.deps.store.get(id!))!.meta.deadlineAt;
    const handle = await fleet.deps.provider.create({
      image: task.image,
      rolloutId: id!,
      owner: "agent",
      expiresAt: deadlineAt + 60_000,
    });
    const entry = {
      key: sandboxKey(id!, "agent"),
      rolloutId: id!,
      owner: "agent" as const,
      provider: handle.provider,
      handle,
      createdAt: Date.now(),
      expiresAt: deadlineAt + 60_000,
    };
    expect(await fleet.deps.ledger.recordIntent(entry)).toBe("ok");
    await fleet.deps.store.requestCancel(id!);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({ status: "cancelled", teardown: "pending" });
    // Still there: the janitor's to destroy, from the ledger.
    expect(await fleet.deps.provider.find(id!, "agent")).not.toBeNull();
    expect(await fleet.deps.ledger.isPending(id!)).toBe(true);
    const later = { ...fleet.deps, now: () => Date.now() + 10 * 60_000 };
    await janitorTick(later, { orphanGraceMs: 60_000 });
    expect(await fleet.deps.provider.find(id!, "agent")).toBeNull();
    expect(await containersOf([id!])).toBe(0);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "cancelled",
      teardown: "confirmed",
    });
  });

  it("a stage taken for the first time past the rollout's deadline does not start: it closes the rollout, masked deadline_exceeded (rules 1, 5)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    const deadlineAt = (await fleet.deps.store.get(id!))!.meta.deadlineAt;
    const late = { ...fleet.deps, now: () => deadlineAt + 1 };
    let staged = 0;
    late.provider = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      put: async (...a: Parameters<SandboxProvider["put"]>) => {
        staged++;
        return fleet.deps.provider.put(...a);
      },
    });
    expect(await runStageJob("verify", job(id!), late)).toBe("skipped");
    expect(staged).toBe(0);
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(id!, "close"))).toBeDefined();
    await closeExpecting(id!, { status: "masked", failureKind: "deadline_exceeded", reward: null });

    // A seed past its deadline makes no sandbox and records no intent.
    const [seedLate] = await fleet.submit([oracle(byId("hello-file"))]);
    const seedDeadline = (await fleet.deps.store.get(seedLate!))!.meta.deadlineAt;
    expect(await runStageJob("seed", job(seedLate!), { ...fleet.deps, now: () => seedDeadline + 1 })).toBe(
      "skipped",
    );
    expect(await containersOf([seedLate!])).toBe(0);
    expect((await fleet.deps.ledger.sandboxesOf(seedLate!)).resources).toBeNull();
    await closeExpecting(seedLate!, { status: "masked", failureKind: "deadline_exceeded" });
  });

  it("a stage job that finds a failure recorded and no close job enqueues close itself (rule 1: close always runs)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    // A failure recorded by a worker that died before it enqueued close.
    await fleet.deps.store.recordFailure(id!, {
      stage: "run",
      terminal: true,
      failureKind: "agent_error",
      mask: false,
      reason: "recorded by a worker that died before its close enqueue (the test)",
      at: Date.now(),
    });
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(id!, "close"))).toBeUndefined();
    expect(await runStageJob("run", job(id!), fleet.deps)).toBe("skipped");
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(id!, "close"))).toBeDefined();
    await closeExpecting(id!, { status: "failed", failureKind: "agent_error" });
  });

  it("a run whose kill sweep fails (throws) stores no run receipt and is retried: never verified unconfirmed (rules 2, 10)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const sweepFails = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async () => {
          throw FleetError.retryable("provider_unavailable", "the sweep's exec failed (the test)");
        },
      }),
    };
    await expect(runStageJob("run", job(id!), sweepFails)).rejects.toThrow(/the sweep's exec failed/);
    const rec = (await fleet.deps.store.get(id!))!;
    expect(rec.receipts.run).toBeUndefined();
    expect(rec.times["verify:start"]).toBeUndefined();
    expect(await fleet.deps.queues.queues.verify.getJob(stageJobId(id!, "verify"))).toBeUndefined();
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    expect((await fleet.deps.store.get(id!))!.receipts.run!.cleanup.confirmed).toBe(true);
    await runStageJob("verify", job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a retryable failure is retried only while its next attempt can start before the rollout's one deadline (rule 5)", async () => {
    // The shortest deadline hello-file admits: 108 s (its agent's 60, its tests' 30, 8, and 10).
    const [late] = await fleet.submit([{ ...oracle(byId("hello-file")), deadlineS: 108 }]);
    const [early] = await fleet.submit([oracle(byId("hello-file"))]);
    // Both before their deadlines; `late`'s next attempt (1 s of backoff) would start after its own.
    const at = (await fleet.deps.store.get(late!))!.meta.deadlineAt - 500;
    const daemonDown = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      create: async () => {
        throw FleetError.retryable("provider_unavailable", "the daemon is restarting");
      },
    });
    const deps = { ...fleet.deps, provider: daemonDown, now: () => at };
    const lateErr = await runStageJob("seed", job(late!), deps).catch((e: unknown) => e);
    expect(lateErr).toBeInstanceOf(UnrecoverableError);
    expect((await fleet.deps.store.get(late!))!.failure).toMatchObject({
      failureKind: "provider_unavailable",
      terminal: true,
    });
    const earlyErr = await runStageJob("seed", job(early!), deps).catch((e: unknown) => e);
    expect(earlyErr).not.toBeInstanceOf(UnrecoverableError);
    expect(earlyErr).toMatchObject({ kind: "provider_unavailable", retryable: true });
    expect((await fleet.deps.store.get(early!))!.failure).toBeNull();
    // Closed here: their seed jobs stay queued, and a later test's workers would take them.
    for (const id of [late!, early!]) await runStageJob("close", job(id), fleet.deps);
    expect(await containersOf([late!, early!])).toBe(0);
  });

  it("failure records are facts (rule 12): each keeps its stage, terminal flag, failure kind, its own mask and a bounded reason", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    let creates = 0;
    // The first create meets a daemon restarting (infrastructure: masked kind, retried), the
    // second a refusal no retry can fix (final, not masked): the result is failed, and its log
    // still says the first failure was an infrastructure one.
    const provider = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      create: async () => {
        creates++;
        throw creates === 1
          ? FleetError.retryable("provider_unavailable", `the daemon is restarting ${"x".repeat(10_000)}`)
          : FleetError.nonRetryable("isolation_refused", "the sandbox shares the host's PID namespace");
      },
    });
    const deps = { ...fleet.deps, provider };
    const first = await runStageJob("seed", job(id!), deps).catch((e: unknown) => e);
    expect(first).toMatchObject({ kind: "provider_unavailable", retryable: true });
    const second = await runStageJob("seed", job(id!, 1), deps).catch((e: unknown) => e);
    expect(second).toBeInstanceOf(UnrecoverableError);
    expect(creates).toBe(2);
    // No sandbox was made: the intent's grace need not be waited out.
    await runStageJob("close", job(id!), { ...fleet.deps, intentGraceMs: 0 });
    const r = await fleet.deps.store.getResult(id!);
    expect(r).toMatchObject({
      status: "failed",
      mask: false,
      reward: null,
      failureKind: "isolation_refused",
      stage: "seed",
    });
    const facts = r!.failures.map(({ stage, terminal, failureKind, mask }) => ({
      stage,
      terminal,
      failureKind,
      mask,
    }));
    expect(facts).toEqual([
      { stage: "seed", terminal: false, failureKind: "provider_unavailable", mask: true },
      { stage: "seed", terminal: true, failureKind: "isolation_refused", mask: false },
    ]);
    expect(r!.failures[0]!.reason).toMatch(/^the daemon is restarting x{100}/);
    expect(r!.failures[0]!.reason.length).toBeLessThanOrEqual(MAX_FIELD_CHARS);
    expect(r!.failures[1]!.reason).toBe("the sandbox shares the host's PID namespace");
    expect(await containersOf([id!])).toBe(0);
  });

  it("a seed that loses the receipt race to another holding the same container (adopted by name) leaves it alone", async () => {
    const [id] = (await fleet.submit([oracle(byId("csv-aggregate"))])) as [string]; // has workspace files
    // Seed A's lock lapsed while its create hung; seed B was delivered, created the rollout's
    // container and stored its receipt. A's create then meets the name and adopts that container.
    const inCreate = latch();
    const released = latch();
    const real = fleet.deps.provider;
    let staged = 0;
    const hung = Object.assign(Object.create(real) as SandboxProvider, {
      create: async (spec: Parameters<SandboxProvider["create"]>[0]) => {
        inCreate.open();
        await released.opened;
        return real.create(spec);
      },
      put: async (...args: Parameters<SandboxProvider["put"]>) => {
        staged++;
        return real.put(...args);
      },
    });
    // A's job was taken 20 s ago: past half its 30 s lock, another worker may have it.
    const a = runStageJob(
      "seed",
      { ...job(id), processedOn: Date.now() - 20_000 },
      { ...fleet.deps, provider: hung },
    );
    await inCreate.opened;
    expect(await runStageJob("seed", job(id, 1), fleet.deps)).toBe("ok");
    const winner = (await fleet.deps.store.get(id))!.receipts.seed!.handle;
    // B's run may be working in it by now: its agent rewrote a task file.
    const file = `/workspace/${Object.keys(byId("csv-aggregate").workspace)[0]}`;
    await real.exec(winner, ["sh", "-c", `echo agent-work > ${file}`], { deadlineMs: 30_000 });
    released.open();
    expect(await a).toBe("superseded");
    // The loser held the rollout's one container: it neither destroyed it (the run would lose
    // its sandbox) nor staged the task into it again (under the running agent).
    expect((await fleet.deps.store.get(id))!.receipts.seed!.handle.id).toBe(winner.id);
    expect(await real.alive(winner)).toBe(true);
    expect(staged).toBe(0);
    const kept = await real.exec(winner, ["cat", file], { deadlineMs: 30_000 });
    expect(kept.stdout.trim()).toBe("agent-work");
    await runStageJob("close", job(id), fleet.deps);
    expect(await containersOf([id])).toBe(0);
  });

  it("an agent whose processes cannot be confirmed stopped is never verified: masked sandbox_lost (rules 2, 10)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    const stubborn = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      killProcesses: async () => ({
        confirmed: false,
        scope: "processes" as const,
        at: Date.now(),
        alreadyGone: false,
        remaining: 2,
      }),
    });
    // A harness that reports what its model calls spent (as the tool-loop does): that survives
    // the failure after it returned.
    const usage = { calls: 3, promptTokens: 30, completionTokens: 9, cachedTokens: 0, gaps: [] };
    const spending: PipelineDeps["createHarness"] = (agent, harnessDeps) => {
      const real = createHarness(agent, harnessDeps);
      return { name: real.name, run: async (ctx) => ({ ...(await real.run(ctx)), usage }) };
    };
    const err = await runStageJob("run", job(id!), {
      ...fleet.deps,
      provider: stubborn,
      createHarness: spending,
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UnrecoverableError);
    expect(String((err as Error).message)).toMatch(/sandbox_lost.*could not be confirmed stopped/);
    const rec = (await fleet.deps.store.get(id!))!;
    expect(rec.receipts.run).toBeUndefined();
    expect(await runStageJob("verify", job(id!), fleet.deps)).toBe("skipped");
    expect((await fleet.deps.store.get(id!))!.times["verify:start"]).toBeUndefined();
    await closeExpecting(id!, {
      status: "masked",
      failureKind: "sandbox_lost",
      reward: null,
      usage,
    });
  });

  it("a run whose rollout has less time left than its agent's own timeout, the tests and the margin never starts its agent: deadline_exceeded, masked; with that much left it starts", async () => {
    // hello-file's tests take up to 30 s; the agent's own budget is 60 s here.
    const [short, enough] = await fleet.submit([
      { task: byId("hello-file"), agent: { harness: "oracle", timeoutS: 60 }, deadlineS: 600 },
      { task: byId("hello-file"), agent: { harness: "oracle", timeoutS: 60 }, deadlineS: 600 },
    ]);
    const { counting, launches } = countingLaunches(fleet.deps);
    /** The deps of a run that starts `leftMs` before the rollout's deadline. */
    const at = async (id: string, leftMs: number) => {
      const deadlineAt = (await fleet.deps.store.get(id))!.meta.deadlineAt;
      return { ...counting, now: () => deadlineAt - leftMs };
    };
    for (const id of [short!, enough!]) expect(await runStageJob("seed", job(id), fleet.deps)).toBe("ok");
    // 1 ms short of 60 s + 30 s + the margin.
    const need = (60 + 30) * 1000 + RUN_MARGIN_MS;
    const err = await runStageJob("run", job(short!), await at(short!, need - 1)).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UnrecoverableError);
    expect(launches()).toBe(0);
    expect((await fleet.deps.store.get(short!))!.failure).toMatchObject({
      failureKind: "deadline_exceeded",
      stage: "run",
      reason: expect.stringMatching(
        /^the rollout's deadline leaves 97\.9 s, less than the 98 s that the agent's timeout \(60 s\), the tests' \(30 s\) and stopping and grading \(8 s\) need/,
      ),
    });
    await closeExpecting(short!, { status: "masked", failureKind: "deadline_exceeded", reward: null });
    expect(await runStageJob("run", job(enough!), await at(enough!, need))).toBe("ok");
    expect(launches()).toBe(1);
    await runStageJob("close", job(enough!), fleet.deps);

    // An own sandbox that takes its time to make (a loaded host): the time left is counted
    // again at launch. sum-answer: the agent's 60 s, a match verifier (no tests), 8 s.
    const [own] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "oracle", sandbox: "own" } },
    ]);
    expect(await runStageJob("seed", job(own!), fleet.deps)).toBe("ok");
    const deadlineAt = (await fleet.deps.store.get(own!))!.meta.deadlineAt;
    let clockAt = deadlineAt - (60_000 + RUN_MARGIN_MS); // just enough before the sandbox is made
    const slowCreate = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      create: async (...args: Parameters<SandboxProvider["create"]>) => {
        const made = await fleet.deps.provider.create(...args);
        clockAt += 3_000;
        return made;
      },
    });
    const ownErr = await runStageJob("run", job(own!), {
      ...counting,
      provider: slowCreate,
      now: () => clockAt,
    }).catch((e: unknown) => e);
    expect(ownErr).toBeInstanceOf(UnrecoverableError);
    expect(launches()).toBe(1);
    expect((await fleet.deps.store.get(own!))!.failure).toMatchObject({
      failureKind: "deadline_exceeded",
      reason: expect.stringMatching(/^the rollout's deadline leaves 65 s, less than the 68 s/),
    });
    await closeExpecting(own!, { status: "masked", failureKind: "deadline_exceeded" });
  });

  /** A harness that starts, says so (`started`), and returns exit 0 once `release` is called. */
  const gatedHarness = () => {
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    let markStarted!: () => void;
    const started = new Promise<void>((r) => (markStarted = r));
    const createHarness = () => ({
      name: "oracle" as const,
      async run() {
        markStarted();
        await released;
        return { exec: execResult({ exitCode: 0 }), answer: null, transcript: null, usage: null };
      },
    });
    return { createHarness, started, release };
  };

  it("an agent's own sandbox is probed before anything is staged in it; a refusal fails the rollout for good", async () => {
    const provider = new WatchedProvider(docker);
    const deps = { ...fleet.deps, provider };
    const own = { task: byId("sum-answer"), agent: { harness: "oracle" as const, sandbox: "own" as const } };
    const [id, refused] = await fleet.submit([own, own]);
    expect(await runStageJob("seed", job(id!), deps)).toBe("ok");
    expect(await runStageJob("run", job(id!), deps)).toBe("ok");
    const agentCalls = provider.calls.filter((c) => c.includes(" agent"));
    expect(agentCalls.slice(0, 2)).toEqual(["probe agent", "put agent /workspace"]);
    await runStageJob("verify", job(id!), deps);
    await runStageJob("close", job(id!), deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({ status: "completed", reward: 1 });

    provider.refuseAgentProbe = true;
    provider.calls.length = 0;
    expect(await runStageJob("seed", job(refused!), deps)).toBe("ok");
    await expect(runStageJob("run", job(refused!), deps)).rejects.toThrow(/isolation_refused/);
    expect(provider.calls.filter((c) => c.includes(" agent"))).toEqual(["probe agent"]);
    await runStageJob("close", job(refused!), deps);
    expect(await fleet.deps.store.getResult(refused!)).toMatchObject({
      status: "failed",
      failureKind: "isolation_refused",
      stage: "run",
    });
    // The refused sandbox was its failed run's, destroyed by that run (rule 11): the close
    // destroyed the task's and reports the teardown confirmed, with no janitor pass to wait for.
    expect(await fleet.deps.store.getResult(refused!)).toMatchObject({ teardown: "confirmed" });
    expect(await containersOf([id!, refused!])).toBe(0);
  });

  it("a probe that reports a sandbox not isolated, without throwing, refuses it for good: the task's sandbox as an agent's own, nothing staged in it (rule 4)", async () => {
    /** `docker`, whose probe of `owner`'s sandbox answers "not isolated" instead of throwing. */
    const reportsShared = (owner: "resources" | "agent") => {
      const staged: string[] = [];
      const provider = Object.assign(Object.create(docker) as SandboxProvider, {
        probe: async (h: SandboxHandle) => {
          const report = await docker.probe(h);
          if (h.owner !== owner) return report;
          return { ...report, isolated: false, checks: { ...report.checks, pidNamespaceDiffers: false } };
        },
        put: async (...a: Parameters<SandboxProvider["put"]>) => {
          if (a[0].owner === owner) staged.push(a[1]);
          return docker.put(...a);
        },
      });
      return { provider, staged };
    };
    const own = { task: byId("sum-answer"), agent: { harness: "oracle" as const, sandbox: "own" as const } };
    const [seeded, owned] = await fleet.submit([oracle(byId("hello-file")), own]);

    const task = reportsShared("resources");
    const seedErr = await runStageJob("seed", job(seeded!), { ...fleet.deps, provider: task.provider }).catch(
      (e: unknown) => e,
    );
    expect(seedErr).toBeInstanceOf(UnrecoverableError);
    expect((seedErr as Error).message).toMatch(/^isolation_refused: .*not isolated.*pidNamespaceDiffers/);
    expect(task.staged).toEqual([]);
    await runStageJob("close", job(seeded!), fleet.deps);
    expect(await fleet.deps.store.getResult(seeded!)).toMatchObject({
      status: "failed",
      mask: false,
      reward: null,
      failureKind: "isolation_refused",
      stage: "seed",
    });

    const agent = reportsShared("agent");
    const deps = { ...fleet.deps, provider: agent.provider };
    expect(await runStageJob("seed", job(owned!), deps)).toBe("ok");
    const runErr = await runStageJob("run", job(owned!), deps).catch((e: unknown) => e);
    expect(runErr).toBeInstanceOf(UnrecoverableError);
    expect((runErr as Error).message).toMatch(/^isolation_refused: /);
    expect(agent.staged).toEqual([]);
    expect((await fleet.deps.store.get(owned!))!.receipts.run).toBeUndefined();
    await runStageJob("close", job(owned!), fleet.deps);
    expect(await fleet.deps.store.getResult(owned!)).toMatchObject({
      status: "failed",
      failureKind: "isolation_refused",
      stage: "run",
    });
    // The refused sandbox was its failed run's; close hands it to the janitor (rule 11).
    await janitorTick(fleet.deps, { orphanGraceMs: 10 * 60_000 });
    expect(await containersOf([seeded!, owned!])).toBe(0);
  });

  it("a stored task that no longer parses (stored under a looser schema) fails the rollout for good, not masked after retries", async () => {
    const task = { ...byId("hello-file"), id: `stale-${Date.now()}` };
    const [id] = await fleet.submit([oracle(task)]);
    const { taskDigest } = (await fleet.deps.store.get(id!))!.meta;
    // What an older build accepted: a test.sh that runs nothing.
    await fleet.redis.set(
      fleet.deps.store.keys.task(taskDigest),
      JSON.stringify({ ...TaskContent.parse(task), tests: { "test.sh": "# nothing\n" } }),
    );
    await expect(runStageJob("seed", job(id!), fleet.deps)).rejects.toThrow(
      /invalid_task: stored task .* is no longer valid/,
    );
    expect((await fleet.deps.store.get(id!))!.failure).toMatchObject({
      failureKind: "invalid_task",
      terminal: true,
    });
    expect(await runStageJob("close", job(id!), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "failed",
      failureKind: "invalid_task",
    });
    expect(await containersOf([id!])).toBe(0);
  });

  it("an agent's own sandbox left by an attempt that failed before its harness is replaced and staged, not reused empty", async () => {
    const provider = new WatchedProvider(docker);
    const deps = { ...fleet.deps, provider };
    const [id] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "oracle", sandbox: "own" } },
    ]);
    expect(await runStageJob("seed", job(id!), deps)).toBe("ok");
    provider.failAgentProbeOnce = true;
    await expect(runStageJob("run", job(id!), deps)).rejects.toThrow(/probe timed out/);
    provider.calls.length = 0;
    expect(await runStageJob("run", job(id!, 1), deps)).toBe("ok");
    expect(provider.calls.filter((c) => c.includes(" agent")).slice(0, 2)).toEqual([
      "probe agent",
      "put agent /workspace",
    ]);
    await runStageJob("verify", job(id!), deps);
    await runStageJob("close", job(id!), deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({ status: "completed", reward: 1 });
    expect(await containersOf([id!])).toBe(0);
  });

  it("a rerun with its own sandbox starts in a fresh one: no reset, so an image with workspace files is no mask", async () => {
    const [id] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "oracle", sandbox: "own" } },
    ]);
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    // An image whose /workspace could not be put back (a reset would mask the rollout)...
    const seedReceipt = (await fleet.deps.store.get(id!))!.receipts.seed!;
    seedReceipt.probe.workspaceEmpty = false;
    await fleet.redis.hset(fleet.deps.store.keys.rollout(id!), "r:seed", JSON.stringify(seedReceipt));
    // ...and an earlier launch that died: this attempt is a rerun.
    await fleet.deps.store.claimLaunch(id!, "dead-worker:1");
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    await runStageJob("verify", job(id!), fleet.deps);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a rerun's usage says that the earlier launches' spend is not in it (a gap, not a silent undercount)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    await fleet.deps.store.claimLaunch(id!, "dead-worker:1");
    const usage = { calls: 1, promptTokens: 10, completionTokens: 5, cachedTokens: 0, gaps: [] };
    const spending: PipelineDeps["createHarness"] = (agent, harnessDeps) => {
      const real = createHarness(agent, harnessDeps);
      return { name: real.name, run: async (ctx) => ({ ...(await real.run(ctx)), usage }) };
    };
    expect(await runStageJob("run", job(id!, 1), { ...fleet.deps, createHarness: spending })).toBe("ok");
    await runStageJob("verify", job(id!), fleet.deps);
    await closeExpecting(id!, {
      status: "completed",
      agentLaunches: 2,
      usage: {
        ...usage,
        gaps: [expect.stringMatching(/^1 earlier launch\(es\) of this rollout not counted here/)],
      },
    });
    // A rerun that fails, its error carrying its usage: the same gap.
    const [failed] = await fleet.submit([oracle(byId("hello-file"))]);
    expect(await runStageJob("seed", job(failed!), fleet.deps)).toBe("ok");
    await fleet.deps.store.claimLaunch(failed!, "dead-worker:1");
    const failing: PipelineDeps["createHarness"] = (agent) => ({
      name: agent.harness,
      run: async () => {
        throw withUsage(FleetError.nonRetryable("agent_error", "the agent's spec is wrong"), usage);
      },
    });
    await runStageJob("run", job(failed!, 1), { ...fleet.deps, createHarness: failing }).catch(
      () => undefined,
    );
    await closeExpecting(failed!, {
      status: "failed",
      usage: {
        ...usage,
        gaps: [expect.stringMatching(/^1 earlier launch\(es\) of this rollout not counted here/)],
      },
    });
  });

  it("a re-delivered seed that finds the earlier attempt's sandbox stopped replaces it instead of probing it to death", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    // The first attempt recorded its intent and created the sandbox, whose container then
    // stopped (its worker died between create and start, say).
    await fleet.deps.store.begin(id!, "seed", Date.now(), beginOptions("seed", fleet.deps));
    const first = await docker.create({
      image: IMAGE,
      rolloutId: id!,
      owner: "resources",
      expiresAt: Date.now() + 600_000,
    });
    execFileSync("docker", ["stop", "-t", "0", first.id], { stdio: "pipe", timeout: 60_000 });
    expect(await docker.alive(first)).toBe(false);
    expect(await runStageJob("seed", job(id!, 1), fleet.deps)).toBe("ok");
    const seeded = (await fleet.deps.store.get(id!))!.receipts.seed!;
    expect(seeded.handle.id).not.toBe(first.id);
    expect(seeded.reused).toBe(false);
    expect(await docker.alive(seeded.handle)).toBe(true);
    expect(await containersOf([id!])).toBe(1);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await containersOf([id!])).toBe(0);
  });

  it("a re-delivered seed replays its receipt instead of creating a second sandbox", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    const first = (await fleet.deps.store.get(id!))!.receipts.seed!.handle;
    expect(await runStageJob("seed", job(id!, 1), fleet.deps)).toBe("replayed");
    expect((await fleet.deps.store.get(id!))!.receipts.seed!.handle.id).toBe(first.id);
    expect(await containersOf([id!])).toBe(1);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await containersOf([id!])).toBe(0);
  });

  it("a seed that dies between creating its sandbox and recording its handle left the intent first: close destroys the sandbox by it (rule 9)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    const key = sandboxKey(id!, "resources");
    const dies = diesAfterCreate("resources", key);
    await expect(runStageJob("seed", job(id!), { ...fleet.deps, provider: dies.provider })).rejects.toThrow(
      /the worker died here/,
    );
    // The intent was persisted before anything was made, and nothing recorded a handle.
    expect(dies.intentAtCreate()).toMatchObject({ rolloutId: id, owner: "resources", handle: null });
    expect(await containersOf([id!])).toBe(1);
    expect((await fleet.deps.ledger.getSandbox(key))?.handle).toBeNull();
    await runStageJob("close", job(id!), fleet.deps);
    expect(await containersOf([id!])).toBe(0);
    expect(await fleet.deps.ledger.getSandbox(key)).toBeNull();
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({ teardown: "confirmed", reward: null });
  });

  it("a run that dies between creating its own sandbox and recording its handle left the intent first: the janitor destroys the sandbox by it (rule 9)", async () => {
    const [id] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "command", argv: ["true"], sandbox: "own" } },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    const key = sandboxKey(id!, "agent");
    const dies = diesAfterCreate("agent", key);
    await expect(runStageJob("run", job(id!), { ...fleet.deps, provider: dies.provider })).rejects.toThrow(
      /the worker died here/,
    );
    // The intent was persisted before anything was made, and nothing recorded a handle.
    expect(dies.intentAtCreate()).toMatchObject({ rolloutId: id, owner: "agent", handle: null });
    expect(await docker.find(id!, "agent")).not.toBeNull();
    await fleet.deps.store.requestCancel(id!);
    await runStageJob("close", job(id!), fleet.deps);
    // Not close's to destroy (rule 11): the janitor's, found by the intent the run left.
    expect(await docker.find(id!, "agent")).not.toBeNull();
    const later = { ...fleet.deps, now: () => Date.now() + 10 * 60_000 };
    await janitorTick(later, { orphanGraceMs: 60_000 });
    expect(await containersOf([id!])).toBe(0);
    expect(await fleet.deps.ledger.getSandbox(key)).toBeNull();
  });

  it("a first seed does not look for its sandbox by label; one re-delivered after dying past staging finds it and replaces it", async () => {
    /** Counts label lookups; the first staging put fails after staging, as if the worker died then. */
    class DiesAfterCreate extends FlakyDestroyProvider {
      finds = 0;
      created: string[] = [];
      putFailures = 1;
      override find = async (...a: Parameters<SandboxProvider["find"]>) => {
        this.finds++;
        return docker.find(...a);
      };
      override create = async (...a: Parameters<SandboxProvider["create"]>) => {
        const handle = await docker.create(...a);
        this.created.push(handle.id);
        return handle;
      };
      override put = async (...a: Parameters<SandboxProvider["put"]>) => {
        await docker.put(...a);
        if (this.putFailures-- > 0) throw FleetError.retryable("provider_unavailable", "worker died here");
      };
    }
    const provider = new DiesAfterCreate(docker, 0);
    const deps = { ...fleet.deps, provider };

    const [fresh] = await fleet.submit([oracle(byId("hello-file"))]);
    provider.putFailures = 0;
    expect(await runStageJob("seed", job(fresh!), deps)).toBe("ok");
    expect([provider.finds, provider.created.length]).toEqual([0, 1]);
    await runStageJob("close", job(fresh!), deps);

    const [id] = await fleet.submit([oracle(byId("csv-aggregate"))]); // has workspace files
    provider.putFailures = 1;
    await expect(runStageJob("seed", job(id!), deps)).rejects.toThrow(/worker died here/);
    expect(await containersOf([id!])).toBe(1);
    expect(await runStageJob("seed", job(id!, 1), deps)).toBe("ok");
    const seedReceipt = (await fleet.deps.store.get(id!))!.receipts.seed!;
    // The sandbox the first attempt staged is replaced: a probe of it would have taken the
    // task's files for the image's own.
    expect(seedReceipt.reused).toBe(false);
    expect(seedReceipt.probe.workspaceEmpty).toBe(true);
    expect(seedReceipt.handle.id).toBe(provider.created[2]);
    expect([provider.finds, provider.created.length, await containersOf([id!])]).toEqual([1, 3, 1]);
    await runStageJob("close", job(id!), deps);
    expect(await containersOf([fresh!, id!])).toBe(0);
  });

  it("a run re-delivered after an interrupted one starts from the task's workspace (at its modes) and clean scratch, not from its leftovers", async () => {
    const task = { ...byId("python-bugfix"), modes: { "workspace/stats.py": "600" } };
    const original = createHash("md5").update(task.workspace["stats.py"]!).digest("hex");
    // Lists the workspace, fingerprints the task's file, its mode, and lists the agent's own scratch files
    // (but the instruction, written for each run), then dirties all three.
    const argv = [
      "sh",
      "-c",
      "ls -A; md5sum stats.py | cut -d' ' -f1; stat -c %a stats.py; " +
        "find /tmp /logs /dev/shm /dev/mqueue -mindepth 1 -user $(id -u) ! -path '/tmp/fleet*' 2>&1; " +
        "echo x > leftover.txt; echo x > stats.py; chmod 777 stats.py; echo plan > /tmp/notes; mkdir /logs/l; echo x > /dev/shm/x; touch /dev/mqueue/q",
    ];
    const [id] = await fleet.submit([{ task, agent: { harness: "command", argv } }]);
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    // The first run's worker dies once its agent has run (a retryable failure after the harness).
    const dies = {
      ...fleet.deps,
      createHarness: (...a: Parameters<typeof createHarness>) => {
        const harness = createHarness(...a);
        return {
          name: harness.name,
          run: async (ctx: Parameters<typeof harness.run>[0]) => {
            await harness.run(ctx);
            throw FleetError.retryable("provider_unavailable", "the worker died here");
          },
        };
      },
    };
    await expect(runStageJob("run", job(id!), dies)).rejects.toThrow(/the worker died here/);
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    const run = (await fleet.deps.store.get(id!))!.receipts.run!;
    expect(run.attempts).toBe(2);
    expect(run.exec.stdout.split("\n").filter(Boolean)).toEqual(["stats.py", original, "600"]);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await containersOf([id!])).toBe(0);
  });

  it.each([
    ["/workspace files", "workspaceEmpty"],
    ["agent-owned files", "scratchClean"],
  ] as const)(
    "a run interrupted after its agent started, on an image with its own %s, is masked, not rerun",
    async (what, field) => {
      const task = byId("python-bugfix");
      const [id] = await fleet.submit([
        { task, agent: { harness: "command", argv: ["sh", "-c", "echo ran"] } },
      ]);
      expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
      // As a seed's probe reports an image that brought such files.
      const seedReceipt = (await fleet.deps.store.get(id!))!.receipts.seed!;
      expect(seedReceipt.probe[field]).toBe(true);
      seedReceipt.probe[field] = false;
      await fleet.redis.hset(fleet.deps.store.keys.rollout(id!), "r:seed", JSON.stringify(seedReceipt));
      // The first launch is claimed, then its worker dies: the re-delivery finds the fence taken.
      await fleet.deps.store.claimLaunch(id!, "dead-worker:1");
      const err = await runStageJob("run", job(id!, 1), fleet.deps).then(
        () => null,
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(UnrecoverableError);
      expect(String((err as Error).message)).toMatch(/sandbox_lost.*cannot be put back/);
      expect(String((err as Error).message)).toContain(what);
      expect((await fleet.deps.store.get(id!))!.receipts.run).toBeUndefined();
      await closeExpecting(id!, {
        status: "masked",
        failureKind: "sandbox_lost",
        reward: null,
      });
    },
  );

  it("a stage job BullMQ fails by itself (stalled too often: its workers kept dying) closes the rollout at once, masked", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    const jobKey = `${fleet.prefix}:seed:${id}.seed`;
    expect(await fleet.redis.exists(jobKey)).toBe(1);
    // What BullMQ's stalled check leaves on a job past maxStalledCount: a deferred failure.
    await fleet.redis.hset(jobKey, "defa", "job stalled more than allowable limit");
    // Another whose verify stored its reward, but whose verify job BullMQ then failed (its worker
    // died after the receipt, before completing the job): its reward stands.
    const [graded] = await fleet.submit([oracle(byId("hello-file"))]);
    for (const stage of ["seed", "run", "verify"] as const)
      await runStageJob(stage, job(graded!), fleet.deps);
    await (await fleet.deps.queues.queues.close.getJob(`${graded}.close`))!.remove();
    await fleet.redis.hset(
      `${fleet.prefix}:verify:${graded}.verify`,
      "defa",
      "job stalled more than allowable limit",
    );
    const workers = createStageWorkers(STAGES, fleet.deps, {
      connection: fleet.redis,
      prefix: fleet.prefix,
      concurrency: 2,
      supervise: false,
    });
    try {
      const [r, g] = await fleet.waitForResults([id!, graded!], 60_000);
      expect(r).toMatchObject({ status: "masked", failureKind: "provider_unavailable", stage: "seed" });
      expect(r!.reason).toMatch(/failed in BullMQ: job stalled more than allowable limit/);
      expect(g).toMatchObject({ status: "completed", reward: 1 });
    } finally {
      await workers.close(10_000);
    }
  });

  it.each([
    ["masked", false],
    ["cancelled, when a cancel had claimed the stop", true],
  ] as const)(
    "a last attempt that fails before its stage begins (an error on begin, not Redis refusing: that holds the job) closes the rollout at once: %s",
    async (_how, cancelled) => {
      const [id] = await fleet.submit([oracle(byId("hello-file"))]);
      // Its attempts but one are spent; the last one's begin fails.
      await fleet.redis.hset(
        `${fleet.prefix}:seed:${id}.seed`,
        "atm",
        String(STAGE_CATALOG.seed.options.attempts! - 1),
      );
      // A cancel whose flag landed and whose failure record did not (its dispatcher died between).
      if (cancelled) await fleet.deps.store.requestCancel(id!);
      let blips = 0;
      const store = fleet.deps.store;
      const blipping = Object.assign(Object.create(store) as typeof store, {
        begin: async (...a: Parameters<typeof store.begin>) => {
          if (a[0] === id && a[1] === "seed" && blips++ === 0) throw new Error("the begin broke");
          return store.begin(...a);
        },
      });
      const workers = createStageWorkers(
        STAGES,
        { ...fleet.deps, store: blipping },
        {
          connection: fleet.redis,
          prefix: fleet.prefix,
          concurrency: 2,
          supervise: false,
        },
      );
      try {
        // Well before its deadline (the watchdog's way, an hour and more away).
        const [r] = await fleet.waitForResults([id!], 30_000);
        if (cancelled)
          expect(r).toMatchObject({ status: "cancelled", failureKind: "cancelled", mask: false });
        else {
          expect(r).toMatchObject({ status: "masked", failureKind: "provider_unavailable", stage: "seed" });
          expect(r!.reason).toMatch(/last attempt failed before its stage began: the begin broke/);
        }
        expect(blips).toBe(1);
      } finally {
        await workers.close(10_000);
      }
    },
  );

  it("a rollout whose job BullMQ failed is closed once Redis takes writes again, when Redis refused the close at first: not left to its deadline", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await fleet.redis.hset(
      `${fleet.prefix}:seed:${id}.seed`,
      "atm",
      String(STAGE_CATALOG.seed.options.attempts! - 1),
    );
    const store = fleet.deps.store;
    // The last attempt's begin fails (not a refusal by Redis, which would hold the job: see
    // redis-refusal.int.test.ts), and Redis refuses the next three tries of the close that follows.
    let refusals = 0;
    const oom = () =>
      Object.assign(new Error("OOM command not allowed when used memory > 'maxmemory'."), {
        name: "ReplyError",
      });
    const full = Object.assign(Object.create(store) as typeof store, {
      begin: async (...a: Parameters<typeof store.begin>) => {
        if (a[0] === id && a[1] === "seed" && refusals++ === 0) throw new Error("the begin broke");
        return store.begin(...a);
      },
      get: async (...a: Parameters<typeof store.get>) => {
        if (a[0] === id && refusals > 0 && refusals++ <= 3) throw oom();
        return store.get(...a);
      },
    });
    const workers = createStageWorkers(
      STAGES,
      { ...fleet.deps, store: full },
      { connection: fleet.redis, prefix: fleet.prefix, concurrency: 2, supervise: false },
    );
    try {
      const [r] = await fleet.waitForResults([id!], 45_000);
      expect(r).toMatchObject({ status: "masked", failureKind: "provider_unavailable", stage: "seed" });
      expect(refusals).toBe(5);
    } finally {
      await workers.close(10_000);
    }
  });

  it("a final failure stays final when recording it hits a Redis blip: no BullMQ retry, the failure recorded on a later try", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    const store = fleet.deps.store;
    let blips = 2;
    const flaky = {
      ...fleet.deps,
      store: Object.assign(Object.create(store) as typeof store, {
        getTask: async () => null, // the task is gone: a final invalid_task
        recordFailure: async (...a: Parameters<typeof store.recordFailure>) => {
          if (blips-- > 0) throw new Error("Connection is closed.");
          return store.recordFailure(...a);
        },
      }),
    };
    const err = await runStageJob("seed", job(id!), flaky).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UnrecoverableError);
    expect((await store.get(id!))!.failure).toMatchObject({ failureKind: "invalid_task", terminal: true });
    expect(await runStageJob("close", job(id!), fleet.deps)).toBe("ok");
  });

  it("a final failure whose record landed but whose close enqueue hit a blip is logged once, and close still comes", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    const store = fleet.deps.store;
    let blips = 1;
    const flaky = {
      ...fleet.deps,
      store: Object.assign(Object.create(store) as typeof store, { getTask: async () => null }),
      queues: Object.assign(Object.create(fleet.deps.queues) as typeof fleet.deps.queues, {
        enqueue: async (...a: Parameters<typeof fleet.deps.queues.enqueue>) => {
          if (a[0] === "close" && blips-- > 0) throw new Error("Connection is closed.");
          return fleet.deps.queues.enqueue(...a);
        },
      }),
    };
    const err = await runStageJob("seed", job(id!), flaky).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UnrecoverableError);
    expect(blips).toBe(-1); // the enqueue was tried again, and went through
    const log = await store.failureLog(id!);
    expect(log.filter((f) => f.terminal)).toHaveLength(1);
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(id!, "close"))).toBeDefined();
  });

  it("a final failure Redis refused for all the runner's tries is recorded by the worker once Redis takes it, and the rollout closed: not left open for its stage to run again", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    const store = fleet.deps.store;
    // The runner's four tries and the worker's first two are refused (a failover's read-only replica).
    let refusals = 6;
    let seeds = 0;
    const failingOver = Object.assign(Object.create(store) as typeof store, {
      getTask: async () => null, // the task is gone: a final invalid_task
      begin: async (...a: Parameters<typeof store.begin>) => {
        if (a[0] === id && a[1] === "seed") seeds++;
        return store.begin(...a);
      },
      recordFailure: async (...a: Parameters<typeof store.recordFailure>) => {
        if (a[0] === id && refusals-- > 0) {
          throw Object.assign(new Error("READONLY You can't write against a read only replica."), {
            name: "ReplyError",
          });
        }
        return store.recordFailure(...a);
      },
    });
    const workers = createStageWorkers(
      STAGES,
      { ...fleet.deps, store: failingOver },
      { connection: fleet.redis, prefix: fleet.prefix, concurrency: 2, supervise: false },
    );
    try {
      const [r] = await fleet.waitForResults([id!], 30_000);
      expect(r).toMatchObject({ status: "failed", failureKind: "invalid_task", stage: "seed" });
      expect(refusals).toBe(-1);
      expect(seeds).toBe(1);
      const log = await store.failureLog(id!);
      expect(log.filter((f) => f.terminal)).toHaveLength(1);
    } finally {
      await workers.close(10_000);
    }
  });

  it("a run job ahead of its seed receipt, or one handed back at shutdown before its harness, gives the launch back", async () => {
    const [id] = await fleet.submit([
      { task: byId("hello-file"), agent: { harness: "command", argv: ["sh", "-c", "echo ran"] } },
    ]);
    const fence = () => fleet.redis.hget(fleet.deps.store.keys.rollout(id!), "fence");
    await expect(runStageJob("run", job(id!), fleet.deps)).rejects.toThrow(/without a seed receipt/);
    expect(await fence()).toBeNull();
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    const shutdown = new AbortController();
    shutdown.abort();
    const handedBack = await runStageJob("run", job(id!), fleet.deps, { signal: shutdown.signal }).catch(
      (e) => e,
    );
    expect(isHandBack(handedBack)).toBe(true);
    expect(await fence()).toBeNull();
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    expect((await fleet.deps.store.get(id!))!.receipts.run!.attempts).toBe(1);
    await runStageJob("verify", job(id!), fleet.deps);
    await runStageJob("close", job(id!), fleet.deps);
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("completed");
  });

  /**
   * A rollout of `task` for a command agent, seeded, whose seed's probe says the image has its own
   * /workspace files: a rerun could not put the sandbox back, so it would be masked.
   */
  async function seededWhoseRerunWouldMask(task: TaskContent): Promise<string> {
    const [id] = await fleet.submit([
      { task, agent: { harness: "command", argv: ["sh", "-c", "echo ran"] } },
    ]);
    expect(await runStageJob("seed", job(id!), fleet.deps)).toBe("ok");
    const seedReceipt = (await fleet.deps.store.get(id!))!.receipts.seed!;
    seedReceipt.probe.workspaceEmpty = false;
    await fleet.redis.hset(fleet.deps.store.keys.rollout(id!), "r:seed", JSON.stringify(seedReceipt));
    return id!;
  }

  it("a run that fails before its harness starts gives the launch back: the next attempt is a first launch, not a rerun", async () => {
    const task = byId("python-bugfix");
    const id = await seededWhoseRerunWouldMask(task);
    // The first attempt claims the launch, then fails (a Redis blip reading the task) before
    // its agent starts.
    let blips = 1;
    const store = fleet.deps.store;
    const blipping = {
      ...fleet.deps,
      store: Object.assign(Object.create(store) as typeof store, {
        getTask: async (digest: string) => {
          if (blips-- > 0) throw FleetError.retryable("provider_unavailable", "blip before launch");
          return store.getTask(digest);
        },
      }),
    };
    await expect(runStageJob("run", job(id!), blipping)).rejects.toThrow(/blip before launch/);
    expect(await fleet.redis.hget(fleet.deps.store.keys.rollout(id!), "fence")).toBeNull();
    expect(await runStageJob("run", job(id!, 1), blipping)).toBe("ok");
    const run = (await fleet.deps.store.get(id!))!.receipts.run!;
    expect([run.exec.stdout, run.attempts]).toEqual(["ran\n", 1]);
    await runStageJob("verify", job(id!), fleet.deps);
    await runStageJob("close", job(id!), fleet.deps);
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("completed");

    // A claim that took over an earlier launch keeps the fence when it fails before launching:
    // the earlier launch (cut off, perhaps alive) must not become the holder again.
    const [other] = await fleet.submit([
      { task, agent: { harness: "command", argv: ["sh", "-c", "echo ran"] } },
    ]);
    expect(await runStageJob("seed", job(other!), fleet.deps)).toBe("ok");
    await fleet.deps.store.claimLaunch(other!, "cut-off-worker:1");
    blips = 1;
    await expect(runStageJob("run", job(other!, 1), blipping)).rejects.toThrow(/blip before launch/);
    expect(await fleet.deps.store.launchState(other!, "cut-off-worker:1")).toBe("lost");
    await runStageJob("close", job(other!), fleet.deps);
  });

  it("a run handed back at shutdown before its agent ran anything (no command, no model call) gives the launch back: the next delivery is a first launch, not a rerun", async () => {
    const id = await seededWhoseRerunWouldMask(byId("python-bugfix"));
    // The first delivery's agent is still starting (its command not created yet) when its worker
    // shuts down: it stops without having run a command, and its harness calls no model itself.
    const starting = latch();
    const shutdown = new AbortController();
    const createHarness = untilStopped(starting, () => new Error("stopped before its first command"));
    const first = runStageJob(
      "run",
      job(id!),
      { ...fleet.deps, createHarness },
      { signal: shutdown.signal },
    ).catch((e: unknown) => e);
    await starting.opened;
    shutdown.abort();
    expect(isHandBack(await first)).toBe(true);
    expect(await fleet.redis.hget(fleet.deps.store.keys.rollout(id!), "fence")).toBeNull();
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    const run = (await fleet.deps.store.get(id!))!.receipts.run!;
    expect([run.exec.stdout, run.attempts]).toEqual(["ran\n", 1]);
    await runStageJob("verify", job(id!), fleet.deps);
    await runStageJob("close", job(id!), fleet.deps);
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("completed");
  });

  it("a launch whose run was taken over by another worker drops its outcome: no kill of the new launch, no receipt", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const gate = gatedHarness();
    const kills: string[] = [];
    const cutOff = {
      ...fleet.deps,
      stopPollMs: 60_000, // the takeover is found by the check after the harness, not by the poll
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async (...a: Parameters<SandboxProvider["killProcesses"]>) => {
          kills.push(a[1] ?? "");
          return fleet.deps.provider.killProcesses(...a);
        },
      }),
      createHarness: gate.createHarness,
    };
    // A job held for most of its lock's duration already: a takeover is possible.
    const a = runStageJob("run", { ...job(id!), processedOn: Date.now() - 25_000 }, cutOff);
    await gate.started;
    // Worker A lost its job's lock; B took the job over and claimed the launch.
    expect((await fleet.deps.store.claimLaunch(id!, "worker-b:1")).previous).toMatch(/^launched:/);
    gate.release();
    expect(await a).toBe("superseded");
    expect(kills).toEqual([]);
    const rec = (await fleet.deps.store.get(id!))!;
    expect(rec.receipts.run).toBeUndefined();
    expect(rec.fence).toBe("launched:worker-b:1");
    expect(await fleet.deps.queues.queues.verify.getJob(`${id}.verify`)).toBeUndefined();
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a run taken over before its launch started (its lock lapsed on a slow start) does not start a second agent", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const store = fleet.deps.store;
    let harnesses = 0;
    const slowStart = {
      ...fleet.deps,
      createHarness: (...a: Parameters<typeof createHarness>) => {
        harnesses++;
        return createHarness(...a);
      },
      store: Object.assign(Object.create(store) as typeof store, {
        getTask: async (digest: string) => {
          // Meanwhile this worker's lock lapsed, and worker B took the run over.
          await store.claimLaunch(id!, "worker-b:1");
          return store.getTask(digest);
        },
      }),
    };
    expect(await runStageJob("run", { ...job(id!), processedOn: Date.now() - 25_000 }, slowStart)).toBe(
      "superseded",
    );
    expect(harnesses).toBe(0);
    const rec = (await store.get(id!))!;
    expect(rec.receipts.run).toBeUndefined();
    expect(rec.fence).toBe("launched:worker-b:1");
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a run taken over while it made its own sandbox (the later launch's, adopted by its name) neither stages into it nor destroys it", async () => {
    const [id] = await fleet.submit([
      { task: byId("sum-answer"), agent: { harness: "oracle", sandbox: "own" } },
    ]);
    await runStageJob("seed", job(id!), fleet.deps);
    const { provider, store } = fleet.deps;
    let later: SandboxHandle | null = null;
    const touched: string[] = [];
    const paused = {
      ...fleet.deps,
      provider: Object.assign(Object.create(provider) as SandboxProvider, {
        create: async (spec: Parameters<SandboxProvider["create"]>[0]) => {
          // Meanwhile this worker's lock lapsed: worker B took the run over and made its own
          // sandbox, of the same name, where its agent now works.
          await store.claimLaunch(id!, "worker-b:1");
          later = await provider.create(spec);
          return provider.create(spec);
        },
        probe: async (h: SandboxHandle) => {
          touched.push(`probe ${h.id}`);
          return provider.probe(h);
        },
        put: async (
          h: SandboxHandle,
          ...rest: Parameters<SandboxProvider["put"]> extends [unknown, ...infer R] ? R : never
        ) => {
          touched.push(`put ${h.id}`);
          return provider.put(h, ...rest);
        },
        destroy: async (h: SandboxHandle) => {
          touched.push(`destroy ${h.id}`);
          return provider.destroy(h);
        },
      }),
    };
    expect(await runStageJob("run", { ...job(id!), processedOn: Date.now() - 25_000 }, paused)).toBe(
      "superseded",
    );
    expect(later).not.toBeNull();
    expect(touched).toEqual([]);
    expect(await provider.alive(later!)).toBe(true);
    expect((await store.get(id!))!.fence).toBe("launched:worker-b:1");
    await provider.destroy(later!);
    await runStageJob("close", job(id!), fleet.deps);
  });

  /**
   * An earlier verify attempt (of this release: it honours the fence) noted its tests `at`, in a
   * sandbox whose verify fence cannot be raised (its directory made read-only by its owner, as
   * a sandbox made before it had one): a verify delivered again waits those tests out.
   */
  const notedUnfenceable = async (id: string, at: number) => {
    const { store } = fleet.deps;
    await store.begin(id, "verify", Date.now(), { verifyToken: `earlier-${id}` });
    expect(await store.noteVerifyWork(id, at, `earlier-${id}`)).toBe("noted");
    await makeUnfenceable((await store.get(id))!.receipts.seed!.handle);
  };

  it("a verify delivered again to a sandbox it cannot fence that cannot wait out the earlier tests before the deadline ends masked; a shutdown hands it back", async () => {
    const task = {
      ...byId("hello-file"),
      id: `late-verify-${Date.now()}`,
      timeouts: { agentS: 1, verifierS: 30 },
    };
    const [late, stopping] = await fleet.submit([
      // Time for the run (1 s + 30 s + 8 s, and 10 s before it), not for waiting out 30 s of
      // tests + 15 s of grace.
      { ...oracle(task), deadlineS: 49 },
      { ...oracle(task), deadlineS: 600 },
    ]);
    for (const id of [late!, stopping!]) {
      for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id), fleet.deps);
      // The earlier attempt began its tests just now, by its worker's clock 5 s ahead of ours.
      await notedUnfenceable(id, Date.now() + 5_000);
    }
    // 30 s of tests + 15 s of grace from then (50 s on) passes the 49 s deadline: no point
    // sleeping into it.
    await expect(runStageJob("verify", job(late!), fleet.deps)).rejects.toThrow(/deadline_exceeded/);
    const shutdown = new AbortController();
    const waiting = runStageJob("verify", job(stopping!), fleet.deps, { signal: shutdown.signal }).catch(
      (e) => e,
    );
    shutdown.abort();
    expect(isHandBack(await waiting)).toBe(true);
    for (const id of [late!, stopping!]) await runStageJob("close", job(id), fleet.deps);
    expect(await fleet.deps.store.getResult(late!)).toMatchObject({
      status: "masked",
      failureKind: "deadline_exceeded",
    });
  });

  it("a run taken over during its kill sweep (after its last look at the fence) stores no receipt over the new launch's", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const store = fleet.deps.store;
    const late = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async (...a: Parameters<SandboxProvider["killProcesses"]>) => {
          // While this launch stops its agent, its lock lapses and worker B takes the run over.
          await store.claimLaunch(id!, "worker-b:1");
          return fleet.deps.provider.killProcesses(...a);
        },
      }),
    };
    // Its lock may have lapsed (taken 25 s ago): its receipt is stored only under its fence.
    expect(await runStageJob("run", { ...job(id!), processedOn: Date.now() - 25_000 }, late)).toBe(
      "superseded",
    );
    const rec = (await store.get(id!))!;
    expect(rec.receipts.run).toBeUndefined();
    expect(rec.status).not.toBe("ran");
    expect(rec.fence).toBe("launched:worker-b:1");
    expect(await fleet.deps.queues.queues.verify.getJob(stageJobId(id!, "verify"))).toBeUndefined();
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a rerun taken over while it prepared neither kills nor resets what the new launch runs", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    // An earlier launch died: this attempt is a rerun, which kills and resets before launching.
    await fleet.deps.store.claimLaunch(id!, "dead-worker:1");
    const store = fleet.deps.store;
    const kills: string[] = [];
    const slow = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async (...a: Parameters<SandboxProvider["killProcesses"]>) => {
          kills.push(a[1] ?? "");
          return fleet.deps.provider.killProcesses(...a);
        },
      }),
      store: Object.assign(Object.create(store) as typeof store, {
        getTask: async (digest: string) => {
          // Meanwhile this worker's lock lapsed, and worker B took the run over and launched.
          await store.claimLaunch(id!, "worker-b:1");
          return store.getTask(digest);
        },
      }),
    };
    expect(await runStageJob("run", { ...job(id!, 1), processedOn: Date.now() - 25_000 }, slow)).toBe(
      "superseded",
    );
    expect(kills).toEqual([]);
    expect((await store.get(id!))!.fence).toBe("launched:worker-b:1");
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify handed back at shutdown stops its tests first, so the next attempt does not wait out their budget: it masks at once, never running the tests again on the sandbox they changed", async () => {
    // The first run of the tests hangs; a second one would pass on what the first left (/tmp).
    const { id, handle } = await ranWithTests(
      "handed-back-verify",
      "#!/bin/sh\n[ -e /tmp/handed-back ] && exit 0\ntouch /tmp/handed-back\nsleep 600\n",
    );
    const rootSleeps = () => rootSleeping(handle, 600);
    const shutdown = new AbortController();
    const verifying = runStageJob("verify", job(id!), fleet.deps, { signal: shutdown.signal }).catch(
      (e) => e,
    );
    await waitFor(async () => (await rootSleeps()) === "1");
    shutdown.abort();
    expect(isHandBack(await verifying)).toBe(true);
    // Its tests are gone, and so is its note of them: nothing for the next attempt to wait out.
    expect(await rootSleeps()).toBe("0");
    expect((await fleet.deps.store.get(id!))!.times["verify:last"]).toBeUndefined();
    // The next attempt stages the tests, and its runner, finding the mark of A's, runs nothing.
    const { deps: watching, staged } = watchStaging();
    await expectCutShort(id!, watching);
    expect(staged).toHaveLength(1);
  });

  it("a verify handed back whose sweep lands after a later attempt fenced the sandbox kills nothing of that attempt's tests", async () => {
    const { id, handle } = await ranWithTests("handed-back-late-sweep", "#!/bin/sh\nsleep 600\n");
    const { store, provider } = fleet.deps;
    const shutdown = new AbortController();
    const lateSweep = {
      ...fleet.deps,
      provider: Object.assign(Object.create(provider) as SandboxProvider, {
        killProcesses: async (...a: Parameters<SandboxProvider["killProcesses"]>) => {
          if (a[1] !== ROOT_USER) return provider.killProcesses(...a);
          // A's sweep is delayed past its claim: B (epoch 2) begins, fences the sandbox (its
          // sweep stops A's tests) and starts its own meanwhile.
          await laterAttemptTakesOver(id!, handle, 2, 603);
          return provider.killProcesses(...a);
        },
      }),
    };
    const verifying = runStageJob("verify", job(id!), lateSweep, { signal: shutdown.signal }).catch((e) => e);
    await waitFor(async () => (await rootSleeping(handle, 600)) === "1");
    shutdown.abort();
    expect(isHandBack(await verifying)).toBe(true);
    // B's tests run on; A's sweep stopped at B's fence, and its claim ended.
    expect(await rootSleeping(handle, 603)).toBe("1");
    expect(await store.testsSweepLeftMs(id!)).toBe(0);
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify handed back whose tests' sweep does not answer still hands back within its bound, its note kept for the next attempt", async () => {
    const task = {
      ...byId("hello-file"),
      id: `handed-back-hung-sweep-${Date.now()}`,
      timeouts: { agentS: 30, verifierS: 90 },
      tests: { "test.sh": "#!/bin/sh\nsleep 600\n" },
    };
    const [id] = await fleet.submit([oracle(task)]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    const hung = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: (...a: Parameters<SandboxProvider["killProcesses"]>) =>
          a[1] === ROOT_USER ? new Promise<never>(() => undefined) : fleet.deps.provider.killProcesses(...a),
      }),
    };
    const shutdown = new AbortController();
    const verifying = runStageJob("verify", job(id!), hung, { signal: shutdown.signal }).catch((e) => e);
    await waitFor(async () => (await fleet.deps.store.get(id!))!.times["verify:last"] !== undefined);
    shutdown.abort();
    // Within the bound (10 s), not never.
    const handedBack = await Promise.race([
      verifying,
      new Promise((r) => setTimeout(r, 30_000, "still waiting")),
    ]);
    expect(isHandBack(handedBack)).toBe(true);
    // Not confirmed stopped: the note stays, so the next attempt waits the tests out. Nor is it
    // marked left: an exec of the attempt's still queued in its client could yet start.
    expect((await fleet.deps.store.get(id!))!.times["verify:last"]).toBeDefined();
    expect((await fleet.deps.store.verifyNote(id!))?.left).toBe(false);
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify that begins while a handed-back attempt sweeps its tests waits for the sweep to end (it never works in the sandbox under it), then masks at once: the tests ran there", async () => {
    // The first run of the tests hangs; a second one would pass on what the first left (/tmp).
    const { id, handle } = await ranWithTests(
      "sweep-race",
      "#!/bin/sh\nif [ -e /tmp/swept ]; then sleep 8; exit 0; fi\ntouch /tmp/swept\nsleep 600\n",
    );
    const rootSleeps = (seconds: number) => rootSleeping(handle, seconds);
    // Attempt A: handed back at shutdown, its sweep held until the gate opens.
    const gate = latch();
    const a = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async (...args: Parameters<SandboxProvider["killProcesses"]>) => {
          if (args[1] === ROOT_USER) await gate.opened;
          return fleet.deps.provider.killProcesses(...args);
        },
      }),
    };
    const shutdown = new AbortController();
    const verifyingA = runStageJob("verify", job(id!), a, { signal: shutdown.signal }).catch((e) => e);
    await waitFor(async () => (await rootSleeps(600)) === "1");
    shutdown.abort();
    await waitFor(async () => (await fleet.deps.store.testsSweepLeftMs(id!)) > 0);
    // B: delivered again meanwhile (A's lock lapsed in a stall). A's tests began just now, so
    // B's begin also finds their note: it would wait out their 90 s budget, but for the sweep.
    let waitsForSweep = false;
    const staged: number[] = [];
    const logger = fleet.deps.logger;
    const b = {
      ...fleet.deps,
      logger: Object.assign(Object.create(logger) as typeof logger, {
        info: (obj: unknown, msg?: string) => {
          if (msg?.includes("sweep")) waitsForSweep = true;
          logger.info(obj, msg);
        },
      }),
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (...args: Parameters<SandboxProvider["put"]>) => {
          if (args[1] === "/tests") staged.push(Date.now());
          return fleet.deps.provider.put(...args);
        },
      }),
    };
    const verifyingB = runStageJob("verify", job(id!), b).then(
      () => "ok",
      (err: unknown) => ({ err, at: Date.now() }),
    );
    await waitFor(async () => waitsForSweep);
    const opened = Date.now();
    gate.open();
    expect(isHandBack(await verifyingA)).toBe(true);
    const ended = (await verifyingB) as { err: Error; at: number };
    expect(ended.err.message).toContain(TESTS_CUT_SHORT);
    // Freed by the sweep's end, A's tests confirmed stopped (neither the claim's 30 s nor the
    // tests' budget): it staged the tests only then, and its runner ran nothing.
    expect(staged).toHaveLength(1);
    expect(staged[0]!).toBeGreaterThanOrEqual(opened);
    expect(ended.at - opened).toBeLessThan(10_000);
    await closeExpecting(id!, { status: "masked", failureKind: "verifier_error", reward: null });
  });

  it("a verify handed back after a later attempt began sweeps nothing: the tests in the sandbox are not its to stop", async () => {
    const { id, handle } = await ranWithTests("superseded-hand-back", "#!/bin/sh\nsleep 600\n");
    const rootSleeps = () => rootSleeping(handle, 600);
    const swept: string[] = [];
    const a = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async (...args: Parameters<SandboxProvider["killProcesses"]>) => {
          swept.push(args[1] ?? "");
          return fleet.deps.provider.killProcesses(...args);
        },
      }),
    };
    const shutdown = new AbortController();
    const verifyingA = runStageJob("verify", job(id!), a, { signal: shutdown.signal }).catch((e) => e);
    await waitFor(async () => (await rootSleeps()) === "1");
    // A later attempt began (A's lock lapsed in a stall): it holds the verify fence now.
    await fleet.deps.store.begin(id!, "verify", Date.now(), { verifyToken: "later-attempt" });
    shutdown.abort();
    expect(isHandBack(await verifyingA)).toBe(true);
    // A swept nothing: what runs in the sandbox now is the later attempt's to stop.
    expect(swept).not.toContain(ROOT_USER);
    expect(await rootSleeps()).toBe("1");
    expect(await fleet.deps.store.testsSweepLeftMs(id!)).toBe(0);
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify handed back whose sweep counted tests it could not stop ends its claim (the sweep is over) and keeps its note: the next attempt waits the tests out, not the claim", async () => {
    const { id } = await ranWithTests("hand-back-resisted", "#!/bin/sh\nsleep 600\n");
    const resisted = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        killProcesses: async (...args: Parameters<SandboxProvider["killProcesses"]>) =>
          args[1] === ROOT_USER
            ? {
                confirmed: false,
                scope: "processes" as const,
                at: Date.now(),
                alreadyGone: false,
                remaining: 1,
              }
            : fleet.deps.provider.killProcesses(...args),
      }),
    };
    const shutdown = new AbortController();
    const verifying = runStageJob("verify", job(id!), resisted, { signal: shutdown.signal }).catch((e) => e);
    await waitFor(async () => (await fleet.deps.store.get(id!))!.times["verify:last"] !== undefined);
    shutdown.abort();
    expect(isHandBack(await verifying)).toBe(true);
    expect(await fleet.deps.store.testsSweepLeftMs(id!)).toBe(0);
    expect((await fleet.deps.store.get(id!))!.times["verify:last"]).toBeDefined();
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify waiting for a handed-back attempt's sweep ends masked once the rollout's deadline passes, not at the claim's end", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    // Attempt A, handed back, holds a claim on the sweep of its tests (30 s, by Redis's clock).
    await fleet.deps.store.begin(id!, "verify", Date.now(), { verifyToken: "attempt-a" });
    expect(await fleet.deps.store.claimTestsSweep(id!, "attempt-a", 30_000)).toMatchObject({ claimed: true });
    // B begins and waits for it; meanwhile the rollout's deadline passes (its clock jumps past it).
    const deadlineAt = (await fleet.deps.store.get(id!))!.meta.deadlineAt;
    let waiting = false;
    const logger = fleet.deps.logger;
    const b = {
      ...fleet.deps,
      now: () => (waiting ? deadlineAt + 1 : Date.now()),
      logger: Object.assign(Object.create(logger) as typeof logger, {
        info: (obj: unknown, msg?: string) => {
          if (msg?.includes("sweep")) waiting = true;
          logger.info(obj, msg);
        },
      }),
    };
    const started = Date.now();
    await expect(runStageJob("verify", job(id!), b)).rejects.toThrow(/deadline_exceeded/);
    expect(waiting).toBe(true);
    expect(Date.now() - started).toBeLessThan(10_000);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "masked",
      failureKind: "deadline_exceeded",
    });
  });

  it("a verify delivered again to a sandbox it cannot fence waits out the earlier attempt's tests (their own budget) before staging its own", async () => {
    const task = {
      ...byId("hello-file"),
      id: `slow-verify-${Date.now()}`,
      timeouts: { agentS: 30, verifierS: 1 },
    };
    const [id] = await fleet.submit([oracle(task)]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    // The attempt before began verifying 14.5 s ago; its tests (1 s budget) may run until
    // 1 s + the 15 s grace after that: 1.5 s from now.
    const earlier = Date.now() - 14_500;
    await notedUnfenceable(id!, earlier);
    const { deps: watching, staged } = watchStaging();
    expect(await runStageJob("verify", job(id!), watching)).toBe("ok");
    expect(staged).toHaveLength(1);
    expect(staged[0]!).toBeGreaterThanOrEqual(earlier + 1_000 + 15_000);
    // It noted when its tests started (after its wait), so a later delivery would wait from then.
    const last = Number(await fleet.redis.hget(fleet.deps.store.keys.rollout(id!), "t:verify:last"));
    expect(last).toBeGreaterThanOrEqual(earlier + 1_000 + 15_000);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a verify whose earlier attempt failed before its tests started (staging them) retries at once, with no tests to wait out", async () => {
    const task = {
      ...byId("hello-file"),
      id: `staging-failed-verify-${Date.now()}`,
      timeouts: { agentS: 30, verifierS: 30 },
    };
    const [id] = await fleet.submit([oracle(task)]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    const staged: number[] = [];
    let failStaging = true;
    const flaky = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (...a: Parameters<SandboxProvider["put"]>) => {
          if (a[1] === "/tests") {
            staged.push(Date.now());
            if (failStaging) {
              failStaging = false;
              throw FleetError.retryable("provider_unavailable", "the daemon blipped (the test)");
            }
          }
          return fleet.deps.provider.put(...a);
        },
      }),
    };
    await expect(runStageJob("verify", job(id!), flaky)).rejects.toThrow(/the daemon blipped/);
    expect(await runStageJob("verify", job(id!, 1), flaky)).toBe("ok");
    expect(staged).toHaveLength(2);
    // Waiting out tests that never started would have held it until 30 s + 15 s of grace after
    // the first attempt.
    expect(staged[1]! - staged[0]!).toBeLessThan(30_000);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a verify whose exec broke mid-tests (the daemon's answer lost) leaves the sandbox: the next attempt stops the tests it left at once, not a budget later, and masks: the tests ran there", async () => {
    // The first run of the tests hangs; a second one would pass on what the first left (/tmp).
    const { id, handle } = await ranWithTests(
      "broken-exec-verify",
      "#!/bin/sh\n[ -e /tmp/broke ] && exit 0\ntouch /tmp/broke\nsleep 600\n",
    );
    const rootSleeps = () => rootSleeping(handle, 600);
    let brokeAt = 0;
    const breaking = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        exec: async (...a: Parameters<SandboxProvider["exec"]>) => {
          if (a[1] !== RUN_TESTS_ARGV) return fleet.deps.provider.exec(...a);
          // The tests start in the sandbox, and their answer never comes back.
          void fleet.deps.provider.exec(...a).catch(() => undefined);
          await waitFor(async () => (await rootSleeps()) === "1");
          brokeAt = Date.now();
          throw FleetError.retryable("provider_unavailable", "the daemon went away mid-exec (the test)");
        },
      }),
    };
    await expect(runStageJob("verify", job(id!), breaking)).rejects.toThrow(/the daemon went away/);
    // A gave the job back and left the sandbox; its tests run on there.
    expect(await rootSleeps()).toBe("1");
    expect((await fleet.deps.store.verifyNote(id!))?.left).toBe(true);
    const { deps: watching, staged, swept } = watchStaging();
    await expect(runStageJob("verify", job(id!, 1), watching)).rejects.toThrow(TESTS_CUT_SHORT);
    // B stopped A's tests, then masked: not their 90 s budget (+ 15 s) later.
    expect(swept).toContain(ROOT_USER);
    expect(await rootSleeps()).toBe("0");
    expect(staged).toHaveLength(1);
    expect(staged[0]! - brokeAt).toBeLessThan(30_000);
    await closeExpecting(id!, { status: "masked", failureKind: "verifier_error", reward: null });
  });

  it("a verify whose tests' exec was never made (Docker refused it: nothing started) is retried and grades: only a runner that started the tests marks the sandbox", async () => {
    const { id, handle } = await ranWithTests(
      "refused-exec",
      "#!/bin/sh\ngrep -qx 'Hello, fleet!' hello.txt\n",
    );
    let refused = 0;
    const refusing = {
      ...fleet.deps,
      provider: Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        exec: async (...a: Parameters<SandboxProvider["exec"]>) => {
          if (a[1] === RUN_TESTS_ARGV && refused++ === 0) {
            throw FleetError.retryable(
              "provider_unavailable",
              "docker exec: connect ECONNREFUSED (the test)",
              undefined,
            );
          }
          return fleet.deps.provider.exec(...a);
        },
      }),
    };
    await expect(runStageJob("verify", job(id!), refusing)).rejects.toThrow(/ECONNREFUSED/);
    const mark = await fleet.deps.provider.exec(handle, ["test", "-e", TESTS_STARTED_MARK], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    expect(mark.exitCode).toBe(1);
    expect(await runStageJob("verify", job(id!, 1), refusing)).toBe("ok");
    expect(refused).toBe(2);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a verify whose sweep of the tests an earlier attempt left has no answer starts nothing before its claim on the sweep lapses: it hands its job back until then", async () => {
    const { id, handle } = await ranWithTests("unanswered-sweep", "#!/bin/sh\nsleep 600\n");
    const store = fleet.deps.store;
    // A noted its tests 104 s ago (90 s budget + 15 s grace: 1 s left), and left (its exec broke).
    await store.begin(id!, "verify", Date.now(), { verifyToken: "attempt-a" });
    expect(await store.noteVerifyWork(id!, Date.now() - 104_000, "attempt-a")).toBe("noted");
    const aTests = fleet.deps.provider
      .exec(handle, ["sleep", "600"], { deadlineMs: 120_000, user: ROOT_USER })
      .catch(() => undefined);
    await waitFor(async () => (await rootSleeping(handle, 600)) === "1");
    expect(await store.leaveVerifyWork(id!, "attempt-a")).toBe(true);
    // B's sweep of them never answers (a hung daemon): it may yet land.
    await expectHeldByUnansweredSweep(id!);
    // A later attempt that begins meanwhile waits for that claim too.
    expect(await store.testsSweepLeftMs(id!)).toBeGreaterThan(0);
    await runStageJob("close", job(id!), fleet.deps);
    await aTests;
  });

  it("a verify whose earlier attempt noted its tests and never left (its worker died, or it is paused past its lock) fences the sandbox and stops them, then starts at once; the earlier attempt's runner, started after, starts nothing", async () => {
    const paused = await verifyPausedAtRunner("never-left-verify");
    const { id, handle } = paused;
    const notedByA = Number(await fleet.redis.hget(fleet.deps.store.keys.rollout(id!), "t:verify:last"));
    // What runs as root in the sandbox (A's tests, as far as B can tell).
    const aTests = fleet.deps.provider
      .exec(handle, ["sleep", "600"], { deadlineMs: 120_000, user: ROOT_USER })
      .catch(() => undefined);
    await waitFor(async () => (await rootSleeping(handle, 600)) === "1");
    // The job delivered again: B (epoch 2) fences the sandbox, stops A's tests, and verifies at
    // once, not 90 s + 15 s after A's note. (A's runner never started: no mark of tests run.)
    const { deps: watching, staged, swept } = watchStaging();
    expect(await runStageJob("verify", job(id!, 1), watching)).toBe("ok");
    expect(swept).toContain(ROOT_USER);
    expect(await rootSleeping(handle, 600)).toBe("0");
    expect(staged[0]!).toBeLessThan(notedByA + 90_000);
    await aTests;
    await expectFencedOut(paused);
  });

  it.each([
    ["its note is past the tests' budget (it was paused longer than that)", "past"],
    ["it has no note (handed back: its own sweep took it, its runner's exec still queued)", "none"],
  ] as const)(
    "a verify delivered again whose earlier attempt may still start its tests though %s fences the sandbox before staging: that runner, started after, starts nothing",
    async (_, note) => {
      const paused = await verifyPausedAtRunner(`unnoted-verify-${note}`);
      const { id } = paused;
      const key = fleet.deps.store.keys.rollout(id!);
      if (note === "past") await fleet.redis.hset(key, "t:verify:last", String(Date.now() - 90_000 - 16_000));
      else await fleet.redis.hdel(key, "t:verify:last");
      // The job delivered again: B (epoch 2) has nothing to wait out, and fences the sandbox first.
      const { deps: watching, swept, order } = watchStaging();
      expect(await runStageJob("verify", job(id!, 1), watching)).toBe("ok");
      expect(swept).toEqual([ROOT_USER]);
      expect(order).toEqual(["swept", "staged"]);
      await expectFencedOut(paused);
    },
  );

  it("a verify delivered again whose fencing sweep has no answer (no tests noted) starts nothing before its claim on the sweep lapses: that sweep could yet kill its tests", async () => {
    const { id } = await ranWithTests("unnoted-unanswered", "#!/bin/sh\nexit 0\n");
    // A began and is gone without a note.
    await fleet.deps.store.begin(id!, "verify", Date.now(), { verifyToken: "attempt-a" });
    await expectHeldByUnansweredSweep(id!);
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify delivered again whose fencing sweep lands after a later attempt fenced the sandbox kills nothing of that attempt's tests, and ends superseded without a trace", async () => {
    const { id, handle } = await ranWithTests("late-sweep", "#!/bin/sh\nexit 0\n");
    const { store } = fleet.deps;
    // A began and is gone without a note; B is delivered again (epoch 2).
    await store.begin(id!, "verify", Date.now(), { verifyToken: "attempt-a" });
    const { deps: watching, staged } = watchStaging();
    const late = {
      ...watching,
      provider: Object.assign(Object.create(watching.provider) as SandboxProvider, {
        killProcesses: async (...a: Parameters<SandboxProvider["killProcesses"]>) => {
          // B's sweep is delayed past its claim: C (epoch 3) begins, fences the sandbox and
          // starts its tests meanwhile.
          await laterAttemptTakesOver(id!, handle, 3, 602);
          return watching.provider.killProcesses(...a);
        },
      }),
    };
    // Superseded: it ends without a trace (no verdict, no failure, nothing enqueued).
    expect(await runStageJob("verify", job(id!, 1), late)).toBe("superseded");
    expect(await rootSleeping(handle, 602)).toBe("1");
    expect(staged).toEqual([]);
    // Its sweep is over (it stopped there): its claim ended, holding no later attempt back.
    expect(await store.testsSweepLeftMs(id!)).toBe(0);
    expect((await store.get(id!))!.receipts.verify).toBeUndefined();
    expect(await store.failureLog(id!)).toEqual([]);
    await runStageJob("close", job(id!), fleet.deps);
  });

  it("a verify delivered again to a sandbox it cannot fence, with no earlier tests noted, starts at once as before the fence", async () => {
    const { id, handle } = await ranWithTests("unnoted-unfenceable", "#!/bin/sh\nexit 0\n");
    await fleet.deps.store.begin(id!, "verify", Date.now(), { verifyToken: "attempt-a" });
    await makeUnfenceable(handle);
    const { deps: watching, staged, swept, sweeps } = watchStaging();
    expect(await runStageJob("verify", job(id!, 1), watching)).toBe("ok");
    expect(swept).toEqual([ROOT_USER]);
    expect(staged).toHaveLength(1);
    // It tried, and the fence did not go up; its receipt says why.
    const fence = await readFence(handle);
    expect(fence.exitCode).not.toBe(0);
    expect(sweeps[0]).toMatchObject({ confirmed: true, fenced: false });
    expect(sweeps[0]!.detail).toMatch(/fence not raised: its file could not be written/);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a first verify attempt neither sweeps nor fences the sandbox: only one delivered again pays for that", async () => {
    const { id, handle } = await ranWithTests("first-verify", "#!/bin/sh\nexit 0\n");
    const { deps: watching, staged, swept } = watchStaging();
    expect(await runStageJob("verify", job(id!), watching)).toBe("ok");
    expect(staged).toHaveLength(1);
    expect(swept).toEqual([]);
    const fence = await readFence(handle);
    expect(fence.exitCode).not.toBe(0);
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a verify that finds the sandbox's fence above its epoch while no later attempt began (Redis lost the epochs) raises Redis's past it and is retried, then grades", async () => {
    const { id, handle } = await ranWithTests("fence-ahead-verify", "#!/bin/sh\nexit 0\n");
    // The fence holds 9: Redis gave out epochs up to 9 before a failover lost them.
    expect(await fleet.deps.provider.killProcesses(handle, ROOT_USER, { fenceEpoch: 9 })).toMatchObject({
      fenced: true,
    });
    await expect(runStageJob("verify", job(id!), fleet.deps)).rejects.toThrow(/verify fence \(epoch 9\)/);
    expect(await fleet.redis.hget(fleet.deps.store.keys.rollout(id!), "vepoch")).toBe("9");
    expect(await runStageJob("verify", job(id!, 1), fleet.deps)).toBe("ok");
    expect((await fleet.deps.store.get(id!))!.receipts.verify).toMatchObject({ reward: 1 });
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a Redis blip while noting that the tests start is held (no attempt spent), not masked as a verifier crash", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    const store = Object.create(fleet.deps.store) as typeof fleet.deps.store;
    store.noteVerifyWork = async () => {
      throw new Error("Connection is closed.");
    };
    const err = await runStageJob("verify", job(id!), { ...fleet.deps, store }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RedisHoldError);
    expect((err as Error).message).toMatch(/^the fleet's Redis cannot serve now: .*Connection is closed\.$/);
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    expect(await runStageJob("verify", job(id!, 1), fleet.deps)).toBe("ok");
    await closeExpecting(id!, { status: "completed", reward: 1 });
  });

  it("a verify attempt a later one superseded (paused past its lock) neither stages nor starts its tests, nor stores its verdict, records a failure or closes the rollout", async () => {
    const ids = await fleet.submit([1, 2, 3, 4, 5].map(() => oracle(byId("hello-file"))));
    for (const id of ids)
      for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id), fleet.deps);
    const [beforeStaging, beforeTests, afterTests, failingFresh, failingLapsed] = ids as [
      string,
      string,
      string,
      string,
      string,
    ];
    const store = fleet.deps.store;
    // The job delivered again to worker B, whose verify begins (taking the fence).
    const laterAttemptBegins = async (id: string) => {
      await store.begin(
        id,
        "verify",
        Date.now(),
        beginOptions("verify", { ...fleet.deps, workerId: "worker-b" }),
      );
    };
    const staged: string[] = [];
    const testsRun: string[] = [];
    const watching = (onStage: () => Promise<void> = async () => {}) =>
      Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
        put: async (...a: Parameters<SandboxProvider["put"]>) => {
          if (a[1] === "/tests") {
            staged.push(a[0].id);
            await onStage();
          }
          return fleet.deps.provider.put(...a);
        },
        exec: async (...a: Parameters<SandboxProvider["exec"]>) => {
          if (a[1] === RUN_TESTS_ARGV) testsRun.push(a[0].id);
          return fleet.deps.provider.exec(...a);
        },
      });
    // Its lock fresh (the fence alone refuses), or old enough to have lapsed.
    const fresh = (id: string) => ({ ...job(id), processedOn: Date.now() });
    const lapsed = (id: string) => ({ ...job(id), processedOn: Date.now() - 25_000 });
    const closeQueued = async (id: string) =>
      !!(await fleet.deps.queues.queues.close.getJob(stageJobId(id, "close")));
    const handleOf = async (id: string) => (await store.get(id))!.receipts.seed!.handle.id;

    // 1. Superseded while it loaded the task: the note before staging refuses, nothing is staged.
    const loading = {
      ...fleet.deps,
      provider: watching(),
      store: Object.assign(Object.create(store) as typeof store, {
        getTask: async (digest: string) => {
          await laterAttemptBegins(beforeStaging);
          return store.getTask(digest);
        },
      }),
    };
    expect(await runStageJob("verify", fresh(beforeStaging), loading)).toBe("superseded");
    expect(staged).toEqual([]);

    // 2. Superseded between staging its tests and starting them: it does not start them.
    const staging = { ...fleet.deps, provider: watching(() => laterAttemptBegins(beforeTests)) };
    expect(await runStageJob("verify", fresh(beforeTests), staging)).toBe("superseded");
    expect(staged).toEqual([await handleOf(beforeTests)]);
    expect(testsRun).toEqual([]);

    // 3. Superseded after its tests ran: its verdict is dropped, and close is not enqueued under
    // the later attempt's tests (not even on the fresh-lock path, whose commands ioredis may
    // have held through an outage the lock did not survive).
    const grading = (id: string, fail?: FleetError | Error) => ({
      ...fleet.deps,
      provider: watching(),
      verify: async (ctx: Parameters<typeof verify>[0]) => {
        const verdict = await verify(ctx);
        await laterAttemptBegins(id);
        if (fail) throw fail;
        return verdict;
      },
    });
    expect(await runStageJob("verify", fresh(afterTests), grading(afterTests))).toBe("superseded");
    expect(testsRun).toEqual([await handleOf(afterTests)]);

    // 4. Superseded, then its grading fails: no failure recorded (one that ends the rollout, or a
    // retry's entry), no close; fenced atomically (fresh lock) or seen first (lapsed lock).
    const crash = new Error("the verifier crashed");
    expect(await runStageJob("verify", fresh(failingFresh), grading(failingFresh, crash))).toBe("superseded");
    const blip = FleetError.retryable("provider_unavailable", "the daemon blipped (the test)");
    expect(await runStageJob("verify", lapsed(failingLapsed), grading(failingLapsed, blip))).toBe(
      "superseded",
    );

    for (const id of ids) {
      const rec = (await store.get(id))!;
      expect(rec.receipts.verify).toBeUndefined();
      expect(rec.failure).toBeNull();
      expect(await store.failureLog(id)).toEqual([]);
      expect(await closeQueued(id)).toBe(false);
    }
    // The later attempts verify as usual where the first attempts' tests never started (and
    // those, seen to end, need no waiting out); where they ran, the later attempt masks.
    for (const id of ids) {
      await fleet.redis.hdel(store.keys.rollout(id), "t:verify:last");
      if (id === beforeStaging || id === beforeTests) {
        expect(await runStageJob("verify", job(id, 1), fleet.deps)).toBe("ok");
        expect(await closeQueued(id)).toBe(true);
        await closeExpecting(id, { status: "completed", reward: 1 });
      } else await expectCutShort(id);
    }
  });

  it("a verify whose lock may have lapsed and whose rollout closed under it (a stop) enqueues close", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    for (const stage of ["seed", "run"] as const) await runStageJob(stage, job(id!), fleet.deps);
    const closing = {
      ...fleet.deps,
      verify: async (ctx: Parameters<typeof verify>[0]) => {
        const verdict = await verify(ctx);
        await fleet.deps.store.tombstone(id!); // a close began (its job then lost, say)
        return verdict;
      },
    };
    expect(await runStageJob("verify", { ...job(id!), processedOn: Date.now() - 25_000 }, closing)).toBe(
      "ok",
    );
    expect((await fleet.deps.store.get(id!))!.receipts.verify).toBeUndefined();
    expect(await fleet.deps.queues.queues.close.getJob(stageJobId(id!, "close"))).toBeTruthy();
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({ status: "masked", reward: null });
    expect(await containersOf([id!])).toBe(0);
  });

  it("a fresh launch (its lock cannot have lapsed) sends verify with its receipt; a stop that came meanwhile still ends in close", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const gate = gatedHarness();
    const slow = { ...fleet.deps, stopPollMs: 60_000, createHarness: gate.createHarness };
    const a = runStageJob("run", { ...job(id!), processedOn: Date.now() }, slow);
    await gate.started;
    // A cancel whose dispatcher died before it enqueued close: the fence is stopped.
    await fleet.deps.store.requestCancel(id!);
    gate.release();
    expect(await a).toBe("ok");
    expect((await fleet.deps.store.get(id!))!.receipts.run).toBeUndefined();
    // Verify went out with the (refused) receipt, and skips to close on the cancel.
    expect(await runStageJob("verify", job(id!), fleet.deps)).toBe("skipped");
    expect(await fleet.deps.queues.queues.close.getJob(`${id}.close`)).toBeDefined();
    await runStageJob("close", job(id!), fleet.deps);
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("cancelled");
  });

  it("an agent that leaves a loop killing every process of its uid is graded, not masked", async () => {
    const [id] = await fleet.submit([
      {
        task: byId("hello-file"),
        agent: {
          harness: "command",
          argv: ["bash", "-c", "setsid bash -c 'while :; do kill -9 -1; done' >/dev/null 2>&1 < /dev/null &"],
        },
      },
    ]);
    for (const stage of ["seed", "run", "verify", "close"] as const)
      await runStageJob(stage, job(id!), fleet.deps);
    const r = await fleet.deps.store.getResult(id!);
    expect(r).toMatchObject({ status: "completed", reward: 0, mask: false });
  });

  it("a seed whose task is gone fails invalid_task and leaves no intent: the teardown is confirmed at once", async () => {
    const task = { ...byId("hello-file"), id: `gone-${Date.now()}` };
    const [id] = await fleet.submit([oracle(task)]);
    const rec = (await fleet.deps.store.get(id!))!;
    await fleet.redis.del(fleet.deps.store.keys.task(rec.meta.taskDigest));
    await expect(runStageJob("seed", job(id!), fleet.deps)).rejects.toThrow(/invalid_task/);
    expect((await fleet.deps.ledger.sandboxesOf(id!)).resources).toBeNull();
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "failed",
      failureKind: "invalid_task",
      teardown: "confirmed",
    });

    // When an earlier attempt recorded the intent (and may have made the sandbox), it stays.
    const [again] = await fleet.submit([oracle(task)]);
    await fleet.redis.del(fleet.deps.store.keys.task(rec.meta.taskDigest));
    await fleet.deps.store.begin(again!, "seed", Date.now(), beginOptions("seed", fleet.deps));
    await expect(runStageJob("seed", job(again!, 1), fleet.deps)).rejects.toThrow(/invalid_task/);
    expect((await fleet.deps.ledger.sandboxesOf(again!)).resources).not.toBeNull();
    await runStageJob("close", job(again!), { ...fleet.deps, intentGraceMs: 0 });
    expect((await fleet.deps.store.getResult(again!))?.teardown).toBe("confirmed");
  });

  it("a rollout asking more of its sandbox than this worker's ceiling allows fails invalid_task, naming the option and the variable, before any sandbox is made", async () => {
    // Admitted by a dispatcher configured otherwise (or before the ceiling was lowered).
    const [id] = await fleet.submit([
      { ...oracle(byId("hello-file")), sandbox: { memoryMb: 4096, cpus: 2 } },
    ]);
    let creates = 0;
    const counting = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      create: (spec: Parameters<SandboxProvider["create"]>[0]) => {
        creates++;
        return fleet.deps.provider.create(spec);
      },
    });
    const deps = { ...fleet.deps, provider: counting, sandboxCeiling: { memoryMb: 2048, cpus: 2 } };
    await expect(runStageJob("seed", job(id!), deps)).rejects.toThrow(
      "invalid_task: sandbox.memoryMb asks for 4096, more than this fleet allows (FLEET_SANDBOX_MAX_MEMORY_MB=2048)",
    );
    expect(creates).toBe(0);
    await runStageJob("close", job(id!), deps);
    const r = await fleet.deps.store.getResult(id!);
    expect(r).toMatchObject({
      status: "failed",
      failureKind: "invalid_task",
      stage: "seed",
      teardown: "confirmed",
    });
    expect(r!.failures.map((f) => f.reason)).toEqual([
      "sandbox.memoryMb asks for 4096, more than this fleet allows (FLEET_SANDBOX_MAX_MEMORY_MB=2048)",
    ]);

    // At the ceiling it runs.
    const [ok] = await fleet.submit([{ ...oracle(byId("hello-file")), sandbox: { memoryMb: 2048 } }]);
    for (const stage of ["seed", "run", "verify", "close"] as const) await runStageJob(stage, job(ok!), deps);
    expect(await fleet.deps.store.getResult(ok!)).toMatchObject({ status: "completed", reward: 1 });
    expect(creates).toBe(1);
  });

  it("a seed that arrives after a close began is refused and creates no sandbox, while the close is under way as after it (rule 9)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    let creates = 0;
    const counting = Object.assign(Object.create(fleet.deps.provider) as SandboxProvider, {
      create: async (...a: Parameters<SandboxProvider["create"]>) => {
        creates++;
        return fleet.deps.provider.create(...a);
      },
    });
    const deps = { ...fleet.deps, provider: counting };
    // A close began (its begin set the tombstone) and has not finalized (its worker died, say):
    // the rollout is not terminal, so only the tombstone stands between a late seed and a sandbox.
    await fleet.deps.store.tombstone(id!);
    expect(isTerminal((await fleet.deps.store.get(id!))!.status)).toBe(false);
    expect(await runStageJob("seed", job(id!), deps)).toBe("skipped");
    // Even bypassing the stage runner's checks, the tombstone refuses the sandbox intent.
    const rec = (await fleet.deps.store.get(id!))!;
    const intent = {
      key: `${id}:resources`,
      rolloutId: id!,
      owner: "resources" as const,
      provider: "docker" as const,
      handle: null,
      createdAt: Date.now(),
      expiresAt: rec.meta.deadlineAt,
    };
    expect(await fleet.deps.ledger.recordIntent(intent)).toBe("closed");
    expect(await fleet.deps.ledger.getSandbox(intent.key)).toBeNull();
    expect(creates).toBe(0);
    expect(await containersOf([id!])).toBe(0);
    // The close finishes; a seed after it replays the terminal state and still makes nothing.
    expect(await runStageJob("close", job(id!), fleet.deps)).toBe("ok");
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("masked"); // closed before any verdict: never a 0
    expect(await runStageJob("seed", job(id!), deps)).toBe("replayed");
    expect(await fleet.deps.ledger.recordIntent(intent)).toBe("closed");
    expect(creates).toBe(0);
    expect(await containersOf([id!])).toBe(0);
  });

  it("a stop that wins the launch claim means the run stage is skipped: no receipt, not even a start time", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    await fleet.deps.store.requestCancel(id!);
    const claim = await fleet.deps.store.claimLaunch(id!, "late");
    expect(claim).toMatchObject({ previous: "stopped", launches: 0 });
    // The stop keeps the fence: the late claim took nothing (rule 10).
    expect((await fleet.deps.store.get(id!))!.fence).toBe("stopped");
    expect(await fleet.deps.store.launchState(id!, "late")).toBe("stop");
    await runStageJob("run", job(id!), fleet.deps);
    const rec = await fleet.deps.store.get(id!);
    expect(rec!.receipts.run).toBeUndefined();
    expect(rec!.times["run:start"]).toBeUndefined();
    await runStageJob("close", job(id!), fleet.deps);
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("cancelled");
  });

  it("a run handler that claims its launch itself (no claim at begin) and loses it to a stop starts no harness and hands over to close (rule 10)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    // Begun without a launch claim; the stop comes between that begin and the handler's claim.
    const {
      record,
      failures,
      unreadableFailures: _,
      ...begun
    } = await fleet.deps.store.begin(id!, "run", Date.now());
    expect(begun.launch).toBeNull();
    await fleet.deps.store.requestCancel(id!);
    const { counting, launches } = countingLaunches(fleet.deps);
    const rec = Object.assign(record!, { begun, failureLog: failures });
    expect(await HANDLERS.run(rec, counting, 1)).toBe("close");
    expect(launches()).toBe(0);
    expect((await fleet.deps.store.get(id!))!.receipts.run).toBeUndefined();
    await runStageJob("close", job(id!), fleet.deps);
    expect((await fleet.deps.store.getResult(id!))?.status).toBe("cancelled");
  });

  it("a run whose begin is sent again after a later delivery's claim (ioredis re-sends one whose reply a reconnect lost) is superseded: it starts no harness and leaves the fence to that launch (rule 10)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    await fleet.deps.store.begin(id!, "run", Date.now(), { launchToken: "first" });
    await fleet.deps.store.begin(id!, "run", Date.now(), { launchToken: "later" });
    // The first delivery's begin again, late.
    const {
      record,
      failures,
      unreadableFailures: _,
      ...begun
    } = await fleet.deps.store.begin(id!, "run", Date.now(), {
      launchToken: "first",
    });
    expect(begun.launch).toMatchObject({ previous: "superseded", launches: 0 });
    const { counting, launches } = countingLaunches(fleet.deps);
    // Its lock as fresh as can be: the handler does not rely on looking at the fence again.
    const lock = { since: Date.now(), durationMs: 60_000 };
    const rec = Object.assign(record!, { begun, failureLog: failures, lock });
    expect(await HANDLERS.run(rec, counting, 1)).toBe(SUPERSEDED);
    expect(launches()).toBe(0);
    const after = await fleet.deps.store.get(id!);
    expect(after!.fence).toBe("launched:later");
    expect(after!.launches).toBe(2);
    expect(after!.receipts.run).toBeUndefined();
  });

  it("a run delivery whose job lock another delivery holds (its own lapsed before its begin reached Redis) claims nothing and is superseded (rule 10)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const queueQualifiedName = `${fleet.prefix}:run`;
    const jobId = `${id}.run`;
    await fleet.redis.set(`${queueQualifiedName}:${jobId}:lock`, "later-delivery", "PX", 60_000);
    const { counting, launches } = countingLaunches(fleet.deps);
    const delivery = { ...job(id!), id: jobId, token: "this-delivery", queueQualifiedName };
    expect(await runStageJob("run", delivery, counting)).toBe("superseded");
    expect(launches()).toBe(0);
    const rec = await fleet.deps.store.get(id!);
    expect([rec!.fence, rec!.launches, rec!.receipts.run]).toEqual([null, 0, undefined]);
    // Its lock held: it runs.
    await fleet.redis.set(`${queueQualifiedName}:${jobId}:lock`, "this-delivery", "PX", 60_000);
    expect(await runStageJob("run", delivery, counting)).toBe("ok");
    expect(launches()).toBe(1);
  });

  it("an error from a sandbox that vanished mid-run masks as sandbox_lost, whatever its surface", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    // A harness whose sandbox is removed under it and whose last call then looks like a task error.
    const racing = {
      ...fleet.deps,
      createHarness: () => ({
        name: "command" as const,
        async run(ctx: { handle: SandboxHandle }) {
          await docker.destroy(ctx.handle);
          throw FleetError.nonRetryable("invalid_task", "/workspace: no such file or directory");
        },
      }),
    } as typeof fleet.deps;
    await expect(runStageJob("run", job(id!), racing)).rejects.toThrow(/sandbox_lost/);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "masked",
      failureKind: "sandbox_lost",
      exitCode: -2,
      reward: null,
    });
  });

  it("…also while the removed sandbox still reports itself running for a moment", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    // Docker answers "running" for a moment while a force-remove is under way: the first looks
    // after the error see the sandbox alive, the next ones see it gone.
    const real = fleet.deps.provider;
    let lagging = 0;
    const provider = new Proxy(real, {
      get(target, prop) {
        if (prop === "alive") {
          return async (h: SandboxHandle) => (lagging-- > 0 ? true : target.alive(h));
        }
        const value = Reflect.get(target, prop, target);
        return typeof value === "function" ? value.bind(target) : value;
      },
    });
    const racing = {
      ...fleet.deps,
      provider,
      createHarness: () => ({
        name: "command" as const,
        async run(ctx: { handle: SandboxHandle }) {
          await docker.destroy(ctx.handle);
          lagging = 3;
          throw FleetError.nonRetryable(
            "invalid_task",
            "staging 1 file(s) into /tmp/fleet failed (exit 137)",
          );
        },
      }),
    } as typeof fleet.deps;
    await expect(runStageJob("run", job(id!), racing)).rejects.toThrow(/sandbox_lost/);
    expect(lagging).toBeLessThan(0); // it looked again until the sandbox was seen gone
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "masked",
      failureKind: "sandbox_lost",
    });
  });

  it("a stage whose predecessor's receipt is not there yet retries, then proceeds once it is", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    // run before seed's receipt exists: a retry, not a failure of the rollout.
    const early = runStageJob("run", job(id!), fleet.deps);
    await expect(early).rejects.toThrow(/without a seed receipt/);
    await expect(early).rejects.not.toBeInstanceOf(UnrecoverableError);
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    // verify before run's receipt exists: the same.
    await runStageJob("seed", job(id!), fleet.deps);
    const tooEarly = runStageJob("verify", job(id!), fleet.deps);
    await expect(tooEarly).rejects.toThrow(/no run receipt/);
    await expect(tooEarly).rejects.not.toBeInstanceOf(UnrecoverableError);
    expect((await fleet.deps.store.get(id!))!.failure).toBeNull();
    expect(await runStageJob("run", job(id!, 1), fleet.deps)).toBe("ok");
    expect(await runStageJob("verify", job(id!, 1), fleet.deps)).toBe("ok");
    expect(await runStageJob("close", job(id!), fleet.deps)).toBe("ok");
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({ status: "completed", reward: 1 });
  });

  it("verify refuses for good a run receipt whose cleanup was not confirmed (rule 2)", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    const rec = (await fleet.deps.store.get(id!))!;
    const at = Date.now();
    await fleet.deps.store.saveReceipt(
      rec.meta,
      "run",
      {
        exec: execResult(),
        answer: null,
        transcript: null,
        usage: null,
        cleanup: { confirmed: false, scope: "processes", at, alreadyGone: false, remaining: 2 },
        ownedSandbox: null,
        startedAt: at,
        stoppedAt: at,
        attempts: 1,
        at,
      },
      "ran",
      at,
    );
    // First attempt, attempts left: still final, not retried.
    await expect(runStageJob("verify", job(id!), fleet.deps)).rejects.toBeInstanceOf(UnrecoverableError);
    await runStageJob("close", job(id!), fleet.deps);
    expect(await fleet.deps.store.getResult(id!)).toMatchObject({
      status: "masked",
      failureKind: "verifier_error",
      reward: null,
    });
  });

  it("verify refuses to run without a confirmed cleanup receipt", async () => {
    const [id] = await fleet.submit([oracle(byId("hello-file"))]);
    await runStageJob("seed", job(id!), fleet.deps);
    // Skip the run stage: no cleanup receipt exists.
    await expect(runStageJob("verify", job(id!, 2), fleet.deps)).rejects.toThrow(/cleanup receipt/);
    await runStageJob("close", job(id!), fleet.deps);
    const r = await fleet.deps.store.getResult(id!);
    expect(r).toMatchObject({ status: "masked", failureKind: "verifier_error", reward: null });
  });
});

async function waitFor(cond: () => Promise<boolean>, timeoutMs = 60_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error("condition not met in time");
    await new Promise((r) => setTimeout(r, 100));
  }
}
