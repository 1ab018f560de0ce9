import { type SandboxEntry, sandboxKey } from "../teardown-ledger.ts";

/** A sandbox registry (or ledger) entry for a test: rollout `id`'s sandbox of `owner`, no handle yet. */
export function sandboxEntry(id: string, owner: SandboxEntry["owner"] = "resources"): SandboxEntry {
  return {
    key: sandboxKey(id, owner),
    rolloutId: id,
    owner,
    provider: "docker",
    handle: null,
    createdAt: 1,
    expiresAt: 2,
  };
}
