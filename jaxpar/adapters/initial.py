"""A run's starting weights read from files: model.init's Hugging Face checkpoint, and on
an adapter run adapter.init's PEFT adapters beside its base (each leaf read shard by
shard onto the devices that hold it)."""

from __future__ import annotations

from collections.abc import Callable

from jaxpar import hf
from jaxpar.adapters import lora, peft
from jaxpar.config import registry
from jaxpar.config.sections import AdapterKind, Config
from jaxpar.nn.problem import Problem


def params(cfg: Config, own: Problem) -> Callable[[dict], dict] | None:
    """(targets -> arrays, as jaxpar.train takes them) for `own` (the registered model,
    adapters on it, no objective); None for the init from train.seed."""
    directory = hf.directory_of(cfg.model.init)
    if directory and cfg.adapter.kind is AdapterKind.LORA:
        read = peft.initial(cfg.adapter, cfg.model, own.shapes) if cfg.adapter.init else None
        return lora.from_files(cfg, own, directory, read)
    if directory:
        fmt = registry.hf_format(cfg.model.name, "model.init")
        return hf.initial_params(fmt, cfg.model, directory, own.shapes)
    return None
