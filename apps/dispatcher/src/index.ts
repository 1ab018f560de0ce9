export { type Access, createTokenChecker, type TokenChecker } from "./auth.ts";
export { BOARD_PATH, registerBoard } from "./board.ts";
export type { DispatcherDeps, MetricsRegistry } from "./context.ts";
export {
  type ErrorBody,
  errorBody,
  HttpError,
  type HttpErrorCode,
  isHttpError,
  toHttpError,
} from "./http-error.ts";
export { buildOpenApi } from "./openapi.ts";
export {
  type Authenticator,
  type AuthVia,
  createAuthenticator,
  isAdminPath,
  type RequestAuth,
  sameOrigin,
} from "./request-auth.ts";
export * from "./responses.ts";
export { presentRollout, RolloutView } from "./rollout-view.ts";
export { type RegisteredRoute, registeredRoutes, trackRoutes } from "./route-table.ts";
export { LOGIN_PATH, LOGOUT_PATH, LoginForm } from "./routes/admin.ts";
export { createServer, NDJSON_TYPES } from "./server.ts";
export { createSessionCodec, SESSION_COOKIE, type SessionCodec } from "./session.ts";
