import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { RolloutResult, TaskContent } from "@fleet/contracts";
import { certificateExpirySeconds, freeLoopbackPort, LocalRedisServer } from "@fleet/queue";
import {
  encryptTestKey,
  makeTestCertificates,
  replaceFile,
  type TestCertificates,
  tlsServerArgs,
} from "@fleet/queue/testing";
import { EXAMPLE_SUITE_DIR, loadSuite } from "@fleet/tasks";
import { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FleetProcesses } from "../scripts/lib/fleet-processes.ts";
import { callApi } from "./helpers/api.ts";
import { containersOf, IMAGE, testPrefix, waitFor } from "./helpers/env.ts";
import { npmStart } from "./helpers/npm-app.ts";
import { parseMetrics, sampleValue } from "./ops/prom.ts";

/**
 * Every app (dispatcher, the three stage workers, the janitor) as its own process against a Redis
 * that speaks TLS only on the port they are given, with a certificate a CA of the test's own
 * signed, and that asks them for a client certificate: `REDIS_URL=rediss://…`,
 * `FLEET_REDIS_TLS_CA_FILE` naming that CA, `FLEET_REDIS_TLS_CERT_FILE`/`_KEY_FILE` theirs, the
 * key encrypted, its passphrase in `FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE`. Then Redis moves to
 * another CA and the files are rewritten in place: the same processes go on.
 */
