import { execFile } from "node:child_process";
import { capText, FleetError } from "@fleet/contracts";

/**
 * Host firewall for a gateway network's bridge: the sandboxes on it may open TCP connections to
 * the model gateway (one host IP and port) and to nothing else: no other host port, no routed
 * traffic beyond the bridge (so also no DNS forwarded by Docker's embedded resolver).
 *
 * Why a host firewall at all: Docker's `Internal: true` is enforced with iptables rules that
 * Docker itself installs; a daemon run with `--iptables=false` (as on this project's machines)
 * installs none, and even with them Docker never blocks a container from the host's own
 * addresses on the bridge, so every host service listening on 0.0.0.0 would be reachable.
 */
export interface GatewayFirewall {
  /** Deny all traffic from `bridge` to the host and through it. Idempotent; call before the bridge exists. */
  seal(bridge: string): Promise<void>;
  /** Allow TCP from `bridge` to `gatewayIp:port` (the gateway). Idempotent. */
  allow(bridge: string, gatewayIp: string, port: number): Promise<void>;
  /** Remove every rule for `bridge`. Idempotent. */
  unseal(bridge: string): Promise<void>;
}

/** The per-bridge iptables chain (names are at most 28 characters). */
export function gatewayChainName(bridge: string): string {
  return `FLEET-${bridge}`.slice(0, 28);
}

/** A rule as `iptables -C/-I/-A/-D` takes it: chain first, then the match and target. */
export type RuleSpec = readonly string[];

