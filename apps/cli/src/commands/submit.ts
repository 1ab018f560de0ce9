import { setTimeout as sleep } from "node:timers/promises";
import type { TaskContent } from "@fleet/contracts";
import { ApiError, type BatchAccepted, type BatchStatus, type FleetClient, isApiError } from "../client.ts";
import { type CliContext, OutputError, ResultsFile, writeText } from "../context.ts";
import { ProgressReporter } from "../progress.ts";
import { buildRollouts, chunkRollouts, resolveAgent, UsageError } from "../requests.ts";
import { ResultTally, renderSummary } from "../summary.ts";

export interface SubmitOptions {
  suite: string;
  agent: string;
  repeat: number;
  task?: string[];
  deadline?: number;
  metadata?: string;
  wait?: boolean;
  out?: string;
  json?: boolean;
  maxRequestBytes: number;
  inlineTasks?: boolean;
  pollInterval: number;
  /** How long to keep offering a chunk the fleet's backlog has no room for (s). */
  backlogWait: number;
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
): Promise<number> {
  if (opts.out !== undefined && !opts.wait)
    throw new UsageError("--out needs --wait (or use `fleet results`)");
  // Opened before anything is submitted: a path that cannot be written is a usage error now,
  // not after hours of waiting.
  let file: ResultsFile | null = null;
  if (opts.out !== undefined) {
    try {
      file = await ResultsFile.open(opts.out);
    } catch (err) {
      throw new UsageError(`cannot write --out ${opts.out}: ${(err as Error).message}`);
    }
  }
  try {
    return await submitAndFollow(client, opts, ctx, file);
  } finally {
    await file?.discard();
  }
}

async function submitAndFollow(
  client: FleetClient,
  opts: SubmitOptions,
  ctx: CliContext,
  file: ResultsFile | null,
): Promise<number> {
  const agent = await resolveAgent(opts.agent, ctx.readFile);
  let tasks: TaskContent[];
  try {
    tasks = await ctx.loadSuite(opts.suite);
  } catch (err) {
    throw new UsageError(`cannot load suite ${opts.suite}: ${(err as Error).message}`);
  }
  const requests = buildRollouts({
    tasks,
    agent,
    repeat: opts.repeat,
    taskIds: opts.task,
    deadlineS: opts.deadline,
    metadata: parseMetadata(opts.metadata),
  });
  const chunks = chunkRollouts(requests, {
    maxBytes: opts.maxRequestBytes,
    digestOf: opts.inlineTasks ? undefined : ctx.digestOf,
  });

  const taskCount = new Set(requests.map((r) => ("id" in r.task ? r.task.id : r.task.digest))).size;
  const batchIds: string[] = [];
  let accepted = 0;
  const onAccepted = async (batch: BatchAccepted) => {
    batchIds.push(batch.batchId);
    accepted += batch.count;
    await writeText(ctx.stdout, `${batch.batchId}\n`);
  };
  for (const [i, lines] of chunks.entries()) {
    try {
      await submitChunk(client, lines, ctx, opts.backlogWait * 1000, onAccepted);
    } catch (err) {
      if (batchIds.length > 0) {
        await writeText(
          ctx.stderr,
          `submitted ${i} of ${chunks.length} chunks before the error: ${batchIds.join(" ")} ` +
            "(cancel them with `fleet cancel <batchId>`)\n",
        );
      }
      throw err;
    }
  }
  await writeText(
    ctx.stderr,
    `submitted ${accepted} rollouts (${taskCount} tasks × ${opts.repeat}) in ${batchIds.length} ` +
      `batch${batchIds.length === 1 ? "" : "es"} to ${client.url}\n`,
  );
  if (!opts.wait) return 0;

  await waitForBatches(client, batchIds, opts.pollInterval, ctx);

  const tally = new ResultTally();
  try {
    for (const batchId of batchIds) {
      for await (const line of client.batchResultLines(batchId)) {
        tally.addLine(line);
        await file?.writeLine(line);
      }
    }
    await file?.commit();
  } catch (err) {
    if (!(err instanceof OutputError)) throw err;
    throw new OutputError(
      `${err.message} (the results stay on the dispatcher: \`fleet results <batchId> --out <file>\` ` +
        `for ${batchIds.join(" ")})`,
      { cause: err },
    );
  }
  const summary = tally.summary();
  if (summary.total !== accepted) {
    await writeText(
      ctx.stderr,
      `warning: ${accepted} rollouts accepted but ${summary.total} results returned\n`,
    );
  }
  if (opts.json) {
    await writeText(
      ctx.stdout,
      `${JSON.stringify({ batchIds, accepted, out: opts.out ?? null, ...summary })}\n`,
    );
  } else {
    await writeText(ctx.stdout, `${renderSummary(summary)}\n`);
    if (opts.out !== undefined) await writeText(ctx.stdout, `results written to ${opts.out}\n`);
  }
  return 0;
}

