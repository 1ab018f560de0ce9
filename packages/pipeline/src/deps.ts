import type { AgentSpec, SandboxCeiling } from "@fleet/contracts";
import type { Harness, HarnessDeps } from "@fleet/harness";
import type { RolloutStore, StageQueues, TeardownLedger } from "@fleet/queue";
import type { GatewayNetwork, SandboxProvider } from "@fleet/sandbox";
import type { FleetMetrics, Logger } from "@fleet/telemetry";
import type { Verdict, VerifyContext } from "@fleet/verifiers";

/** The per-rollout gateway networks (the part of `DockerGatewayNetworks` the stages use). */
export interface GatewayNetworks {
  ensure(rolloutId: string): Promise<GatewayNetwork>;
  allowGateway(network: GatewayNetwork, port: number): Promise<void>;
  /** `name`: the network's as `list` gave it; by default the one `ensure` makes. */
  remove(rolloutId: string, name?: string): Promise<{ alreadyGone: boolean }>;
  /** `otherInstance`: another deployment's (`LABEL_INSTANCE`); absent is this one's. */
  list(): Promise<Array<{ name: string; rolloutId: string; createdAt: number; otherInstance?: boolean }>>;
}

/** Everything the stage handlers need; apps build it once in `main.ts`. */
export interface PipelineDeps {
  store: RolloutStore;
  ledger: TeardownLedger;
  queues: StageQueues;
  provider: SandboxProvider;
  logger: Logger;
  metrics?: FleetMetrics;
  /**
   * The fleet's clock, epoch ms: Redis's in the apps (`startRedisClock`), so that every process
   * decides deadlines and stamps timings on the same clock whatever its host's says; this
   * process's own without it. Injectable for tests.
   */
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
  /**
   * How often a stage at work stamps its heartbeat (`RolloutStore.beat`), so that the janitor
   * never takes a long run or verify for a lost job (`STAGE_BEAT_MS`).
   */
  stageBeatMs?: number;
  /** Per-rollout sealed networks for sandboxes that get model access (command agents with a model). */
  networks?: GatewayNetworks;
  /** The model gateway's `maxCallsPerMinute` (`FLEET_GATEWAY_MAX_CALLS_PER_MINUTE`). @defaultValue 120 */
  gatewayMaxCallsPerMinute?: number;
  /** Age after which an intent without a handle is taken as never created. */
  intentGraceMs?: number;
  /** How long a sandbox is watched for its removal after an in-sandbox error (`SANDBOX_SETTLE_MS`). */
  sandboxSettleMs?: number;
  /** The most a task's `sandbox` options may ask on this worker (`FLEET_SANDBOX_MAX_*`). */
  sandboxCeiling?: SandboxCeiling;
}

export function clock(deps: PipelineDeps): number {
  return deps.now ? deps.now() : Date.now();
}

/**
 * A time on the fleet's clock (`clock`: Redis's in the apps) as this process's own clock reads
 * it: for what counts down with `Date.now()` (a harness's or a verifier's deadline).
 */
export function localTime(deps: PipelineDeps, at: number): number {
  return deps.now ? at - (deps.now() - Date.now()) : at;
}
