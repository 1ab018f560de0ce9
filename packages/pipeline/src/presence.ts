import { randomUUID } from "node:crypto";
import { clock, type PipelineDeps } from "./deps.ts";

/** How often a worker process says it consumes its queues (`keepWorkerPresence`). */
export const PRESENCE_INTERVAL_MS = 10_000;
/** An entry outlives its last saying by this many intervals: two sayings lost (a slow Redis) still count. */
export const PRESENCE_INTERVALS = 3;

export interface WorkerPresence {
  /**
   * Stop saying, and take this process's entries out: it no longer consumes its queues. Bounded by
   * `timeoutMs` (Redis away: the entries expire on their own).
   */
  stop(timeoutMs?: number): Promise<void>;
}

/**
 * Say, now and every `intervalMs` until `stop`, that this process consumes `queues` (its BullMQ
 * workers' queue names), each entry until `PRESENCE_INTERVALS` intervals on (the fleet's clock):
 * `RolloutStore.sayWorkerPresent`. The dispatcher's `fleet_queue_workers` counts these where
 * Redis refuses `CLIENT LIST`. One timer per process (unref'd), nothing per job; a saying that
 * fails is left to the next.
 */
export function keepWorkerPresence(
  deps: PipelineDeps,
  queues: readonly string[],
  intervalMs = PRESENCE_INTERVAL_MS,
): WorkerPresence {
  // Unique per process (and per call): `workerId` can be configured, the same on two hosts.
  const self = `${deps.workerId}:${randomUUID()}`;
  // The sayings not answered yet: `stop` waits for them before it takes the entries out. One
  // sent before the removal can still land after it (ioredis sends a script again, as EVAL,
  // only once Redis answered NOSCRIPT, behind the removal), and would count a closed process.
  const unanswered = new Set<Promise<unknown>>();
  const say = () => {
    const now = clock(deps);
    const expiresAt = now + PRESENCE_INTERVALS * intervalMs;
    for (const queue of queues) {
      const saying = deps.store.sayWorkerPresent(queue, self, now, expiresAt).catch(() => undefined);
      unanswered.add(saying);
      void saying.finally(() => unanswered.delete(saying));
    }
  };
  say();
  const timer = setInterval(say, intervalMs);
  timer.unref();
  let stopping: Promise<void> | null = null;
  return {
    stop(timeoutMs = 2_000) {
      clearInterval(timer);
      stopping ??= Promise.race([
        Promise.all(unanswered)
          .then(() => Promise.all(queues.map((queue) => deps.store.forgetWorkerPresent(queue, self))))
          .then(
            () => undefined,
            () => undefined,
          ),
        new Promise<void>((resolve) => setTimeout(resolve, timeoutMs).unref()),
      ]);
      return stopping;
    },
  };
}
