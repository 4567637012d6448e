"""The module paths of the last release, before jaxpar's modules moved into subpackages,
and those renamed since: `import jaxpar.sharding` or `from jaxpar.config import Config`
still works and warns, with a DeprecationWarning naming the new home, until REMOVED_IN.

An old module with one new home is that very module (`jaxpar.sharding is
jaxpar.parallel.sharding`); one split in several reads each name from the homes in turn.
Where the old module's name is now a subpackage (config, cost, data), the package
forwards the old module's names (`attribute`). Three old names cannot come back, as the
new subpackages' modules hold them: `jaxpar.cli.main` (the function is now
`jaxpar.cli.main.main`), `jaxpar.step.build` (now `jaxpar.step.gradient_sync.build`) and
`jaxpar.bench.measure` (now `jaxpar.bench.measure.measure`).
Nothing is imported until an old path is used."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec

REMOVED_IN = "0.3.0"  # the release after next: the old paths go then

# `jaxpar bench`'s modules, the one holding most first
BENCH = ("bench.measure", "bench.run", "bench.strategies", "bench.schedules", "bench.dp")
BENCH += ("bench.hosts", "bench.offload", "bench.remat", "bench.context", "bench.experts")
BENCH += ("bench.checkpoint", "bench.compile", "bench.longest", "bench.plan", "bench.generate")
# old module (jaxpar.<old>) -> its new homes under jaxpar, the one holding most first
MOVED = {
    "accumulate": ("step.accumulate",),
    "attention": ("nn.attention",),
    "axes": ("parallel.axes",),
    "batches": ("parallel.batches",),
    "bench": BENCH,
    "chat": ("data.chat",),
    "checkpoint": ("training.checkpoint",),
    "collectives": ("parallel.collectives", "parallel.ring", "parallel.server"),
    "commands": ("recipe", "planning", "inspection"),
    "config": ("config.sections",),
    "console": ("training.console",),
    "context": ("nn.scope",),
    "cost": ("cost.formulas", "parallel.leaf_layout"),
    "data": ("data.tokens",),
    "decoding": ("generation.decoding",),
    "distributed": ("parallel.distributed",),
    "documents": ("nn.documents",),
    "dp": ("parallel.data_parallel", "parallel.ring", "parallel.server"),
    "engine": ("step.engine",),
    "export": ("training.export",),
    "hlo": ("cost.hlo",),
    "inspect": ("inspection",),
    "keys_help": ("config.keys_help",),
    "layers": ("nn.layers", "nn.staging", "nn.tensor_parallel", "nn.experts", "names"),
    "ledger": ("cost.ledger",),
    "local_sgd": ("step.local_sgd",),
    "mesh": ("parallel.mesh",),
    "mesh_rules": ("parallel.layout_checks",),
    "metrics": ("training.metrics", "cost.report"),
    "offload": ("step.offload",),
    "optim": ("step.optimizer",),
    "options": ("config.options",),
    "pipeline": ("parallel.pipeline", "parallel.schedules", "nn.staging"),
    "planner": ("cost.planner",),
    "preflight": ("step.preflight",),
    "prepare": ("data.prepare", "data.chat"),
    "presets": ("config.presets",),
    "problem": ("nn.problem",),
    "prompts": ("generation.prompts", "data.chat"),
    "registry": ("config.registry",),
    "replicas": ("step.replica_check",),
    "report": ("cost.report",),
    "run": ("compiled.run", "step.build", "compiled.describe"),
    "rundir": ("training.rundir",),
    "schedules": ("step.pipelined", "parallel.schedules"),
    "sequence": ("parallel.context", "nn.sequence"),
    "sharding": ("parallel.sharding",),
    "state": ("step.state",),
    "throughput": ("cost.throughput",),
    "trainer": ("training.trainer",),
    "xla_flags": ("step.xla_flags",),
    "zero": ("parallel.zero",),
    # renamed since the last release
    "parallel.mesh_rules": ("parallel.layout_checks",),  # checks, not a rules table
    "cli.bench": BENCH,  # a library of its own: a module per section
    "cli.bench_generate": ("bench.generate",),
    "cli.bench_grpo": ("bench.grpo",),
    "generation.rollouts": ("objectives.rollouts",),  # the GRPO driver, with its objective
    # what the commands run, out of the command line (cli/ parses and dispatches)
    "cli.commands": ("recipe", "planning", "inspection", "training.console"),
    "cli.inspect": ("inspection",),
}
# modules that `import jaxpar` exports by these names: importing them is not deprecated
EXPORTED = {"mesh", "distributed"}


def _homes(old: str) -> list[types.ModuleType]:
    return [importlib.import_module(f"jaxpar.{home}") for home in MOVED[old]]


def _warn(old: str, new: str, stacklevel: int) -> None:
    """Warn at the user's line: the caller is stacklevel 1 (the warnings module skips
    the import system's own frames)."""
    warnings.warn(
        f"{old} moved to {new}; import it from there ({old} goes in jaxpar {REMOVED_IN})",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def _found(old: str, name: str):
    """(the home module holding `name`, its value), or raise AttributeError."""
    if not name.startswith("__"):
        for home in _homes(old):
            value = getattr(home, name, home)
            if value is not home and not isinstance(value, types.ModuleType):
                return home, value
    raise AttributeError(
        f"module 'jaxpar.{old}' has no attribute {name!r} (its last release's names "
        f"are in {', '.join(f'jaxpar.{h}' for h in MOVED[old])})"
    )


def attribute(package: str, name: str):
    """`name` of the last release's module that a subpackage now stands where (e.g.
    jaxpar.config's Config, now in jaxpar.config.sections), with the warning."""
    old = package.removeprefix("jaxpar.")
    holder = vars(sys.modules[package])
    if name.startswith("__") or (  # a submodule of the package, not yet imported: importing
        "__path__" in holder and importlib.util.find_spec(f"{package}.{name}") is not None
    ):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    home, value = _found(old, name)
    public = sys.modules["jaxpar"]
    new = f"jaxpar.{name}" if name in public.__all__ else f"{home.__name__}.{name}"
    _warn(f"{package}.{name}", new, 3)  # attribute, the package's __getattr__
    return value


class _Split(types.ModuleType):
    """An old module whose names went to several new homes: each read from them."""

    def __getattr__(self, name: str):
        return _found(self.__name__.removeprefix("jaxpar."), name)[1]

    def __dir__(self) -> list[str]:
        old = self.__name__.removeprefix("jaxpar.")
        return sorted(
            name
            for home in _homes(old)
            for name, value in vars(home).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)
        )


class _OldPaths(MetaPathFinder, Loader):
    """Finds `jaxpar.<old>` (after every real module, so that none is shadowed)."""

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != "jaxpar" or old not in MOVED:
            return None
        return ModuleSpec(fullname, self)

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        return _Split(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__.removeprefix("jaxpar.")
        homes = [f"jaxpar.{home}" for home in MOVED[old]]
        if old not in EXPORTED:
            _warn(module.__name__, " and ".join(homes), 2)  # exec_module, the import
        if len(homes) == 1:  # the very module: the import binds it (importlib re-reads)
            sys.modules[module.__name__] = importlib.import_module(homes[0])
        else:
            module.__all__ = dir(module)


def install() -> None:
    """Put the finder last on sys.meta_path (once, however often jaxpar is imported)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
