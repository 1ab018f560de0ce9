import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { RolloutResult, TaskContent } from "@fleet/contracts";
import { createRedis, RolloutStore, TeardownLedger } from "@fleet/queue";
import { dockerClient, LABEL_SCOPE } from "@fleet/sandbox";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type AppKind, FleetProcesses } from "../../scripts/lib/fleet-processes.ts";
import { IMAGE, testPrefix, waitFor } from "../helpers/env.ts";
import { DockerProxy } from "./lib/docker-proxy.ts";
import { FleetClient } from "./lib/fleet-client.ts";
import { PrivateRedis } from "./lib/private-redis.ts";
import { INFRA_FAILURE_KINDS } from "./lib/terminal.ts";

/**
 * DESIGN §2 under faults: the whole fleet as separate processes (dispatcher, several replicas of
 * every worker, the janitor) on a private Redis with AOF, Docker reached through a proxy the
 * test can cut. While oracle rollouts of the example suite stream in, worker processes of every
 * kind are SIGKILLed (and restarted), Redis is restarted and the Docker daemon becomes
 * unreachable for a while. Afterwards every accepted rollout must have exactly one terminal
 * result, no sandbox may be left, the teardown ledger must be empty, every masked result must
 * name an infrastructure failure and every graded result must be 1.0.
 *
 * `npm test` runs the small profile; `npm run test:chaos` the full one (FLEET_CHAOS_PROFILE=full):
 * 200 rollouts, 12 kills, a 20 s Docker outage; with FLEET_CHAOS_REAL_DOCKERD=1 it also restarts
 * the real dockerd (which disturbs everyone on the machine: never in `npm test`).
 */
interface Profile {
  rollouts: number;
  wave: number;
  replicas: Partial<Record<AppKind, number>>;
  concurrency: number;
  kills: AppKind[];
  outageMs: number;
  realDockerd: boolean;
}

const FULL = process.env.FLEET_CHAOS_PROFILE === "full";
const PROFILE: Profile = FULL
  ? {
      rollouts: Number(process.env.FLEET_CHAOS_ROLLOUTS ?? 200),
      wave: 8,
      replicas: { resources: 2, agent: 3, verifier: 2, janitor: 2 },
      concurrency: 4,
      kills: [
        "agent",
        "resources",
        "verifier",
        "janitor",
        "agent",
        "resources",
        "verifier",
        "agent",
        "resources",
        "verifier",
        "janitor",
        "agent",
      ],
      outageMs: 20_000,
      realDockerd: process.env.FLEET_CHAOS_REAL_DOCKERD === "1",
    }
  : {
      rollouts: Number(process.env.FLEET_CHAOS_ROLLOUTS ?? 30),
      wave: 3,
      replicas: { resources: 2, agent: 2, verifier: 2, janitor: 1 },
      concurrency: 3,
      kills: ["agent", "resources", "verifier"],
      outageMs: 8_000,
      realDockerd: false,
    };

const JANITOR_INTERVAL_MS = 2_000;
const ORPHAN_GRACE_MS = 10_000;

