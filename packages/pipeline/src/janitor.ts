import { isTerminal } from "@fleet/contracts";
import {
  cancelBatch,
  duplicateRedis,
  isInvalidStoredData,
  JANITOR_QUEUE,
  type LedgerEntry,
  LONGEST_LIFE_MS,
  NETWORK_RETRY_MS,
  type RedisConnection,
  type SandboxEntry,
  sandboxKey,
  stageJobId,
  UnreadableRecordError,
} from "@fleet/queue";
import {
  LABEL_EXPIRES,
  LABEL_INSTANCE,
  LABEL_OWNER,
  LABEL_ROLLOUT,
  madeByAnotherInstance,
  type SandboxInfo,
} from "@fleet/sandbox";
import { ageSeconds, type JanitorStep, SANDBOX_OWNERS } from "@fleet/telemetry";
import { Queue, Worker } from "bullmq";
import { clock, localTime, type PipelineDeps } from "./deps.ts";
import { DEFAULT_LOST_JOB_GRACE_MS, type LostJobCursor, requeueLostJobs } from "./lost-jobs.ts";
import { keepWorkerPresence } from "./presence.ts";
import type { ProviderGate } from "./provider-gate.ts";
import { CLOSE_AGAIN_LIMIT, closeWithoutDestroys, destroyOrLedger } from "./stages.ts";
import { boundedClose, countStalledJobs, freshErrors } from "./worker.ts";

export interface JanitorOptions {
  /** A labelled sandbox with no known rollout is left alone this long (it may be mid-seed). */
  orphanGraceMs: number;
  /** A rollout this far past its deadline is closed by the watchdog. */
  watchdogGraceMs?: number;
  /**
   * No destroy is started once a pass's provider steps (from its ledger retries on) have run this
   * long; the rest wait for the next pass. @defaultValue 60 s
   */
  destroyBudgetMs?: number;
  /**
   * An admission under way this long (its seeds not enqueued) is taken for one its dispatcher
   * died in, and finished: the seeds of its recorded rollouts enqueued. @defaultValue 60 s
   */
  admissionGraceMs?: number;
  /**
   * A batch cancel whose walk has noted no progress this long is taken for one its dispatcher
   * died in, and walked again: every rollout of the batch still open asked to stop.
   * @defaultValue 60 s (`DEFAULT_ADMISSION_GRACE_MS`)
   */
  cancelGraceMs?: number;
  /**
   * An open rollout whose record has not changed this long, and whose stage job is gone (removed
   * by an operator, a queue drained or obliterated), has the job enqueued again
   * (`requeueLostJobs`). @defaultValue 2 min
   */
  lostJobGraceMs?: number;
  /** Where this replica's walk of the in-flight index for lost jobs is; one per janitor. */
  lostJobCursor?: LostJobCursor;
  /** How long finished stage jobs are kept before the trim step removes them. @defaultValue `FINISHED_JOB_AGE_MS` */
  finishedJobAgeMs?: { completed: number; failed: number };
  /** Where this replica's walk of the overdue rollouts is, past the most overdue page; one per janitor. */
  watchdogCursor?: LostJobCursor;
  /**
   * Whether the sandbox provider answers (`watchProvider`): while it does not, a pass runs only
   * its Redis steps, and the orphan sweep's listing failing marks it down. Without one, every
   * step runs every pass.
   */
  providerGate?: Pick<ProviderGate, "up" | "trip">;
}

export const DEFAULT_ADMISSION_GRACE_MS = 60_000;

export const DEFAULT_DESTROY_BUDGET_MS = 60_000;

/** A janitor loop's first this many failing entries are reported one by one; the rest in one report. */
export const REPORTED_ENTRY_FAILURES = 3;

const errorText = (err: unknown) => (err instanceof Error ? err.message : String(err));

/** A helper container not running after this long was left behind (reapers finish in seconds). */
export const STALE_HELPER_MS = 5 * 60_000;

export interface JanitorReport {
  retried: number;
  confirmed: number;
  stillPending: number;
  orphansRemoved: number;
  /** Sandbox volumes no container used, of rollouts over or unknown (or past their expiry), removed. */
  volumesRemoved: number;
  /** Registered sandboxes this pass put on the ledger (their rollout over, or their expiry passed). */
  expiredScheduled: number;
  /**
   * Registry entries that do not parse this pass retired (`retireUnreadableEntry`): their rollout
   * over past the grace period, nothing of it left on the provider.
   */
  registryRetired: number;
  watchdogClosed: number;
  /**
   * Overdue rollouts whose close job was delayed past any retry's backoff (by hand:
   * `changeDelay` in Bull Board or BullMQ) that this pass moved to run now (`CLOSE_DELAY_LIMIT_MS`).
   */
  closesPromoted: number;
  /**
   * Overdue rollouts whose record cannot be read (torn, or gone) that this pass took out of the
   * in-flight index into the unreadable one (`keys.unreadable()`), their record kept.
   */
  setAside: number;
  /** Rollouts the janitor closed itself, their closes having ended unfinalized too often (`CLOSE_AGAIN_LIMIT`). */
  closedByJanitor: number;
  /** Admissions a dispatcher did not finish whose recorded rollouts' seeds this pass enqueued. */
  admissionsFinished: number;
  /** Batch cancels a dispatcher did not finish that this pass walked again. */
  cancelsResumed: number;
  /** Open rollouts whose stage job was gone, enqueued again this pass. */
  lostRequeued: number;
  /** Finished stage jobs past their retention (`FINISHED_JOB_AGE_MS`) this pass removed. */
  jobsTrimmed: number;
  /** Steps of this pass that failed (e.g. `orphans: docker list: …`); the other steps still ran. */
  errors: string[];
  /**
   * The provider did not answer (`JanitorOptions.providerGate`): the steps that need it were not
   * run (ledger retries, orphans, volumes, networks, helpers; the registry only scheduled).
   */
  providerDown: boolean;
}

/** A janitor step's name: the step, or one entry of its loop (`<step> <entry key>`). */
type StepName = JanitorStep | `${JanitorStep} ${string}`;

