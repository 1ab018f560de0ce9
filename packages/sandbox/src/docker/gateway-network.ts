/// <reference path="./dockerode.d.ts" />
import { createHash } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { FleetError, isFleetError } from "@fleet/contracts";
import type Dockerode from "dockerode";
import {
  LABEL_INSTANCE,
  LABEL_MANAGED,
  LABEL_ROLLOUT,
  LABEL_SCOPE,
  madeByAnotherInstance,
} from "../provider.ts";
import { dockerSafeId, scopeTag } from "./container-config.ts";
import { dockerClient } from "./docker-client.ts";
import { type DockerConnection, resolveDockerConnection } from "./docker-endpoint.ts";
import { dockerErrorFacts } from "./docker-errors.ts";
import { type GatewayFirewall, IptablesGatewayFirewall } from "./gateway-firewall.ts";

/** Tries of a bridge's unseal once its network is gone (a busy xtables lock is retryable), 250 ms apart and growing. */
const UNSEAL_ATTEMPTS = 4;
const UNSEAL_BACKOFF_MS = 250;

/** Label marking a network as a rollout's gateway network (value `gateway`). */
export const LABEL_NETWORK = "fleet.network";

/** A rollout's internal network on which its sandbox reaches the model gateway, and only that. */
export interface GatewayNetwork {
  /** Docker network name; pass it as the sandbox spec's `network`. */
  name: string;
  id: string;
  rolloutId: string;
  /** Host-side bridge interface (`fgw-<11 hex>`). */
  bridge: string;
  subnet: string;
  /** The host's address on the bridge: the gateway listens here. */
  gatewayIp: string;
}

/**
 * `fleet-gw-<rolloutId>`, or with a scope `fleet-gw-<scopeTag>-<rolloutId>` (distinct per fleet,
 * as sandbox names are); sanitised + hashed like sandbox names when needed.
 */
export function gatewayNetworkName(rolloutId: string, scope?: string): string {
  return `${scope ? `fleet-gw-${scopeTag(scope)}-` : "fleet-gw-"}${dockerSafeId(rolloutId)}`;
}

/** The bridge interface of a gateway network: `fgw-` + 11 hex chars (Linux allows 15). */
export function gatewayBridgeName(networkName: string): string {
  return `fgw-${shortHash(networkName, 11)}`;
}

function shortHash(text: string, chars: number): string {
  return createHash("sha256").update(text).digest("hex").slice(0, chars);
}

/** Where explicit subnets come from, instead of Docker's default pools (about 30 networks). */
export interface SubnetPool {
  /** An IPv4 CIDR reserved for gateway networks, e.g. `10.213.0.0/16`. */
  base: string;
  /** Prefix length of each network. @defaultValue 28 (16 addresses: gateway + sandboxes) */
  prefix?: number;
}

function ipToInt(ip: string): number {
  const parts = ip.split(".").map(Number);
  if (parts.length !== 4 || parts.some((p) => !Number.isInteger(p) || p < 0 || p > 255)) {
    throw new RangeError(`not an IPv4 address: ${ip}`);
  }
  return ((parts[0]! << 24) | (parts[1]! << 16) | (parts[2]! << 8) | parts[3]!) >>> 0;
}

function intToIp(n: number): string {
  return [n >>> 24, (n >>> 16) & 255, (n >>> 8) & 255, n & 255].join(".");
}

/**
 * The `index`-th subnet of a pool and its gateway (first host address). Pure.
 * @throws RangeError for an invalid pool.
 */
export function poolSubnet(
  pool: SubnetPool,
  index: number,
): { subnet: string; gateway: string; count: number } {
  const [baseIp, baseBits] = pool.base.split("/");
  const bits = Number(baseBits);
  const prefix = pool.prefix ?? 28;
  if (!Number.isInteger(bits) || bits < 8 || bits > 30)
    throw new RangeError(`invalid subnet pool: ${pool.base}`);
  if (!Number.isInteger(prefix) || prefix < bits || prefix > 29) {
    throw new RangeError(`invalid subnet prefix /${prefix} for pool ${pool.base}`);
  }
  const count = 2 ** (prefix - bits);
  const base = (ipToInt(baseIp ?? "") & ~(2 ** (32 - bits) - 1)) >>> 0;
  const start = (base + (((index % count) + count) % count) * 2 ** (32 - prefix)) >>> 0;
  return { subnet: `${intToIp(start)}/${prefix}`, gateway: intToIp(start + 1), count };
}

