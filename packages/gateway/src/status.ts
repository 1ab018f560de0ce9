/**
 * Whether an upstream status refuses the key or sends the call elsewhere: 401, 403, or a redirect
 * (never followed with the key).
 */
export function isRefusalStatus(status: number): boolean {
  return status === 401 || status === 403 || (status >= 300 && status < 400);
}

/**
 * Whether an upstream status is a gateway timeout from a proxy before the model (nginx's 504 at
 * 60 s, Cloudflare's 524, a 408): a long generation as often as a hung upstream, so, like a
 * timeout of the fleet's own, no sure failure of the upstream.
 */
export function isGatewayTimeoutStatus(status: number): boolean {
  return status === 504 || status === 524 || status === 408;
}

/**
 * How long a gateway timeout must have taken to stand for one: a proxy gives up on a long
 * generation after tens of seconds (nginx 60 s, Cloudflare 100 s). One that came sooner timed
 * nothing out: the upstream behind it is down (a balancer with no backend), a sure failure.
 */
export const GATEWAY_TIMEOUT_MIN_MS = 10_000;

/**
 * Whether an answer of `status` that took `elapsedMs` is a proxy's timeout of a call that may
 * have been a long generation (`isGatewayTimeoutStatus`, after at least `GATEWAY_TIMEOUT_MIN_MS`):
 * neither a failure of the upstream nor an answer.
 */
export function isSlowGatewayTimeout(
  status: number,
  elapsedMs: number,
  minMs = GATEWAY_TIMEOUT_MIN_MS,
): boolean {
  return isGatewayTimeoutStatus(status) && elapsedMs >= minMs;
}

/**
 * Whether an upstream status, answered after `elapsedMs`, is an infrastructure failure (see `UpstreamHealth`): the upstream
 * down, overloaded or refusing the key, or redirecting (it moved, or a proxy wants https: the
 * gateway follows no redirect, so every call of the agent fails, through no fault of its own).
 * A 404 too: the gateway sets the path and the model of every call, so the upstream has no such
 * model (a server restarted without it, or a spec naming one it never had) or route, never the
 * agent's request (as the tool-loop counts a 404 after answered calls). A 402 too: the operator's
 * account out of credit (OpenRouter's "insufficient credits"), never what the agent sent.
 * A gateway timeout that took a proxy's time is not (`isSlowGatewayTimeout`); one that came at
 * once is.
 */
export function isInfraStatus(status: number, elapsedMs: number, minMs = GATEWAY_TIMEOUT_MIN_MS): boolean {
  return (
    (status >= 500 ||
      status === 429 ||
      status === 404 ||
      status === 408 ||
      status === 402 ||
      isRefusalStatus(status)) &&
    !isSlowGatewayTimeout(status, elapsedMs, minMs)
  );
}

/**
 * How an upstream's error message says the request does not fit the model's context (OpenAI,
 * vLLM, SGLang, Anthropic's proxies), for one that sends no `context_length_exceeded` code.
 */
export const CONTEXT_LENGTH_WORDING =
  /context[ _-]?(length|window)|maximum context|prompt is too long|too many tokens/i;
