# syntax=docker/dockerfile:1
# The one image of every fleet app: the dispatcher, the three stage workers and the janitor
# (and the `fleet` CLI). Apps run from their TypeScript sources with `node --import tsx` (no
# build step; not the `tsx` command, which SIGKILLs an app that has not answered a relayed
# SIGTERM within 30 ms, i.e. mid-shutdown on a busy event loop); docker-compose.yml picks the
# app with its command:
#
#   docker build -t rollout-fleet/app .
#   docker run --rm -e REDIS_URL=redis://redis:6379 rollout-fleet/app node --import tsx apps/janitor/src/main.ts
#
# Needs a registry for node:20-slim and the npm registry for `npm ci`; where there is none
# (an air-gapped host), build it elsewhere and `docker save` / `docker load` it.
ARG NODE_IMAGE=node:20-slim

# 1. The package manifests alone, so the dependency layer below is rebuilt only when one of
#    them changes (COPY --from compares content), not on every source edit.
FROM ${NODE_IMAGE} AS manifests
WORKDIR /src
COPY . .
RUN mkdir -p /out \
 && cp package.json package-lock.json /out/ \
 && find apps packages test -maxdepth 2 -name package.json -exec cp --parents {} /out/ \;

# 2. Production dependencies. The fleet's own packages are npm workspaces: node_modules/@fleet/*
#    are links to apps/* and packages/*, whose sources the runtime stage adds.
FROM ${NODE_IMAGE} AS deps
WORKDIR /app
COPY --from=manifests /out/ ./
RUN npm ci --omit=dev --no-audit --no-fund \
 && npm cache clean --force

# 3. Runtime: node, the production node_modules (tsx among them: the CLI's dependency) and the
#    sources; an unprivileged user.
FROM ${NODE_IMAGE} AS runtime
WORKDIR /app
ENV NODE_ENV=production \
    FLEET_HTTP_HOST=0.0.0.0 \
    FLEET_METRICS_HOST=0.0.0.0
COPY --from=deps /app/node_modules ./node_modules
COPY package.json package-lock.json tsconfig.base.json tsconfig.json ./
COPY packages ./packages
COPY apps ./apps
USER node
# 8080: the dispatcher's API, Bull Board and /metrics; 9464: a worker's or the janitor's /metrics.
EXPOSE 8080 9464
CMD ["node", "--import", "tsx", "apps/dispatcher/src/main.ts"]
