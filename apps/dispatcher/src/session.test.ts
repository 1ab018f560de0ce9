import { describe, expect, it } from "vitest";
import { createSessionCodec, readCookie, SESSION_COOKIE, sessionCookie } from "./session.ts";

const NOW = 1_700_000_000_000;

describe("createSessionCodec", () => {
  const codec = createSessionCodec(["user-tok", "boss-tok"], ["boss-tok"], 60_000);

  it("issues a session that holds neither token and grants what the token grants", () => {
    const user = codec.issue("user-tok", NOW)!;
    const admin = codec.issue("boss-tok", NOW)!;
    expect(user).not.toContain("user-tok");
    expect(admin).not.toContain("boss-tok");
    expect(codec.verify(user, NOW + 1000)).toBe("user");
    expect(codec.verify(admin, NOW + 1000)).toBe("admin");
    expect(codec.issue("nope", NOW)).toBeNull();
  });

  it("refuses an expired, tampered or foreign session", () => {
    const user = codec.issue("user-tok", NOW)!;
    expect(codec.verify(user, NOW + 60_001)).toBe("none");
    const [v, tid, exp, sig] = user.split(".");
    // A later expiry or another token id breaks the signature.
    expect(codec.verify([v, tid, String(Number(exp) + 10_000_000), sig].join("."), NOW)).toBe("none");
    const admin = codec.issue("boss-tok", NOW)!;
    expect(codec.verify([v, admin.split(".")[1], exp, sig].join("."), NOW)).toBe("none");
    expect(codec.verify(`${user}x`, NOW)).toBe("none");
    expect(codec.verify(undefined, NOW)).toBe("none");
    expect(codec.verify("garbage", NOW)).toBe("none");
    // Another configuration (tokens rotated) does not accept it.
    const rotated = createSessionCodec(["user-tok", "boss-tok", "new"], ["boss-tok"], 60_000);
    expect(rotated.verify(user, NOW)).toBe("none");
  });

  it("grants admin only through the id of a configured admin token", () => {
    // With no admin token configured, a session never grants admin, whatever it says.
    const solo = createSessionCodec(["only"], [], 60_000);
    const s = solo.issue("only", NOW)!;
    expect(solo.verify(s, NOW)).toBe("user");
  });
});

describe("cookies", () => {
  it("sets HttpOnly, SameSite=Strict, Path=/admin, and Secure only over HTTPS", () => {
    const c = sessionCookie("v1.a.b.c", { secure: false });
    expect(c).toMatch(new RegExp(`^${SESSION_COOKIE}=v1\\.a\\.b\\.c; `));
    expect(c).toContain("HttpOnly");
    expect(c).toContain("SameSite=Strict");
    expect(c).toContain("Path=/admin");
    expect(c).not.toContain("Secure");
    expect(sessionCookie("x", { secure: true })).toContain("Secure");
    expect(sessionCookie(null, { secure: false })).toContain("Max-Age=0");
  });

  it("reads one cookie out of a Cookie header", () => {
    expect(readCookie(`a=1; ${SESSION_COOKIE}=v1.x.y.z; b=2`, SESSION_COOKIE)).toBe("v1.x.y.z");
    expect(readCookie("a=1", SESSION_COOKIE)).toBeUndefined();
    expect(readCookie(undefined, SESSION_COOKIE)).toBeUndefined();
  });
});
