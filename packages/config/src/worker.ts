import { parseConfig } from "./parse.ts";
import { WorkerConfig, type WorkerKind } from "./schemas.ts";

/** `WorkerConfig` for a worker app that knows its own kind (overrides any `FLEET_WORKER_KIND`). */
export function parseWorkerConfig(kind: WorkerKind, env: Record<string, string | undefined>): WorkerConfig {
  return parseConfig(WorkerConfig, { ...env, FLEET_WORKER_KIND: kind });
}
