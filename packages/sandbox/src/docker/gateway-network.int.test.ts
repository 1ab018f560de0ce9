import { randomUUID } from "node:crypto";
import { FleetError, isFleetError } from "@fleet/contracts";
import Dockerode from "dockerode";
import { afterAll, describe, expect, it } from "vitest";
import { MemoryGatewayFirewall } from "../testing/memory-firewall.ts";
import {
  buildGatewayNetworkConfig,
  DockerGatewayNetworks,
  gatewayBridgeName,
  gatewayNetworkName,
} from "./gateway-network.ts";

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

  /**
   * Make rollout `id`'s network as the version before scoped names did (`fleet-gw-<id>`, its
   * bridge named after it), labelled with `scope`; removed after the tests.
   */
  async function createLegacyNetwork(id: string, scope: string): Promise<{ name: string; bridge: string }> {
    const name = gatewayNetworkName(id);
    const bridge = gatewayBridgeName(name);
    const config = buildGatewayNetworkConfig(id, undefined, scope);
    made.push(name);
    await docker.createNetwork({
      ...config,
      Name: name,
      Options: { ...config.Options, "com.docker.network.bridge.name": bridge },
    });
    return { name, bridge };
  }

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
    // Another deployment with this scope (its own Redis): its networks are listed as such (the
    // janitor leaves them to it); those made before networks carried an instance are this one's.
    const other = buildGatewayNetworkConfig(`gwd-${run}`, undefined, mine, "other-deployment");
    await docker.createNetwork(other);
    made.push(other.Name);
    const listed = async (instance: string) =>
      (await new DockerGatewayNetworks({ scope: mine, instance }).list())
        .filter((n) => n.rolloutId.endsWith(run))
        .map((n) => `${n.rolloutId}${n.otherInstance ? " (another's)" : ""}`)
        .sort();
    expect(await listed("this-deployment")).toEqual([`gwa-${run}`, `gwc-${run}`, `gwd-${run} (another's)`]);
    expect(await listed("other-deployment")).toEqual([`gwa-${run}`, `gwc-${run}`, `gwd-${run}`]);
  });

  it("two fleets' networks for a rollout id they share are distinct: neither adopts nor removes the other's", async () => {
    // Rollout ids derive from idempotency keys, so two fleets given the same key share them.
    const run = randomUUID().slice(0, 8);
    const [scopeA, scopeB] = [`{a-${run}}`, `{b-${run}}`];
    const fleetA = new DockerGatewayNetworks({ scope: scopeA });
    const fleetB = new DockerGatewayNetworks({ scope: scopeB });
    const id = `gws-${run}`;
    made.push(gatewayNetworkName(id, scopeA), gatewayNetworkName(id, scopeB));
    try {
      const a = await fleetA.ensure(id);
      const b = await fleetB.ensure(id);
      expect(b.name).not.toBe(a.name);
      expect(b.id).not.toBe(a.id);
      expect(b.bridge).not.toBe(a.bridge);
      expect((await fleetB.ensure(id)).id).toBe(b.id); // a re-delivered ensure still finds its own
      expect(await fleetB.remove(id)).toEqual({ alreadyGone: false });
      expect((await docker.getNetwork(a.name).inspect()).Id).toBe(a.id);
    } finally {
      await fleetA.remove(id);
      await fleetB.remove(id);
    }

    // A sealed internal network under this fleet's name, but another fleet's: refused, left alone.
    const other = `gwt-${run}`;
    const config = buildGatewayNetworkConfig(other, undefined, scopeB);
    made.push(config.Name!);
    const foreign = await docker.createNetwork({
      ...config,
      Labels: { ...config.Labels, "fleet.scope": scopeA },
    });
    try {
      const err = await fleetB.ensure(other).then(
        () => null,
        (e: unknown) => e,
      );
      expect(isFleetError(err) && [err.kind, err.retryable]).toEqual(["isolation_refused", false]);
      expect((await foreign.inspect()).Id).toBe(foreign.id);
    } finally {
      await fleetB.remove(other); // the network (by name) and the seal its ensure put on the bridge
    }
  });

  it("an unseal that meets a busy xtables lock after the network is gone is tried again, not left on the host for good", async () => {
    const run = randomUUID().slice(0, 8);
    const firewall = new MemoryGatewayFirewall();
    const { sealed } = firewall;
    let busy = 2;
    firewall.unsealFailure = () =>
      busy-- > 0
        ? FleetError.retryable("provider_unavailable", "iptables: the xtables lock stayed busy")
        : null;
    const networks = new DockerGatewayNetworks({ scope: `{unseal-${run}}`, firewall });
    const id = `gwl-${run}`;
    made.push(gatewayNetworkName(id, `{unseal-${run}}`));
    const net = await networks.ensure(id);
    expect([...sealed]).toEqual([net.bridge]);
    expect(await networks.remove(id)).toEqual({ alreadyGone: false });
    await expect(docker.getNetwork(net.name).inspect()).rejects.toMatchObject({ statusCode: 404 });
    expect(sealed.size).toBe(0);
    expect(busy).toBe(-1);
  });

  it("a rollout in flight across the upgrade keeps the network an earlier version made under its unscoped name", async () => {
    const run = randomUUID().slice(0, 8);
    const scope = `{u-${run}}`;
    const fleet = new DockerGatewayNetworks({ scope });
    const id = `gwu-${run}`;
    // What the version before scoped names made: `fleet-gw-<id>`, labelled with the scope.
    made.push(gatewayNetworkName(id, scope));
    const { name: legacyName } = await createLegacyNetwork(id, scope);
    try {
      // The sandbox seeded by the earlier version is on it: the gateway must listen there too.
      const net = await fleet.ensure(id);
      expect(net.name).toBe(legacyName);
      expect((await docker.listNetworks({ filters: { name: [gatewayNetworkName(id, scope)] } })).length).toBe(
        0,
      );
      // Close removes it by the rollout id alone.
      expect(await fleet.remove(id)).toEqual({ alreadyGone: false });
      await expect(docker.getNetwork(legacyName).inspect()).rejects.toMatchObject({ statusCode: 404 });
    } finally {
      await fleet.remove(id, legacyName).catch(() => undefined);
    }
  });

  it("a retried removal of a rollout whose network from before names carried the scope was removed, its unseal failing, removes that network's rules: nothing else leads back to them", async () => {
    const run = randomUUID().slice(0, 8);
    const scope = `{ul-${run}}`;
    const id = `gwr-${run}`;
    // This rollout's network as the version before scoped names made it (labelled with the scope).
    made.push(gatewayNetworkName(id, scope));
    const { name: legacyName, bridge: legacyBridge } = await createLegacyNetwork(id, scope);
    // The host firewall: the legacy bridge's unseal fails (an `iptables -D` refused) until mended.
    const firewall = new MemoryGatewayFirewall();
    await firewall.seal(legacyBridge);
    let broken = true;
    firewall.unsealFailure = (bridge) =>
      broken && bridge === legacyBridge
        ? FleetError.nonRetryable("isolation_refused", "iptables -D failed")
        : null;
    const networks = new DockerGatewayNetworks({ scope, firewall });
    // Close's removal: the network goes, its rules stay (the janitor retries it by rollout).
    await expect(networks.remove(id)).rejects.toThrow("iptables -D failed");
    await expect(docker.getNetwork(legacyName).inspect()).rejects.toMatchObject({ statusCode: 404 });
    expect([...firewall.sealed]).toEqual([legacyBridge]);
    // The janitor's retry, the firewall mended: the rules go before the retry is marked done.
    broken = false;
    expect(await networks.remove(id)).toEqual({ alreadyGone: true });
    expect([...firewall.sealed]).toEqual([]);
  });

  it("a retried removal whose network is gone leaves a network of the unscoped name that is not its own (another fleet's, for a rollout id they share), and its rules", async () => {
    const run = randomUUID().slice(0, 8);
    const id = `gwo-${run}`;
    // Another fleet's network under the name from before names carried the scope.
    const { name: legacyName, bridge: legacyBridge } = await createLegacyNetwork(id, `{theirs-${run}}`);
    const firewall = new MemoryGatewayFirewall();
    await firewall.seal(legacyBridge);
    const networks = new DockerGatewayNetworks({ scope: `{mine-${run}}`, firewall });
    // This fleet's network for the rollout is gone already (a retry): nothing of theirs is touched.
    expect(await networks.remove(id)).toEqual({ alreadyGone: true });
    expect((await docker.getNetwork(legacyName).inspect()).Name).toBe(legacyName);
    expect([...firewall.sealed]).toEqual([legacyBridge]);
  });

  it("with a subnet pool (FLEET_GATEWAY_SUBNET_POOL), each rollout's network gets a subnet of the pool, skipping one taken", async () => {
    const run = randomUUID().slice(0, 8);
    const scope = `{pool-${run}}`;
    const pool = { base: "10.213.77.0/24", prefix: 28 };
    const networks = new DockerGatewayNetworks({ scope, subnetPool: pool });
    const [a, b] = [`gpa-${run}`, `gpb-${run}`];
    made.push(gatewayNetworkName(a, scope), gatewayNetworkName(b, scope), `fleet-pool-squatter-${run}`);
    const inPool = (subnet: string) => {
      const [ip, bits] = subnet.split("/");
      expect(subnet.startsWith("10.213.77."), subnet).toBe(true);
      expect(Number(bits)).toBe(28);
      expect(Number(ip!.split(".")[3]) % 16).toBe(0);
    };
    const first = await networks.ensure(a);
    inPool(first.subnet);
    const other = await networks.ensure(b);
    inPool(other.subnet);
    expect(other.subnet).not.toBe(first.subnet);
    // Something else takes rollout A's subnet while its network is gone: the next ensure moves on.
    expect(await networks.remove(a)).toEqual({ alreadyGone: false });
    await docker.createNetwork({
      Name: `fleet-pool-squatter-${run}`,
      Internal: true,
      IPAM: { Config: [{ Subnet: first.subnet }] },
    });
    const again = await networks.ensure(a);
    inPool(again.subnet);
    expect(again.subnet).not.toBe(first.subnet);
    expect(again.subnet).not.toBe(other.subnet);
    await networks.remove(a);
    await networks.remove(b);
  });
});
