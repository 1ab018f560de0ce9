import { z } from "zod";
import { capText, Seconds } from "./bounded.ts";
import { JsonObject } from "./json-object.ts";

/** Directories a task file may be nested in, at most (each one is a directory the sandbox gets). */
export const MAX_PATH_DEPTH = 32;
/** Bytes in one segment of a path, at most (Linux's NAME_MAX). */
export const MAX_NAME_BYTES = 255;
/**
 * Files and the directories they imply, at most, in one file set: each is an entry of the tar
 * a worker builds in memory to stage them (20,000 files in distinct deep directories of a 10 MiB
 * task would be millions of entries, gigabytes).
 */
export const MAX_FILESET_ENTRIES = 10_000;

/** Whether a string is well-formed Unicode: no lone UTF-16 surrogate (ES2024, Node ≥ 20). */
function isWellFormed(s: string): boolean {
  return (s as string & { isWellFormed(): boolean }).isWellFormed();
}

const NOT_WELL_FORMED =
  "must be well-formed Unicode (a lone UTF-16 surrogate would be staged as U+FFFD, not as sent)";

/**
 * Text staged or shown as UTF-8: a lone surrogate has no UTF-8 spelling (encoders write U+FFFD),
 * so two different strings would stage the same bytes, and the digest would not name them.
 */
export const WellFormedText = z.string().refine(isWellFormed, { message: NOT_WELL_FORMED });

/**
 * Relative POSIX path inside a task directory: no absolute paths, no `..`, no NUL, and spelled
 * plainly (`a/b`, as `normalizeRelativePath` writes it: no `./`, `//`, `/./` or trailing `/`), so
 * one set of files has one spelling, and one task one digest.
 */
export const RelativePath = z
  .string()
  .min(1)
  .max(512)
  .refine((p) => !p.startsWith("/") && !p.split("/").includes("..") && !p.includes("\0"), {
    message: "must be a relative path without '..'",
  })
  .refine(isWellFormed, { message: NOT_WELL_FORMED })
  // Every file of every task row comes through here: its segments are split once.
  .superRefine((p, ctx) => {
    const segments = pathSegments(p);
    const problem = (message: string) => ctx.addIssue({ code: "custom", message });
    if (segments.length === 0) problem("must name a file, not '.' or the directory itself");
    else if (segments.length !== p.split("/").length) problem(`must be spelled "${segments.join("/")}"`);
    if (segments.length > MAX_PATH_DEPTH + 1)
      problem(`must be nested in at most ${MAX_PATH_DEPTH} directories`);
    if (!segments.every((s) => Buffer.byteLength(s) <= MAX_NAME_BYTES)) {
      problem(`each name in the path must be at most ${MAX_NAME_BYTES} bytes`);
    }
  });

/** A relative path's segments, without empty and `.` ones (`a//./b` → `a`, `b`). */
function pathSegments(p: string): string[] {
  return p.split("/").filter((s) => s !== "" && s !== ".");
}

/** A relative path as one spelling: `./a//b` → `a/b` (how file modes name files). */
export function normalizeRelativePath(p: string): string {
  return pathSegments(p).join("/");
}

/** The file trees of a task, each staged into its own sandbox directory. */
export const TASK_FILE_SETS = ["workspace", "solution", "tests"] as const;
export type TaskFileSet = (typeof TASK_FILE_SETS)[number];

/**
 * A file's permission bits as three octal digits (`"644"`, `"755"`, `"600"`). No setuid, setgid
 * or sticky bit: staged files are the task's data, not privileges.
 */
export const FileMode = z.string().regex(/^[0-7]{3}$/, 'must be three octal digits, e.g. "644" or "755"');

/** Why a file set (or a task directory, `@fleet/tasks`) holding too many entries is refused. */
export const FILESET_TOO_LARGE = `holds more than ${MAX_FILESET_ENTRIES} files and directories`;

/**
 * A set of text files: relative path (spelled plainly, so two keys never name the same file) →
 * UTF-8 content. A file may not be another's directory (`a` and `a/b`): no tar of them could be
 * unpacked as given.
 */
