import { capText, FleetError } from "@fleet/contracts";

/** A plain decimal number, as tests write it (`1`, `0.75`, `.5`, `1e-1`); no hex, no `Infinity`. */
const DECIMAL = /^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$/;

/**
 * The most of a reward file that is read (`verify` reads one byte more, to tell a longer file):
 * a longer one is not a number, whatever its first bytes say.
 */
export const MAX_REWARD_FILE_BYTES = 64 * 1024;

/**
 * Parse the content of a reward file: a finite number in [0, 1], surrounding whitespace allowed.
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
  if (!Number.isFinite(value) || value < 0 || value > 1) {
    throw FleetError.nonRetryable(
      "verifier_error",
      `reward file must hold a number in [0, 1], got ${JSON.stringify(capText(trimmed, 100))}`,
    );
  }
  // -0 parses from "-0"; store it as 0.
  return value === 0 ? 0 : value;
}
