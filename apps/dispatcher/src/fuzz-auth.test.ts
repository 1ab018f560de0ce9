import fc from "fast-check";
import { beforeEach, describe, expect, it, vi } from "vitest";

// Spy on the comparison the checker must use (the real implementation still runs).
const compared = vi.hoisted(() => ({ calls: [] as [Buffer, Buffer][] }));
vi.mock("node:crypto", async (importOriginal) => {
  const real = await importOriginal<typeof import("node:crypto")>();
  return {
    ...real,
    timingSafeEqual: (a: NodeJS.ArrayBufferView, b: NodeJS.ArrayBufferView) => {
      compared.calls.push([
        Buffer.from(a.buffer, a.byteOffset, a.byteLength),
        Buffer.from(b.buffer, b.byteOffset, b.byteLength),
      ]);
      return real.timingSafeEqual(a, b);
    },
  };
});

const { createHash } = await import("node:crypto");
const { createTokenChecker } = await import("./auth.ts");

const sha = (t: string) => createHash("sha256").update(t, "utf8").digest();
const TOKENS = ["s", "a-much-longer-user-token-0123456789abcdef", "boss-token"];

describe("bearer token comparison is constant-time (timingSafeEqual over sha256 digests)", () => {
  const checker = createTokenChecker(TOKENS, ["boss-token"]);
  beforeEach(() => {
    compared.calls = [];
  });

  it("compares equal-length digests against every configured token, whatever is presented", () => {
    fc.assert(
      fc.property(
        fc.oneof(
          fc.string({ maxLength: 2_000 }),
          fc.constantFrom(...TOKENS),
          fc.constantFrom("", "s2", "boss-token-but-longer", "boss-toke"),
        ),
        fc.constantFrom("Bearer ", "bearer ", "Bearer\t", "Basic ", ""),
        (presented, scheme) => {
          compared.calls = [];
          const header = `${scheme}${presented}`;
          const access = checker.check(header);
          // Always one comparison per configured token (no early exit on a match or a miss)...
          expect(compared.calls).toHaveLength(TOKENS.length);
          for (const [a, b] of compared.calls) {
            // ...of two sha256 digests: equal lengths, so neither the presented token's length
            // nor how much of it matched can show in the time taken.
            expect(a.length).toBe(32);
            expect(b.length).toBe(32);
          }
          const configured = compared.calls.map(([, b]) => b.toString("hex")).sort();
          expect(configured).toEqual(TOKENS.map((t) => sha(t).toString("hex")).sort());
          const bearer = /^bearer[ \t]+(\S+)[ \t]*$/i.exec(header)?.[1];
          const expected =
            bearer === "boss-token"
              ? "admin"
              : bearer !== undefined && TOKENS.includes(bearer)
                ? "user"
                : "none";
          expect(access).toBe(expected);
        },
      ),
      { numRuns: 300 },
    );
  });

  it("a missing header still costs one comparison per token", () => {
    expect(checker.check(undefined)).toBe("none");
    expect(compared.calls).toHaveLength(TOKENS.length);
    expect(compared.calls.every(([a]) => a.equals(sha("")))).toBe(true);
  });

  it("handles tokens of very different lengths without throwing (raw timingSafeEqual would)", () => {
    expect(() => checker.check(`Bearer ${"x".repeat(100_000)}`)).not.toThrow();
    expect(checker.check("Bearer s")).toBe("user");
    expect(checker.check(`Bearer ${TOKENS[1]}`)).toBe("user");
    expect(checker.check("Bearer boss-token")).toBe("admin");
  });
});
