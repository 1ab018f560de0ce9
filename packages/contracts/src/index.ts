export * from "./agent.ts";
export * from "./bounded.ts";
export * from "./canonical.ts";
export * from "./errors.ts";
export * from "./failure.ts";
export * from "./rollout.ts";
export * from "./sandbox.ts";
export * from "./task.ts";
