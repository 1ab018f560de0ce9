import { execFile } from "node:child_process";
import { createServer, type Server } from "node:net";
import { promisify } from "node:util";
import type { SandboxHandle } from "@fleet/contracts";
import { DockerGatewayNetworks, DockerSandboxProvider, type GatewayNetwork, ROOT_USER } from "@fleet/sandbox";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type ModelGateway, startGateway } from "./gateway.ts";
import { chatReply, type ScriptedUpstream, startScriptedUpstream } from "./testing/scripted-upstream.ts";

// A real sandbox on a real gateway network (Docker + iptables on this host) drives the gateway
// with python3's urllib. Only loopback and the network's internal bridge carry traffic.
const IMAGE = process.env.FLEET_BASE_IMAGE ?? "rollout-fleet/base:latest";
const ROLLOUT = `gwit${process.pid}${Date.now().toString(36)}`;
const CREDENTIAL = "sk-real-upstream-credential-abcdef123456";
const run = promisify(execFile);

// Scoped, sandboxes and networks alike: a janitor test sweeping unscoped (pre-scope) networks
// must never take this one.
const scope = `gateway-test-${process.pid}`;
const provider = new DockerSandboxProvider({ docker: { socketPath: "/var/run/docker.sock" }, scope });
const networks = new DockerGatewayNetworks({ docker: { socketPath: "/var/run/docker.sock" }, scope });

let net: GatewayNetwork;
let handle: SandboxHandle | undefined;
let upstream: ScriptedUpstream;
let gateway: ModelGateway;
const hostServers: Server[] = [];

/** A TCP server on the host that answers "<tag>" to anyone who connects. */
async function hostService(host: string, tag: string): Promise<number> {
  const server = createServer((socket) => socket.end(tag));
  hostServers.push(server);
  await new Promise<void>((resolve) => server.listen({ host, port: 0 }, resolve));
  return (server.address() as { port: number }).port;
}

const CLIENT = `
import json, os, sys, urllib.request, urllib.error
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
out = []
for i in range(int(sys.argv[1])):
    body = {"model": "anything", "messages": [{"role": "user", "content": "hello %d" % i}]}
    req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            out.append({"status": r.status, "body": json.loads(r.read())})
    except urllib.error.HTTPError as e:
        out.append({"status": e.code, "body": json.loads(e.read() or b"null")})
print(json.dumps(out))
`;

const PROBE = `
import json, os, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=3)
        s.settimeout(0.5)
        try: data = s.recv(16).decode()
        except Exception: data = ""
        s.close()
        out[target] = "open:" + data
    except Exception as e:
        out[target] = type(e).__name__
out["docker.sock"] = os.path.exists("/var/run/docker.sock")
print(json.dumps(out))
`;

async function inSandbox<T>(script: string, args: string[], env: Record<string, string> = {}): Promise<T> {
  const r = await provider.exec(handle!, ["python3", "-c", script, ...args], { deadlineMs: 60_000, env });
  expect(r.exitCode, r.stderr).toBe(0);
  return JSON.parse(r.stdout) as T;
}

type ProbeResult = Record<string, string | boolean>;
type ClientResult = Array<{
  status: number;
  body: { choices: Array<{ message: { content: string } }>; error: { code: string } };
}>;

beforeAll(async () => {
  upstream = await startScriptedUpstream();
  net = await networks.ensure(ROLLOUT);
  gateway = await startGateway({
    upstreamBaseUrl: upstream.baseUrl,
    resolveCredential: async () => CREDENTIAL,
    host: net.gatewayIp,
  });
  handle = await provider.create({
    image: IMAGE,
    rolloutId: ROLLOUT,
    owner: "resources",
    expiresAt: Date.now() + 600_000,
    network: net.name,
  });
});

afterAll(async () => {
  if (handle) await provider.destroy(handle);
  await gateway?.close();
  await upstream?.close();
  for (const s of hostServers) await new Promise<void>((resolve) => s.close(() => resolve()));
  await networks.remove(ROLLOUT);
});