/**
 * One janitor pass: (4) first (it needs only Redis), then (0) finish admissions and batch
 * cancels their dispatcher died in, (1) retry due teardown-ledger entries (DESIGN §2 rule 3), (2) schedule
 * registry entries of finished or expired rollouts, (3) remove labelled sandboxes whose rollout
 * is terminal or unknown past a grace period or whose `fleet.expires` passed, and by the same rules
 * sandbox volumes no container uses (`listUnusedVolumes`), (4) close
 * rollouts stuck past their deadline, (5) remove gateway networks of finished rollouts and retry
 * the network removals close could not finish (`ledger.networkRetries`), (6) remove
 * the provider's stale helper containers (`removeStaleHelpers`). Each
 * step runs whatever the others did: a Docker daemon that is down stops the orphan sweep, not the
 * deadline watchdog, which needs only Redis and runs first (a hung daemon, answering each call
 * only at its timeout, cannot hold it up); no destroy starts once the pass's provider steps
 * (from the ledger's on) have run `destroyBudgetMs`. A step's failure is logged and reported in `errors`. While
 * `options.providerGate` says the provider does not answer, the steps that need it are not run
 * (`providerDown`); the orphan sweep's listing failing marks it down.
 */
export async function janitorTick(deps: PipelineDeps, options: JanitorOptions): Promise<JanitorReport> {
  const report: JanitorReport = {
    retried: 0,
    confirmed: 0,
    stillPending: 0,
    orphansRemoved: 0,
    volumesRemoved: 0,
    expiredScheduled: 0,
    registryRetired: 0,
    watchdogClosed: 0,
    closesPromoted: 0,
    setAside: 0,
    closedByJanitor: 0,
    admissionsFinished: 0,
    cancelsResumed: 0,
    lostRequeued: 0,
    jobsTrimmed: 0,
    errors: [],
    providerDown: false,
  };
  const now = clock(deps);
  // Destroys stop being started once the pass's provider steps (from the ledger's on: `started`
  // is set there) have taken this long (wall clock): with a daemon that answers each call only at
  // its timeout, a pass of 50 due entries would take 25 minutes. Not timed from the pass's start:
  // Redis steps before them that took the budget (a slow Redis, a registry of thousands) left
  // every pass no destroy, the ledger's retries never tried.
  let started = Date.now();
  const overBudget = () => Date.now() - started > (options.destroyBudgetMs ?? DEFAULT_DESTROY_BUDGET_MS);
  // A step's name is its `JanitorStep`, and for one entry of a loop `<step> <entry key>`: the
  // metric counts it under the step, which `JANITOR_STEPS` lists so that its series starts at 0.
  const stepFailed = (name: StepName, err: unknown) => {
    const message = errorText(err);
    report.errors.push(`${name}: ${message}`);
    deps.metrics?.janitorStepFailures.inc({ step: name.split(" ")[0] as JanitorStep });
    deps.logger.warn({ step: name, err: message }, "janitor step failed; the next pass retries it");
  };
  /** Run `body`; a failure goes to `failed` instead of ending the pass. */
  const guarded =
    (failed: (name: StepName, err: unknown) => void) => async (name: StepName, body: () => Promise<void>) => {
      try {
        await body();
      } catch (err) {
        failed(name, err);
      }
    };
  const step = guarded(stepFailed);
  // The steps below that need the provider run only while it answers (asked at each: the orphan
  // sweep's listing failing marks it down for the rest of the pass).
  const providerUp = () => {
    const up = options.providerGate?.up ?? true;
    if (!up) report.providerDown = true;
    return up;
  };
  // Per-entry steps of one loop: every entry is tried whatever the others did, but only the first
  // few failures are reported one by one; the rest are summed up in one report when the loop ends
  // (`done`). Redis or the daemon failing every call (a busy script, an outage that answers
  // errors) is otherwise one warning and one count per entry, for a registry of thousands,
  // every pass.
  const entrySteps = (loop: JanitorStep) => {
    let more = 0;
    let last = "";
    let reported = 0;
    const failed = (name: StepName, err: unknown) => {
      if (reported < REPORTED_ENTRY_FAILURES) {
        reported++;
        stepFailed(name, err);
        return;
      }
      more++;
      last = `${name}: ${errorText(err)}`;
    };
    const run = guarded(failed);
    // A stored entry that does not parse (torn, or another release's shape: every entry of it,
    // in a rolling upgrade) is reported and skipped: it must not stop the sweep of every other.
    const invalid = (key: string, err: Error) =>
      failed(`${loop} ${key}`, new Error(`stored entry does not parse: ${err.message.slice(0, 300)}`));
    const done = () => {
      if (more > 0)
        stepFailed(loop, new Error(`${more} more entries failed (not reported one by one); last, ${last}`));
    };
    return { run, invalid, done };
  };

  // (4) Watchdog: rollouts past their deadline that no stage is closing. First: it needs only
  // Redis, and the steps below wait on the provider (a hung daemon answers each call only at
  // its timeout).
  // The most overdue page every pass, and past it a page a pass from this replica's cursor:
  // rollouts the watchdog leaves alone (their close queued) stay overdue, and a hundred of them
  // at the front must not hide every later one from it for good.
  let overdue: string[] = [];
  await step("watchdog", async () => {
    const before = now - (options.watchdogGraceMs ?? 30_000);
    overdue = await deps.store.pastDeadline(before, WATCHDOG_PAGE);
    if (overdue.length < WATCHDOG_PAGE) return;
    const cursor = options.watchdogCursor ?? { next: WATCHDOG_PAGE };
    if (cursor.next < WATCHDOG_PAGE) cursor.next = WATCHDOG_PAGE;
    const later = await deps.store.pastDeadline(before, WATCHDOG_PAGE, cursor.next);
    cursor.next = later.length < WATCHDOG_PAGE ? WATCHDOG_PAGE : cursor.next + later.length;
    const first = new Set(overdue);
    overdue.push(...later.filter((id) => !first.has(id)));
  });
  const watchdogSteps = entrySteps("watchdog");
  for (const id of overdue) {
    await watchdogSteps.run(`watchdog ${id}`, async () => {
      let done: Awaited<ReturnType<typeof watchdogClose>> | "unreadable";
      let cause: string | undefined;
      try {
        done = await watchdogClose(deps, id, now);
      } catch (err) {
        if (!(err instanceof UnreadableRecordError)) throw err; // Redis failing: next pass
        done = "unreadable";
        cause = err.message; // which field, for the operator who repairs it
      }
      if (done === "enqueued") report.watchdogClosed++;
      if (done === "promoted") report.closesPromoted++;
      if (done === "closed") report.closedByJanitor++;
      if (done === "unreadable" || done === "gone") {
        // No pass can close it: left in flight it would hold one of the first overdue places
        // every pass (enough of them, all of them) and backlog room for good. Its record is kept
        // as it is, for an operator (or a release that reads it) to find in `unreadable`.
        // Logged with its id here (the loop sums up failures past the first few) and failed as
        // an entry, once: counted for FleetJanitorStepFailing.
        if (await deps.store.setAsideUnreadable(id)) {
          report.setAside++;
          const where = deps.store.keys.unreadable();
          deps.logger.error(
            { rolloutId: id, record: done, key: where, ...(cause ? { cause } : {}) },
            "a rollout past its deadline whose record cannot be read was taken out of the in-flight index; its record is kept",
          );
          throw new Error(
            `its record ${done === "gone" ? "is gone" : "cannot be read"}: set aside in ${where}`,
          );
        }
      }
    });
  }
  watchdogSteps.done();

  // (0) Admissions their dispatcher never finished (it died between recording the rollouts and
  // enqueueing their seeds): the recorded rollouts' seeds are enqueued now (deduplicated by job
  // id), so they run instead of holding backlog until their deadline and ending masked. What the
  // admission never recorded is the client's to send again (a replay with its key finishes it).
  await step("admissions", async () => {
    const grace = options.admissionGraceMs ?? DEFAULT_ADMISSION_GRACE_MS;
    for (const { admission, score } of await deps.store.admissionsBefore(now - grace)) {
      const waiting = await deps.store.unseededOf(admission);
      if (waiting.length > 0) {
        await deps.queues.enqueueSeeds(waiting);
        deps.logger.warn(
          { admission, rollouts: waiting.length },
          "finished an admission its dispatcher did not: enqueued its recorded rollouts' seeds",
        );
      }
      // Only the note read: one a live admission refreshed meanwhile (a chunk recorded since) stays.
      await deps.store.admissionDone(admission, score);
      report.admissionsFinished++;
    }
  });

  // (0b) Batch cancels their dispatcher never finished (it died while walking the batch): the
  // batch is walked again, so every rollout still open is asked to stop (a cancel already
  // recorded changes nothing). A batch gone since (its records expired) only loses its note.
  await step("cancels", async () => {
    const grace = options.cancelGraceMs ?? DEFAULT_ADMISSION_GRACE_MS;
    for (const { batchId, score } of await deps.store.cancelsBefore(now - grace)) {
      const cancelled = await cancelBatch(deps.store, deps.queues, batchId, () => clock(deps));
      // Only the note read: the walk above took its own away; one a live walker renewed stays.
      await deps.store.cancelDone(batchId, score);
      deps.logger.warn(
        { batchId, cancelled },
        "finished a batch cancel its dispatcher did not: asked the batch's open rollouts to stop",
      );
      report.cancelsResumed++;
    }
  });

  // (0c) Open rollouts whose stage job is gone (an operator removed it, a queue was drained or
  // obliterated): enqueued again, instead of waiting out their deadline. A page of the in-flight
  // index a pass.
  await step("lost", async () => {
    const requeued = await requeueLostJobs(deps, now, options.lostJobCursor ?? { next: 0 }, {
      graceMs: options.lostJobGraceMs ?? DEFAULT_LOST_JOB_GRACE_MS,
    });
    if (requeued.length > 0) {
      report.lostRequeued += requeued.length;
      deps.logger.warn(
        { rollouts: requeued.length, first: requeued.slice(0, 5) },
        "open rollouts whose stage job was gone (removed, cleaned or drained by hand?): enqueued it again",
      );
    }
  });

  // (0d) Finished stage jobs past their retention, which BullMQ trims only when another job of
  // their queue finishes: on a quiet queue they outlived their rollout's record, and a rollout
  // admitted again under its key after that found its old seed job there (never added again).
  await step("trim", async () => {
    report.jobsTrimmed += await deps.queues.trimFinished(TRIM_LIMIT, options.finishedJobAgeMs);
  });

  // (2) Sandboxes still registered whose rollout is over, or whose expiry passed.
  await step("registry", async () => {
    const registrySteps = entrySteps("registry");
    const unreadable: string[] = [];
    const listed = await deps.ledger.listSandboxes((key, err) => {
      unreadable.push(key);
      registrySteps.invalid(key, err);
    });
    // One that does not parse with nothing of its rollout left behind it: retired, or it would
    // be reported every pass and keep its rollout's teardown pending for good.
    // What the provider holds beside sandboxes, listed once for all of them (and only if any).
    // Asked for where it is awaited at once (a listing that fails is never left unheard).
    let leftoversListing: Promise<Leftovers> | null = null;
    const leftovers = () => {
      leftoversListing ??= listLeftovers(deps);
      return leftoversListing;
    };
    // Retiring one asks the provider what it holds: not while it does not answer.
    for (const key of providerUp() ? unreadable : []) {
      await registrySteps.run(`registry ${key}`, async () => {
        const retired = await retireUnreadableEntry(deps, key, now, options.orphanGraceMs, leftovers);
        if (retired) report.registryRetired++;
      });
    }
    for (const entry of listed) {
      await registrySteps.run(`registry ${entry.key}`, async () => {
        // Expired: removed whatever its rollout (its record is not read: one that cannot be read
        // must not keep an expired sandbox alive).
        const expired = entry.expiresAt < now;
        const rec = expired ? null : await deps.store.get(entry.rolloutId);
        const over = !rec || isTerminal(rec.status);
        if (expired || (over && now - entry.createdAt > options.orphanGraceMs)) {
          // Not counted when on the ledger already (backing off): that pass scheduled nothing.
          if (await deps.ledger.schedule(entry, now)) report.expiredScheduled++;
        }
      });
    }
    registrySteps.done();
  });

  // (1) Ledger retries. A confirmed destroy that was the rollout's last on the ledger marks its
  // result's teardown confirmed (in the ledger's confirm).
  started = Date.now();
  if (providerUp())
    await step("ledger", async () => {
      const ledgerSteps = entrySteps("ledger");
      const due = await deps.ledger.dueToTake(now, undefined, ledgerSteps.invalid);
      ledgerSteps.done();
      for (const read of due) {
        if (overBudget()) break; // the rest are still due next pass
        // Counted and put off before its destroy is tried (`take`): a destroy that never returns
        // (it crashed or hung the janitor until it was killed) would otherwise leave the entry
        // due at its old time, first in the next pass's read, every pass dying on it. One no
        // longer as read (another failure of it recorded, or confirmed, meanwhile) is not tried:
        // its schedule now is its own.
        const entry = await deps.ledger.take(read, clock(deps));
        if (!entry) continue;
        report.retried++;
        const r = await destroyOrLedger(deps, entry, { taken: entry });
        if (r.teardown === "confirmed") report.confirmed++;
        else report.stillPending++;
      }
    });

  // (3) Orphans by label: what the registry does not know (a worker died before recording).
  if (providerUp())
    await step("orphans", async () => {
      let listed: SandboxInfo[];
      try {
        listed = await deps.provider.list();
      } catch (err) {
        // The provider does not answer: the steps that need it wait until it does (probed with
        // backoff), instead of failing every pass.
        options.providerGate?.trip(errorText(err));
        // No count now: fleet_sandboxes_active goes without a sample rather than keep its last
        // value, which FleetSandboxLeak would take for sandboxes the fleet no longer accounts for.
        dropSandboxCount(deps);
        throw err;
      }
      // A sandbox on the teardown ledger is the ledger step's, retried on its backoff: trying it
      // here too would retry a failing destroy every pass and push its backoff out each time.
      // (One that does not parse was reported by the ledger step, when due.)
      const onLedger = new Map((await deps.ledger.pending(() => undefined)).map((e) => [e.key, e]));
      // fleet_sandboxes_active: what the provider holds after this pass (removed orphans
      // subtracted), of this deployment's (another's with the same scope would page a leak).
      const active = { resources: 0, agent: 0 };
      const foreign = new Set(
        listed.filter((info) => madeByAnotherInstance(info.labels, deps.provider.instance)),
      );
      warnOfAnotherInstance(deps, [...foreign]);
      for (const info of listed) {
        if (!foreign.has(info)) active[info.labels[LABEL_OWNER] === "agent" ? "agent" : "resources"]++;
      }
      const orphanSteps = entrySteps("orphans");
      for (const info of listed) {
        const rolloutId = info.labels[LABEL_ROLLOUT];
        const owner = info.labels[LABEL_OWNER] === "agent" ? "agent" : "resources";
        const expires = labelledExpiry(info.labels);
        if (!rolloutId) continue;
        const theirs = foreign.has(info);
        // Each sandbox on its own: one whose rollout record cannot be read stops no other's removal.
        await orphanSteps.run(`orphans ${sandboxKey(rolloutId, owner)}`, async () => {
          const orphan = await isOrphan(
            deps,
            rolloutId,
            expires,
            info.createdAt,
            now,
            options.orphanGraceMs,
            theirs,
          );
          if (!orphan) return;
          if (overBudget()) return; // counted as active; removed next pass
          // The ledger step's: this sandbox's entry, or an intent's (no sandbox yet) under its key.
          const ledgers = (e: LedgerEntry | null | undefined) =>
            !!e && (e.handle === null || e.handle.id === info.handle.id);
          if (ledgers(onLedger.get(sandboxKey(rolloutId, owner)))) return;
          // An entry holds whole epoch ms: a label or creation time that is none (a fractional or
          // huge `fleet.expires`, no creation time given) is now there, or the entry was refused
          // before the destroy, every pass, and the orphan never removed.
          const wholeMs = (ms: number) => (Number.isSafeInteger(ms) ? ms : now);
          const entry: SandboxEntry = {
            key: sandboxKey(rolloutId, owner),
            rolloutId,
            owner,
            provider: deps.provider.name,
            handle: info.handle,
            createdAt: wholeMs(info.createdAt),
            expiresAt: wholeMs(expires),
          };
          // On the ledger, taken, before its destroy is tried (`takeNew`): a destroy that never
          // returns (it crashed or hung the janitor until it was killed) would otherwise leave
          // nothing behind, and the next pass's sweep tried it first again, in listing order, every
          // pass dying on it, the orphans after it and the steps after this one never reached. On
          // the ledger, this sweep skips it and the ledger step retries it on its backoff. Where
          // the key holds an entry put there since the look above that is the ledger step's, it
          // is left to it; one of another sandbox (one this replaced under the key) is kept, and
          // this one destroyed untaken, as before (a failure recorded over that entry).
          const took = await deps.ledger.takeNew(entry, clock(deps), undefined, { overUndecodable: true });
          if ("held" in took && ledgers(took.held)) return;
          const r = await destroyOrLedger(deps, entry, "taken" in took ? { taken: took.taken } : {});
          if (r.teardown === "confirmed") {
            if (!theirs) active[owner]--;
            // One another caller removed meanwhile (another pass, a close) is that one's to count.
            if (!r.receipt?.alreadyGone) report.orphansRemoved++;
          }
        });
      }
      for (const [owner, n] of Object.entries(active)) {
        deps.metrics?.sandboxesActive.set({ provider: deps.provider.name, owner }, n);
      }
      orphanSteps.done();
    });

  // (3b) Sandbox volumes no container uses (`diskMb: null` workspaces): a destroy cut off between
  // removing the container and removing its volume leaves the volume, which the orphan sweep
  // (by container label) never finds. The same rules as for containers, by the volume's labels;
  // one a container uses is never listed, and the daemon refuses its removal if one took it since.
  const listUnusedVolumes = deps.provider.listUnusedVolumes?.bind(deps.provider);
  const removeUnusedVolume = deps.provider.removeUnusedVolume?.bind(deps.provider);
  if (listUnusedVolumes && removeUnusedVolume && providerUp()) {
    await step("volumes", async () => {
      const volumeSteps = entrySteps("volumes");
      for (const volume of await listUnusedVolumes()) {
        const rolloutId = volume.labels[LABEL_ROLLOUT];
        if (!rolloutId) continue;
        await volumeSteps.run(`volumes ${volume.name}`, async () => {
          const expires = labelledExpiry(volume.labels);
          const orphan = await isOrphan(
            deps,
            rolloutId,
            expires,
            volume.createdAt,
            now,
            options.orphanGraceMs,
            madeByAnotherInstance(volume.labels, deps.provider.instance),
          );
          if (!orphan || overBudget()) return;
          if (await removeUnusedVolume(volume.name)) report.volumesRemoved++;
        });
      }
      volumeSteps.done();
    });
  }

  // (5) Gateway networks whose rollout is over (a close that could not remove one).
  if (deps.networks && providerUp()) {
    const networks = deps.networks;
    await step("networks", async () => {
      const failed: string[] = [];
      // A network whose rollout still has a sandbox awaiting its teardown on the ledger (its
      // destroy failed, backing off) holds that sandbox until the ledger's retry removes it:
      // its removal failing then is expected, not this step's failure (counted every pass, it
      // paged FleetJanitorStepFailing beside FleetTeardownLedgerNotDraining, which says when
      // that teardown does not come). It is still retried.
      const failedUnlessPending = async (rolloutId: string, what: string) => {
        if (!(await deps.ledger.isPending(rolloutId).catch(() => false))) failed.push(what);
      };
      for (const net of await networks.list()) {
        // Another deployment's (same scope, its own Redis): its rollout is unknown here, and it
        // has no expiry to go by. Left to that fleet's janitor; removed only once older than any
        // rollout can live (a deployment whose Redis lost its data made it, say), when no sandbox
        // is on it any more (Docker refuses the removal of one in use: then left, quietly).
        if (net.otherInstance) {
          if (now - net.createdAt > LONGEST_LIFE_MS) {
            await networks.remove(net.rolloutId, net.name).catch(() => undefined);
          }
          continue;
        }
        // A record that cannot be read is reported and its network left: it must not stop the
        // other networks' removal nor the retries below, every pass. Once the network is older
        // than any rollout can live, its rollout is over whatever the record says: removed, as
        // its sandbox is at its expiry (a record set aside as unreadable is kept for good).
        let rec: Awaited<ReturnType<typeof deps.store.get>>;
        let overForSure = false;
        try {
          rec = await deps.store.get(net.rolloutId);
        } catch (err) {
          // (A creation time Docker gave that did not parse is 0: not taken for an old one.)
          if (net.createdAt <= 0 || now - net.createdAt <= LONGEST_LIFE_MS) {
            failed.push(`${net.name}: its rollout's record cannot be read: ${errorText(err)}`);
            continue;
          }
          rec = null;
          overForSure = true;
        }
        if (
          overForSure ||
          ((!rec || isTerminal(rec.status)) && now - net.createdAt > options.orphanGraceMs)
        ) {
          // One that will not go stops none of the others; the step still fails (and is
          // counted for FleetJanitorStepFailing) so a network that never goes is seen.
          await networks.remove(net.rolloutId, net.name).catch(async (err: unknown) => {
            await failedUnlessPending(net.rolloutId, `${net.name}: ${errorText(err)}`);
            // The network may be gone with its rules left: only the ledger leads back to them.
            await deps.ledger.networkRemovalFailed(net.rolloutId, now + NETWORK_RETRY_MS);
          });
        }
      }
      // Removals close could not finish (recorded by close): the network by its rollout id, or
      // (the network gone already) the firewall rules it left.
      for (const rolloutId of await deps.ledger.networkRetries(now)) {
        try {
          await networks.remove(rolloutId);
          await deps.ledger.networkRemoved(rolloutId);
        } catch (err) {
          await failedUnlessPending(rolloutId, `${rolloutId}'s network: ${errorText(err)}`);
          // Later, and after the others due now: one that never goes cannot hold up the rest.
          await deps.ledger.networkRetryLater(rolloutId, now);
        }
      }
      if (failed.length > 0) {
        throw new Error(
          `could not remove ${failed.length} gateway network(s): ${failed.slice(0, 3).join("; ")}`,
        );
      }
    });
  }

  // (6) The provider's helper containers left behind (a kill-sweep reaper whose worker died
  // before starting it): only the provider knows them.
  const removeStaleHelpers = deps.provider.removeStaleHelpers?.bind(deps.provider);
  if (removeStaleHelpers && providerUp()) {
    await step("helpers", async () => {
      await removeStaleHelpers(STALE_HELPER_MS);
    });
  }

  await step("metrics", async () => {
    const [size, since] = await Promise.all([deps.ledger.size(), deps.ledger.oldestSince()]);
    deps.metrics?.teardownLedgerEntries.set(size);
    // Its entries are dated on the fleet's clock.
    deps.metrics?.teardownLedgerOldestAge.set(ageSeconds(since, clock(deps)));
  });
  return report;
}

