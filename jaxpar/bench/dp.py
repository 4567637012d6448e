"""`jaxpar bench --only dp`: the data-parallel gradient reduction by XLA, the ring and the
gradient server, at two bucket sizes: wire bytes against the minimum, the busiest
device, the collectives."""

from __future__ import annotations

from jaxpar.bench import measure

# Data-parallel gradient reduction, data=8, ZeRO-0.
DP_MODES = {
    "xla": ("parallel.data=8", "parallel.dp_collective=xla"),
    "ring": ("parallel.data=8", "parallel.dp_collective=ring"),
    "ring-0.1MB": ("parallel.data=8", "parallel.dp_collective=ring", "parallel.bucket_mb=0.1"),
    "server": ("parallel.data=8", "parallel.dp_collective=server"),
    "server-0.1MB": ("parallel.data=8", "parallel.dp_collective=server", "parallel.bucket_mb=0.1"),
}

DP_COLUMNS = {
    "step ms": measure.step_ms,
    "wire/device": measure.comm,
    "minimum": measure.minimum,
    "busiest device": measure.bytes_of(lambda rep: rep.comm.busiest_device_bytes),
    "collectives": lambda r: str(
        sum(n for k, n in r["report"].collective_counts.items() if k.endswith("@data"))
    ),
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"data-parallel gradient reduction, {where}, data=8, ZeRO-0"
    return {
        "dp": measure.layouts(
            "dp", tables, title, "dp_collective", DP_MODES, DP_COLUMNS, steps, base
        )
    }
