"""What a model calls to be parallel without naming a mesh axis.

- `param(rngs, init, shape, names)`: a parameter with one logical name per dim.
- `constrain(x, names)`: pin an activation's dims to the rules (no-op outside a step).
- `dense(spec, x, w, names)`: einsum(spec, x, w) with a weight whose dims carry logical
  names; under sequence parallelism, the gather of x's sequence over `tensor` before a
  column-split product and the reduce-scatter after a row-split one, placed by hand.
- `batch_sum(x)`: x summed over the devices that share this step's batch (a statistic of
  the whole batch, e.g. the load of a mixture's experts); x itself outside a step.
- `stack(make_layer, n, rngs)`: n layers stacked on a leading `layers` dim.
- `scan_layers(stack, carry, fn)`: run a stacked NNX module layer by layer. Inside a
  jaxpar step it makes each layer's parameters ready just before use (the ZeRO-3
  gather, the offload fetch; again in the backward pass instead of keeping them), and
  applies `parallel.remat`: `full` keeps each layer's input and recomputes the rest;
  `offload` keeps that input in host memory; and runs `train.unroll` layers per loop
  iteration.

`constrain`, `batch_sum`, `dense` and `scan_layers` read the running step's
`jaxpar.nn.scope.Context`, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxpar.names import LAYERS
from jaxpar.nn import logits, scope
from jaxpar.nn.scope import HOST, KEY, LAYER_INPUT
from jaxpar.parallel.axes import MANUAL_AXES, TENSOR
from jaxpar.parallel.sharding import compute_spec
from jaxpar.parallel.zero import Keep


class Assembled:
    """A weight that a layer computes from several stored leaves (a low-rank adapted or
    quantized weight: jaxpar.adapters), a pytree of them. scan_layers slices each of
    its leaves to the layer and asks `ready(fetch)` for the weight, where fetch(key,
    leaf) makes one stored leaf ready (the ZeRO-3 gather, the offload fetch)."""

    def ready(self, fetch: Callable[[str, jax.Array], jax.Array]) -> jax.Array:
        raise NotImplementedError


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """An fp32 parameter with one logical name per dim; jaxpar decides where it lives."""
    return nnx.Param(
        init(rngs.params(), shape, jnp.float32), out_sharding=tuple(names), eager_sharding=False
    )


def stack(make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """n layers, each make_layer(rngs) with its own random draws, stacked on a leading dim
    named `layers` (what scan_layers and the pipeline stages slice)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(rngs):
        return make_layer(rngs)

    return build(rngs)


