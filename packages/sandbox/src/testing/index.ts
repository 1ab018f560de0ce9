// Test support, not for production code: an in-memory provider for unit tests, and a base rootfs
// plus a capability check for bubblewrap tests.
export * from "../bubblewrap/test-rootfs.ts";
export * from "./in-memory-provider.ts";
