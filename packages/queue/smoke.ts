import { Queue, UnrecoverableError, Worker } from "bullmq";
import { Redis } from "ioredis";

const connection = new Redis("redis://127.0.0.1:6379", { maxRetriesPerRequest: null });
const q = new Queue("smoke", { connection, prefix: "{smoke}" });
const w = new Worker(
  "smoke",
  async (job) => {
    if (job.data.x === 2) throw new UnrecoverableError("no");
    return job.data.x * 2;
  },
  { connection: connection.duplicate(), prefix: "{smoke}" },
);
const done = new Promise((r) => {
  let n = 0;
  w.on("completed", (j, v) => {
    console.log("completed", j.id, v);
    if (++n + f >= 2) r(0);
  });
  let f = 0;
  w.on("failed", (j, e) => {
    console.log("failed", j?.id, e.name, e.message, j?.attemptsMade);
    f++;
    if (n + f >= 2) r(0);
  });
});
await q.add("a", { x: 1 }, { jobId: "r1.seed" });
await q.add("a", { x: 2 }, { jobId: "r2.seed", attempts: 3 });
const dup = await q.add("a", { x: 1 }, { jobId: "r1.seed" });
console.log("dup id", dup.id);
await done;
await w.close();
await q.obliterate({ force: true });
await q.close();
connection.disconnect();
