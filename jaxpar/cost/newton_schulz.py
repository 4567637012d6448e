"""What Muon's Newton-Schulz costs a step, per device: its FLOPs and its temporaries, on
the path the step takes (jaxpar.step.muon.owners).

Each iteration on a matrix of m x n (m the smaller side, where the Gram products are):
X X' (2 m^2 n), its square (2 m^3) and that times X (2 m^2 n), and their sums. On the
owners' path a device orthogonalizes whole matrices, its share of the stacked ones (a tensor split
stays: its Gram products contract the device's columns, and each of the m^3 squares is
repeated on every tensor device). On the shards' path every device runs every matrix
of the leaf on its slice, and every m^3 square whole. The temporaries are fp32: the
normalized momentum and the next iterate (the device's elements, twice) and the two
m x m products of each matrix it runs.

Its textbook bytes per device (the chosen path's own minimum): on the owners' path its
two all-to-alls over the ZeRO axes (w ways), 2 (w-1)/w of the device's slice of the
momentum; where a split falls on a matrix's Gram side (a non-square one cut on its
smaller side), one all-gather of that side, (G-1) times the device's elements of it;
then, on either path, each iteration's all-reduce of the Gram products of the matrices
the device runs over the T devices that split their contracted side (ZeRO's shards,
tensor's split), 2 (T-1)/T of m^2 a matrix, and the Frobenius norms' once. A square
matrix takes its Gram products on the side that leaves the splits contracted
(jaxpar.parallel.matrices.gram_side)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax

from jaxpar.parallel.matrices import Matrix, gram_side, is_spec, matrices, owner_dims


@dataclass(frozen=True)
class NewtonSchulz:
    flops: float  # per device per step
    temp_bytes: float  # per device, the largest leaf's (leaves run one after another)
    wire_bytes: float = 0.0  # least bytes per device per step


def cost(leaves, names, steps: int) -> NewtonSchulz:
    """Newton-Schulz's cost for the Muon leaves among `leaves` (leaf_layout.Leaf, a tree
    like `names`), at `steps` iterations a step."""
    flops, temp, wire = 0.0, 0.0, 0.0
    specs = matrices(names)
    for leaf, spec in zip(
        jax.tree.leaves(leaves, is_leaf=lambda x: hasattr(x, "opt")),
        jax.tree.leaves(specs, is_leaf=is_spec),
        strict=True,
    ):
        if spec is None:
            continue
        f, t, w = _leaf(leaf, spec, steps)
        flops, temp = flops + f, max(temp, t)
        wire += w
    return NewtonSchulz(flops, temp, wire)


def _leaf(leaf, spec: Matrix, steps: int) -> tuple[float, float, float]:
    shape = leaf.shape
    sides = [math.prod(shape[i] for i in dims) for dims in spec]
    m, n = min(sides), max(sides)
    size = math.prod(shape)
    stack = size // (m * n)
    ways = round(leaf.compute / leaf.opt) if leaf.opt else 1  # ZeRO's split of the state
    owned = bool(owner_dims(shape, spec, ways, lambda i: leaf.ways[i] == 1))  # as muon.owners
    split = dict(enumerate(leaf.ways))  # where Newton-Schulz runs: tensor's, ZeRO's shards
    if not owned and ways > 1:
        split[leaf.dim] = split.get(leaf.dim, 1) * ways
    gram = gram_side(shape, spec, tuple(d for d, w in split.items() if w > 1))
    gathered = math.prod(split.get(d, 1) for d in gram)  # its Gram side made whole first
    if owned:  # whole matrices (but for tensor's split), stack / ways of them
        runs, local = stack / ways, m * n * leaf.compute / size * gathered
    else:  # every matrix, on this device's slice of it
        runs, local = stack, leaf.opt / stack * gathered
    # X X' and its product with X (2 m local each), the square (2 m^3), b A + c A^2 (3 m^2)
    # and a X + that X's (2 local); the normalization once (3 local: square, sum, divide)
    per_run = steps * (4 * m * local + 2 * m**3 + 3 * m * m + 2 * local) + 3 * local
    flops = runs * per_run
    temp = 4 * (2 * leaf.opt * gathered + 2 * runs * m * m)
    return flops, temp, _wire(leaf, spec, steps, split, gram, runs, ways if owned else 1)


def _wire(leaf, spec: Matrix, steps: int, split: dict, gram, runs: float, owners: int) -> float:
    """The leaf's Newton-Schulz bytes per device (the module's docstring): `split` the
    ways each dim is split where it runs, `gram` its Gram side, `runs` the matrices it
    orthogonalizes, `owners` the ZeRO split the owners' all-to-alls undo (1: none)."""
    moved = 2 * (owners - 1) / owners * 4 * leaf.opt
    dims = spec.inputs + spec.outputs
    here = runs / math.prod(w for d, w in split.items() if d not in dims)
    gathered = math.prod(split.get(d, 1) for d in gram)
    elements = here * math.prod(leaf.shape[d] / split.get(d, 1) for d in dims)
    t = math.prod(split.get(d, 1) for d in dims if d not in gram)
    side = math.prod(leaf.shape[i] for i in gram)
    grams = 2 * (t - 1) / t * 4 * here * (steps * side**2 + 1)
    return moved + (gathered - 1) * 4 * elements + grams
