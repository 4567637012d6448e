"""`jaxpar bench --only offload`: ZeRO-Offload on data=8: what stays on the device and what
moves to the host."""

from __future__ import annotations

from jaxpar.bench import measure

# ZeRO-Offload on data=8.
OFFLOAD = {
    f"zero{zero} {precision} {mode}": (
        "parallel.data=8",
        f"parallel.zero={zero}",
        f"parallel.offload={mode}",
        f"train.precision={precision}",
    )
    for zero, modes in ((1, ("none", "optimizer")), (3, ("none", "optimizer+params")))
    for precision in ("fp32", "bf16")
    for mode in modes
}

OFFLOAD_COLUMNS = {
    "step ms": measure.step_ms,
    "device params": measure.bytes_of(lambda rep: rep.memory_per_device.params),
    "device opt state": measure.bytes_of(lambda rep: rep.memory_per_device.opt_state),
    "host params": measure.bytes_of(lambda rep: rep.host_memory_per_device.params),
    "host opt state": measure.bytes_of(lambda rep: rep.host_memory_per_device.opt_state),
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"ZeRO-Offload, {where}, data=8"
    return {
        "offload": measure.layouts(
            "offload",
            tables,
            title,
            "zero precision offload",
            OFFLOAD,
            OFFLOAD_COLUMNS,
            steps,
            base,
        )
    }