/**
 * A sandbox's or volume's `fleet.expires` label, epoch ms: +Infinity (no expiry to go by) when it
 * is missing or blank, as `Number` reads a blank label as 0 (long passed: a live rollout's
 * sandbox removed); NaN (never passed either) when it is not a number.
 */
function labelledExpiry(labels: Record<string, string>): number {
  const label = labels[LABEL_EXPIRES];
  return label === undefined || label.trim() === "" ? Number.POSITIVE_INFINITY : Number(label);
}

/**
 * Whether a labelled sandbox or volume of `rolloutId` is an orphan: its `fleet.expires` passed
 * (whatever its rollout: the record is not read, as in the registry step, so one that cannot be
 * read keeps nothing expired alive), or it is older than `graceMs` and its rollout is over or
 * unknown. Not old when the provider gave no creation time (NaN): then only its expiry counts.
 * Another deployment's (`theirs`: same scope, its own Redis, where its rollouts are) only by its
 * expiry: this fleet's Redis knowing nothing of its rollout says nothing.
 */
async function isOrphan(
  deps: PipelineDeps,
  rolloutId: string,
  expires: number,
  createdAt: number,
  now: number,
  graceMs: number,
  theirs = false,
): Promise<boolean> {
  if (expires < now) return true;
  if (theirs || !(now - createdAt > graceMs)) return false;
  const rec = await deps.store.get(rolloutId);
  return rec === null || isTerminal(rec.status);
}

