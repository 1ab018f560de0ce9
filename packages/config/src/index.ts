export * from "./env.ts";
export * from "./parse.ts";
export * from "./schemas.ts";
export * from "./unknown-variables.ts";
export * from "./worker.ts";
