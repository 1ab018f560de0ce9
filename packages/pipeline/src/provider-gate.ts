import type { PipelineDeps } from "./deps.ts";
import { providerProblem } from "./worker.ts";

/**
 * Whether the janitor's sandbox steps (ledger retries, orphan and volume sweeps, gateway
 * networks, helpers) may run: the sandbox provider answered. The janitor's other steps (the
 * deadline watchdog, unfinished admissions, the registry's scheduling) need only Redis, so a
 * janitor whose provider does not answer starts anyway and runs those, instead of refusing to
 * start as a stage worker does (whose every stage needs the provider). Meanwhile
 * `fleet_sandbox_provider_up` is 0 and the provider is probed with backoff, as a stage worker's
 * breaker does; once it answers, the gauge is 1 and the next pass runs every step.
 */
export interface ProviderGate {
  /** Whether the provider answered its last probe. */
  readonly up: boolean;
  /** A provider call failed (`reason`): mark it down (no-op when down already) and probe it until it answers. */
  trip(reason: string): void;
  /** Stop probing (at shutdown). */
  stop(): void;
}

export interface ProviderGateOptions {
  /** What to check, added to the warning when the provider is down (e.g. which variable to set). */
  hint?: string;
  /** A probe (a listing of nothing) that takes longer counts as no answer. @defaultValue 10 s */
  callTimeoutMs?: number;
  /** The first retry's delay, doubled each retry. @defaultValue 250 ms */
  firstDelayMs?: number;
  /** The longest delay between retries. @defaultValue 5 s */
  maxDelayMs?: number;
}

/**
 * Probe the provider once (at most `callTimeoutMs`) and return its gate: up if it answered,
 * else down and probing with backoff in the background. Never throws.
 */
export async function watchProvider(
  deps: Pick<PipelineDeps, "provider" | "logger" | "metrics">,
  options: ProviderGateOptions = {},
): Promise<ProviderGate> {
  const callTimeoutMs = options.callTimeoutMs ?? 10_000;
  const firstDelayMs = options.firstDelayMs ?? 250;
  const maxDelayMs = options.maxDelayMs ?? 5_000;
  const { provider, logger, metrics } = deps;
  let up = true;
  let since = 0;
  let stopped = false;
  let timer: NodeJS.Timeout | null = null;

  const probe = async (delayMs: number, attempt: number) => {
    timer = null;
    if (stopped) return;
    const problem = await providerProblem(provider, callTimeoutMs);
    if (stopped) return;
    if (problem !== null) {
      timer = setTimeout(() => void probe(Math.min(delayMs * 2, maxDelayMs), attempt + 1), delayMs);
      timer.unref();
      return;
    }
    up = true;
    metrics?.sandboxProviderUp.set(1);
    logger.info(
      { provider: provider.name, endpoint: provider.endpoint, attempt, downForMs: Date.now() - since },
      "sandbox provider answers again; the janitor's sandbox steps run from its next pass",
    );
  };

  const gate: ProviderGate = {
    get up() {
      return up;
    },
    trip(reason) {
      if (!up || stopped) return;
      up = false;
      since = Date.now();
      metrics?.sandboxProviderUp.set(0);
      logger.warn(
        {
          provider: provider.name,
          endpoint: provider.endpoint,
          err: reason,
          ...(options.hint ? { hint: options.hint } : {}),
        },
        "sandbox provider not reachable; the janitor runs its Redis-only steps (deadline watchdog, admissions, registry) and retries the provider with backoff; ledger retries and the orphan sweep wait until it answers",
      );
      timer = setTimeout(() => void probe(firstDelayMs, 2), firstDelayMs);
      timer.unref();
    },
    stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
      timer = null;
    },
  };

  const problem = await providerProblem(provider, callTimeoutMs);
  if (problem === null) metrics?.sandboxProviderUp.set(1);
  else gate.trip(problem);
  return gate;
}
