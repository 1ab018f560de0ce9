export * from "./failover.ts";
export * from "./redis-cluster.ts";
export * from "./sandbox-entry.ts";
export * from "./sentinel.ts";
export * from "./tcp-proxy.ts";
export * from "./tls.ts";
