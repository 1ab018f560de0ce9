import { capText, FleetError } from "@fleet/contracts";

/** A plain decimal number, as tests write it (`1`, `0.75`, `.5`, `1e-1`); no hex, no `Infinity`. */
const DECIMAL = /^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$/;

/**
 * The most of a reward file that is read (`verify` reads one byte more, to tell a longer file):
 * a longer one is not a number, whatever its first bytes say.
 */
export const MAX_REWARD_FILE_BYTES = 64 * 1024;

/**
 * How far past 0 or 1 a reward may land and still count as that bound: floating-point sums of
 * weights (`0.4 + 0.2 + 0.3 + 0.1` is `1.0000000000000002` in Python) are no broken grader.
 */
export const REWARD_TOLERANCE = 1e-9;

/**
 * Parse the content of a reward file: a finite number in [0, 1] (within `REWARD_TOLERANCE`,
 * clamped), surrounding whitespace allowed.
 *
 * @throws FleetError `verifier_error` (masked) for anything else: a broken grader is an
 * infrastructure fault, never a zero.
 */
export function parseReward(text: string): number {
  if (Buffer.byteLength(text) > MAX_REWARD_FILE_BYTES) {
    throw FleetError.nonRetryable(
      "verifier_error",
      `reward file is over ${MAX_REWARD_FILE_BYTES} bytes, so no number in [0, 1]`,
    );
  }
  const trimmed = text.trim();
  const value = DECIMAL.test(trimmed) ? Number(trimmed) : Number.NaN;
  const reward = inRange(value);
  if (reward === null) {
    throw FleetError.nonRetryable(
      "verifier_error",
      `reward file must hold a number in [0, 1], got ${JSON.stringify(capText(trimmed, 100))}`,
    );
  }
  return reward;
}

/** A finite number in [0, 1] (within `REWARD_TOLERANCE`), clamped; -0 is 0. `null` otherwise. */
function inRange(value: number): number | null {
  if (!Number.isFinite(value) || value < -REWARD_TOLERANCE || value > 1 + REWARD_TOLERANCE) return null;
  return value <= 0 ? 0 : Math.min(value, 1);
}

/** Most numeric fields of a reward.json kept beside its reward (in the verdict's details). */
const MAX_REWARD_FIELDS = 32;
/** The fields kept from a reward.json, as JSON, at most this many bytes. */
export const MAX_REWARD_FIELDS_BYTES = 4096;

/**
 * Parse a Harbor `reward.json`: a JSON object whose `reward` is a number in [0, 1] (as
 * `parseReward`); its other numeric fields (a grader's sub-scores, not booleans) come back as
 * `fields`, at most `MAX_REWARD_FIELDS`, for the verdict's details.
 *
 * @throws FleetError `verifier_error` (masked) for anything else: not JSON, not an object, no
 * numeric `reward`, one out of range.
 */
export function parseRewardJson(text: string): { reward: number; fields: Record<string, number> } {
  const refuse = (why: string): never => {
    throw FleetError.nonRetryable(
      "verifier_error",
      `reward.json must be a JSON object with a "reward" number in [0, 1]: ${why}`,
    );
  };
  if (Buffer.byteLength(text) > MAX_REWARD_FILE_BYTES) refuse(`it is over ${MAX_REWARD_FILE_BYTES} bytes`);
  let parsed: unknown;
  try {
    // One byte order mark first (Python's utf-8-sig, PowerShell) is no part of the JSON: taken
    // off, as `parseReward`'s trim takes it off a reward.txt, whichever way the file was read.
    parsed = JSON.parse(text.startsWith("\ufeff") ? text.slice(1) : text);
  } catch {
    return refuse(`it is not JSON (${JSON.stringify(capText(text.trim(), 100))})`);
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    return refuse(`got ${JSON.stringify(capText(text.trim(), 100))}`);
  }
  const value = (parsed as Record<string, unknown>).reward;
  const reward = typeof value === "number" ? inRange(value) : null;
  if (reward === null) {
    // A number as it reads (1e309 parses to Infinity, which JSON would print as null).
    const shown = typeof value === "number" ? String(value) : (JSON.stringify(value) ?? "missing");
    return refuse(`its "reward" is ${capText(shown, 100)}`);
  }
  const fields: Record<string, number> = {};
  // Bounded in bytes as stored (JSON), not only in count and characters: a name of control
  // characters is six bytes each, which took a result past its record cap.
  let bytes = 2;
  for (const [k, v] of Object.entries(parsed)) {
    if (Object.keys(fields).length >= MAX_REWARD_FIELDS) break;
    if (k === "reward" || typeof v !== "number" || !Number.isFinite(v)) continue;
    const name = capText(k, 100);
    const size = Buffer.byteLength(JSON.stringify(name)) + JSON.stringify(v).length + 2;
    if (bytes + size > MAX_REWARD_FIELDS_BYTES) break;
    bytes += size;
    fields[name] = v;
  }
  return { reward, fields };
}
