import { type AgentSpec, FleetError, type Usage } from "@fleet/contracts";
import { startGateway, type UpstreamHealth } from "@fleet/gateway";
import type { GatewayNetwork } from "@fleet/sandbox";
import type { PipelineDeps } from "./deps.ts";

type CommandWithModel = Extract<AgentSpec, { harness: "command" }> & {
  model: NonNullable<Extract<AgentSpec, { harness: "command" }>["model"]>;
};

/** Does this agent's sandbox need the model gateway (and so a gateway network instead of none)? */
export function needsModelAccess(agent: AgentSpec): agent is CommandWithModel {
  return agent.harness === "command" && agent.model !== undefined;
}

/** The gateway network for a rollout whose agent needs one; refuses when the worker has none. */
export async function gatewayNetworkFor(deps: PipelineDeps, rolloutId: string): Promise<GatewayNetwork> {
  if (!deps.networks) {
    // No host fallback (rule 4): without a sealed network the sandbox gets no model access at all.
    throw FleetError.nonRetryable(
      "isolation_refused",
      "model access needs a gateway network, and this worker has none",
    );
  }
  return deps.networks.ensure(rolloutId);
}

export interface ModelAccess {
  /** Environment for the agent's command: an OpenAI-compatible base URL and a per-rollout token. */
  env: Record<string, string>;
  /**
   * Revoke the token and stop the gateway; the rollout's usage as the gateway recorded it, and
   * how the upstream fared (a run whose agent failed while the upstream was failing is masked).
   */
  finish(): Promise<{ usage: Usage; health: UpstreamHealth }>;
}

/**
 * Open model access for a command agent (issue: model gateway): a gateway on the rollout's
 * sealed network, forwarding to the agent's upstream with the real credential, which never enters
 * the sandbox. The sandbox sees only `OPENAI_BASE_URL` and an unguessable per-rollout token.
 */
export async function openModelAccess(
  deps: PipelineDeps,
  rolloutId: string,
  agent: CommandWithModel,
): Promise<ModelAccess> {
  const { model } = agent;
  if (!model.baseUrl)
    throw FleetError.nonRetryable("agent_error", "agent.model.baseUrl is required for model access");
  const resolve = deps.harnessDeps?.resolveCredential;
  if (!resolve) throw FleetError.nonRetryable("agent_error", "this worker cannot resolve credentials");
  // Fails early (final agent_error) when unknown or not bound to this upstream.
  const credential = await resolve(model.credential, model.baseUrl);
  const net = await gatewayNetworkFor(deps, rolloutId);
  const gateway = await startGateway({
    upstreamBaseUrl: model.baseUrl,
    resolveCredential: async () => credential,
    host: net.gatewayIp,
    ...(deps.gatewayMaxCallsPerMinute ? { maxCallsPerMinute: deps.gatewayMaxCallsPerMinute } : {}),
  });
  try {
    await deps.networks!.allowGateway(net, gateway.port);
    const grant = gateway.register(rolloutId, {
      model: model.name,
      maxCalls: model.maxCalls,
      maxTokens: model.maxTokens,
    });
    return {
      env: { OPENAI_BASE_URL: grant.baseUrl, OPENAI_API_KEY: grant.token, FLEET_MODEL: model.name },
      async finish() {
        const health = gateway.health(grant.token)!;
        const usage = gateway.revoke(grant.token);
        await gateway.close();
        return { usage, health };
      },
    };
  } catch (err) {
    await gateway.close();
    throw err;
  }
}