export const FileSet = z.record(RelativePath, WellFormedText).superRefine((files, ctx) => {
  const paths = new Set(Object.keys(files));
  const dirs = new Set<string>();
  for (const path of paths) {
    // Each parent directory, by the position of each `/`.
    for (let i = path.indexOf("/"); i !== -1; i = path.indexOf("/", i + 1)) {
      const parent = path.slice(0, i);
      dirs.add(parent);
      if (paths.has(parent)) {
        ctx.addIssue({
          code: "custom",
          path: [parent],
          message: `is a file, but "${path}" needs it as a directory`,
        });
      }
    }
    if (paths.size + dirs.size > MAX_FILESET_ENTRIES) {
      ctx.addIssue({
        code: "custom",
        path: [],
        message: FILESET_TOO_LARGE,
      });
      return;
    }
  }
});
export type FileSet = z.infer<typeof FileSet>;

/**
 * Bytes `files` take at least once staged on a tmpfs: each file's UTF-8 content rounded up to
 * whole 4 KiB pages (an empty file takes none). A sandbox directory capped below this cannot
 * hold them, whatever else is there.
 */
export function stagedBytes(files: FileSet): number {
  let bytes = 0;
  for (const content of Object.values(files)) bytes += Math.ceil(Buffer.byteLength(content) / 4096) * 4096;
  return bytes;
}

/** How a task's result is graded. */
export const VerifierSpec = z.discriminatedUnion("kind", [
  /** Run `tests/test.sh` in the task sandbox: exit 0 → 1.0, or the reward file it writes. */
  z.strictObject({ kind: z.literal("tests") }),
  /** Compare the agent's final answer (its stdout, trimmed) with `expected`. */
  z.strictObject({
    kind: z.literal("match"),
    expected: WellFormedText,
    mode: z.enum(["exact", "regex"]).default("exact"),
  }),
]);
export type VerifierSpec = z.infer<typeof VerifierSpec>;

/**
 * The regular expression a `regex` match verifier grades with: `expected` trimmed (a TOML
 * multi-line string ends in a newline no trimmed answer could match), matching the whole
 * trimmed answer. The loader, the schema and the grader all compile this one. JavaScript syntax,
 * without the `u` flag; another dialect's anchors (`\A`, `\Z`, `\z`, `\G`), escapes (`\p{L}`,
 * `\h`, `\Q`, `\R`, `\u{e9}`, `\x{e9}`…), POSIX classes (`[[:digit:]]`) and a character above
 * U+FFFF in a class or before a quantifier are refused (see `foreignRegexSyntax`): JavaScript
 * would read them as something else and silently grade every answer 0.
 *
 * @throws SyntaxError when it is not a valid regular expression, or uses another dialect's syntax.
 */
export function matchPattern(expected: string): RegExp {
  const pattern = expected.trim();
  const foreign = foreignRegexSyntax(pattern);
  if (foreign !== undefined) throw new SyntaxError(foreign);
  return new RegExp(`^(?:${lfLineEnds(pattern)})$`);
}

/**
 * `pattern` with each escaped CRLF (`\r\n`, or `\r` before a line break) outside a character
 * class as `\n`, as `comparableAnswer` turns the answer's: answers are compared with LF line
 * ends, where a CR before an LF is never left, so as written it could never match (every agent
 * graded 0, the reference answer too). A `[\r\n]`, `\r?\n`, a `\r\n?` or `\r\n*` (which a lone
 * CR matches) and one in a negative lookaround (`(?!\r\n)`, which always passes) are left as they
 * are. (`\x0d\x0a` and the like are not rewritten.)
 */
function lfLineEnds(pattern: string): string {
  let out = "";
  let inClass = false;
  // The open groups, each whether it is a negative lookaround: there a `\r\n` that never
  // matches makes the group always pass, which `\n` would change.
  const groups: boolean[] = [];
  let negative = 0;
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i]!;
    if (c === "\\") {
      const escaped = pattern.slice(i, i + 2);
      if (!inClass && negative === 0 && escaped === "\\r") {
        const lf = pattern.startsWith("\\n", i + 2) ? 2 : pattern[i + 2] === "\n" ? 1 : 0;
        // Not when its `\n` may be absent (`?`, `*`, `{0,…}`): that also matches a lone CR.
        if (lf > 0 && !/^(?:[?*]|\{0)/.test(pattern.slice(i + 2 + lf, i + 4 + lf))) {
          out += "\\n";
          i += 1 + lf;
          continue;
        }
      }
      out += escaped;
      i++;
    } else {
      if (c === "[" && !inClass) inClass = true;
      else if (c === "]" && inClass) inClass = false;
      else if (c === "(" && !inClass) {
        const isNegative = pattern.startsWith("(?!", i) || pattern.startsWith("(?<!", i);
        groups.push(isNegative);
        if (isNegative) negative++;
      } else if (c === ")" && !inClass && groups.pop() === true) negative--;
      out += c;
    }
  }
  return out;
}

