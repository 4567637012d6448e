"""A run's starting weights read from files: model.init's Hugging Face checkpoint, and on
an adapter run adapter.init's PEFT adapters beside its base (each leaf read shard by
shard onto the devices that hold it)."""

from __future__ import annotations

from collections.abc import Callable

from jaxpar import hf
from jaxpar.adapters import lora, peft
from jaxpar.config import registry
from jaxpar.config.sections import Adapter, AdapterKind, Model, Train
from jaxpar.nn.problem import Problem


def params(
    model: Model, adapter: Adapter, train: Train, own: Problem
) -> Callable[[dict], dict] | None:
    """(targets -> arrays, as jaxpar.train takes them) for `own` (the registered model,
    adapters on it, no objective); None for the init from train.seed."""
    directory = hf.directory_of(model.init)
    if directory and adapter.kind is AdapterKind.LORA:
        read = peft.initial(adapter, model, own.shapes) if adapter.init else None
        return lora.from_files(model, train, own, directory, read)
    if directory:
        fmt = registry.hf_format(model.name, "model.init")
        return hf.initial_params(fmt, model, directory, own.shapes)
    return None
