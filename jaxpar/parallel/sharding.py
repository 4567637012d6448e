"""Logical names, the rules table, and the four shardings of every parameter leaf.

Models name their dims with the constants of jaxpar.names; RULES maps them to mesh axes;
`leaf_specs` is the ONE function that turns (names, shape, rules, ZeRO stage, mesh)
into a leaf's storage / compute / gradient / optimizer-state PartitionSpecs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.names import (
    BALANCE,
    BATCH,
    EMBED,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LABELS,
    LATENT,
    LAYERS,
    LORA_RANK,
    MLP,
    POSITION,
    QKV,
    ROUTES,
    SCALE_ONE,
    SEQ,
    SEQ_RESIDUAL,
    STAGE,
    VOCAB,
)
from jaxpar.parallel.axes import DATA, EXPERT, PIPE, TENSOR

# Ordered: logical name -> mesh axis (None = never split). The only place where
# model dims meet mesh axes. An axis is used at most once per leaf (first dim wins).
# (The sequence is split over `context` by the step itself, which is manual over it:
# jaxpar.parallel.context.)
RULES: tuple[tuple[str, str | None], ...] = (
    (BATCH, DATA),
    (VOCAB, TENSOR),
    (HEADS, TENSOR),
    (KV_HEADS, TENSOR),
    (MLP, TENSOR),
    (EMBED, None),
    (SEQ, None),
    (SEQ_RESIDUAL, None),
    (POSITION, None),
    (HEAD_DIM, None),
    (QKV, None),
    (EXPERTS, EXPERT),
    (ROUTES, None),
    (BALANCE, None),
    (LATENT, None),
    (LAYERS, None),
    (LORA_RANK, None),
    (SCALE_ONE, None),
    (LABELS, None),
    (STAGE, PIPE),
)
ZERO_AXES = (DATA, EXPERT)  # what ZeRO splits a leaf over, outermost first (zero_axes)
# Names whose rule applies only where the axis divides the dim; elsewhere the dim stays
# whole on every device of the axis, by design (`optional_unsplit` says where): GQA's
# few key/value heads are computed on every tensor device rather than refused.
WHERE_DIVISIBLE = (KV_HEADS,)
# Dims ZeRO never splits: a layer stack is sliced per layer, so its per-layer
# shard must not depend on the stack.
NOT_ZERO = (LAYERS, STAGE)


def rules_for(sequence_parallel: bool):
    """RULES, with the residual stream's sequence dim split over `tensor` under Megatron
    sequence parallelism."""
    if not sequence_parallel:
        return RULES
    return tuple((name, TENSOR if name == SEQ_RESIDUAL else axis) for name, axis in RULES)


def over_tensor(names: tuple, shape: tuple, t: int) -> tuple[bool, bool]:
    """(split, whole): whether RULES split some dim of a leaf (or a part of one) over
    `tensor` at degree t; whether a dim they would split stays whole because t does not
    divide it (WHERE_DIVISIBLE: what every tensor device then computes all of)."""
    table = dict(RULES)
    wanted = [(n, s) for n, s in zip(names, shape, strict=True) if table.get(n) == TENSOR]
    split = any(s % t == 0 or n not in WHERE_DIVISIBLE for n, s in wanted)
    return split, any(s % t for n, s in wanted if n in WHERE_DIVISIBLE)


def tensor_dims(names_tree, shapes_tree) -> dict[str, int]:
    """The sizes of the parameters' dims that RULES splits over `tensor` without exception
    (not WHERE_DIVISIBLE), by logical name, in RULES' order: what a tensor degree must
    divide."""
    split = [n for n, axis in RULES if axis == TENSOR and n not in WHERE_DIVISIBLE]
    sizes = {}
    for names, x in zip(
        jax.tree.leaves(names_tree, is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.leaves(shapes_tree),
        strict=True,
    ):
        for name, size in zip(names, x.shape, strict=True):
            if name in split:
                sizes.setdefault(name, size)
    return {n: sizes[n] for n in split if n in sizes}


def check_tensor_split(dims: dict[str, int], tensor: int) -> None:
    """`dims` (tensor_dims) against the tensor degree, before any leaf is placed: a
    registered model sizes each by its key of the same name (model.heads, model.mlp,
    model.vocab), which ConfigError names with the fix."""
    for name, size in dims.items():
        if size % tensor:
            raise ConfigError(
                f"model.{name}={size} is not divisible by parallel.tensor={tensor}; Megatron "
                f"splits it over tensor: choose a tensor degree dividing {size}, or change "
                f"model.{name}"
            )


class LeafSpecs(NamedTuple):
    """Where one parameter leaf lives at each point of the step."""

    storage: PartitionSpec  # between steps (ZeRO-3: split over its ZeRO axes)
    compute: PartitionSpec  # in forward/backward
    grad: PartitionSpec  # the gradient accumulation buffer (ZeRO>=2: split)
    opt: PartitionSpec  # optimizer state and the update (ZeRO>=1: split)
    dim: int | None  # the dim ZeRO splits (None: not split)
    over: tuple[str, ...] = ()  # the axes it splits `dim` over, outermost first


SPEC_FIELDS = ("storage", "compute", "grad", "opt")


def compute_spec(
    names: tuple[str, ...],
    shape: tuple[int, ...],
    rules,
    mesh_shape: dict,
    path: str = "",
    skip_axes: tuple[str, ...] = (),
) -> PartitionSpec:
    """Rules applied to a leaf's (or an activation's) logical names."""
    table = dict(rules)
    if len(names) != len(shape):
        raise ConfigError(
            f"{path}: {len(names)} logical names {names} for a leaf of shape "
            f"{shape}; give one name per dim"
        )
    used: set[str] = set()
    spec = []
    for dim, (name, size) in enumerate(zip(names, shape, strict=True)):
        if name not in table:
            raise ConfigError(
                f"{path}: logical name {name!r} (dim {dim}) is not in the rules; "
                f"use one of {sorted(table)}"
            )
        axis = table[name]
        if axis is None or axis in used or axis in skip_axes or mesh_shape.get(axis, 1) == 1:
            spec.append(None)
            continue
        if size % mesh_shape[axis] and name in WHERE_DIVISIBLE:
            spec.append(None)
            continue
        if size % mesh_shape[axis]:
            raise ConfigError(
                f"{path}: shape {shape} dim {dim} ({name}={size}) is not divisible by "
                f"{axis}={mesh_shape[axis]} (rule {name} -> {axis}); the leaf would stay "
                f"replicated. Choose parallel.{axis} dividing {size}, or change {name}"
            )
        used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def zero_axes(compute: PartitionSpec, mesh_shape: dict) -> tuple[str, ...]:
    """The axes ZeRO splits a leaf over, outermost first: `data`, and `expert` but for
    the experts' own weights, which are split over it already (everywhere else `expert`
    is a data axis, jaxpar.parallel.axes); axes of degree 1 left out."""
    used = set(axes_of(compute))
    return tuple(a for a in ZERO_AXES if mesh_shape.get(a, 1) > 1 and a not in used)


def zero_degree(compute: PartitionSpec, mesh_shape: dict) -> int:
    """How many ways ZeRO splits a leaf of that compute spec (the ZeRO paper's N)."""
    return math.prod(mesh_shape[a] for a in zero_axes(compute, mesh_shape))


def _zero_dim(names, shape, spec: PartitionSpec, n: int) -> int | None:
    """The dim ZeRO splits n ways: the largest free dim that n divides."""
    free = [
        d
        for d in range(len(shape))
        if spec[d] is None and names[d] not in NOT_ZERO and shape[d] % n == 0
    ]
    return max(free, key=lambda d: (shape[d], -d)) if free else None


def leaf_specs(
    names: tuple[str, ...],
    shape: tuple[int, ...],
    *,
    rules,
    zero: int,
    mesh_shape: dict,
    path: str = "",
) -> LeafSpecs:
    """THE placement function: the four specs of one parameter leaf."""
    compute = compute_spec(names, shape, rules, mesh_shape, path)
    over = zero_axes(compute, mesh_shape) if zero else ()
    dim = _zero_dim(names, shape, compute, zero_degree(compute, mesh_shape)) if over else None
    if dim is None:
        over = ()
    entry = over[0] if len(over) == 1 else over
    split = PartitionSpec(*(entry if d == dim else a for d, a in enumerate(compute)))
    return LeafSpecs(
        storage=split if zero >= 3 else compute,
        compute=compute,
        grad=split if zero >= 2 else compute,
        opt=split if zero >= 1 else compute,
        dim=dim,
        over=over,
    )


def plan(names_tree, shapes_tree, *, rules=RULES, zero: int, mesh_shape: dict):
    """LeafSpecs for every leaf.

    ZeRO leaves unsplit a leaf with no free dim that its ZeRO degree divides (a bias
    already split over `tensor`, say). If such leaves hold more than ZERO_UNSPLIT_LIMIT of all
    parameters, that is an error listing the largest; below it they are reported by
    `unsplit_leaves`.
    """

    def one(path, names, shape):
        return leaf_specs(
            tuple(names),
            tuple(shape),
            rules=rules,
            zero=zero,
            mesh_shape=mesh_shape,
            path=leaf_key(path),
        )

    specs = jax.tree_util.tree_map_with_path(one, names_tree, shapes_tree, is_leaf=_is_names)
    unsplit = unsplit_leaves(specs, shapes_tree, mesh_shape) if zero else []
    total = sum(math.prod(s) for s in jax.tree.leaves(shapes_tree, is_leaf=_is_shape))
    left = sum(size for _, _, size, _ in unsplit)
    if left > ZERO_UNSPLIT_LIMIT * total:
        worst = "; ".join(f"{p} {list(shape)}: {why}" for p, shape, _, why in unsplit[:3])
        raise ConfigError(
            f"parallel.zero={zero}: {len(unsplit)} parameter leaves ({left} of {total} "
            f"parameters, over {ZERO_UNSPLIT_LIMIT:.0%}) have no dim free for ZeRO to split "
            f"and would stay replicated on every device (largest: {worst}). "
            f"Choose parallel.data (and parallel.expert) dividing their free dims, or "
            f"parallel.zero=0"
        )
    return specs


ZERO_UNSPLIT_LIMIT = 0.01  # share of parameters ZeRO may leave replicated (MaxText allows ~2%)


def leaf_key(path) -> str:
    """A parameter leaf's name: its pytree path joined by '/' (from_nnx's dict keys)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def optional_unsplit(names_tree, shapes_tree, rules, mesh_shape: dict) -> list[str]:
    """Why leaves whose WHERE_DIVISIBLE dims stay whole do so, one line per name."""
    table, notes = dict(rules), {}
    for names, shape in zip(
        jax.tree.leaves(names_tree, is_leaf=_is_names),
        jax.tree.leaves(shapes_tree, is_leaf=_is_shape),
        strict=True,
    ):
        for name, size in zip(names, shape, strict=True):
            axis = table.get(name)
            if name in WHERE_DIVISIBLE and axis and size % mesh_shape.get(axis, 1):
                notes[name] = (
                    f"{name} ({size}) replicated over {axis}={mesh_shape[axis]}: it does not "
                    f"divide; every {axis} device computes all {size}"
                )
    return sorted(notes.values())


def unsplit_leaves(specs, shapes_tree, mesh_shape: dict) -> list[tuple[str, tuple, int, str]]:
    """(path, shape, size, why) of leaves ZeRO could not split, largest first."""
    rows = []

    def visit(path, s: LeafSpecs, shape):
        over = zero_axes(s.compute, mesh_shape)
        if s.dim is None and over and math.prod(shape) > 1:
            why = _why(s, shape, over, mesh_shape)
            rows.append((leaf_key(path), tuple(shape), math.prod(shape), why))

    jax.tree_util.tree_map_with_path(
        visit, specs, shapes_tree, is_leaf=lambda x: isinstance(x, LeafSpecs)
    )
    return sorted(rows, key=lambda r: -r[2])


def _why(s: LeafSpecs, shape, over: tuple[str, ...], mesh_shape: dict) -> str:
    """Why no dim of a leaf is free for ZeRO: each dim's reason."""
    n = math.prod(mesh_shape[a] for a in over)
    ways = " x ".join(f"{a}={mesh_shape[a]}" for a in over)
    reasons = []
    for dim, size in enumerate(shape):
        if s.compute[dim] is not None:
            reasons.append(f"dim {dim} is split by {s.compute[dim]}")
        elif size % n:
            reasons.append(f"dim {dim} ({size}) is not divisible by {ways}")
        else:
            reasons.append(f"dim {dim} is the layer stack, sliced per layer")
    return "; ".join(reasons)


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) for n in x)


def named(mesh, spec_tree):
    """PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def pick(spec_tree, field: str):
    """One of the four specs for every leaf of a plan."""
    return jax.tree.map(
        lambda s: getattr(s, field), spec_tree, is_leaf=lambda x: isinstance(x, LeafSpecs)
    )


def only_axes(spec: PartitionSpec, axes) -> PartitionSpec:
    """The spec with every other axis replaced by None (a dim split over several axes
    keeps those of `axes`)."""

    def keep(entry):
        kept = tuple(a for a in _entry_axes(entry) if a in axes)
        return kept[0] if len(kept) == 1 else kept or None

    return PartitionSpec(*(keep(e) for e in spec))


def _entry_axes(entry) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,) if entry else ()


@functools.lru_cache(maxsize=4096)
def axes_of(spec: PartitionSpec) -> tuple[str, ...]:
    """Every mesh axis a spec splits a dim over (remembered: the planner asks millions of
    times about a few hundred specs)."""
    return tuple(a for entry in spec for a in _entry_axes(entry))
