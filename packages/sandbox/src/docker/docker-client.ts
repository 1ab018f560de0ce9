import Dockerode from "dockerode";

/** How docker-modem's `dial` is called: its request options and a node-style callback. */
type DialCallback = (err: unknown, data?: unknown) => void;
interface Modem {
  dial(options: { abortSignal?: AbortSignal }, callback?: DialCallback): unknown;
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
    const signal = dialOptions?.abortSignal;
    if (!signal || typeof callback !== "function") return dial(dialOptions, callback);
    let settled = false;
    const settle: DialCallback = (err, data) => {
      if (settled) return;
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