/**
 * POST one chunk as a batch. A chunk with more rows than the fleet's backlog bound can ever hold
 * (413 naming `maxBacklog`) goes as several batches of at most that many rows. When the backlog
 * has room for only part of it (429 naming the bound and what is in flight), that part goes
 * first. While the backlog is full, the chunk is offered again after the server's `Retry-After`
 * for up to `backlogWaitMs`, saying so on stderr: a submission larger than the
 * backlog goes in as its earlier batches finish. `onAccepted` is told of every batch admitted.
 */
async function submitChunk(
  client: FleetClient,
  lines: readonly string[],
  ctx: CliContext,
  backlogWaitMs: number,
  onAccepted: (batch: BatchAccepted) => Promise<void>,
): Promise<void> {
  const until = Date.now() + backlogWaitMs;
  for (;;) {
    try {
      await onAccepted(await client.submitBatchLines(lines));
      return;
    } catch (err) {
      if (!isApiError(err)) throw err;
      const details = (err.details ?? {}) as Record<string, unknown>;
      const num = (k: string) => (typeof details[k] === "number" ? (details[k] as number) : null);
      const max = num("maxBacklog");
      if (err.status === 413 && max !== null && max >= 1 && lines.length > max) {
        for (let i = 0; i < lines.length; i += max) {
          await submitChunk(client, lines.slice(i, i + max), ctx, backlogWaitMs, onAccepted);
        }
        return;
      }
      if (err.status !== 429 || Date.now() >= until) throw err;
      // Room for some of the chunk now: send that much, and offer the rest after it.
      const room = max === null ? 0 : max - (num("inflight") ?? max) - (num("admitting") ?? 0);
      if (room >= 1 && room < lines.length) {
        await submitChunk(client, lines.slice(0, room), ctx, backlogWaitMs, onAccepted);
        await submitChunk(client, lines.slice(room), ctx, backlogWaitMs, onAccepted);
        return;
      }
      const waitS = typeof details.retryAfterS === "number" ? details.retryAfterS : 5;
      await writeText(
        ctx.stderr,
        `the fleet's backlog is full; offering ${lines.length} more rollouts again in ${waitS} s\n`,
      );
      try {
        await sleep(waitS * 1000, undefined, { signal: ctx.signal });
      } catch {
        throw new ApiError(0, "aborted", "aborted while waiting for room in the fleet's backlog");
      }
    }
  }
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
  return value as Record<string, unknown>;
}

/** Poll every batch until all its rollouts are terminal, drawing progress on stderr. */
export async function waitForBatches(
  client: FleetClient,
  batchIds: readonly string[],
  pollIntervalMs: number,
  ctx: CliContext,
): Promise<BatchStatus[]> {
  const reporter = new ProgressReporter(ctx.stderr, ctx.progress);
  try {
    for (;;) {
      const statuses = await Promise.all(batchIds.map((id) => client.getBatch(id)));
      const counts = { done: 0, total: 0, masked: 0, failed: 0 };
      for (const s of statuses) {
        counts.done += s.done;
        counts.total += s.total;
        counts.masked += s.counts.masked ?? 0;
        counts.failed += s.counts.failed ?? 0;
      }
      if (statuses.every((s) => s.done >= s.total)) {
        reporter.finish(counts);
        return statuses;
      }
      reporter.update(counts);
      await sleep(pollIntervalMs, undefined, { signal: ctx.signal });
    }
  } catch (err) {
    reporter.interrupt();
    throw err;
  }
}