def constrain(x: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Constrain an activation to the rules for its logical dim names."""
    ctx = scope.current()
    if ctx is None:
        return x
    # the manual axes: each device already holds its own rows, stage and tokens
    spec = compute_spec(names, x.shape, ctx.rules, ctx.mesh_shape, skip_axes=MANUAL_AXES)
    return jax.lax.with_sharding_constraint(x, spec)


def batch_sum(x: jax.Array) -> jax.Array:
    """x summed over every device holding a part of this step's batch (its rows over
    replica and data, its tokens over context): a statistic of the whole batch."""
    ctx = scope.current()
    if ctx is None or not ctx.batch_axes:
        return x
    return jax.lax.psum(x, ctx.batch_axes)


def dense(spec: str, x: jax.Array, w: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """einsum(spec, x, w), x an activation [batch, seq, ...] and w a weight with logical
    `names`. Under Megatron sequence parallelism (the residual stream split by sequence
    over `tensor`), a product with w column-split over `tensor` first all-gathers x's
    sequence over it, and one contracting w's split dim (row-split) reduce-scatters its
    partial sums over the sequence: Megatron's g and g-bar, in a shard_map manual over
    `tensor` (the compiler's own placement of the same rules all-reduces and slices on
    XLA:CPU, half as many bytes again). Otherwise a plain einsum the rules place."""
    ctx = scope.current()
    if ctx is None or not ctx.sequence_parallel:
        return jnp.einsum(spec, x, w)
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    w_spec = compute_spec(names, w.shape, ctx.rules, ctx.mesh_shape, skip_axes=MANUAL_AXES)
    split = next(w_dims[d] for d, axis in enumerate(w_spec) if axis == TENSOR)
    on = lambda dims, letter: PartitionSpec(*(TENSOR if d == letter else None for d in dims))  # noqa: E731
    seq = PartitionSpec(None, TENSOR)
    if split in out:  # column-split: each device computes its part for every token

        def column(x, w):
            return jnp.einsum(spec, jax.lax.all_gather(x, TENSOR, axis=1, tiled=True), w)

        specs = (seq, on(w_dims, split)), on(out, split)
        return jax.shard_map(column, in_specs=specs[0], out_specs=specs[1], axis_names={TENSOR})(
            x, w
        )

    def row(x, w):
        return jax.lax.psum_scatter(jnp.einsum(spec, x, w), TENSOR, scatter_dimension=1, tiled=True)

    return jax.shard_map(
        row, in_specs=(on(x_dims, split), on(w_dims, split)), out_specs=seq, axis_names={TENSOR}
    )(x, w)


def _checkpointed(body, keep: Keep):
    if keep is Keep.INPUT:
        return jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    if keep is Keep.INPUT_ON_HOST:
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device",
            offload_dst=HOST,
        )
        return jax.checkpoint(body, policy=policy)
    if keep is Keep.MATMULS:
        # Keep the big matmul outputs, recompute the rest: above all the ZeRO-3 gathered
        # weights, gathered again for the backward pass instead of being stored whole. (A
        # policy refusing to save only the all-gathers still left the whole gathered
        # weights stored for backward: no all-gather in the backward loop of the HLO.)
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return jax.checkpoint(body, policy=policy)
    return body


def _ready(ctx):
    """One layer's Variable -> ready to use (the step's per-layer gather, ctx.layer)."""

    def ready(var: nnx.Variable) -> nnx.Variable:
        key, value = var.get_metadata().get(KEY), var.get_value()
        if isinstance(value, Assembled):
            return var.replace(value.ready(ctx.layer if ctx else lambda _, x: x))
        return var if ctx is None or key is None else var.replace(ctx.layer(key, value))

    return ready


def apply_layer(layer: nnx.Module, carry, fn: Callable):
    """fn(layer, carry) for a stack module that holds one layer's slice of each leaf (no
    `layers` dim), each leaf made ready as scan_layers makes it: a layer at a time, for
    an executor that differentiates each layer on its own (the zero-bubble schedules)."""
    graphdef, state = nnx.split(layer)
    ready = _ready(scope.current())
    state = jax.tree.map(ready, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return fn(nnx.merge(graphdef, state), carry)


def scan_layers(stack: nnx.Module, carry, fn: Callable, active: jax.Array | None = None):
    """carry = fn(layer, carry) for each layer of `stack` (an nnx.vmap-stacked module,
    e.g. from jaxpar.stack).

    Every parameter of `stack` must have `layers` as its first logical name. `active`
    ([layers] bool) skips the layers it marks False (a pipeline stage's padding); a
    NumPy one that marks none is no branch at all (XLA would make a branch a layer a
    select that keeps both sides' buffers). Where
    the step watches attention's largest logits (jaxpar.nn.logits), each layer's come
    out of the scan stacked and are handed on.
    """
    graphdef, state = nnx.split(stack)
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding") or ()
        if not names or names[0] != LAYERS:
            raise ValueError(
                f"scan_layers: {'/'.join(map(str, path))} has logical names "
                f"{names}; a stacked layer's first name must be {LAYERS!r}"
            )
    ctx = scope.current()
    ready = _ready(ctx)

    watched = logits.wanted()
    seen_in_layer: list = []  # what one layer's trace handed on (the same for each)

    def body(carry, layer_state):
        if ctx and ctx.keep is Keep.INPUT_ON_HOST:
            # the only value kept for the backward pass, sent to host memory there
            carry = checkpoint_name(carry, LAYER_INPUT)
        layer_state = jax.tree.map(
            ready, layer_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        if not watched:
            return fn(nnx.merge(graphdef, layer_state), carry), ()
        with logits.watching() as seen:
            carry = fn(nnx.merge(graphdef, layer_state), carry)
        seen_in_layer[:] = seen
        return carry, [s.max_H for s in seen]

    unroll = 1
    if ctx:
        body, unroll = _checkpointed(body, ctx.keep), ctx.unroll
    if active is None or (isinstance(active, np.ndarray) and active.all()):
        carry, maxima = jax.lax.scan(body, carry, state, unroll=unroll)
        if watched:
            logits.stacked(seen_in_layer, maxima)
        return carry
    none = ()  # a skipped layer's maxima: -inf, under any logit
    if watched:
        first = jax.tree.map(lambda x: x[0], state)
        shapes = jax.eval_shape(body, carry, first)[1]
        none = [jnp.full(x.shape, -jnp.inf, x.dtype) for x in shapes]
    skip = lambda c, s: (c, none)  # noqa: E731
    carry, maxima = jax.lax.scan(
        lambda c, xs: jax.lax.cond(xs[0], body, skip, c, xs[1]),
        carry,
        (active, state),
        unroll=unroll,
    )
    if watched:
        logits.stacked(seen_in_layer, maxima)
    return carry


def unrolled(stack: nnx.Module, carry, caches: list, fn: Callable):
    """(carry, caches) from carry, caches[i] = fn(layer i, carry, caches[i]) for each layer
    of `stack` in turn: decoding, outside a training step. The loop is unrolled, so that
    each layer reads its slice of a stacked weight by a static index (a slice XLA drops
    where the stack was built from per-layer arrays, as jaxpar.generation.decoding passes
    them), and writes its own cache (`caches`: one per layer) in place, not a stacked
    copy."""
    graphdef, state = nnx.split(stack)
    caches = list(caches)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    for i in range(len(caches)):
        take = lambda v, i=i: v.replace(v.get_value()[i])  # noqa: E731
        layer = nnx.merge(graphdef, jax.tree.map(take, state, is_leaf=is_var))
        carry, caches[i] = fn(layer, carry, caches[i])
    return carry, caches
