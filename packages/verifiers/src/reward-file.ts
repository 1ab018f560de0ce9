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
  if (!Number.isFinite(value) || value < -REWARD_TOLERANCE || value > 1 + REWARD_TOLERANCE) {
    throw FleetError.nonRetryable(
      "verifier_error",
      `reward file must hold a number in [0, 1], got ${JSON.stringify(capText(trimmed, 100))}`,
    );
  }
  // Clamped into [0, 1]; -0 (parsed from "-0") stored as 0.
  return value <= 0 ? 0 : Math.min(value, 1);
}
