export { onStartFailure } from "@fleet/telemetry";
// What a verifier checks of its host at start (`testsTamperCheck`), for tests of it.
export { testsTamperRisk } from "@fleet/verifiers";
export * from "./app.ts";
export * from "./deps.ts";
export * from "./hand-back.ts";
export * from "./janitor.ts";
export * from "./presence.ts";
export * from "./provider-gate.ts";
export * from "./result.ts";
export * from "./stage-runner.ts";
export * from "./stages.ts";
export * from "./testing/in-process-fleet.ts";
export * from "./worker.ts";
