import { createServer } from "node:net";
import { describe, expect, it } from "vitest";
import { createRedis, logConnectionOutages } from "./connection.ts";

describe("logConnectionOutages", () => {
  it("logs an outage once however many reconnects fail, and its end once", async () => {
    // A port nothing listens on: every reconnect attempt fails.
    const port = await new Promise<number>((resolve) => {
      const srv = createServer().listen(0, "127.0.0.1", () => {
        const { port } = srv.address() as { port: number };
        srv.close(() => resolve(port));
      });
    });
    const redis = createRedis(`redis://127.0.0.1:${port}`, { retryStrategy: () => 20 });
    const lines: string[] = [];
    logConnectionOutages(redis, {
      warn: (_obj, msg) => lines.push(msg),
      info: (msg) => lines.push(msg),
    });
    let errors = 0;
    await new Promise<void>((resolve) =>
      redis.on("error", () => {
        if (++errors === 5) resolve();
      }),
    );
    expect(lines).toEqual(["redis connection lost; reconnecting"]);
    redis.emit("ready");
    redis.emit("error", new Error("again"));
    redis.disconnect();
    expect(lines).toEqual([
      "redis connection lost; reconnecting",
      "redis connection ready again",
      "redis connection lost; reconnecting",
    ]);
  });
});
