"""`jaxpar bench --only context`: long sequences: whole sequences over data, then split
over context by each strategy, and with tensor + sequence parallelism; the bytes over
context against the minimum."""

from __future__ import annotations

from jaxpar.bench import measure

# Long sequences on 8 devices at two lengths, 8 rows a step: whole sequences over data,
# then each split over context (each strategy), and with tensor + sequence parallelism.
CONTEXT_LENGTHS = (256, 1024)
CONTEXT_LAYOUTS = {
    "data=8": ("parallel.data=8",),
    "context=8 all_gather": ("parallel.data=1", "parallel.context=8"),
    "context=8 ulysses": (
        "parallel.data=1", "parallel.context=8", "parallel.context_strategy=ulysses"
    ),
    "data=2 context=4": ("parallel.data=2", "parallel.context=4"),
    "context=4 tensor=2 sp": (
        "parallel.data=1", "parallel.context=4", "parallel.tensor=2",
        "parallel.sequence_parallel=true",
    ),
}  # fmt: skip
CONTEXT = {
    f"S={seq} {name}": (*overrides, f"train.seq_len={seq}", "train.batch_size=8")
    for seq in CONTEXT_LENGTHS
    for name, overrides in CONTEXT_LAYOUTS.items()
}

CONTEXT_COLUMNS = {
    "step ms": measure.step_ms,
    "tokens/s": measure.tokens_per_s,
    "device temp": measure.bytes_of(lambda rep: rep.memory_per_device.temp),
    "context wire": measure.bytes_of(lambda rep: rep.comm.by_axis["context"].wire),
    "context min": measure.bytes_of(lambda rep: rep.comm.by_axis["context"].minimum or 0),
    "tensor wire": measure.bytes_of(lambda rep: rep.comm.by_axis["tensor"].wire),
    "comm/step": measure.comm,
    "ratio": measure.comm_ratio,
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"long sequences, {where}, 8 rows a step, ZeRO-0"
    return {
        "context": measure.layouts(
            "context", tables, title, "sequence layout", CONTEXT, CONTEXT_COLUMNS, steps, base
        )
    }
