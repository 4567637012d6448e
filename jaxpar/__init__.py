"""jaxpar: data (server, ring, XLA), tensor, pipeline (GPipe, 1F1B, interleaved) and
ZeRO 0-3 parallelism with ZeRO-Offload, for JAX/Flax models, on one named mesh."""

from jaxpar import distributed, mesh
from jaxpar.config import Checkpoint, Config, Data, Model, Parallel, Train, load
from jaxpar.errors import ConfigError, NonFinite
from jaxpar.export import load as load_exported
from jaxpar.export import to_nnx
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
from jaxpar.state import TrainState
from jaxpar.trainer import Result, restore, train

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
    "Checkpoint",
    "Config",
    "ConfigError",
    "Data",
    "Model",
    "NonFinite",
    "Parallel",
    "Problem",
    "Result",
    "Stages",
    "Train",
    "TrainState",
    "build_mesh",
    "constrain",
    "distributed",
    "from_nnx",
    "from_pytree",
    "load",
    "load_exported",
    "mesh",
    "param",
    "restore",
    "scan_layers",
    "to_nnx",
    "train",
]
