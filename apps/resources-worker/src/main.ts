// The resources worker: runs the seed and close stages (DESIGN §2). All wiring lives in
// @fleet/pipeline's runWorkerApp; this file is the only one that reads the environment.
import { onStartFailure, runWorkerApp } from "@fleet/pipeline";

await runWorkerApp("resources", process.env).catch(onStartFailure(process.env));
