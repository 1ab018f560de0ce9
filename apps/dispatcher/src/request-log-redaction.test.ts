import { Writable } from "node:stream";
import { createLogger } from "@fleet/telemetry";
import Fastify, { type FastifyBaseLogger } from "fastify";
import { afterEach, describe, expect, it } from "vitest";

const SECRET = "tok-in-query-5f4e3d2c1b";

/** Fastify's own request lines (its default log controller), through the fleet's logger. */
describe("Fastify request logs through createLogger", () => {
  const apps: { close(): Promise<unknown> }[] = [];
  afterEach(async () => {
    await Promise.all(apps.splice(0).map((a) => a.close()));
  });

  it("never write a ?token= of the request URL: incoming, errored, and not-found lines", async () => {
    const chunks: string[] = [];
    const destination = new Writable({
      write(chunk: Buffer | string, _enc, cb) {
        chunks.push(chunk.toString());
        cb();
      },
    });
    const logger = createLogger({ name: "fastify-test", level: "info", destination });
    const app = Fastify({ loggerInstance: logger as FastifyBaseLogger });
    apps.push(app);
    app.get("/boom", async () => {
      throw new Error("failed");
    });
    expect((await app.inject({ url: `/boom?token=${SECRET}&x=1` })).statusCode).toBe(500);
    expect((await app.inject({ url: `/nope?access_token=${SECRET}` })).statusCode).toBe(404);

    const text = chunks.join("");
    expect(text).not.toContain(SECRET);
    const lines = text
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l) as { msg?: string; req?: { url?: string } });
    // The lines are there, with the rest of the URL: only the secret's value is gone.
    expect(lines.filter((l) => l.msg === "incoming request").map((l) => l.req?.url)).toEqual([
      "/boom?token=[Redacted]&x=1",
      "/nope?access_token=[Redacted]",
    ]);
    expect(lines.some((l) => l.msg === "failed" && l.req?.url === "/boom?token=[Redacted]&x=1")).toBe(true);
    expect(lines.map((l) => l.msg)).toContain("Route GET:/nope?access_token=[Redacted] not found");
  });
});
