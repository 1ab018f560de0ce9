import { createBullBoard } from "@bull-board/api";
import { BullMQAdapter } from "@bull-board/api/bullMQAdapter";
import type { IServerAdapter } from "@bull-board/api/typings/app";
import { FastifyAdapter } from "@bull-board/fastify";
import type { StageName } from "@fleet/contracts";
import { type JANITOR_QUEUE, STAGES, type StageQueues } from "@fleet/queue";
import type { Queue } from "bullmq";
import type { FastifyInstance } from "fastify";
import { errorBody, HttpError } from "./http-error.ts";
import type { Authenticator } from "./request-auth.ts";

/** Where Bull Board is mounted. */
export const BOARD_PATH = "/admin/queues";
/** Route constraint that sends each board request to the read-only or the admin board. */
export const BOARD_CONSTRAINT = "fleetBoard";
type BoardMode = "read" | "admin";

const DESCRIPTIONS: Record<StageName | typeof JANITOR_QUEUE, string> = {
  seed: "seed: create the task sandbox, probe isolation, stage task files (resources worker)",
  run: "run: the agent's harness in the sandbox (agent worker)",
  verify: "verify: grade the result (verifier worker)",
  close: "close: destroy the sandbox, finalise the result; always runs (resources worker)",
  janitor: "janitor: scheduled teardown retries, orphan sweeps, deadline watchdog",
};

/**
 * Bull Board's Fastify adapter, whose error handler answers a malformed query 400 in the API's
 * error body. Bull Board's handlers decode query values (`activeQueue`, `queueName`) once more
 * after Fastify has: a value that decodes to a lone `%` throws `URIError`, which Bull Board's own
 * handler answers 500, as a fault of the server's.
 */
class BoardAdapter extends FastifyAdapter {
  override setErrorHandler(handler: Parameters<FastifyAdapter["setErrorHandler"]>[0]): this {
    return super.setErrorHandler((error) =>
      error instanceof URIError
        ? {
            status: 400,
            body: errorBody(
              new HttpError(400, "malformed", `a query value does not decode: ${error.message}`),
            ),
          }
        : handler(error),
    );
  }
}

/**
 * Mount Bull Board at `/admin/queues` over the four stage queues and the janitor's queue, as two
 * boards on the same paths: a read-only one (Bull Board's `readOnlyMode`: no retry, clean,
 * promote, remove... buttons, and its API refuses them) and a full one. A route constraint
 * derived from the request's credentials picks the board per request: admin tokens (and their
 * sessions) get the full board, everyone else the read-only one. Authentication itself, the
 * admin-only rule for mutating requests and the CSRF check run in the server's `onRequest` hook
 * before either board sees the request.
 */
export function registerBoard(
  app: FastifyInstance,
  deps: { queues: StageQueues; janitorQueue: Queue; auth: Authenticator },
): void {
  const queues: Queue[] = [...STAGES.map((s) => deps.queues.queues[s]), deps.janitorQueue];

  app.addConstraintStrategy({
    name: BOARD_CONSTRAINT,
    storage: () => {
      const byMode = new Map<string, unknown>();
      return {
        get: (mode: string) => (byMode.get(mode) ?? null) as never,
        set: (mode: string, handler: unknown) => {
          byMode.set(mode, handler);
        },
      };
    },
    deriveConstraint: (req) => (deps.auth.authenticate(req).access === "admin" ? "admin" : "read"),
    mustMatchWhenDerived: false,
  });

  for (const mode of ["read", "admin"] as const satisfies readonly BoardMode[]) {
    const serverAdapter = new BoardAdapter();
    serverAdapter.setBasePath(BOARD_PATH);
    createBullBoard({
      queues: queues.map(
        (q) =>
          new BullMQAdapter(q, {
            readOnlyMode: mode === "read",
            allowRetries: mode === "admin",
            description: DESCRIPTIONS[q.name as keyof typeof DESCRIPTIONS] ?? q.name,
          }),
      ),
      // @bull-board/fastify 9.10.1 brings its own copy of @bull-board/api 9.10.1 (ours is 9.10.2):
      // the same adapter protocol, but two declarations of its private fields.
      serverAdapter: serverAdapter as unknown as IServerAdapter,
      options: {
        uiConfig: {
          boardTitle: mode === "admin" ? "rollout-fleet" : "rollout-fleet (read-only)",
          hideDocsLink: true,
          miscLinks: [{ text: "Log out", url: "/admin/logout" }],
        },
      },
    });
    app.register(async (scope) => {
      // Every route of this board (its API, its pages, its static files) carries the constraint.
      scope.addHook("onRoute", (route) => {
        route.constraints = { ...route.constraints, [BOARD_CONSTRAINT]: mode };
      });
      await scope.register(serverAdapter.registerPlugin(), { prefix: BOARD_PATH });
    });
  }
}
