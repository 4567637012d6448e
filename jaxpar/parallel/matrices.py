"""What a model means by a matrix, read from a leaf's logical names, never from its
rank: the layers, pipeline stages, experts and the parts of a fused product (`qkv`:
q/k/v, gate/up) are stacked dims, each of their matrices apart; embeddings and the output
head (a `vocab` or `position` dim), norms, biases and a router's balancing biases are
not hidden matrices. What Muon orthogonalizes (jaxpar.step.muon) and what the cost model
counts its one momentum for."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax

from jaxpar.names import EMBED, EXPERTS, LATENT, LAYERS, LORA_RANK, POSITION, QKV, STAGE, VOCAB

STACKED = (LAYERS, STAGE, EXPERTS, QKV)  # dims that hold matrices side by side
# a matrix's model side, the first of these it has: the inputs are the dims before it
# (or it alone, if first), the outputs the rest (jaxpar's weights are (inputs, outputs))
SIDES = (LORA_RANK, EMBED, LATENT)
TABLES = (VOCAB, POSITION)  # embeddings and the output head: AdamW's


class Matrix(NamedTuple):
    """Which dims of a leaf are one matrix's inputs and outputs (optax's
    MuonDimensionNumbers' reduction and output axes); the others are stacked."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def matrix(names: tuple[str, ...]) -> Matrix | None:
    """How the leaf named `names` is matrices, or None for an AdamW leaf."""
    own = [i for i, n in enumerate(names) if n not in STACKED]
    if len(own) < 2 or any(names[i] in TABLES for i in own):
        return None
    side = next((i for s in SIDES for i in own if names[i] == s), own[0])
    split = max(own.index(side), 1)
    return Matrix(tuple(own[:split]), tuple(own[split:]))


def matrices(names):
    """`matrix` of each leaf of a names tree (None: AdamW)."""
    return jax.tree.map(matrix, names, is_leaf=lambda n: isinstance(n, tuple))


def is_spec(x) -> bool:
    return x is None or isinstance(x, Matrix)


def groups(names) -> dict[str, list[str]]:
    """{'muon': [leaf paths], 'adamw': [...]}: what the start-up summary shows."""
    out = {"muon": [], "adamw": []}
    flat = jax.tree_util.tree_flatten_with_path(matrices(names), is_leaf=is_spec)[0]
    for path, spec in flat:
        out["adamw" if spec is None else "muon"].append(
            jax.tree_util.keystr(path, simple=True, separator="/")
        )
    return out


def gram_side(shape, spec: Matrix, splits: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The dims of the side Newton-Schulz's Gram products are on: the smaller; of a
    square matrix, the side without `splits` (the dims its momentum is split on where
    Newton-Schulz runs: ZeRO's, tensor's), so that the products contract the shards and
    one all-reduce of the Gram sums them."""
    inputs, outputs = (math.prod(shape[i] for i in dims) for dims in spec)
    if inputs == outputs:
        split_in, split_out = (any(d in dims for d in splits) for dims in spec)
        return spec.outputs if split_in and not split_out else spec.inputs
    return spec.outputs if inputs > outputs else spec.inputs


def owner_dims(shape, spec: Matrix, ways: int, whole) -> list[int]:
    """The stacked dims (not the matrix's own) that could hand whole matrices to `ways`
    owners (Muon's owners' path): dims the compute layout leaves whole (`whole(i)`) and
    `ways` divides; none where ZeRO does not split the leaf (`ways` 1)."""
    if ways == 1:
        return []
    stacked = [i for i in range(len(shape)) if i not in spec.inputs + spec.outputs]
    return [i for i in stacked if whole(i) and shape[i] % ways == 0]
