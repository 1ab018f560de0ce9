// Minimal typings for the part of dockerode 5 this package uses (dockerode ships no types and
// @types/dockerode is not a dependency). Only what we call is declared; field names follow the
// Docker Engine API.
declare module "dockerode" {
  import type { Socket } from "node:net";
  import type { Readable } from "node:stream";

  namespace Dockerode {
    interface DockerOptions {
      socketPath?: string;
      host?: string;
      port?: number | string;
      protocol?: "http" | "https" | "ssh";
      ca?: string | Buffer | Array<string | Buffer>;
      cert?: string | Buffer;
      key?: string | Buffer;
      /** Per-request socket timeout (ms). Applies to hijacked streams too: leave unset. */
      timeout?: number;
      version?: string;
    }

    interface WithSignal {
      abortSignal?: AbortSignal;
    }

    interface MountSpec {
      Type: "bind" | "volume" | "tmpfs";
      Source?: string;
      Target: string;
      ReadOnly?: boolean;
      VolumeOptions?: {
        NoCopy?: boolean;
        Labels?: Record<string, string>;
        DriverConfig?: { Name?: string; Options?: Record<string, string> };
      };
      TmpfsOptions?: { SizeBytes?: number; Mode?: number };
    }

    interface HostConfig {
      NetworkMode?: string;
      CapDrop?: string[];
      CapAdd?: string[];
      SecurityOpt?: string[];
      ReadonlyRootfs?: boolean;
      Tmpfs?: Record<string, string>;
      Mounts?: MountSpec[];
      Binds?: string[];
      PidsLimit?: number;
      Memory?: number;
      MemorySwap?: number;
      ShmSize?: number;
      Sysctls?: Record<string, string>;
      NanoCpus?: number;
      Init?: boolean;
      PidMode?: string;
      IpcMode?: string;
      Privileged?: boolean;
      OomScoreAdj?: number;
      AutoRemove?: boolean;
    }

    interface ContainerCreateOptions extends WithSignal {
      name?: string;
      Image: string;
      Entrypoint?: string[];
      Cmd?: string[];
      User?: string;
      WorkingDir?: string;
      Hostname?: string;
      Env?: string[];
      Labels?: Record<string, string>;
      NetworkDisabled?: boolean;
      AttachStdout?: boolean;
      AttachStderr?: boolean;
      Tty?: boolean;
      HostConfig?: HostConfig;
    }

    interface ContainerInspectInfo {
      Id: string;
      /** The image's id. */
      Image: string;
      Name: string;
      Created: string;
      State: {
        Status: string;
        Running: boolean;
        Paused: boolean;
        OOMKilled: boolean;
        ExitCode: number;
        Pid: number;
      };
      Config: { Labels: Record<string, string> | null; Image: string };
      HostConfig: HostConfig;
      Mounts: Array<{ Type: string; Name?: string; Source: string; Destination: string }>;
      NetworkSettings: { Networks: Record<string, unknown> | null };
    }

    interface ContainerInfo {
      Id: string;
      Names: string[];
      Image: string;
      Created: number;
      State: string;
      Status: string;
      Labels: Record<string, string>;
      Mounts: Array<{ Type: string; Name?: string; Destination: string }>;
    }

    interface ExecCreateOptions extends WithSignal {
      Cmd: string[];
      AttachStdin?: boolean;
      AttachStdout?: boolean;
      AttachStderr?: boolean;
      Tty?: boolean;
      Env?: string[];
      User?: string;
      WorkingDir?: string;
      Privileged?: boolean;
    }

    interface ExecStartOptions extends WithSignal {
      hijack?: boolean;
      stdin?: boolean;
      Detach?: boolean;
      Tty?: boolean;
    }

    interface ExecInspectInfo {
      ID: string;
      Running: boolean;
      ExitCode: number | null;
      Pid: number;
    }

