export * from "./redis-cluster.ts";
export * from "./sandbox-entry.ts";
