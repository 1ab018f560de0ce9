import { randomUUID } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Queue, UnrecoverableError, Worker } from "bullmq";
import { Redis } from "ioredis";
import { type Browser, type BrowserContext, chromium, type Page } from "playwright-core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FleetProcesses, REPO_ROOT } from "../../scripts/lib/fleet-processes.ts";
import { dropPrefix, REDIS_URL, testPrefix, waitFor } from "../helpers/env.ts";

const CHROMIUM = process.env.FLEET_CHROMIUM ?? "/usr/bin/chromium";
const ARTIFACTS = join(REPO_ROOT, "test-artifacts", "ops");
const STAGES = ["seed", "run", "verify", "close"] as const;
const QUEUES = [...STAGES, "janitor"] as const;

const available = existsSync(CHROMIUM);
if (!available) {
  console.warn(
    `\n!!! test/ops/board.test.ts SKIPPED: no Chromium at ${CHROMIUM} (apt-get install -y chromium); .ci/run installs it\n`,
  );
}

/** What the test puts in the queues: jobs per queue and state, for a dispatcher with no workers. */
const FIXTURE = { seed: { waiting: 3 }, run: { failed: 1 }, verify: { delayed: 2 }, close: { completed: 1 } };

describe.skipIf(!available)("Bull Board in a browser", () => {
  const prefix = testPrefix("board");
  const USER = `user-${randomUUID()}`;
  const ADMIN = `admin-${randomUUID()}`;
  const failedId = `r-${randomUUID().slice(0, 8)}`;
  let fleet: FleetProcesses;
  let redis: Redis;
  let queues: Record<(typeof QUEUES)[number], Queue>;
  let browser: Browser;
  const contexts: BrowserContext[] = [];

  /** Let one stage queue's next job fail (or complete) through a short-lived worker. */
  async function settle(name: "run" | "close", fail: boolean): Promise<void> {
    const worker = new Worker(
      name,
      async () => {
        if (fail) throw new UnrecoverableError("planted failure");
        return "ok";
      },
      { connection: redis.duplicate(), prefix },
    );
    await new Promise<void>((resolve) => worker.once(fail ? "failed" : "completed", () => resolve()));
    await worker.close();
  }

  beforeAll(async () => {
    // Only the dispatcher: nothing consumes the stage queues, so the fixture stays put.
    fleet = await FleetProcesses.start({
      redisUrl: REDIS_URL,
      prefix,
      logDir: mkdtempSync(join(tmpdir(), "fleet-ops-board-")),
      replicas: { resources: 0, agent: 0, verifier: 0, janitor: 0 },
      env: { FLEET_API_TOKENS: `${USER},admin:${ADMIN}` },
    });
    redis = new Redis(REDIS_URL, { maxRetriesPerRequest: null });
    queues = Object.fromEntries(
      QUEUES.map((q) => [q, new Queue(q, { connection: redis, prefix })]),
    ) as typeof queues;
    for (let i = 0; i < 3; i++)
      await queues.seed.add("seed", { rolloutId: `s${i}` }, { jobId: `s${i}.seed` });
    await queues.run.add("run", { rolloutId: failedId }, { jobId: `${failedId}.run`, attempts: 1 });
    await settle("run", true);
    for (let i = 0; i < 2; i++) {
      await queues.verify.add("verify", { rolloutId: `v${i}` }, { jobId: `v${i}.verify`, delay: 3_600_000 });
    }
    await queues.close.add("close", { rolloutId: "c0" }, { jobId: "c0.close" });
    await settle("close", false);
    browser = await chromium.launch({ executablePath: CHROMIUM, args: ["--no-sandbox"] });
    mkdirSync(ARTIFACTS, { recursive: true });
  });

  afterAll(async () => {
    for (const c of contexts) await c.close().catch(() => undefined);
    await browser?.close();
    await fleet?.stop();
    if (queues) {
      for (const q of Object.values(queues)) {
        await q.obliterate({ force: true });
        await q.close();
      }
    }
    redis?.disconnect();
    await dropPrefix(REDIS_URL, prefix);
  });

  /** A fresh browser profile signed in with `token` through the login form. */
  async function signIn(token: string): Promise<Page> {
    const context = await browser.newContext();
    contexts.push(context);
    const page = await context.newPage();
    const first = await page.goto(`${fleet.url}/admin/queues`);
    expect(first?.status()).toBe(401); // no session yet: the sign-in form, with a 401
    await page.fill("#token", token);
    await Promise.all([page.waitForURL(`${fleet.url}/admin/queues`), page.click("button[type=submit]")]);
    const cookies = await context.cookies(`${fleet.url}/admin/queues`);
    const session = cookies.find((c) => c.name === "fleet_session");
    expect(session).toMatchObject({ httpOnly: true, sameSite: "Strict", path: "/admin" });
    expect(session!.value).not.toContain(token);
    return page;
  }

  /** The job total a queue's card on the overview shows. */
  async function cardTotal(page: Page, queue: string): Promise<number> {
    const total = page.locator(`li:has(a[href="/admin/queues/queue/${queue}"]) [class*="total-"]`);
    await total.waitFor();
    const m = /(\d+) Jobs?/.exec((await total.textContent()) ?? "");
    if (!m) throw new Error(`no job total on the ${queue} card`);
    return Number(m[1]);
  }

  /** The job card's retry button (an icon: Bull Board's refresh glyph), not "Retry all". */
  const retryButton = (page: Page) =>
    page.locator('button:has(svg.lucide-refresh-cw):not(:has-text("Retry all"))');

  it("without a token: 401 on the API and on the board", async () => {
    for (const path of ["/v1/rollouts/x", "/openapi.json", "/admin/queues", "/admin/queues/api/queues"]) {
      const res = await fetch(`${fleet.url}${path}`);
      expect({ path, status: res.status }).toEqual({ path, status: 401 });
    }
    const wrong = await fetch(`${fleet.url}/admin/queues/api/queues`, {
      headers: { authorization: "Bearer nope" },
    });
    expect(wrong.status).toBe(401);
  });

  it("a read-only token signs in, sees the four stage queues with the counts the API reports, and cannot retry", async () => {
    const page = await signIn(USER);
    await expect(page.title()).resolves.toBe("rollout-fleet (read-only)");

    // What the API says: Bull Board's JSON (same session) and the dispatcher's /metrics.
    const board = (await (await page.request.get(`${fleet.url}/admin/queues/api/queues`)).json()) as {
      queues: { name: string; counts: Record<string, number> }[];
    };
    const metrics = await (await fetch(`${fleet.url}/metrics`)).text();
    for (const stage of STAGES) {
      const counts = board.queues.find((q) => q.name === stage)!.counts;
      for (const [state, n] of Object.entries(FIXTURE[stage])) {
        expect({ stage, state, n: counts[state] }).toEqual({ stage, state, n });
        expect(metrics).toContain(
          `fleet_queue_jobs{queue="${stage}",state="${state}",app="dispatcher"} ${n}`,
        );
      }
      const total = Object.values(counts).reduce((a, b) => a + b, 0);
      expect({ stage, shown: await cardTotal(page, stage) }).toEqual({ stage, shown: total });
    }
    // The janitor's queue is on the board too.
    await expect(page.locator('a[href="/admin/queues/queue/janitor"]').first().isVisible()).resolves.toBe(
      true,
    );
    await page.screenshot({ path: join(ARTIFACTS, "bull-board-overview-read-only.png"), fullPage: true });

    // The failed job: shown, without a retry button (nor "Retry all").
    await page.goto(`${fleet.url}/admin/queues/queue/run?status=failed`);
    await page.getByText(`${failedId}.run`).first().waitFor();
    await page.getByText("planted failure").first().waitFor();
    expect(await retryButton(page).count()).toBe(0);
    expect(await page.locator("svg.lucide-refresh-cw").count()).toBe(0);
    expect(await page.getByText("Retry all").count()).toBe(0);
    await page.screenshot({ path: join(ARTIFACTS, "bull-board-failed-job-read-only.png"), fullPage: true });

    // And the endpoint refuses, from the board's own page (same origin, with the session).
    const status = await page.evaluate(
      async (url) => (await fetch(url, { method: "PUT" })).status,
      `/admin/queues/api/queues/run/${failedId}.run/retry`,
    );
    expect(status).toBe(403);
    expect(await queues.run.getJobState(`${failedId}.run`)).toBe("failed");
  });

  it("an admin token gets the retry button, and retrying works", async () => {
    const page = await signIn(ADMIN);
    await expect(page.title()).resolves.toBe("rollout-fleet");
    await page.goto(`${fleet.url}/admin/queues/queue/run?status=failed`);
    await page.getByText(`${failedId}.run`).first().waitFor();
    await retryButton(page).first().waitFor();
    expect(await page.getByText("Retry all").count()).toBe(1);
    await page.screenshot({ path: join(ARTIFACTS, "bull-board-failed-job-admin.png"), fullPage: true });

    // A cross-site request riding on the admin's cookie is refused (Origin is not the dispatcher).
    const forged = await page.request.put(`${fleet.url}/admin/queues/api/queues/run/${failedId}.run/retry`, {
      headers: { origin: "http://evil.example" },
    });
    expect(forged.status()).toBe(403);
    expect(await queues.run.getJobState(`${failedId}.run`)).toBe("failed");

    await retryButton(page).first().click();
    // Bull Board asks before acting.
    await page.getByRole("button", { name: "Confirm" }).click();
    await waitFor(
      "the job to leave failed",
      async () => (await queues.run.getJobState(`${failedId}.run`)) !== "failed",
      15_000,
    );
    expect(await queues.run.getJobState(`${failedId}.run`)).toBe("waiting");
  });
});