    class Exec {
      id: string;
      start(options: ExecStartOptions): Promise<Socket>;
      inspect(options?: WithSignal): Promise<ExecInspectInfo>;
    }

    class Container {
      id: string;
      inspect(options?: WithSignal): Promise<ContainerInspectInfo>;
      start(options?: WithSignal): Promise<unknown>;
      remove(options?: WithSignal & { force?: boolean; v?: boolean }): Promise<unknown>;
      kill(options?: WithSignal & { signal?: string }): Promise<unknown>;
      exec(options: ExecCreateOptions): Promise<Exec>;
      attach(
        options: { stream: boolean; stdout?: boolean; stderr?: boolean } & WithSignal,
      ): Promise<Readable>;
      getArchive(options: WithSignal & { path: string }): Promise<Readable>;
      stats(
        options: WithSignal & { stream: false; "one-shot"?: boolean },
      ): Promise<{ pids_stats?: { current?: number; limit?: number } }>;
    }

    interface NetworkCreateOptions extends WithSignal {
      Name: string;
      Driver?: string;
      Internal?: boolean;
      CheckDuplicate?: boolean;
      EnableIPv6?: boolean;
      Attachable?: boolean;
      Labels?: Record<string, string>;
      Options?: Record<string, string>;
      IPAM?: { Driver?: string; Config?: Array<{ Subnet?: string; Gateway?: string }> };
    }

    interface NetworkInspectInfo {
      Name: string;
      Id: string;
      Created: string;
      Internal: boolean;
      Labels: Record<string, string> | null;
      Options: Record<string, string> | null;
      IPAM: { Config: Array<{ Subnet?: string; Gateway?: string }> | null };
      Containers?: Record<string, { Name: string; IPv4Address: string }> | null;
    }

    type NetworkInfo = NetworkInspectInfo;

    class Network {
      id: string;
      inspect(options?: WithSignal): Promise<NetworkInspectInfo>;
      remove(options?: WithSignal): Promise<unknown>;
    }

    class Image {
      inspect(options?: WithSignal): Promise<{ Id: string; RepoTags: string[] | null }>;
    }

    class Volume {
      name: string;
      inspect(options?: WithSignal): Promise<{ Name: string; Labels: Record<string, string> | null }>;
      remove(options?: WithSignal & { force?: boolean }): Promise<unknown>;
    }

    interface DockerodeError extends Error {
      statusCode?: number;
      reason?: string;
      json?: unknown;
      code?: string;
    }
  }

  class Dockerode {
    constructor(options?: Dockerode.DockerOptions);
    modem: { socketPath?: string; host?: string; port?: number | string; protocol?: string };
    createContainer(options: Dockerode.ContainerCreateOptions): Promise<Dockerode.Container>;
    getContainer(id: string): Dockerode.Container;
    getVolume(name: string): Dockerode.Volume;
    getImage(name: string): Dockerode.Image;
    getNetwork(name: string): Dockerode.Network;
    createNetwork(options: Dockerode.NetworkCreateOptions): Promise<Dockerode.Network>;
    listNetworks(
      options?: Dockerode.WithSignal & { filters?: Record<string, string[]> | string },
    ): Promise<Dockerode.NetworkInfo[]>;
    listContainers(
      options?: Dockerode.WithSignal & { all?: boolean; filters?: Record<string, string[]> | string },
    ): Promise<Dockerode.ContainerInfo[]>;
    listVolumes(options?: Dockerode.WithSignal & { filters?: Record<string, string[]> | string }): Promise<{
      Volumes: Array<{ Name: string; Labels: Record<string, string> | null; CreatedAt?: string }> | null;
    }>;
    ping(options?: Dockerode.WithSignal): Promise<unknown>;
    /** `GET /info`: the daemon's facts; `ID` is its own identity. */
    info(options?: Dockerode.WithSignal): Promise<{ ID?: string; Name?: string }>;
  }

  export = Dockerode;
}