/** The Docker create request of a gateway network (pure). */
export function buildGatewayNetworkConfig(
  rolloutId: string,
  ipam?: { subnet: string; gateway: string },
  /** This fleet's name on a shared daemon (`LABEL_SCOPE`), as on its sandboxes. */
  scope?: string,
  /** This deployment's id (`LABEL_INSTANCE`), as on its sandboxes. */
  instance?: string,
): Dockerode.NetworkCreateOptions {
  const name = gatewayNetworkName(rolloutId, scope);
  return {
    Name: name,
    Driver: "bridge",
    Internal: true,
    CheckDuplicate: true,
    EnableIPv6: false,
    Attachable: false,
    Labels: {
      [LABEL_MANAGED]: "true",
      [LABEL_ROLLOUT]: rolloutId,
      [LABEL_NETWORK]: "gateway",
      ...(scope ? { [LABEL_SCOPE]: scope } : {}),
      ...(instance ? { [LABEL_INSTANCE]: instance } : {}),
    },
    Options: {
      "com.docker.network.bridge.name": gatewayBridgeName(name),
      // What Docker can enforce itself when it runs with iptables; our firewall covers the rest.
      "com.docker.network.bridge.enable_icc": "false",
      "com.docker.network.bridge.enable_ip_masquerade": "false",
    },
    ...(ipam === undefined
      ? {}
      : { IPAM: { Driver: "default", Config: [{ Subnet: ipam.subnet, Gateway: ipam.gateway }] } }),
  };
}

export interface DockerGatewayNetworksOptions {
  /** The Docker daemon, which must run on this host (the firewall and gateway are local). */
  docker?: DockerConnection;
  /** @defaultValue a new `IptablesGatewayFirewall()` */
  firewall?: GatewayFirewall;
  /** Explicit subnets for gateway networks. @defaultValue Docker's default address pools */
  subnetPool?: SubnetPool;
  /** Budget of one Docker API call. @defaultValue 30_000 */
  apiTimeoutMs?: number;
  /**
   * This fleet's name on a shared daemon (`LABEL_SCOPE`, as the sandbox provider's): set on every
   * network made, and `list` (the janitor's sweep) sees only those, never another fleet's.
   */
  scope?: string;
  /**
   * This deployment's id (`LABEL_INSTANCE`, as the sandbox provider's): set on every network made,
   * and each network `list` gives says whether it is another deployment's (a fleet with the same
   * scope and its own Redis; or this one's before its Redis lost its data).
   */
  instance?: string;
}

/**
 * Per-rollout internal networks through which a sandbox reaches the model gateway (running in
 * the worker, bound on the network's host-side IP) and nothing else:
 *
 * 1. `ensure(rolloutId)` seals the bridge in the host firewall (everything refused), *then*
 *    creates the internal network (`Internal: true`, `fleet.managed=true`), so there is never a
 *    moment the bridge is open; a re-delivered ensure adopts the existing network.
 * 2. Create the sandbox with `network: net.name`; start the gateway on `net.gatewayIp`.
 * 3. `allowGateway(net, port)` opens exactly `gatewayIp:port` (TCP) on that bridge.
 * 4. `remove(rolloutId)` after the sandbox is destroyed: removes the network, then its rules.
 *
 * One network per rollout: sandboxes of different rollouts never share a bridge.
 */
export class DockerGatewayNetworks {
  private readonly docker: Dockerode;
  readonly endpoint: string;
  private readonly firewall: GatewayFirewall;
  private readonly pool: SubnetPool | undefined;
  private readonly apiTimeoutMs: number;
  private readonly scope: string | undefined;
  private readonly instance: string | undefined;

  constructor(options: DockerGatewayNetworksOptions = {}) {
    const { options: dockerOptions, endpoint } = resolveDockerConnection(options.docker);
    this.endpoint = endpoint;
    this.docker = dockerClient(dockerOptions);
    this.firewall = options.firewall ?? new IptablesGatewayFirewall();
    this.pool = options.subnetPool;
    this.apiTimeoutMs = options.apiTimeoutMs ?? 30_000;
    this.scope = options.scope || undefined;
    this.instance = options.instance || undefined;
    if (this.pool) poolSubnet(this.pool, 0); // validate early
  }

