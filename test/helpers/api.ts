/** A reply of the fleet's HTTP API: its status and its JSON body (null when empty, `{ raw }` when not JSON). */
export interface ApiReply {
  status: number;
  body: Record<string, unknown> | null;
}

/**
 * Call the fleet's HTTP API at `fleet.url` with its bearer token, a JSON body if given; a call
 * that has no answer in 30 s fails.
 */
export async function callApi(
  fleet: { url: string; token: string },
  method: string,
  path: string,
  body?: unknown,
  headers: Record<string, string> = {},
): Promise<ApiReply> {
  const res = await fetch(`${fleet.url}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${fleet.token}`,
      ...(body === undefined ? {} : { "content-type": "application/json" }),
      ...headers,
    },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(30_000),
  });
  const text = await res.text();
  try {
    return { status: res.status, body: text ? (JSON.parse(text) as Record<string, unknown>) : null };
  } catch {
    return { status: res.status, body: { raw: text } };
  }
}
