import { isFleetError } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import {
  allowRule,
  type CommandRunner,
  gatewayChainName,
  IptablesGatewayFirewall,
  sealRules,
} from "./gateway-firewall.ts";

/** A tiny in-memory iptables: enough semantics for -N/-F/-X/-C/-I/-A/-D, per tool. */
function fakeIptables() {
  const tables = new Map<string, { chains: Set<string>; rules: string[][] }>();
  const calls: string[] = [];
  const state = (tool: string) => {
    let t = tables.get(tool);
    if (!t) {
      t = { chains: new Set(["INPUT", "FORWARD", "OUTPUT"]), rules: [] };
      tables.set(tool, t);
    }
    return t;
  };
  const same = (a: readonly string[], b: readonly string[]) => a.join(" ") === b.join(" ");
  const run: CommandRunner = async (tool, argsIn) => {
    calls.push(`${tool} ${argsIn.join(" ")}`);
    const args = [...argsIn];
    expect(args.shift()).toBe("-w");
    const op = args.shift()!;
    const t = state(tool);
    const ok = { code: 0, stderr: "" };
    switch (op) {
      case "-N":
        if (t.chains.has(args[0]!)) return { code: 1, stderr: "iptables: Chain already exists." };
        t.chains.add(args[0]!);
        return ok;
      case "-F":
        if (!t.chains.has(args[0]!))
          return { code: 1, stderr: "iptables: No chain/target/match by that name." };
        t.rules = t.rules.filter((r) => r[0] !== args[0]);
        return ok;
      case "-X":
        t.chains.delete(args[0]!);
        return ok;
      case "-C":
        return t.rules.some((r) => same(r, args)) ? ok : { code: 1, stderr: "Bad rule" };
      case "-I": {
        const [chain, _pos, ...spec] = args;
        const at = t.rules.findIndex((r) => r[0] === chain);
        t.rules.splice(at < 0 ? t.rules.length : at, 0, [chain!, ...spec]);
        return ok;
      }
      case "-A":
        t.rules.push(args);
        return ok;
      case "-D": {
        const i = t.rules.findIndex((r) => same(r, args));
        if (i < 0) return { code: 1, stderr: "Bad rule" };
        t.rules.splice(i, 1);
        return ok;
      }
      default:
        throw new Error(`unexpected ${op}`);
    }
  };
  return { run, calls, state };
}

describe("gateway firewall rules", () => {
  it("seal: the bridge's chain refuses everything; INPUT jumps to it; FORWARD drops both ways; IPv6 dropped", () => {
    const r = sealRules("fgw-0123456789a");
    expect(r.chain).toBe("FLEET-fgw-0123456789a");
    expect(r.chain.length).toBeLessThanOrEqual(28);
    expect(r.chainTail.at(-1)).toEqual([r.chain, "-j", "DROP"]);
    expect(r.ipv4).toContainEqual(["INPUT", "-i", "fgw-0123456789a", "-j", r.chain]);
    expect(r.ipv4).toContainEqual(["FORWARD", "-i", "fgw-0123456789a", "-j", "DROP"]);
    expect(r.ipv4).toContainEqual(["FORWARD", "-o", "fgw-0123456789a", "-j", "DROP"]);
    expect(r.ipv6).toContainEqual(["INPUT", "-i", "fgw-0123456789a", "-j", "DROP"]);
  });

  it("allow: exactly one destination IP and TCP port", () => {
    expect(allowRule("fgw-x", "172.18.0.1", 4000)).toEqual([
      gatewayChainName("fgw-x"),
      "-d",
      "172.18.0.1/32",
      "-p",
      "tcp",
      "--dport",
      "4000",
      "-j",
      "ACCEPT",
    ]);
    expect(() => allowRule("fgw-x", "0.0.0.0/0", 4000)).toThrow(RangeError);
    expect(() => allowRule("fgw-x", "172.18.0.1", 0)).toThrow(RangeError);
  });
});

describe("IptablesGatewayFirewall", () => {
  it("seals idempotently, keeps an allow rule above the refusals, and unseals everything", async () => {
    const fake = fakeIptables();
    const fw = new IptablesGatewayFirewall({ run: fake.run });
    await fw.seal("fgw-a");
    await fw.allow("fgw-a", "10.0.0.1", 8080);
    await fw.seal("fgw-a"); // a re-delivered ensure must not drop the allow rule or duplicate rules
    await fw.allow("fgw-a", "10.0.0.1", 8080);
    const chain = gatewayChainName("fgw-a");
    const v4 = fake.state("iptables").rules;
    expect(v4.filter((r) => r[0] === chain)).toEqual([
      allowRule("fgw-a", "10.0.0.1", 8080),
      [chain, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
      [chain, "-j", "DROP"],
    ]);
    expect(v4.filter((r) => r[0] !== chain)).toHaveLength(3);
    expect(fake.state("ip6tables").rules).toHaveLength(3);

    await fw.unseal("fgw-a");
    await fw.unseal("fgw-a");
    expect(fake.state("iptables").rules).toEqual([]);
    expect(fake.state("iptables").chains.has(chain)).toBe(false);
    expect(fake.state("ip6tables").rules).toEqual([]);
  });

  it("refuses (final isolation_refused) when iptables cannot run or fails", async () => {
    const missing = new IptablesGatewayFirewall({
      run: async () => {
        throw Object.assign(new Error("spawn iptables ENOENT"), { code: "ENOENT" });
      },
    });
    const err1 = await missing.seal("fgw-a").catch((e: unknown) => e);
    expect(isFleetError(err1) && err1.kind === "isolation_refused" && !err1.retryable).toBe(true);

    const denied = new IptablesGatewayFirewall({
      run: async (_tool, args) =>
        args[1] === "-C"
          ? { code: 1, stderr: "" }
          : { code: 4, stderr: "Permission denied (you must be root)" },
    });
    const err2 = await denied.seal("fgw-a").catch((e: unknown) => e);
    expect(isFleetError(err2) && err2.kind === "isolation_refused").toBe(true);
    expect((err2 as Error).message).toMatch(/Permission denied/);
  });

  it("an iptables stopped on its timeout, or kept off a busy xtables lock, is retryable, not a refusal", async () => {
    const stopped = new IptablesGatewayFirewall({
      run: async () => {
        throw Object.assign(new Error("Command failed: iptables -w -N"), {
          killed: true,
          signal: "SIGTERM",
          code: null,
        });
      },
    });
    const err1 = await stopped.seal("fgw-a").catch((e: unknown) => e);
    expect(isFleetError(err1) && [err1.kind, err1.retryable]).toEqual(["provider_unavailable", true]);

    const locked = new IptablesGatewayFirewall({
      run: async () => ({
        code: 4,
        stderr: "Another app is currently holding the xtables lock. Stopped waiting after 10s.",
      }),
    });
    const err2 = await locked.seal("fgw-a").catch((e: unknown) => e);
    expect(isFleetError(err2) && [err2.kind, err2.retryable]).toEqual(["provider_unavailable", true]);
  });
});