/**
 * Escapes of other dialects that JavaScript without the `u` flag (as the grader compiles) reads
 * as the bare letter, with what each is there and what to write instead.
 */
const OTHER_DIALECT_ESCAPES: Record<string, string> = {
  p: 'a Unicode property class (`\\p{L}`), which JavaScript reads without the `u` flag as the letters "p{L}": use a class such as [A-Za-z\\u00C0-\\u024F]',
  P: 'a negated Unicode property class (`\\P{L}`), which JavaScript reads without the `u` flag as the letters "P{L}": use a negated class',
  h: 'PCRE\'s horizontal whitespace, a literal "h" in JavaScript: use [ \\t]',
  Q: 'PCRE\'s quoting (`\\Q…\\E`), a literal "Q" in JavaScript: escape each special character instead',
  R: 'PCRE\'s line break, a literal "R" in JavaScript: use \\n (answers are compared with LF line ends)',
  K: 'PCRE\'s match reset, a literal "K" in JavaScript: the pattern matches the whole answer, so drop it',
  X: 'PCRE\'s grapheme cluster, a literal "X" in JavaScript: use [\\s\\S] for one character, or a class of what you mean',
};

/**
 * The letters JavaScript without the `u` flag gives an escape of its own (`\b`, `\d`, `\cJ`,
 * `\k<name>`…; `\x` and `\u` only with their hex digits): any other escaped letter is read as
 * the bare letter, which no pattern written for JavaScript means (the `u` flag refuses it).
 */
const JS_LETTER_ESCAPES = new Set("bBcdDfknrsStuvwWx");

/** A quantifier at the start of a string: `*`, `+`, `?` or `{n}`, `{n,}`, `{n,m}`. */
const QUANTIFIER = /^(?:[*+?]|\{\d+(?:,\d*)?\})/;

/**
 * Why `pattern` holds another dialect's syntax that JavaScript reads as something else, or
 * `undefined`: an escape `\A`, `\Z`, `\z` or `\G` (Python's, PCRE's anchors; literal letters
 * here), `\p`/`\P` (property classes, which need the `u` flag), `\h`, `\Q`, `\R`, `\K` or `\X`
 * (PCRE's), any other escaped letter JavaScript has no escape for (`\e`, `\N`…: the letter),
 * `\u{…}` or `\x{…}` (code point escapes: a "u" repeated, an "x"), a `\u` or `\x` without its
 * four or two hex digits, a POSIX class `[[:name:]]` (a class of `[`, `:` and letters here, then
 * a literal `]`), or a character above U+FFFF (an emoji) in a character class or before a
 * quantifier: without the `u` flag it is two UTF-16 units, so `[😀😁]` matches half a character
 * and `😀+` repeats only its second half.
 *
 * Refused rather than compiled with the `u` flag, which would mean them: the `u` flag refuses
 * escapes patterns that work today use (`\-`, `\"` outside a class), and in Node 20 a `u`
 * pattern has no linear-time fallback when it backtracks catastrophically (see the grader), so
 * a correct answer could time out where it matches today.
 */
