"""jaxpar: data (server, ring, XLA), tensor (with sequence parallelism), pipeline (GPipe,
1F1B, interleaved), context (all_gather, Ulysses), expert and ZeRO 0-3 parallelism with
ZeRO-Offload, for JAX/Flax models, on one named mesh.

The names below are imported when first used, so that `import jaxpar` (and the `jaxpar`
command's help and config checks) does not start jax.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("jaxpar")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# public name -> (module, attribute there)
_EXPORTS = {
    **{
        name: ("jaxpar.sharding", name)
        for name in ("BATCH", "EMBED", "EXPERTS", "HEAD_DIM", "HEADS", "LAYERS", "MLP", "QKV")
        + ("SEQ", "SEQ_RESIDUAL", "STAGE", "VOCAB")
    },
    **{
        name: ("jaxpar.config", name)
        for name in ("Checkpoint", "Config", "Data", "Distributed", "Model", "Parallel", "Train")
    },
    "load": ("jaxpar.presets", "load"),
    **{
        name: ("jaxpar.errors", name)
        for name in ("CheckpointError", "ConfigError", "ParamsError", "RendezvousError")
        + ("UserError", "Stopped", "NonFinite", "ReplicasDiverged")
    },
    "ModelSpec": ("jaxpar.registry", "ModelSpec"),
    "register_model": ("jaxpar.registry", "register"),
    "load_exported": ("jaxpar.export", "load"),
    "to_nnx": ("jaxpar.export", "to_nnx"),
    "causal_attention": ("jaxpar.attention", "causal_attention"),
    "report": ("jaxpar.context", "report"),
    "batch_sum": ("jaxpar.layers", "batch_sum"),
    "constrain": ("jaxpar.layers", "constrain"),
    "dense": ("jaxpar.layers", "dense"),
    "param": ("jaxpar.layers", "param"),
    "scan_layers": ("jaxpar.layers", "scan_layers"),
    "stack": ("jaxpar.layers", "stack"),
    "to_experts": ("jaxpar.layers", "to_experts"),
    "from_experts": ("jaxpar.layers", "from_experts"),
    "tensor_parallel": ("jaxpar.layers", "tensor_parallel"),
    "build_mesh": ("jaxpar.mesh", "build_mesh"),
    "plan": ("jaxpar.planner", "plan"),
    "Problem": ("jaxpar.problem", "Problem"),
    "Stages": ("jaxpar.problem", "Stages"),
    "from_nnx": ("jaxpar.problem", "from_nnx"),
    "from_pytree": ("jaxpar.problem", "from_pytree"),
    "TrainState": ("jaxpar.state", "TrainState"),
    "Result": ("jaxpar.trainer", "Result"),
    "restore": ("jaxpar.checkpoint", "restore"),
    "train": ("jaxpar.trainer", "train"),
    "generate": ("jaxpar.prompts", "generate"),
    "distributed": ("jaxpar.distributed", None),
    "mesh": ("jaxpar.mesh", None),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = import_module(module)
    return value if attribute is None else getattr(value, attribute)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
