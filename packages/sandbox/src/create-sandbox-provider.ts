import { FleetError, type ProviderName } from "@fleet/contracts";
import type { Logger } from "@fleet/telemetry";
import type { DockerConnection } from "./docker/docker-endpoint.ts";
import { type DockerSandboxDefaults, DockerSandboxProvider } from "./docker/docker-sandbox-provider.ts";
import type { SandboxProvider } from "./provider.ts";

/** What an app's `main.ts` passes to pick and build its sandbox provider. */
export interface SandboxProviderConfig {
  provider: ProviderName;
  /** Docker daemon to use (`provider: "docker"`); `endpoint` takes `DOCKER_HOST` syntax. */
  docker?: DockerConnection;
  logger?: Logger;
  defaults?: Partial<DockerSandboxDefaults>;
  /** This fleet's name on a shared daemon (apps pass their key prefix); see `LABEL_SCOPE`. */
  scope?: string;
}

/**
 * The one wiring point that maps a provider name to an implementation. There is no host
 * fallback: a provider this build cannot offer is a final error, never "run it locally".
 */
export function createSandboxProvider(config: SandboxProviderConfig): SandboxProvider {
  switch (config.provider) {
    case "docker":
      return new DockerSandboxProvider({
        docker: config.docker,
        logger: config.logger,
        defaults: config.defaults,
        scope: config.scope,
      });
    case "bubblewrap":
      throw FleetError.nonRetryable(
        "invalid_task",
        "sandbox provider 'bubblewrap' is not available in this build; use FLEET_SANDBOX_PROVIDER=docker",
      );
    default:
      return assertNever(config.provider);
  }
}

function assertNever(x: never): never {
  throw FleetError.nonRetryable("invalid_task", `unknown sandbox provider: ${String(x)}`);
}
