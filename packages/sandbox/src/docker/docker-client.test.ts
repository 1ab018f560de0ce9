import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { afterEach, describe, expect, it } from "vitest";
import { STILL_PENDING, settledWithin } from "../testing/index.ts";
import { dockerClient } from "./docker-client.ts";

// A daemon on loopback HTTP that answers the listing as `answer` says: whole, or cut after its
// headers and the start of its body.
let server: Server | null = null;
async function daemon(answer: "whole" | "cut"): Promise<number> {
  server = createServer((_req, res) => {
    const body = JSON.stringify([{ Id: "c1", Names: ["/c1"], Labels: {} }]);
    res.writeHead(200, { "content-type": "application/json", "content-length": String(body.length) });
    if (answer === "whole") res.end(body);
    else res.write(body.slice(0, 5), () => res.socket?.destroy());
  });
  await new Promise<void>((resolve) => server!.listen(0, "127.0.0.1", resolve));
  return (server.address() as AddressInfo).port;
}
afterEach(async () => {
  await new Promise((resolve) => server?.close(resolve) ?? resolve(undefined));
  server = null;
});

describe("dockerClient", () => {
  it("settles a call whose reply was cut after its headers when its abort signal fires, with the signal's reason", async () => {
    const docker = dockerClient({ host: "127.0.0.1", port: await daemon("cut"), protocol: "http" });
    const outcome = await settledWithin(
      docker.listContainers({ abortSignal: AbortSignal.timeout(1_000) }),
      10_000,
    );
    expect(outcome).not.toBe(STILL_PENDING);
    expect(outcome).toMatchObject({ err: { name: "TimeoutError" } });
  });

  it("settles a network's inspect too, whose signal dockerode passes only in its query options", async () => {
    const docker = dockerClient({ host: "127.0.0.1", port: await daemon("cut"), protocol: "http" });
    const inspected = docker.getNetwork("n1").inspect({ abortSignal: AbortSignal.timeout(1_000) });
    const outcome = await settledWithin(inspected, 10_000);
    expect(outcome).not.toBe(STILL_PENDING);
    expect(outcome).toMatchObject({ err: { name: "TimeoutError" } });
  });

  it("answers a whole reply as dockerode does, with a signal and without", async () => {
    const docker = dockerClient({ host: "127.0.0.1", port: await daemon("whole"), protocol: "http" });
    const listed = [{ Id: "c1", Names: ["/c1"], Labels: {} }];
    expect(await docker.listContainers({ abortSignal: AbortSignal.timeout(5_000) })).toEqual(listed);
    expect(await docker.listContainers({})).toEqual(listed);
  });
});
