"""Every process of a profiled test session (pytest's workers and the `jaxpar`, script
and multi-process subprocesses they start) appends what jax did to one JSON-lines file
of its own in $JAXPAR_PROFILE_DIR, each event tagged with the test that ran it
($PYTEST_CURRENT_TEST, which pytest sets and subprocesses inherit):

- `compile`: seconds in XLA's backend compile (jax's own duration event), whether it
  compiled or read the persistent cache;
- `trace`: seconds tracing a program to a jaxpr and lowering it to StableHLO (jax's
  own duration events), which every program pays, even one read from the cache;
- `miss` / `hit`: a program compiled anew / read from the session's persistent cache
  (another test, or another process of this one, compiled it), with its cache key;
- `step`: one training step dispatched (jaxpar's `/jaxpar/train/step` event).

The suite's profile (tests/suite_profile.py) reads the files at the session's end."""

import atexit
import json
import logging
import os

DIR = "JAXPAR_PROFILE_DIR"
STEP = "/jaxpar/train/step"
COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)
_CACHE_LOG = {
    "Persistent compilation cache hit": "hit",
    "PERSISTENT COMPILATION CACHE MISS": "miss",
}


def _test() -> str:
    """The running test's node id, without its phase (`setup`, `call`, `teardown`)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "(outside a test)").rsplit(" (", 1)[0]


class _Log:
    def __init__(self, folder: str):
        self.file = open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a")  # noqa: SIM115
        atexit.register(self.file.close)

    def write(self, kind: str, **fields) -> None:
        self.file.write(json.dumps({"test": _test(), "kind": kind, **fields}) + "\n")
        self.file.flush()


def listen() -> None:
    """Record this process's compiles, cache reads and steps, if the session profiles."""
    folder = os.environ.get(DIR)
    if not folder or getattr(listen, "on", False):
        return
    listen.on = True
    import jax.monitoring

    log = _Log(folder)

    def on_duration(event: str, seconds: float, fun_name: str = "", **_) -> None:
        if event == COMPILE:
            log.write("compile", s=seconds, program=fun_name)
        elif event in TRACE:
            log.write("trace", s=seconds, program=fun_name)

    def on_event(event: str, **_) -> None:
        if event == STEP:
            log.write("step")

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    # the cache key of each compile comes only in jax's compiler log (at DEBUG): a filter
    # on that logger records it, and lets through only what would have shown anyway
    compiler = logging.getLogger("jax._src.compiler")
    shown = compiler.getEffectiveLevel()

    def cache_read(record: logging.LogRecord) -> bool:
        for start, kind in _CACHE_LOG.items():
            if record.msg.startswith(start):
                log.write(kind, key=str(record.args[-1]), program=str(record.args[0]))
        return record.levelno >= shown

    compiler.addFilter(cache_read)
    compiler.setLevel(logging.DEBUG)
