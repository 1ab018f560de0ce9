import { createHash, timingSafeEqual } from "node:crypto";

/** What a request's credentials allow. */
export type Access = "none" | "user" | "admin";

export interface TokenChecker {
  /** False when no token is configured: every request is let in (see README, "Auth"). */
  readonly enabled: boolean;
  /** Check an `Authorization` header value. */
  check(header: string | undefined): Access;
}

function digest(token: string): Buffer {
  return createHash("sha256").update(token, "utf8").digest();
}

/**
 * Bearer-token check. Every configured token is compared, always all of them, as sha256 digests
 * with `timingSafeEqual`: equal-length inputs, so neither a token's length nor how much of it
 * matched shows in the response time.
 */
export function createTokenChecker(
  tokens: readonly string[],
  adminTokens: readonly string[] = [],
): TokenChecker {
  const known = tokens.map((t) => ({ digest: digest(t), admin: adminTokens.includes(t) }));
  return {
    enabled: known.length > 0,
    check(header) {
      if (known.length === 0) return "admin";
      const match = /^Bearer[ \t]+(\S+)[ \t]*$/i.exec(header ?? "");
      // Still hash and compare something, so a missing header costs what a wrong one does.
      const presented = digest(match?.[1] ?? "");
      let access: Access = "none";
      for (const k of known) {
        if (timingSafeEqual(presented, k.digest) && match) {
          if (k.admin) access = "admin";
          else if (access === "none") access = "user";
        }
      }
      return access;
    },
  };
}
