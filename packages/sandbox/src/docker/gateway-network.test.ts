import { FleetError } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import { LABEL_MANAGED, LABEL_ROLLOUT, LABEL_SCOPE } from "../provider.ts";
import { MemoryGatewayFirewall } from "../testing/memory-firewall.ts";
import {
  buildGatewayNetworkConfig,
  DockerGatewayNetworks,
  gatewayBridgeName,
  gatewayNetworkName,
  LABEL_NETWORK,
  poolSubnet,
} from "./gateway-network.ts";

describe("gateway network naming and config", () => {
  it("names the network after the rollout and derives a valid bridge name", () => {
    expect(gatewayNetworkName("r-1")).toBe("fleet-gw-r-1");
    const odd = gatewayNetworkName("batch/7:row 3");
    expect(odd).toMatch(/^fleet-gw-batch_7_row_3-[0-9a-f]{12}$/);
    expect(gatewayNetworkName("batch/7:row 3")).toBe(odd);
    const bridge = gatewayBridgeName("fleet-gw-r-1");
    expect(bridge).toMatch(/^fgw-[0-9a-f]{11}$/);
    expect(bridge.length).toBeLessThanOrEqual(15);
    expect(gatewayBridgeName("fleet-gw-r-2")).not.toBe(bridge);
    // Per fleet with a scope, and so is the bridge.
    const scoped = gatewayNetworkName("r-1", "{fleet-a}");
    expect(scoped).toMatch(/^fleet-gw-s[0-9a-f]{8}-r-1$/);
    expect(gatewayNetworkName("r-1", "{fleet-b}")).not.toBe(scoped);
    expect(gatewayBridgeName(scoped)).not.toBe(bridge);
    expect(buildGatewayNetworkConfig("r-1", undefined, "{fleet-a}").Name).toBe(scoped);
  });

  it("builds an internal, labelled bridge network with our bridge name", () => {
    const c = buildGatewayNetworkConfig("r-1");
    expect(c).toMatchObject({ Name: "fleet-gw-r-1", Driver: "bridge", Internal: true, EnableIPv6: false });
    expect(c.Labels).toEqual({ [LABEL_MANAGED]: "true", "fleet.rollout": "r-1", [LABEL_NETWORK]: "gateway" });
    expect(c.Options?.["com.docker.network.bridge.name"]).toBe(gatewayBridgeName("fleet-gw-r-1"));
    expect(c.IPAM).toBeUndefined();
    const withIpam = buildGatewayNetworkConfig("r-1", { subnet: "10.9.0.16/28", gateway: "10.9.0.17" });
    expect(withIpam.IPAM?.Config).toEqual([{ Subnet: "10.9.0.16/28", Gateway: "10.9.0.17" }]);
    expect(buildGatewayNetworkConfig("r-1", undefined, "{fleet-a}").Labels).toMatchObject({
      "fleet.scope": "{fleet-a}",
    });
  });

  it("carves subnets from a pool, wrapping around", () => {
    const pool = { base: "10.213.0.0/16", prefix: 28 };
    expect(poolSubnet(pool, 0)).toEqual({ subnet: "10.213.0.0/28", gateway: "10.213.0.1", count: 4096 });
    expect(poolSubnet(pool, 1)).toMatchObject({ subnet: "10.213.0.16/28", gateway: "10.213.0.17" });
    expect(poolSubnet(pool, 4095)).toMatchObject({ subnet: "10.213.255.240/28" });
    expect(poolSubnet(pool, 4096)).toMatchObject({ subnet: "10.213.0.0/28" });
    expect(() => poolSubnet({ base: "10.0.0.0/16", prefix: 30 }, 0)).toThrow(RangeError);
    expect(() => poolSubnet({ base: "nope/16" }, 0)).toThrow(RangeError);
  });
});

describe("gateway network removal", () => {
  it("a retried removal of a rollout whose network from before names carried the scope was removed, its unseal failing, removes that network's rules: nothing else leads back to them", async () => {
    const scope = "{fleet-a}";
    const id = "r-legacy";
    const legacyName = gatewayNetworkName(id);
    const legacyBridge = gatewayBridgeName(legacyName);
    // The daemon's networks, in memory: this rollout's made by a release before names carried
    // the scope (labelled with it).
    const daemon = new Map<string, { Name: string; Labels: Record<string, string> }>([
      [legacyName, { Name: legacyName, Labels: { [LABEL_ROLLOUT]: id, [LABEL_SCOPE]: scope } }],
    ]);
    const notFound = () => Object.assign(new Error("no such network"), { statusCode: 404 });
    const docker = {
      getNetwork: (name: string) => ({
        inspect: async () => {
          const info = daemon.get(name);
          if (!info) throw notFound();
          return info;
        },
        remove: async () => {
          if (!daemon.delete(name)) throw notFound();
        },
      }),
    };
    // The host firewall: the legacy bridge's unseal fails (the xtables lock busy) until mended.
    let busy = true;
    const firewall = new MemoryGatewayFirewall();
    const unseal = firewall.unseal.bind(firewall);
    firewall.unseal = async (bridge: string) => {
      if (busy && bridge === legacyBridge)
        throw FleetError.nonRetryable("isolation_refused", "iptables -D failed");
      await unseal(bridge);
    };
    await firewall.seal(legacyBridge);
    const networks = new DockerGatewayNetworks({ scope, firewall });
    Object.assign(networks as unknown as { docker: unknown }, { docker });

    // Close's removal: the network goes, its rules stay (the janitor retries it by rollout).
    await expect(networks.remove(id)).rejects.toThrow("iptables -D failed");
    expect(daemon.has(legacyName)).toBe(false);
    expect([...firewall.sealed]).toEqual([legacyBridge]);
    // The janitor's retry, the firewall mended: the rules go, before the retry is marked done.
    busy = false;
    expect(await networks.remove(id)).toEqual({ alreadyGone: true });
    expect([...firewall.sealed]).toEqual([]);
  });
});
