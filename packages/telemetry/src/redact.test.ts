import { describe, expect, it } from "vitest";
import {
  MIN_SECRET_FRAGMENT,
  REDACTED,
  redactSecretFields,
  redactSecrets,
  redactUrlCredentials,
} from "./redact.ts";

describe("redactSecrets", () => {
  it("replaces every occurrence of each secret, longest first", () => {
    expect(redactSecrets("a=abc123 b=abc123 c=abc", ["abc", "abc123"])).toBe(
      `a=${REDACTED} b=${REDACTED} c=${REDACTED}`,
    );
  });

  it("ignores empty secrets and leaves text without secrets alone", () => {
    expect(redactSecrets("nothing here", ["", "zzz"])).toBe("nothing here");
  });

  it("also replaces a long enough part of a secret (an upstream quoting a key it refused), not a masked echo", () => {
    const key = "sk-OBSSECRET-1234567890abcdef";
    const echoed = `Incorrect API key provided: ${key}. Partial: ${key.slice(0, 18)}, tail ${key.slice(-12)}`;
    const fragments = { fragments: true };
    expect(redactSecrets(echoed, [key], REDACTED, fragments)).toBe(
      `Incorrect API key provided: ${REDACTED}. Partial: ${REDACTED}, tail ${REDACTED}`,
    );
    // Only when asked: text an agent sees back must not tell it which runs are the key's.
    expect(redactSecrets(echoed, [key])).toBe(
      `Incorrect API key provided: ${REDACTED}. Partial: ${key.slice(0, 18)}, tail ${key.slice(-12)}`,
    );
    // A masked echo, a few characters of it, and a fragment below the bound stay.
    const masked = `Incorrect API key provided: sk-OBS**********cdef; ${key.slice(3, 3 + MIN_SECRET_FRAGMENT - 1)}`;
    expect(redactSecrets(masked, [key], REDACTED, fragments)).toBe(masked);
    // Runs next to each other and text around them are kept apart; short secrets go whole.
    expect(
      redactSecrets(`x${key.slice(0, 12)}y${key.slice(10)}z abc`, [key, "abc"], REDACTED, fragments),
    ).toBe(`x${REDACTED}y${REDACTED}z ${REDACTED}`);
  });

  it("also replaces the JSON-escaped form", () => {
    const secret = 'a"b\\c';
    const json = JSON.stringify({ v: secret });
    expect(redactSecrets(json, [secret])).toBe(`{"v":"${REDACTED}"}`);
  });
});

describe("redactUrlCredentials", () => {
  it("redacts the credentials of a URL inside a longer text, and keeps the rest byte for byte", () => {
    expect(redactUrlCredentials("connect to https://u:p@host failed")).toBe(
      `connect to https://${REDACTED}@host failed`,
    );
    expect(
      redactUrlCredentials(
        "fetch HTTPS://ghp_abc123@github.com/o/r.git (and redis://:pw@10.0.0.1:6379/0), then https://Api.Example.com/x?limit=5&api_key=k1#top.",
      ),
    ).toBe(
      `fetch HTTPS://${REDACTED}@github.com/o/r.git (and redis://${REDACTED}@10.0.0.1:6379/0), then https://Api.Example.com/x?limit=5&api_key=${REDACTED}#top.`,
    );
    // A password holding an @ (the last @ of the authority ends the userinfo), on a new line.
    expect(redactUrlCredentials("error:\n  at amqp://fleet:p@ss@mq.internal/vh")).toBe(
      `error:\n  at amqp://${REDACTED}@mq.internal/vh`,
    );
    // A request target without a scheme (a logged req.url), a fragment parameter, an encoded name.
    expect(redactUrlCredentials("GET /v1/batches/b1/results?token=t0k&x=1 404")).toBe(
      `GET /v1/batches/b1/results?token=${REDACTED}&x=1 404`,
    );
    expect(redactUrlCredentials("https://h/cb#access_token=at1&state=s")).toBe(
      `https://h/cb#access_token=${REDACTED}&state=s`,
    );
    expect(redactUrlCredentials("https://h/?api%5Fkey=k2")).toBe(`https://h/?api%5Fkey=${REDACTED}`);
    // Already redacted text stays as it is.
    const once = redactUrlCredentials("https://u:p@h/?token=t");
    expect(redactUrlCredentials(once)).toBe(once);
  });

  it("redacts inside serialized JSON without breaking it, an escaped quote in a secret included", () => {
    const line = JSON.stringify({
      msg: 'redis connect to redis://fleet:pa"ss@redis:6379 failed',
      req: { url: '/v1/x?token=ab"cd&limit=5' },
    });
    const out = redactUrlCredentials(line);
    expect(JSON.parse(out)).toEqual({
      msg: `redis connect to redis://${REDACTED}@redis:6379 failed`,
      req: { url: `/v1/x?token=${REDACTED}&limit=5` },
    });
  });

  it("leaves text without URL credentials as it is", () => {
    const kept = [
      "see https://example.com/@user for a@b.c, ok?",
      "https://example.com/a@b?limit=5&tokenCount=3",
      "git@github.com:o/r.git",
      "what? 100% sure://@",
      "a=b c?d=e&promptTokens=7",
      "token=abc without a ? or & before it",
    ];
    for (const text of kept) expect(redactUrlCredentials(text)).toBe(text);
  });
});

