import type {
  CleanupReceipt,
  ExecOptions,
  ExecResult,
  FileSet,
  ProbeReport,
  SandboxHandle,
  SandboxSpecInput,
} from "@fleet/contracts";
import { beforeStart, FleetError } from "@fleet/contracts";
import {
  AGENT_USER,
  type CreateOptions,
  type PutOptions,
  type SandboxInfo,
  type SandboxProvider,
} from "../provider.ts";
import { SCRATCH_DIRS } from "../scratch.ts";

/** One file in a fake sandbox. */
export interface FakeFile {
  content: string;
  user: string | undefined;
}

/** A fake sandbox: a flat map of absolute path → file, and whether it still exists. */
export interface FakeSandbox {
  handle: SandboxHandle;
  files: Map<string, FakeFile>;
  alive: boolean;
}

export interface ExecCall {
  argv: string[];
  options: ExecOptions;
}

/** Decides what an exec does; may mutate the sandbox's files (e.g. write a reward file) or throw. */
export type ExecHandler = (
  call: ExecCall,
  sandbox: FakeSandbox,
) => Partial<ExecResult> | Promise<Partial<ExecResult>>;

/** A successful, empty exec result (test fixture); override what a test cares about. */
export function execResult(overrides: Partial<ExecResult> = {}): ExecResult {
  return {
    exitCode: 0,
    timedOut: false,
    stdout: "",
    stderr: "",
    stdoutTruncated: false,
    stderrTruncated: false,
    durationMs: 0,
    oomKilled: false,
    ...overrides,
  };
}

/**
 * An in-memory `SandboxProvider` for unit tests of harness logic: no processes run; `exec`
 * is answered by a scripted handler, `put`/`get` work on a map of files. Test-only.
 */
export class InMemorySandboxProvider implements SandboxProvider {
  readonly name = "docker" as const;
  readonly endpoint = "memory://test";
  readonly sandboxes = new Map<string, FakeSandbox>();
  readonly execCalls: ExecCall[] = [];
  readonly putCalls: Array<{
    dir: string;
    files: FileSet;
    user: string | undefined;
    replace?: boolean;
    modes?: Readonly<Record<string, number>>;
    fenceEpoch?: number;
  }> = [];
  /**
   * While true, every call fails `provider_unavailable` before doing anything
   * (`nothingStarted`), as a daemon that does not answer.
   */
  unreachable = false;
  private next = 1;

  constructor(public onExec: ExecHandler = () => ({})) {}

  private gate(): void {
    if (this.unreachable)
      throw beforeStart(
        FleetError.retryable("provider_unavailable", "the in-memory provider is unreachable"),
      );
  }

  async create(spec: SandboxSpecInput, options: CreateOptions = {}): Promise<SandboxHandle> {
    this.gate();
    // Instant otherwise: only a create asked to stop before it began is stopped.
    if (options.signal?.aborted)
      throw FleetError.retryable("provider_unavailable", "the sandbox create was stopped");
    const id = `fake-${this.next++}`;
    const handle: SandboxHandle = {
      provider: "docker",
      endpoint: this.endpoint,
      id,
      name: id,
      rolloutId: spec.rolloutId,
      owner: spec.owner,
      volumes: [],
    };
    this.sandboxes.set(id, { handle, files: new Map(), alive: true });
    return handle;
  }

  /** The sandbox behind a handle; throws `sandbox_lost` like a real provider when it is gone. */
  sandbox(handle: SandboxHandle): FakeSandbox {
    this.gate();
    const box = this.sandboxes.get(handle.id);
    if (!box?.alive) throw new FleetError("sandbox_lost", `sandbox ${handle.id} is gone`);
    return box;
  }

  async find(rolloutId: string, owner: SandboxHandle["owner"]): Promise<SandboxHandle | null> {
    this.gate();
    for (const box of this.sandboxes.values()) {
      if (box.alive && box.handle.rolloutId === rolloutId && box.handle.owner === owner) return box.handle;
    }
    return null;
  }

  async exec(handle: SandboxHandle, argv: string[], options: ExecOptions): Promise<ExecResult> {
    const box = this.sandbox(handle);
    const call = { argv: [...argv], options };
    this.execCalls.push(call);
    const result = await this.onExec(call, box);
    return execResult({ durationMs: 1, ...result });
  }

  async put(handle: SandboxHandle, dir: string, files: FileSet, options: PutOptions = {}): Promise<void> {
    const box = this.sandbox(handle);
    this.putCalls.push({
      dir,
      files: { ...files },
      user: options.user,
      replace: options.replace,
      // Recorded when some file has a mode of its own.
      ...(options.modes && Object.keys(options.modes).length > 0 ? { modes: { ...options.modes } } : {}),
      // Recorded when given (a verify attempt's staging).
      ...(options.fenceEpoch !== undefined ? { fenceEpoch: options.fenceEpoch } : {}),
    });
    const base = dir.replace(/\/+$/, "");
    if (options.replace) {
      for (const path of [...box.files.keys()]) if (path.startsWith(`${base}/`)) box.files.delete(path);
    }
    for (const [rel, content] of Object.entries(files)) {
      box.files.set(`${base}/${rel}`, { content, user: options.user });
    }
  }

  async get(
    handle: SandboxHandle,
    path: string,
    options: { maxBytes?: number } = {},
  ): Promise<string | null> {
    const file = this.sandbox(handle).files.get(path);
    if (file === undefined) return null;
    return file.content.slice(0, options.maxBytes ?? 1024 * 1024);
  }

  async probe(handle: SandboxHandle): Promise<ProbeReport> {
    const files = [...this.sandbox(handle).files];
    const workspaceEmpty = !files.some(([p]) => p.startsWith("/workspace/"));
    const scratchClean = !files.some(
      ([p, f]) => f.user === AGENT_USER && SCRATCH_DIRS.some((d) => p.startsWith(`${d}/`)),
    );
    return {
      isolated: true,
      checks: { pidNamespace: true },
      detail: "in-memory",
      durationMs: 0,
      workspaceEmpty,
      scratchClean,
    };
  }

  async killProcesses(handle: SandboxHandle): Promise<CleanupReceipt> {
    this.sandbox(handle);
    return { confirmed: true, scope: "processes", at: Date.now(), alreadyGone: false, remaining: 0 };
  }

  async destroy(handle: SandboxHandle): Promise<CleanupReceipt> {
    this.gate();
    const box = this.sandboxes.get(handle.id);
    const alreadyGone = !box?.alive;
    if (box) box.alive = false;
    return { confirmed: true, scope: "sandbox", at: Date.now(), alreadyGone, remaining: 0 };
  }

  async list(): Promise<SandboxInfo[]> {
    this.gate();
    return [...this.sandboxes.values()]
      .filter((b) => b.alive)
      .map((b) => ({ handle: b.handle, labels: { "fleet.managed": "true" }, running: true, createdAt: 0 }));
  }

  async alive(handle: SandboxHandle): Promise<boolean> {
    this.gate();
    return this.sandboxes.get(handle.id)?.alive ?? false;
  }
}