/** When this process last warned of another deployment's sandboxes (once per 10 minutes). */
let anotherInstanceWarnedAt = 0;

/**
 * Say (now and then) that sandboxes of another deployment of this fleet's scope share the
 * provider: two fleets with one `FLEET_PREFIX` and their own Redis on one Docker daemon. Each
 * janitor leaves the other's alone until they expire, but the two should not share a prefix.
 */
function warnOfAnotherInstance(deps: PipelineDeps, foreign: readonly SandboxInfo[]): void {
  if (foreign.length === 0 || Date.now() - anotherInstanceWarnedAt < 600_000) return;
  anotherInstanceWarnedAt = Date.now();
  deps.logger.warn(
    {
      sandboxes: foreign.length,
      instances: [...new Set(foreign.map((info) => info.labels[LABEL_INSTANCE]))].slice(0, 5),
      own: deps.provider.instance,
    },
    "sandboxes of another fleet with this FLEET_PREFIX share the sandbox provider (its own Redis): left to it until they expire; give each fleet its own FLEET_PREFIX",
  );
}

interface Leftovers {
  volumes: { labels: Record<string, string> }[];
  networks: { rolloutId: string }[];
}

/** The provider's volumes no container uses and the gateway networks (none without either). */
async function listLeftovers(deps: PipelineDeps): Promise<Leftovers> {
  const [volumes, networks] = await Promise.all([
    deps.provider.listUnusedVolumes?.() ?? [],
    deps.networks?.list() ?? [],
  ]);
  return { volumes, networks };
}

