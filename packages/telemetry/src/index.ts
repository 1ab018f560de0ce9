export * from "./logger.ts";
export * from "./metrics.ts";
export * from "./metrics-server.ts";
export * from "./redact.ts";
