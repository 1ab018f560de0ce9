import type { GatewayFirewall } from "../docker/gateway-firewall.ts";

/**
 * The host firewall, in memory: which bridges are sealed. `unsealFailure` is asked before each
 * unseal, with its bridge; an error it returns is thrown instead (a busy xtables lock, a failed
 * `iptables -D`).
 */
export class MemoryGatewayFirewall implements GatewayFirewall {
  readonly sealed = new Set<string>();
  unsealFailure: (bridge: string) => Error | null = () => null;

  async seal(bridge: string): Promise<void> {
    this.sealed.add(bridge);
  }
  async allow(): Promise<void> {}
  async unseal(bridge: string): Promise<void> {
    const failure = this.unsealFailure(bridge);
    if (failure) throw failure;
    this.sealed.delete(bridge);
  }
}
