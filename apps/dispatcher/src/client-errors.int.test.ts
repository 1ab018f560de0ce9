import { connect } from "node:net";
import { createRedis } from "@fleet/queue";
import type { Redis } from "ioredis";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { startTestServer, type TestServer } from "./test-server.ts";

/**
 * What Node's HTTP parser refuses before Fastify sees a request gets the API's one error body
 * too, on a real listening socket (inject never reaches the parser).
 */
const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";

/** Send raw bytes; the whole answer, once the server closes the connection. */
function raw(port: number, request: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, "127.0.0.1", () => socket.write(request));
    let answer = "";
    socket.on("data", (c: Buffer) => (answer += c.toString("utf8")));
    socket.on("close", () => resolve(answer));
    socket.on("error", reject);
  });
}

function parse(answer: string): { status: number; body: unknown } {
  const [head = "", body = ""] = answer.split("\r\n\r\n");
  return { status: Number(head.split(" ")[1]), body: JSON.parse(body) };
}

describe("HTTP the parser refuses", () => {
  let redis: Redis;
  let server: TestServer;
  let port: number;
  beforeAll(async () => {
    redis = createRedis(REDIS_URL);
    server = await startTestServer(redis, "client-errors");
    await server.app.listen({ host: "127.0.0.1", port: 0 });
    port = (server.app.server.address() as { port: number }).port;
  });
  afterAll(async () => {
    await server?.close();
    await redis?.quit();
  });

  it("answers headers too large (431) and a request that is not HTTP (400) with the API's error body", async () => {
    const big = await raw(
      port,
      `GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ${"a".repeat(64 * 1024)}\r\n\r\n`,
    );
    expect(parse(big)).toEqual({
      status: 431,
      body: { error: { code: "malformed", message: "the request's headers are too large", details: null } },
    });
    const junk = await raw(port, "NOT HTTP AT ALL\r\n\r\n");
    expect(parse(junk)).toEqual({
      status: 400,
      body: { error: { code: "malformed", message: "the request is not valid HTTP", details: null } },
    });
  });
});