interface Figures {
  rollouts: number;
  accepted: number;
  kills: number;
  processRestarts: number;
  redisRestarts: number;
  dockerOutages: number;
  lost: number;
  duplicated: number;
  leaked: number;
  ledger: number;
  masked: number;
  graded: number;
  failed: number;
  byStatus: Record<string, number>;
  maskedKinds: Record<string, number>;
  seconds: number;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe(`chaos (${FULL ? "full" : "small"} profile)`, () => {
  const prefix = testPrefix("chaos");
  const logDir = mkdtempSync(join(tmpdir(), "fleet-chaos-"));
  const docker = dockerClient({ socketPath: "/var/run/docker.sock" });
  let redis: PrivateRedis;
  let proxy: DockerProxy;
  let fleet: FleetProcesses;
  let client: FleetClient;
  let suite: TaskContent[];

  beforeAll(async () => {
    suite = (await loadSuite(EXAMPLE_SUITE_DIR)).map((t) => ({ ...t, image: IMAGE }));
    redis = await PrivateRedis.start();
    proxy = await DockerProxy.start();
    fleet = await FleetProcesses.start({
      redisUrl: redis.url,
      prefix,
      logDir,
      replicas: PROFILE.replicas,
      env: {
        DOCKER_HOST: proxy.endpoint,
        FLEET_CONCURRENCY: String(PROFILE.concurrency),
        FLEET_LOCK_DURATION_MS: "5000",
        FLEET_STALLED_INTERVAL_MS: "2000",
        FLEET_JANITOR_INTERVAL_MS: String(JANITOR_INTERVAL_MS),
        FLEET_ORPHAN_GRACE_MS: String(ORPHAN_GRACE_MS),
        FLEET_SHUTDOWN_TIMEOUT_MS: "10000",
      },
    });
    client = new FleetClient(fleet.url, fleet.token);
  });

  afterAll(async () => {
    // Each part whatever the ones before it did, each Docker call bounded: a private Redis left
    // running, or a daemon left behind its proxy, would weigh on every later file.
    const signal = () => AbortSignal.timeout(30_000);
    const label = [`${LABEL_SCOPE}=${prefix}`];
    const parts = [
      () => fleet?.stop(),
      () => proxy?.close(),
      // Before the Docker calls, which a daemon that hangs holds up to 30 s each.
      () => redis?.stop(),
      // Whatever a failed run left behind (the assertions below count it first).
      async () => {
        // Gone already, or going (a reaper removes itself): not a failure of the cleanup.
        const goneOrGoing = (err: unknown) => {
          const code = (err as { statusCode?: number }).statusCode;
          if (code !== 404 && code !== 409) throw err;
        };
        const left = await docker.listContainers({ all: true, filters: { label }, abortSignal: signal() });
        for (const c of left)
          await docker
            .getContainer(c.Id)
            .remove({ force: true, v: true, abortSignal: signal() })
            .catch(goneOrGoing);
        const vols = (await docker.listVolumes({ filters: { label }, abortSignal: signal() })).Volumes ?? [];
        for (const v of vols)
          await docker.getVolume(v.Name).remove({ force: true, abortSignal: signal() }).catch(goneOrGoing);
      },
    ];
    const failed: unknown[] = [];
    for (const part of parts)
      await Promise.resolve()
        .then(part)
        .catch((err: unknown) => failed.push(err));
    if (failed.length > 0) throw new AggregateError(failed, "the chaos test's cleanup failed");
  });

  it("keeps every rollout exactly once through SIGKILLs, a Redis restart and a Docker outage", async () => {
    const started = Date.now();
    const accepted: { batchId: string; ids: string[] }[] = [];
    const events: string[] = [];
    const note = (what: string) => events.push(`${((Date.now() - started) / 1000).toFixed(1)}s ${what}`);
    let kills = 0;
    const killedKinds = new Set<AppKind>();

    // The fault schedule, run once alongside the submissions.
    const chaos = async () => {
      const plan: (() => Promise<void>)[] = [];
      const kill = (kind: AppKind, i: number) => async () => {
        const live = fleet.of(kind);
        const target = live[i % live.length]!;
        note(`SIGKILL ${kind}-${target.index}`);
        await fleet.restart(kind, target.index, "SIGKILL");
        kills++;
        killedKinds.add(kind);
        note(`${kind}-${target.index} restarted`);
      };
      const outage = async () => {
        note(`docker unreachable for ${PROFILE.outageMs / 1000}s`);
        await proxy.cut();
        await sleep(PROFILE.outageMs);
        await proxy.restore();
        note("docker reachable again");
      };
      const redisRestart = async () => {
        note("redis restart");
        await redis.restart({ signal: "SIGKILL", downMs: 2_000 });
        note("redis back");
      };
      const realDockerd = async () => {
        note("real dockerd restart");
        // The daemon by its pid file (never by name), then the project's own bring-up script.
        const { execFileSync } = await import("node:child_process");
        execFileSync(
          "bash",
          [
            "-c",
            // Waits for the old daemon to exit (it stops the sandboxes first, without
            // live-restore): started too early, the bring-up saw it still answering and started
            // none, and then it was gone.
            'pid="$(cat /var/run/docker.pid)"; kill -TERM "$pid"; for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done; bash scripts/ensure-services.sh >/dev/null',
          ],
          { stdio: "ignore", env: { ...process.env, REDIS_URL: redis.url } },
        );
        note("real dockerd back");
      };
      const kinds = PROFILE.kills;
      const half = Math.ceil(kinds.length / 2);
      for (const [i, k] of kinds.slice(0, half).entries()) plan.push(kill(k, i));
      plan.push(outage);
      plan.push(redisRestart);
      for (const [i, k] of kinds.slice(half).entries()) plan.push(kill(k, i + half));
      if (PROFILE.realDockerd) plan.push(realDockerd);
      for (const step of plan) {
        await sleep(FULL ? 3_000 : 1_500);
        await step();
      }
    };

    // Submissions: waves of oracle rollouts over the example suite, until the faults are over
    // and all rollouts are in.
    let chaosDone = false;
    const chaosRun = chaos().finally(() => {
      chaosDone = true;
    });
    let submitted = 0;
    let wave = 0;
    while (submitted < PROFILE.rollouts) {
      const n = Math.min(PROFILE.wave, PROFILE.rollouts - submitted);
      const rows = Array.from({ length: n }, (_, i) => ({
        task: suite[(submitted + i) % suite.length]!,
        agent: { harness: "oracle" },
        metadata: { wave },
      }));
      accepted.push(await client.submitBatch(rows, `${prefix}-wave-${wave}`));
      submitted += n;
      wave++;
      // Spread the submissions over the fault schedule (about 1 wave a second while it lasts).
      if (!chaosDone) await sleep(FULL ? 1_000 : 1_200);
    }
    await chaosRun;
    note("faults over; waiting for every rollout");

    const ids = accepted.flatMap((b) => b.ids);
    const conn = createRedis(redis.url);
    const store = new RolloutStore(conn, prefix);
    const ledger = new TeardownLedger(conn, prefix);
    try {
      await waitFor(
        "every accepted rollout to finish",
        async () => (await store.getResults(ids)).every((r) => r !== null),
        FULL ? 900_000 : 240_000,
        1_000,
      );
      note("all rollouts terminal");

      // One result line per rollout in each batch's NDJSON; batch `done` never over-counts.
      let lines = 0;
      const miscounted: string[] = [];
      const seen = new Map<string, number>();
      for (const b of accepted) {
        const batch = await store.getBatch(b.batchId);
        if (batch?.total !== b.ids.length || batch?.done !== b.ids.length) {
          miscounted.push(
            `${b.batchId}: ${JSON.stringify(await conn.hgetall(store.keys.batch(b.batchId)))} ids ${JSON.stringify(
              await Promise.all(
                b.ids.map(async (id) => [id, await conn.hget(store.keys.rollout(id), "status")]),
              ),
            )}`,
          );
        }
        for (const r of await client.results(b.batchId)) {
          seen.set(String(r.id), (seen.get(String(r.id)) ?? 0) + 1);
          lines++;
        }
      }
      const results = (await store.getResults(ids)).filter((r): r is RolloutResult => r !== null);
      const lost = ids.filter((id) => !seen.has(id)).length;
      const duplicated = [...seen.values()].filter((n) => n > 1).length + Math.max(0, lines - ids.length);
      expect(await store.inflightCount()).toBe(0);

      // No sandbox of this fleet survives a janitor period (orphan grace included), and the
      // teardown ledger and the intent registry drain.
      const scoped = { label: [`${LABEL_SCOPE}=${prefix}`] };
      const leakedNow = (await docker.listContainers({ all: true, filters: scoped })).length;
      await waitFor(
        "the janitor to leave no sandbox, volume or ledger entry",
        async () =>
          (await docker.listContainers({ all: true, filters: scoped })).length === 0 &&
          ((await docker.listVolumes({ filters: scoped })).Volumes ?? []).length === 0 &&
          (await ledger.size()) === 0 &&
          (await ledger.listSandboxes()).length === 0,
        // Orphan/intent grace, plus the teardown ledger's backoff for entries that failed while
        // Docker was unreachable.
        ORPHAN_GRACE_MS + 90_000,
        500,
      ).catch(() => false);
      const leaked = (await docker.listContainers({ all: true, filters: scoped })).length;
      const ledgerLeft = await ledger.size();
      const registryLeft = (await ledger.listSandboxes()).length;

      const byStatus: Record<string, number> = {};
      const maskedKinds: Record<string, number> = {};
      for (const r of results) {
        byStatus[r.status] = (byStatus[r.status] ?? 0) + 1;
        if (r.status === "masked")
          maskedKinds[String(r.failureKind)] = (maskedKinds[String(r.failureKind)] ?? 0) + 1;
      }
      const graded = results.filter((r) => r.reward !== null);
      const figures: Figures = {
        rollouts: PROFILE.rollouts,
        accepted: ids.length,
        kills,
        processRestarts: kills,
        redisRestarts: redis.restarts,
        dockerOutages: proxy.outages,
        lost,
        duplicated,
        leaked,
        ledger: ledgerLeft,
        masked: byStatus.masked ?? 0,
        graded: graded.length,
        failed: byStatus.failed ?? 0,
        byStatus,
        maskedKinds,
        seconds: Math.round((Date.now() - started) / 1000),
      };
      console.log(
        [
          `[chaos] ${FULL ? "full" : "small"} profile, logs in ${logDir}`,
          ...events.map((e) => `[chaos]   ${e}`),
          `[chaos] rollouts=${figures.accepted}/${figures.rollouts} kills=${figures.kills} restarts=${figures.processRestarts}+redis:${figures.redisRestarts} docker-outages=${figures.dockerOutages} lost=${lost} duplicated=${duplicated} leaked=${leaked} (at finish: ${leakedNow}) ledger=${ledgerLeft} registry=${registryLeft} masked=${figures.masked} graded=${figures.graded} failed=${figures.failed} seconds=${figures.seconds}`,
          `[chaos] by status ${JSON.stringify(byStatus)}; masked kinds ${JSON.stringify(maskedKinds)}`,
          ...miscounted.map((m) => `[chaos] batch miscounted: ${m}`),
          // Why each masked rollout was masked (the first few): which fault it met, and where.
          ...results
            .filter((r) => r.status === "masked")
            .slice(0, 5)
            .map((r) => `[chaos] masked ${r.id} at ${r.stage}: ${String(r.reason).slice(0, 300)}`),
        ].join("\n"),
      );
      expect(miscounted).toEqual([]);

      expect(ids.length).toBe(PROFILE.rollouts);
      expect(kills).toBeGreaterThanOrEqual(PROFILE.kills.length);
      // Every worker kind (and in the full profile the janitor) was killed and came back.
      expect(killedKinds).toEqual(
        new Set(FULL ? ["agent", "resources", "verifier", "janitor"] : ["agent", "resources", "verifier"]),
      );
      expect(redis.restarts).toBe(1);
      expect(proxy.outages).toBeGreaterThanOrEqual(1);
      expect(lost).toBe(0);
      expect(duplicated).toBe(0);
      expect(leaked).toBe(0);
      expect(ledgerLeft).toBe(0);
      expect(registryLeft).toBe(0);
      for (const r of results) {
        if (r.status === "masked") {
          expect(r.mask).toBe(true);
          expect(INFRA_FAILURE_KINDS, `${r.id}: ${r.reason}`).toContain(r.failureKind);
          expect(r.reward).toBeNull();
        }
        // The oracle solves every example task: a graded result below 1.0 is a fault turned into a score.
        if (r.reward !== null) expect(r.reward, `${r.id} (${r.taskId}): ${r.reason}`).toBe(1);
        expect(r.status, `${r.id}: ${r.failureKind} ${r.reason}`).not.toBe("failed");
        expect(r.status).not.toBe("cancelled");
      }
      // Most rollouts get through: faults may mask some, never most.
      expect(graded.length).toBeGreaterThan(ids.length / 2);
      // Every process is still up (none crashed on its own under the faults).
      for (const [kind, n] of Object.entries({ dispatcher: 1, ...PROFILE.replicas })) {
        expect(fleet.of(kind as AppKind).length, `${kind} processes alive`).toBe(n);
      }
    } finally {
      conn.disconnect();
    }
  });
});
