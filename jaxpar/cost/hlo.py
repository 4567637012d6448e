"""Reads compiled (optimized) HLO text: each collective's kind, the mesh axes its device
groups span, its buffer bytes and how often it runs per step (loop trip counts
multiplied through the call graph); and the trip counts of named loops.

Replica groups come in four forms: explicit `{{0,1},{2,3}}`, iota `[4,2]<=[8]`,
transposed iota `[2,4]<=[4,2]T(1,0)`, and `mesh[...] device_ids=(...) {axes}`;
permutes list `source_target_pairs`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

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
    executions: float  # times per step (loop trip counts multiplied; scopes' rates too)
    senders: float = 1.0  # collective-permute: share of devices that send
    groups: list = field(default_factory=list)  # device groups (permutes: (source, target))
    sizes: tuple[int, ...] = ()  # the degree of each of `axes`

    def share(self, axis: str) -> float:
        """The part of this collective's wire bytes that crosses `axis`. A group spanning
        several whole axes counts as the same collective run over each in turn,
        outermost first, on what the ones before left: (n-1)/n of the buffer on the
        first, (m-1)/m of its 1/n on the next, ... (together the group's (N-1)/N). Any
        other group counts whole on every axis it touches."""
        if axis not in self.axes:
            return 0.0
        whole = len(self.axes) == 1 or self.kind == "collective-permute"
        if whole or math.prod(self.sizes) != self.group:
            return 1.0
        i = self.axes.index(axis)
        before, n = math.prod(self.sizes[:i]), self.sizes[i]
        return (n - 1) / n / before / ((self.group - 1) / self.group)


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
    """Trip counts of the while loops that jax.named_scope(scope) opens itself: the loop
    whose op name ends in the scope (inside jvp(...) or transpose(...)) and `/while`,
    not the loops XLA makes of ops inside its body (a scatter the CPU backend expands)."""
    opens = re.compile(rf'op_name="[^"]*{re.escape(scope)}\)*/while"')
    return [
        int(trip.group(1))
        for line in hlo_text.splitlines()
        if " while(" in line and opens.search(line) and (trip := _TRIP.search(line))
    ]


def collectives(
    hlo_text: str, mesh_shape: dict[str, int], rates: dict[str, float] | None = None
) -> tuple[list[Collective], int]:
    """(every collective of the module, per device; loops whose trip count is unknown and
    whose collectives were therefore counted once). `rates`: named scopes whose
    collectives run only on some steps (a conditional), and the share of steps they run
    on (parameter averaging's every sync_every-th)."""
    lines = hlo_text.splitlines()
    mult, owner, unknown = _multipliers(lines)
    found = []
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
        axes = _axes(groups, mesh_shape)
        found.append(
            Collective(
                kind=kind,
                axes=axes,
                group=size,
                buffer_bytes=buffer,
                executions=mult.get(owner.get(i), 0) * _rate(line, rates or {}),
                senders=len(groups) / math.prod(mesh_shape.values())
                if kind == "collective-permute" and groups
                else 1.0,
                groups=groups or [],
                sizes=tuple(mesh_shape[a] for a in axes),
            )
        )
    return found, unknown


def _rate(line: str, rates: dict[str, float]) -> float:
    name = re.search(r'op_name="([^"]*)"', line)
    scopes = name.group(1).split("/") if name else []
    return next((rate for scope, rate in rates.items() if scope in scopes), 1.0)


# The source-location tables of an HLO module's text: they name whatever Python the
# process traced, so the same program prints longer after another model was traced.
SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program_lines(hlo_text: str) -> int:
    """Lines of the module's program: its text without the source-location tables."""
    blocks = hlo_text.split("\n\n")
    return sum(b.count("\n") + 1 for b in blocks if b.split("\n", 1)[0] not in SOURCE_TABLES)
