import { execFileSync } from "node:child_process";
import { AgentSpec, type AgentSpecInput, type SandboxHandle, type TaskContent } from "@fleet/contracts";
import { createHarness, type HarnessOutcome, stageWorkspace } from "@fleet/harness";
import {
  AGENT_USER,
  DockerSandboxProvider,
  ROOT_USER,
  type SandboxProvider,
  TestsSupersededError,
} from "@fleet/sandbox";
import { execResult } from "@fleet/sandbox/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, afterEach, describe, expect, it } from "vitest";
import { REWARD_FILE, RUN_TESTS_ARGV, TESTS_CUT_SHORT, TESTS_STARTED_MARK, verify } from "./verify.ts";

// The bundled example suite end to end on real Docker: in one sandbox per task, a wrong agent
// scores 0, then the oracle scores 1.0 (re-verifying the same sandbox also proves the verifier
// clears what the previous grading left in /tests and /logs/verifier).
const IMAGE_OVERRIDE = process.env.FLEET_BASE_IMAGE;
const provider = new DockerSandboxProvider();
const RUN = `it-suite-${process.pid}-${Date.now().toString(36)}`;
const created: SandboxHandle[] = [];
const rolloutIds: string[] = [];
const tasks = (await loadSuite(EXAMPLE_SUITE_DIR)).map((t) =>
  IMAGE_OVERRIDE ? { ...t, image: IMAGE_OVERRIDE } : t,
);

const ORACLE: AgentSpecInput = { harness: "oracle" };
/** Does nothing useful: leaves the workspace untouched and answers "42". */
const WRONG: AgentSpecInput = { harness: "command", argv: ["bash", "-c", "echo 42"] };

async function sandbox(task: TaskContent, label: string): Promise<SandboxHandle> {
  const rolloutId = `${RUN}-${label}`;
  rolloutIds.push(rolloutId);
  const handle = await provider.create({
    image: task.image,
    rolloutId,
    owner: "resources",
    expiresAt: Date.now() + 10 * 60_000,
  });
  created.push(handle);
  await stageWorkspace(provider, handle, task);
  return handle;
}

/** Run an agent, confirm its processes are gone (close-before-verify), then grade. */
/**
 * These tests grade one sandbox more than once (a wrong agent, then the oracle): the tests'
 * runner's mark that tests ran there, which makes a rollout's later verify attempt run nothing
 * (`TESTS_CUT_SHORT`), is removed before each grading.
 */
async function forgetTestsRan(handle: SandboxHandle): Promise<void> {
  const r = await provider.exec(handle, ["rm", "-f", TESTS_STARTED_MARK], {
    deadlineMs: 10_000,
    user: ROOT_USER,
  });
  expect(r.exitCode, r.stderr).toBe(0);
}

async function runAndVerify(handle: SandboxHandle, task: TaskContent, input: AgentSpecInput) {
  const agent = AgentSpec.parse(input);
  const outcome: HarnessOutcome = await createHarness(agent).run({
    provider,
    handle,
    task,
    agent,
    deadlineMs: Date.now() + task.timeouts.agentS * 1000,
    signal: new AbortController().signal,
  });
  const cleanup = await provider.killProcesses(handle, AGENT_USER);
  expect(cleanup.confirmed).toBe(true);
  await forgetTestsRan(handle);
  const verdict = await verify({ provider, handle, task, run: outcome, deadlineMs: Date.now() + 120_000 });
  return { outcome, verdict };
}

/** Grade an untouched run, recording which of put/exec/get the verification called. */
async function verifyCounting(handle: SandboxHandle, task: TaskContent) {
  await forgetTestsRan(handle);
  const calls: string[] = [];
  const verdict = await verify({
    provider: counting(calls),
    handle,
    task,
    run: { answer: null, exec: execResult() },
    deadlineMs: Date.now() + 120_000,
  });
  return { verdict, calls };
}

/** The provider, recording which of put/exec/get each verification called. */
function counting(calls: string[]): SandboxProvider {
  return new Proxy(provider, {
    get(target, key, receiver) {
      const value = Reflect.get(target, key, receiver);
      if (typeof value !== "function") return value;
      return (...args: unknown[]) => {
        if (key === "put" || key === "exec" || key === "get") calls.push(key);
        return value.apply(target, args);
      };
    },
  });
}

afterEach(async () => {
  await Promise.all(created.splice(0).map((h) => provider.destroy(h)));
});

afterAll(async () => {
  for (const rolloutId of rolloutIds) expect(await provider.list({ "fleet.rollout": rolloutId })).toEqual([]);
  await provider.close?.();
});

