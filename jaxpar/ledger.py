"""Reads a compiled step: its collectives (kind, mesh axes, bytes, executions per step)
and its per-device memory by category, and sets them against the textbook minimum.

Wire bytes per device use the ring factors: all-reduce 2(n-1)/n of the buffer,
all-gather and all-to-all (n-1)/n of the gathered buffer, reduce-scatter (n-1)/n of
the input, collective-permute 1x for each device that sends (averaged over the
devices). Collectives inside loops count once per iteration (XLA's known_trip_count).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxpar.sharding import LeafSpecs, zero_dim

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLS = re.compile(
    r"\b(body|condition|to_apply|calls|true_computation|false_computation)="
    r"%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass
class Collective:
    kind: str
    axes: tuple[str, ...]  # mesh axes the groups span
    group: int  # devices per group
    buffer_bytes: int  # result bytes (reduce-scatter: its input)
    executions: int  # times per step (loop trip counts multiplied)
    senders: float = 1.0  # collective-permute: share of devices that send
    groups: list = field(default_factory=list)  # device groups (permutes: (source, target))

    @property
    def wire_bytes(self) -> float:
        n = self.group
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": self.senders}.get(
            self.kind, (n - 1) / n
        )
        return factor * self.buffer_bytes * self.executions


@dataclass
class Ledger:
    collectives: list[Collective] = field(default_factory=list)
    unknown_trip_counts: int = 0  # loops whose collectives were counted once

    def by_kind(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for c in self.collectives:
            row = out.setdefault(c.kind, {"count": 0, "bytes": 0, "wire_bytes": 0.0, "axes": {}})
            row["count"] += c.executions
            row["bytes"] += c.buffer_bytes * c.executions
            row["wire_bytes"] += c.wire_bytes
            key = "+".join(c.axes) or "none"
            row["axes"][key] = row["axes"].get(key, 0) + c.executions
        return out

    def wire_bytes(self, axes: set[str] | None = None, kinds: set[str] | None = None) -> float:
        return sum(
            c.wire_bytes
            for c in self.collectives
            if (axes is None or set(c.axes) & axes) and (kinds is None or c.kind in kinds)
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
                sent = c.wire_bytes  # per member; it receives as much
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


def _top_level(type_str: str) -> list[str]:
    """Top-level elements of an HLO result type (a tuple or a single array)."""
    s = type_str.strip()
    if not s.startswith("("):
        return [s]
    parts, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _bytes(type_str: str) -> int:
    return sum(
        _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in _ARRAY.findall(type_str)
    )


def _result_bytes(kind: str, type_str: str, is_async: bool) -> int:
    parts = _top_level(type_str)
    if is_async and kind in ("all-gather", "collective-permute"):
        # (operands..., results..., [context]) -> the results
        arrays = [p for p in parts if _ARRAY.search(p) and not p.strip().startswith("u32[]")]
        parts = arrays[len(arrays) // 2 :]
    return sum(_bytes(p) for p in parts)


def _iota(spec: str) -> np.ndarray:
    """'[4,2]<=[8]', '[2,4]<=[4,2]T(1,0)' or '[4,2]T(1,0)' -> the device id array."""
    m = re.match(r"(?:\[([\d,]+)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape([int(x) for x in m.group(1).split(",")] if m.group(1) else -1)


def _groups(line: str) -> list[list[int]] | None:
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [
            [int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\{([\d, ]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        return _iota(m.group(1)).tolist()
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))?\s*\{([^}]*)\}",
        line,
    )
    if m:
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        shape = [int(n) for _, n in names]
        ids = (_iota(m.group(2)) if m.group(2) else np.arange(math.prod(shape))).reshape(shape)
        grouped = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(3)]
        rest = [i for i in range(len(shape)) if i not in grouped]
        ids = ids.transpose(rest + grouped)
        return ids.reshape(-1, math.prod(shape[i] for i in grouped) if grouped else 1).tolist()
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


def _axes(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    if not groups:
        return ()
    names, shape = list(mesh_shape), list(mesh_shape.values())
    coords = np.array([np.unravel_index(i, shape) for i in groups[0]])
    return tuple(n for d, n in enumerate(names) if len(set(coords[:, d])) > 1)


def _multipliers(lines: list[str]) -> tuple[dict[str, int], dict[int, str], int]:
    """Executions per step of each computation, and which computation each line is in."""
    owner: dict[int, str] = {}
    edges: dict[str, list[tuple[str, int | None]]] = defaultdict(list)
    entry, current = None, None
    for i, line in enumerate(lines):
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            if m.group(1):
                entry = current
            continue
        owner[i] = current
        trip = _TRIP.search(line)
        for role, callee in _CALLS.findall(line):
            edges[current].append(
                (callee, (int(trip.group(1)) if trip else None) if role == "body" else 1)
            )
        for branches in _BRANCHES.findall(line):
            for callee in re.findall(r"%?([\w.\-]+)", branches):
                edges[current].append((callee, 1))
    mult: dict[str, int] = defaultdict(int)
    unknown = 0

    def visit(comp: str, times: int) -> None:
        nonlocal unknown
        mult[comp] += times
        for callee, k in edges.get(comp, ()):
            if k is None:
                unknown += 1
                k = 1
            visit(callee, times * k)

    visit(entry, 1)
    return mult, owner, unknown


def loop_trip_counts(hlo_text: str, scope: str) -> list[int]:
    """Trip counts of the while loops traced under jax.named_scope(scope)."""
    return [
        int(trip.group(1))
        for line in hlo_text.splitlines()
        if " while(" in line and scope in line and (trip := _TRIP.search(line))
    ]


def read(hlo_text: str, mesh_shape: dict[str, int]) -> Ledger:
    """The collectives of an optimized HLO module, per device, per step."""
    lines = hlo_text.splitlines()
    mult, owner, unknown = _multipliers(lines)
    ledger = Ledger(unknown_trip_counts=unknown)
    for i, line in enumerate(lines):
        m = _OP.match(line)
        if not m:
            continue
        type_str, kind, is_async = m.group(1), m.group(2), bool(m.group(3))
        groups = _groups(line)
        size = len(groups[0]) if groups and kind != "collective-permute" else 2
        buffer = _result_bytes(kind, type_str, is_async)
        if kind == "reduce-scatter":
            buffer *= size
        ledger.collectives.append(
            Collective(
                kind=kind,
                axes=_axes(groups, mesh_shape),
                group=size,
                buffer_bytes=buffer,
                executions=mult.get(owner.get(i), 0),
                senders=len(groups) / math.prod(mesh_shape.values())
                if kind == "collective-permute" and groups
                else 1.0,
                groups=groups or [],
            )
        )
    return ledger


def _local_elems(shape, spec, mesh_shape) -> float:
    split = math.prod(mesh_shape[a] for a in spec if a is not None)
    return math.prod(shape) / split


def minimum_bytes(
    specs,
    shapes,
    *,
    zero: int,
    mesh_shape: dict,
    compute_bytes: int,
    accum: int,
    tensor_elements: int | None,
) -> dict[str, float | None]:
    """Textbook wire bytes per device per step, by axis.

    data: ZeRO-0 ring all-reduce 2(N-1)/N of the fp32 gradient; ZeRO-1/2 reduce-scatter
    of the gradient (ZeRO-2: every micro-batch) + all-gather of the updated fp32
    parameters, (N-1)/N each; ZeRO-3 per micro-batch: gather for forward, again for
    backward, reduce-scatter of the gradient, (N-1)/N each in the compute dtype.
    Leaves ZeRO cannot split pay the all-reduce. tensor: Megatron's all-reduces of
    activations, 2(T-1)/T of `tensor_elements` (per micro-batch) each.
    """
    n, t = mesh_shape.get("data", 1), mesh_shape.get("tensor", 1)
    ring, share = 2 * (n - 1) / n, (n - 1) / n
    data = 0.0
    for s, shape in _pairs(specs, shapes):
        local = _local_elems(shape, s.compute, mesh_shape)
        if zero == 0 or zero_dim(s) is None:
            data += ring * 4 * local
        elif zero in (1, 2):
            data += share * 4 * local * ((accum if zero == 2 else 1) + 1)
        else:
            data += share * compute_bytes * local * 3 * accum
    tensor = (
        None
        if tensor_elements is None
        else 2 * (t - 1) / t * tensor_elements * compute_bytes * accum
    )
    return {"data": data, "tensor": tensor}


def _pairs(specs, shapes) -> list[tuple[LeafSpecs, tuple[int, ...]]]:
    out = []
    jax.tree.map(
        lambda s, x: out.append((s, tuple(x.shape))),
        specs,
        shapes,
        is_leaf=lambda x: isinstance(x, LeafSpecs),
    )
    return out


def params_per_device(specs, shapes, mesh_shape: dict) -> float:
    """Parameters one device computes with (split by the rules, not by ZeRO): ZeRO's Psi."""
    return sum(_local_elems(shape, s.compute, mesh_shape) for s, shape in _pairs(specs, shapes))


