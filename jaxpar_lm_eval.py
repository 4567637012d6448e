"""`lm_eval --model jaxpar`: registers jaxpar's model backend in lm-eval's registry when
lm-eval loads it, under the name "jaxpar" and lazily (jaxpar itself is imported only
when lm-eval asks for the model). jaxpar_lm_eval.pth imports this at start-up; it
imports nothing but the standard library, and only watches for lm-eval's registry."""

import importlib.abc
import importlib.util
import sys

REGISTRY = "lm_eval.api.registry"
BACKEND = "jaxpar.evaluation.harness:JaxparLM"


class _Registers(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it lets lm-eval's registry module load as ever, then adds
    jaxpar's entry to it."""

    def find_spec(self, name, path=None, target=None):
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)  # once, and not while the real finder looks
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            if "jaxpar" not in module.model_registry:
                module.model_registry.register("jaxpar", target=BACKEND)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if REGISTRY not in sys.modules and not any(isinstance(f, _Registers) for f in sys.meta_path):
        sys.meta_path.insert(0, _Registers())


install()
