import { withTimeout } from "@fleet/contracts";
import type { PipelineDeps } from "./deps.ts";

/**
 * Whether the sandbox provider answers, kept by probing it: tripped by a caller whose provider
 * call failed, it exports `fleet_sandbox_provider_up` 0, says so once, and probes the provider
 * (an empty listing) with backoff until it answers, when the gauge is 1 again and that is said
 * once. A stage worker's breaker holds its jobs on it (`onDown`, `onUp`); the janitor runs only
 * its Redis steps while it is down (`watchProvider`).
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
  /** What is held while the provider is down, and what runs again once it answers: the logs' words. */
  words?: { down: string; up: string };
  /** Run when the gate goes down (after the gauge and the warning), and when it is up again. */
  onDown?: () => void;
  onUp?: () => void;
  /** Whether the owner shuts down: no trip, probe or `onUp` from then on. */
  closing?: () => boolean;
}

const JANITOR_WORDS = {
  down: "sandbox provider not reachable; the janitor runs its Redis-only steps (deadline watchdog, admissions, registry) and retries the provider with backoff; ledger retries and the orphan sweep wait until it answers",
  up: "sandbox provider answers again; the janitor's sandbox steps run from its next pass",
};

/**
 * Why the sandbox provider does not answer (its listing, of nothing: a label no sandbox has,
 * failed or took over `timeoutMs`), or null when it does. Never throws.
 */
export async function providerProblem(
  provider: PipelineDeps["provider"],
  timeoutMs: number,
): Promise<string | null> {
  try {
    await withTimeout(
      provider.list({ "fleet.probe": "reachable" }),
      timeoutMs,
      `no answer within ${timeoutMs} ms`,
    );
    return null;
  } catch (err) {
    return err instanceof Error ? err.message : String(err);
  }
}

/** A gate that starts up (gauge 1), probing nothing until it is tripped. */
export function providerGate(
  deps: Pick<PipelineDeps, "provider" | "logger" | "metrics">,
  options: ProviderGateOptions = {},
): ProviderGate {
  const callTimeoutMs = options.callTimeoutMs ?? 10_000;
  const firstDelayMs = options.firstDelayMs ?? 250;
  const maxDelayMs = options.maxDelayMs ?? 5_000;
  const words = options.words ?? JANITOR_WORDS;
  const { provider, logger, metrics } = deps;
  let up = true;
  let since = 0;
  let stopped = false;
  let timer: NodeJS.Timeout | null = null;
  const done = () => stopped || (options.closing?.() ?? false);
  metrics?.sandboxProviderUp.set(1);

  const probe = async (delayMs: number, attempt: number) => {
    timer = null;
    if (done()) return;
    const problem = await providerProblem(provider, callTimeoutMs);
    if (done()) return;
    if (problem !== null) {
      timer = setTimeout(() => void probe(Math.min(delayMs * 2, maxDelayMs), attempt + 1), delayMs);
      timer.unref();
      return;
    }
    up = true;
    metrics?.sandboxProviderUp.set(1);
    logger.info(
      { provider: provider.name, endpoint: provider.endpoint, attempt, downForMs: Date.now() - since },
      words.up,
    );
    options.onUp?.();
  };

  return {
    get up() {
      return up;
    },
    trip(reason) {
      if (!up || done()) return;
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
        words.down,
      );
      options.onDown?.();
      timer = setTimeout(() => void probe(firstDelayMs, 2), firstDelayMs);
      timer.unref();
    },
    stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
      timer = null;
    },
  };
}

/**
 * The janitor's gate: probe the provider once (at most `callTimeoutMs`) and return the gate, up
 * if it answered, else down and probing with backoff in the background. Never throws. The
 * janitor's other steps (the deadline watchdog, unfinished admissions, the registry's
 * scheduling) need only Redis, so a janitor whose provider does not answer starts anyway and runs
 * those, instead of refusing to start as a stage worker does (whose every stage needs it).
 */
export async function watchProvider(
  deps: Pick<PipelineDeps, "provider" | "logger" | "metrics">,
  options: ProviderGateOptions = {},
): Promise<ProviderGate> {
  const gate = providerGate(deps, options);
  const problem = await providerProblem(deps.provider, options.callTimeoutMs ?? 10_000);
  if (problem !== null) gate.trip(problem);
  return gate;
}
