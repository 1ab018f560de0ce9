/// <reference path="./dockerode.d.ts" />
import { randomBytes } from "node:crypto";
import { setMaxListeners } from "node:events";
import type { Socket } from "node:net";
import { tmpdir } from "node:os";
import {
  beforeStart,
  type CleanupReceipt,
  type ExecOptions,
  type ExecResult,
  type FileSet,
  FleetError,
  isFleetError,
  Millis,
  type ProbeReport,
  type SandboxHandle,
  type SandboxSpec,
  type SandboxSpecInput,
  withTimeout,
} from "@fleet/contracts";
import type { Logger } from "@fleet/telemetry";
import type Dockerode from "dockerode";
import { deadlineArgv, envList, execOutcome, parseNumericUser } from "../exec-command.ts";
import {
  assertCoreutilsTimeout,
  assertIsolated,
  bySchema,
  checkProviderDefaults,
  countProcessesViaExec,
  DEFAULT_EXEC_DEFAULTS,
  type DefaultCheck,
  delay,
  EXEC_DEFAULTS_CHECKS,
  type ExecDefaults,
  type ExecStdin,
  endWithStdin,
  execResult,
  extractArchiveViaExec,
  extractViaExec,
  findSandbox,
  getTarget,
  hostProbeFacts,
  killProcessesViaExec,
  parseExecOptions,
  parseSandboxSpec,
  pid1Starting,
  planPut,
  probeExecCall,
  probeStdout,
  probeWhilePid1Starts,
  ROOT_KILL_SWEEP_SCRIPT,
  readViaExec,
  SANDBOX_LIMITS_CHECKS,
  type SandboxExec,
  sentinelProbeLine,
  TIMEOUT_PROBE_LINE,
  WORKSPACE_PROBE_LINE,
} from "../exec-ops.ts";
import { CappedBuffer, DockerStreamDemuxer, execOutputBuffers } from "../output.ts";
import {
  AGENT_USER,
  type CreateOptions,
  type KillOptions,
  LABEL_MANAGED,
  LABEL_OWNER,
  LABEL_ROLLOUT,
  LABEL_SCOPE,
  madeByAnotherInstance,
  OPS_CWD,
  OPS_ENV,
  type PutOptions,
  ROOT_USER,
  SANDBOX_PATHS,
  type SandboxInfo,
  type SandboxProvider,
  type UnusedVolumeInfo,
} from "../provider.ts";
import { SCRATCH_PROBE_LINE } from "../scratch.ts";
import { Spool } from "../spool.ts";
import { tarHasContent } from "../tar.ts";
import {
  buildContainerConfig,
  DEFAULT_SANDBOX_LIMITS,
  effectiveLimits,
  KEEPALIVE_USER,
  LABEL_REAPER,
  reaperLabels,
  type SandboxLimits,
  sandboxName,
} from "./container-config.ts";
import { dockerClient } from "./docker-client.ts";
import { type DockerConnection, resolveDockerConnection } from "./docker-endpoint.ts";
import { classifyDockerError, classifyDockerFacts, dockerErrorFacts } from "./docker-errors.ts";
import { LABEL_NETWORK } from "./gateway-network.ts";

/** Provider-wide defaults; every field optional in the constructor. */
export interface DockerSandboxDefaults extends SandboxLimits, ExecDefaults {
  /** Budget of one Docker API call (not of an exec's output stream). @defaultValue 30_000 */
  apiTimeoutMs: number;
}

export const DEFAULT_DOCKER_SANDBOX_DEFAULTS: Readonly<DockerSandboxDefaults> = Object.freeze({
  ...DEFAULT_SANDBOX_LIMITS,
  ...DEFAULT_EXEC_DEFAULTS,
  apiTimeoutMs: 30_000,
});

const DOCKER_DEFAULTS_CHECKS: Readonly<Record<keyof DockerSandboxDefaults, DefaultCheck>> = Object.freeze({
  ...EXEC_DEFAULTS_CHECKS,
  ...SANDBOX_LIMITS_CHECKS,
  apiTimeoutMs: bySchema(Millis),
});

export interface DockerSandboxProviderOptions {
  /** Where the daemon is: `{ endpoint: "unix:///var/run/docker.sock" }` (default) or dockerode options. */
  docker?: DockerConnection;
  logger?: Logger;
  defaults?: Partial<DockerSandboxDefaults>;
  /**
   * This fleet's name on a shared daemon (`LABEL_SCOPE`): set on every sandbox created, and
   * `list`/`find` see only sandboxes carrying it. Unset: labels nothing, lists every fleet's.
   */
  scope?: string;
  /** This deployment's id (`LABEL_INSTANCE`), set on every sandbox and volume it creates. */
  instance?: string;
}

type Container = Dockerode.Container;

/**
 * `SandboxProvider` on a Docker daemon via dockerode. Hardened by default (see
 * `buildContainerConfig`); relaxations come only from a spec's strict `options`.
 */
export class DockerSandboxProvider implements SandboxProvider {
  readonly name = "docker" as const;
  readonly endpoint: string;
  readonly defaults: Readonly<DockerSandboxDefaults>;
  private readonly docker: Dockerode;
  private readonly logger: Logger | undefined;
  private readonly remotes = new Map<string, Dockerode>();
  /** This worker's TLS material (DOCKER_CERT_PATH): also what it shows another https daemon. */
  private readonly tls: Pick<Dockerode.DockerOptions, "ca" | "cert" | "key"> | null;
  readonly scope: string | undefined;
  readonly instance: string | undefined;

  constructor(options: DockerSandboxProviderOptions = {}) {
    this.scope = options.scope || undefined;
    this.instance = options.instance || undefined;
    const { options: dockerOptions, endpoint } = resolveDockerConnection(options.docker);
    this.endpoint = endpoint;
    this.docker = dockerClient(dockerOptions);
    const { ca, cert, key } = dockerOptions;
    this.tls = ca || cert || key ? { ca, cert, key } : null;
    this.logger = options.logger;
    this.defaults = Object.freeze({ ...DEFAULT_DOCKER_SANDBOX_DEFAULTS, ...options.defaults });
    checkProviderDefaults("docker", this.defaults, DOCKER_DEFAULTS_CHECKS);
  }

  async create(input: SandboxSpecInput, options: CreateOptions = {}): Promise<SandboxHandle> {
    const { signal } = options;
    if (!signal) return this.createSandbox(input);
    // Stopped: its API call in flight is aborted with it, and it waits for nothing more (a
    // removal of what it made, against the daemon that is slow to answer, would hold the worker
    // as long as the create). What the daemon made (or still makes) carries the sandbox's
    // labels from its create on: `find`, a close and the janitor's label sweep find it.
    const stopped = () =>
      FleetError.retryable(
        "provider_unavailable",
        `the create of a sandbox for rollout ${input.rolloutId} was stopped`,
      );
    if (signal.aborted) throw stopped();
    // The create's own signal, which its calls listen to (see `apiSignal`), not the caller's: a
    // worker's shutdown signal lives as long as the worker, this one as long as the create.
    const stop = new AbortController();
    setMaxListeners(0, stop.signal);
    let onAbort = () => {};
    const aborted = new Promise<never>((_resolve, reject) => {
      onAbort = () => {
        stop.abort(signal.reason);
        reject(stopped());
      };
      signal.addEventListener("abort", onAbort, { once: true });
    });
    try {
      return await Promise.race([this.createSandbox(input, stop.signal), aborted]);
    } catch (err) {
      if (signal.aborted) throw stopped();
      throw err;
    } finally {
      signal.removeEventListener("abort", onAbort);
    }
  }