describe("model gateway from inside a sandbox", () => {
  it("is unreachable until its port is allowed, then reachable while nothing else on the host is", async () => {
    const other = await hostService(net.gatewayIp, "other-service");
    const loop = await hostService("127.0.0.1", "loopback-service");
    const gw = `${net.gatewayIp}:${gateway.port}`;

    // Sealed by default: even the gateway is refused before allowGateway.
    const before = await inSandbox<ProbeResult>(PROBE, [gw]);
    expect(before[gw]).toBe("ConnectionRefusedError");

    await networks.allowGateway(net, gateway.port);
    await networks.ensure(ROLLOUT); // re-delivered ensure: same network, allow rule kept
    const targets = [
      gw,
      `${net.gatewayIp}:${other}`, // a host service on the very same address, another port
      `${net.gatewayIp}:${loop}`,
      `127.0.0.1:${loop}`, // the sandbox's loopback is its own
      `${net.gatewayIp}:2375`, // Docker API over TCP (plain and TLS ports)
      `${net.gatewayIp}:2376`,
      `${net.gatewayIp}:6379`, // Redis
    ];
    const after = await inSandbox<ProbeResult>(PROBE, targets);
    expect(after[gw]).toMatch(/^open:/);
    for (const t of targets.slice(1)) expect(after[t], t).not.toMatch(/^open/);
    expect(after[`${net.gatewayIp}:${other}`]).toBe("ConnectionRefusedError");
    expect(after["docker.sock"]).toBe(false);

    // The host itself does reach that service: the refusal above is the sandbox's, not a dead port.
    const fromHost = await new Promise<string>((resolve, reject) => {
      import("node:net").then(({ connect }) => {
        const s = connect({ host: net.gatewayIp, port: other }, () => undefined);
        s.on("data", (d) => resolve(d.toString()));
        s.on("error", reject);
      }, reject);
    });
    expect(fromHost).toBe("other-service");
  });

  it("serves chat completions, records usage, refuses past the token cap, and 401s after revoke", async () => {
    await networks.allowGateway(net, gateway.port);
    const { token, baseUrl } = gateway.register(ROLLOUT, { model: "qwen-test", maxTokens: 40 });
    upstream.push(
      chatReply({ content: "one", usage: { prompt: 12, completion: 8, cached: 4 } }),
      chatReply({ content: "two", usage: { prompt: 15, completion: 9, cached: 0 } }),
      chatReply({ content: "never" }),
    );
    const before = upstream.requests.length;
    const env = { OPENAI_BASE_URL: baseUrl, OPENAI_API_KEY: token };
    const results = await inSandbox<ClientResult>(CLIENT, ["3"], env);
    expect(results.map((r) => r.status)).toEqual([200, 200, 429]);
    expect(results[0]!.body.choices[0]!.message.content).toBe("one");
    expect(results[2]!.body.error.code).toBe("token_cap_exceeded");
    // 20 tokens after call 1 (< 40), 44 after call 2 (crossed): call 3 is refused, never forwarded.
    expect(upstream.requests.length - before).toBe(2);
    for (const r of upstream.requests.slice(before)) {
      expect(r.headers.authorization).toBe(`Bearer ${CREDENTIAL}`);
      expect((r.body as { model: string }).model).toBe("qwen-test");
    }
    expect(gateway.usage(token)).toEqual({
      calls: 2,
      promptTokens: 27,
      completionTokens: 17,
      cachedTokens: 4,
      gaps: [],
    });

    const summary = gateway.revoke(token);
    expect(summary.calls).toBe(2);
    const revoked = await inSandbox<ClientResult>(CLIENT, ["1"], env);
    expect(revoked[0]!.status).toBe(401);

    // The credential never reached the sandbox: not in its environment, not in what it received.
    const envDump = await provider.exec(
      handle!,
      ["sh", "-c", "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'"],
      {
        deadlineMs: 10_000,
        user: ROOT_USER,
      },
    );
    expect(envDump.stdout).not.toContain(CREDENTIAL);
    expect(JSON.stringify(results)).not.toContain(CREDENTIAL);
  });

  it("leaves no network and no firewall rule behind after remove", async () => {
    const id = `${ROLLOUT}-x`;
    const extra = await networks.ensure(id);
    await networks.allowGateway(extra, 4242);
    const rulesWith = (await run("iptables", ["-w", "-S"])).stdout;
    expect(rulesWith).toContain(extra.bridge);
    expect(await networks.remove(id)).toEqual({ alreadyGone: false });
    expect(await networks.remove(id)).toEqual({ alreadyGone: true });
    expect((await run("iptables", ["-w", "-S"])).stdout).not.toContain(extra.bridge);
    expect((await run("ip6tables", ["-w", "-S"])).stdout).not.toContain(extra.bridge);
    expect((await networks.list()).map((n) => n.name)).not.toContain(extra.name);
  });
});