describe("redactSecretFields", () => {
  it("handles cycles and leaves objects written by their own toJSON (a Date) alone", () => {
    const date = new Date(0);
    const obj: Record<string, unknown> = { when: date, password: "p" };
    obj.self = obj;
    const out = redactSecretFields(obj);
    expect(out.password).toBe(REDACTED);
    expect(out.when).toBe(date);
    expect(out.self).toBe(out);
  });

  it("redacts the common spellings of tokens and keys, and not counts that merely end in token", () => {
    const out = redactSecretFields({
      apiToken: "a",
      auth_token: "b",
      "Session-Token": "c",
      secretKey: "d",
      secret_access_key: "e",
      bearerToken: "f",
      sentinelPassword: "g",
      promptTokens: 12,
      maxTokens: 64,
    });
    expect(out).toEqual({
      apiToken: REDACTED,
      auth_token: REDACTED,
      "Session-Token": REDACTED,
      secretKey: REDACTED,
      secret_access_key: REDACTED,
      bearerToken: REDACTED,
      sentinelPassword: REDACTED,
      promptTokens: 12,
      maxTokens: 64,
    });
  });

  it("never passes a secret through below its depth limit: what it does not walk is cut, not kept", () => {
    let deep: Record<string, unknown> = { apiKey: "sk-deep", items: [{ token: "t-deep" }] };
    for (let i = 0; i < 15; i++) deep = { level: i, next: deep };
    const out = JSON.stringify(redactSecretFields(deep));
    expect(out).not.toContain("sk-deep");
    expect(out).not.toContain("t-deep");
    // The levels it walked are kept as they were.
    expect(out.startsWith('{"level":14,"next":{"level":13,')).toBe(true);
  });

  it("writes a URL as its href without credentials: userinfo and secret-named query values", () => {
    const out = redactSecretFields({
      git: new URL("https://ghp_abc123@github.com/o/r.git"),
      api: new URL("https://api.example.com/v1/x?Api-Key=k1&limit=5&access_token=k2#top"),
      plain: new URL("http://example.com:8080/a?b=c"),
      file: new URL("file:///tmp/x"),
      // An empty fragment, and credentials beside a secret query value.
      bare: new URL("https://u:p@example.com/p?token=t&x=1#"),
    });
    expect(out).toEqual({
      git: `https://${REDACTED}@github.com/o/r.git`,
      api: `https://api.example.com/v1/x?Api-Key=${REDACTED}&limit=5&access_token=${REDACTED}#top`,
      plain: "http://example.com:8080/a?b=c",
      file: "file:///tmp/x",
      bare: `https://${REDACTED}@example.com/p?token=${REDACTED}&x=1`,
    });
  });

  it("redacts the secret fields of class instances at any depth, as their JSON would write them", () => {
    class Options {
      constructor(
        readonly host: string,
        readonly password: string,
      ) {}
    }
    class Client {
      readonly options: Options;
      readonly apiToken = "tok-client";
      constructor(password: string) {
        this.options = new Options("redis.internal", password);
      }
    }
    const when = new Date(0);
    const out = redactSecretFields({
      top: new Client("pw-top"),
      job: { conn: { client: new Client("pw-deep") }, when },
      list: [[new Options("h", "pw-list")]],
    });
    const json = JSON.stringify(out);
    for (const secret of ["pw-top", "pw-deep", "pw-list", "tok-client"]) expect(json).not.toContain(secret);
    expect(out.job.conn.client).toEqual({
      options: { host: "redis.internal", password: REDACTED },
      apiToken: REDACTED,
    });
    // What JSON writes by its own toJSON (a Date, a Buffer) is kept as it is.
    expect(out.job.when).toBe(when);
  });

  it("writes a URL string without credentials, and leaves every other string as it is", () => {
    const kept = [
      "http://example.com:8080/a?b=c",
      "see https://example.com/@user for a@b.c, ok?",
      "https://example.com/a@b",
      "git@github.com:o/r.git",
      "what? 100% sure://@",
      "  https://example.com/x?limit=5  ",
    ];
    const out = redactSecretFields({
      redis: "redis://fleet:s3cret@redis.internal:6379/0",
      git: "https://ghp_abc123@github.com/o/r.git",
      api: ["https://api.example.com/v1/x?Api-Key=k1&limit=5#top"],
      sentinel: "redis-sentinel://u:p@s1:26379/m?sentinelPassword=sp1&sentinelUsername=w",
      kept,
    });
    expect(out).toEqual({
      redis: `redis://${REDACTED}@redis.internal:6379/0`,
      git: `https://${REDACTED}@github.com/o/r.git`,
      api: [`https://api.example.com/v1/x?Api-Key=${REDACTED}&limit=5#top`],
      sentinel: `redis-sentinel://${REDACTED}@s1:26379/m?sentinelPassword=${REDACTED}&sentinelUsername=w`,
      kept,
    });
  });

  it("redacts URL credentials inside a longer string field", () => {
    const out = redactSecretFields({
      reason: "connect to https://u:p@host failed",
      nested: [{ stderr: "curl: (22) https://api.example.com/v1?api_key=sk-1 returned 401" }],
    });
    expect(out).toEqual({
      reason: `connect to https://${REDACTED}@host failed`,
      nested: [{ stderr: `curl: (22) https://api.example.com/v1?api_key=${REDACTED} returned 401` }],
    });
  });

  it("keeps an error an error, with its message and cause", () => {
    const cause = new Error("inner");
    const err = Object.assign(new Error("outer", { cause }), { token: "t" });
    const out = redactSecretFields(err);
    expect(out).toBeInstanceOf(Error);
    expect(out.message).toBe("outer");
    expect(out.token).toBe(REDACTED);
    expect((out.cause as Error).message).toBe("inner");
  });
});
