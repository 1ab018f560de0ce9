import { freeLoopbackPort } from "@fleet/queue";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { PrivateRedis } from "./chaos/lib/private-redis.ts";
import { testPrefix, waitFor } from "./helpers/env.ts";
import { npmStart } from "./helpers/npm-app.ts";

/** An app started the README's way (`npm start -w <app>`): its output so far, and its exit code once it ends. */
function startApp(workspace: string, env: Record<string, string>) {
  const { npm, output } = npmStart(workspace, { FLEET_API_TOKENS: "durability-test", ...env });
  let ended = false;
  const exited = new Promise<number | null>((resolve) =>
    npm.once("exit", (code) => {
      ended = true;
      resolve(code);
    }),
  );
  return { output, ended: () => ended, exited, stop: () => npm.kill("SIGTERM") };
}

const APPS = [
  { workspace: "@fleet/dispatcher", ready: /listening/ },
  // The stage workers start through the same code as the janitor (`buildDeps`).
  { workspace: "@fleet/janitor", ready: /janitor started/ },
] as const;

/**
 * DESIGN §2 rule 7 needs acknowledged writes to survive a crash of Redis's host: the apps refuse a
 * Redis that fsyncs its AOF only once a second, unless the operator accepts the loss
 * (`FLEET_REDIS_ACCEPT_WRITE_LOSS=true`). The check itself is tested in the queue package; this
 * is its wiring in the apps, whole processes against a Redis of the test's own.
 */
describe("apps against a Redis with appendfsync everysec", () => {
  let redis: PrivateRedis;
  const prefix = testPrefix("durability");
  beforeAll(async () => {
    redis = await PrivateRedis.start({ appendfsync: "everysec" });
  });
  afterAll(async () => redis?.stop());

  it("refuse to start, saying why and what to set, and start with FLEET_REDIS_ACCEPT_WRITE_LOSS=true", async () => {
    const port = await freeLoopbackPort();
    const env = {
      REDIS_URL: redis.url,
      FLEET_PREFIX: prefix,
      FLEET_HTTP_HOST: "127.0.0.1",
      FLEET_HTTP_PORT: String(port),
    };
    await Promise.all(
      APPS.map(async ({ workspace, ready }) => {
        const refused = startApp(workspace, env);
        expect(await refused.exited, workspace).not.toBe(0);
        expect(refused.output(), workspace).toMatch(
          /appendfsync is "everysec".*FLEET_REDIS_ACCEPT_WRITE_LOSS/s,
        );
        expect(refused.output(), workspace).not.toMatch(ready);
      }),
    );
    // One at a time from here: the dispatcher holds its port until it exits.
    for (const { workspace, ready } of APPS) {
      const accepted = startApp(workspace, { ...env, FLEET_REDIS_ACCEPT_WRITE_LOSS: "true" });
      try {
        await waitFor(
          `${workspace} to start or end`,
          async () => ready.test(accepted.output()) || accepted.ended(),
          90_000,
        );
        expect(accepted.output(), workspace).toMatch(ready);
      } finally {
        accepted.stop();
      }
      expect(await accepted.exited, workspace).toBe(0);
    }
  }, 240_000);
});