export function foreignRegexSyntax(pattern: string): string | undefined {
  let inClass = false;
  // In a class: its last atom (whether it is one escaped surrogate, and whether it ended a
  // range), and a range operator waiting for its end (whether it started at such a surrogate).
  let last: { surrogate: boolean; endsRange: boolean } | null = null;
  let rangeFrom: "surrogate" | "other" | null = null;
  const atom = (surrogate: boolean) => {
    last = { surrogate, endsRange: rangeFrom !== null };
    rangeFrom = null;
  };
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i];
    const astral = astralLength(pattern, i);
    // In a class, two surrogate escapes one of which is the end of a surrogate range
    // (`[\uD800-\uDBFF\uDC00-\uDFFF]`) are two UTF-16 units meant as such, not one character:
    // read as the escapes they are. (A range to one from anything else, `[a-\uD83D\uDE00]`, or
    // after a `-` that is no range's, `[a-b-\uD83D\uDE00]`, is an emoji in a class.)
    const unitsInRange =
      inClass &&
      astral === 12 &&
      (rangeFrom === "surrogate" ||
        (pattern[i + 12] === "-" && SURROGATE_ESCAPE.test(pattern.slice(i + 13, i + 19))));
    if (unitsInRange) {
      atom(true);
      atom(true);
      i += 11;
      continue;
    }
    if (astral > 0) {
      const spelled = pattern.slice(i, i + astral);
      const halves =
        "is a character above U+FFFF, which JavaScript without the `u` flag reads as two UTF-16 units";
      if (inClass) {
        return `${spelled} in a character class ${halves}, so the class matches half a character: use an alternation, such as (?:${spelled}|…)`;
      }
      const quantifier = QUANTIFIER.exec(pattern.slice(i + astral))?.[0];
      if (quantifier !== undefined) {
        return `${spelled} before a quantifier (${quantifier}) ${halves}, so only its second half is repeated: group it, as (?:${spelled})${quantifier}`;
      }
      i += astral - 1;
    } else if (c === "\\") {
      const next = pattern[i + 1] ?? "";
      if (next === "A" || next === "Z" || next === "z" || next === "G") {
        return `\\${next} is another dialect's anchor, a literal "${next}" in JavaScript: the pattern already matches the whole answer (drop it)`;
      }
      const other = OTHER_DIALECT_ESCAPES[next];
      if (other !== undefined) return `\\${next} is ${other}`;
      if ((next === "u" || next === "x") && pattern[i + 2] === "{") {
        return `\\${next}{…} is a code point escape, which JavaScript reads without the \`u\` flag as a literal "${next}" (repeated, when a number follows): write the character itself, or \\uXXXX`;
      }
      if (next === "u" && !/^[0-9A-Fa-f]{4}/.test(pattern.slice(i + 2, i + 6))) {
        return '\\u without four hex digits is a literal "u" in JavaScript: write \\uXXXX';
      }
      if (next === "x" && !/^[0-9A-Fa-f]{2}/.test(pattern.slice(i + 2, i + 4))) {
        return '\\x without two hex digits is a literal "x" in JavaScript: write \\xHH';
      }
      if (/^[A-Za-z]$/.test(next) && !JS_LETTER_ESCAPES.has(next)) {
        return `\\${next} is no JavaScript escape (another dialect's?), a literal "${next}" in JavaScript: write the letter without the backslash, or JavaScript's escape for what you mean`;
      }
      if (inClass) atom(SURROGATE_ESCAPE.test(pattern.slice(i, i + 6)));
      // The escaped character, and a \uHHHH's or \xHH's digits.
      i += next === "u" ? 5 : next === "x" ? 3 : 1;
    } else if (c === "[" && /^\[:[a-z]+:\]/.test(pattern.slice(i + 1))) {
      return `${pattern.slice(i, pattern.indexOf("]", i) + 2)} is a POSIX class, which JavaScript does not have: use \\d, \\s, \\w or a range such as [0-9]`;
    } else if (c === "[" && !inClass) {
      inClass = true;
      last = null;
      rangeFrom = null;
    } else if (c === "]" && inClass) {
      inClass = false;
    } else if (inClass) {
      // A `-` between an atom that ended no range and one more is a range's; any other, a literal.
      const lastAtom = last as { surrogate: boolean; endsRange: boolean } | null;
      if (c === "-" && lastAtom !== null && !lastAtom.endsRange && pattern[i + 1] !== "]") {
        rangeFrom = lastAtom.surrogate ? "surrogate" : "other";
        last = null;
      } else atom(false);
    }
  }
  return undefined;
}

/** One UTF-16 surrogate escaped, `\uD800` to `\uDFFF` (the other end of a surrogate range). */
const SURROGATE_ESCAPE = /^\\u[dD][89a-fA-F][0-9a-fA-F]{2}$/;

