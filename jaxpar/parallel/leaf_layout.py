"""Each parameter leaf as a layout places it, counted once: the numbers jaxpar.cost reads.

`leaf_layout` turns a placement plan (jaxpar.parallel.sharding's LeafSpecs, one per leaf)
into one `Leaf` per leaf: its elements per device under each of the four specs, the axes
its gradient is summed over, the axes ZeRO splits it over, and how often ZeRO-3 gathers
it. The cost formulas, the report of a compiled step and the planner take these as data:
none of them reads a PartitionSpec.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.moved import REMOVED_IN
from jaxpar.parallel.matrices import matrix
from jaxpar.parallel.sharding import LeafSpecs, axes_of, zero_axes
from jaxpar.parallel.zero import stack_dims


@dataclass(frozen=True)
class Leaf:
    """One parameter leaf in a layout, per device."""

    shape: tuple[int, ...]
    dtype: np.dtype  # as stored
    storage: float  # elements between steps (ZeRO-3: its slice)
    compute: float  # elements in forward and backward
    grad: float  # elements of its gradient buffer (ZeRO>=2: its slice)
    opt: float  # elements of its optimizer state and update (ZeRO>=1: its slice)
    layer: float  # of `compute`, one layer's (a layer stack's leaf; else 0)
    synced: tuple[str, ...]  # the data-parallel axes its gradient is summed over
    over: tuple[str, ...]  # the axes ZeRO splits it over, outermost first (none: whole)
    gathers: int  # ZeRO-3's gathers of it per micro-batch: a scanned stack's twice, else once
    matrix: bool = False  # one or more hidden matrices (jaxpar.parallel.matrices: Muon's)
    dim: int | None = None  # the dim ZeRO splits (LeafSpecs.dim; None: not split)
    ways: tuple[int, ...] = ()  # per dim, how many ways the compute layout splits it

    @property
    def floating(self) -> bool:
        return bool(jnp.issubdtype(self.dtype, jnp.floating))

    def degree(self, mesh_shape: dict) -> int:
        """How many ways ZeRO splits it (the ZeRO paper's N)."""
        return math.prod(mesh_shape[a] for a in self.synced)


def leaf_layout(specs, shapes, names, mesh_shape: dict, scans_layers: bool = True):
    """A tree like `specs` of Leaf: `shapes` (ShapeDtypeStructs) placed by `specs` on a mesh
    of `mesh_shape`; `names` their logical names (what marks a layer stack's leaves)."""

    def one(s: LeafSpecs, x, n) -> Leaf:
        shape, layers = tuple(x.shape), stack_dims(tuple(n))
        return Leaf(
            shape=shape,
            dtype=np.dtype(x.dtype),
            storage=local_elems(shape, s.storage, mesh_shape),
            compute=local_elems(shape, s.compute, mesh_shape),
            grad=local_elems(shape, s.grad, mesh_shape),
            opt=local_elems(shape, s.opt, mesh_shape),
            layer=local_elems(shape[layers:], s.compute[layers:], mesh_shape) if layers else 0.0,
            synced=zero_axes(s.compute, mesh_shape),
            over=s.over,
            gathers=2 if scans_layers and layers else 1,
            matrix=matrix(tuple(n)) is not None,
            dim=s.dim,
            ways=tuple(dim_ways(s.compute, i, mesh_shape) for i in range(len(shape))),
        )

    return jax.tree.map(one, specs, shapes, names, is_leaf=_is_specs)


def leaves(layout) -> list[Leaf]:
    """The Leaf records of a layout tree (or of any part of it)."""
    return jax.tree.leaves(layout)


def dim_ways(spec, i: int, mesh_shape: dict) -> int:
    """How many ways `spec` splits dim `i`."""
    entry = spec[i] if i < len(spec) else None
    axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    return math.prod(mesh_shape[a] for a in axes)


def local_elems(shape, spec, mesh_shape: dict) -> float:
    """Elements per device of a leaf of `shape` that `spec` splits."""
    return math.prod(shape) / math.prod(mesh_shape[a] for a in axes_of(spec))


# The last release's jaxpar.cost helpers, for its scripts until REMOVED_IN: the formulas
# read a Leaf's counts instead.
def leaf_pairs(specs, shapes) -> list[tuple[LeafSpecs, tuple[int, ...]]]:
    """(specs, shape) of each leaf."""
    _old("leaf_pairs")
    pairs = jax.tree.map(lambda s, x: (s, tuple(x.shape)), specs, shapes, is_leaf=_is_specs)
    return jax.tree.leaves(pairs, is_leaf=lambda x: isinstance(x, tuple) and _is_specs(x[0]))


def gathers(names, scans_layers: bool = True):
    """Per leaf, how often ZeRO-3 gathers it per micro-batch (Leaf.gathers)."""
    _old("gathers")
    stacked = lambda n: 2 if scans_layers and stack_dims(n) else 1  # noqa: E731
    return jax.tree.map(stacked, names, is_leaf=lambda x: isinstance(x, tuple))


def _is_specs(x) -> bool:
    return isinstance(x, LeafSpecs)


def _old(name: str) -> None:
    warnings.warn(
        f"jaxpar.cost.{name} goes in jaxpar {REMOVED_IN}: read "
        "jaxpar.parallel.leaf_layout's Leaf records",
        DeprecationWarning,
        stacklevel=3,
    )
