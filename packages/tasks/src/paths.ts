import { fileURLToPath } from "node:url";

/** Absolute path of the bundled example suite (`packages/tasks/suites/example`). */
export const EXAMPLE_SUITE_DIR: string = fileURLToPath(new URL("../suites/example", import.meta.url));