/** A surrogate pair escaped as two `\uHHHH`: one character above U+FFFF, spelled in ASCII. */
const ESCAPED_PAIR = /^\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}/;

/**
 * The length in `pattern` of a character above U+FFFF that starts at `i` (as written, `\`-escaped,
 * or as a pair of `\uHHHH` escapes), or 0 when none does.
 */
function astralLength(pattern: string, i: number): number {
  const isPair = (at: number) => (pattern.codePointAt(at) ?? 0) > 0xffff;
  if (isPair(i)) return 2;
  if (pattern[i] !== "\\") return 0;
  if (isPair(i + 1)) return 3;
  return ESCAPED_PAIR.test(pattern.slice(i, i + 12)) ? 12 : 0;
}

/** Characters of an agent's final answer that are kept (and graded): the rest is cut. */
export const MAX_ANSWER_CHARS = 4000;

/**
 * An answer (or an exact `expected`) as compared: Unicode NFC (an accented letter typed as one
 * code point or as a letter and a combining mark is one answer), CRLF line ends as LF, and
 * trimmed of white space and zero-width characters at either end.
 */
export function comparableAnswer(text: string): string {
  return trimAnswer(text.normalize("NFC").replace(/\r\n/g, "\n"));
}

/** A character `comparableAnswer` trims (every one is a single UTF-16 unit). */
const TRIMMED_CHAR = /[\s\u200b-\u200d\u2060]/;

/**
 * A character that shows something: neither white space nor one of Unicode's default-ignorable
 * code points (the zero-width ones `comparableAnswer` trims, and a soft hyphen, variation
 * selectors, invisible operators, the Hangul fillers). One regex test, no backtracking.
 */
const VISIBLE_CHAR = /[^\s\p{Default_Ignorable_Code_Point}]/u;

/** Whether `text` shows nothing: white space, zero-width and other invisible characters only. */
export function isBlank(text: string): boolean {
  return !VISIBLE_CHAR.test(text);
}

/**
 * `text` without trimmed characters at either end, in one pass from each end. Not a regex: an
 * anchored `[…]+$` is tried from every position of a run of white space that something follows,
 * quadratic in the run, and an agent's output of 256 KiB of newlines before a word held a worker's
 * event loop for 50 s (its other jobs' locks lapsing meanwhile).
 */
function trimAnswer(text: string): string {
  let start = 0;
  let end = text.length;
  while (start < end && TRIMMED_CHAR.test(text[start]!)) start++;
  while (end > start && TRIMMED_CHAR.test(text[end - 1]!)) end--;
  return text.slice(start, end);
}

/**
 * The final answer a harness keeps of the agent's text: `comparableAnswer`, then cut to
 * `MAX_ANSWER_CHARS` (marked as cut), and whether it was cut. Compared before the cut, so the
 * text a verifier compares is the agent's as far as it is kept; a cut answer is not the agent's
 * whole answer, and a match verifier grades it 0 (`answerTruncated`).
 */
export function keptAnswer(text: string): { answer: string; truncated: boolean } {
  const whole = comparableAnswer(text);
  return { answer: capText(whole, MAX_ANSWER_CHARS), truncated: whole.length > MAX_ANSWER_CHARS };
}

/**
 * Why a match verifier's `expected` cannot grade, or `undefined` when it can: blank, (exact)
 * longer than any kept answer, or (regex mode) not a valid regular expression on its own and as
 * {@link matchPattern} compiles it, or one that matches an empty answer. An agent that prints
 * nothing (even one killed at its deadline) would pass the first and the last; none would pass
 * the second.
 */
