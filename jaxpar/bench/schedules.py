"""`jaxpar bench --only schedules`: pipeline schedules on data=4 x pipeline=2: the bubble
against its formula, the temporaries, and the stage-to-stage bytes against their
minimum."""

from __future__ import annotations

from jaxpar.bench import measure

# Pipeline schedules on 8 devices (data=4 x pipeline=2), 8 micro-batches of 1 sequence.
SCHEDULES = {
    name: (
        "parallel.data=4",
        "parallel.pipeline=2",
        "parallel.microbatches=8",
        "train.batch_size=32",
        *extra,
    )
    for name, extra in {
        "gpipe": ("parallel.schedule=gpipe",),
        "1f1b": ("parallel.schedule=1f1b",),
        "zb-h1": ("parallel.schedule=zb-h1",),
        "zbv": ("parallel.schedule=zbv",),
        "dualpipev": ("parallel.schedule=dualpipev",),
        "interleaved-v2": ("parallel.schedule=interleaved", "parallel.virtual_stages=2"),
    }.items()
}

SCHEDULE_COLUMNS = {
    "bubble": lambda r: f"{r['report'].pipeline.bubble:.3f}",
    "formula": lambda r: f"{r['report'].pipeline.bubble_formula:.3f}",
    "temp": measure.bytes_of(lambda rep: rep.memory_per_device.temp),
    "step ms": measure.step_ms,
    "tokens/s": measure.tokens_per_s,
    "permute": measure.bytes_of(lambda rep: rep.pipeline.permute_bytes_per_device),
    "minimum": measure.bytes_of(lambda rep: rep.pipeline.permute_minimum_per_device),
    "ratio": lambda r: f"{r['report'].pipeline.permute_ratio:.3f}",
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"pipeline schedules, {where}: {' '.join(SCHEDULES['gpipe'][:4])}"
    return {
        "schedules": measure.layouts(
            "schedules", tables, title, "schedule", SCHEDULES, SCHEDULE_COLUMNS, steps, base
        )
    }
