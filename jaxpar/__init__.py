"""jaxpar: data, tensor and ZeRO parallelism for JAX/Flax on one named mesh."""

from jaxpar.config import Config, ConfigError, Data, Model, Parallel, Train, load
from jaxpar.layers import constrain, param, scan_layers
from jaxpar.mesh import build_mesh
from jaxpar.problem import Problem, from_nnx, from_pytree
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
from jaxpar.trainer import Result, train, train_config

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
    "Train",
    "build_mesh",
    "constrain",
    "from_nnx",
    "from_pytree",
    "load",
    "param",
    "scan_layers",
    "train",
    "train_config",
]