export function matchExpectedProblem(spec: {
  expected: string;
  mode: "exact" | "regex";
}): string | undefined {
  const expected = spec.expected.trim();
  if (expected === "") return "is blank, so an agent that prints nothing would pass";
  if (spec.mode === "exact") {
    // As compared: NFC may lengthen it (U+FB2C is three code points in NFC), a CRLF shortens it.
    return comparableAnswer(expected).length > MAX_ANSWER_CHARS
      ? `is longer than the ${MAX_ANSWER_CHARS} characters an answer is kept to, so no answer could match`
      : undefined;
  }
  // The answer is compared in NFC with LF line ends (`comparableAnswer`); a pattern written
  // otherwise (decomposed accents, typed on some systems; a CRLF from a Windows editor) could
  // never match it, and every agent would score 0.
  if (expected.normalize("NFC") !== expected) {
    return "is not in Unicode NFC (an accented letter as a letter and a combining mark), while answers are compared in NFC, so it could never match: write it in NFC";
  }
  if (expected.includes("\r")) {
    return "holds a carriage return, while answers are compared with LF line ends, so it could never match: use \\n";
  }
  let pattern: RegExp;
  try {
    pattern = matchPattern(spec.expected);
    // And on its own: `a)|(b` compiles inside the whole-answer group, as `^(?:a)|(b)$`, which
    // anchors neither alternative to the whole answer.
    new RegExp(expected);
  } catch (err) {
    return `is not a valid regular expression: ${(err as Error).message}`;
  }
  if (pattern.test("")) return "matches an empty answer, so an agent that prints nothing would pass";
  return undefined;
}

/** A `#!` line as the kernel reads it: the interpreter, then the rest of the line (one argument). */
const SHEBANG = /^#![ \t]*([^ \t\n]+)([^\n]*)/;

/** A carriage return that does not start a CRLF: classic Mac line endings. */
const LONE_CR = /\r(?!\n)/;

/** A task's whole content, as it travels with a request and is stored content-addressed. */
const DOMAIN_COMPONENT = "(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])";
/** A registry host (with its port): a name with a dot, an IPv6 address in brackets, or one with a port, or localhost. */
const REGISTRY = new RegExp(
  `^(?:${DOMAIN_COMPONENT}(?:\\.${DOMAIN_COMPONENT})+(?::\\d+)?|${DOMAIN_COMPONENT}:\\d+|\\[[0-9a-fA-F:.]+\\](?::\\d+)?|localhost)$`,
);
const PATH_COMPONENT = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$/;
const TAG = /^\w[\w.-]{0,127}$/;
const DIGEST = /^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$/;

/**
 * Why `ref` is no Docker image reference (`[registry/]name[:tag][@digest]`, the name's path
 * lowercase), or `undefined` when it is one. The daemon refuses such a name only once a worker
 * asks it for a sandbox: the API can tell first.
 */
export function imageReferenceProblem(ref: string): string | undefined {
  if (ref.length === 0 || ref.length > 300) return "must be 1 to 300 characters";
  if (/\s/.test(ref)) return "must have no whitespace";
  let rest = ref;
  const at = rest.indexOf("@");
  if (at >= 0) {
    if (!DIGEST.test(rest.slice(at + 1))) return "has a digest that is not <algorithm>:<hex>";
    rest = rest.slice(0, at);
  }
  const parts = rest.split("/");
  const last = parts[parts.length - 1]!;
  const colon = last.lastIndexOf(":");
  if (colon >= 0) {
    if (!TAG.test(last.slice(colon + 1))) return "has a tag that is not [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}";
    parts[parts.length - 1] = last.slice(0, colon);
  }
  if (parts.length > 1 && REGISTRY.test(parts[0]!)) parts.shift();
  if (!parts.every((p) => PATH_COMPONENT.test(p))) {
    return "has a name that is not lowercase letters, digits and separators (. _ __ -) between slashes";
  }
  return undefined;
}

const ImageReference = z.string().superRefine((ref, ctx) => {
  const problem = imageReferenceProblem(ref);
  if (problem) ctx.addIssue({ code: "custom", message: `${problem}: not a Docker image reference` });
});

