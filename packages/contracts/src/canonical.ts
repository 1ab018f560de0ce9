import { hash } from "node:crypto";

/**
 * Canonical JSON: object keys sorted (by UTF-16 code unit), no whitespace, `undefined`
 * properties dropped. Two values that mean the same give the same text, whatever order their
 * keys were written in. Non-finite numbers, functions, bigints and symbols are refused rather
 * than silently turned into `null`.
 */
export function canonicalJson(value: unknown): string {
  try {
    return write(value, null);
  } catch (err) {
    // Refused somewhere (or an array with holes): again with paths, so the error names where.
    if (err === NOT_CANONICAL) return write(value, "$");
    throw err;
  }
}

/** What `write` throws for a value it refuses when it is not tracking paths (`at` null). */
const NOT_CANONICAL = new Error("no canonical JSON form");

function refused(at: string | null, what: string): Error {
  return at === null ? NOT_CANONICAL : new TypeError(`${at}: ${what}`);
}

/**
 * `at`: the JSON path of `value`, for the error of a value refused; null to track none (every
 * request of a batch is written at admission: building a path per value doubled the time), in
 * which case a refused value, or an array with holes (written as `Array.map` leaves them), throws
 * `NOT_CANONICAL` and `canonicalJson` writes it again with paths.
 */
function write(value: unknown, at: string | null): string {
  if (value === null) return "null";
  switch (typeof value) {
    case "string":
    case "boolean":
      return JSON.stringify(value);
    case "number":
      if (!Number.isFinite(value)) throw refused(at, "non-finite number has no canonical JSON form");
      return JSON.stringify(value);
    case "object": {
      if (Array.isArray(value)) {
        let out = "[";
        for (let i = 0; i < value.length; i++) {
          if (i > 0) out += ",";
          // A hole is written as nothing (as `Array.map` and `join` always left it); not when
          // tracking no path: written again with paths.
          if (!(i in value)) {
            if (at === null) throw NOT_CANONICAL;
            continue;
          }
          out += write(value[i], at === null ? null : `${at}[${i}]`);
        }
        return `${out}]`;
      }
      if (value instanceof Date) return JSON.stringify(value.toISOString());
      let out = "{";
      for (const k of Object.keys(value).sort()) {
        const v = (value as Record<string, unknown>)[k];
        if (v === undefined) continue;
        if (out.length > 1) out += ",";
        out += `${JSON.stringify(k)}:${write(v, at === null ? null : `${at}.${k}`)}`;
      }
      return `${out}}`;
    }
    default:
      throw refused(at, `a ${typeof value} has no canonical JSON form`);
  }
}

/** sha256 of a UTF-8 text, as lowercase hex. */
export function sha256Hex(text: string): string {
  // One-shot (`crypto.hash`, Node >= 20.12): half the time of a Hash object for a short text.
  return hash("sha256", text, "hex");
}
