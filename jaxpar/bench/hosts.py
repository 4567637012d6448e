"""`jaxpar bench --only hosts`: data parallelism across two hosts of 4 devices: flat ZeRO,
ZeRO groups replicated, parameter averaging; the bytes over each axis and across the two
hosts."""

from __future__ import annotations

from jaxpar.bench import measure
from jaxpar.cost.report import human_bytes

# Data parallelism across two hosts of 4 devices (simulated: the mesh's first and second
# halves): flat ZeRO over 8, ZeRO groups of 4 replicated twice, parameter averaging.
ACROSS_HOSTS = {
    "flat zero1": ("parallel.data=8", "parallel.zero=1"),
    "replica2 zero1": ("parallel.replica=2", "parallel.data=4", "parallel.zero=1"),
    "flat zero3": ("parallel.data=8", "parallel.zero=3"),
    "replica2 zero3": ("parallel.replica=2", "parallel.data=4", "parallel.zero=3"),
    **{
        f"params every {k}": (
            "parallel.data=8",
            "parallel.dp_sync=params",
            f"parallel.sync_every={k}",
        )
        for k in (1, 4, 36)
    },
}

ACROSS_HOSTS_COLUMNS = {
    "step ms": measure.step_ms,
    "replica wire": measure.bytes_of(lambda rep: rep.comm.by_axis["replica"].wire),
    "replica min": measure.bytes_of(lambda rep: rep.comm.by_axis["replica"].minimum),
    "data wire": measure.bytes_of(lambda rep: rep.comm.by_axis["data"].wire),
    "data min": measure.bytes_of(lambda rep: rep.comm.by_axis["data"].minimum),
    "across 2 hosts": lambda r: human_bytes(r["across_2_hosts"]),
    "state": measure.state,
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"data parallelism across 2 hosts of 4 devices, {where}; per device per step"
    return {
        "hosts": measure.layouts(
            "hosts", tables, title, "layout", ACROSS_HOSTS, ACROSS_HOSTS_COLUMNS, steps, base
        )
    }