export const TaskContent = z
  .strictObject({
    id: z
      .string()
      .min(1)
      .max(200)
      .regex(
        /^[A-Za-z0-9][A-Za-z0-9._-]*$/,
        "must start with a letter or digit, then only letters, digits, '.', '_' or '-'",
      ),
    instruction: WellFormedText.min(1, "must not be empty")
      // As the task loader refuses an instruction.md of white space: text that shows nothing
      // (zero-width characters too) runs the agent on no task, graded as if it had one.
      .refine((text) => text === "" || !isBlank(text), {
        message: "must not be empty (it holds only white space or zero-width characters)",
      }),
    /** Sandbox image name; must exist on the worker hosts. */
    image: ImageReference,
    /** Files placed in the agent's workspace before it starts. */
    workspace: FileSet.default({}),
    /** The reference solution (`solve.sh` and helpers); used by the `oracle` agent only. */
    solution: FileSet.default({}),
    /** The tests (`test.sh` and helpers); staged only after the agent has stopped. */
    tests: FileSet.default({}),
    timeouts: z
      .strictObject({
        agentS: Seconds.default(120),
        verifierS: Seconds.default(60),
      })
      .default({ agentS: 120, verifierS: 60 }),
    verifier: VerifierSpec.default({ kind: "tests" }),
    metadata: JsonObject.default({}),
    /**
     * Modes of the files that are not staged at the default (0755 for a file starting with `#!`,
     * 0644 for any other): `"<set>/<path>"` (e.g. `"workspace/deploy.sh"`) → `"644"`. Optional,
     * and absent when empty, so a task without it keeps its digest.
     */
    modes: z.record(z.string(), FileMode).optional(),
  })
  .superRefine((task, ctx) => {
    // Each set's files (spelled plainly), built once (a task may hold thousands of files).
    const files = new Map<string, Set<string>>();
    const filesOf = (set: TaskFileSet) => {
      let names = files.get(set);
      if (!names) {
        names = new Set(Object.keys(task[set]));
        files.set(set, names);
      }
      return names;
    };
    // One spelling per file, and no empty map: the same staging is always the same digest.
    if (task.modes !== undefined && Object.keys(task.modes).length === 0) {
      ctx.addIssue({ code: "custom", path: ["modes"], message: "is empty: leave it out" });
    }
    for (const key of Object.keys(task.modes ?? {})) {
      const slash = key.indexOf("/");
      const set = key.slice(0, slash) as TaskFileSet;
      const rel = normalizeRelativePath(key.slice(slash + 1));
      const named = slash > 0 && TASK_FILE_SETS.includes(set) && filesOf(set).has(rel);
      if (!named) {
        ctx.addIssue({
          code: "custom",
          path: ["modes", key],
          message: `names no file of the task (a key is "workspace/<path>", "solution/<path>" or "tests/<path>")`,
        });
      } else if (key !== `${set}/${rel}`) {
        ctx.addIssue({ code: "custom", path: ["modes", key], message: `must be spelled "${set}/${rel}"` });
      }
    }
    // Graded by `tests/test.sh`: a missing one could only fail the rollout at verify
    // (`invalid_task`) after a sandbox was made and the agent ran; one that runs nothing (blank,
    // comments only) would pass every agent's work with 1.0. The verifier looks the script up by
    // the key `test.sh` exactly, so this does too.
    const script = task.tests["test.sh"];
    if (task.verifier.kind === "tests" && script === undefined) {
      ctx.addIssue({
        code: "custom",
        path: ["tests", "test.sh"],
        message: "is missing: a task graded by its tests needs tests/test.sh",
      });
    }
    // (One with classic Mac line endings reads as a single comment line: refused for those below.)
    if (
      task.verifier.kind === "tests" &&
      script !== undefined &&
      !hasCommand(script) &&
      !LONE_CR.test(script)
    ) {
      ctx.addIssue({
        code: "custom",
        path: ["tests", "test.sh"],
        message: "runs nothing (blank or comments only), so every agent would pass",
      });
    }
    // Graded by matching its answer: its tests would never run. An author who wrote both
    // expects them to count; a result graded without them is not what they asked for.
    if (task.verifier.kind === "match" && Object.keys(task.tests).length > 0) {
      ctx.addIssue({
        code: "custom",
        path: ["tests"],
        message:
          'are never run for a task graded by matching its answer ([verifier] kind = "match"): remove tests/, or grade with kind = "tests"',
      });
    }
    // The two scripts the fleet runs with bash (test.sh only for a task graded by its tests),
    // checked for what makes bash fail, or skip a line, only after a whole run: CRLF line endings
    // (each line's `\r` ends its last word), a byte order mark (part of the first command: a
    // `set -e` there is lost), a mode that takes away the read bit of whoever runs it (tests run
    // as root without capabilities, the file's owner; solve.sh as the agent's uid, an "other").
    const scripts = [
      {
        set: "tests",
        name: "test.sh",
        runs: task.verifier.kind === "tests",
        read: 0o400,
        who: "its owner (root)",
      },
      { set: "solution", name: "solve.sh", runs: true, read: 0o004, who: "others (the agent's uid runs it)" },
    ] as const;
    for (const { set, name, runs, read, who } of scripts) {
      const text = task[set][name];
      if (!runs || text === undefined) continue;
      const problem = (message: string) => ctx.addIssue({ code: "custom", path: [set, name], message });
      if (text.includes("\r\n")) {
        problem("has Windows (CRLF) line endings, which bash cannot run: convert it (dos2unix)");
      } else if (LONE_CR.test(text)) {
        problem("has classic Mac (CR) line endings, which bash reads as one line: convert it (mac2unix)");
      }
      // test.sh runs by its #! line as the kernel reads it: a relative interpreter (`#!bash`)
      // would be looked up in the working directory, the agent's workspace.
      const shebang = set === "tests" ? SHEBANG.exec(text) : null;
      const interpreter = shebang?.[1];
      if (interpreter !== undefined && !interpreter.startsWith("/")) {
        problem(
          `names a relative #! interpreter (${interpreter}), which would be looked up in the agent's workspace: name its path (#!/bin/bash, or #!/usr/bin/env ${interpreter})`,
        );
      }
      // The kernel passes the rest of the line as one argument: `#!/usr/bin/env bash -e` has env
      // look for a program named "bash -e", which exits 127 in every sandbox, a 0 for every
      // agent (not the task's failure). env splits it itself only after `-S` (GNU's `-[iv]S`, or
      // `--split-string=`, abbreviated as getopt allows down to `--s=`; `--split-string ` with a
      // space is one unknown option to it).
      const arg = shebang?.[2]?.trim() ?? "";
      const long = /^--([a-z-]+)=/.exec(arg)?.[1];
      const splits = /^-[iv]*S/.test(arg) || (long !== undefined && "split-string".startsWith(long));
      if (interpreter?.split("/").pop() === "env" && /[ \t]/.test(arg) && !splits) {
        problem(
          `runs "${arg}" through #!${interpreter}, which gets it as one argument and would look for a program by that name: split it with -S (#!${interpreter} -S ${arg})`,
        );
      }
      if (text.startsWith("\uFEFF")) {
        problem(
          "starts with a byte order mark, which bash would run as part of its first command: save it without one",
        );
      }
      const mode = fileModes(task, set)[name];
      if (mode !== undefined && (mode & read) === 0) {
        ctx.addIssue({
          code: "custom",
          path: ["modes", `${set}/${name}`],
          message: `takes away the read bit of ${who}, so ${set}/${name} could not run`,
        });
      }
    }
    // Graded by the answer: an `expected` that an empty answer matches would pass an agent that
    // printed nothing; a pattern the grader cannot compile would fail only after the whole run.
    const problem = task.verifier.kind === "match" ? matchExpectedProblem(task.verifier) : undefined;
    if (problem !== undefined) {
      ctx.addIssue({ code: "custom", path: ["verifier", "expected"], message: problem });
    }
  });
