import {
  AgentSpec,
  type AgentSpecInput,
  isFleetError,
  type SandboxHandle,
  TaskContent,
} from "@fleet/contracts";
import { AGENT_USER, DockerSandboxProvider } from "@fleet/sandbox";
import { afterAll, afterEach, describe, expect, it } from "vitest";
import { createHarness } from "./create-harness.ts";
import type { HarnessContext } from "./harness.ts";
import { stageWorkspace } from "./stage-workspace.ts";

// Real Docker, the offline base image: what the harnesses do inside an actual sandbox.
const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const provider = new DockerSandboxProvider();
const created: SandboxHandle[] = [];
const rolloutIds: string[] = [];
const RUN = `it-harness-${process.pid}-${Date.now().toString(36)}`;

const TASK = TaskContent.parse({
  id: "probe-task",
  instruction: "Report who and where you are.",
  image: IMAGE,
  workspace: { "input.txt": "seed data\n", "deploy.sh": "#!/bin/sh\necho deployed\n" },
  solution: {
    "solve.sh": [
      "#!/bin/bash",
      "set -euo pipefail",
      'echo "uid=$(id -u) cwd=$(pwd)"',
      'echo "instruction=$(cat "$FLEET_INSTRUCTION_FILE")"',
      'echo "input=$(cat input.txt)"',
      'echo "helper=$(bash /solution/lib/helper.sh)"',
      'echo "modes=$(stat -c %a deploy.sh /solution/lib/helper.sh | tr "\\n" " ")"',
      "echo made > output.txt",
      "",
    ].join("\n"),
    "lib/helper.sh": "echo helped\n",
  },
  tests: { "test.sh": "exit 0\n" },
  // Not the defaults (a script 0755, any other file 0644): the task's own modes are staged.
  modes: { "workspace/deploy.sh": "644", "solution/lib/helper.sh": "755" },
});

async function sandbox(label: string): Promise<SandboxHandle> {
  rolloutIds.push(`${RUN}-${label}`);
  const handle = await provider.create({
    image: IMAGE,
    rolloutId: `${RUN}-${label}`,
    owner: "resources",
    expiresAt: Date.now() + 10 * 60_000,
  });
  created.push(handle);
  return handle;
}

function ctx(handle: SandboxHandle, agent: AgentSpecInput, deadlineInMs = 60_000): HarnessContext {
  return {
    provider,
    handle,
    task: TASK,
    agent: AgentSpec.parse(agent),
    deadlineMs: Date.now() + deadlineInMs,
    signal: new AbortController().signal,
  };
}

afterEach(async () => {
  // Every sandbox this file made is removed before the next test (and none is left behind).
  await Promise.all(created.splice(0).map((h) => provider.destroy(h)));
});

afterAll(async () => {
  for (const rolloutId of rolloutIds) expect(await provider.list({ "fleet.rollout": rolloutId })).toEqual([]);
  await provider.close?.();
});

describe("harnesses in a real Docker sandbox", () => {
  it("oracle: runs solve.sh (with helpers) as uid 1000 in /workspace, with the instruction file, files at the task's modes", async () => {
    const handle = await sandbox("oracle");
    await stageWorkspace(provider, handle, TASK);
    const outcome = await createHarness(AgentSpec.parse({ harness: "oracle" })).run(
      ctx(handle, { harness: "oracle" }),
    );

    expect(outcome.exec).toMatchObject({ exitCode: 0, timedOut: false });
    expect(outcome.answer).toBe(
      [
        "uid=1000 cwd=/workspace",
        "instruction=Report who and where you are.",
        "input=seed data",
        "helper=helped",
        "modes=644 755",
      ].join("\n"),
    );
    expect(outcome.usage).toBeNull();
    expect(await provider.get(handle, "/workspace/output.txt")).toBe("made\n");
  });

  it("command: runs argv with its env and FLEET_INSTRUCTION_FILE; non-zero exit is kept", async () => {
    const handle = await sandbox("command");
    const agent: AgentSpecInput = {
      harness: "command",
      argv: [
        "bash",
        "-c",
        'echo "$GREETING from $(id -u)"; echo "$FLEET_INSTRUCTION_FILE"; echo oops >&2; exit 7',
      ],
      env: { GREETING: "hi" },
    };
    const outcome = await createHarness(AgentSpec.parse(agent)).run(ctx(handle, agent));
    expect(outcome.exec).toMatchObject({ exitCode: 7, timedOut: false, stderr: "oops\n" });
    expect(outcome.answer).toBe("hi from 1000\n/tmp/fleet/instruction.md");
  });

  it("a command past its deadline is killed: exit -1, partial output kept", async () => {
    const handle = await sandbox("timeout");
    const agent: AgentSpecInput = { harness: "command", argv: ["bash", "-c", "echo started; exec sleep 60"] };
    const started = Date.now();
    const outcome = await createHarness(AgentSpec.parse(agent)).run(ctx(handle, agent, 1500));
    expect(outcome.exec).toMatchObject({ exitCode: -1, timedOut: true });
    expect(outcome.answer).toBe("started");
    expect(Date.now() - started).toBeLessThan(20_000);
    // The deadline killed the process tree: nothing of the agent's is left running.
    const receipt = await provider.killProcesses(handle, AGENT_USER);
    expect(receipt.confirmed).toBe(true);
  });

  it("a sandbox that is gone surfaces as the provider's FleetError (the run stage maps it to -2)", async () => {
    const handle = await sandbox("lost");
    await provider.destroy(handle);
    const agent: AgentSpecInput = { harness: "command", argv: ["true"] };
    const err = await createHarness(AgentSpec.parse(agent))
      .run(ctx(handle, agent))
      .then(
        () => null,
        (e: unknown) => e,
      );
    expect(isFleetError(err) && ["sandbox_lost", "provider_unavailable"].includes(err.kind)).toBe(true);
  });
});
