export * from "./client.ts";
export type { CliContext } from "./context.ts";
export { LineTooLongError, MAX_LINE_CHARS, splitLines } from "./lines.ts";
export { createProgram, EXIT, runCli } from "./program.ts";
export * from "./progress.ts";
export * from "./requests.ts";
export * from "./summary.ts";