/**
 * Retire a registry entry `key` (`<rolloutId>:<owner>`) that does not parse, once its rollout is
 * over (finalized past `graceMs`, or its record gone: no intent is recorded for a rollout without
 * one, nor after its close) and the provider holds nothing labelled with it: no sandbox, no
 * volume, no gateway network. Then no sandbox can be behind it; the label sweeps would have found
 * one. The entry is moved as it is to `keys.retiredSandboxes()` (never deleted: a release that
 * reads it may need it), the rollout's teardown confirmed if nothing else of it is pending, and a
 * warning logged. True if retired; false (it stays, reported) otherwise.
 */
async function retireUnreadableEntry(
  deps: PipelineDeps,
  key: string,
  now: number,
  graceMs: number,
  leftovers: () => Promise<Leftovers>,
): Promise<boolean> {
  const at = key.lastIndexOf(":");
  const rolloutId = key.slice(0, at);
  const owner = key.slice(at + 1);
  if (at <= 0 || (owner !== "resources" && owner !== "agent")) return false;
  const rec = await deps.store.get(rolloutId);
  if (rec && !isTerminal(rec.status)) return false; // its close reads it
  const overSince = rec ? rec.result?.finishedAt : Number.NEGATIVE_INFINITY;
  if (overSince == null || now - overSince <= graceMs) return false;
  if ((await deps.provider.list({ [LABEL_ROLLOUT]: rolloutId })).length > 0) return false;
  const { volumes, networks } = await leftovers();
  if (volumes.some((v) => v.labels[LABEL_ROLLOUT] === rolloutId)) return false;
  if (networks.some((n) => n.rolloutId === rolloutId)) return false;
  const raw = await deps.ledger.rawSandbox(key);
  if (raw === null || !(await deps.ledger.retireUnreadable(key, raw, rolloutId))) return false;
  deps.logger.warn(
    { key, rolloutId, retiredTo: deps.ledger.keys.retiredSandboxes() },
    "a sandbox registry entry that does not parse was retired: its rollout is over and nothing labelled with it is left",
  );
  return true;
}

