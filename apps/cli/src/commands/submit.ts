import { randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import {
  ADMISSION_ALLOWANCE_MS,
  RolloutRequest,
  RUN_MARGIN_MS,
  runNeeds,
  type TaskContent,
} from "@fleet/contracts";
import { ApiError, type BatchAccepted, type BatchStatus, type FleetClient, isApiError } from "../client.ts";
import { type CliContext, flushText, OutputError, openOut, type ResultsFile, writeText } from "../context.ts";
import { formatDuration, ProgressReporter } from "../progress.ts";
import {
  BATCH_ENVELOPE_BYTES,
  buildRollouts,
  chunkRollouts,
  resolveAgent,
  selectTasks,
  UsageError,
} from "../requests.ts";
import { isRerunFile, maskedLines, rerunRollouts } from "../rerun.ts";
import { ResultTally, renderSummary } from "../summary.ts";

export interface SubmitOptions extends FollowOptions {
  suite: string;
  agent: string;
  repeat: number;
  task?: string[];
  deadline?: number;
  metadata?: string;
  wait?: boolean;
  maxRequestBytes: number;
  /** The loader's task size bound (the dispatcher's `FLEET_MAX_TASK_BYTES` decides). */
  maxTaskBytes: number;
  inlineTasks?: boolean;
  /** How long to keep offering a chunk the fleet's backlog has no room for (s). */
  backlogWait: number;
  /** Base of the chunks' Idempotency-Keys (`<base>-<n>`); random when absent. */
  idempotencyKey?: string;
  /** A results file whose masked rollouts to submit again (instead of task × repeat). */
  rerun?: string;
}

/**
 * `fleet submit`: load the suite, build task × repeat requests, POST them as one batch (or one
 * batch per chunk when the body would pass `--max-request-bytes`), print each batch id on
 * stdout; with `--wait`, show progress on stderr until every rollout is terminal, then collect
 * the results and print a summary. Returns the exit code.
 */
export async function submitCommand(
  client: FleetClient,
  opts: SubmitOptions,
  ctx: CliContext,
  /** Told the ids of the batches admitted so far, after each one (what Ctrl-C would leave running). */
  onSubmitted: (batchIds: readonly string[]) => void = () => {},
): Promise<number> {
  if (opts.out !== undefined && !opts.wait)
    throw new UsageError("--out needs --wait (or use `fleet results`)");
  if (opts.waitTimeout !== undefined && !opts.wait) throw new UsageError("--wait-timeout needs --wait");
  // Without --wait stdout is the batch ids, not JSON: said before anything is submitted, not
  // found by the script parsing it after the rollouts went in.
  if (opts.json && !opts.wait)
    throw new UsageError(
      "--json needs --wait (without it, stdout is the batch ids, one a line; or use `fleet watch --json`)",
    );
  if (opts.rerun !== undefined && opts.out !== undefined && (await isRerunFile(opts.rerun, opts.out))) {
    throw new UsageError(
      `--out ${opts.out} is the --rerun file ${opts.rerun}: the rerun's results would replace the results it reruns; write the rerun elsewhere (another --out)`,
    );
  }
  // Opened before anything is submitted: a path that cannot be written is a usage error now,
  // not after hours of waiting.
  const file = await openOut(opts.out);
  try {
    return await submitAndFollow(client, opts, ctx, file, onSubmitted);
  } finally {
    await file?.discard();
  }
}

async function submitAndFollow(
  client: FleetClient,
  opts: SubmitOptions,
  ctx: CliContext,
  file: ResultsFile | null,
  onSubmitted: (batchIds: readonly string[]) => void,
): Promise<number> {
  const agent = await resolveAgent(opts.agent, ctx.readFile);
  // --rerun: the masked rollouts of a results file, again (their tasks only are loaded).
  const rerun = opts.rerun === undefined ? null : await maskedLines(opts.rerun);
  const nothingToRerun = async (lines: number) => {
    await writeText(
      ctx.stderr,
      `nothing to rerun: none of the ${lines} results in ${opts.rerun} is masked${opts.task === undefined ? "" : " (of the tasks --task selects)"}\n`,
    );
    return 0;
  };
  // Without --task there is nothing to check against the suite: said before it is loaded.
  if (rerun !== null && opts.task === undefined && rerun.masked.length === 0)
    return nothingToRerun(rerun.lines);
  const only =
    rerun !== null && opts.task === undefined
      ? [...new Set(rerun.masked.map((l) => l.taskId))]
      : (opts.task ?? []);
  let tasks: TaskContent[];
  try {
    // A broken task of the suite that --task did not ask for does not stop the submission.
    tasks = await ctx.loadSuite(opts.suite, { maxBytes: opts.maxTaskBytes, only });
  } catch (err) {
    const message = (err as Error).message;
    // The loader's bound is this command's: a fleet that takes bigger tasks says so in its own.
    const hint = /over the limit of \d+/.test(message)
      ? " (a fleet whose FLEET_MAX_TASK_BYTES allows more: --max-task-bytes)"
      : "";
    throw new UsageError(`cannot load suite ${opts.suite}: ${message}${hint}`);
  }
  // --task is checked against the suite with --rerun too: a misspelt id is a usage error, not
  // "nothing to rerun".
  const picked = selectTasks(tasks, opts.task);
  const masked = rerun?.masked.filter((l) => opts.task?.includes(l.taskId) ?? true) ?? [];
  if (rerun !== null && masked.length === 0) return nothingToRerun(rerun.lines);
  const rerunIds = new Set(masked.map((l) => l.taskId));
  const selected = rerun !== null ? picked.filter((t) => rerunIds.has(t.id)) : picked;
  // The oracle runs each task's solution/solve.sh: the dispatcher refuses a rollout of a task
  // without one, which for a suite split into several requests would be after the first ones
  // were admitted and started. Said here, before anything is sent.
  if (agent.harness === "oracle") {
    const without = selected.filter((t) => t.solution["solve.sh"] === undefined).map((t) => t.id);
    if (without.length > 0) {
      const named =
        without.slice(0, 10).join(", ") + (without.length > 10 ? `, and ${without.length - 10} more` : "");
      throw new UsageError(
        `the oracle agent runs each task's solution/solve.sh, which ${without.length === 1 ? "this task lacks" : `${without.length} tasks lack`}: ${named} (leave them out with --task, or choose another agent)`,
      );
    }
  }
  checkDeadline(opts.deadline, selected, agent);
  // Every rollout is built and serialised before the first request: past this, memory runs out
  // (14 million took 4.4 GB, then the process died) before anything is sent.
  const total = rerun !== null ? masked.length : selected.length * opts.repeat;
  if (total > MAX_SUBMIT_ROLLOUTS) {
    throw new UsageError(
      rerun !== null
        ? `${total} masked rollouts are more than one submit sends (${MAX_SUBMIT_ROLLOUTS}): rerun them in parts (--task)`
        : `${total} rollouts (${selected.length} tasks × --repeat ${opts.repeat}) are more than one submit sends (${MAX_SUBMIT_ROLLOUTS}): submit them in parts`,
    );
  }
  const metadata = parseMetadata(opts.metadata);
  const requests =
    rerun !== null
      ? rerunRollouts({
          path: opts.rerun as string,
          masked,
          tasks: selected,
          agent,
          digestOf: ctx.digestOf,
          deadlineS: opts.deadline,
          metadata,
        })
      : buildRollouts({
          tasks,
          agent,
          repeat: opts.repeat,
          taskIds: opts.task,
          deadlineS: opts.deadline,
          metadata,
        });
  const chunks = chunkRollouts(requests, {
    maxBytes: opts.maxRequestBytes,
    digestOf: opts.inlineTasks ? undefined : ctx.digestOf,
  });

  const taskCount = new Set(requests.map((r) => ("id" in r.task ? r.task.id : r.task.digest))).size;
  const keyBase = opts.idempotencyKey ?? randomUUID();
  const batchIds: string[] = [];
  let accepted = 0;
  /** Rollouts and batches an earlier run of this command (same --idempotency-key) had submitted. */
  const replayed = { rollouts: 0, batches: 0 };
  const posting: PostingState = { key: "", backlogSplit: false };
  const held = new HeldProgress(
    client,
    batchIds,
    requests.length,
    opts.pollInterval,
    ctx,
    opts.wait === true,
  );
  const onAccepted = async (batch: BatchAccepted) => {
    batchIds.push(batch.batchId);
    onSubmitted([...batchIds]);
    accepted += batch.count;
    if (!batch.created) {
      replayed.rollouts += batch.count;
      replayed.batches++;
    }
    // With --wait --json, stdout is the one JSON summary (its batchIds name them): ids to stderr.
    if (opts.json) await held.say(`${batch.batchId}\n`);
    else await held.aside(() => writeText(ctx.stdout, `${batch.batchId}\n`));
  };
  // With --wait, a long run: ride out a dispatcher restart while submitting too (every POST
  // carries its Idempotency-Key, so one sent again admits nothing twice). Without it, fail fast.
  const poster = opts.wait
    ? patientClient(client, opts.outageWait * 1000, (text) => void held.say(text))
    : client;
  for (const [i, lines] of chunks.entries()) {
    const chunkKey = `${keyBase}-${i}`;
    const keyFor = (from: number, to: number) =>
      from === 0 && to === lines.length ? chunkKey : `${chunkKey}.${from}-${to}`;
    try {
      await submitChunk(poster, lines, 0, keyFor, posting, held, opts.backlogWait * 1000, onAccepted);
      // The last batch id's write fails after it returned (stdout on a full disk): seen here, the
      // batches are named below as a chunk's failure names them, not left to an error at exit.
      if (i === chunks.length - 1) await flushText(ctx.stdout);
    } catch (err) {
      held.stop();
      held.reporter?.interrupt();
      if (batchIds.length > 0) {
        // Counted in rollouts: a chunk split (backlog room, body limit) may be in part of them.
        await writeText(
          ctx.stderr,
          `submitted ${accepted} of ${requests.length} rollouts in ${counted(batchIds.length, "batch", "batches")} ` +
            `before the error: ${batchIds.join(" ")} (cancel them with \`fleet cancel <batchId>\`)\n`,
        );
      }
      await writeText(ctx.stderr, chunkFailureNote(err, { i, chunks, keyBase, posting, opts }));
      throw err;
    }
  }
  // A poll that a wait for room started may still be under way: following polls afresh.
  held.settle();
  const shape =
    opts.rerun !== undefined
      ? `the masked of ${opts.rerun}, ${counted(taskCount, "task")}`
      : `${counted(taskCount, "task")} × ${opts.repeat}`;
  const what = `${counted(accepted, "rollout")} (${shape}) in ${counted(batchIds.length, "batch", "batches")}`;
  const replay = "with this --idempotency-key: replayed, nothing started again";
  await held.say(
    replayed.batches > 0 && replayed.batches === batchIds.length
      ? `already submitted: ${what} at ${client.url}, ${replay}\n`
      : replayed.batches > 0
        ? `submitted ${what} to ${client.url}; ${replayed.rollouts} of them (${counted(replayed.batches, "batch", "batches")}) ` +
          `were already submitted ${replay}\n`
        : `submitted ${what} to ${client.url}\n`,
  );
  if (!opts.wait) return 0;
  return followBatches(client, batchIds, accepted, opts, ctx, file, held.reporter ?? undefined);
}

/**
 * What `submit` says on stderr, and how it waits for room in the fleet's full backlog. With
 * `--wait`, once a chunk has had to wait for room, each wait polls the batches admitted so far
 * (at most once a `--poll-interval`, one poll at a time) and draws their progress against every
 * rollout this submit sends: a submission many times the backlog shows its rollouts finishing
 * from the start, not only once its last chunk is in. A poll the dispatcher is slow to answer
 * does not lengthen a wait: it goes on through the chunk's next offer, and what it finds is drawn
 * by a later wait (`settle` gives up one still under way once every chunk is in).
 * `followBatches` then carries on with the same reporter.
 * Before the first wait, and without `--wait`, it says and waits as plain writes and sleeps.
 */
class HeldProgress {
  /** Drawing from the first wait for room on (with `--wait`); null before it. */
  reporter: ProgressReporter | null = null;
  /** With `--wait`, the client the waits poll with; null without. */
  private readonly poller: FleetClient | null;
  /** Each admitted batch's status last polled: a finished one is not asked again. */
  private readonly latest = new Map<string, BatchStatus>();
  private lastPollAt: number | null = null;
  /** The poll under way, which may outlast the wait that started it; null between polls. */
  private polling: Promise<void> | null = null;
  /** A poll ended since the progress was last drawn. */
  private polled = false;
  /** Ends a poll still under way when the submission stops (`stop`). */
  private readonly stopped = new AbortController();

  constructor(
    client: FleetClient,
    /** The batches admitted so far (the caller's list, growing). */
    private readonly batchIds: readonly string[],
    /** Every rollout this submit sends, admitted or not. */
    private readonly total: number,
    private readonly pollIntervalMs: number,
    private readonly ctx: CliContext,
    follow: boolean,
  ) {
    // One attempt per poll, no retries: a poll retried, or riding out an outage, would only show
    // progress later (the chunk's next offer does not wait for it; its POST rides out an outage
    // itself, saying so). A poll that fails only leaves the progress as it was until the next one.
    this.poller = follow
      ? client.with({ retries: 0, signal: AbortSignal.any([ctx.signal, this.stopped.signal]) })
      : null;
  }

  /** Write `text` on stderr, redrawing a TTY progress line below it. */
  async say(text: string): Promise<void> {
    if (this.reporter === null) await writeText(this.ctx.stderr, text);
    else this.reporter.note(text);
  }

  /** Run `write` (to stdout, which may share the terminal) with the progress line out of its way. */
  async aside(write: () => Promise<void>): Promise<void> {
    if (this.reporter === null) await write();
    else await this.reporter.aside(write);
  }

  /**
   * Wait `ms` for room in the backlog, drawing progress meanwhile with `--wait`: a poll is started
   * when one is due and none is under way, and drawn when it ends within this wait or a later one:
   * a poll under way never makes the wait longer than `ms`. Rejects on Ctrl-C.
   */
  async waitForRoom(ms: number): Promise<void> {
    const signal = this.ctx.signal;
    if (this.poller === null) {
      await sleep(ms, undefined, { signal });
      return;
    }
    this.reporter ??= new ProgressReporter(this.ctx.stderr, this.ctx.progress);
    const reporter = this.reporter;
    const end = performance.now() + ms;
    for (;;) {
      signal.throwIfAborted();
      this.draw(reporter);
      if (
        this.polling === null &&
        (this.lastPollAt === null || performance.now() - this.lastPollAt >= this.pollIntervalMs)
      ) {
        this.lastPollAt = performance.now();
        this.polling = this.poll(this.poller).finally(() => {
          this.polling = null;
        });
      }
      const now = performance.now();
      if (now >= end) return;
      // Until the wait's end, or sooner: the poll under way ends (to draw it), or the next is due.
      const polling = this.polling;
      if (polling === null) {
        const nextPoll = Math.max(0, (this.lastPollAt ?? now) + this.pollIntervalMs - now);
        await sleep(Math.min(end - now, nextPoll), undefined, { signal });
        continue;
      }
      // A Ctrl-C ends the poll too (the poller's signal): the loop's check then throws.
      let timer: NodeJS.Timeout | undefined;
      const nap = new Promise<void>((resolve) => {
        timer = setTimeout(resolve, end - now);
      });
      await Promise.race([polling, nap]).finally(() => clearTimeout(timer));
    }
  }

  /**
   * Once every chunk is in: draw what the last poll found, and give up one still under way rather
   * than wait for it (a dispatcher slow to answer would hold following back by up to the status
   * timeout): following polls at once, with the same reporter.
   */
  settle(): void {
    this.stop();
    if (this.reporter !== null) this.draw(this.reporter);
  }

  /** The submission ended early (an error, Ctrl-C): give up the poll under way, if any. */
  stop(): void {
    this.stopped.abort();
  }

  private draw(reporter: ProgressReporter): void {
    if (!this.polled) return;
    this.polled = false;
    reporter.update({ ...sumProgress([...this.latest.values()]), total: this.total });
  }

  private async poll(client: FleetClient): Promise<void> {
    const open = this.batchIds.filter((id) => {
      const s = this.latest.get(id);
      return s === undefined || s.done < s.total;
    });
    // A batch whose status cannot be read now counts as it last did (zero before its first read):
    // the progress is only shown here, and following after the submission reports a dispatcher
    // that keeps failing, as it does without a wait.
    const polled = await Promise.allSettled(open.map((id) => client.getBatch(id)));
    for (const [i, p] of polled.entries()) if (p.status === "fulfilled") this.latest.set(open[i]!, p.value);
    this.polled = true;
  }
}

/** What following batches to their end needs: `submit --wait`'s and `watch`'s options. */
export interface FollowOptions {
  out?: string;
  json?: boolean;
  pollInterval: number;
  /** How long to keep waiting through a dispatcher outage (s). */
  outageWait: number;
  /** How long to wait for the batches to finish at all (s); unset: until they do. */
  waitTimeout?: number;
}

/**
 * Follow batches until every rollout is terminal (progress on stderr), collect their results
 * (to `file` when given) and print a summary; 1 when fewer results come back than `expected`.
 */
export async function followBatches(
  client: FleetClient,
  batchIds: readonly string[],
  expected: number,
  opts: FollowOptions,
  ctx: CliContext,
  file: ResultsFile | null,
  /** Carried on from `submit`'s progress while the backlog held it back, when it drew any. */
  reporter = new ProgressReporter(ctx.stderr, ctx.progress),
): Promise<number> {
  // From here on nothing is submitted: ride out a dispatcher restart or a proxy's 502/503/504
  // rather than dropping hours of waiting after a few seconds of retries.
  const patient = patientClient(client, opts.outageWait * 1000, (text) => reporter.note(text));
  const stayOnDispatcher =
    `the batches keep running on the dispatcher: follow them with \`fleet status <batchId>\` and ` +
    `collect them with \`fleet results <batchId> --out <file>\` for ${batchIds.join(" ")}`;
  const tally = new ResultTally();
  try {
    await waitForBatches(
      patient,
      batchIds,
      opts.pollInterval,
      ctx,
      reporter,
      opts.waitTimeout === undefined ? undefined : opts.waitTimeout * 1000,
    );
    for (const batchId of batchIds) {
      for await (const line of patient.batchResultLines(batchId)) {
        tally.addLine(line);
        await file?.writeLine(line);
      }
    }
    await file?.commit();
  } catch (err) {
    if (err instanceof OutputError) {
      throw new OutputError(
        `${err.message} (the results stay on the dispatcher: \`fleet results <batchId> --out <file>\` ` +
          `for ${batchIds.join(" ")})`,
        { cause: err },
      );
    }
    if (isApiError(err) && err.code !== "aborted") await writeText(ctx.stderr, `${stayOnDispatcher}\n`);
    throw err;
  }
  const summary = tally.summary();
  if (opts.json) {
    await writeText(
      ctx.stdout,
      `${JSON.stringify({ batchIds, accepted: expected, out: opts.out ?? null, ...summary })}\n`,
    );
  } else {
    await writeText(ctx.stdout, `${renderSummary(summary)}\n`);
    if (opts.out !== undefined) await writeText(ctx.stdout, `results written to ${opts.out}\n`);
  }
  if (summary.total !== expected) {
    // Results gone from the dispatcher (its retention, FLEET_RESULT_TTL_S, ran out before the
    // batch was collected): what came is written and summed up, but the run is not whole.
    await writeText(
      ctx.stderr,
      `error: ${expected} rollouts accepted but ${summary.total} results returned; the rest are gone ` +
        "from the dispatcher (past its result retention?)\n",
    );
    return 1;
  }
  return 0;
}

/** `client`, riding out an outage of up to `maxOutageMs` without an answer, saying so through `note`. */
export function patientClient(
  client: FleetClient,
  maxOutageMs: number,
  note: (text: string) => void,
): FleetClient {
  return client.with({
    patience: {
      maxOutageMs,
      onOutage: ({ since, reason, code }) =>
        note(
          // A 503 `unavailable` is the dispatcher answering that the fleet's Redis cannot serve.
          `${code === "unavailable" ? "the fleet's Redis is unavailable" : "dispatcher unreachable"} (${reason}); ` +
            `still waiting (since ${since.toISOString().replace(/\.\d+Z$/, "Z")}, ` +
            `giving up after ${formatDuration(maxOutageMs)} without an answer)\n`,
        ),
      onRecovered: ({ downMs }) =>
        note(`dispatcher answering again after ${formatDuration(downMs)}; carrying on\n`),
    },
  });
}

/** What the chunk loop knows when a POST fails. */
interface PostingState {
  /** The Idempotency-Key of the POST last sent (the one that failed, after a failure). */
  key: string;
  /** Whether the backlog's room (a 429) made the CLI split a chunk: that split is not repeatable. */
  backlogSplit: boolean;
  /**
   * The dispatcher's setting by which a 413 made the CLI split a chunk (its backlog bound, its
   * body limit), if one did: a re-run splits it alike, under the same keys, only while that
   * setting is unchanged.
   */
  boundSplit?: string;
  /**
   * Set once the dispatcher refused a chunk as a JSON batch (over its FLEET_MAX_JSON_BATCH_BYTES,
   * which may be lower than the size the client sends NDJSON from): every later body goes as NDJSON.
   */
  ndjson?: boolean;
}

/**
 * POST one chunk (or the part of it from row `from`) as a batch. A chunk with more rows than the
 * fleet's backlog bound can ever hold (413 naming `maxBacklog`) goes as several batches of at most
 * that many rows; one whose body is over the dispatcher's body limit (413 naming `limit`), as
 * several bodies under it. When the backlog has room for only part of it (429 naming the bound and
 * what is in flight), that part goes first. While the backlog is full, the chunk is offered again after
 * the server's `Retry-After` for up to `backlogWaitMs` from the first answer that it is full (a
 * slow answer is no wait for room), saying so on stderr (with `--wait`, drawing the progress of the
 * batches admitted so far meanwhile: `held`): a submission larger than the backlog goes in as its
 * earlier batches finish. Each POST's Idempotency-Key is
 * `keyFor(from, to)` of the rows it carries. `onAccepted` is told of every batch admitted.
 */
async function submitChunk(
  client: FleetClient,
  lines: readonly string[],
  from: number,
  keyFor: (from: number, to: number) => string,
  posting: PostingState,
  held: HeldProgress,
  backlogWaitMs: number,
  onAccepted: (batch: BatchAccepted) => Promise<void>,
): Promise<void> {
  const part = (start: number, end: number) =>
    submitChunk(
      client,
      lines.slice(start, end),
      from + start,
      keyFor,
      posting,
      held,
      backlogWaitMs,
      onAccepted,
    );
  // The `--backlog-wait` window opens at the first answer that the backlog is full, not before the
  // first POST: a slow answer is no time spent waiting for room. A wait that runs to the window's
  // end makes the offer after it the last one, whatever the clocks say about the timer's precision.
  let until: number | null = null;
  let lastOffer = false;
  for (;;) {
    try {
      posting.key = keyFor(from, from + lines.length);
      // A full backlog (429) comes straight back here, which waits as `--backlog-wait` says.
      await onAccepted(
        await client.submitBatchLines(lines, {
          idempotencyKey: posting.key,
          returnBusy: true,
          ...(posting.ndjson ? { format: "ndjson" as const } : {}),
        }),
      );
      return;
    } catch (err) {
      if (!isApiError(err)) throw err;
      const details = (err.details ?? {}) as Record<string, unknown>;
      const num = (k: string) => (typeof details[k] === "number" ? (details[k] as number) : null);
      // Over the dispatcher's FLEET_MAX_JSON_BATCH_BYTES (a 413 naming `ndjsonLimit`, the bound of
      // an NDJSON body): the same rollouts again as NDJSON, under the same key (the dispatcher
      // replays a key across the two formats). Split below only if that body is over
      // FLEET_MAX_BODY_BYTES too.
      if (err.status === 413 && !posting.ndjson && num("ndjsonLimit") !== null) {
        posting.ndjson = true;
        continue;
      }
      const max = num("maxBacklog");
      if (err.status === 413 && max !== null && max >= 1 && lines.length > max) {
        posting.boundSplit ??= `FLEET_MAX_BACKLOG (${max})`;
        for (let i = 0; i < lines.length; i += max) await part(i, i + max);
        return;
      }
      // A body over the dispatcher's FLEET_MAX_BODY_BYTES (413 naming `limit`, and no row: a task
      // over its size names the row, and no split helps it): as bodies it takes, split by the same
      // bytes every time (a re-run with this --idempotency-key sends the same parts).
      // Not when the body is under that limit already: the 413 is then about something else.
      const limit = num("limit");
      const parts =
        err.status === 413 && limit !== null && details.index === undefined ? underLimit(lines, limit) : [];
      if (parts.length > 1) {
        await held.say(
          `the dispatcher takes request bodies of at most ${limit} bytes: sending these ${lines.length} rollouts as ${parts.length} batches (--max-request-bytes ${limit} would from the start)\n`,
        );
        posting.boundSplit ??= `FLEET_MAX_BODY_BYTES (${limit})`;
        for (const [start, end] of parts) await part(start, end);
        return;
      }
      if (err.status !== 429) throw err;
      const now = Date.now();
      until ??= now + backlogWaitMs;
      if (lastOffer || now >= until) throw err;
      // Room for some of the chunk now: send that much, and offer the rest after it.
      const room = max === null ? 0 : max - (num("inflight") ?? max) - (num("admitting") ?? 0);
      if (room >= 1 && room < lines.length) {
        posting.backlogSplit = true;
        await part(0, room);
        await part(room, lines.length);
        return;
      }
      const leftS = (until - now) / 1000;
      const waitS = Math.min(
        typeof details.retryAfterS === "number" ? details.retryAfterS : 5,
        Math.max(0.01, leftS),
      );
      lastOffer = waitS >= leftS;
      await held.say(
        `the fleet's backlog is full; offering ${lines.length} more ${lines.length === 1 ? "rollout" : "rollouts"} again in ${Math.round(waitS * 10) / 10} s\n`,
      );
      try {
        await held.waitForRoom(waitS * 1000);
      } catch {
        throw new ApiError(0, "aborted", ABORTED_WAITING_FOR_ROOM);
      }
    }
  }
}

/**
 * Row ranges `[from, to)` of `lines` whose bodies are at most `limit` bytes (counted as
 * `chunkRollouts` counts a body: at least its size as JSON or NDJSON), a row over it alone. One
 * range, `lines` whole, when their body is not over it.
 */
export function underLimit(lines: readonly string[], limit: number): [number, number][] {
  const parts: [number, number][] = [];
  let from = 0;
  let bytes = BATCH_ENVELOPE_BYTES;
  for (const [i, line] of lines.entries()) {
    const size = Buffer.byteLength(line) + 1;
    if (i > from && bytes + size > limit) {
      parts.push([from, i]);
      from = i;
      bytes = BATCH_ENVELOPE_BYTES;
    }
    bytes += size;
  }
  parts.push([from, lines.length]);
  return parts;
}

/**
 * What to tell the user when chunk `i` failed. A 5xx, a timeout, a dropped connection or a garbled
 * answer may mean the dispatcher admitted the chunk (fully or partly) without the CLI learning its
 * batch id: name its key, and how to finish the submission without admitting anything twice.
 */
/** A Ctrl-C while a chunk waited for room in the backlog: nothing of it was in flight. */
const ABORTED_WAITING_FOR_ROOM = "aborted while waiting for room in the fleet's backlog";

function chunkFailureNote(
  err: unknown,
  f: { i: number; chunks: string[][]; keyBase: string; posting: PostingState; opts: SubmitOptions },
): string {
  if (!isApiError(err)) return "";
  if (err.status === 409 && err.code === "conflict" && f.opts.idempotencyKey !== undefined) {
    return (
      `--idempotency-key ${f.keyBase} was used before for a different submission (other suite, ` +
      "agent or flags): re-run with exactly the same flags, or drop --idempotency-key for a new one\n"
    );
  }
  if (!(err.status === 0 || err.status >= 500 || err.code === "bad_response")) return "";
  const rerun = `re-run the same command with --idempotency-key ${f.keyBase}`;
  const lines = [
    err.code === "aborted" && err.message === ABORTED_WAITING_FOR_ROOM
      ? `chunk ${f.i + 1} of ${f.chunks.length} (${f.chunks[f.i]?.length} rollouts) was interrupted while ` +
        "waiting for room in the fleet's backlog: what the backlog had no room for was not sent."
      : `chunk ${f.i + 1} of ${f.chunks.length} (${f.chunks[f.i]?.length} rollouts) was not confirmed: the ` +
        `dispatcher may have admitted it, fully or in part, under Idempotency-Key ${f.posting.key}.`,
  ];
  if (f.posting.backlogSplit) {
    lines.push(
      "The fleet's full backlog made this run split a chunk into smaller batches, and a re-run may " +
        `split it differently: re-running the same command with --idempotency-key ${f.keyBase} replays ` +
        "the batches sent whole, but rollouts of a split chunk could be admitted twice. Check the " +
        "batches above with `fleet status` first.",
    );
  } else {
    lines.push(
      `To finish the submission without admitting anything twice, ${rerun} ` +
        "(batches already admitted come back with the same ids; the rest go in once).",
    );
    // Its batches' keys name the rows each carried, which that setting decided: changed before
    // the re-run, a split chunk is cut elsewhere, under keys that admit its rollouts again.
    if (f.posting.boundSplit !== undefined) {
      lines.push(
        `This run split a chunk by the dispatcher's ${f.posting.boundSplit}: the re-run sends the same ` +
          "batches only while that setting is unchanged; if it changed, rollouts of a split chunk " +
          "could be admitted twice (check the batches above with `fleet status` first).",
      );
    }
  }
  return `${lines.join("\n")}\n`;
}

function parseMetadata(text: string | undefined): Record<string, unknown> | undefined {
  if (text === undefined) return undefined;
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (err) {
    throw new UsageError(`--metadata is not valid JSON: ${(err as Error).message}`);
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new UsageError("--metadata must be a JSON object");
  }
  // What the dispatcher would refuse (a "__proto__" key at any depth, an integer past 2^53 that
  // JSON.parse already rounded), refused here, before anything is sent: the contract's own schema.
  const parsed = RolloutRequest.shape.metadata.safeParse(value);
  if (!parsed.success) {
    const problems = parsed.error.issues.map((i) =>
      i.path.length === 0 ? i.message : `${i.path.map(String).join(".")} ${i.message}`,
    );
    throw new UsageError(`--metadata is refused: ${problems.join("; ")}`);
  }
  return value as Record<string, unknown>;
}

/** The batches' progress summed: done, total, masked and failed rollouts. */
function sumProgress(statuses: readonly BatchStatus[]): {
  done: number;
  total: number;
  masked: number;
  failed: number;
} {
  const counts = { done: 0, total: 0, masked: 0, failed: 0 };
  for (const s of statuses) {
    counts.done += s.done;
    counts.total += s.total;
    counts.masked += s.counts.masked ?? 0;
    counts.failed += s.counts.failed ?? 0;
  }
  return counts;
}

/** Poll the batches until all their rollouts are terminal (a finished one not again), drawing progress on stderr. */
export async function waitForBatches(
  client: FleetClient,
  batchIds: readonly string[],
  pollIntervalMs: number,
  ctx: CliContext,
  reporter = new ProgressReporter(ctx.stderr, ctx.progress),
  /** Give up (an ApiError `wait_timeout`) when they are not finished this long after the start (ms). */
  timeoutMs?: number,
): Promise<BatchStatus[]> {
  const started = performance.now();
  // A batch found finished is not asked again: a submission the backlog split into hundreds of
  // batches would otherwise poll every one of them each interval until the last is done.
  const finished = new Map<string, BatchStatus>();
  try {
    for (;;) {
      const statuses = await Promise.all(batchIds.map((id) => finished.get(id) ?? client.getBatch(id)));
      for (const [i, s] of statuses.entries()) if (s.done >= s.total) finished.set(batchIds[i]!, s);
      const counts = sumProgress(statuses);
      if (statuses.every((s) => s.done >= s.total)) {
        reporter.finish(counts);
        return statuses;
      }
      reporter.update(counts);
      const elapsed = performance.now() - started;
      if (timeoutMs !== undefined && elapsed >= timeoutMs) {
        // A CI job's bound: no worker at work, a janitor down, would otherwise wait for good.
        throw new ApiError(
          0,
          "wait_timeout",
          `the batches were not finished after --wait-timeout ${formatDuration(timeoutMs)} (${counts.done}/${counts.total} done)`,
        );
      }
      // Never past the bound by a long poll interval: the last poll comes at it.
      const nap = timeoutMs === undefined ? pollIntervalMs : Math.min(pollIntervalMs, timeoutMs - elapsed);
      await sleep(nap, undefined, { signal: ctx.signal });
    }
  } catch (err) {
    reporter.interrupt();
    throw err;
  }
}

/** `n` and the noun, singular for 1. */
function counted(n: number, one: string, many = `${one}s`): string {
  return `${n} ${n === 1 ? one : many}`;
}

/** Most rollouts one `fleet submit` builds and sends (tasks × `--repeat`). */
export const MAX_SUBMIT_ROLLOUTS = 1_000_000;

/**
 * A `--deadline` shorter than a task's rollout needs (the agent's timeout, the tests', the margin
 * to stop and grade, the allowance before the run) is refused by the dispatcher: for a suite split
 * into several requests, after the first ones were admitted and started. Said here, before
 * anything is sent, with the tasks it is short for.
 */
function checkDeadline(
  deadlineS: number | undefined,
  tasks: readonly TaskContent[],
  agent: { timeoutS?: number | undefined },
): void {
  if (deadlineS === undefined) return;
  const short = tasks
    .map((t) => ({ id: t.id, needS: (runNeeds(t, agent).needMs + ADMISSION_ALLOWANCE_MS) / 1000 }))
    .filter((t) => deadlineS < t.needS);
  if (short.length === 0) return;
  const named =
    short
      .slice(0, 10)
      .map((t) => `${t.id} (${t.needS} s)`)
      .join(", ") + (short.length > 10 ? `, and ${short.length - 10} more` : "");
  throw new UsageError(
    `--deadline ${deadlineS} s is shorter than a rollout of ${short.length === 1 ? "this task needs" : `${short.length} tasks needs`} (the agent's timeout, the tests', ${RUN_MARGIN_MS / 1000} s to stop and grade, ${ADMISSION_ALLOWANCE_MS / 1000} s before the run): ${named}; raise --deadline, lower the agent's timeoutS, or leave them out with --task`,
  );
}
