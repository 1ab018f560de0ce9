import { createHash, timingSafeEqual } from "node:crypto";

/** What a request's credentials allow. */
export type Access = "none" | "user" | "admin";

export interface TokenChecker {
  /** False when no token is configured: every request is let in (see README, "Auth"). */
  readonly enabled: boolean;
  /** Check an `Authorization` header value. */
  check(header: string | undefined): Access;
  /**
   * Check it, and say which configured token it is: `principal` is the token's sha256 in hex (a
   * name for it that is never the secret; "" when nothing matched or no token is configured).
   */
  identify(header: string | undefined): { access: Access; principal: string };
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
  const identify = (header: string | undefined): { access: Access; principal: string } => {
    if (known.length === 0) return { access: "admin", principal: "" };
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
    return { access, principal: access === "none" ? "" : presented.toString("hex") };
  };
  return {
    enabled: known.length > 0,
    check: (header) => identify(header).access,
    identify,
  };
}
