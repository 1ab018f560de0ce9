import { createHash, createHmac, timingSafeEqual } from "node:crypto";
import type { Access } from "./auth.ts";

/** Name of the Bull Board session cookie. */
export const SESSION_COOKIE = "fleet_session";
/** The cookie is sent only to `/admin/...` (never to the API, which takes bearer tokens only). */
export const SESSION_COOKIE_PATH = "/admin";
/** How long a board session lasts. @defaultValue 8 hours */
export const SESSION_TTL_MS = 8 * 3600_000;

export interface SessionCodec {
  /**
   * A signed session value for `token`, or null when the token is not a configured one (check
   * it with the constant-time `TokenChecker` first). The value holds a token id (a hash of the
   * token, not the token), an expiry and an HMAC.
   */
  issue(token: string, now: number): string | null;
  /** What a presented session value allows: `none` when malformed, forged, expired or revoked. */
  verify(value: string | undefined, now: number): Access;
}

const b64url = (buf: Buffer) => buf.toString("base64url");
const tokenId = (token: string) =>
  b64url(createHash("sha256").update(`fleet-tid:${token}`).digest()).slice(0, 22);

/**
 * Sessions for the Bull Board login: `v1.<tokenId>.<expiresAtMs>.<hmac>`.
 *
 * The HMAC key is derived from every configured token, so every dispatcher replica with the same
 * `FLEET_API_TOKENS` accepts the same sessions, and changing the tokens ends every session. What
 * a session may do is looked up from the *current* configuration by its token id (admin or not),
 * never read from the cookie, so a session cannot claim more than its token has.
 */
export function createSessionCodec(
  tokens: readonly string[],
  adminTokens: readonly string[],
  ttlMs: number = SESSION_TTL_MS,
): SessionCodec {
  const key = createHash("sha256")
    .update("fleet-board-session-v1\0")
    .update([...tokens].sort().join("\0"))
    .update("\0")
    .update([...adminTokens].sort().join("\0"))
    .digest();
  const access = new Map<string, Access>(
    tokens.map((t) => [tokenId(t), adminTokens.includes(t) ? "admin" : "user"] as const),
  );
  const sign = (payload: string) => createHmac("sha256", key).update(payload).digest();

  return {
    issue(token, now) {
      const tid = tokenId(token);
      if (!access.has(tid)) return null;
      const payload = `v1.${tid}.${Math.floor(now + ttlMs)}`;
      return `${payload}.${b64url(sign(payload))}`;
    },
    verify(value, now) {
      if (!value || value.length > 200) return "none";
      const parts = value.split(".");
      if (parts.length !== 4 || parts[0] !== "v1") return "none";
      const [, tid, exp, sig] = parts as [string, string, string, string];
      const expected = sign(`v1.${tid}.${exp}`);
      const presented = Buffer.from(sig, "base64url");
      if (presented.length !== expected.length || !timingSafeEqual(presented, expected)) return "none";
      if (!/^\d+$/.test(exp) || Number(exp) <= now) return "none";
      return access.get(tid) ?? "none";
    },
  };
}

/** The value of cookie `name` in a `Cookie` header, or undefined. */
export function readCookie(header: string | undefined, name: string): string | undefined {
  if (!header) return undefined;
  for (const part of header.split(";")) {
    const eq = part.indexOf("=");
    if (eq < 0) continue;
    if (part.slice(0, eq).trim() === name) {
      const raw = part.slice(eq + 1).trim();
      try {
        return decodeURIComponent(raw.startsWith('"') && raw.endsWith('"') ? raw.slice(1, -1) : raw);
      } catch {
        return undefined;
      }
    }
  }
  return undefined;
}

/**
 * `Set-Cookie` for a session: HttpOnly (no script reads it), SameSite=Strict (no other site's
 * page sends it), Path=/admin; `Secure` when the request came over HTTPS (directly or, as the
 * proxy says, `X-Forwarded-Proto: https`). `value: null` clears the cookie.
 */
export function sessionCookie(value: string | null, options: { secure: boolean; maxAgeS?: number }): string {
  const parts = [
    `${SESSION_COOKIE}=${value ?? ""}`,
    `Path=${SESSION_COOKIE_PATH}`,
    "HttpOnly",
    "SameSite=Strict",
    `Max-Age=${value === null ? 0 : (options.maxAgeS ?? Math.floor(SESSION_TTL_MS / 1000))}`,
  ];
  if (options.secure) parts.push("Secure");
  return parts.join("; ");
}
