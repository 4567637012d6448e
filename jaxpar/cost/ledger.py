"""The cost model: a compiled step's collectives and memory against the textbook.

Wire bytes per device use the ring factors: all-reduce 2(n-1)/n of the buffer,
all-gather and all-to-all (n-1)/n of the gathered buffer, reduce-scatter (n-1)/n of
the input, collective-permute 1x for each device that sends (averaged over the
devices). Collectives inside loops count once per iteration (the HLO is read by
jaxpar.cost.hlo). Memory: per-device state bytes from the compiled input shardings against
the ZeRO paper's formula; temporaries from `memory_analysis()`. Pipelines: the bubble
measured from the schedule's tick table, and the hand-over bytes against one
activation per micro-batch per chunk boundary.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import jax

from jaxpar.cost import formulas as cost
from jaxpar.cost.hlo import Collective, collectives, loop_trip_counts
from jaxpar.cost.report import (
    AxisComm,
    Comm,
    DeviceMemory,
    HostMemory,
    KindTotals,
    Pipeline,
    StateBytes,
)
from jaxpar.parallel import schedules
from jaxpar.parallel.axes import CONTEXT, DATA, EXPERT, OPTIONAL_AXES, PIPE, REPLICA, TENSOR
from jaxpar.parallel.pipeline import Layout


def wire_bytes(c: Collective) -> float:
    """Bytes one device of the group puts on the wire per step for `c` (ring factors)."""
    n = c.group
    if n <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": c.senders}.get(
        c.kind, (n - 1) / n
    )
    return factor * c.buffer_bytes * c.executions


@dataclass
class Ledger:
    collectives: list[Collective]
    unknown_trip_counts: int = 0  # loops whose collectives were counted once

    def by_kind(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for c in self.collectives:
            row = out.setdefault(c.kind, {"count": 0, "bytes": 0, "wire_bytes": 0.0, "axes": {}})
            row["count"] += c.executions
            row["bytes"] += c.buffer_bytes * c.executions
            row["wire_bytes"] += wire_bytes(c)
            key = "+".join(c.axes) or "none"
            row["axes"][key] = row["axes"].get(key, 0) + c.executions
        return out

    def wire_bytes(self, axes: set[str] | None = None, kinds: set[str] | None = None) -> float:
        """Wire bytes per device, of all collectives or of the part crossing `axes`
        (Collective.share: a group over several axes split between them)."""
        return sum(
            wire_bytes(c) * (1.0 if axes is None else min(1.0, sum(c.share(a) for a in axes)))
            for c in self.collectives
            if kinds is None or c.kind in kinds
        )

    def device_bytes(self) -> dict[int, float]:
        """Bytes each device sends plus receives per step (ring model for group collectives)."""
        out: dict[int, float] = defaultdict(float)
        for c in self.collectives:
            if c.kind == "collective-permute":
                for source, target in c.groups:
                    out[source] += c.buffer_bytes * c.executions
                    out[target] += c.buffer_bytes * c.executions
            elif c.group > 1:
                sent = wire_bytes(c)  # per member; it receives as much
                for group in c.groups:
                    for device in group:
                        out[device] += 2 * sent
        return dict(out)

    def busiest_device_bytes(self) -> float:
        return max(self.device_bytes().values(), default=0.0)

    def counts(self) -> dict[str, int]:
        """Executions per step by 'kind@axes' (for golden files); trivial groups skipped."""
        out: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            if c.group > 1:
                out[f"{c.kind}@{'+'.join(c.axes)}"] += c.executions
        return dict(sorted(out.items()))


def read(
    hlo_text: str, mesh_shape: dict[str, int], rates: dict[str, float] | None = None
) -> Ledger:
    """The collectives of an optimized HLO module, per device, per step (`rates`: see
    jaxpar.cost.hlo.collectives)."""
    return Ledger(*collectives(hlo_text, mesh_shape, rates))


def assumes(zero: int, compute: str, reduce: str, sync_every: int | None = None) -> str:
    """What the minimum counts, with the dtypes, in words (summary.json's comm.assumes)."""
    if sync_every:
        return (
            f"parameter averaging: one all-reduce of the fp32 parameters every {sync_every} steps"
        )
    grads = f"gradients summed in {reduce}"
    if zero == 0:
        return f"ZeRO-0: one all-reduce of the {grads}"
    if zero in (1, 2):
        return (
            f"ZeRO-{zero}: reduce-scatter of the {grads}"
            + (" every micro-batch" if zero == 2 else "")
            + ", all-gather of the updated fp32 parameters"
        )
    return (
        f"ZeRO-3: parameters gathered in {compute}, a layer stack's twice (forward, "
        f"backward) and other leaves once per micro-batch; {grads}, reduce-scattered"
    )


def _state_totals(compiled, state_shapes) -> dict[tuple[str, bool], int]:
    """Per-device bytes of each part of the compiled step's state, by (part, on host):
    host arrays are the ones its input shardings place in pinned_host."""
    state_sh = compiled.input_shardings[0][0]
    totals = defaultdict(int)
    for part in ("params", "opt", "compute", "local.params", "local.opt"):
        shapes, shardings = _part(state_shapes, part), _part(state_sh, part)
        for x, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
            host = sh.memory_kind == "pinned_host"
            totals[part, host] += math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
    return totals


def _part(state, dotted: str):
    for name in dotted.split("."):
        state = None if state is None else getattr(state, name)
    return state


def memory(
    compiled,
    state_shapes,
    grads: int,
    host_activations: int,
    frozen=frozenset(),
    reference=frozenset(),
) -> tuple[DeviceMemory, HostMemory]:
    """Per-device memory of the compiled step, on the device and in host memory; of the
    parameters, the `frozen` leaves' apart: an adapter run's base, and a reference
    model's copy (DPO's `reference` keys)."""
    t = _state_totals(compiled, state_shapes)
    stats = compiled.memory_analysis()
    shardings = compiled.input_shardings[0][0].params

    def held(keys) -> int:
        return sum(
            math.prod(shardings[k].shard_shape(state_shapes.params[k].shape))
            * state_shapes.params[k].dtype.itemsize
            for k in keys
        )

    device = DeviceMemory(
        # the parameters it computes with (a compute copy when offloaded)
        params=t["params", False] + t["compute", False] + t["local.params", False],
        grads=grads,
        opt_state=t["opt", False] + t["local.opt", False],
        temp=int(stats.temp_size_in_bytes),
        base=held(frozen - reference),
        reference=held(reference),
    )
    host = HostMemory(
        params=t["params", True] + t["compute", True],
        opt_state=t["opt", True],
        activations=host_activations,
        temp=int(stats.host_temp_size_in_bytes),
    )
    return device, host


def state_bytes(compiled, state_shapes, formula: float) -> StateBytes:
    """The model state of the ZeRO formula (master parameters and optimizer state, on
    the device and the host) against it."""
    t = _state_totals(compiled, state_shapes)
    parts = ("params", "opt", "local.params", "local.opt")
    actual = sum(t[part, host] for part in parts for host in (False, True))
    arguments = int(compiled.memory_analysis().argument_size_in_bytes)
    return StateBytes(actual=actual, formula=formula, ratio=actual / formula, arguments=arguments)


def across_processes(led: Ledger, axis: str, process_of: list[int]) -> float:
    """Of the wire bytes per device on `axis`, those between devices of different
    processes: a group collective's ring hops between consecutive members (by device
    position in the mesh, as the HLO numbers them), a permute's source-target pairs."""
    total = 0.0
    for c in led.collectives:
        if axis not in c.axes or not c.groups:
            continue
        if c.kind == "collective-permute":
            pairs = c.groups
        else:
            pairs = [(g[i], g[(i + 1) % len(g)]) for g in c.groups for i in range(len(g))]
        crossing = sum(process_of[a] != process_of[b] for a, b in pairs) / len(pairs)
        total += wire_bytes(c) * c.share(axis) * crossing
    return total


def comm(
    led: Ledger, minimum: dict[str, float | None], process_of: list[int], assumed: str = ""
) -> Comm:
    """Wire bytes against the textbook minimum, on the axes that have one; `process_of`
    is each mesh position's process; `assumed` says what the minimum counts."""
    wire = {axis: led.wire_bytes({axis}) for axis in (REPLICA, DATA, EXPERT, CONTEXT, TENSOR)}
    optional = OPTIONAL_AXES  # only where the mesh has them
    known = [
        a for a in wire if minimum[a] is not None and (a not in optional or minimum[a] or wire[a])
    ]
    total_min = sum(minimum[a] for a in known)
    return Comm(
        wire_bytes_per_device=led.wire_bytes(),
        minimum_bytes_per_device=total_min,
        ratio=sum(wire[a] for a in known) / total_min if total_min else None,
        by_axis={
            a: AxisComm(wire[a], minimum[a], across_processes(led, a, process_of)) for a in wire
        },
        ratio_axes=known,
        assumes=assumed,
        busiest_device_bytes=led.busiest_device_bytes(),
        unknown_trip_counts=led.unknown_trip_counts,
    )


def kinds(led: Ledger) -> dict[str, KindTotals]:
    return {kind: KindTotals(**row) for kind, row in led.by_kind().items()}


def pipeline_report(
    layout: Layout,
    schedule: str,
    m: int,
    accum: int,
    hlo_text: str,
    led: Ledger,
    activation_bytes: int,
) -> Pipeline:
    """Stage assignment, the bubble measured from the tick table the compiled loop runs,
    and the hand-over bytes against the minimum (`activation_bytes`: one micro-batch's
    activation at a chunk boundary)."""
    p, v = layout.stages, layout.virtual
    table = schedules.tick_table(schedule, p, m, v)
    loop = max(loop_trip_counts(hlo_text, schedules.TICKS_SCOPE), default=0)
    # Each hand-over between consecutive chunks carries one activation each way per
    # micro-batch; p * v - 1 hand-overs (a V's turn on its last device is none), shared
    # by p devices.
    boundaries = p * v - 1 - (1 if layout.vee else 0)
    minimum = 2 * m * accum * activation_bytes * boundaries / p
    permutes = led.wire_bytes({PIPE}, kinds={"collective-permute"}) * schedules.handover_share(
        schedule, p, m
    )
    return Pipeline(
        stages=layout.device_layers(),
        chunks=[list(c) for c in layout.chunks],
        schedule=schedule,
        microbatches=m,
        virtual_stages=v,
        ticks=loop,
        bubble=schedules.lockstep(table)[1] if loop == len(table) else None,
        bubble_formula=cost.bubble(p, m, v, schedule),
        permute_bytes_per_device=permutes,
        permute_minimum_per_device=minimum,
        permute_ratio=permutes / minimum,
    )