  /** Seal, then create (or adopt) the rollout's gateway network. */
  async ensure(rolloutId: string): Promise<GatewayNetwork> {
    if (!this.endpoint.startsWith("unix://")) {
      throw FleetError.nonRetryable(
        "isolation_refused",
        `gateway networks need the Docker daemon on this host (a local unix socket), not ${this.endpoint}`,
      );
    }
    const name = gatewayNetworkName(rolloutId, this.scope);
    // Made by a version before names carried the scope (a rollout in flight across an upgrade,
    // its sandbox already on it): still the rollout's network, and the one its sandbox can reach.
    const legacy = await this.legacyNetwork(rolloutId);
    if (legacy) {
      // Sealed again (idempotent), as the scoped path does: rules a firewall reload lost come back.
      await this.firewall.seal(gatewayBridgeName(legacy.Name));
      return this.adopt(legacy, rolloutId);
    }
    await this.firewall.seal(gatewayBridgeName(name));
    const existing = await this.inspect(name);
    if (existing) return this.adopt(existing, rolloutId);
    const attempts = this.pool ? 32 : 1;
    const first = this.pool ? Number.parseInt(shortHash(rolloutId, 8), 16) : 0;
    for (let i = 0; i < attempts; i++) {
      const ipam = this.pool ? poolSubnet(this.pool, first + i) : undefined;
      try {
        await this.docker.createNetwork({
          ...buildGatewayNetworkConfig(rolloutId, ipam, this.scope, this.instance),
          abortSignal: this.signal(),
        });
        break;
      } catch (err) {
        const facts = dockerErrorFacts(err);
        if (facts.statusCode === 409 || /already exists/i.test(facts.message)) break; // a concurrent ensure
        if (this.pool && /overlap/i.test(facts.message) && i < attempts - 1) continue;
        throw this.classify(err, `create gateway network ${name}`);
      }
    }
    const created = await this.inspect(name);
    if (!created) {
      throw FleetError.retryable(
        "provider_unavailable",
        `gateway network ${name} vanished right after creation`,
      );
    }
    return this.adopt(created, rolloutId);
  }

  /** Open `gatewayIp:port` (TCP) on the network's bridge: the only thing its sandboxes may reach. */
  async allowGateway(network: GatewayNetwork, port: number): Promise<void> {
    await this.firewall.allow(network.bridge, network.gatewayIp, port);
  }

  /**
   * Remove the rollout's gateway network and then its firewall rules. Idempotent (`alreadyGone`
   * when there was no network). A network still holding a sandbox is a retryable
   * `provider_unavailable`: destroy the sandbox first. `name` is the network's as `list` gave it
   * (one made before names carried the scope); by default the one `ensure` makes.
   */
  async remove(rolloutId: string, name?: string): Promise<{ alreadyGone: boolean }> {
    if (name === undefined) {
      // By default the one `ensure` makes, and one made before names carried the scope.
      const legacy = await this.legacyNetwork(rolloutId);
      const removed = await this.remove(rolloutId, gatewayNetworkName(rolloutId, this.scope));
      if (!legacy) {
        // Neither network there (a retry): the one from before names carried the scope may be
        // gone with its rules left (its unseal failed after its removal), and nothing lists a
        // gone network again. Its bridge is unsealed too (a no-op where it had none), only then,
        // never while a network of that name is there (another fleet's, or one still in use).
        const legacyName = gatewayNetworkName(rolloutId);
        if (this.scope && removed.alreadyGone && !(await this.inspect(legacyName))) {
          await this.remove(rolloutId, legacyName);
        }
        return removed;
      }
      const old = await this.remove(rolloutId, legacy.Name);
      return { alreadyGone: removed.alreadyGone && old.alreadyGone };
    }
    let alreadyGone = false;
    try {
      await this.docker.getNetwork(name).remove({ abortSignal: this.signal() });
    } catch (err) {
      const facts = dockerErrorFacts(err);
      if (facts.statusCode === 404) alreadyGone = true;
      else throw this.classify(err, `remove gateway network ${name}`);
    }
    // Only once the bridge is gone: until then the rules keep it sealed. Tried a few times: with
    // the network gone, nothing lists this bridge again (the janitor sweeps networks), so rules
    // left now stay on the host for good.
    const bridge = gatewayBridgeName(name);
    for (let attempt = 1; ; attempt++) {
      try {
        await this.firewall.unseal(bridge);
        break;
      } catch (err) {
        if (attempt >= UNSEAL_ATTEMPTS || !isFleetError(err) || !err.retryable) throw err;
        await sleep(UNSEAL_BACKOFF_MS * attempt);
      }
    }
    return { alreadyGone };
  }