describe("the fleet on a Redis over TLS with a private CA and client certificates", () => {
  const prefix = testPrefix("tls");
  const dir = mkdtempSync(join(tmpdir(), "fleet-tls-e2e-"));
  let redis: LocalRedisServer;
  let fleet: FleetProcesses | undefined;
  let suite: TaskContent[];
  let tlsPort = 0;
  let certs: TestCertificates;
  let encryptedKey = "";
  const passphrase = "fleet test passphrase 7f3a";
  const passphraseFile = join(dir, "passphrase");
  // The files the apps are given, rewritten at a rotation.
  const live = {
    ca: join(dir, "live-ca.pem"),
    cert: join(dir, "live-client.pem"),
    key: join(dir, "live-client.key"),
  };
  const install = (from: TestCertificates, key: string) => {
    replaceFile(from.caFile, live.ca);
    replaceFile(from.clientCertFile, live.cert);
    replaceFile(key, live.key);
  };
  const ids: string[] = [];

  beforeAll(async () => {
    suite = await loadSuite(EXAMPLE_SUITE_DIR);
    certs = makeTestCertificates(dir);
    mkdirSync(join(dir, "next"));
    encryptedKey = encryptTestKey(certs.clientKeyFile, join(dir, "client-encrypted.key"), passphrase);
    writeFileSync(passphraseFile, `${passphrase}\n`);
    install(certs, encryptedKey);
    tlsPort = await freeLoopbackPort();
    // It asks every client for a certificate its CA signed (tls-auth-clients yes, Redis's default).
    redis = await LocalRedisServer.start({ dir, args: tlsServerArgs(certs, tlsPort, { authClients: true }) });
    fleet = await FleetProcesses.start({
      redisUrl: `rediss://127.0.0.1:${tlsPort}`,
      prefix,
      logDir: join(dir, "logs"),
      env: {
        FLEET_REDIS_TLS_CA_FILE: live.ca,
        FLEET_REDIS_TLS_CERT_FILE: live.cert,
        FLEET_REDIS_TLS_KEY_FILE: live.key,
        FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE: passphraseFile,
        FLEET_REDIS_TLS_RELOAD_MS: "500",
        FLEET_METRICS_PORT: "0",
        FLEET_JANITOR_INTERVAL_MS: "2000",
      },
    });
  });

  afterAll(async () => {
    await fleet?.stop();
    await redis?.kill();
    if (process.env.FLEET_KEEP_LOGS !== "1") rmSync(dir, { recursive: true, force: true });
    expect(await containersOf(ids)).toBe(0);
  });

  /** When the client certificate the dispatcher and an agent worker present expires, by their metrics. */
  const certificateExpiries = async () => {
    const agentPort = fleet!.of("agent")[0]?.metricsPort;
    const values: number[] = [];
    for (const url of [`${fleet!.url}/metrics`, `http://127.0.0.1:${agentPort}/metrics`]) {
      const text = await (await fetch(url)).text();
      values.push(sampleValue(parseMetrics(text), "fleet_redis_tls_cert_expiry_timestamp_seconds"));
    }
    return values;
  };

  /** Two oracle rollouts of `hello-file` through the fleet, each to reward 1. */
  const twoOracleRollouts = async () => {
    const task = { ...suite.find((t) => t.id === "hello-file")!, image: IMAGE };
    const b = await callApi(fleet!, "POST", "/v1/batches", {
      rollouts: [0, 1].map(() => ({ task, agent: { harness: "oracle" } })),
    });
    expect(b.status).toBe(202);
    const batchId = String(b.body?.batchId);
    const batchIds = (b.body?.rolloutIds ?? []) as string[];
    ids.push(...batchIds);
    const batch = await waitFor(
      "the batch to finish",
      async () => {
        const s = await callApi(fleet!, "GET", `/v1/batches/${batchId}`);
        return Number(s.body?.done) === 2 ? s.body : null;
      },
      180_000,
    );
    expect(batch).toMatchObject({ total: 2, done: 2, counts: { completed: 2 } });
    for (const id of batchIds) {
      const r = (await callApi(fleet!, "GET", `/v1/rollouts/${id}`)).body as unknown as RolloutResult;
      expect(r).toMatchObject({ status: "completed", reward: 1, teardown: "confirmed" });
    }
  };

  it("runs oracle rollouts to reward 1, every app's connection on the TLS port", async () => {
    await twoOracleRollouts();
    const expiry = certificateExpirySeconds(readFileSync(certs.clientCertFile, "utf8"));
    expect(await certificateExpiries()).toEqual([expiry, expiry]);
    // The apps' connections all reached the TLS port (the plain one is this test's alone).
    const admin = new Redis(redis.url);
    try {
      const clients = String(await admin.client("LIST"))
        .split("\n")
        .filter((line) => line.includes("laddr="));
      const ports = clients.map((line) => Number(/laddr=[^ ]*:(\d+)/.exec(line)?.[1]));
      expect(ports.filter((p) => p === tlsPort).length).toBeGreaterThanOrEqual(5);
      expect(ports.filter((p) => p !== tlsPort)).toEqual([redis.port]);
    } finally {
      admin.disconnect();
    }
    // Neither the passphrase nor the key it opens in any app's log.
    const logs = readdirSync(join(dir, "logs")).map((f) => readFileSync(join(dir, "logs", f), "utf8"));
    expect(logs.length).toBeGreaterThanOrEqual(5);
    const keyBody = readFileSync(encryptedKey, "utf8").split("\n")[1]!;
    for (const log of logs) {
      expect(log).not.toContain(passphrase);
      expect(log).not.toContain(keyBody);
    }
  });

  it("after Redis moves to another CA and the files are rewritten in place, the same processes run rollouts again", async () => {
    const pids = fleet!.procs.map((p) => p.child.pid);
    // Valid for a day longer: its expiry differs from the first's.
    const next = makeTestCertificates(join(dir, "next"), { days: 3 });
    const nextKey = encryptTestKey(next.clientKeyFile, join(dir, "next", "client-encrypted.key"), passphrase);
    // Restarted on the new CA (its data kept: the same directory's AOF); every connection drops.
    await redis.kill();
    redis = await LocalRedisServer.start({
      dir,
      args: tlsServerArgs(next, tlsPort, { authClients: true }),
    });
    install(next, nextKey);
    // The dispatcher answers 503 until it has reconnected (with the new files), then 404 for a
    // rollout Redis does not hold.
    await waitFor(
      "the dispatcher to reach Redis again",
      async () => (await callApi(fleet!, "GET", "/v1/rollouts/no-such-rollout")).status === 404 || null,
      60_000,
    );
    await twoOracleRollouts();
    expect(fleet!.procs.map((p) => p.child.pid)).toEqual(pids);
    const expiry = certificateExpirySeconds(readFileSync(next.clientCertFile, "utf8"));
    expect(expiry - certificateExpirySeconds(readFileSync(certs.clientCertFile, "utf8"))).toBeGreaterThan(
      80_000,
    );
    expect(await certificateExpiries()).toEqual([expiry, expiry]);
    expect(fleet!.procs.every((p) => p.child.exitCode === null)).toBe(true);
    // Each app said it took the new files.
    const logs = readdirSync(join(dir, "logs")).map((f) => readFileSync(join(dir, "logs", f), "utf8"));
    expect(logs.filter((log) => log.includes("the Redis TLS files changed")).length).toBe(pids.length);
  });

  it("an app given a CA file it cannot read or holding no certificate, a key not its certificate's, or an encrypted key without its passphrase, refuses to start, naming the variable", async () => {
    const client = { FLEET_REDIS_TLS_CERT_FILE: certs.clientCertFile };
    for (const [env, said] of [
      [
        { FLEET_REDIS_TLS_CA_FILE: join(dir, "missing.pem") },
        /FLEET_REDIS_TLS_CA_FILE: cannot read ".*missing\.pem": ENOENT/,
      ],
      [
        { FLEET_REDIS_TLS_CA_FILE: join(dir, "server.key") },
        /FLEET_REDIS_TLS_CA_FILE: ".*server\.key" holds no PEM certificate/,
      ],
      [
        { ...client, FLEET_REDIS_TLS_KEY_FILE: certs.keyFile },
        /FLEET_REDIS_TLS_KEY_FILE: the key in ".*server\.key" is not the key of the certificate in ".*client\.crt"/,
      ],
      [
        { ...client, FLEET_REDIS_TLS_KEY_FILE: encryptedKey },
        /FLEET_REDIS_TLS_KEY_FILE: ".*client-encrypted\.key" is encrypted: name a file holding its passphrase in FLEET_REDIS_TLS_KEY_PASSPHRASE_FILE/,
      ],
    ] as const) {
      for (const workspace of ["@fleet/dispatcher", "@fleet/janitor"]) {
        const { npm, output } = npmStart(workspace, {
          REDIS_URL: `rediss://127.0.0.1:${tlsPort}`,
          FLEET_PREFIX: prefix,
          ...env,
          FLEET_HTTP_PORT: "0",
        });
        const code = await new Promise<number | null>((resolve) => npm.once("exit", resolve));
        expect(code, `${workspace}: ${output()}`).not.toBe(0);
        expect(output(), workspace).toMatch(said);
      }
    }
  }, 120_000);
});