def grad_bytes(specs, shapes, mesh_shape: dict) -> int:
    """Per-device bytes of the fp32 gradient accumulator, as its gradient spec splits it."""
    return int(
        sum(4 * _local_elems(shape, s.grad, mesh_shape) for s, shape in _pairs(specs, shapes))
    )


def state_formula(zero: int, params_per_device: float, n: int, offload: bool = False) -> float:
    """ZeRO paper's model-state bytes per device for fp32 AdamW (K=8: m and v; 4 for the
    fp32 parameters): stage 0 (4+8)Psi, 1 and 2 4Psi + 8Psi/N, 3 12Psi/N. Offloaded, the
    fp32 master parameters are split like the optimizer state: 12Psi/N from stage 1."""
    psi = params_per_device
    if offload and zero:
        return 12 * psi / n
    return {0: 12 * psi, 1: 4 * psi + 8 * psi / n, 2: 4 * psi + 8 * psi / n}.get(zero, 12 * psi / n)


def memory(compiled, state_shapes) -> dict[str, int]:
    """Per-device bytes of the compiled step's state by memory kind (from its input
    shardings: host arrays are the ones XLA lays out in memory space S(5)) and of its
    temporaries (memory_analysis)."""
    state_sh = compiled.input_shardings[0][0]

    def total(part: str, host: bool) -> int:
        if part not in state_shapes:
            return 0
        pairs = zip(
            jax.tree.leaves(state_shapes[part]), jax.tree.leaves(state_sh[part]), strict=True
        )
        return int(
            sum(
                math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
                for x, sh in pairs
                if (sh.memory_kind == "pinned_host") == host
            )
        )

    stats = compiled.memory_analysis()
    return {
        # on the device: the parameters it computes with (a compute copy when offloaded)
        "params": total("params", False) + total("compute", False),
        "opt_state": total("opt", False),
        "host_params": total("params", True) + total("compute", True),
        "host_opt_state": total("opt", True),
        # the model state of the ZeRO formula: master parameters and optimizer state
        "state": sum(total(part, host) for part in ("params", "opt") for host in (False, True)),
        "temp": int(stats.temp_size_in_bytes),
        "host_temp": int(stats.host_temp_size_in_bytes),
        "arguments": int(stats.argument_size_in_bytes),
    }


