export * from "./admission.ts";
export * from "./batcher.ts";
export * from "./catalog.ts";
export * from "./connection.ts";
export * from "./keys.ts";
export * from "./rollout-store.ts";
export * from "./stage-queues.ts";
export * from "./teardown-ledger.ts";
