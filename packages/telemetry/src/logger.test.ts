import { Writable } from "node:stream";
import { describe, expect, it } from "vitest";
import { createLogger } from "./logger.ts";

/** A destination that collects every line pino writes. */
function sink(): { stream: Writable; text: () => string; lines: () => Record<string, unknown>[] } {
  const chunks: string[] = [];
  const stream = new Writable({
    write(chunk: Buffer | string, _enc, cb) {
      chunks.push(chunk.toString());
      cb();
    },
  });
  const text = () => chunks.join("");
  return {
    stream,
    text,
    lines: () =>
      text()
        .split("\n")
        .filter((l) => l.length > 0)
        .map((l) => JSON.parse(l) as Record<string, unknown>),
  };
}

const SECRET = "sk-live-9f8e7d6c5b4a";

describe("createLogger", () => {
  it("redacts secret-shaped fields at any depth, in objects, arrays, errors and child bindings", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    log.info({ apiKey: SECRET, model: { name: "m", api_key: SECRET } }, "top and one level");
    log.info({ req: { headers: { authorization: `Bearer ${SECRET}`, accept: "*/*" } } }, "headers");
    log.info({ a: { b: { c: { d: { password: SECRET, Token: SECRET, secret: SECRET } } } } }, "deep");
    log.info({ items: [{ credentialValue: SECRET }, { nested: [{ "x-api-key": SECRET }] }] }, "arrays");
    const err = Object.assign(new Error("boom"), { config: { headers: { Authorization: SECRET } } });
    log.error({ err }, "error with secret config");
    log.child({ token: SECRET, job: { password: SECRET } }).warn("child bindings");

    expect(out.text()).not.toContain(SECRET);
    const lines = out.lines();
    expect(lines).toHaveLength(6);
    expect(lines[0]).toMatchObject({ apiKey: "[Redacted]", model: { name: "m", api_key: "[Redacted]" } });
    expect(lines[1]).toMatchObject({ req: { headers: { authorization: "[Redacted]", accept: "*/*" } } });
    expect(lines[4]).toMatchObject({ err: { message: "boom", type: "Error" } });
    expect(lines[5]).toMatchObject({ token: "[Redacted]", job: { password: "[Redacted]" } });
  });

  it("redacts the errors an AggregateError holds (pino writes them as aggregateErrors)", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    // As Node's happy-eyeballs connect or Promise.any fail: the inner errors carry the fields.
    const inner = Object.assign(new Error("401 from upstream"), { config: { apiKey: SECRET } });
    log.error({ err: new AggregateError([inner], "all attempts failed") }, "aggregate");
    expect(out.text()).not.toContain(SECRET);
    expect(out.lines()[0]).toMatchObject({
      err: {
        type: "AggregateError",
        message: "all attempts failed",
        aggregateErrors: [{ message: "401 from upstream", config: { apiKey: "[Redacted]" } }],
      },
    });
  });

  it("logs a URL object without its credentials, and without throwing", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    // A URL's `password` getter, read off a copy by the `*.password` redact path, threw
    // "Cannot read private member"; and its JSON (its href) carried the credentials.
    const url = () => new URL(`redis://fleet:${SECRET}@redis.internal:6379/0?api_key=${SECRET}&db=0`);
    expect(() => log.info({ target: url() }, "top")).not.toThrow();
    log.info({ conn: { target: url() } }, "nested");
    expect(out.text()).not.toContain(SECRET);
    expect(out.lines().map((l) => l.msg)).toEqual(["top", "nested"]);
    expect(out.lines()[1]).toMatchObject({
      conn: { target: "redis://[Redacted]@redis.internal:6379/0?api_key=[Redacted]&db=0" },
    });
  });

  it("redacts class instances at any depth and URL strings with credentials", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    class RedisOptions {
      constructor(
        readonly host: string,
        readonly password: string,
      ) {}
    }
    class Upstream {
      readonly apiKey = SECRET;
      readonly options = new RedisOptions("redis.internal", SECRET);
    }
    log.info({ job: { upstream: new Upstream() } }, "instances");
    log.info({ redisUrl: `redis://fleet:${SECRET}@redis.internal:6379/0` }, "url string");
    expect(out.text()).not.toContain(SECRET);
    expect(out.lines()[0]).toMatchObject({
      job: {
        upstream: { apiKey: "[Redacted]", options: { host: "redis.internal", password: "[Redacted]" } },
      },
    });
    expect(out.lines()[1]).toMatchObject({ redisUrl: "redis://[Redacted]@redis.internal:6379/0" });
  });

  it("hands a class instance to the serializer a child added for its field (Fastify's req), as it is", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    // As a Fastify request: what its serializer reads comes from getters on its prototype.
    class Request {
      constructor(readonly raw: { method: string; url: string }) {}
      get method() {
        return this.raw.method;
      }
      get url() {
        return this.raw.url;
      }
    }
    const serializers = { req: (req: Request) => ({ method: req.method, url: req.url }) };
    // Fastify makes its child once, then a child of that per request.
    const request = log.child({}, { serializers }).child({ reqId: "req-1" });
    request.info({ req: new Request({ method: "GET", url: "/v1/x" }) }, "incoming request");
    expect(out.lines()[0]).toMatchObject({ reqId: "req-1", req: { method: "GET", url: "/v1/x" } });
  });

  it("redacts URL credentials in messages, error messages and stacks, and what a serializer wrote (Fastify's req.url)", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    log.error(`connect to https://fleet:${SECRET}@redis.internal:6379 failed`);
    log.error({ err: new Error(`GET https://api.example.com/v1?api_key=${SECRET} refused`) }, "upstream");
    // As Fastify's request serializer and its 404 line: the request target, query and all.
    const serializers = {
      req: (req: { method: string; url: string }) => ({ method: req.method, url: req.url }),
    };
    const request = log.child({}, { serializers }).child({ reqId: "req-1" });
    request.error(
      { req: { method: "GET", url: `/v1/batches/b1/results?token=${SECRET}` } },
      "request errored",
    );
    request.info(`Route GET:/nope?access_token=${SECRET}&x=1 not found`);
    expect(out.text()).not.toContain(SECRET);
    const lines = out.lines();
    expect(lines.map((l) => l.msg)).toEqual([
      "connect to https://[Redacted]@redis.internal:6379 failed",
      "upstream",
      "request errored",
      "Route GET:/nope?access_token=[Redacted]&x=1 not found",
    ]);
    expect(lines[1]).toMatchObject({
      err: { message: "GET https://api.example.com/v1?api_key=[Redacted] refused" },
    });
    expect(lines[2]).toMatchObject({
      req: { method: "GET", url: "/v1/batches/b1/results?token=[Redacted]" },
    });
  });

  it("keeps count fields whose names merely contain a secret word", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    log.info({ usage: { promptTokens: 12, completionTokens: 3 }, tokenCount: 15 }, "usage");
    expect(out.lines()[0]).toMatchObject({
      usage: { promptTokens: 12, completionTokens: 3 },
      tokenCount: 15,
    });
  });

  it("does not mutate the logged object", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    const obj = { model: { apiKey: SECRET } };
    log.info(obj, "x");
    expect(obj.model.apiKey).toBe(SECRET);
  });

  it("scrubs known secret values from messages and free-form fields, including ones added later", () => {
    const out = sink();
    const secrets = new Set<string>();
    const log = createLogger({ name: "t", destination: out.stream, secrets });
    secrets.add(SECRET);
    secrets.add('pa"ss\\word');
    log.info({ stderr: `curl: 401 for key ${SECRET}` }, `calling with ${SECRET}`);
    log.info({ note: 'quoted pa"ss\\word here' }, "escaped");
    expect(out.text()).not.toContain(SECRET);
    expect(out.text()).not.toContain(JSON.stringify('pa"ss\\word').slice(1, -1));
    expect(out.lines()[0]).toMatchObject({ msg: "calling with [Redacted]" });
    // A part of one an upstream quoted back (a key it refused), added later still.
    const key = "sk-live-0123456789abcdefghij";
    secrets.add(key);
    log.warn(`upstream said: Incorrect API key provided. Partial: ${key.slice(0, 16)}`);
    expect(out.text()).not.toContain(key.slice(0, 16));
  });

  it("logs a Redis error's command by name only, never its arguments (a whole task)", () => {
    const out = sink();
    const log = createLogger({ name: "t", destination: out.stream });
    const err = Object.assign(new Error("OOM command not allowed when used memory > 'maxmemory'."), {
      command: { name: "set", args: ["{fleet}:x:task:abc", "x".repeat(200_000), "NX"] },
    });
    log.error({ err }, "request failed");
    log.error({ err: new Error(`bad: ${"y".repeat(50_000)}`) }, "long message");
    const [first, second] = out.lines() as Array<{ err: { command?: unknown; message: string } }>;
    expect(first!.err.command).toEqual({ name: "set" });
    expect(out.text().length).toBeLessThan(30_000);
    expect(second!.err.message.length).toBeLessThan(5_000);
  });

  it("honours the level", () => {
    const out = sink();
    const log = createLogger({ name: "t", level: "warn", destination: out.stream });
    log.info("hidden");
    log.warn("shown");
    expect(out.lines().map((l) => l.msg)).toEqual(["shown"]);
  });
});
