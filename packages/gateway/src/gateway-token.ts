import { createHash, randomBytes, timingSafeEqual } from "node:crypto";

const PREFIX = "fgw";

/** A freshly minted per-rollout token: what the client sends, and what the gateway keeps. */
export interface MintedToken {
  /** `fgw_<keyId>_<secret>`: handed to the rollout, never stored by the gateway. */
  token: string;
  /** Non-secret lookup key (64 random bits, hex). */
  keyId: string;
  /** sha256 of the secret part (256 random bits). */
  secretHash: Buffer;
}

function sha256(text: string): Buffer {
  return createHash("sha256").update(text, "utf8").digest();
}

/** Mint a token: a non-secret key id for lookup plus a 256-bit secret, kept only as its hash. */
export function mintToken(): MintedToken {
  const keyId = randomBytes(8).toString("hex");
  const secret = randomBytes(32).toString("base64url");
  return { token: `${PREFIX}_${keyId}_${secret}`, keyId, secretHash: sha256(secret) };
}

/** Split a presented token into its key id and secret; `null` when it is not one of ours. */
export function parseToken(presented: string): { keyId: string; secret: string } | null {
  const m = /^fgw_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$/.exec(presented);
  return m ? { keyId: m[1]!, secret: m[2]! } : null;
}

/** Constant-time check of a presented secret against the stored hash. */
export function secretMatches(secret: string, secretHash: Buffer): boolean {
  const presented = sha256(secret);
  return presented.length === secretHash.length && timingSafeEqual(presented, secretHash);
}

/** The bearer token of an `Authorization` header, or `null`. */
export function bearerToken(header: string | undefined): string | null {
  if (header === undefined) return null;
  const m = /^Bearer\s+(\S+)\s*$/i.exec(header);
  return m ? m[1]! : null;
}