  private async createSandbox(input: SandboxSpecInput, stop?: AbortSignal): Promise<SandboxHandle> {
    const spec = parseSandboxSpec(input);
    const config = buildContainerConfig(spec, this.defaults, this.scope, this.instance);
    const name = config.name!;
    await this.checkMemory(config);
    const daemon = await this.localDaemonId();
    const handle: SandboxHandle = {
      provider: "docker",
      endpoint: this.endpoint,
      id: "",
      name,
      rolloutId: spec.rolloutId,
      owner: spec.owner,
      volumes: volumesOf(config),
      ...(daemon ? { daemon } : {}),
    };

    if (spec.network !== "none") await this.checkGatewayNetwork(spec, stop);
    const container = await this.createContainer(config, handle, spec, stop);
    if (!("start" in container)) return container; // adopted
    handle.id = container.id;
    await this.startAndStage(container, handle, spec, isWorkspaceTmpfs(config.HostConfig), stop);
    this.logger?.debug({ sandbox: name, id: container.id, rolloutId: spec.rolloutId }, "sandbox created");
    return handle;
  }

  /**
   * Start a container never started, and stage its image's /workspace files when its workspace
   * is a tmpfs (`workspaceTmpfs`): Docker copies them into a volume, never into a tmpfs. They are
   * read from the image before the start (the archive of a container not started reads its
   * image's layers), and staged after it. A container that cannot start, or whose files cannot
   * be staged, is removed.
   */
  private async startAndStage(
    container: Container,
    handle: SandboxHandle,
    spec: SandboxSpec,
    workspaceTmpfs: boolean,
    /** A create stopped (`create`'s signal): its calls are aborted, and nothing is removed. */
    stop?: AbortSignal,
  ): Promise<void> {
    const imageFiles = workspaceTmpfs ? await this.imageWorkspaceFiles(container, handle, spec, stop) : null;
    try {
      await this.startCreated(container, handle, spec, stop);
      if (imageFiles) {
        try {
          await extractArchiveViaExec(this.execOf(handle), imageFiles, SANDBOX_PATHS.workspace, AGENT_USER);
        } catch (err) {
          if (stop?.aborted) throw err;
          await this.removeFailed(container, handle, "could not get its image's /workspace files", err);
          throw err;
        }
      }
    } finally {
      await imageFiles?.dispose();
    }
  }

