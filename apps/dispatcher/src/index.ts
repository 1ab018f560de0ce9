export { type Access, createTokenChecker, type TokenChecker } from "./auth.ts";
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
export * from "./responses.ts";
export { presentRollout, RolloutView } from "./rollout-view.ts";
export { createServer, NDJSON_TYPES } from "./server.ts";
