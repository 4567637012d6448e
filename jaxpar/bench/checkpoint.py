"""`jaxpar bench --only checkpoint`: checkpointing's cost on data=8, ZeRO-3: the time a
save holds the loop, and the bytes on disk against the ledger's state times the devices."""

from __future__ import annotations

from jaxpar.bench import measure
from jaxpar.cost.report import human_bytes

# Checkpointing overhead on data=8 ZeRO-3 (nothing replicated: the state on disk is the
# ledger's per-device state times the devices).
CHECKPOINTS = {
    "off": ("parallel.data=8", "parallel.zero=3", "checkpoint.every=0"),
    "every=1 (async)": ("parallel.data=8", "parallel.zero=3", "checkpoint.every=1"),
    "every=1 (async, zstd)": (
        "parallel.data=8", "parallel.zero=3", "checkpoint.every=1", "checkpoint.compress=true",
    ),
    # a local tier in memory (tmpfs), every tenth save to the disk's
    "every=1, local tier /dev/shm": (
        "parallel.data=8", "parallel.zero=3", "checkpoint.every=1",
        "checkpoint.local_dir=/dev/shm", "checkpoint.shared_every=10",
    ),
}  # fmt: skip

CHECKPOINT_COLUMNS = {
    "trainer step ms": lambda r: f"{r['step_s'] * r['trainer_over_bare'] * 1e3:.1f}",
    # the trainer's loop over the bare compiled step, timed alternately in the same row:
    # the rows' ratio to "off" in this column is the cost of saving; the step times of
    # two rows, measured minutes apart, drift by 5-10% on these cores
    "x its bare step": lambda r: f"{r['trainer_over_bare']:.3f}",
    "blocking ms/save": lambda r: (
        "-" if r["save_blocking_s"] is None else f"{r['save_blocking_s'] * 1e3:.1f}"
    ),
    "on disk": lambda r: human_bytes(r["disk_bytes"]),
    "ledger state x devices": measure.bytes_of(lambda rep: rep.state_bytes.actual * rep.devices),
    "disk / ledger": lambda r: (
        "-"
        if r["disk_bytes"] is None
        else f"{r['disk_bytes'] / (r['report'].state_bytes.actual * r['report'].devices):.3f}"
    ),
}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    where = measure.where(base)
    title = f"checkpointing, {where}, data=8, ZeRO-3 (orbax, asynchronous)"
    return {
        "checkpoint": measure.layouts(
            "checkpoint", tables, title, "checkpoint", CHECKPOINTS, CHECKPOINT_COLUMNS, steps, base
        )
    }
