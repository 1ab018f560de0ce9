export { canonicalJson, canonicalTaskJson, taskDigest, taskSize } from "./canonical.ts";
export {
  DEFAULT_MAX_TASK_BYTES,
  type LoadSuiteOptions,
  type LoadTaskOptions,
  loadSuite,
  loadTask,
} from "./load-task.ts";
export { EXAMPLE_SUITE_DIR } from "./paths.ts";
export { TaskToml } from "./task-toml.ts";
