import { createHash } from "node:crypto";

/**
 * Canonical JSON: object keys sorted (by UTF-16 code unit), no whitespace, `undefined`
 * properties dropped. Two values that mean the same give the same text, whatever order their
 * keys were written in. Non-finite numbers, functions, bigints and symbols are refused rather
 * than silently turned into `null`.
 */
export function canonicalJson(value: unknown): string {
  return write(value, "$");
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
  return createHash("sha256").update(text, "utf8").digest("hex");
}