def report(
    compiled,
    led: Ledger,
    *,
    specs,
    shapes,
    state_shapes,
    host_activations: int,
    mesh_shape: dict,
    zero: int,
    compute_bytes: int,
    accum: int,
    tensor_elements: int | None,
) -> dict:
    """The summary.json sections that describe the compiled step (`led`: its ledger)."""
    mem = memory(compiled, state_shapes)
    psi = params_per_device(specs, shapes, mesh_shape)
    minimum = minimum_bytes(
        specs,
        shapes,
        zero=zero,
        mesh_shape=mesh_shape,
        compute_bytes=compute_bytes,
        accum=accum,
        tensor_elements=tensor_elements,
    )
    wire = {"data": led.wire_bytes({"data"}), "tensor": led.wire_bytes({"tensor"})}
    known = [a for a in wire if minimum[a] is not None]
    total_min = sum(minimum[a] for a in known)
    total_wire = sum(wire[a] for a in known)
    formula = state_formula(zero, psi, mesh_shape.get("data", 1), offload="compute" in state_shapes)
    return {
        "memory_per_device": {
            "params": mem["params"],
            "grads": grad_bytes(specs, shapes, mesh_shape),
            "opt_state": mem["opt_state"],
            "temp": mem["temp"],
        },
        "host_memory_per_device": {  # pinned_host
            "params": mem["host_params"],
            "opt_state": mem["host_opt_state"],
            # layer inputs the program sends to the host for the backward pass
            # (parallel.remat=offload), counted in the traced step ...
            "activations": host_activations,
            # ... and the host temporaries of the compiled step, where the compiler
            # placed them (XLA:CPU drops in-step placement: 0 there)
            "temp": mem["host_temp"],
        },
        "state_bytes": {
            "actual": mem["state"],
            "formula": formula,
            "ratio": mem["state"] / formula,
            "arguments": mem["arguments"],
        },
        "collectives": led.by_kind(),
        "collective_counts": led.counts(),
        "comm": {
            "wire_bytes_per_device": led.wire_bytes(),
            "minimum_bytes_per_device": total_min,
            "ratio": total_wire / total_min if total_min else None,
            "by_axis": {a: {"wire": wire[a], "minimum": minimum[a]} for a in wire},
            "ratio_axes": known,
            "busiest_device_bytes": led.busiest_device_bytes(),
            "unknown_trip_counts": led.unknown_trip_counts,
        },
    }
