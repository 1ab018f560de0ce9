import { AdmissionError } from "@fleet/queue";
import { ReplyError } from "ioredis";
import { describe, expect, it } from "vitest";
import { errorBody, HttpError, toHttpError } from "./http-error.ts";

describe("toHttpError", () => {
  it("keeps an HttpError", () => {
    const err = new HttpError(409, "conflict", "taken", { id: "x" });
    expect(toHttpError(err)).toBe(err);
    expect(errorBody(err)).toEqual({ error: { code: "conflict", message: "taken", details: { id: "x" } } });
  });

  it("maps admission errors by code", () => {
    expect(toHttpError(new AdmissionError("invalid", "bad", { index: 1 }))).toMatchObject({
      status: 422,
      code: "invalid",
      details: { index: 1 },
    });
    expect(toHttpError(new AdmissionError("payload_too_large", "big")).status).toBe(413);
    expect(toHttpError(new AdmissionError("conflict", "other body")).status).toBe(409);
  });

  it("maps Fastify's client errors and hides server errors", () => {
    const tooLarge = Object.assign(new Error("Request body is too large"), {
      code: "FST_ERR_CTP_BODY_TOO_LARGE",
      statusCode: 413,
    });
    expect(toHttpError(tooLarge)).toMatchObject({ status: 413, code: "payload_too_large" });
    const media = Object.assign(new Error("Unsupported Media Type"), {
      code: "FST_ERR_CTP_INVALID_MEDIA_TYPE",
      statusCode: 415,
    });
    expect(toHttpError(media)).toMatchObject({ status: 415, code: "unsupported_media_type" });
    const syntax = Object.assign(new SyntaxError("Unexpected end of JSON input"), { statusCode: 400 });
    expect(toHttpError(syntax)).toMatchObject({ status: 400, code: "malformed" });
    const internal = toHttpError(new Error("ECONNRESET at 10.0.0.3 secret path"));
    expect(internal).toMatchObject({ status: 500, code: "internal", message: "internal error" });
    expect(toHttpError("a string")).toMatchObject({ status: 500 });
  });

  it("answers 503 with Retry-After when Redis is down", () => {
    const err = Object.assign(new Error("Reached the max retries per request limit"), {
      name: "MaxRetriesPerRequestError",
    });
    expect(toHttpError(err)).toMatchObject({
      status: 503,
      code: "unavailable",
      headers: { "retry-after": "5" },
    });
    // ioredis' own words for a command refused while down (failFastOnceReady), a standalone
    // Redis's and a cluster's, and for one cut off by a closed connection.
    for (const message of [
      "Stream isn't writeable and enableOfflineQueue options is false",
      "Cluster isn't ready and enableOfflineQueue options is false",
      "Connection is closed.",
    ]) {
      expect(toHttpError(new Error(message)), message).toMatchObject({ status: 503, code: "unavailable" });
    }
  });

  it("answers 503 when Redis replies that it cannot serve now (full, read-only replica, cluster down), 500 for other replies", () => {
    for (const reply of [
      "OOM command not allowed when used memory > 'maxmemory'.",
      "READONLY You can't write against a read only replica.",
      "LOADING Redis is loading the dataset in memory",
      "CLUSTERDOWN The cluster is down",
      "TRYAGAIN Multiple keys request during rehashing of slot",
      "BUSY Redis is busy running a script.",
    ]) {
      expect(toHttpError(new ReplyError(reply)), reply).toMatchObject({ status: 503, code: "unavailable" });
    }
    const allFailed = Object.assign(new Error("Failed to refresh slots cache."), {
      name: "ClusterAllFailedError",
    });
    expect(toHttpError(allFailed)).toMatchObject({ status: 503 });
    // A MULTI whose writes Redis refused for being full: EXECABORT, the refusals kept beside it.
    const aborted = Object.assign(
      new ReplyError("EXECABORT Transaction discarded because of previous errors."),
      {
        previousErrors: [new ReplyError("OOM command not allowed when used memory > 'maxmemory'.")],
      },
    );
    expect(toHttpError(aborted)).toMatchObject({ status: 503, code: "unavailable" });
    const ourBug = Object.assign(
      new ReplyError("EXECABORT Transaction discarded because of previous errors."),
      {
        previousErrors: [new ReplyError("ERR wrong number of arguments for 'hset' command")],
      },
    );
    expect(toHttpError(ourBug)).toMatchObject({ status: 500 });
    // A reply that is our bug (a script error), or a word that only starts like one: still a 500.
    for (const reply of ["ERR Error running script", "OOMPH not a Redis state"]) {
      expect(toHttpError(new ReplyError(reply)), reply).toMatchObject({ status: 500, code: "internal" });
    }
  });
});

describe("toHttpError of a connection reset", () => {
  it("takes the client's own request abort for a 400, and any other reset (Redis's socket, say) for a 500", () => {
    const aborted = Object.assign(new Error("aborted"), { code: "ECONNRESET" });
    expect(toHttpError(aborted)).toMatchObject({ status: 400, code: "malformed" });
    const other = Object.assign(new Error("read ECONNRESET"), { code: "ECONNRESET" });
    expect(toHttpError(other)).toMatchObject({ status: 500, code: "internal" });
  });
});
