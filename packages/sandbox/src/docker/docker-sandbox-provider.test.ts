import { getEventListeners } from "node:events";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { afterEach, describe, expect, it } from "vitest";
import { DockerSandboxProvider } from "./docker-sandbox-provider.ts";

// A daemon on loopback HTTP that knows its facts and lists no container, and fails every
// container create (500): enough for a provider's calls to end at once, no Docker needed.
let server: Server | null = null;
async function daemon(hangs = false): Promise<number> {
  server = createServer((req, res) => {
    if (hangs) return; // takes the connection, never answers
    const [status, body] = req.url?.includes("/info")
      ? [200, { ID: "fake", MemTotal: 8 * 1024 ** 3 }]
      : req.url?.includes("/containers/json")
        ? [200, []]
        : [500, { message: "the daemon is out of sorts" }];
    res.writeHead(status, { "content-type": "application/json" });
    res.end(JSON.stringify(body));
  });
  await new Promise<void>((resolve) => server!.listen(0, "127.0.0.1", resolve));
  return (server.address() as AddressInfo).port;
}
afterEach(async () => {
  await new Promise((resolve) => server?.close(resolve) ?? resolve(undefined));
  server = null;
});

/**
 * What a signal holds of others: its "abort" listeners, and the signals `AbortSignal.any` made of
 * it (Node keeps those in a set of its own, under a symbol it does not export).
 */
function heldBy(signal: AbortSignal): number {
  const dependants = Object.getOwnPropertySymbols(signal).find((s) => s.description === "kDependantSignals");
  const set = dependants
    ? (signal as unknown as Record<symbol, Set<unknown> | undefined>)[dependants]
    : undefined;
  return getEventListeners(signal, "abort").length + (set?.size ?? 0);
}

describe("DockerSandboxProvider's API calls", () => {
  it("leave nothing on the long-lived signals they answer to once they end: a worker's shutdown signal given to its creates, the provider's own close", async () => {
    const provider = new DockerSandboxProvider({
      docker: { host: "127.0.0.1", port: await daemon(), protocol: "http" },
    });
    const shutdown = new AbortController();
    for (let i = 0; i < 50; i++) {
      const created = provider.create(
        { image: "fake:latest", rolloutId: `r${i}`, owner: "resources", expiresAt: Date.now() + 600_000 },
        { signal: shutdown.signal },
      );
      await expect(created).rejects.toMatchObject({ kind: "provider_unavailable", retryable: true });
      expect(await provider.list()).toEqual([]);
    }
    // A worker makes millions of calls in its life, each under both: anything each left (on
    // Node 20 `AbortSignal.any` leaves a weak reference on its sources for good) adds up.
    expect(heldBy(shutdown.signal)).toBe(0);
    expect(heldBy((provider as unknown as { closing: AbortController }).closing.signal)).toBe(0);
    await provider.close();
  });

  it("end at close, in flight or made after it, retryable (a worker's shutdown makes no failure final)", async () => {
    const provider = new DockerSandboxProvider({
      docker: { host: "127.0.0.1", port: await daemon(true), protocol: "http" },
    });
    const listed = provider.list().catch((err: unknown) => err);
    await new Promise((resolve) => server!.once("request", resolve));
    await provider.close();
    expect(await listed).toMatchObject({ kind: "provider_unavailable", retryable: true });
    await expect(provider.list()).rejects.toMatchObject({ kind: "provider_unavailable", retryable: true });
  });
});