  /** Gateway networks on this daemon (for the janitor's sweep), with their rollout ids. */
  async list(): Promise<
    Array<{ name: string; id: string; rolloutId: string; createdAt: number; otherInstance: boolean }>
  > {
    let networks: Dockerode.NetworkInfo[];
    try {
      networks = await this.docker.listNetworks({
        filters: { label: [`${LABEL_MANAGED}=true`, `${LABEL_NETWORK}=gateway`] },
        abortSignal: this.signal(),
      });
    } catch (err) {
      throw this.classify(err, "list gateway networks");
    }
    // This fleet's, and those made before networks carried a scope (no label: nobody else
    // would ever sweep them). Docker's label filter cannot say "absent", so it is done here.
    const scope = this.scope;
    const ours = scope ? networks.filter((n) => (n.Labels?.[LABEL_SCOPE] ?? scope) === scope) : networks;
    return ours.map((n) => ({
      name: n.Name,
      id: n.Id,
      rolloutId: n.Labels?.[LABEL_ROLLOUT] ?? "",
      createdAt: Date.parse(n.Created) || 0,
      // Its rollout is in another Redis: the janitor leaves it to that fleet (see LABEL_INSTANCE).
      otherInstance: madeByAnotherInstance(n.Labels ?? {}, this.instance),
    }));
  }

  /**
   * The rollout's network under its name from before names carried the scope (`fleet-gw-<id>`),
   * when this fleet made it (its scope label); null otherwise, or for an unscoped fleet (whose
   * names never changed).
   */
  private async legacyNetwork(rolloutId: string): Promise<Dockerode.NetworkInspectInfo | null> {
    if (!this.scope) return null;
    const info = await this.inspect(gatewayNetworkName(rolloutId));
    const labels = info?.Labels ?? {};
    return info && labels[LABEL_ROLLOUT] === rolloutId && labels[LABEL_SCOPE] === this.scope ? info : null;
  }

  private async inspect(name: string): Promise<Dockerode.NetworkInspectInfo | null> {
    try {
      return await this.docker.getNetwork(name).inspect({ abortSignal: this.signal() });
    } catch (err) {
      if (dockerErrorFacts(err).statusCode === 404) return null;
      throw this.classify(err, `inspect gateway network ${name}`);
    }
  }

  private adopt(info: Dockerode.NetworkInspectInfo, rolloutId: string): GatewayNetwork {
    const labels = info.Labels ?? {};
    const bridge = info.Options?.["com.docker.network.bridge.name"];
    if (
      labels[LABEL_ROLLOUT] !== rolloutId ||
      labels[LABEL_NETWORK] !== "gateway" ||
      labels[LABEL_SCOPE] !== this.scope ||
      madeByAnotherInstance(labels, this.instance) ||
      !info.Internal ||
      bridge !== gatewayBridgeName(info.Name)
    ) {
      throw FleetError.nonRetryable(
        "isolation_refused",
        `network ${info.Name} exists but is not this rollout's sealed internal gateway network`,
      );
    }
    const config = info.IPAM?.Config?.[0];
    if (!config?.Subnet || !config.Gateway) {
      throw FleetError.retryable(
        "provider_unavailable",
        `gateway network ${info.Name} has no IPv4 subnet yet`,
      );
    }
    return {
      name: info.Name,
      id: info.Id,
      rolloutId,
      bridge,
      subnet: config.Subnet,
      gatewayIp: config.Gateway,
    };
  }

  private classify(err: unknown, what: string): FleetError {
    const facts = dockerErrorFacts(err);
    const detail = `${facts.statusCode === null ? (facts.code ?? "error") : `HTTP ${facts.statusCode}`}: ${facts.message}`;
    // Daemon unreachable / 5xx / an endpoint still attached: worth retrying. Other 4xx: final.
    // Address pools used up is capacity, not a bad request.
    if (
      facts.statusCode === null ||
      facts.statusCode >= 500 ||
      /active endpoints|non-overlapping|address pool|overlap/i.test(facts.message)
    ) {
      return FleetError.retryable("provider_unavailable", `docker: ${what} failed: ${detail}`, err);
    }
    return FleetError.nonRetryable("isolation_refused", `docker: ${what} rejected: ${detail}`, err);
  }

  private signal(): AbortSignal {
    return AbortSignal.timeout(this.apiTimeoutMs);
  }
}
