// Preloaded (`node --import`) into a fleet process to run its clock TEST_CLOCK_SKEW_MS ahead
// (negative: behind), as a host whose clock is off: `Date.now()`, which the fleet and BullMQ
// read, is shifted; timers and the monotonic clock are not.
const skew = Number(process.env.TEST_CLOCK_SKEW_MS ?? 0);
if (skew !== 0) {
  const real = Date.now;
  Date.now = () => real() + skew;
}
