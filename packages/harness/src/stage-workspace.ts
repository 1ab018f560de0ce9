import { fileModes, type SandboxHandle, type TaskContent } from "@fleet/contracts";
import { AGENT_USER, SANDBOX_PATHS, type SandboxProvider } from "@fleet/sandbox";

/**
 * Stage a task's initial `workspace/` files into /workspace, owned by the agent user, so every
 * harness starts from the same state (the seed stage calls this), at the modes the task gives.
 * No-op for an empty workspace.
 */
export async function stageWorkspace(
  provider: SandboxProvider,
  handle: SandboxHandle,
  task: TaskContent,
): Promise<void> {
  if (Object.keys(task.workspace).length === 0) return;
  await provider.put(handle, SANDBOX_PATHS.workspace, task.workspace, {
    user: AGENT_USER,
    modes: fileModes(task, "workspace"),
  });
}
