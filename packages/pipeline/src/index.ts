export * from "./app.ts";
export * from "./deps.ts";
export * from "./janitor.ts";
export * from "./result.ts";
export * from "./stage-runner.ts";
export * from "./stages.ts";
export * from "./testing/in-process-fleet.ts";
export * from "./worker.ts";
