/**
 * One `host[:port]` of a Redis Cluster or Sentinel URL (`redis-cluster://h:p,h:p`): a name, an
 * address or a bracketed IPv6 address, and a port or none (a `:` with nothing after it is not
 * one). Group 1 is the host, group 2 the port. The config's check of REDIS_URL and the queue's
 * parser both take a node by it.
 */
export const REDIS_HOST_PORT = /^(\[[^\]]+\]|[^:]+)(?::(\d+))?$/;