export type TaskContent = z.infer<typeof TaskContent>;
export type TaskContentInput = z.input<typeof TaskContent>;

/**
 * The modes `task.modes` gives the files of one set: normalized relative path → mode bits, for
 * `SandboxProvider.put` (files not named get the default).
 */
export function fileModes(task: Pick<TaskContent, "modes">, set: TaskFileSet): Record<string, number> {
  const out: Record<string, number> = {};
  const prefix = `${set}/`;
  for (const [key, mode] of Object.entries(task.modes ?? {})) {
    if (key.startsWith(prefix))
      out[normalizeRelativePath(key.slice(prefix.length))] = Number.parseInt(mode, 8);
  }
  return out;
}

/** Whether a shell script has a line that is neither blank nor a comment. */
function hasCommand(script: string): boolean {
  return script.split("\n").some((line) => {
    const t = line.trim();
    return t !== "" && !t.startsWith("#");
  });
}

/** sha256 hex digest of a stored task. */
export const TaskDigest = z.string().regex(/^[0-9a-f]{64}$/, "must be a sha256 hex digest");

/** A task in a request: inline content, or the digest of one already stored. */
export const TaskRef = z.union([z.strictObject({ digest: TaskDigest }), TaskContent]);
export type TaskRef = z.infer<typeof TaskRef>;
