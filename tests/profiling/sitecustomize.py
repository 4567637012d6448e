"""Started with every Python subprocess of a profiled test session (conftest puts this
folder on PYTHONPATH): once the process imports jax, suite_events records what it
compiles and trains. A process that never imports jax pays nothing."""

import importlib.abc
import importlib.util
import os
import sys


class _AfterJax(importlib.abc.MetaPathFinder):
    """Finds `jax` as usual, then listens once its module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("jax")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import suite_events

            suite_events.listen()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("JAXPAR_PROFILE_DIR"):
    sys.meta_path.insert(0, _AfterJax())
