"""jaxpar: data (server, ring, XLA), tensor (with sequence parallelism), pipeline (GPipe,
1F1B, interleaved), context (all_gather, Ulysses), expert and ZeRO 0-3 parallelism with
ZeRO-Offload, for JAX/Flax models, on one named mesh.

The names below are imported when first used, so that `import jaxpar` (and the `jaxpar`
command's help and config checks) does not start jax.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from jaxpar import moved

try:
    __version__ = version("jaxpar")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> (module, attribute there)
_EXPORTS = {
    **{
        name: ("jaxpar.names", name)
        for name in ("BATCH", "EMBED", "EXPERTS", "HEAD_DIM", "HEADS", "LAYERS", "MLP", "QKV")
        + ("SEQ", "SEQ_RESIDUAL", "STAGE", "VOCAB")
    },
    **{
        name: ("jaxpar.config.sections", name)
        for name in ("Adapter", "Checkpoint", "Config", "Data", "Distributed", "Dpo", "Grpo")
        + ("Model", "Muon")
        + ("Parallel", "Train")
    },
    "load": ("jaxpar.config.presets", "load"),
    **{
        name: ("jaxpar.errors", name)
        for name in ("CheckpointError", "ConfigError", "ParamsError", "RendezvousError")
        + ("UserError", "Stopped", "NonFinite", "ReplicasDiverged")
    },
    "ModelSpec": ("jaxpar.config.registry", "ModelSpec"),
    "ModelDims": ("jaxpar.config.registry", "ModelDims"),
    "BlockKind": ("jaxpar.config.registry", "BlockKind"),
    "register_model": ("jaxpar.config.registry", "register"),
    "load_exported": ("jaxpar.training.export", "load"),
    "to_nnx": ("jaxpar.training.export", "to_nnx"),
    "causal_attention": ("jaxpar.nn.attention", "causal_attention"),
    "report": ("jaxpar.nn.scope", "report"),
    "batch_sum": ("jaxpar.nn.layers", "batch_sum"),
    "constrain": ("jaxpar.nn.layers", "constrain"),
    "dense": ("jaxpar.nn.layers", "dense"),
    "param": ("jaxpar.nn.layers", "param"),
    "scan_layers": ("jaxpar.nn.layers", "scan_layers"),
    "stack": ("jaxpar.nn.layers", "stack"),
    "to_experts": ("jaxpar.nn.experts", "to_experts"),
    "from_experts": ("jaxpar.nn.experts", "from_experts"),
    "tensor_parallel": ("jaxpar.nn.tensor_parallel", "tensor_parallel"),
    "build_mesh": ("jaxpar.parallel.mesh", "build_mesh"),
    "plan": ("jaxpar.cost.planner", "plan"),
    "Problem": ("jaxpar.nn.problem", "Problem"),
    "Stages": ("jaxpar.nn.problem", "Stages"),
    "from_nnx": ("jaxpar.nn.problem", "from_nnx"),
    "from_pytree": ("jaxpar.nn.problem", "from_pytree"),
    "TrainState": ("jaxpar.step.state", "TrainState"),
    "Result": ("jaxpar.training.trainer", "Result"),
    "restore": ("jaxpar.training.checkpoint", "restore"),
    "train": ("jaxpar.training.trainer", "train"),
    "setup": ("jaxpar.recipe", "setup"),
    "Hook": ("jaxpar.training.hooks", "Hook"),
    "Setup": ("jaxpar.recipe", "Setup"),
    "generate": ("jaxpar.generation.prompts", "generate"),
    "distributed": ("jaxpar.parallel.distributed", None),
    "mesh": ("jaxpar.parallel.mesh", None),
}
__all__ = sorted(_EXPORTS)
moved.install()  # the last release's module paths, forwarded with a warning


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = import_module(module)
    return value if attribute is None else getattr(value, attribute)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
