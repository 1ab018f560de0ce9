import type { StageName } from "@fleet/contracts";
import { STAGES, type StageQueues, type TeardownLedger } from "@fleet/queue";
import type { FleetMetrics } from "@fleet/telemetry";

/**
 * Set the queue gauges from Redis, at scrape time: `fleet_queue_jobs{queue,state}`,
 * `fleet_queue_oldest_waiting_age_seconds{queue}` and, given a ledger,
 * `fleet_teardown_ledger_entries`. On failure the gauges are cleared (a stale depth would
 * mislead an alert) and the error is rethrown for the caller to log.
 */
export async function refreshQueueMetrics(
  queues: StageQueues,
  metrics: FleetMetrics,
  ledger: TeardownLedger | undefined,
  now: number,
): Promise<void> {
  try {
    const [counts, oldest, ledgerSize] = await Promise.all([
      queues.counts(),
      Promise.all(STAGES.map((s) => oldestWaitingAgeS(queues, s, now))),
      ledger ? ledger.size() : Promise.resolve(null),
    ]);
    metrics.queueJobs.reset();
    for (const stage of STAGES) {
      for (const [state, n] of Object.entries(counts[stage]))
        metrics.queueJobs.set({ queue: stage, state }, n);
    }
    STAGES.forEach((stage, i) => {
      metrics.queueOldestWaitingAge.set({ queue: stage }, oldest[i]!);
    });
    if (ledgerSize !== null) metrics.teardownLedgerEntries.set(ledgerSize);
  } catch (err) {
    metrics.queueJobs.reset();
    metrics.queueOldestWaitingAge.reset();
    metrics.teardownLedgerEntries.reset();
    throw err;
  }
}

/** Age of the oldest job waiting in a stage queue, in seconds (0 when none waits). */
async function oldestWaitingAgeS(queues: StageQueues, stage: StageName, now: number): Promise<number> {
  const [job] = await queues.queues[stage].getJobs(["waiting"], 0, 0, true);
  if (!job?.timestamp) return 0;
  return Math.max(0, (now - job.timestamp) / 1000);
}
