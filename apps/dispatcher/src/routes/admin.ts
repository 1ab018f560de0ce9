import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";
import { z } from "zod";
import { BOARD_PATH } from "../board.ts";
import type { Authenticator } from "../request-auth.ts";
import { sameOrigin } from "../request-auth.ts";
import { sessionCookie } from "../session.ts";

export const LOGIN_PATH = "/admin/login";
export const LOGOUT_PATH = "/admin/logout";
/** The largest sign-in form body read (a token and a `next`); over it, 413. */
export const LOGIN_FORM_BYTES = 8192;

/** The login form's body (`application/x-www-form-urlencoded`). */
export const LoginForm = z.object({
  token: z.string().max(1000),
  /** Where to go after logging in: a path under `/admin/queues` (anything else is ignored). */
  next: z.string().max(2000).optional(),
});
export type LoginForm = z.infer<typeof LoginForm>;

/** Security headers of every page the dispatcher renders itself. */
const PAGE_HEADERS = {
  "content-type": "text/html; charset=utf-8",
  "cache-control": "no-store",
  "content-security-policy":
    "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
  "x-frame-options": "DENY",
  "referrer-policy": "same-origin",
};

/** Only a path under the board: never another site, never `//host`. */
export function safeNext(next: string | undefined): string {
  if (
    next &&
    (next === BOARD_PATH || next.startsWith(`${BOARD_PATH}/`) || next.startsWith(`${BOARD_PATH}?`))
  ) {
    if (!next.includes("\\") && !/[\r\n]/.test(next)) return next;
  }
  return BOARD_PATH;
}

/** Was the request made over HTTPS (directly, or so says the TLS-terminating proxy)? */
function isHttps(req: FastifyRequest): boolean {
  const forwarded = req.headers["x-forwarded-proto"];
  const first = (Array.isArray(forwarded) ? forwarded[0] : forwarded)?.split(",")[0]?.trim();
  return req.protocol === "https" || first === "https";
}

const escapeHtml = (s: string) =>
  s.replace(
    /[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c] ?? c,
  );

/** The login page (also the body of a 401 for a browser that opens the board without a session). */
export function loginPage(options: { next?: string; error?: string }): string {
  const next = escapeHtml(safeNext(options.next));
  const error = options.error ? `<p class="error" role="alert">${escapeHtml(options.error)}</p>` : "";
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rollout-fleet: sign in</title>
<style>
body { font-family: system-ui, sans-serif; background: #f4f5f7; display: grid; place-items: center; min-height: 100vh; margin: 0; }
form { background: #fff; padding: 2rem; border-radius: 8px; box-shadow: 0 1px 4px rgba(0,0,0,.15); width: 22rem; }
h1 { font-size: 1.2rem; margin-top: 0; }
label { display: block; margin-bottom: .4rem; }
input[type=password] { width: 100%; box-sizing: border-box; padding: .5rem; font-family: monospace; }
button { margin-top: 1rem; padding: .5rem 1rem; }
.error { color: #b00020; }
.hint { color: #555; font-size: .85rem; }
</style>
</head>
<body>
<form method="post" action="${LOGIN_PATH}">
<h1>rollout-fleet: Bull Board</h1>
${error}
<label for="token">API token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<input type="hidden" name="next" value="${next}">
<button type="submit">Sign in</button>
<p class="hint">A token from <code>FLEET_API_TOKENS</code>. Tokens written <code>admin:&lt;token&gt;</code> may retry, clean and promote jobs; others see a read-only board.</p>
</form>
</body>
</html>
`;
}

/** Reply with the login page (status 200, or 401 for a refused sign-in or a missing session). */
export function sendLoginPage(
  reply: FastifyReply,
  status: number,
  options: { next?: string; error?: string },
): FastifyReply {
  return reply.code(status).headers(PAGE_HEADERS).send(loginPage(options));
}

/**
 * `GET /admin/login` (the form), `POST /admin/login` (token → an HMAC-signed session cookie,
 * then 303 to the board) and `GET /admin/logout`. All public: they are how one gets a session.
 */
export function registerAdminRoutes(app: FastifyInstance, auth: Authenticator): void {
  app.register(async (scope) => {
    // Form posts are read only here; the API keeps refusing this type (415).
    scope.addContentTypeParser(
      "application/x-www-form-urlencoded",
      { parseAs: "string", bodyLimit: LOGIN_FORM_BYTES },
      (_req, body, done) => done(null, Object.fromEntries(new URLSearchParams(body as string))),
    );

    scope.get(LOGIN_PATH, { config: { public: true } }, async (req, reply) => {
      const next = (req.query as { next?: unknown }).next;
      if (!auth.enabled) return reply.redirect(BOARD_PATH, 303);
      return sendLoginPage(reply, 200, { next: typeof next === "string" ? next : undefined });
    });

    scope.post(LOGIN_PATH, { config: { public: true } }, async (req, reply) => {
      if (!auth.enabled) return reply.redirect(BOARD_PATH, 303);
      // Login CSRF: a form on another site must not sign the browser in (as someone else).
      if (sameOrigin(req.headers) === false) {
        return sendLoginPage(reply, 403, { error: "Cross-site sign-in refused." });
      }
      const form = LoginForm.safeParse(req.body);
      if (!form.success) return sendLoginPage(reply, 400, { error: "Send the form with a token." });
      const session = auth.login(form.data.token.trim());
      if (session === null) {
        req.log.info("board sign-in refused");
        return sendLoginPage(reply, 401, { next: form.data.next, error: "That token is not valid." });
      }
      req.log.info("board sign-in");
      return reply
        .header("set-cookie", sessionCookie(session, { secure: isHttps(req) }))
        .header("cache-control", "no-store")
        .redirect(safeNext(form.data.next), 303);
    });

    scope.get(LOGOUT_PATH, { config: { public: true } }, async (req, reply) => {
      // Logout CSRF: another site's link (or image) to this route must not sign the browser out,
      // as its form must not sign it in. Back to the board, the session as it was.
      if (sameOrigin(req.headers) === false) return reply.redirect(BOARD_PATH, 303);
      return reply
        .header("set-cookie", sessionCookie(null, { secure: isHttps(req) }))
        .header("cache-control", "no-store")
        .redirect(LOGIN_PATH, 303);
    });
  });
}