/** Close states in which the close is still on its way: the watchdog leaves those alone. */
const CLOSE_UNDER_WAY = new Set(["waiting", "active", "delayed", "prioritized", "waiting-children"]);

/** Finished stage jobs the trim step removes at most per queue, kind and pass. */
const TRIM_LIMIT = 1000;

/** Overdue rollouts the watchdog reads a page at a time (`pastDeadline`). */
export const WATCHDOG_PAGE = 100;

/**
 * Longest a delayed close of an overdue rollout is left to wait: past every backoff of close's
 * retries (at most 17 min) and every hold a worker puts on it. One delayed further was delayed
 * by hand (`changeDelay` in Bull Board or BullMQ: ten years, say), and would never finalize.
 */
export const CLOSE_DELAY_LIMIT_MS = 20 * 60_000;

/**
 * Close a rollout past its deadline that nothing is closing. One whose close job is queued,
 * delayed or running is left to it (a backed-up close queue is not a stuck rollout). Otherwise
 * the deadline failure is recorded, unless the rollout is already graded (a verify receipt: its
 * reward stands, close only has to report it) or has a failure recorded, and close is enqueued,
 * replacing a close job that ended without finalizing; past `CLOSE_AGAIN_LIMIT` enqueued
 * closes, the janitor closes it itself. Says which it did (null: neither; "gone": its record is
 * missing). @throws UnreadableRecordError when its record cannot be read, or the janitor's own
 * close cannot use what it holds.
 */
async function watchdogClose(
  deps: PipelineDeps,
  id: string,
  now: number,
): Promise<"enqueued" | "closed" | "promoted" | "gone" | null> {
  const rec = await deps.store.get(id);
  // In flight with no record (its hash deleted by hand, or lost): nothing can close it.
  if (!rec) return "gone";
  if (isTerminal(rec.status)) return null;
  const closeJob = await deps.queues.queues.close.getJob(stageJobId(id, "close"));
  if (closeJob) {
    const state = await closeJob.getState();
    if (state === "delayed") {
      // When it is due, on the clock of whoever delayed it (this host's, near enough).
      const dueAt = (await deps.queues.delayedUntil("close", id)) ?? 0;
      if (dueAt > Date.now() + CLOSE_DELAY_LIMIT_MS) {
        // Promoted, not replaced: it keeps its attempts, and a close already under way is not
        // doubled. (Not delayed any more by the time of the promote: it ran or failed, fine.)
        const promoted = await closeJob.promote().then(
          () => true,
          () => false,
        );
        if (promoted) {
          deps.logger.warn(
            { rolloutId: id, dueAt: new Date(dueAt).toISOString() },
            "an overdue rollout's close was delayed far past any retry's backoff (by hand?): it runs now",
          );
          return "promoted";
        }
      }
    }
    if (CLOSE_UNDER_WAY.has(state)) return null;
    await closeJob.remove();
  }
  // Not over a claimed cancel (close composes `cancelled` from it), and only while the result is
  // undecided, checked in the write itself: a verify may store its reward between this pass's
  // read and its write, and that reward stands.
  if (!rec.receipts.verify && !rec.failure && !rec.cancelRequested) {
    await deps.store.recordFailure(
      id,
      {
        stage: rec.receipts.run ? "verify" : rec.receipts.seed ? "run" : "seed",
        terminal: true,
        failureKind: "deadline_exceeded",
        mask: true,
        reason: "closed by the watchdog: the rollout passed its deadline",
        at: now,
      },
      { beforeDecided: true },
    );
  }
  // Counted only if no one counted since this pass read the record: another janitor's pass that
  // found no close under way either (a replica frozen past its pass's lock, whose pass ran again
  // elsewhere) enqueues that close and counts it; counted twice, the janitor closed the rollout
  // itself after fewer closes than `CLOSE_AGAIN_LIMIT`, one of them still queued.
  const closes = await deps.store.noteCloseAgain(id, rec.closesAgain);
  // Another counted since this pass read the record (a stage worker after BullMQ failed the close,
  // another pass): it enqueues that close, or closes the rollout itself past the limit. Nothing
  // is enqueued here: a close enqueued by this pass as well could be taken and fail before that
  // counter's own enqueue, which then added a close no one counted (past the limit, too). When
  // this pass's remove above took that counter's new close (the same job id: another pass
  // replaced the failed one meanwhile), the rollout has none until this pass's lost-job step, or
  // the next pass's watchdog, enqueues it again, counted: the janitor then closes it itself one
  // close sooner, never one close later.
  if (closes < 0) return null;
  if (closes > CLOSE_AGAIN_LIMIT) {
    deps.logger.warn(
      { rolloutId: id, closes: closes - 1 },
      "the rollout's closes keep ending without finalizing: the janitor closes it, its sandboxes left to the teardown ledger",
    );
    // At this pass's time: the sandboxes it hands to the ledger are due in this pass's ledger
    // step. Not counted when another closer finalized meanwhile (a close job, another pass).
    try {
      return (await closeWithoutDestroys(deps, id, now)) ? "closed" : null;
    } catch (err) {
      // Stored data no close can use (a receipt of another release's shape, say: JSON this one
      // parses, then refuses in the result): every close so far threw on it, and every later
      // one would. Its record is unreadable to this release, as a torn one is.
      if (isInvalidStoredData(err)) throw new UnreadableRecordError(id, err);
      throw err;
    }
  }
  if (closes === 0) return null; // it finished meanwhile
  await deps.queues.enqueue("close", id);
  return "enqueued";
}

