import { Redis } from "ioredis";

const r = new Redis();
const mode = process.argv[2];
if (mode === "on") {
  await r.config("SET", "slowlog-log-slower-than", "0");
  await r.config("SET", "slowlog-max-len", "300000");
  await r.slowlog("RESET");
} else {
  const e = await r.slowlog("GET", 300000);
  await r.config("SET", "slowlog-log-slower-than", "10000");
  await r.config("SET", "slowlog-max-len", "128");
  const agg = new Map();
  for (const [, , us, args] of e) {
    let k = String(args[0]).toLowerCase();
    if (k === "evalsha") k += " " + String(args[1]).slice(0, 8) + " k" + args[2];
    const a = agg.get(k) || { n: 0, us: 0 };
    a.n++;
    a.us += Number(us);
    agg.set(k, a);
  }
  const N = Number(process.argv[3] || 1);
  let tot = 0;
  for (const a of agg.values()) tot += a.us;
  console.log("total us per rollout", (tot / N).toFixed(1));
  for (const [k, a] of [...agg].sort((x, y) => y[1].us - x[1].us).slice(0, 25))
    console.log(
      k.padEnd(34),
      "calls/r",
      (a.n / N).toFixed(2).padStart(6),
      "us/call",
      (a.us / a.n).toFixed(1).padStart(7),
      "us/r",
      (a.us / N).toFixed(1).padStart(7),
    );
}
await r.quit();
