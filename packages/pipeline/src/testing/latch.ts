/** A one-shot signal for tests: `opened` settles once `open()` is called (again: no effect). */
export interface Latch {
  readonly opened: Promise<void>;
  open(): void;
}

export function latch(): Latch {
  let open!: () => void;
  const opened = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { opened, open };
}