  /** Start a container just created; one that cannot start is removed. */
  private async startCreated(
    container: Container,
    handle: SandboxHandle,
    spec: SandboxSpec,
    stop?: AbortSignal,
  ): Promise<void> {
    try {
      await container.start({ abortSignal: this.apiSignal(stop) });
    } catch (err) {
      if (stop?.aborted) throw err;
      const facts = dockerErrorFacts(err);
      // The image cannot run our keepalive (no `sleep`), or the runtime refused the config: final.
      // Not a container removed (404) or being removed (409) meanwhile, by a re-delivered seed
      // that took over or a close: the infrastructure's, retried.
      const final =
        facts.statusCode !== null &&
        facts.statusCode < 500 &&
        !/is already (started|running)/i.test(facts.message) &&
        facts.statusCode !== 304 &&
        facts.statusCode !== 404 &&
        facts.statusCode !== 409;
      // The image's only when the runtime names the program it could not exec (`exec: "sleep":
      // executable file not found`, `exec: "/usr/bin/sleep": stat …: no such file or directory`):
      // not a path of its own it failed on (a cgroup file under load, containerd's socket while it
      // restarts), which is the infrastructure's, as the probe tells the two (`probeStdout`).
      const startFailedOnImage =
        /exec: "[^"]*": (?:stat [^:]*: )?no such file or directory|executable file not found/i.test(
          facts.message,
        );
      await this.removeFailed(container, handle, `failed to start (${facts.message})`, err);
      if (startFailedOnImage) {
        throw FleetError.nonRetryable(
          "invalid_task",
          `sandbox image ${spec.image} cannot run the keepalive 'sleep infinity': ${facts.message}`,
          err,
        );
      }
      if (final)
        throw FleetError.nonRetryable(
          "invalid_task",
          `sandbox ${handle.name} failed to start: ${facts.message}`,
          err,
        );
      throw FleetError.retryable(
        "provider_unavailable",
        `sandbox ${handle.name} failed to start: ${facts.message}`,
        err,
      );
    }
  }

  /**
   * Remove a container whose create failed part way. One still there afterwards makes the create
   * retryable whatever went wrong (a final error would let the caller take the sandbox for never
   * made, and report it torn down): a retry finds it by name and takes it over or removes it.
   */
  private async removeFailed(
    container: Container,
    handle: SandboxHandle,
    what: string,
    err: unknown,
  ): Promise<void> {
    const removed = await this.destroy(handle).then(
      (r) => r.confirmed,
      async (cleanupErr: unknown) => {
        this.logger?.warn(
          { err: cleanupErr, sandbox: handle.name },
          `could not remove a sandbox that ${what}`,
        );
        // Removing its volume may have failed after the container went: what matters here is
        // whether the container is still there.
        return container.inspect({ abortSignal: this.apiSignal() }).then(
          () => false,
          (inspectErr: unknown) => dockerErrorFacts(inspectErr).statusCode === 404,
        );
      },
    );
    if (!removed) {
      throw FleetError.retryable(
        "provider_unavailable",
        `sandbox ${handle.name} ${what} and could not be removed`,
        err,
      );
    }
  }

  /** Create the container, or take over the one of that name a re-delivered create made (`adopt`). */
  private async createContainer(
    config: Dockerode.ContainerCreateOptions,
    handle: SandboxHandle,
    spec: SandboxSpec,
    stop?: AbortSignal,
  ): Promise<Container | SandboxHandle> {
    try {
      return await this.docker.createContainer({ ...config, abortSignal: this.apiSignal(stop) });
    } catch (err) {
      const facts = dockerErrorFacts(err);
      if (classifyDockerFacts(facts, "create") === "name_conflict") return this.adopt(handle, spec, stop);
      throw classifyDockerError(err, "create", handle.name);
    }
  }

  /**
   * The image's /workspace as Docker's archive (entries `workspace/…`), or null when it has no
   * files there: the archive of a container not started yet reads its image's layers (the tmpfs
   * is not mounted). More than the workspace's cap is the task's (final `invalid_task`).
   */
  private async imageWorkspaceFiles(
    container: Container,
    handle: SandboxHandle,
    spec: SandboxSpec,
    stop?: AbortSignal,
  ): Promise<Spool | null> {
    const capMb = effectiveLimits(spec, this.defaults).diskMb ?? 0;
    // Spooled, never joined: the archive may be as large as the workspace's cap.
    const spool = new Spool();
    try {
      const stream = await container.getArchive({
        path: SANDBOX_PATHS.workspace,
        abortSignal: this.apiSignal(stop),
      });
      for await (const chunk of stream) {
        if (spool.bytes + (chunk as Buffer).length > capMb * 1024 * 1024) {
          stream.destroy();
          const tooBig = FleetError.nonRetryable(
            "invalid_task",
            `image ${spec.image} has more in /workspace than the workspace's cap of ${capMb} MiB`,
          );
          await this.removeFailed(container, handle, "has too much in its image's /workspace", tooBig);
          throw tooBig;
        }
        try {
          await spool.write(chunk as Buffer);
        } catch (err) {
          // This worker's disk (TMPDIR full or gone), not the daemon: said so.
          stream.destroy();
          const failed = FleetError.retryable(
            "provider_unavailable",
            `could not spool image ${spec.image}'s /workspace to this worker's TMPDIR (${tmpdir()}): ${err instanceof Error ? err.message : String(err)}`,
            err,
          );
          await this.removeFailed(container, handle, "could not spool its image's /workspace", failed);
          throw failed;
        }
      }
      if (await tarHasContent(spool.read())) return spool;
    } catch (err) {
      await spool.dispose();
      if (isFleetError(err) || stop?.aborted) throw err;
      if (dockerErrorFacts(err).statusCode === 404) return null; // no /workspace in the image
      const failed = classifyDockerError(err, "inspect", handle.name);
      await this.removeFailed(container, handle, "could not read its image's /workspace", failed);
      throw failed;
    }
    await spool.dispose();
    return null;
  }

  /**
   * A sandbox joins no network but its own rollout's sealed internal gateway network (this
   * fleet's): never `host`, `bridge`, another container's namespace or another rollout's network,
   * whatever a spec says. One that does not exist is final `invalid_task`.
   */
  private async checkGatewayNetwork(spec: SandboxSpec, stop?: AbortSignal): Promise<void> {
    let info: Dockerode.NetworkInspectInfo;
    try {
      info = await this.docker.getNetwork(spec.network).inspect({ abortSignal: this.apiSignal(stop) });
    } catch (err) {
      // Also what `container:<id>` and the like inspect as: never left to the create.
      if (dockerErrorFacts(err).statusCode === 404) {
        throw FleetError.nonRetryable(
          "invalid_task",
          `network ${spec.network} does not exist on this Docker host`,
        );
      }
      throw classifyDockerError(err, "inspect", spec.network);
    }
    const labels = info.Labels ?? {};
    if (
      !info.Internal ||
      labels[LABEL_NETWORK] !== "gateway" ||
      labels[LABEL_ROLLOUT] !== spec.rolloutId ||
      labels[LABEL_SCOPE] !== this.scope ||
      // Another deployment's (its own Redis, the same scope) may give the same rollout id.
      madeByAnotherInstance(labels, this.instance)
    ) {
      throw FleetError.nonRetryable(
        "isolation_refused",
        `network ${spec.network} is not this rollout's internal gateway network: a sandbox joins no other`,
      );
    }
  }

  /** A re-delivered create: the container of that name exists; take it over if it is this rollout's. */
  private async adopt(handle: SandboxHandle, spec: SandboxSpec, stop?: AbortSignal): Promise<SandboxHandle> {
    const container = this.docker.getContainer(handle.name);
    let info: Dockerode.ContainerInspectInfo;
    try {
      info = await container.inspect({ abortSignal: this.apiSignal(stop) });
    } catch (err) {
      // Removed in between (e.g. a concurrent close): let the caller retry the create.
      throw FleetError.retryable("provider_unavailable", `sandbox name ${handle.name} is in use`, err);
    }
    const labels = info.Config.Labels ?? {};
    if (
      labels[LABEL_ROLLOUT] !== handle.rolloutId ||
      labels[LABEL_OWNER] !== handle.owner ||
      // Another fleet's (or, unscoped, any fleet's; or another deployment's with this scope, a
      // rollout id both were given): never ours to take over.
      labels[LABEL_SCOPE] !== this.scope ||
      madeByAnotherInstance(labels, this.instance)
    ) {
      throw FleetError.nonRetryable(
        "invalid_task",
        `container name ${handle.name} is taken by a container that is not this rollout's sandbox`,
      );
    }
    const adopted = { ...handle, id: info.Id, volumes: mountedVolumes(info.Mounts) };
    if (info.State.Status === "created") {
      // Never started: its create was cut off before its start (its worker died), so before its
      // image's /workspace files were staged. Finished as that create would have: started
      // as it was, an empty workspace would be graded as the agent's work.
      this.logger?.info(
        { sandbox: handle.name, id: info.Id },
        "taking over a sandbox its earlier create never started",
      );
      // By how it was made (its workspace a tmpfs, or a volume Docker fills), not by this create.
      await this.startAndStage(container, adopted, spec, isWorkspaceTmpfs(info.HostConfig), stop);
      return adopted;
    }
    if (!info.State.Running) {
      // It ran and stopped (killed from outside, its daemon restarted): started again it would
      // come back without what it held in memory (its tmpfs workspace and the image's files
      // staged there, the verify fence), yet be taken for the sandbox it was. Destroyed (its
      // workspace volume too, an uncapped one's: left, the retry's create would mount it with the
      // earlier files in it); the create's retry makes it afresh.
      const gone = await this.destroy(adopted).catch(() => null);
      if (!gone?.confirmed) {
        throw FleetError.retryable(
          "provider_unavailable",
          `sandbox ${handle.name} existed but had stopped (${info.State.Status}), and could not be removed`,
        );
      }
      throw FleetError.retryable(
        "sandbox_lost",
        `sandbox ${handle.name} existed but had stopped (${info.State.Status}); removed, to be made afresh`,
      );
    }
    this.logger?.info({ sandbox: handle.name, id: info.Id }, "sandbox already existed; reusing it");
    // Its volumes as it was made (by another version, or with a volume for the image's files).
    return adopted;
  }

  async find(rolloutId: string, owner: SandboxHandle["owner"]): Promise<SandboxHandle | null> {
    return findSandbox(
      (labels) => this.list(labels),
      { [LABEL_ROLLOUT]: rolloutId, [LABEL_OWNER]: owner },
      sandboxName(rolloutId, owner, this.scope),
      this.instance,
    );
  }

  async exec(handle: SandboxHandle, argv: string[], options: ExecOptions): Promise<ExecResult> {
    try {
      await this.checkDaemon(handle);
    } catch (err) {
      throw beforeStart(err);
    }
    // A command's output keeps its end as well as its start (see `CappedBuffer`).
    let result: ExecResult & { rawExitCode: number };
    try {
      result = await this.execIn(handle, argv, {
        ...parseExecOptions(options, this.defaults),
        keepTail: true,
      });
    } catch (err) {
      // The daemon forgets the exec of a container removed under it (404 "no such exec
      // instance"), as it does one it started before a restart: the container tells which.
      if (
        isFleetError(err) &&
        err.kind === "provider_unavailable" &&
        dockerErrorFacts(err.cause).statusCode === 404
      ) {
        await this.throwIfLost(handle, err);
      }
      throw err;
    }
    if (result.rawExitCode === 137) {
      // A container removed, killed or stopped under the command SIGKILLs it (its PID namespace's
      // init died): its 137 is the sandbox's end, masked, never the command's own exit graded.
      // The container's state, read for that, also tells the OOM check whether Docker saw one.
      const state = await this.throwIfLost(handle);
      if (!result.timedOut) result.oomKilled = await this.oomKilled(handle, state.OOMKilled);
    }
    if (result.rawExitCode === -1) {
      // The host-side timer fired. In a sandbox frozen or stopped from outside, the in-sandbox
      // `timeout` could not fire: the sandbox failed under the command, which did not run out of
      // its time (masked, never a timeout graded 0). Told by the container's state, not the
      // timer alone: code under test that stops the `timeout` process leaves its sandbox
      // running, and a timeout it is. Here only, for the commands run for callers: the
      // provider's own execs (the kill sweep, the probe) keep their own reading of a paused
      // sandbox (its processes are never reported stopped).
      const frozen = await this.frozenOrStopped(handle);
      if (frozen !== null) {
        throw FleetError.nonRetryable(
          "sandbox_lost",
          `sandbox ${handle.name} ${frozen} while a command ran (its own deadline could not fire)`,
        );
      }
    }
    const { rawExitCode: _raw, ...out } = result;
    return out;
  }

  /** One exec: create, start (hijacked stream, demultiplexed and capped), inspect for the code. */
  private async execIn(
    handle: SandboxHandle,
    argv: readonly string[],
    o: {
      deadlineMs: number;
      env?: Readonly<Record<string, string>>;
      cwd?: string | undefined;
      user: string;
      stdin: ExecStdin | null;
      maxOutputBytes: number;
      /** Keep the output's last half-cap too (commands); not for the provider's own reads. */
      keepTail?: boolean;
    },
  ): Promise<ExecResult & { rawExitCode: number }> {
    const cmd = deadlineArgv(argv, o.deadlineMs, this.defaults.killGraceS);
    const container = this.containerOf(handle);
    const started = performance.now();
    let exec: Dockerode.Exec;
    try {
      exec = await container.exec({
        Cmd: cmd,
        AttachStdin: o.stdin !== null,
        AttachStdout: true,
        AttachStderr: true,
        Tty: false,
        Env: envList(o.env),
        User: o.user,
        WorkingDir: o.cwd,
        abortSignal: this.apiSignal(),
      });
    } catch (err) {
      // Not created: nothing started (a failed start, below, may have started the command).
      throw beforeStart(classifyDockerError(err, "exec", handle.name));
    }

    const { stdout, stderr } = execOutputBuffers(o.maxOutputBytes, o.keepTail);
    const safetyMs = o.deadlineMs + this.defaults.killGraceS * 1000 + this.defaults.execSlackMs;
    const hostTimedOut = await this.stream(
      exec,
      o.stdin,
      new DockerStreamDemuxer(stdout, stderr),
      safetyMs,
      handle,
    );

    const info = await this.execExit(exec, handle, hostTimedOut);
    const durationMs = performance.now() - started;
    let outcome: { exitCode: number; timedOut: boolean };
    let rawExitCode: number;
    if (info === null) {
      // The host-side safety timer fired and the command still runs (or never reported).
      this.logger?.warn({ sandbox: handle.name, deadlineMs: o.deadlineMs }, "exec outlived its deadline");
      outcome = { exitCode: -1, timedOut: true };
      rawExitCode = -1;
    } else {
      rawExitCode = info;
      outcome = execOutcome(info, durationMs, o.deadlineMs);
    }
    return execResult(outcome.exitCode, outcome.timedOut, stdout, stderr, durationMs, rawExitCode);
  }

  /**
   * Why the sandbox cannot be running commands (`was paused`, `stopped`, `was removed`), or null
   * when it runs. A daemon that does not answer is `provider_unavailable` (thrown).
   */
  private async frozenOrStopped(handle: SandboxHandle): Promise<string | null> {
    try {
      const { State } = await this.containerOf(handle).inspect({ abortSignal: this.apiSignal() });
      if (State.Paused) return "was paused (frozen from outside)";
      return State.Running ? null : `stopped (${State.Status})`;
    } catch (err) {
      if (dockerErrorFacts(err).statusCode === 404) return "was removed";
      throw classifyDockerError(err, "inspect", handle.name);
    }
  }

  /**
   * Throw `sandbox_lost` when the sandbox was removed or stopped (a command in it ended with it).
   * Paused or running, nothing is thrown and the container's state is returned; a daemon that
   * cannot tell throws `cause` when given (what failed already), else `provider_unavailable`.
   */
  private async throwIfLost(
    handle: SandboxHandle,
    cause?: FleetError,
  ): Promise<Dockerode.ContainerInspectInfo["State"]> {
    let why: string | null;
    let state: Dockerode.ContainerInspectInfo["State"] | undefined;
    try {
      ({ State: state } = await this.containerOf(handle).inspect({ abortSignal: this.apiSignal() }));
      why = state.Running || state.Paused ? null : `stopped (${state.Status})`;
    } catch (err) {
      if (dockerErrorFacts(err).statusCode === 404) why = "was removed";
      else throw cause ?? classifyDockerError(err, "inspect", handle.name);
    }
    if (why !== null) {
      throw FleetError.nonRetryable(
        "sandbox_lost",
        `sandbox ${handle.name} ${why} while a command ran`,
        cause,
      );
    }
    return state!; // read: only a failed inspect leaves it unset, and that threw or set `why`
  }

  /** `execIn` bound to one sandbox, for the fleet's own operations' exec (`exec-ops`): with `OPS_ENV`, never the image's PATH. */
  private execOf(handle: SandboxHandle): SandboxExec {
    return (argv, o) => this.execIn(handle, argv, { ...o, env: OPS_ENV });
  }

  /** Start the exec and pump its stream; resolves `true` if the host-side safety timer fired. */
  private async stream(
    exec: Dockerode.Exec,
    stdin: ExecStdin | null,
    demux: DockerStreamDemuxer,
    safetyMs: number,
    handle: SandboxHandle,
  ): Promise<boolean> {
    let socket: Socket;
    try {
      socket = await exec.start({ hijack: true, stdin: stdin !== null, abortSignal: this.apiSignal() });
    } catch (err) {
      throw classifyDockerError(err, "exec", handle.name);
    }
    return new Promise<boolean>((resolve, reject) => {
      let settled = false;
      const settle = (timedOut: boolean, err?: unknown) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        socket.destroy();
        if (err === undefined) resolve(timedOut);
        else reject(classifyDockerError(err, "exec", handle.name));
      };
      const timer = setTimeout(() => settle(true), safetyMs);
      socket.on("data", (chunk: Buffer) => demux.push(chunk));
      socket.once("end", () => settle(false));
      socket.once("close", () => settle(false));
      socket.once("error", (err) => settle(false, err));
      if (stdin !== null) endWithStdin(socket, stdin);
    });
  }

  /**
   * The exec's exit code. The stream can close a moment before the daemon records the exit, so
   * a still-running exec is re-inspected briefly; after a host-side timeout, a running exec is
   * reported as `null`.
   */
  private async execExit(
    exec: Dockerode.Exec,
    handle: SandboxHandle,
    hostTimedOut: boolean,
  ): Promise<number | null> {
    const until = performance.now() + (hostTimedOut ? 1_000 : 5_000);
    for (let attempt = 0; ; attempt++) {
      let info: Dockerode.ExecInspectInfo;
      try {
        info = await exec.inspect({ abortSignal: this.apiSignal() });
      } catch (err) {
        throw classifyDockerError(err, "exec", handle.name);
      }
      if (!info.Running && info.ExitCode !== null) return info.ExitCode;
      if (performance.now() >= until) {
        if (hostTimedOut) return null;
        throw FleetError.retryable(
          "provider_unavailable",
          `exec in ${handle.name} ended without an exit code`,
        );
      }
      await delay(Math.min(5 * 2 ** attempt, 100));
    }
  }

  /**
   * A sandbox's OOM-kill count as this provider last saw it (by container): the count only grows,
   * so an exec killed by SIGKILL after an earlier OOM kill was OOM-killed only if it grew since.
   * (A sandbox this process has not seen before counts from 0: an OOM kill on another worker, the
   * agent's, may then mark a verifier's SIGKILLed exec; `oomKilled` only informs, it never grades.)
   */
  private readonly oomKillsSeen = new Map<string, number>();

  /**
   * After a SIGKILL exit: did the memory cgroup's OOM killer act in this sandbox? `dockerSaw`:
   * the container state's `OOMKilled`, as read just before.
   */
  private async oomKilled(handle: SandboxHandle, dockerSaw: boolean): Promise<boolean> {
    if (dockerSaw) return true;
    try {
      // cgroup v1 memory.oom_control / v2 memory.events both carry `oom_kill <n>`. Run as root
      // after any SIGKILL exit, the agent's own commands' too: by `OPS_ENV`'s PATH (`execOf`),
      // never the image's, which may lead through a directory the agent writes (its `sh` would
      // run as root, beyond the reach of the sweep of the agent's uid).
      const r = await this.execOf(handle)(
        ["sh", "-c", "cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events 2>/dev/null"],
        { deadlineMs: 5_000, cwd: OPS_CWD, user: ROOT_USER, stdin: null, maxOutputBytes: 4096 },
      );
      const m = /oom_kill (\d+)/.exec(r.stdout);
      if (m === null) return false;
      const count = Number(m[1]);
      const key = handle.id || handle.name;
      const before = this.oomKillsSeen.get(key) ?? 0;
      this.oomKillsSeen.delete(key); // re-inserted last: the map drops its oldest entries first
      this.oomKillsSeen.set(key, count);
      // Bounded: workers that never destroy the sandboxes they exec in (agent, verifier) forget
      // the ones they have not seen for longest.
      while (this.oomKillsSeen.size > OOM_KILLS_REMEMBERED) {
        this.oomKillsSeen.delete(this.oomKillsSeen.keys().next().value!);
      }
      return count > before;
    } catch (err) {
      this.logger?.debug({ err, sandbox: handle.name }, "could not tell whether an exec was OOM-killed");
      return false;
    }
  }

  async put(handle: SandboxHandle, dir: string, files: FileSet, options: PutOptions = {}): Promise<void> {
    await this.checkDaemon(handle);
    const plan = planPut(dir, files, options.user, this.defaults.execUser);
    // Extracted inside the container, as the user, whatever the path (volume, tmpfs, writable
    // root): what the container sees is what counts. Docker's archive API writes through the
    // daemon's own mount of a volume, which a daemon restarted with live-restore no longer has:
    // the files went nowhere, the call succeeded, and an agent rerun in an empty workspace was
    // graded 0. (It cannot see a tmpfs at all.)
    await extractViaExec(this.execOf(handle), plan, options);
  }

  async get(
    handle: SandboxHandle,
    path: string,
    options: { maxBytes?: number } = {},
  ): Promise<string | null> {
    await this.checkDaemon(handle);
    const maxBytes = options.maxBytes ?? this.defaults.maxOutputBytes;
    // Read inside the container, as `put` writes (see there).
    return this.getViaExec(handle, getTarget(path), maxBytes);
  }

  /** Read a file with `cat` inside the container (root first; the file's owner may be the agent). */
  private getViaExec(handle: SandboxHandle, path: string, maxBytes: number): Promise<string | null> {
    return readViaExec(this.execOf(handle), path, [ROOT_USER, this.defaults.execUser], maxBytes);
  }

  async probe(handle: SandboxHandle, options: { timeoutMs?: number } = {}): Promise<ProbeReport> {
    await this.checkDaemon(handle);
    const timeoutMs = options.timeoutMs ?? this.defaults.probeTimeoutMs;
    const started = performance.now();
    // The host sentinel: this very process. With a private PID namespace its pid names nothing
    // (or someone else) inside; shared, it would show our own command line.
    const { pidNs: hostPidNs, sentinelPid, sentinelCmdline } = hostProbeFacts();
    const script = [
      "readlink /proc/self/ns/pid",
      "tr '\\000' ' ' < /proc/1/cmdline; echo",
      sentinelProbeLine(sentinelPid),
      WORKSPACE_PROBE_LINE,
      SCRATCH_PROBE_LINE,
      TIMEOUT_PROBE_LINE,
    ].join("; ");

    let stdout: string;
    let pidMode: string | undefined;
    try {
      const deadline = AbortSignal.timeout(timeoutMs);
      const [r, info] = await withTimeout(
        Promise.all([
          // By `OPS_ENV`'s PATH (`execOf`), never the image's: a sandbox is probed again after an
          // agent ran in it (an own sandbox a re-delivered run takes over), and a PATH through a
          // directory the agent writes would run its programs as root, which no sweep of its uid stops.
          probeWhilePid1Starts(async () =>
            probeStdout(await this.execOf(handle)(["sh", "-c", script], probeExecCall(timeoutMs)), timeoutMs),
          ),
          this.containerOf(handle).inspect({ abortSignal: deadline }),
        ]),
        timeoutMs,
        `probe timed out after ${timeoutMs} ms`,
      );
      stdout = r;
      pidMode = info.HostConfig.PidMode;
    } catch (err) {
      if (isFleetError(err) && err.kind === "invalid_task") throw err; // the image's (probeStdout)
      const e = isFleetError(err) ? err : classifyDockerError(err, "probe", handle.name);
      // A container that is gone is lost (final, masked), as bubblewrap's is: not an unreachable
      // daemon, which a retry against the same handle could never get past.
      if (e.kind === "sandbox_lost") throw e;
      throw FleetError.retryable(
        "provider_unavailable",
        `isolation probe of ${handle.name} failed: ${e.message}`,
        err,
      );
    }

    const [sandboxPidNs = "", pid1 = "", sentinel = "", workspace = "", scratch = "", timeoutKind = ""] =
      stdout.split("\n").map((l) => l.trim());
    const checks = {
      pidNamespaceDiffers: sandboxPidNs !== "" && sandboxPidNs !== hostPidNs,
      pidModeNotHost: pidMode !== "host",
      pid1IsSandboxInit: /^(\S*\/)?(docker-init|tini|sleep)( |$)/.test(pid1),
      hostSentinelInvisible: sentinel === "" || sentinel !== sentinelCmdline,
    };
    if (
      pid1Starting(pid1) &&
      checks.pidNamespaceDiffers &&
      checks.pidModeNotHost &&
      checks.hostSentinelInvisible
    ) {
      // Still the runtime's start shim after the settle window, all else sound: a slow daemon,
      // not a verdict. (A shared namespace is refused whatever PID 1 shows.)
      throw FleetError.retryable(
        "provider_unavailable",
        `isolation probe of ${handle.name}: the container's PID 1 is still starting (${pid1})`,
      );
    }
    const detail = `sandbox pid ns ${sandboxPidNs || "?"} vs host ${hostPidNs}; PidMode=${pidMode || "private"}; pid 1: ${pid1 || "?"}; host pid ${sentinelPid} ${sentinel ? "visible" : "invisible"}`;
    const durationMs = performance.now() - started;
    const isolated = assertIsolated(handle.name, checks, detail);
    assertCoreutilsTimeout(handle.name, timeoutKind);
    return {
      isolated,
      checks,
      detail,
      durationMs,
      workspaceEmpty: workspace === "empty",
      scratchClean: scratch === "clean",
    };
  }

  async killProcesses(
    handle: SandboxHandle,
    user: string = AGENT_USER,
    options: KillOptions = {},
  ): Promise<CleanupReceipt> {
    await this.checkDaemon(handle);
    // The daemon itself is unreachable (no HTTP answer at all): a retry later, not a sweep.
    const daemonUnreachable = (err: unknown) =>
      dockerErrorFacts(isFleetError(err) ? err.cause : err).statusCode === null && !isSweepFailure(err);
    const uid = parseNumericUser(user)?.uid;
    // A uid other than root's has the reaper below behind its sweep.
    const backedUp = uid !== undefined && uid !== 0 && options.quickMs === undefined;
    const receipt = await killProcessesViaExec(
      this.execOf(handle),
      user,
      this.defaults.killRounds,
      daemonUnreachable,
      { ...options, backedUp },
    );
    if (uid === 0 && receipt.confirmed && !receipt.alreadyGone) {
      // Root's own sweep (the tests') runs as root with no capability, as the tests do: their code
      // can take its stdout (`pidfd_getfd`), write `remaining=0` there and kill it. Its "none
      // left" stands only when counted again by an uid they cannot reach (the keepalive's).
      const left = await countProcessesViaExec(this.execOf(handle), 0, KEEPALIVE_USER);
      if (left !== 0) {
        return {
          ...receipt,
          confirmed: false,
          remaining: left ?? 0,
          detail:
            left === null
              ? "the sweep of root's processes reported none left, but a count outside root's reach could not be taken"
              : `the sweep of root's processes reported none left, but a count outside root's reach found ${left}`,
        };
      }
    }
    if (!backedUp) return receipt;
    if (receipt.confirmed) {
      if (receipt.alreadyGone) return receipt;
      // The sweep ran as the uid it swept, so its "none left" is that uid's word, which the agent
      // can forge (see `countProcessesViaExec`). Counted again by an uid it cannot reach: none
      // left there confirms; anything else (some left, no count) goes to the reaper.
      const left = await countProcessesViaExec(this.execOf(handle), uid, KEEPALIVE_USER);
      if (left === 0) return receipt;
      this.logger?.warn(
        { sandbox: handle.name, left },
        "kill sweep reported no process left, but a count outside its uid did not confirm it; sending a reaper",
      );
    } else {
      // The sweep, run as the user itself (the sandbox grants no capability), could not confirm:
      // something of that uid resisted it (killed every sweep with its own `kill -9 -1` loop,
      // outran it). Escalate to a reaper it cannot signal, or the rollout would be masked where
      // the agent chose it.
      this.logger?.warn(
        { sandbox: handle.name, detail: receipt.detail },
        "kill sweep resisted; sending a reaper",
      );
    }
    return this.reap(handle, uid, user);
  }

  async removeStaleHelpers(olderThanMs: number): Promise<number> {
    let containers: Dockerode.ContainerInfo[];
    try {
      containers = await this.docker.listContainers({
        all: true,
        filters: {
          label: [`${LABEL_REAPER}=true`, ...(this.scope ? [`${LABEL_SCOPE}=${this.scope}`] : [])],
        },
        abortSignal: this.apiSignal(),
      });
    } catch (err) {
      throw classifyDockerError(err, "list");
    }
    let removed = 0;
    for (const c of containers) {
      // A running reaper is at work; it removes itself when done.
      if (c.State === "running" || Date.now() - c.Created * 1000 < olderThanMs) continue;
      try {
        await this.docker.getContainer(c.Id).remove({ force: true, abortSignal: this.apiSignal() });
        removed++;
      } catch (err) {
        if (dockerErrorFacts(err).statusCode !== 404) throw classifyDockerError(err, "destroy", c.Id);
      }
    }
    return removed;
  }

  async listUnusedVolumes(): Promise<UnusedVolumeInfo[]> {
    let listed: Awaited<ReturnType<Dockerode["listVolumes"]>>;
    try {
      listed = await this.docker.listVolumes({
        filters: {
          label: [`${LABEL_MANAGED}=true`, ...(this.scope ? [`${LABEL_SCOPE}=${this.scope}`] : [])],
          // Referenced by no container, running or not.
          dangling: ["true"],
        },
        abortSignal: this.apiSignal(),
      });
    } catch (err) {
      throw classifyDockerError(err, "list");
    }
    return (listed.Volumes ?? []).map((v) => ({
      name: v.Name,
      labels: v.Labels ?? {},
      createdAt: v.CreatedAt ? Date.parse(v.CreatedAt) : Number.NaN,
    }));
  }

  async removeUnusedVolume(name: string): Promise<boolean> {
    try {
      // Not forced: the daemon refuses (409) a volume a container uses, whatever the listing said.
      await this.docker.getVolume(name).remove({ abortSignal: this.apiSignal() });
      return true;
    } catch (err) {
      const { statusCode } = dockerErrorFacts(err);
      if (statusCode === 404) return true;
      if (statusCode === 409) return false;
      throw classifyDockerError(err, "destroy", name);
    }
  }

  /**
   * A short-lived container beside the sandbox, in its PID namespace, running the root kill sweep
   * (`ROOT_KILL_SWEEP_SCRIPT`) as root with CAP_KILL and no other capability, no network, a
   * read-only root. The capability is the reaper's container's alone: nothing running in the
   * sandbox (the verifier's root tests included) can get it. Removed by the daemon when it exits
   * (`AutoRemove`), so a worker dying meanwhile leaves nothing behind.
   */
  private async reap(handle: SandboxHandle, uid: number, user: string): Promise<CleanupReceipt> {
    const docker = this.clientOf(handle);
    let info: Dockerode.ContainerInspectInfo;
    try {
      info = await this.containerOf(handle).inspect({ abortSignal: this.apiSignal() });
    } catch (err) {
      const fe = classifyDockerError(err, "inspect", handle.name);
      if (fe.kind === "sandbox_lost") {
        return { confirmed: true, scope: "processes", at: Date.now(), alreadyGone: true, remaining: 0 };
      }
      throw fe;
    }
    let reaper: Container;
    const reaperName = `${handle.name}-reaper-${randomBytes(4).toString("hex")}`;
    try {
      reaper = await docker.createContainer({
        name: reaperName,
        Image: info.Image,
        Entrypoint: ["sh", "-c", ROOT_KILL_SWEEP_SCRIPT, "sh", String(uid), String(this.defaults.killRounds)],
        User: "0:0",
        Labels: reaperLabels(handle.rolloutId, this.scope),
        AttachStdout: true,
        AttachStderr: true,
        Tty: false,
        HostConfig: {
          PidMode: `container:${info.Id}`,
          NetworkMode: "none",
          CapDrop: ["ALL"],
          CapAdd: ["KILL"],
          SecurityOpt: ["no-new-privileges"],
          ReadonlyRootfs: true,
          AutoRemove: true,
          PidsLimit: 32,
          Memory: 64 * 1024 * 1024,
        },
        abortSignal: this.apiSignal(),
      });
    } catch (err) {
      // The daemon may have made it before the call failed (a timeout on our side): never started,
      // it would not remove itself.
      await docker
        .getContainer(reaperName)
        .remove({ force: true, abortSignal: this.apiSignal() })
        .catch(() => undefined);
      throw classifyDockerError(err, "create", `${handle.name} reaper`);
    }
    const stdout = new CappedBuffer(4096);
    const stderr = new CappedBuffer(4096);
    // Not the API timeout's signal: the reaper's output may take longer to come. Aborted when the
    // reaper failed, so an attach still pending (or its stream) does not stay open.
    const attaching = new AbortController();
    try {
      const stream = await withTimeout(
        reaper.attach({ stream: true, stdout: true, stderr: true, abortSignal: attaching.signal }),
        this.defaults.apiTimeoutMs,
        "attaching to the reaper timed out",
      );
      const demux = new DockerStreamDemuxer(stdout, stderr);
      const ended = new Promise<void>((resolve) => {
        stream.on("data", (chunk: Buffer) => demux.push(chunk));
        stream.once("end", () => resolve());
        stream.once("close", () => resolve());
        stream.once("error", () => resolve());
      });
      await reaper.start({ abortSignal: this.apiSignal() });
      await withTimeout(ended, 60_000, "the reaper did not finish within 60 s");
    } catch (err) {
      attaching.abort();
      // Under the API timeout like every other call: this path runs when the daemon is slow.
      await reaper.remove({ force: true, abortSignal: this.apiSignal() }).catch(() => undefined);
      if (isFleetError(err)) throw err;
      throw FleetError.retryable(
        "provider_unavailable",
        `reaper for ${handle.name} failed: ${String(err)}`,
        err,
      );
    }
    const m = /remaining=(\d+)/.exec(stdout.text());
    const remaining = m ? Number(m[1]) : -1;
    return {
      confirmed: remaining === 0,
      scope: "processes",
      at: Date.now(),
      alreadyGone: false,
      remaining: Math.max(0, remaining),
      detail: `uid of ${user}, by a reaper: ${remaining === 0 ? "no process left" : remaining > 0 ? `${remaining} process(es) still alive` : `no report (${stderr.text().trim()})`}`,
    };
  }

  async destroy(handle: SandboxHandle): Promise<CleanupReceipt> {
    await this.checkDaemon(handle);
    this.oomKillsSeen.delete(handle.id || handle.name);
    const docker = this.clientOf(handle);
    let alreadyGone = false;
    try {
      await docker
        .getContainer(handle.id || handle.name)
        .remove({ force: true, v: true, abortSignal: this.apiSignal() });
    } catch (err) {
      const facts = dockerErrorFacts(err);
      if (facts.statusCode === 404) alreadyGone = true;
      else if (facts.statusCode === 409 && /already in progress/i.test(facts.message)) {
        // Another removal is under way (a close and the janitor at once, say): not confirmed
        // until the container is gone, since that removal may yet fail and leave it. Gone, it
        // was that removal's doing: counted once (its caller's `confirmed`), not by each.
        await this.waitRemoved(docker, handle);
        alreadyGone = true;
      } else {
        throw FleetError.retryable(
          "provider_unavailable",
          `removing sandbox ${handle.name} failed: ${facts.message}`,
          err,
        );
      }
    }
    // The handle names its volumes (none for a capped workspace, a tmpfs of the container's own).
    for (const volume of new Set(handle.volumes)) await this.removeVolume(docker, volume);
    this.logger?.debug({ sandbox: handle.name, alreadyGone }, "sandbox destroyed");
    return { confirmed: true, scope: "sandbox", at: Date.now(), alreadyGone, remaining: 0 };
  }

  /** Wait (bounded by the API timeout) until a container another caller is removing is gone. */
  private async waitRemoved(docker: Dockerode, handle: SandboxHandle): Promise<void> {
    const until = performance.now() + this.defaults.apiTimeoutMs;
    for (let attempt = 0; ; attempt++) {
      try {
        await docker.getContainer(handle.id || handle.name).inspect({ abortSignal: this.apiSignal() });
      } catch (err) {
        if (dockerErrorFacts(err).statusCode === 404) return;
        throw classifyDockerError(err, "inspect", handle.name);
      }
      if (performance.now() >= until) {
        throw FleetError.retryable(
          "provider_unavailable",
          `sandbox ${handle.name} is still there after another removal of it began`,
        );
      }
      await delay(Math.min(20 * 2 ** attempt, 500));
    }
  }

  private async removeVolume(docker: Dockerode, volume: string): Promise<void> {
    // A removal already in progress (409) releases the volume a moment later.
    const until = performance.now() + 10_000;
    for (let attempt = 0; ; attempt++) {
      try {
        await docker.getVolume(volume).remove({ force: true, abortSignal: this.apiSignal() });
        return;
      } catch (err) {
        const facts = dockerErrorFacts(err);
        if (facts.statusCode === 404) return;
        if (facts.statusCode !== 409 || performance.now() >= until) {
          throw FleetError.retryable(
            "provider_unavailable",
            `removing volume ${volume} failed: ${facts.message}`,
            err,
          );
        }
      }
      await delay(Math.min(20 * 2 ** attempt, 500));
    }
  }

  async list(labels: Record<string, string> = {}): Promise<SandboxInfo[]> {
    const filters = [
      `${LABEL_MANAGED}=true`,
      ...(this.scope ? [`${LABEL_SCOPE}=${this.scope}`] : []),
      ...Object.entries(labels).map(([k, v]) => `${k}=${v}`),
    ];
    let containers: Dockerode.ContainerInfo[];
    try {
      containers = await this.docker.listContainers({
        all: true,
        filters: { label: filters },
        abortSignal: this.apiSignal(),
      });
    } catch (err) {
      throw classifyDockerError(err, "list");
    }
    const daemon = await this.localDaemonId();
    const out: SandboxInfo[] = [];
    for (const c of containers) {
      const rolloutId = c.Labels[LABEL_ROLLOUT];
      const owner = c.Labels[LABEL_OWNER];
      const name = (c.Names[0] ?? "").replace(/^\//, "");
      if (!rolloutId || (owner !== "resources" && owner !== "agent") || !name) continue;
      const volumes = mountedVolumes(c.Mounts);
      out.push({
        handle: {
          provider: "docker",
          endpoint: this.endpoint,
          id: c.Id,
          name,
          rolloutId,
          owner,
          volumes,
          ...(daemon ? { daemon } : {}),
        },
        labels: c.Labels,
        running: c.State === "running",
        createdAt: c.Created * 1000,
      });
    }
    return out;
  }

  async alive(handle: SandboxHandle): Promise<boolean> {
    await this.checkDaemon(handle);
    try {
      const info = await this.containerOf(handle).inspect({ abortSignal: this.apiSignal() });
      return info.State.Running;
    } catch (err) {
      if (dockerErrorFacts(err).statusCode === 404) return false;
      throw classifyDockerError(err, "inspect", handle.name);
    }
  }

  /**
   * Ends the API calls in flight (and fails any made after it): a daemon that hangs would
   * otherwise hold them, and with them the process, until their timeout (an app that gave up
   * waiting for its provider, `FLEET_PROVIDER_WAIT_MS`, exited half a minute later).
   */
  async close(): Promise<void> {
    this.closing.abort();
    for (const call of this.calls) call.abort(this.closing.signal.reason);
    this.remotes.clear();
  }

  /** Aborted by `close`. */
  private readonly closing = new AbortController();
  /** The API calls' signals not yet aborted (each is by its budget at the latest), for `close`. */
  private readonly calls = new Set<AbortController>();

  /**
   * One API call's signal: its budget, the provider's `close`, and a create's own (`stop`) when
   * given. Not `AbortSignal.any` over `closing`: on Node 20 each signal it makes leaves a weak
   * reference on its sources for good (some 60 bytes a call, on a provider that makes millions);
   * the call is in `calls` until its signal aborts, its budget's end at the latest.
   */
  private apiSignal(stop?: AbortSignal): AbortSignal {
    const call = new AbortController();
    if (this.closing.signal.aborted) {
      call.abort(this.closing.signal.reason);
      return call.signal;
    }
    const timer = setTimeout(
      () => call.abort(new DOMException("The operation was aborted due to timeout", "TimeoutError")),
      this.defaults.apiTimeoutMs,
    );
    timer.unref();
    this.calls.add(call);
    const stopped = () => call.abort(stop?.reason);
    call.signal.addEventListener(
      "abort",
      () => {
        clearTimeout(timer);
        this.calls.delete(call);
        stop?.removeEventListener("abort", stopped);
      },
      { once: true },
    );
    if (stop?.aborted) stopped();
    else stop?.addEventListener("abort", stopped, { once: true });
    return call.signal;
  }

  private daemon: Promise<{ id: string | null; memTotal: number | null }> | null = null;

  /**
   * This provider's daemon's id and its host's memory, asked once (a failed ask is asked again
   * next time).
   */
  private daemonFacts(): Promise<{ id: string | null; memTotal: number | null }> {
    this.daemon ??= this.docker.info({ abortSignal: this.apiSignal() }).then(
      (info: { ID?: string; MemTotal?: number }) => ({
        id: info.ID || null,
        memTotal: typeof info.MemTotal === "number" && info.MemTotal > 0 ? info.MemTotal : null,
      }),
      (err: unknown) => {
        this.daemon = null;
        throw classifyDockerError(err, "inspect", "the daemon");
      },
    );
    return this.daemon;
  }

  /**
   * This provider's daemon's id when its endpoint is a local socket (every host names those
   * alike), else null.
   */
  private async localDaemonId(): Promise<string | null> {
    if (!this.endpoint.startsWith("unix://")) return null;
    return (await this.daemonFacts()).id;
  }

  /**
   * A sandbox whose memory limit is more than its host has is refused (final, the task's): such a
   * limit is none, and its agent could take the host's memory from every other sandbox on it
   * (their rollouts masked, or the daemon killed). A task's `sandbox` options that large are a
   * mistake for this host.
   */
  private async checkMemory(config: { HostConfig?: { Memory?: number } }): Promise<void> {
    const memory = config.HostConfig?.Memory ?? 0;
    const { memTotal } = await this.daemonFacts();
    if (memTotal !== null && memory > memTotal) {
      const mib = (bytes: number) => Math.round(bytes / 2 ** 20);
      throw FleetError.nonRetryable(
        "invalid_task",
        `the sandbox's memory limit (${mib(memory)} MiB: its memoryMb plus what its tmpfs mounts may hold, from the task's sandbox options) is more than the sandbox host has (${mib(memTotal)} MiB)`,
      );
    }
  }

  /**
   * A handle made on another host's local daemon (same socket path, another daemon): never
   * answered from this one, where its sandbox would look gone (a destroy or kill "confirmed"
   * while it runs on). Retryable: a worker on its host can.
   */
  private async checkDaemon(handle: SandboxHandle): Promise<void> {
    if (!handle.daemon || !this.isLocal(handle)) return;
    const own = await this.localDaemonId();
    if (own !== null && own !== handle.daemon) {
      throw FleetError.retryable(
        "provider_unavailable",
        `sandbox ${handle.name} lives on Docker daemon ${handle.daemon}, and this worker's ${this.endpoint} leads to ${own}: fleets on several hosts reach their daemons over TCP/TLS (DOCKER_HOST), not each host's own socket`,
      );
    }
  }

  /** Whether `handle` names this provider's own endpoint (or none: a handle from before endpoints). */
  private isLocal(handle: SandboxHandle): boolean {
    return handle.endpoint === this.endpoint || handle.endpoint === "";
  }

  /** The daemon holding `handle` (DESIGN §8: a handle names its endpoint). */
  private clientOf(handle: SandboxHandle): Dockerode {
    if (handle.provider !== "docker") {
      throw FleetError.nonRetryable(
        "invalid_task",
        `a ${handle.provider} sandbox handle given to the docker provider`,
      );
    }
    if (this.isLocal(handle)) return this.docker;
    let client = this.remotes.get(handle.endpoint);
    if (!client) {
      // A daemon of the same fleet over TLS trusts the same CA and client certificate.
      const remote = resolveDockerConnection({ endpoint: handle.endpoint }).options;
      client = dockerClient(remote.protocol === "https" && this.tls ? { ...remote, ...this.tls } : remote);
      this.remotes.set(handle.endpoint, client);
    }
    return client;
  }

  private containerOf(handle: SandboxHandle): Container {
    return this.clientOf(handle).getContainer(handle.id || handle.name);
  }
}

