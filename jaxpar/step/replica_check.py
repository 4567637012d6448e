"""The replica consistency check (train.check_replicas_every): every parameter leaf that
devices hold as copies (over `replica` and `data`, and over `pipeline` or `tensor`
where the leaf is not split there) must be bit-identical on all of them.

Each device hashes its copy of each leaf: a position-weighted sum of its words in
wrapping 32-bit integer arithmetic, with odd weights, so any one changed word changes
the hash. The copies' hashes are compared by one all-reduce (max of the hashes and of
their complements) per set of axes the leaves are copied over, and one of a flag per
leaf: a few bytes per leaf, never the parameters. Only when copies differ are they
read, from this process's devices, to name the devices and the largest difference.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxpar.cost import ledger
from jaxpar.parallel.sharding import axes_of, leaf_key

_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash constant


@dataclass(frozen=True)
class Check:
    """The compiled check for one engine's stored parameters."""

    fn: Any  # jitted: params -> bool[leaves], True where a leaf's copies differ
    keys: list[str]  # the leaves' names, in that order
    copied_over: list[tuple[str, ...]]  # per leaf: the axes its copies span
    wire_bytes: float  # per device, per check (the ledger's ring model)
    collectives: int

    def __call__(self, state) -> str | None:
        """None if every copy agrees, else one line naming each differing leaf, the
        devices that hold an odd copy and the largest difference."""
        held = checked(state)
        flags = np.asarray(jax.device_get(self.fn(held)))
        if not flags.any():
            return None
        leaves = jax.tree.leaves(held)
        return "; ".join(
            _describe(self.keys[i], leaves[i], self.copied_over[i]) for i in np.flatnonzero(flags)
        )


def checked(state) -> dict:
    """What is checked of a TrainState: the stored parameters, and the compute copy
    that offload keeps on the device (what the model computes with)."""
    held = {"params": state.params}
    if state.compute is not None:
        held["compute"] = state.compute
    return held


def build(mesh: Mesh, shardings) -> Check:
    """The check for leaves stored as `shardings` (a tree of NamedShardings)."""
    paths = jax.tree_util.tree_leaves_with_path(shardings)
    keys = [leaf_key(p) for p, _ in paths]
    specs = [sh.spec for _, sh in paths]
    sizes = dict(mesh.shape)
    copied_over = [
        tuple(a for a in mesh.axis_names if sizes[a] > 1 and a not in axes_of(s)) for s in specs
    ]
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, axes in enumerate(copied_over):
        if axes:
            groups[axes].append(i)
    on_host = [sh.memory_kind == "pinned_host" for _, sh in paths]

    def local(leaves):
        hashes = [_hash(x) for x in leaves]
        differ = jnp.zeros(len(leaves), jnp.int32)
        for axes, members in groups.items():
            h = jnp.stack([hashes[i] for i in members])
            both = jax.lax.pmax(jnp.concatenate([h, ~h]), axes)
            high, low = both[: len(members)], ~both[len(members) :]
            differ = differ.at[jnp.array(members)].set((high != low).astype(jnp.int32))
        return jax.lax.pmax(differ, tuple(mesh.axis_names)) > 0

    def check(params):
        leaves = [
            jax.device_put(x, jax.memory.Space.Device) if host else x
            for x, host in zip(jax.tree.leaves(params), on_host, strict=True)
        ]
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs,),
            out_specs=PartitionSpec(),
            check_vma=False,
        )(leaves)

    return Check(jax.jit(check), keys, copied_over, 0.0, 0)


def compiled(mesh: Mesh, state_shapes) -> Check:
    """`build`, compiled for a TrainState of ShapeDtypeStructs with their shardings, with
    its own cost read from its HLO."""
    shapes = checked(state_shapes)
    check = build(mesh, jax.tree.map(lambda x: x.sharding, shapes))
    executable = check.fn.trace(shapes).lower().compile()
    led = ledger.read(executable.as_text(), dict(mesh.shape))
    groups = round(sum(c.executions for c in led.collectives if c.group > 1))
    return Check(executable, check.keys, check.copied_over, led.wire_bytes(), groups)


def _hash(x) -> jax.Array:
    """A position-weighted wrapping sum of x's 32-bit words (odd weights)."""
    words = _words(x).reshape(-1)
    weights = jnp.arange(words.size, dtype=jnp.uint32) * _GOLDEN * np.uint32(2) + np.uint32(1)
    return jnp.sum(words * weights, dtype=jnp.uint32)


def _words(x) -> jax.Array:
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size < 4:
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing dim of 2 words


def _describe(key: str, x: jax.Array, axes: tuple[str, ...]) -> str:
    """Which of this process's devices hold a copy of `key` unlike the most common one,
    and by how much at most."""
    copies = defaultdict(list)  # the block (its index) -> [(device id, values)]
    for shard in x.addressable_shards:
        index = tuple((s.start, s.stop) for s in shard.index)
        copies[index].append((shard.device.id, np.asarray(shard.data)))
    odd, most = [], 0.0
    for held in copies.values():
        common, _ = Counter(v.tobytes() for _, v in held).most_common(1)[0]
        usual = next(v for _, v in held if v.tobytes() == common)
        for device, v in held:
            if v.tobytes() != common:
                odd.append(device)
                diff = np.abs(v.astype(np.float64) - usual.astype(np.float64))
                most = max(most, float(np.nanmax(diff)) if diff.size else 0.0)
    where = (
        f"device{'s' if len(odd) > 1 else ''} {', '.join(map(str, sorted(odd)))} "
        f"differ{'' if len(odd) > 1 else 's'}"
        if odd
        else "the copies differ on another process's devices"
    )
    return (
        f"{key} ({where} from the other copies over {' x '.join(axes)}; max difference {most:.3g})"
    )
