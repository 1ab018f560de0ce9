import { FleetError, isFleetError } from "@fleet/contracts";
import { describe, expect, it } from "vitest";
import {
  classifyDockerError,
  classifyDockerFacts,
  type DockerOperation,
  dockerErrorFacts,
} from "./docker-errors.ts";

/** A dockerode-shaped HTTP error: what docker-modem rejects with when the daemon answers. */
function httpError(statusCode: number, message: string): Error {
  return Object.assign(new Error(`(HTTP code ${statusCode}) unexpected - ${message}`), {
    statusCode,
    json: { message },
  });
}

function sysError(code: string): Error {
  return Object.assign(new Error(`connect ${code} /var/run/docker.sock`), { code });
}

describe("dockerErrorFacts", () => {
  it("prefers the daemon's own message", () => {
    expect(dockerErrorFacts(httpError(404, "No such image: x:latest"))).toEqual({
      statusCode: 404,
      code: null,
      message: "No such image: x:latest",
    });
  });

  it("reads socket error codes and abort/timeout names", () => {
    expect(dockerErrorFacts(sysError("ECONNREFUSED")).code).toBe("ECONNREFUSED");
    const timeout = Object.assign(new Error("The operation was aborted"), {
      name: "AbortError",
      code: "ABORT_ERR",
    });
    expect(dockerErrorFacts(timeout)).toMatchObject({ code: "AbortError", message: /timed out/ });
    expect(dockerErrorFacts("weird").message).toBe("weird");
  });
});

describe("classifyDockerFacts", () => {
  const cases: Array<[DockerOperation, number | null, string, string]> = [
    ["create", null, "connect ENOENT /nope.sock", "daemon_unavailable"],
    ["exec", null, "socket hang up", "daemon_unavailable"],
    ["create", 500, "server error", "daemon_unavailable"],
    ["create", 503, "service unavailable", "daemon_unavailable"],
    ["create", 404, "No such image: nope:latest", "image_missing"],
    ["create", 404, "network fleet-gw not found", "network_missing"],
    ["create", 409, 'Conflict. The container name "/fleet-r1-resources" is already in use', "name_conflict"],
    ["create", 400, "invalid reference format", "bad_request"],
    ["exec", 404, "No such container: abc", "sandbox_gone"],
    // A daemon restarted with live-restore forgets its exec instances; the container runs on.
    ["exec", 404, "No such exec instance: 172a95a46b34", "daemon_unavailable"],
    ["exec", 409, "Container abc is not running", "sandbox_gone"],
    ["exec", 409, "Container abc is paused, unpause the container before exec", "daemon_unavailable"],
    ["exec", 500, "Container abc is paused, unpause the container before exec", "daemon_unavailable"],
    ["exec", 500, "Container abc is not running", "sandbox_gone"],
    ["exec", 500, "OCI runtime exec failed: resource temporarily unavailable", "daemon_unavailable"],
    ["get", 404, "Could not find the file /workspace/x in container abc", "path_missing"],
    ["put", 404, "Could not find the file /nope in container abc", "path_missing"],
    ["get", 404, "No such container: abc", "sandbox_gone"],
    ["inspect", 404, "No such container: abc", "sandbox_gone"],
    // Older daemons answer a missing path in a put/get with 400.
    ["put", 400, "Could not find the file /nope in container abc", "path_missing"],
    // A create the daemon answers 404 without naming an image or network: still the task's image.
    ["create", 404, "reference does not exist", "image_missing"],
    // "is not running" on a create is no sandbox of ours gone: the daemon's trouble, retried.
    ["create", 500, "container abc is not running", "daemon_unavailable"],
  ];
  it.each(cases)("%s HTTP %s %j → %s", (op, statusCode, message, expected) => {
    expect(classifyDockerFacts({ statusCode, code: null, message }, op)).toBe(expected);
  });
});

describe("classifyDockerError", () => {
  it("daemon unreachable → retryable provider_unavailable", () => {
    const e = classifyDockerError(sysError("ECONNREFUSED"), "create", "fleet-r1-resources");
    expect(e).toBeInstanceOf(FleetError);
    expect(e.kind).toBe("provider_unavailable");
    expect(e.retryable).toBe(true);
    expect(e.message).toContain("ECONNREFUSED");
    expect(e.cause).toBeInstanceOf(Error);
  });

  it("5xx → retryable provider_unavailable", () => {
    const e = classifyDockerError(httpError(500, "boom"), "destroy");
    expect([e.kind, e.retryable]).toEqual(["provider_unavailable", true]);
  });

  it("missing image → final invalid_task that says images are never pulled", () => {
    // The provider passes the container's name as the subject: the message names the image.
    const e = classifyDockerError(httpError(404, "No such image: nope:1"), "create", "fleet-r1-resources");
    expect([e.kind, e.retryable]).toEqual(["invalid_task", false]);
    expect(e.message).toMatch(/never pulled/);
    expect(e.message).toContain("No such image: nope:1");
    expect(e.message).not.toContain("fleet-r1-resources");
  });

  it("container gone → final sandbox_lost", () => {
    const e = classifyDockerError(httpError(404, "No such container: abc"), "exec");
    expect([e.kind, e.retryable]).toEqual(["sandbox_lost", false]);
  });

  it("maps each class to its kind and retryability (final vs retryable, DESIGN §2 rule 5)", () => {
    const kinds = (err: Error, op: DockerOperation) => {
      const e = classifyDockerError(err, op, "fleet-r1-resources");
      return [e.kind, e.retryable];
    };
    // A name in use on create: a re-delivered create or a removal still under way; retried.
    expect(kinds(httpError(409, 'Conflict. The container name "/x" is already in use'), "create")).toEqual([
      "provider_unavailable",
      true,
    ]);
    // The daemon refused the request itself (e.g. an option it does not know): no retry fixes it.
    expect(kinds(httpError(400, "invalid reference format"), "create")).toEqual(["invalid_task", false]);
    expect(kinds(httpError(404, "network fleet-gw not found"), "create")).toEqual(["invalid_task", false]);
    expect(kinds(httpError(404, "Could not find the file /x in container abc"), "get")).toEqual([
      "invalid_task",
      false,
    ]);
  });

  it("passes FleetErrors through", () => {
    const original = FleetError.nonRetryable("isolation_refused", "shared pid ns");
    expect(classifyDockerError(original, "probe")).toBe(original);
  });

  it("keeps messages bounded", () => {
    const e = classifyDockerError(httpError(500, "x".repeat(50_000)), "exec");
    expect(e.message.length).toBeLessThanOrEqual(4000);
    expect(isFleetError(e)).toBe(true);
  });
});
