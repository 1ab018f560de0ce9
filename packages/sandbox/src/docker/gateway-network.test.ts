import { describe, expect, it } from "vitest";
import { LABEL_MANAGED } from "../provider.ts";
import {
  buildGatewayNetworkConfig,
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
