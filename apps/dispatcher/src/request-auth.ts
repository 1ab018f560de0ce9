import type { IncomingHttpHeaders, IncomingMessage } from "node:http";
import { type Access, createTokenChecker } from "./auth.ts";
import { createSessionCodec, readCookie, SESSION_COOKIE, SESSION_COOKIE_PATH } from "./session.ts";

/** How a request authenticated: a bearer token, a board session cookie, or auth is off. */
export type AuthVia = "bearer" | "session" | "open" | "none";

export interface RequestAuth {
  access: Access;
  via: AuthVia;
  /**
   * Whose request it is, for scoping what a client names itself (idempotency keys): the bearer
   * token's sha256 in hex; "session" for a board session; "" when auth is off or none matched.
   */
  principal: string;
}

export interface Authenticator {
  /** False when no token is configured: every request is let in as admin (see README, "Auth"). */
  readonly enabled: boolean;
  /**
   * Who a request is. A bearer `Authorization` header decides when present; otherwise, for
   * `/admin/...` paths only, the board session cookie. Memoised per request (the board's route
   * constraint and the auth hook both ask).
   */
  authenticate(req: Pick<IncomingMessage, "headers" | "url">): RequestAuth;
  /** A session cookie value for a token typed into the login form, or null for a wrong token. */
  login(token: string): string | null;
}

/** Build the request authenticator from the configured tokens. */
export function createAuthenticator(
  tokens: readonly string[],
  adminTokens: readonly string[],
  now: () => number,
): Authenticator {
  const checker = createTokenChecker(tokens, adminTokens);
  const sessions = createSessionCodec(tokens, adminTokens);
  const memo = new WeakMap<object, RequestAuth>();

  const decide = (req: Pick<IncomingMessage, "headers" | "url">): RequestAuth => {
    if (!checker.enabled) return { access: "admin", via: "open", principal: "" };
    const header = req.headers.authorization;
    if (header !== undefined) {
      const { access, principal } = checker.identify(header);
      return { access, via: access === "none" ? "none" : "bearer", principal };
    }
    if (isAdminPath(req.url)) {
      const access = sessions.verify(readCookie(req.headers.cookie, SESSION_COOKIE), now());
      return access === "none"
        ? { access, via: "none", principal: "" }
        : { access, via: "session", principal: "session" };
    }
    return { access: "none", via: "none", principal: "" };
  };

  return {
    enabled: checker.enabled,
    authenticate(req) {
      let auth = memo.get(req);
      if (!auth) {
        auth = decide(req);
        memo.set(req, auth);
      }
      return auth;
    },
    login(token) {
      if (checker.check(`Bearer ${token}`) === "none") return null;
      return sessions.issue(token, now());
    },
  };
}

/** `/admin` or anything under `/admin/` (the session cookie's path). */
export function isAdminPath(url: string | undefined): boolean {
  const path = (url ?? "").split("?")[0]!;
  return path === SESSION_COOKIE_PATH || path.startsWith(`${SESSION_COOKIE_PATH}/`);
}

/**
 * Whether a browser request comes from a page of this very dispatcher: its `Origin` (or, when
 * absent, its `Referer`) names the host the request was sent to. `null` when the request has
 * neither header (not a browser's cross-site request: browsers send `Origin` with every
 * non-GET fetch, XHR and form post). `false` as well when the browser says the request came from
 * another site's page (`Sec-Fetch-Site`), whose GET (a link to the sign-out route) may carry
 * neither header: a page withholds its Referer at will (`referrerpolicy="no-referrer"`), but
 * cannot set that one.
 */
export function sameOrigin(headers: IncomingHttpHeaders): boolean | null {
  const site = headers["sec-fetch-site"]?.toLowerCase();
  if (site === "cross-site" || site === "same-site") return false;
  const host = headers.host?.toLowerCase();
  const source = headers.origin ?? headers.referer;
  if (source === undefined) return null;
  if (!host || source === "null") return false;
  try {
    const from = new URL(source);
    // Through URL on both sides, so a default port (`:80` / `:443`) compares equal to none.
    return from.host === new URL(`${from.protocol}//${host}`).host;
  } catch {
    return false;
  }
}
