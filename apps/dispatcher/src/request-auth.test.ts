import { createHash } from "node:crypto";
import { describe, expect, it } from "vitest";
import { createAuthenticator, isAdminPath, sameOrigin } from "./request-auth.ts";
import { SESSION_COOKIE } from "./session.ts";

const now = () => 1_700_000_000_000;

describe("createAuthenticator", () => {
  const auth = createAuthenticator(["u"], [], now);
  const admin = createAuthenticator(["u", "a"], ["a"], now);

  it("takes a bearer token anywhere, and the session cookie only under /admin", () => {
    expect(auth.authenticate({ url: "/v1/rollouts", headers: { authorization: "Bearer u" } })).toEqual({
      access: "user",
      via: "bearer",
      principal: createHash("sha256").update("u").digest("hex"),
    });
    const session = admin.login("a")!;
    const cookie = `${SESSION_COOKIE}=${session}`;
    expect(admin.authenticate({ url: "/admin/queues/api/queues", headers: { cookie } })).toEqual({
      access: "admin",
      via: "session",
      principal: "session",
    });
    // The API does not take the board's cookie.
    expect(admin.authenticate({ url: "/v1/rollouts", headers: { cookie } }).access).toBe("none");
    // A bearer header decides when present, even next to a valid cookie.
    expect(
      admin.authenticate({ url: "/admin/queues", headers: { cookie, authorization: "Bearer x" } }).access,
    ).toBe("none");
  });

  it("names each token apart, and never by its value", () => {
    const who = (token: string) =>
      admin.authenticate({ url: "/v1/rollouts", headers: { authorization: `Bearer ${token}` } }).principal;
    expect(who("u")).not.toBe(who("a"));
    expect(who("u")).toBe(who("u"));
    expect(who("u")).not.toContain("u");
    expect(who("wrong")).toBe("");
  });

  it("signs in only a configured token", () => {
    expect(auth.login("u")).toMatch(/^v1\./);
    expect(auth.login("nope")).toBeNull();
    expect(auth.login("u extra")).toBeNull();
  });

  it("with no token configured lets everyone in (auth off)", () => {
    const open = createAuthenticator([], [], now);
    expect(open.enabled).toBe(false);
    expect(open.authenticate({ url: "/v1/rollouts", headers: {} })).toEqual({
      access: "admin",
      via: "open",
      principal: "",
    });
  });
});

describe("isAdminPath / sameOrigin", () => {
  it("matches /admin and below only", () => {
    expect(isAdminPath("/admin")).toBe(true);
    expect(isAdminPath("/admin/queues?x=1")).toBe(true);
    expect(isAdminPath("/administrator")).toBe(false);
    expect(isAdminPath("/v1/admin/x")).toBe(false);
  });

  it("compares Origin (or Referer) with Host", () => {
    expect(sameOrigin({ host: "fleet:8080", origin: "http://fleet:8080" })).toBe(true);
    expect(sameOrigin({ host: "fleet:8080", origin: "http://evil.example" })).toBe(false);
    expect(sameOrigin({ host: "fleet:8080", origin: "http://fleet:9090" })).toBe(false);
    expect(sameOrigin({ host: "fleet:8080", referer: "http://fleet:8080/admin/queues" })).toBe(true);
    expect(sameOrigin({ host: "fleet:8080", origin: "null" })).toBe(false);
    expect(sameOrigin({ host: "fleet:80", origin: "http://fleet" })).toBe(true);
    expect(sameOrigin({ host: "fleet", origin: "https://fleet:443" })).toBe(true);
    expect(sameOrigin({ host: "fleet:80", origin: "https://fleet" })).toBe(false);
    expect(sameOrigin({ host: "fleet:8080" })).toBeNull();
    // Another site's page that withheld its Referer: the browser still says so.
    expect(sameOrigin({ host: "fleet:8080", "sec-fetch-site": "cross-site" })).toBe(false);
    expect(sameOrigin({ host: "fleet:8080", "sec-fetch-site": "same-site" })).toBe(false);
    expect(sameOrigin({ host: "fleet:8080", "sec-fetch-site": "same-origin" })).toBeNull();
    expect(sameOrigin({ host: "fleet:8080", "sec-fetch-site": "none" })).toBeNull();
  });
});