/** The rules `seal` guarantees (pure; unit-tested). */
export function sealRules(bridge: string): {
  chain: string;
  /** In the bridge's chain, in this order, at its end: anything not explicitly allowed is refused. */
  chainTail: RuleSpec[];
  /** In INPUT/FORWARD, at the top. */
  ipv4: RuleSpec[];
  ipv6: RuleSpec[];
} {
  const chain = gatewayChainName(bridge);
  return {
    chain,
    chainTail: [
      // A refused TCP connect fails fast (RST) instead of hanging; everything else is dropped.
      [chain, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
      [chain, "-j", "DROP"],
    ],
    ipv4: [
      ["INPUT", "-i", bridge, "-j", chain],
      ["FORWARD", "-i", bridge, "-j", "DROP"],
      ["FORWARD", "-o", bridge, "-j", "DROP"],
    ],
    ipv6: [
      ["INPUT", "-i", bridge, "-j", "DROP"],
      ["FORWARD", "-i", bridge, "-j", "DROP"],
      ["FORWARD", "-o", bridge, "-j", "DROP"],
    ],
  };
}

/** The one rule `allow` inserts at the top of the bridge's chain. */
export function allowRule(bridge: string, gatewayIp: string, port: number): RuleSpec {
  if (!/^\d{1,3}(\.\d{1,3}){3}$/.test(gatewayIp)) throw new RangeError(`not an IPv4 address: ${gatewayIp}`);
  if (!Number.isInteger(port) || port < 1 || port > 65535) throw new RangeError(`not a TCP port: ${port}`);
  return [
    gatewayChainName(bridge),
    "-d",
    `${gatewayIp}/32`,
    "-p",
    "tcp",
    "--dport",
    String(port),
    "-j",
    "ACCEPT",
  ];
}

/** Runs one iptables-family command; resolves with its exit code (0 = ok), rejects if it cannot run. */
export type CommandRunner = (
  file: string,
  args: readonly string[],
) => Promise<{ code: number; stderr: string }>;

const runCommand: CommandRunner = (file, args) =>
  new Promise((resolve, reject) => {
    execFile(file, [...args], { timeout: 15_000 }, (err, _stdout, stderr) => {
      if (err === null) return resolve({ code: 0, stderr: String(stderr) });
      const code = (err as { code?: unknown }).code;
      if (typeof code === "number") return resolve({ code, stderr: String(stderr) });
      reject(err);
    });
  });

export interface IptablesGatewayFirewallOptions {
  /** @defaultValue "iptables" */
  iptables?: string;
  /**
   * `null` skips the IPv6 rules: only for hosts where IPv6 is off in the kernel (a gateway
   * network never has IPv6 and Docker disables it in the container, but the rules are the proof).
   * @defaultValue "ip6tables"
   */
  ip6tables?: string | null;
  /** Test seam: how commands run. @defaultValue execFile */
  run?: CommandRunner;
}

/**
 * `GatewayFirewall` with iptables/ip6tables (legacy or nft backend) on the Docker host. Needs
 * root (or CAP_NET_ADMIN in the host network namespace). Anything it cannot do is a final
 * `isolation_refused`: a gateway network that is not sealed must not be used.
 */
export class IptablesGatewayFirewall implements GatewayFirewall {
  private readonly v4: string;
  private readonly v6: string | null;
  private readonly run: CommandRunner;

  constructor(options: IptablesGatewayFirewallOptions = {}) {
    this.v4 = options.iptables ?? "iptables";
    this.v6 = options.ip6tables === undefined ? "ip6tables" : options.ip6tables;
    this.run = options.run ?? runCommand;
  }

  async seal(bridge: string): Promise<void> {
    const rules = sealRules(bridge);
    const created = await this.exec(this.v4, ["-N", rules.chain]);
    if (created.code !== 0 && !/exists/i.test(created.stderr))
      this.refuse(`create chain ${rules.chain}`, created);
    for (const rule of rules.chainTail) await this.ensure(this.v4, rule, "-A");
    for (const rule of rules.ipv4) await this.ensure(this.v4, rule, "-I");
    if (this.v6 !== null) for (const rule of rules.ipv6) await this.ensure(this.v6, rule, "-I");
  }

  async allow(bridge: string, gatewayIp: string, port: number): Promise<void> {
    await this.ensure(this.v4, allowRule(bridge, gatewayIp, port), "-I");
  }

  async unseal(bridge: string): Promise<void> {
    const rules = sealRules(bridge);
    for (const rule of rules.ipv4) await this.deleteAll(this.v4, rule);
    if (this.v6 !== null) for (const rule of rules.ipv6) await this.deleteAll(this.v6, rule);
    const flushed = await this.exec(this.v4, ["-F", rules.chain]);
    if (flushed.code !== 0 && !/no chain|does not exist|not found/i.test(flushed.stderr)) {
      this.refuse(`flush chain ${rules.chain}`, flushed);
    }
    if (flushed.code === 0) {
      const removed = await this.exec(this.v4, ["-X", rules.chain]);
      if (removed.code !== 0) this.refuse(`delete chain ${rules.chain}`, removed);
    }
  }

  /** Add `rule` unless present (`-I` at the top of its chain, `-A` at the end). */
  private async ensure(tool: string, rule: RuleSpec, how: "-I" | "-A"): Promise<void> {
    const [chain, ...spec] = rule;
    const present = await this.exec(tool, ["-C", chain!, ...spec]);
    if (present.code === 0) return;
    const args = how === "-I" ? ["-I", chain!, "1", ...spec] : ["-A", chain!, ...spec];
    const added = await this.exec(tool, args);
    if (added.code !== 0) this.refuse(`${tool} ${args.join(" ")}`, added);
  }

  private async deleteAll(tool: string, rule: RuleSpec): Promise<void> {
    for (let i = 0; i < 16; i++) {
      const deleted = await this.exec(tool, ["-D", ...rule]);
      if (deleted.code !== 0) return;
    }
  }

  private async exec(tool: string, args: string[]): Promise<{ code: number; stderr: string }> {
    let result: { code: number; stderr: string };
    try {
      result = await this.run(tool, ["-w", ...args]);
    } catch (err) {
      const message = err instanceof Error ? err.message : String(err);
      const e = err as { killed?: unknown; signal?: unknown };
      if (e.killed === true || typeof e.signal === "string") {
        // Ran, and was stopped (its time ran out waiting on a busy xtables lock, say): the
        // host's load, not a host that cannot seal. Retried.
        throw FleetError.retryable("provider_unavailable", `${tool} did not finish: ${message}`, err);
      }
      throw FleetError.nonRetryable(
        "isolation_refused",
        `cannot run ${tool} to seal the gateway network (needs iptables and root on the Docker host): ${message}`,
        err,
      );
    }
    if (result.code === 4 && /xtables lock/i.test(result.stderr)) {
      // Another program held the lock throughout (`-w` waits; some builds give up): retried.
      throw FleetError.retryable(
        "provider_unavailable",
        `${tool}: the xtables lock stayed busy: ${capText(result.stderr.trim(), 300)}`,
      );
    }
    return result;
  }

  private refuse(what: string, result: { code: number; stderr: string }): never {
    throw FleetError.nonRetryable(
      "isolation_refused",
      `gateway network firewall: ${what} failed (exit ${result.code}): ${capText(result.stderr.trim(), 500)}`,
    );
  }
}
