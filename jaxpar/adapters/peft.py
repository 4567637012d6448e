"""Adapters in and out of Hugging Face PEFT: `adapter_model.safetensors` (each target's
lora_A [r, in] and lora_B [out, r], per layer and expert, under PEFT's names) and
`adapter_config.json`. Out: what `peft.PeftModel.from_pretrained` loads on the base. In
(adapter.init=peft:DIR): an adapter PEFT saved, its config read into adapter.*, each
device's shard of A and B read from the file as a base's is (jaxpar.hf.read_params)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxpar import hf
from jaxpar.adapters import lora
from jaxpar.adapters.lora import Linear, targets_of
from jaxpar.config.sections import Adapter, Config
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.hf import Tensor

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names
SCHEME = "peft:"
# adapter_config.json's settings of a LoRA that W + (alpha / r) A B is not, at their
# plain values: anything else is refused
PLAIN = {
    "peft_type": "LORA",
    "use_dora": False,
    "use_rslora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


def tensors(p: Linear) -> tuple[Tensor, Tensor]:
    """A's and B's tensors in PEFT's file: nn.Linear's [out, in] of lora_A (in -> r)
    and lora_B (r -> out); R is the rank."""
    out, inp = (" ".join(g) for g in hf.dims_of(p.tensor.file_dims))
    module = PREFIX + p.tensor.name.removesuffix(".weight")
    t = p.tensor
    return (
        Tensor(p.a, f"{module}.lora_A.weight", f"R ({inp})", f"{inp} R", t.every, t.offset),
        Tensor(p.b, f"{module}.lora_B.weight", f"({out}) R", f"R {out}", t.every, t.offset),
    )


def config(adapter: Adapter, model, base: str) -> dict:
    """adapter_config.json: PEFT's LoraConfig of these adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": adapter.dropout,
        "target_modules": sorted(lora.wanted(adapter)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def export(adapter: Adapter, model, params: dict, to: Path, base: str = "") -> int:
    """Write the adapters of `params` (host arrays by key) as a PEFT adapter directory;
    returns the number of tensors."""
    out = {}
    for p in targets_of(adapter, model):
        for t in tensors(p):
            ours = np.asarray(params[t.key], np.float32)
            stacked = ours.shape[: len(t.stacked)]
            out |= {t.file_name(i): hf.to_file(t, ours[i]) for i in np.ndindex(stacked)}
    to.mkdir(parents=True, exist_ok=True)
    hf.save_safetensors(out, to / WEIGHTS, {"format": "pt"})
    (to / CONFIG).write_text(json.dumps(config(adapter, model, base), indent=2) + "\n")
    return len(out)


def directory_of(init: str) -> Path | None:
    """adapter.init -> the PEFT adapter directory (None: fresh adapters)."""
    if not init:
        return None
    directory = Path(init.removeprefix(SCHEME)).expanduser()
    if not init.startswith(SCHEME) or not directory.is_dir():
        raise ConfigError(
            f"adapter.init={init}: give peft:DIR, a directory PEFT's save_pretrained wrote "
            "(adapter_config.json, adapter_model.safetensors), or leave it empty for fresh "
            "adapters"
        )
    return directory


def resolve(cfg: Config, explicit: set[str]) -> Config:
    """`cfg` with adapter.rank, alpha and targets read from adapter.init's
    adapter_config.json (unchanged without one); those in `explicit` (set by the user)
    must agree with it."""
    adapter = cfg.adapter
    directory = directory_of(adapter.init)
    if directory is None:
        return cfg
    where = f"adapter.init={adapter.init}"
    if not cfg.model.init:
        raise ConfigError(
            f"{where}: an adapter is trained on its base; give that base as "
            "model.init=hf:DIR (the checkpoint PEFT's adapter was made on)"
        )
    try:
        written = json.loads((directory / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}: {CONFIG} cannot be read ({e})") from None
    if not isinstance(written, dict) or not isinstance(written.get("r"), int):
        raise CheckpointError(
            f"{where}: {CONFIG} names no rank r; give a directory PEFT's save_pretrained wrote"
        )
    for name, plain in PLAIN.items():
        if written.get(name, plain) not in (plain, [], {}):
            raise CheckpointError(
                f"{where}: {CONFIG} has {name}={written[name]!r}; jaxpar trains plain LoRA "
                f"({name}={plain!r}), W + (alpha / r) A B on the target projections"
            )
    modules = written.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else modules
    keys = {
        "rank": written.get("r"),
        "alpha": written.get("lora_alpha", 8),  # PEFT's default
        "targets": ",".join(sorted(modules)),
    }
    for key, value in keys.items():
        mine = getattr(adapter, key)
        if key in explicit and (
            set(mine.split(",")) != set(value.split(",")) if key == "targets" else mine != value
        ):
            raise ConfigError(
                f"adapter.{key}={mine} disagrees with {where}, whose {CONFIG} gives {value}; "
                f"drop adapter.{key}, or use another adapter"
            )
    keys["alpha"] = float(keys["alpha"])
    return dataclasses.replace(cfg, adapter=dataclasses.replace(adapter, **keys))


def initial(adapter: Adapter, model, shapes: dict):
    """(targets -> params) of the adapters in adapter.init's directory (jaxpar.hf.
    initial_params, for A and B): their names and shapes checked now against the base
    `model.*` and adapter.rank."""
    directory = directory_of(adapter.init)
    return hf.read_params(
        [t for p in targets_of(adapter, model) for t in tensors(p)],
        directory,
        shapes,
        f"adapter.init={adapter.init}",
        f"model.name={model.name} with adapter.rank={adapter.rank}",
        ignore=r"$^",
    )
