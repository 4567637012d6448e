"""`jaxpar bench --only remat`: activation checkpointing of the layers on data=8, ZeRO-1:
device temporaries against the activations kept on the host."""

from __future__ import annotations

from jaxpar.bench import measure

# Activation checkpointing of the layers, data=8, ZeRO-1.
REMAT = {
    mode: ("parallel.data=8", "parallel.zero=1", f"parallel.remat={mode}")
    for mode in ("none", "full", "offload")
}

REMAT_COLUMNS = {
    "step ms": measure.step_ms,
    "device temp": measure.bytes_of(lambda rep: rep.memory_per_device.temp),
    "host activations": measure.bytes_of(lambda rep: rep.host_memory_per_device.activations),
    "compiled host temp": measure.bytes_of(lambda rep: rep.host_memory_per_device.temp),
    "comm/step": measure.comm,
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"activation checkpointing, {where}, data=8, ZeRO-1"
    return {
        "remat": measure.layouts(
            "remat", tables, title, "parallel.remat", REMAT, REMAT_COLUMNS, steps, base
        )
    }
