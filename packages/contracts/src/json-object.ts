import { z } from "zod";

/** How deep a `JsonObject` is searched (a request nested deeper is refused at admission anyway). */
const MAX_SEARCH_DEPTH = 64;

/** Why a `__proto__` key is refused, said where one is found. */
export const PROTO_KEY_MESSAGE =
  'is a "__proto__" key, which JavaScript readers drop (it names an object\'s prototype): rename it';

/**
 * A free JSON object (`metadata`): string keys, any JSON values, and no `__proto__` key at any
 * depth: refused, not lost. JSON.parse makes one an own key, but zod's record skips it, and an
 * object spread, assignment or copy takes it for the object's prototype, so it would vanish
 * without a word. (The dispatcher's JSON parser refuses one in a request body already; this holds
 * for every other reader of the contract: the task loader, a client checking its rows.)
 */
export const JsonObject: z.ZodType<Record<string, unknown>, Record<string, unknown>> = z.preprocess(
  (value, ctx) => {
    const at = protoKeyPath(value, 0);
    if (at !== null) ctx.addIssue({ code: "custom", path: at, message: PROTO_KEY_MESSAGE, input: value });
    return value;
  },
  z.record(z.string(), z.unknown()),
);
export type JsonObject = z.infer<typeof JsonObject>;

/** The path to the first own `__proto__` key in `value`, or `null`. */
function protoKeyPath(value: unknown, depth: number): PropertyKey[] | null {
  if (value === null || typeof value !== "object" || depth > MAX_SEARCH_DEPTH) return null;
  if (Object.hasOwn(value, "__proto__")) return ["__proto__"];
  for (const [key, item] of Object.entries(value)) {
    const below = protoKeyPath(item, depth + 1);
    if (below !== null) return [Array.isArray(value) ? Number(key) : key, ...below];
  }
  return null;
}
