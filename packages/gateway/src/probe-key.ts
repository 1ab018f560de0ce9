import { modelFetch } from "./model-fetch.ts";
import { isRefusalStatus } from "./status.ts";

/** What a plain request says of a key (see `probeKey`). */
export type KeyProbe = "refused" | "works" | "silent";

/**
 * Ask a chat-completions endpoint one short message (one token) with a key and model, after a
 * bare 403 or a 402 on a request of an episode whose earlier calls were answered: `refused`
 * (401, 403 or a redirect: the key; 402: an account out of credit), `works` (a 2xx, or a 4xx
 * about the probe itself, such as a model that wants `max_completion_tokens`: the 403 or 402 was
 * the request's, e.g. a firewall's rule on what the policy wrote, a `max_tokens` the balance
 * cannot cover), `silent` (a 429 or 5xx, or no answer within `timeoutMs`: the endpoint failing,
 * which says nothing of the key). The caller's `signal` aborting ends it with `silent` too; a
 * caller that must tell that apart checks its signal. Its few tokens are nobody's usage: the
 * callers note each probe as a gap.
 */
export async function probeKey(options: {
  url: string;
  apiKey: string | null | undefined;
  model: unknown;
  timeoutMs: number;
  signal?: AbortSignal;
}): Promise<KeyProbe> {
  if (options.timeoutMs <= 0) return "silent";
  const headers: Record<string, string> = { "content-type": "application/json", accept: "application/json" };
  if (options.apiKey) headers.authorization = `Bearer ${options.apiKey}`;
  // Whole milliseconds (AbortSignal.timeout refuses a fraction): a caller's time left to a
  // deadline of a fraction of one.
  const timeout = AbortSignal.timeout(Math.ceil(options.timeoutMs));
  try {
    const res = await modelFetch(options.url, {
      method: "POST",
      headers,
      body: JSON.stringify({
        model: options.model,
        messages: [{ role: "user", content: "Reply with OK." }],
        max_tokens: 1,
        stream: false,
      }),
      signal: options.signal ? AbortSignal.any([options.signal, timeout]) : timeout,
      // The key goes to this endpoint only, never where a redirect points.
      redirect: "manual",
    });
    await res.body?.cancel().catch(() => undefined);
    // A 402 to one token: the account cannot pay for anything (out of credit), not the request.
    if (isRefusalStatus(res.status) || res.status === 402) return "refused";
    return res.status === 429 || res.status >= 500 ? "silent" : "works";
  } catch {
    return "silent";
  }
}
