import { mkdtempSync, rmSync } from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, describe, expect, it } from "vitest";
import { assertRedisDurable, createRedis } from "./connection.ts";
import { freeLoopbackPort, LocalRedisServer } from "./local-redis.ts";

describe("LocalRedisServer", () => {
  const started: LocalRedisServer[] = [];
  const dirs: string[] = [];
  const dir = () => {
    const d = mkdtempSync(join(tmpdir(), "fleet-local-redis-"));
    dirs.push(d);
    return d;
  };
  afterEach(async () => {
    await Promise.all(started.splice(0).map((s) => s.kill()));
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });

  it("starts durable as the fleet requires, keeps what it acknowledged through a crash and a relaunch on the same port", async () => {
    const server = await LocalRedisServer.start({ dir: dir() });
    started.push(server);
    const port = server.port;
    const r = createRedis(server.url);
    r.on("error", () => undefined);
    try {
      await expect(assertRedisDurable(r)).resolves.toBeUndefined();
      await r.set("k", "v");
    } finally {
      r.disconnect();
    }
    await server.kill("SIGKILL");
    expect(server.process).toBeNull();
    await server.relaunch();
    expect(server.port).toBe(port);
    const again = createRedis(server.url);
    try {
      expect(await again.get("k")).toBe("v");
    } finally {
      again.disconnect();
    }
  });

  it("its arguments win over the durable defaults", async () => {
    const server = await LocalRedisServer.start({ dir: dir(), args: ["--appendfsync", "everysec"] });
    started.push(server);
    const r = createRedis(server.url);
    try {
      await expect(assertRedisDurable(r)).rejects.toThrow(/appendfsync is "everysec"/);
    } finally {
      r.disconnect();
    }
  });

  it("does not take another process's server on its port for its own: a fixed port that is taken fails, saying so", async () => {
    const other = await LocalRedisServer.start({ dir: dir() });
    started.push(other);
    await expect(LocalRedisServer.start({ dir: dir(), port: other.port })).rejects.toThrow(
      new RegExp(`port ${other.port} was taken`),
    );
  });

  it("a fixed port held by something that is not Redis, and never answers, fails saying so (no hang)", async () => {
    const sockets = new Set<Socket>();
    const blocker: Server = createServer((socket) => {
      sockets.add(socket);
      socket.on("close", () => sockets.delete(socket));
    });
    const port = await freeLoopbackPort();
    await new Promise<void>((resolve) => blocker.listen(port, "127.0.0.1", resolve));
    try {
      await expect(LocalRedisServer.start({ dir: dir(), port, readyTimeoutMs: 30_000 })).rejects.toThrow(
        new RegExp(`port ${port} was taken`),
      );
    } finally {
      for (const socket of sockets) socket.destroy();
      await new Promise((r) => blocker.close(r));
    }
  });

  it("a server that cannot start fails at once with where to look, never a hang", async () => {
    const d = dir();
    await expect(
      LocalRedisServer.start({ dir: d, args: ["--no-such-option", "1"], readyTimeoutMs: 60_000 }),
    ).rejects.toThrow(/exited at start: .*no-such-option.*; see .*redis\.log/s);
  });
});
