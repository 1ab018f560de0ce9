import { isTerminal } from "@fleet/contracts";
import {
  duplicateRedis,
  JANITOR_QUEUE,
  type RedisConnection,
  type SandboxEntry,
  sandboxKey,
  stageJobId,
} from "@fleet/queue";
import { LABEL_EXPIRES, LABEL_OWNER, LABEL_ROLLOUT } from "@fleet/sandbox";
import { Queue, Worker } from "bullmq";
import { clock, type PipelineDeps } from "./deps.ts";
import { destroyOrLedger } from "./stages.ts";

export interface JanitorOptions {
  /** A labelled sandbox with no known rollout is left alone this long (it may be mid-seed). */
  orphanGraceMs: number;
  /** A rollout this far past its deadline is closed by the watchdog. */
  watchdogGraceMs?: number;
}

export interface JanitorReport {
  retried: number;
  confirmed: number;
  stillPending: number;
  orphansRemoved: number;
  expiredScheduled: number;
  watchdogClosed: number;
}

/**
 * One janitor pass: (1) retry due teardown-ledger entries (DESIGN §2 rule 3), (2) schedule
 * registry entries of finished or expired rollouts, (3) remove labelled sandboxes whose rollout
 * is terminal or unknown past a grace period or whose `fleet.expires` passed, (4) close
 * rollouts stuck past their deadline.
 */
export async function janitorTick(deps: PipelineDeps, options: JanitorOptions): Promise<JanitorReport> {
  const report: JanitorReport = {
    retried: 0,
    confirmed: 0,
    stillPending: 0,
    orphansRemoved: 0,
    expiredScheduled: 0,
    watchdogClosed: 0,
  };
  const now = clock(deps);

  // (2) Sandboxes still registered whose rollout is over, or whose expiry passed.
  for (const entry of await deps.ledger.listSandboxes()) {
    const rec = await deps.store.get(entry.rolloutId);
    const over = !rec || isTerminal(rec.status);
    if ((over && now - entry.createdAt > options.orphanGraceMs) || entry.expiresAt < now) {
      await deps.ledger.schedule(entry, now);
      report.expiredScheduled++;
    }
  }

  // (1) Ledger retries.
  for (const entry of await deps.ledger.due(now)) {
    report.retried++;
    const r = await destroyOrLedger(deps, entry);
    if (r.teardown === "confirmed") {
      report.confirmed++;
      if (!(await deps.ledger.isPending(entry.rolloutId))) await deps.store.confirmTeardown(entry.rolloutId);
    } else {
      report.stillPending++;
    }
  }

  // (3) Orphans by label: what the registry does not know (a worker died before recording).
  const listed = await deps.provider.list();
  // fleet_sandboxes_active: what the provider holds after this pass (removed orphans subtracted).
  const active = { resources: 0, agent: 0 };
  for (const info of listed) active[info.labels[LABEL_OWNER] === "agent" ? "agent" : "resources"]++;
  for (const info of listed) {
    const rolloutId = info.labels[LABEL_ROLLOUT];
    const owner = info.labels[LABEL_OWNER] === "agent" ? "agent" : "resources";
    const expires = Number(info.labels[LABEL_EXPIRES] ?? Number.POSITIVE_INFINITY);
    if (!rolloutId) continue;
    const rec = await deps.store.get(rolloutId);
    const old = now - info.createdAt > options.orphanGraceMs;
    const orphan = (rec === null && old) || (rec !== null && isTerminal(rec.status) && old) || expires < now;
    if (!orphan) continue;
    const entry: SandboxEntry = {
      key: sandboxKey(rolloutId, owner),
      rolloutId,
      owner,
      provider: deps.provider.name,
      handle: info.handle,
      createdAt: info.createdAt,
      expiresAt: Number.isFinite(expires) ? expires : now,
    };
    const r = await destroyOrLedger(deps, entry);
    if (r.teardown === "confirmed") {
      active[owner]--;
      report.orphansRemoved++;
      if (rec && !(await deps.ledger.isPending(rolloutId))) await deps.store.confirmTeardown(rolloutId);
    }
  }

  // (4) Watchdog: rollouts past their deadline that no stage closed.
  for (const id of await deps.store.pastDeadline(now - (options.watchdogGraceMs ?? 30_000))) {
    const rec = await deps.store.get(id);
    if (!rec || isTerminal(rec.status)) continue;
    await deps.store.recordFailure(id, {
      stage: rec.receipts.run ? "verify" : rec.receipts.seed ? "run" : "seed",
      terminal: true,
      failureKind: "deadline_exceeded",
      mask: true,
      reason: "closed by the watchdog: the rollout passed its deadline",
      at: now,
    });
    const closeJob = await deps.queues.queues.close.getJob(stageJobId(id, "close"));
    if (closeJob && (await closeJob.isFailed())) await closeJob.remove();
    await deps.queues.enqueue("close", id);
    report.watchdogClosed++;
  }

  for (const [owner, n] of Object.entries(active)) {
    deps.metrics?.sandboxesActive.set({ provider: deps.provider.name, owner }, n);
  }
  // (5) Gateway networks whose rollout is over (a close that could not remove one).
  if (deps.networks) {
    for (const net of await deps.networks.list()) {
      const rec = await deps.store.get(net.rolloutId);
      if ((!rec || isTerminal(rec.status)) && now - net.createdAt > options.orphanGraceMs) {
        await deps.networks.remove(net.rolloutId).catch(() => undefined);
      }
    }
  }

  deps.metrics?.teardownLedgerEntries.set(await deps.ledger.size());
  return report;
}

export interface Janitor {
  close(timeoutMs?: number): Promise<void>;
}

/**
 * Runs `janitorTick` as a BullMQ job scheduler on the `janitor` queue, so that any number of
 * janitor replicas share one schedule and never run a pass twice at once.
 */
export async function startJanitor(
  deps: PipelineDeps,
  options: JanitorOptions & { connection: RedisConnection; prefix: string; intervalMs: number },
): Promise<Janitor> {
  const queue = new Queue(JANITOR_QUEUE, { connection: options.connection, prefix: options.prefix });
  // One pass at a time across every replica: a slow pass must not overlap the next tick.
  await queue.setGlobalConcurrency(1);
  await queue.upsertJobScheduler(
    "janitor-tick",
    { every: options.intervalMs },
    { name: "tick", data: {}, opts: { removeOnComplete: 100, removeOnFail: 100 } },
  );
  const worker = new Worker(
    JANITOR_QUEUE,
    async () => {
      const report = await janitorTick(deps, options);
      if (report.retried + report.orphansRemoved + report.watchdogClosed + report.expiredScheduled > 0) {
        deps.logger.info(report, "janitor pass");
      }
      return report;
    },
    { connection: duplicateRedis(options.connection), prefix: options.prefix, concurrency: 1 },
  );
  worker.on("error", (err) => deps.logger.error({ err: err.message }, "janitor worker error"));
  worker.on("failed", (_job, err) => deps.logger.warn({ err: err.message }, "janitor pass failed"));
  return {
    async close() {
      await worker.close();
      await worker.disconnect();
      await queue.close();
    },
  };
}
