import { type ApiReply, callApi } from "../../helpers/api.ts";
import { TERMINAL_STATUSES } from "./terminal.ts";

/**
 * A small client for the dispatcher under test that rides out the faults the chaos tests
 * inject: a refused connection or a 5xx (Redis restarting) is retried; what a retry could
 * duplicate carries an `Idempotency-Key`, so a retried POST lands on the same rollouts.
 */
export class FleetClient {
  constructor(
    private readonly url: string,
    private readonly token: string,
  ) {}

  async call(
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
  ): Promise<ApiReply> {
    return callApi({ url: this.url, token: this.token }, method, path, body, headers);
  }

  /** `call`, retried (bounded) on network errors and 5xx answers. */
  async retrying(
    method: string,
    path: string,
    body?: unknown,
    headers: Record<string, string> = {},
    timeoutMs = 120_000,
  ): Promise<ApiReply> {
    const end = Date.now() + timeoutMs;
    let last = "";
    for (let attempt = 0; ; attempt++) {
      try {
        const r = await this.call(method, path, body, headers);
        if (r.status < 500) return r;
        last = `HTTP ${r.status} ${JSON.stringify(r.body)}`;
      } catch (err) {
        last = err instanceof Error ? err.message : String(err);
      }
      if (Date.now() > end) throw new Error(`${method} ${path} kept failing: ${last}`);
      await new Promise((r) => setTimeout(r, Math.min(2_000, 100 * 2 ** attempt)));
    }
  }

  /** A batch's NDJSON results, one parsed line each (retried like `retrying`). */
  async results(batchId: string, timeoutMs = 60_000): Promise<Record<string, unknown>[]> {
    const end = Date.now() + timeoutMs;
    for (;;) {
      try {
        const res = await fetch(`${this.url}/v1/batches/${batchId}/results`, {
          headers: { authorization: `Bearer ${this.token}` },
          signal: AbortSignal.timeout(30_000),
        });
        const text = await res.text();
        if (res.status === 200) {
          return text
            .split("\n")
            .filter((l) => l.trim() !== "")
            .map((l) => JSON.parse(l) as Record<string, unknown>);
        }
        if (res.status < 500) throw new Error(`results of ${batchId}: HTTP ${res.status} ${text}`);
      } catch (err) {
        if (Date.now() > end) throw err;
      }
      await new Promise((r) => setTimeout(r, 500));
    }
  }

  /** Submit a batch idempotently; resolves the batch id and rollout ids once accepted. */
  async submitBatch(rows: unknown[], key: string): Promise<{ batchId: string; ids: string[] }> {
    const r = await this.retrying("POST", "/v1/batches", { rollouts: rows }, { "idempotency-key": key });
    if (r.status !== 202 && r.status !== 200) {
      throw new Error(`batch ${key} refused: HTTP ${r.status} ${JSON.stringify(r.body)}`);
    }
    return { batchId: String(r.body?.batchId), ids: (r.body?.rolloutIds ?? []) as string[] };
  }

  /** Submit one rollout idempotently; resolves its id. */
  async submit(row: unknown, key: string): Promise<string> {
    const r = await this.retrying("POST", "/v1/rollouts", row, { "idempotency-key": key });
    if (r.status !== 202 && r.status !== 200) {
      throw new Error(`rollout ${key} refused: HTTP ${r.status} ${JSON.stringify(r.body)}`);
    }
    return String(r.body?.id);
  }

  /** The rollout's view once terminal, else null. */
  async terminal(id: string): Promise<Record<string, unknown> | null> {
    const r = await this.call("GET", `/v1/rollouts/${id}`).catch(() => null);
    return r && TERMINAL_STATUSES.includes(String(r.body?.status)) ? r.body : null;
  }
}
