import type { AgentSpec } from "@fleet/contracts";
import type { Harness, HarnessDeps } from "@fleet/harness";
import type { RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
import type { SandboxProvider } from "@fleet/sandbox";
import type { FleetMetrics, Logger } from "@fleet/telemetry";
import type { Verdict, VerifyContext } from "@fleet/verifiers";

/** Everything the stage handlers need; apps build it once in `main.ts`. */
export interface PipelineDeps {
  store: RolloutStore;
  ledger: TeardownLedger;
  queues: StageQueues;
  provider: SandboxProvider;
  logger: Logger;
  metrics?: FleetMetrics;
  /** Epoch ms; injectable for tests. */
  now?: () => number;
  /** Stable id of this worker process (logs, fence tokens). */
  workerId: string;
  harnessDeps?: HarnessDeps;
  /** Override harness construction (benchmarks use a no-op harness). */
  createHarness?: (agent: AgentSpec, deps: HarnessDeps) => Harness;
  /** Override grading (benchmarks). */
  verify?: (ctx: VerifyContext) => Promise<Verdict>;
  /** How often the run stage polls for a stop request while the harness runs. */
  stopPollMs?: number;
  /** Age after which an intent without a handle is taken as never created. */
  intentGraceMs?: number;
}

export function clock(deps: PipelineDeps): number {
  return deps.now ? deps.now() : Date.now();
}
