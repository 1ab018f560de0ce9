import { randomUUID } from "node:crypto";
import Dockerode from "dockerode";
import { afterAll, describe, expect, it } from "vitest";
import { buildGatewayNetworkConfig, DockerGatewayNetworks } from "./gateway-network.ts";

const docker = new Dockerode();

describe("DockerGatewayNetworks on a shared daemon", () => {
  const made: string[] = [];
  afterAll(async () => {
    for (const name of made)
      await docker
        .getNetwork(name)
        .remove()
        .catch(() => undefined);
  });

  it("lists only its own fleet's gateway networks: the janitor never sweeps another fleet's", async () => {
    const run = randomUUID().slice(0, 8);
    const [mine, theirs] = [`{a-${run}}`, `{b-${run}}`];
    for (const [rolloutId, scope] of [
      [`gwa-${run}`, mine],
      [`gwb-${run}`, theirs],
      [`gwc-${run}`, undefined], // made before networks carried a scope: everyone's to sweep
    ] as const) {
      const config = buildGatewayNetworkConfig(rolloutId, undefined, scope);
      await docker.createNetwork(config);
      made.push(config.Name);
    }
    const ids = async (scope: string) =>
      (await new DockerGatewayNetworks({ scope }).list())
        .map((n) => n.rolloutId)
        .filter((id) => id.endsWith(run));
    expect((await ids(mine)).sort()).toEqual([`gwa-${run}`, `gwc-${run}`]);
    expect((await ids(theirs)).sort()).toEqual([`gwb-${run}`, `gwc-${run}`]);
  });
});
