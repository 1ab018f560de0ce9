import Dockerode from "dockerode";

/** How docker-modem's `dial` is called: its request options and a node-style callback. */
type DialCallback = (err: unknown, data?: unknown) => void;
interface DialOptions {
  abortSignal?: AbortSignal;
  /** The call's query options: where dockerode 5 leaves the signal of a network's inspect. */
  options?: { abortSignal?: AbortSignal };
}
interface Modem {
  dial(options: DialOptions, callback?: DialCallback): unknown;
}

/**
 * A dockerode client on `options` alone (DOCKER_HOST & co. in the environment are ignored: the
 * apps resolve their connection themselves) whose calls settle when their abort signal fires,
 * whatever the reply is doing.
 *
 * docker-modem (5.x) reads a reply's body with only "data" and "end" listeners, so a connection
 * cut after the headers (a daemon restarted mid-reply, a proxy or socket dropped) ends the body
 * without either, and Node then destroys it without an "error" (none is listened to): the call
 * never settled, not even at its abort signal, which destroys the body once more. A janitor pass
 * waited on such a call for good; a stage, until its rollout's deadline.
 */
export function dockerClient(options: Dockerode.DockerOptions): Dockerode {
  const docker = new Dockerode({
    host: undefined,
    port: undefined,
    protocol: undefined,
    timeout: undefined,
    ca: undefined,
    cert: undefined,
    key: undefined,
    ...options,
  });
  const modem = docker.modem as unknown as Modem;
  const dial = modem.dial.bind(modem);
  modem.dial = (dialOptions, callback) => {
    // `Network.inspect` passes its signal only in the query options, which docker-modem drops:
    // the request never saw it. Taken from there, for the request and for the settling below.
    const signal = dialOptions?.abortSignal ?? dialOptions?.options?.abortSignal;
    if (!signal || typeof callback !== "function") return dial(dialOptions, callback);
    dialOptions.abortSignal = signal;
    let settled = false;
    const settle: DialCallback = (err, data) => {
      if (settled) {
        // A stream (an exec's hijacked socket, a body) answered after the call failed at its
        // signal has no reader: closed, not left open on the daemon.
        (data as { destroy?: () => void } | undefined)?.destroy?.();
        return;
      }
      settled = true;
      signal.removeEventListener("abort", aborted);
      callback(err, data);
    };
    // The signal's reason (a TimeoutError from `AbortSignal.timeout`) is what docker-modem
    // itself rejects with when it notices: the same error either way.
    const aborted = () =>
      settle(signal.reason instanceof Error ? signal.reason : new Error("the Docker call was aborted"));
    signal.addEventListener("abort", aborted, { once: true });
    return dial(dialOptions, settle);
  };
  return docker;
}
