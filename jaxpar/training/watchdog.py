"""train.hang_timeout_s: a step that makes no progress ends the process, naming itself.

A dead gloo peer makes the others abort, but a stuck one (stopped, deadlocked, its host
frozen) leaves them waiting in a collective for ever. A thread watches the steps settle
(their metrics read back: the step, and every collective in it, done); when none has
for the timeout, it prints which process is waiting, in which step, with every thread's
Python stack (faulthandler), and exits with status HUNG, which `jaxpar launch` restarts
from as from a death.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

from jaxpar.errors import HUNG


class Watchdog:
    """Used as `with Watchdog(timeout_s) as dog:` around the loop, `dog.beat()` after each
    step settles. A timeout of 0 watches nothing."""

    def __init__(self, timeout_s: float, start: int = 0):
        self.timeout_s, self.step = timeout_s, start
        self._last = time.monotonic()
        self._done = threading.Event()

    def beat(self) -> None:
        self.step += 1
        self._last = time.monotonic()

    def __enter__(self) -> Watchdog:
        if self.timeout_s:
            self._last = time.monotonic()
            threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(self.timeout_s / 10, 1.0)):
            if time.monotonic() - self._last > self.timeout_s:
                self._hung()

    def _hung(self) -> None:
        import jax

        me, n = jax.process_index(), jax.process_count()
        print(
            f"jaxpar: process {me} of {n}: step {self.step + 1} made no progress for "
            f"{self.timeout_s:g} s (train.hang_timeout_s): a peer is stuck, or a collective "
            f"waits on one; exiting with status {HUNG}. The stacks of process {me}:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HUNG)
