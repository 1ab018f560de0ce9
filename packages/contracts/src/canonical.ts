import { hash } from "node:crypto";

/**
 * Canonical JSON: object keys sorted (by UTF-16 code unit), no whitespace, `undefined`
 * properties dropped. Two values that mean the same give the same text, whatever order their
 * keys were written in. Non-finite numbers, functions, bigints and symbols are refused rather
 * than silently turned into `null`.
 */
export function canonicalJson(value: unknown): string {
  try {
    return writeFast(value);
  } catch (err) {
    // Refused somewhere: `write` names where (its path), and says the same for the same value.
    if (err === NOT_CANONICAL) return write(value, "$");
    throw err;
  }
}

/** What `writeFast` throws for a value `write` refuses (without building the path to it). */
const NOT_CANONICAL = new Error("no canonical JSON form");

/**
 * `write` without tracking the path to each value (only an error uses it) or the intermediate
 * arrays of its filter/sort/map/join: admission writes every request of a batch, and this halves
 * the time. The same text for every value it writes; whatever it does not write as `write` would
 * (a refused value, an array with holes) it leaves to `write` by throwing `NOT_CANONICAL`.
 */
function writeFast(value: unknown): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "string":
    case "boolean":
      return JSON.stringify(value);
    case "number":
      if (!Number.isFinite(value)) throw NOT_CANONICAL;
      return JSON.stringify(value);
    case "object": {
      if (Array.isArray(value)) {
        let out = "[";
        for (let i = 0; i < value.length; i++) {
          if (!(i in value)) throw NOT_CANONICAL; // a hole: `write`'s map skips it
          if (i > 0) out += ",";
          out += writeFast(value[i]);
        }
        return `${out}]`;
      }
      if (value instanceof Date) return JSON.stringify(value.toISOString());
      const keys = Object.keys(value).sort();
      let out = "{";
      for (const k of keys) {
        const v = (value as Record<string, unknown>)[k];
        if (v === undefined) continue;
        if (out.length > 1) out += ",";
        out += `${JSON.stringify(k)}:${writeFast(v)}`;
      }
      return `${out}}`;
    }
    default:
      throw NOT_CANONICAL;
  }
}

function write(value: unknown, at: string): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "string":
    case "boolean":
      return JSON.stringify(value);
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`${at}: non-finite number has no canonical JSON form`);
      return JSON.stringify(value);
    case "object": {
      if (Array.isArray(value)) return `[${value.map((v, i) => write(v, `${at}[${i}]`)).join(",")}]`;
      if (value instanceof Date) return JSON.stringify(value.toISOString());
      const entries = Object.keys(value)
        .filter((k) => (value as Record<string, unknown>)[k] !== undefined)
        .sort()
        .map((k) => `${JSON.stringify(k)}:${write((value as Record<string, unknown>)[k], `${at}.${k}`)}`);
      return `{${entries.join(",")}}`;
    }
    default:
      throw new TypeError(`${at}: a ${typeof value} has no canonical JSON form`);
  }
}

/** sha256 of a UTF-8 text, as lowercase hex. */
export function sha256Hex(text: string): string {
  // One-shot (`crypto.hash`, Node >= 20.12): half the time of a Hash object for a short text.
  return hash("sha256", text, "hex");
}
