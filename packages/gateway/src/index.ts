export { type CapCode, type CapLimits, type CapRefusal, type CapState, capRefusal } from "./caps.ts";
export {
  type GatewayGrant,
  GatewayHttpError,
  type GatewayOptions,
  type GatewayRegistration,
  isChatCompletion,
  type ModelGateway,
  startGateway,
  type UpstreamHealth,
  type UsageSummary,
} from "./gateway.ts";
export { bearerToken, mintToken, parseToken, secretMatches } from "./gateway-token.ts";
export {
  guardedDispatcher,
  guardedLookup,
  LINK_LOCAL_REFUSED,
  linkLocalRefusal,
  type ModelDispatcher,
  modelFetch,
} from "./model-fetch.ts";
export { type KeyProbe, probeKey } from "./probe-key.ts";
export {
  CONTEXT_LENGTH_WORDING,
  GATEWAY_TIMEOUT_MIN_MS,
  isGatewayTimeoutStatus,
  isInfraStatus,
  isRefusalStatus,
  isSlowGatewayTimeout,
} from "./status.ts";
export { type CallUsage, describeCalls, readCallUsage, UsageMeter } from "./usage-meter.ts";
