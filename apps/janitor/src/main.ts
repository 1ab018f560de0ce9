// The janitor: retries failed teardowns from the ledger, sweeps orphaned sandboxes and closes
// rollouts stuck past their deadline (DESIGN §2 rules 3, 9). Wiring lives in @fleet/pipeline.
import { onStartFailure, runJanitorApp } from "@fleet/pipeline";

await runJanitorApp(process.env).catch(onStartFailure(process.env));
