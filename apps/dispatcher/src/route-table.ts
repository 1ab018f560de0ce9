import type { FastifyInstance } from "fastify";

/** One route as Fastify registered it (HEAD twins of GET routes left out). */
export interface RegisteredRoute {
  method: string;
  /** Full path with its prefix, in Fastify's syntax (`/v1/rollouts/:id`). */
  url: string;
  /** `schema.hide`: left out of the API description on purpose (Bull Board's own routes). */
  hidden: boolean;
  /** Served without a token (`config.public`). */
  public: boolean;
}

const tables = new WeakMap<FastifyInstance, RegisteredRoute[]>();

/**
 * Record every route registered on `app` from now on, plugins' included (Fastify's `onRoute`
 * hook). Call before registering routes; read with `registeredRoutes(app)` after `ready()`.
 */
export function trackRoutes(app: FastifyInstance): void {
  const routes: RegisteredRoute[] = [];
  tables.set(app, routes);
  app.addHook("onRoute", (route) => {
    for (const method of [route.method].flat()) {
      if (method === "HEAD") continue;
      routes.push({
        method,
        url: route.url,
        hidden: Boolean((route.schema as { hide?: boolean } | undefined)?.hide),
        public: Boolean(route.config?.public),
      });
    }
  });
}

/** The routes `trackRoutes` saw on `app` (empty when it was never called). */
export function registeredRoutes(app: FastifyInstance): readonly RegisteredRoute[] {
  return tables.get(app) ?? [];
}