/** How many sandboxes' OOM-kill counts a provider remembers (see `oomKillsSeen`). */
const OOM_KILLS_REMEMBERED = 4096;

export { LABEL_REAPER } from "./container-config.ts";

/** A sweep that ran but failed inside the sandbox (not a Docker call that failed). */
function isSweepFailure(err: unknown): boolean {
  return isFleetError(err) && err.cause === undefined;
}

/** The named volumes a container config mounts (removed with the sandbox). */
function volumesOf(config: Dockerode.ContainerCreateOptions): string[] {
  return (config.HostConfig?.Mounts ?? []).flatMap((m) =>
    m.Type === "volume" && m.Source ? [m.Source] : [],
  );
}

/** The named volumes among a container's mounts (as inspect and list report them). */
function mountedVolumes(mounts: ReadonlyArray<{ Type?: string; Name?: string }>): string[] {
  return mounts.flatMap((m) => (m.Type === "volume" && m.Name ? [m.Name] : []));
}

/** Whether a container's workspace is a tmpfs of its own (capped), not a volume. */
function isWorkspaceTmpfs(hostConfig: { Tmpfs?: Record<string, string> } | undefined): boolean {
  return Boolean(hostConfig?.Tmpfs?.[SANDBOX_PATHS.workspace]);
}
