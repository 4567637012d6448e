"""Adapters out to Hugging Face PEFT: `adapter_model.safetensors` (each target's lora_A
[r, in] and lora_B [out, r], per layer and expert, under PEFT's names) and
`adapter_config.json`, which `peft.PeftModel.from_pretrained` loads on the base."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar import hf
from jaxpar.adapters.lora import Linear, targets_of
from jaxpar.config.sections import Adapter
from jaxpar.hf import Tensor

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names


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
        "target_modules": sorted({p.module for p in targets_of(adapter, model)}),
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
