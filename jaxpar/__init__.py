"""jaxpar: data (server, ring, XLA), tensor, pipeline (GPipe, 1F1B, interleaved) and
ZeRO 0-3 parallelism with ZeRO-Offload, for JAX/Flax models, on one named mesh."""

from jaxpar.config import Config, Data, Model, Parallel, Train, load
from jaxpar.errors import ConfigError
from jaxpar.layers import constrain, param, scan_layers
from jaxpar.mesh import build_mesh
from jaxpar.problem import Problem, Stages, from_nnx, from_pytree
from jaxpar.sharding import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    LAYERS,
    MLP,
    QKV,
    SEQ,
    STAGE,
    VOCAB,
)
from jaxpar.trainer import Result, train

__all__ = [
    "BATCH",
    "EMBED",
    "HEAD_DIM",
    "HEADS",
    "LAYERS",
    "MLP",
    "QKV",
    "SEQ",
    "STAGE",
    "VOCAB",
    "Config",
    "ConfigError",
    "Data",
    "Model",
    "Parallel",
    "Problem",
    "Result",
    "Stages",
    "Train",
    "build_mesh",
    "constrain",
    "from_nnx",
    "from_pytree",
    "load",
    "param",
    "scan_layers",
    "train",
]
