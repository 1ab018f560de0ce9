import { FleetError, type ProviderName } from "@fleet/contracts";
import type { Logger } from "@fleet/telemetry";
import {
  type BubblewrapSandboxDefaults,
  BubblewrapSandboxProvider,
} from "./bubblewrap/bubblewrap-sandbox-provider.ts";
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
  /**
   * Where bubblewrap sandboxes come from (`provider: "bubblewrap"`): the unpacked base rootfs and
   * the state directory (`${FLEET_STATE_DIR:-/var/lib/rollout-fleet}/bwrap`).
   */
  bubblewrap?: { rootfs: string; stateDir: string; defaults?: Partial<BubblewrapSandboxDefaults> };
  /** This fleet's name on a shared daemon (apps pass their key prefix); see `LABEL_SCOPE`. */
  scope?: string;
  /** This deployment's id, kept in its Redis (`fleetInstance`); see `LABEL_INSTANCE`. */
  instance?: string;
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
        instance: config.instance,
      });
    case "bubblewrap":
      if (!config.bubblewrap?.rootfs || !config.bubblewrap.stateDir) {
        throw FleetError.nonRetryable(
          "invalid_task",
          "sandbox provider 'bubblewrap' needs a rootfs directory and a state directory",
        );
      }
      return new BubblewrapSandboxProvider({
        rootfs: config.bubblewrap.rootfs,
        stateDir: config.bubblewrap.stateDir,
        defaults: config.bubblewrap.defaults,
        logger: config.logger,
        scope: config.scope,
        instance: config.instance,
      });
    default:
      return assertNever(config.provider);
  }
}

function assertNever(x: never): never {
  throw FleetError.nonRetryable("invalid_task", `unknown sandbox provider: ${String(x)}`);
}