/** `fleet_sandboxes_active` without a sample (no count that is a fact now). */
function dropSandboxCount(deps: PipelineDeps): void {
  for (const owner of SANDBOX_OWNERS)
    deps.metrics?.sandboxesActive.remove({ provider: deps.provider.name, owner });
}

/** The janitor queue's job scheduler, whose ticks are the passes. */
export const JANITOR_SCHEDULER = "janitor-tick";

/** After this many pass intervals without a pass of its own, a replica drops its sandbox count. */
export const STALE_SAMPLE_INTERVALS = 3;

export interface Janitor {
  /** Stop within `timeoutMs`: a pass under way gets all but its last 2 s (half of a budget under 4 s), then is cut off (each step is idempotent). */
  close(timeoutMs?: number): Promise<void>;
}

/**
 * Runs `janitorTick` as a BullMQ job scheduler on the `janitor` queue, so that any number of
 * janitor replicas share one schedule and never run a pass twice at once.
 */
export async function startJanitor(
  deps: PipelineDeps,
  options: JanitorOptions & {
    connection: RedisConnection;
    prefix: string;
    intervalMs: number;
    /** How often the worker checks for passes whose worker died (BullMQ's `stalledInterval`). @defaultValue 30 s */
    stalledIntervalMs?: number;
    /** How often it says it consumes the janitor queue (`keepWorkerPresence`). @defaultValue `PRESENCE_INTERVAL_MS` */
    presenceIntervalMs?: number;
  },
): Promise<Janitor> {
  const queue = new Queue(JANITOR_QUEUE, { connection: options.connection, prefix: options.prefix });
  // It re-emits the shared connection's errors, which the connection's owner logs; unheard,
  // BullMQ would print each one raw on stderr (one per reconnect attempt of an outage).
  queue.on("error", () => undefined);
  // One pass at a time across every replica: a slow pass must not overlap the next tick.
  await queue.setGlobalConcurrency(1);
  const schedule = () =>
    queue.upsertJobScheduler(
      JANITOR_SCHEDULER,
      { every: options.intervalMs },
      { name: "tick", data: {}, opts: { removeOnComplete: 100, removeOnFail: 100 } },
    );
  await schedule();
  // A rate limit on the janitor queue (Bull Board's queue "rate limit", a script) holds each
  // pass past its tick: with one of one job an hour, one pass an hour, no watchdog, ledger retry
  // or orphan sweep between. The schedule alone paces the passes: the limit is taken off, at
  // start and after each pass (before the worker asks for the next tick, which the limit would
  // hold for the rest of its window).
  const unthrottle = async () => {
    if ((await queue.getGlobalRateLimit()) === null) return;
    deps.logger.warn(
      { queue: JANITOR_QUEUE },
      "a rate limit was set on the janitor queue (Bull Board?): its passes follow the janitor's schedule alone; taking it off",
    );
    await queue.removeGlobalRateLimit();
  };
  await unthrottle();
  // The newest pass's end, any replica's, kept in Redis; before any, the first start's (never
  // this start's: a janitor restarted after each pass it died in would look like one that passes).
  // Kept on the fleet's clock (every replica's); the gauge on this host's, which Prometheus's
  // time() is compared with.
  const lastPassKey = deps.store.keys.janitorLastPass();
  const startedAt = clock(deps);
  await options.connection.set(lastPassKey, String(startedAt), "NX");
  let kept = Number(await options.connection.get(lastPassKey));
  if (!Number.isFinite(kept) || kept <= 0 || kept > startedAt) {
    // Not a time, or ahead of the fleet's clock (a failover onto a node whose clock is behind, a
    // restore): it would keep the alert quiet while no pass runs. This start's instead.
    kept = startedAt;
    await options.connection.set(lastPassKey, String(kept));
  }
  deps.metrics?.janitorLastPass.set(localTime(deps, kept) / 1000);
  // fleet_sandboxes_active is this replica's sample from its last pass. With several replicas
  // sharing the schedule, another may run every pass for a while: a sample older than a few
  // intervals is no fact about the provider now (FleetSandboxLeak takes the max over replicas).
  // Timed on the monotonic clock: on this host's, a pass run while it was ahead (then stepped
  // back, NTP) looked recent until it caught up, and no check ran meanwhile, not even the one that
  // makes the schedule again from a tick dated far ahead on it (the only replica: no pass at all).
  let lastPassAt = performance.now();
  // Said once per 10 minutes: while a replica whose clock runs ahead lives, it comes back each check.
  const farTickNews = freshErrors(600_000);
  // This replica's walk of the in-flight index for lost stage jobs, a page a pass.
  const lostJobCursor: LostJobCursor = options.lostJobCursor ?? { next: 0 };
  // And of the overdue rollouts past the most overdue page.
  const watchdogCursor: LostJobCursor = options.watchdogCursor ?? { next: WATCHDOG_PAGE };
  const staleAfterMs = STALE_SAMPLE_INTERVALS * options.intervalMs;
  // The same for its teardown ledger gauges: a stale oldest age over the threshold (the ledger
  // drained since, by another replica) would page FleetTeardownLedgerNotDraining, a max over all.
  const stale = setInterval(() => {
    if (performance.now() - lastPassAt > staleAfterMs) {
      dropSandboxCount(deps);
      deps.metrics?.teardownLedgerEntries.remove({});
      deps.metrics?.teardownLedgerOldestAge.remove({});
      // No pass of this replica's for a while: another's, or none at all. A schedule removed
      // (Bull Board's job-scheduler "remove", a script) would stop every pass until a janitor
      // restarts: made again. (Only when missing: an upsert of one that exists may move its next
      // tick.)
      // The same for its one-pass-at-a-time limit (gone with an obliterate of the queue).
      // And a rate limit set again while the pass the last one let through still counts against
      // it (its window): it holds the next tick at once, and no pass comes to take it off.
      queue
        .getJobScheduler(JANITOR_SCHEDULER)
        .then(async (found) => {
          await unthrottle();
          if ((await queue.getGlobalConcurrency()) !== 1) {
            deps.logger.warn(
              { queue: JANITOR_QUEUE },
              "the janitor queue's one-pass-at-a-time limit was removed; setting it again",
            );
            await queue.setGlobalConcurrency(1);
          }
          if (found) {
            // Its next tick far off: set on a clock that ran ahead (a replica's host, or this
            // one's before NTP stepped it back). BullMQ dates ticks on the clock of the replica
            // that ran the last pass: no pass would run until this clock caught up. Made again,
            // from this clock.
            const next = found.next ?? 0;
            // Or the schedule's tick is due, but none is ready or running and the one delayed is
            // due far ahead: its delay was changed (Bull Board's "delay" of the tick job, a
            // script). BullMQ makes the tick after it only once it runs: no pass until then, and
            // the schedule itself looked due. Made again, from this clock, as well.
            const heldAhead = async () => {
              if ((await queue.getJobCountByTypes("waiting", "prioritized", "active")) > 0) return false;
              const [, score] = await options.connection.zrange(
                queue.toKey("delayed"),
                "0",
                "0",
                "WITHSCORES",
              );
              return score !== undefined && Number(score) / 0x1000 - Date.now() > 2 * options.intervalMs;
            };
            const due = next - Date.now() <= 2 * options.intervalMs;
            const tickHeld = due && (await heldAhead());
            if (due && !tickHeld) return;
            // Unless passes go on (another replica's, noted within the last few intervals on the
            // fleet's clock): then it is this host's clock that is behind theirs, on which they
            // date the ticks. Made again from this clock, the schedule was made again at every
            // check, each time a pass out of turn, and this replica warned of a clock ahead.
            // A note ahead of the fleet's clock is none: the replica that dated the far tick, its
            // clock jumped ahead since it last measured Redis's, noted its pass ahead by as much.
            const last = Number(await options.connection.get(lastPassKey));
            if (Number.isFinite(last) && Math.abs(clock(deps) - last) <= staleAfterMs) return;
            if (tickHeld) {
              deps.logger.warn(
                { scheduler: JANITOR_SCHEDULER },
                "the janitor's next tick was delayed far past its schedule (its delay changed by hand?); scheduling it again from this host's clock",
              );
            } else if (farTickNews("far tick")) {
              deps.logger.warn(
                { scheduler: JANITOR_SCHEDULER, nextInMs: next - Date.now() },
                "the janitor's next pass was scheduled far ahead (by a host whose clock runs ahead?); scheduling it again from this host's clock",
              );
            }
            // An upsert keeps a scheduler's next tick: removed, then made again from now.
            await queue.removeJobScheduler(JANITOR_SCHEDULER);
            await schedule();
            return;
          }
          deps.logger.warn(
            { scheduler: JANITOR_SCHEDULER },
            "the janitor's schedule was removed; making it again",
          );
          await schedule();
        })
        .catch(() => undefined); // Redis unreachable: the next check tries again
    }
  }, options.intervalMs);
  stale.unref();
  const worker = new Worker(
    JANITOR_QUEUE,
    async () => {
      const report = await janitorTick(deps, { ...options, lostJobCursor, watchdogCursor });
      lastPassAt = performance.now();
      deps.metrics?.janitorLastPass.set(Date.now() / 1000);
      // For the next janitor to start (a failed write: this replica's gauge still says it). Not
      // awaited: the pass is over, and a Redis that is down must not hold its job open.
      void options.connection.set(lastPassKey, String(clock(deps))).catch(() => undefined);
      // Before the pass's job completes (its completion takes the next tick, held by a limit still
      // there); bounded, as a Redis that is down must not hold the job open: the next pass tries again.
      await Promise.race([
        unthrottle().catch(() => undefined),
        new Promise((resolve) => setTimeout(resolve, 2_000).unref()),
      ]);
      const did =
        report.retried +
        report.orphansRemoved +
        report.volumesRemoved +
        report.watchdogClosed +
        report.closesPromoted +
        report.closedByJanitor +
        report.setAside +
        report.registryRetired +
        report.expiredScheduled;
      if (did + report.errors.length > 0) {
        deps.logger.info(report, "janitor pass");
      }
      return report;
    },
    {
      connection: duplicateRedis(options.connection),
      prefix: options.prefix,
      concurrency: 1,
      // Held by a rate limit (until a check takes it off), it asks again each interval (the
      // check that takes it off runs on it), at most BullMQ's 30 s apart, as before.
      maximumRateLimitDelay: Math.min(options.intervalMs, 30_000),
      ...(options.stalledIntervalMs === undefined ? {} : { stalledInterval: options.stalledIntervalMs }),
    },
  );
  // Said in Redis while it runs: fleet_queue_workers{queue="janitor"} where Redis refuses CLIENT LIST.
  const presence = keepWorkerPresence(deps, [JANITOR_QUEUE], options.presenceIntervalMs);
  // Its passes too: one whose replica died or froze past its lock (FleetJobsStalling).
  countStalledJobs(worker, deps, "a janitor pass stalled (its replica died or froze); it runs again");
  const fresh = freshErrors();
  worker.on("error", (err) => {
    if (fresh(err.message)) deps.logger.error({ err: err.message }, "janitor worker error");
  });
  worker.on("failed", (_job, err) => deps.logger.warn({ err: err.message }, "janitor pass failed"));
  return {
    async close(timeoutMs = 30_000) {
      clearInterval(stale);
      // Taking no more passes: no longer counted as consuming its queue.
      const left = presence.stop(Math.min(2_000, timeoutMs));
      const graceful = worker.close().then(() => true);
      graceful.catch(() => undefined);
      // The cut-off below takes up to 2 s of the budget (half of a budget under 4 s, or a small
      // one ran over by the cut-off's own 2 s): a pass gets the rest.
      const cutMs = Math.min(2_000, Math.floor(timeoutMs / 2));
      const passMs = timeoutMs - cutMs;
      const timer = new Promise<false>((resolve) => setTimeout(() => resolve(false), passMs).unref());
      if (!(await Promise.race([graceful, timer]))) {
        deps.logger.warn({ timeoutMs }, "janitor pass still running at shutdown; cutting it off");
      }
      await boundedClose(worker, cutMs / 2);
      await Promise.race([queue.close(), timer]);
      await left;
    },
  };
}