describe("the example suite on real Docker", () => {
  it("has the tasks this test expects", () => {
    expect(tasks.length).toBeGreaterThanOrEqual(12);
  });

  it.each(tasks.map((t) => [t.id, t] as const))(
    "%s: a wrong agent scores 0, the oracle 1.0",
    async (id, task) => {
      const handle = await sandbox(task, id);

      const wrong = await runAndVerify(handle, task, WRONG);
      expect(wrong.verdict.reward, JSON.stringify(wrong.verdict.details)).toBe(0);

      const oracle = await runAndVerify(handle, task, ORACLE);
      expect(oracle.outcome.exec.exitCode, oracle.outcome.exec.stderr).toBe(0);
      expect(oracle.verdict.reward, JSON.stringify(oracle.verdict.details)).toBe(1);
      // Tasks whose tests run the agent's code write the reward file themselves, last.
      const writesReward = ["poem-stats", "python-bugfix", "shell-script"].includes(id);
      const source = task.verifier.kind === "match" ? "match" : writesReward ? "reward_file" : "exit_code";
      expect(oracle.verdict.details.source).toBe(source);
    },
  );

  it.each([
    ["shell-script", "reward file", "printf 'echo 1 > /logs/verifier/reward.txt; echo nope\\n' > greet.sh"],
    [
      "python-bugfix",
      "reward file, early exit",
      'printf \'import os\\nopen("/logs/verifier/reward.txt", "w").write("1")\\nos._exit(0)\\n\' > stats.py',
    ],
    [
      "json-transform",
      "shadowed module",
      'printf \'def load(f):\\n    return ["Alice", "Carol", "Eve", "Trent"]\\n\' > json.py; echo "[]" > adults.json',
    ],
    [
      "shell-script",
      "reward file and /logs/verifier made read-only",
      "printf 'echo 1 > /logs/verifier/reward.txt; chmod 444 /logs/verifier/reward.txt; chmod 555 /logs/verifier\\n' > greet.sh",
    ],
    [
      "python-bugfix",
      "reward file and /logs/verifier made read-only",
      'printf \'import os\\nopen("/logs/verifier/reward.txt", "w").write("1")\\nos.chmod("/logs/verifier/reward.txt", 0o444)\\nos.chmod("/logs/verifier", 0o555)\\n\' > stats.py',
    ],
    [
      "shell-script",
      "the agent's own read-only /logs/verifier swapped in",
      "mkdir /logs/mine && echo 1 > /logs/mine/reward.txt && chmod 444 /logs/mine/reward.txt && chmod 555 /logs/mine && printf 'mv /logs/verifier /logs/old; mv /logs/mine /logs/verifier\\n' > greet.sh",
    ],
    [
      "python-bugfix",
      "a writer left in the background",
      'printf \'import os\\nif os.fork() == 0:\\n    os.close(1); os.close(2)\\n    while True:\\n        try: open("/logs/verifier/reward.txt", "w").write("1")\\n        except OSError: pass\\n\' > stats.py',
    ],
    [
      "shell-script",
      "a writer left in the background",
      "printf '(while :; do echo 1 > /logs/verifier/reward.txt; done) >/dev/null 2>&1 &\\n' > greet.sh",
    ],
    [
      "shell-script",
      "reward file written, then the tests and their runner killed",
      // biome-ignore lint/suspicious/noTemplateCurlyInString: a shell parameter expansion, not a template
      "printf 'mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; for p in /proc/[0-9]*; do grep -qsE \"fleet-verify|tests/test.sh\" $p/cmdline && kill -9 ${p#/proc/}; done\\n' > greet.sh",
    ],
    [
      "shell-script",
      "reward file written, then only the tests killed (their runner reports the file)",
      `cat > greet.sh <<'EOF'
mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt
for p in /proc/[0-9]*; do
  [ "$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)" = "bash /tests/test.sh " ] && kill -9 \${p#/proc/}
done
EOF`,
    ],
    [
      "shell-script",
      "a writer in a session of its own, its wrapper killed",
      `cat > greet.sh <<'EOF'
setsid bash -c 'while :; do mkdir -p /logs/verifier 2>/dev/null; echo 1 > /logs/verifier/reward.txt 2>/dev/null; done' </dev/null >/dev/null 2>&1 &
kill -9 $PPID
EOF`,
    ],
    [
      "python-bugfix",
      "a writer in a session of its own, pytest killed",
      `cat > stats.py <<'EOF'
import os
if os.fork() == 0:
    os.setsid()
    os.close(1); os.close(2)
    while True:
        try:
            os.makedirs("/logs/verifier", exist_ok=True)
            open("/logs/verifier/reward.txt", "w").write("1")
        except OSError:
            pass
os.kill(os.getppid(), 9)
EOF`,
    ],
  ])("%s: agent code the tests run cannot grade itself (%s)", async (id, _how, script) => {
    const task = tasks.find((t) => t.id === id)!;
    const handle = await sandbox(task, `${id}-selfgrade`);
    const { verdict } = await runAndVerify(handle, task, {
      harness: "command",
      argv: ["bash", "-c", script],
    });
    expect(verdict.reward, JSON.stringify(verdict.details)).toBe(0);
  });

  it.each([
    [
      "config-edit",
      "app.conf a symlink to the tests' copy",
      "rm app.conf && ln -s /tests/expected.conf app.conf",
    ],
    [
      "file-permissions",
      "notes.txt emptied",
      "chmod 750 run.sh && chmod 600 secret.txt && : > notes.txt && chmod 644 notes.txt && mkdir -m 700 private",
    ],
    [
      "file-permissions",
      "secret.txt emptied",
      "chmod 750 run.sh && : > secret.txt && chmod 600 secret.txt && chmod 644 notes.txt && mkdir -m 700 private",
    ],
    [
      "directory-tree",
      "todo.txt emptied",
      "mkdir -p sorted/csv sorted/jpg sorted/png sorted/txt && mv inbox/*.csv sorted/csv && mv inbox/*.jpg sorted/jpg && mv inbox/*.png sorted/png && mv inbox/*.txt sorted/txt && : > sorted/txt/todo.txt",
    ],
    [
      "file-permissions",
      "secret.txt and run.sh replaced at their sizes",
      "chmod 750 run.sh && chmod 600 secret.txt && printf 'api-token: stolenXXXXXXXXXXX\\n' > secret.txt && printf '#!/bin/bash\\nexit 1 #XXXXXXXXXXXXXXXXXXXXXX\\n' > run.sh && chmod 644 notes.txt && mkdir -m 700 private",
    ],
    [
      "poem-stats",
      "the four right lines and another LINES=",
      "printf 'LINES=6\\nWORDS=21\\nBYTES=109\\nLONGEST=haunches\\nLINES=999\\n' > stats.env",
    ],
    [
      "poem-stats",
      "the four right lines and a junk line",
      "printf 'LINES=6\\nWORDS=21\\nBYTES=109\\nLONGEST=haunches\\njunk\\n' > stats.env",
    ],
    [
      "long-deadline",
      "the 25 primes on one line",
      "python3 -c 'print(*[2,3,5,7,11,13,17,19,23,29,31,37,41,43,47,53,59,61,67,71,73,79,83,89,97])' > primes.txt",
    ],
    ["hello-file", "three lines, not one", "printf 'Hello, fleet!\\n\\n\\n' > hello.txt"],
  ])("%s: work the instruction forbids scores 0 (%s)", async (id, _how, script) => {
    const task = tasks.find((t) => t.id === id)!;
    const handle = await sandbox(task, `${id}-forbidden`);
    const { outcome, verdict } = await runAndVerify(handle, task, {
      harness: "command",
      argv: ["bash", "-c", script],
    });
    expect(outcome.exec.exitCode, outcome.exec.stderr).toBe(0);
    expect(verdict.reward, JSON.stringify(verdict.details)).toBe(0);
  });

  it("nothing the tests started outlives the verification, however it hid (a session of its own, another name)", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh": [
          "setsid sleep 991 </dev/null >/dev/null 2>&1 &",
          "(exec -a fleet-keepalive sleep 992) </dev/null >/dev/null 2>&1 &",
          "exit 0",
        ].join("\n"),
      },
    };
    const handle = await sandbox(task, "leftovers");
    const { verdict } = await runAndVerify(handle, task, WRONG);
    // Tests that exit 0 but leave processes running: whatever they said, it is not trusted.
    // Two processes, each counted once (one still exiting as reap goes round again is no second).
    expect(verdict).toMatchObject({ reward: 0, details: { source: "stray_processes", strays: 2 } });
    const left = await provider.exec(handle, ["bash", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"], {
      deadlineMs: 10_000,
      user: "0:0",
    });
    expect(left.stdout).not.toMatch(/ 99[12] /);
  });

  it("tests that stop what they started without waiting for it (a fatal signal already on its way) leave no stray", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh": [
          // A server the tests start, ignoring SIGHUP; then stopped with a plain kill, no wait.
          "python3 -c 'import time, signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); time.sleep(300)' &",
          "sleep 300 &",
          "sleep 0.3",
          "kill %1 %2; echo 0.5 > /logs/verifier/reward.txt",
        ].join("\n"),
      },
    };
    const handle = await sandbox(task, "stopped-unwaited");
    for (let i = 0; i < 3; i++) {
      const { verdict } = await runAndVerify(handle, task, WRONG);
      expect(verdict, JSON.stringify(verdict.details)).toMatchObject({
        reward: 0.5,
        details: { source: "reward_file" },
      });
    }
  });

  it("a writer the agent's code starts in the tests, silent until their last command, cannot give a wrong answer 1.0", async () => {
    // Tests as many task authors write them: run the agent's program, write the reward, end.
    // The agent's program starts detached writers (a session of their own; one a fork chain whose
    // pid keeps changing) that write 1 only once the tests' last command ran: every write lands
    // after the tests' own verdict, in the last moments of the tests or after them.
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh": [
          "cd /workspace",
          "touch /tmp/testing",
          "out=$(timeout 10 python3 sol.py 2>/dev/null)",
          'if [ "$out" = "42" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi',
          'echo "got: $out"',
          "rm -f /tmp/testing",
        ].join("\n"),
      },
    };
    const sol = `import subprocess
loop = "while :; do [ -e /tmp/testing ] || echo 1 > /logs/verifier/reward.txt 2>/dev/null; done"
chain = "x() { [ -e /tmp/testing ] || echo 1 > /logs/verifier/reward.txt 2>/dev/null; x & }; x"
for cmd in [loop, loop, chain]:
    subprocess.Popen(["setsid", "-f", "bash", "-c", cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(41)
`;
    const handle = await sandbox(task, "late-writer");
    const { verdict } = await runAndVerify(handle, task, {
      harness: "command",
      argv: ["bash", "-c", `cat > sol.py <<'EOF'\n${sol}EOF`],
    });
    expect(verdict.reward, JSON.stringify(verdict.details)).toBe(0);
    expect(verdict.details).toMatchObject({ source: "stray_processes" });
    expect(verdict.details.stdoutTail).toContain("got: 41");
  });

  it("poem-stats: 3 of 4 correct lines → reward 0.75 from the reward file", async () => {
    const task = tasks.find((t) => t.id === "poem-stats")!;
    const handle = await sandbox(task, "poem-partial");
    const partial: AgentSpecInput = {
      harness: "command",
      argv: ["bash", "-c", "printf 'LINES=6\\nWORDS=21\\nBYTES=109\\nLONGEST=looking\\n' > stats.env"],
    };
    const { verdict } = await runAndVerify(handle, task, partial);
    expect(verdict.reward).toBe(0.75);
    expect(verdict.details).toMatchObject({ source: "reward_file", rewardText: "0.75", exitCode: 0 });

    // Graded again, counting sandbox calls: staging the tests and one exec that runs them and
    // brings the reward file back.
    const again = await verifyCounting(handle, task);
    expect(again.verdict.reward).toBe(0.75);
    expect(again.calls).toEqual(["put", "exec"]);
  });

  it("a reward file over 1 KiB is read apart, as before", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: { "test.sh": `printf '1%2000s' '' > /logs/verifier/reward.txt\n` },
    };
    const large = await verifyCounting(await sandbox(task, "large-reward"), task);
    expect(large.verdict).toMatchObject({ reward: 1, details: { source: "reward_file" } });
    expect(large.calls).toEqual(["put", "exec", "get"]);
  });

  it("a reward file no one may read: tests that failed grade 0 by their exit status; tests that passed mask", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const withTests = (exit: number): TaskContent => ({
      ...base,
      tests: {
        "test.sh": `echo 0.3 > /logs/verifier/reward.txt; chmod 000 /logs/verifier/reward.txt; exit ${exit}\n`,
      },
    });
    // The agent's code under test may have done it: a mask would trade its failure for one.
    const failed = withTests(1);
    const graded = await verifyCounting(await sandbox(failed, "unreadable-reward-failed"), failed);
    expect(graded.verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
    expect(graded.verdict.details.reason).toMatch(/cannot be read/);
    // Tests that passed and left no readable verdict: the grader's fault, masked.
    const passed = withTests(0);
    const err = await verifyCounting(await sandbox(passed, "unreadable-reward-passed"), passed).catch(
      (e) => e,
    );
    expect(err).toMatchObject({ kind: "verifier_error" });
  });

  it("tests whose stderr passes the output cap: the runner's report, at the end, is kept with the output's tail", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh": "head -c 2000000 /dev/zero | tr '\\0' e >&2\necho 0.5 > /logs/verifier/reward.txt\n",
      },
    };
    const noisy = await verifyCounting(await sandbox(task, "noisy-tests"), task);
    expect(noisy.verdict).toMatchObject({ reward: 0.5, details: { source: "reward_file" } });
    expect(noisy.calls).toEqual(["put", "exec"]); // no separate read of the reward file
  });

  it("tests killed by a signal: their status comes through the runner and grades 0", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = { ...base, tests: { "test.sh": "kill -KILL $$\n" } };
    const killed = await verifyCounting(await sandbox(task, "killed-tests"), task);
    expect(killed.verdict).toMatchObject({ reward: 0, details: { source: "exit_code", exitCode: 137 } });
    expect(killed.calls).toEqual(["put", "exec"]);
  });

  it.each([
    ["#!/bin/bash -e", 0],
    ["#!/usr/bin/env -S bash -euo pipefail", 0],
    ["#!/bin/bash", 1],
    ["", 1],
  ] as const)(
    "test.sh runs as its #! line says (%j): a failing command under -e fails the tests",
    async (shebang, reward) => {
      const base = tasks.find((t) => t.id === "hello-file")!;
      const task: TaskContent = {
        ...base,
        tests: { "test.sh": `${shebang}\ngrep -qx hi /workspace/no-such-file\necho "all checks passed"\n` },
      };
      const label = `shebang-${shebang.length}-${reward}`;
      const graded = await verifyCounting(await sandbox(task, label), task);
      expect(graded.verdict).toMatchObject({ reward, details: { source: "exit_code" } });
    },
  );

  it.each([
    "#!/usr/bin/env no-such-interpreter",
    "#!/usr/bin/env -S no-such-interpreter -e",
    "#!/bin/no-such-shell",
  ])(
    "a #! interpreter the image does not have (%s) fails the task (invalid_task), never a 0 for every agent",
    async (shebang) => {
      const base = tasks.find((t) => t.id === "hello-file")!;
      const task: TaskContent = { ...base, tests: { "test.sh": `${shebang}\nexit 0\n` } };
      const err = await verifyCounting(await sandbox(task, `no-interp-${shebang.length}`), task).catch(
        (e) => e,
      );
      expect(err).toMatchObject({ kind: "invalid_task", retryable: false });
      expect(err.message).toMatch(
        /#! line names (\/usr\/bin\/env |)?\/?[a-z/-]*no-such-(interpreter|shell), which the sandbox image does not have/,
      );
    },
  );

  it("a #! interpreter that is a directory (#!/usr/bin) fails the task (invalid_task), never a 0 for every agent", async () => {
    // `[ -x ]` holds for a directory: the tests were run by it, and exit 126 graded every agent 0.
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = { ...base, tests: { "test.sh": "#!/usr/bin\nexit 0\n" } };
    const err = await verifyCounting(await sandbox(task, "dir-interp"), task).catch((e) => e);
    expect(err).toMatchObject({ kind: "invalid_task", retryable: false });
    expect(err.message).toMatch(/#! line names \/usr\/bin, which the sandbox image does not have/);
  });

  it("a test.sh in Python (#!/usr/bin/env python3) runs in Python", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh":
          "#!/usr/bin/env python3\nimport pathlib\npathlib.Path('/logs/verifier/reward.txt').write_text(str(0.25))\n",
      },
    };
    const graded = await verifyCounting(await sandbox(task, "python-tests"), task);
    expect(graded.verdict).toMatchObject({ reward: 0.25, details: { source: "reward_file" } });
  });

  it("a reward.json (Harbor's other reward file) grades when there is no reward.txt; reward.txt wins beside it", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const withTests = (body: string): TaskContent => ({ ...base, tests: { "test.sh": body } });
    const json = withTests(`echo '{"reward": 0.3, "accuracy": 0.5}' > /logs/verifier/reward.json\nexit 0\n`);
    const graded = await verifyCounting(await sandbox(json, "reward-json"), json);
    expect(graded.verdict).toMatchObject({
      reward: 0.3,
      details: { source: "reward_file", rewardFile: "reward.json", rewards: { accuracy: 0.5 } },
    });
    expect(graded.calls).toEqual(["put", "exec"]);
    const both = withTests(
      `echo '{"reward": 0.3}' > /logs/verifier/reward.json; echo 0.6 > /logs/verifier/reward.txt\n`,
    );
    const txt = await verifyCounting(await sandbox(both, "reward-both"), both);
    expect(txt.verdict).toMatchObject({ reward: 0.6, details: { source: "reward_file", rewardText: "0.6" } });
    expect(txt.verdict.details.rewardFile).toBeUndefined();
  });

  it("tests that exit 255 (`exit -1`) keep the reward they wrote: no signal ended them", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: { "test.sh": "echo 0.5 > /logs/verifier/reward.txt\nexit -1\n" },
    };
    const graded = await verifyCounting(await sandbox(task, "exit-255"), task);
    expect(graded.verdict).toMatchObject({ reward: 0.5, details: { source: "reward_file", exitCode: 255 } });
  });

  it("the tests never see the oracle's /solution: tests leaning on it fail the oracle as they fail every agent", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      solution: { ...base.solution, "expected.txt": "hi\n" },
      tests: {
        "test.sh": "ls -A /solution >&2; test ! -e /solution/expected.txt && test ! -e /solution/solve.sh\n",
      },
    };
    const handle = await sandbox(task, "solution-hidden");
    const { outcome, verdict } = await runAndVerify(handle, task, ORACLE);
    expect(outcome.exec.exitCode).toBe(0);
    expect(verdict).toMatchObject({ reward: 1, details: { source: "exit_code", exitCode: 0 } });
  });

  it("a verify attempt whose epoch is below the sandbox's verify fence stages nothing and starts nothing (a later attempt took the sandbox over); one at or above it grades", async () => {
    const task = tasks.find((t) => t.id === "hello-file")!;
    const handle = await sandbox(task, "fenced");
    const { verdict } = await runAndVerify(handle, task, ORACLE);
    expect(verdict.reward).toBe(1);
    // A later attempt (epoch 4) fences the sandbox as it sweeps it.
    expect(await provider.killProcesses(handle, ROOT_USER, { fenceEpoch: 4 })).toMatchObject({
      confirmed: true,
      fenced: true,
    });
    // What the later attempt staged and its tests wrote (staging replaces /tests; a runner
    // clears /logs/verifier first).
    const marks = async () =>
      (
        await provider.exec(handle, ["sh", "-c", `cat /tests/mark ${REWARD_FILE}.mark`], {
          deadlineMs: 10_000,
          user: ROOT_USER,
        })
      ).stdout;
    await provider.exec(handle, ["sh", "-c", `echo staged > /tests/mark; echo later > ${REWARD_FILE}.mark`], {
      deadlineMs: 10_000,
      user: ROOT_USER,
    });
    expect(await marks()).toBe("staged\nlater\n");
    /** Grade an untouched run as the verify attempt of this epoch. */
    const verifyAs = async (fenceEpoch: number) => {
      await forgetTestsRan(handle);
      return verify({
        provider,
        handle,
        task,
        run: { answer: null, exec: execResult() },
        deadlineMs: Date.now() + 120_000,
        fenceEpoch,
      });
    };
    // The earlier attempt (epoch 3), paused past its lock, wakes and stages its tests: refused.
    const stale = await verifyAs(3).catch((e: unknown) => e);
    expect(stale).toBeInstanceOf(TestsSupersededError);
    expect(stale).toMatchObject({ fence: 4, epoch: 3 });
    // Its tests' runner, had it staged before the fence and woken only now, refuses too.
    const nonce = "0".repeat(32);
    const runner = await provider.exec(handle, RUN_TESTS_ARGV, {
      deadlineMs: 30_000,
      cwd: "/",
      user: ROOT_USER,
      stdin: `${nonce}\n3\n`,
    });
    expect(runner.exitCode).toBe(5);
    expect(runner.stderr).toContain(`\n${nonce} superseded 4\n`);
    expect(runner.stderr).not.toContain(`${nonce} ready`);
    // Neither touched anything.
    expect(await marks()).toBe("staged\nlater\n");
    // The attempt that holds the fence, and any later one, grades.
    for (const fenceEpoch of [4, 5]) {
      const { verdict: again } = await runAndVerify(handle, task, ORACLE);
      expect(again.reward).toBe(1);
      expect((await verifyAs(fenceEpoch)).reward).toBe(1);
    }
  });

  it("tests run at most once on a sandbox: a second run finds the first's mark and runs nothing (masked: the first run changed the sandbox); an agent cannot plant the mark", async () => {
    // Tests that change the sandbox: a second run on it would grade another sandbox (here, fail).
    // They also clear /logs as tests may (`rm -rf /logs/*`: the mark is a dot file), and leave a
    // directory there that root cannot search (the mark is looked for before /logs is scanned).
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh":
          "set -e\nmkdir /tmp/results\ngrep -qx 'Hello, fleet!' hello.txt\nrm -rf /logs/*\nmkdir -p /logs/verifier /logs/cache\nchmod 000 /logs/cache\n",
      },
    };
    const handle = await sandbox(task, "tests-once");
    // The agent plants the mark (its own file, removed with its other leftovers in /logs).
    const planter: AgentSpecInput = {
      harness: "command",
      argv: ["bash", "-c", `printf 'Hello, fleet!\\n' > hello.txt && : > ${TESTS_STARTED_MARK}`],
    };
    const agent = AgentSpec.parse(planter);
    const outcome = await createHarness(agent).run({
      provider,
      handle,
      task,
      agent,
      deadlineMs: Date.now() + 60_000,
      signal: new AbortController().signal,
    });
    expect(outcome.exec.exitCode, outcome.exec.stderr).toBe(0);
    expect((await provider.killProcesses(handle, AGENT_USER)).confirmed).toBe(true);
    const grade = () => verify({ provider, handle, task, run: outcome, deadlineMs: Date.now() + 120_000 });
    expect(await grade()).toMatchObject({ reward: 1, details: { source: "exit_code", exitCode: 0 } });
    const again = await grade().catch((e: unknown) => e);
    expect(again).toMatchObject({ name: "FleetError", kind: "verifier_error", retryable: false });
    expect((again as Error).message).toBe(TESTS_CUT_SHORT);
  });

  it("clearing the agent's leftovers in /logs takes none of the tests' budget: hundreds of mode-000 directories there, and the tests still run and grade", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = { ...base, timeouts: { ...base.timeouts, verifierS: 1 } };
    const handle = await sandbox(task, "slow-scrub");
    const litter: AgentSpecInput = {
      harness: "command",
      argv: [
        "python3",
        "-c",
        "import os\nos.makedirs('/logs/a')\nfor i in range(600): os.mkdir('/logs/a/%d' % i, 0)\nopen('hello.txt', 'w').write('Hello, fleet!\\n')\n",
      ],
    };
    const { outcome, verdict } = await runAndVerify(handle, task, litter);
    expect(outcome.exec.exitCode, outcome.exec.stderr).toBe(0);
    expect(verdict).toMatchObject({ reward: 1, details: { source: "exit_code", exitCode: 0 } });
  });

  // A wide litter: the scrub opens many to a chmod, within its minute. A deep one: nested past
  // PATH_MAX, which a chmod given full paths cannot open (it masked the rollout: sandbox_lost).
  it.each([
    {
      label: "many-dirs",
      what: "20,000 mode-000 directories in /logs (some nested)",
      script:
        "import os\nfor i in range(10000):\n  os.makedirs('/logs/d%d/e' % i)\n  os.chmod('/logs/d%d/e' % i, 0)\n  os.chmod('/logs/d%d' % i, 0)\n",
    },
    {
      label: "deep-dirs",
      what: "a chain of 3,000 mode-000 directories in /logs, nested past PATH_MAX",
      script:
        "import os\nos.mkdir('/logs/d')\nos.chdir('/logs/d')\nfor _ in range(3000):\n  os.mkdir('a')\n  os.chdir('a')\nfor _ in range(3000):\n  os.chdir('..')\n  os.chmod('a', 0)\nos.chdir('/workspace')\n",
    },
  ])(
    "an agent that leaves $what is graded on its work in one verify",
    async ({ label, script }) => {
      const task = tasks.find((t) => t.id === "hello-file")!;
      const handle = await sandbox(task, label);
      const litter: AgentSpecInput = {
        harness: "command",
        argv: ["python3", "-c", `${script}open('hello.txt', 'w').write('Hello, fleet!\\n')\n`],
      };
      const { outcome, verdict } = await runAndVerify(handle, task, litter);
      expect(outcome.exec.exitCode, outcome.exec.stderr).toBe(0);
      expect(verdict).toMatchObject({ reward: 1, details: { source: "exit_code", exitCode: 0 } });
    },
    120_000,
  );

  it("a reward file the agent planted in /logs/verifier is cleared, and the agent graded on its work", async () => {
    const task = tasks.find((t) => t.id === "hello-file")!;
    const handle = await sandbox(task, "tamper");
    const cheat: AgentSpecInput = {
      harness: "command",
      argv: ["bash", "-c", "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"],
    };
    const { verdict } = await runAndVerify(handle, task, cheat);
    // No hello.txt: the tests fail, and the planted "1" is gone.
    expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
  });

  it("an agent that filled /logs (all its inodes but one, or its space) is graded on its work: its files there are cleared before the tests", async () => {
    // poem-stats' test.sh ends with an echo (exit 0): were its reward write to fail for want of
    // room, the exit status would grade the agent's nothing 1.0.
    const task = tasks.find((t) => t.id === "poem-stats")!;
    for (const [name, fill] of [
      [
        "inodes",
        "mkdir -p /logs/.x && cd /logs/.x && i=0; while : > f$i 2>/dev/null; do i=$((i+1)); done; rm -f f0",
      ],
      ["space", "head -c 2000000000 /dev/zero > /logs/.fill; true"],
    ] as const) {
      const handle = await sandbox(task, `fill-logs-${name}`);
      const { verdict } = await runAndVerify(handle, task, {
        harness: "command",
        argv: ["bash", "-c", fill],
      });
      // No stats.env: no line right, 0 from the reward file; neither 1.0 nor masked.
      expect(verdict, name).toMatchObject({ reward: 0, details: { source: "reward_file" } });
    }
  });

  it("clearing the agent's files from /logs leaves what it left in /tmp for the tests", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const task: TaskContent = {
      ...base,
      tests: {
        "test.sh":
          'if [ "$(cat /tmp/agent-note)" = hi ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n',
      },
    };
    const handle = await sandbox(task, "logs-and-tmp");
    const agent: AgentSpecInput = {
      harness: "command",
      argv: [
        "bash",
        "-c",
        "echo hi > /tmp/agent-note && mkdir -p /logs/agent && echo log > /logs/agent/run.log",
      ],
    };
    const { verdict } = await runAndVerify(handle, task, agent);
    expect(verdict).toMatchObject({ reward: 1, details: { source: "reward_file" } });
  });

  it("a reward file that is no regular file (a FIFO, a device) is unreadable: tests that passed mask, none waits on it", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    for (const [name, make] of [
      ["fifo", "mkfifo /logs/verifier/reward.txt"],
      ["device", "ln -s /dev/zero /logs/verifier/reward.txt"],
    ] as const) {
      const task: TaskContent = {
        ...base,
        tests: { "test.sh": `${make}; exit 0\n` },
        timeouts: { ...base.timeouts, verifierS: 20 },
      };
      const err = await verifyCounting(await sandbox(task, `reward-${name}`), task).catch((e) => e);
      expect(err, name).toMatchObject({ kind: "verifier_error" });
    }
  });

  it("agent code that hangs the tests past their budget is graded 0, not masked", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    // The tests run what the agent wrote; the agent's answer never returns.
    const task: TaskContent = {
      ...base,
      tests: { "test.sh": "bash /workspace/answer.sh\n" },
      timeouts: { ...base.timeouts, verifierS: 1.5 },
    };
    const handle = await sandbox(task, "slow-tests");
    const hang: AgentSpecInput = {
      harness: "command",
      argv: ["bash", "-c", "printf 'sleep 30\\n' > /workspace/answer.sh"],
    };
    const { outcome, verdict } = await runAndVerify(handle, task, hang);
    expect(outcome.exec.exitCode).toBe(0);
    expect(verdict).toMatchObject({ reward: 0, details: { source: "timeout", timedOut: true } });
    expect(verdict.details.durationMs).toBeLessThan(10_000);
  });

  it("an image whose PATH leads through a directory the agent writes: the tests' runner (root) runs none of the agent's programs, and the agent's mkdir writes no reward", async () => {
    const base = tasks.find((t) => t.id === "hello-file")!;
    const image = `fleet-test/agent-path:${RUN}`;
    execFileSync("docker", ["build", "-q", "-t", image, "-"], {
      input: `FROM ${base.image}\nENV PATH=/workspace/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n`,
      stdio: ["pipe", "ignore", "pipe"],
      timeout: 120_000,
    });
    try {
      const task = { ...base, image };
      const handle = await sandbox(task, "agent-path");
      // The agent does not do the task: it plants a mkdir that the runner, as root, would run to
      // make /logs/verifier, and that writes a reward of 1 there.
      const plant = [
        "mkdir -p /workspace/bin",
        "echo '#!/bin/sh' > /workspace/bin/mkdir",
        `echo '/bin/mkdir "$@"; r=$?; echo 1 > /logs/verifier/reward.txt 2>/dev/null; exit $r' >> /workspace/bin/mkdir`,
        "chmod 755 /workspace/bin/mkdir",
      ].join(" && ");
      const { outcome, verdict } = await runAndVerify(handle, task, {
        harness: "command",
        argv: ["bash", "-c", plant],
      });
      expect(outcome.exec.exitCode, outcome.exec.stderr).toBe(0);
      expect(verdict).toMatchObject({ reward: 0, details: { source: "exit_code" } });
    } finally {
      await Promise.all(created.splice(0).map((h) => provider.destroy(h)));
      execFileSync("docker", ["rmi", "-f", image], { stdio: "ignore", timeout: 60_000 });
    }
  });
});
