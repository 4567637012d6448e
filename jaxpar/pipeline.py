"""Pipeline parallelism over the `pipeline` axis: stages, micro-batches, schedules.

The layer stack [layers, ...] is cut into p * v contiguous chunks (v = virtual stages),
balanced by cost with the embedding counted on the first chunk and the head on the
last; chunk c lives on device c % p. Each leaf is stored as [p, v * slots, ...]
(logical names `stage`, `layers`), padding short chunks with skipped slots.

Schedules, run inside the step's shard_map (manual over `data` and `pipeline`):
- gpipe / interleaved: a forward loop of v*m + p - 1 ticks in which every device runs
  one chunk on one micro-batch and hands the result to the next device (ppermute);
  autodiff runs the same loop backwards. Micro-batch i meets chunk k*p + s at device s
  on tick s + (i // p)*v*p + k*p + i % p, so every hand-over is consumed on the very
  next tick. All m micro-batches' activations are alive at the turn.
- 1f1b: a table of ticks, simulated on the host, in which each device runs one forward
  or one backward of a micro-batch (PipeDream-flush order: p - s - 1 warm-up forwards,
  then one forward and one backward in turn). A backward recomputes its chunk from the
  stage input kept since its forward, so at most about p inputs are alive, not m.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import collectives
from jaxpar.config import ConfigError
from jaxpar.problem import Problem
from jaxpar.sharding import LAYERS, STAGE, LeafSpecs

PIPE = "pipeline"


@dataclass(frozen=True)
class Layout:
    stages: int  # p: devices along `pipeline`
    virtual: int  # v: chunks per device
    chunks: tuple[tuple[int, ...], ...]  # layers of chunk c (pipeline order), c = k*p + s
    slots: int  # layer slots per chunk (the longest chunk)

    @property
    def slot_layer(self) -> np.ndarray:
        """[p, v*slots]: which layer each device's slot holds (-1 = padding)."""
        table = -np.ones((self.stages, self.virtual * self.slots), dtype=np.int64)
        for c, layers in enumerate(self.chunks):
            s, k = c % self.stages, c // self.stages
            table[s, k * self.slots : k * self.slots + len(layers)] = layers
        return table

    def device_layers(self) -> list[list[int]]:
        """The layers each device holds, in order."""
        return [[int(x) for x in row if x >= 0] for row in self.slot_layer]


def assign(layers: int, stages: int, virtual: int, costs: tuple[float, float, float]) -> Layout:
    """Contiguous chunks minimising the largest chunk cost (pre on the first, post on the
    last chunk). Raises ConfigError when there are more chunks than layers."""
    n = stages * virtual
    if n > layers:
        raise ConfigError(
            f"parallel.pipeline={stages} * parallel.virtual_stages={virtual} = {n} chunks but "
            f"the model has {layers} layers; use at most {layers} chunks, or more layers"
        )
    pre, layer, post = costs

    def cost(c: int, a: int, b: int) -> float:
        return (b - a) * layer + (pre if c == 0 else 0) + (post if c == n - 1 else 0)

    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(n + 1)]
    cut = [[0] * (layers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for c in range(1, n + 1):
        for b in range(c, layers - (n - c) + 1):
            for a in range(c - 1, b):
                value = max(best[c - 1][a], cost(c - 1, a, b))
                if value < best[c][b] - 1e-9:
                    best[c][b], cut[c][b] = value, a
    bounds, b = [], layers
    for c in range(n, 0, -1):
        bounds.append((cut[c][b], b))
        b = cut[c][b]
    chunks = tuple(tuple(range(a, b)) for a, b in reversed(bounds))
    return Layout(stages, virtual, chunks, max(len(c) for c in chunks))


def to_stages(layout: Layout, x: jax.Array) -> jax.Array:
    """A stacked leaf [layers, ...] -> [p, v*slots, ...] (padding slots hold zeros)."""
    idx = layout.slot_layer
    mask = (idx >= 0).reshape(idx.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, x[np.maximum(idx, 0)], 0).astype(x.dtype)


def from_stages(layout: Layout, y: jax.Array) -> jax.Array:
    """Inverse of to_stages."""
    flat = y.reshape((-1,) + y.shape[2:])
    where = {int(layer): i for i, layer in enumerate(layout.slot_layer.reshape(-1)) if layer >= 0}
    return flat[np.array([where[layer] for layer in sorted(where)])]


def staged(problem: Problem, layout: Layout) -> Problem:
    """The problem with its layer stack in pipeline layout."""
    keys = set(problem.parts.stack_keys)
    rows = (layout.stages, layout.virtual * layout.slots)

    def init(key):
        params = problem.init(key)
        return {k: to_stages(layout, v) if k in keys else v for k, v in params.items()}

    shapes = {
        k: jax.ShapeDtypeStruct(rows + s.shape[1:], s.dtype) if k in keys else s
        for k, s in problem.shapes.items()
    }
    names = {k: (STAGE, *n) if k in keys else n for k, n in problem.names.items()}
    for k in keys:
        if problem.names[k][0] != LAYERS:
            raise ConfigError(f"{k}: a stacked parameter's first logical name must be {LAYERS}")
    return replace(problem, init=init, shapes=shapes, names=names)


def unstaged(problem: Problem, layout: Layout, params: dict) -> dict:
    keys = set(problem.parts.stack_keys)
    return {k: from_stages(layout, v) if k in keys else v for k, v in params.items()}


# --- schedules ---------------------------------------------------------------------

IDLE, FWD, BWD = 0, 1, 2


def one_f_one_b(p: int, m: int) -> tuple[np.ndarray, int]:
    """([ticks, p, 2] of (action, micro-batch), slots): PipeDream-flush 1F1B, each op
    run on the first tick its inputs are there (a hand-over arrives one tick later)."""
    order = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [(FWD, i) for i in range(warm)]
        for i in range(m - warm):
            ops += [(FWD, warm + i), (BWD, i)]
        ops += [(BWD, i) for i in range(m - warm, m)]
        order.append(ops)
    done = {}  # (kind, stage, i) -> tick
    ptr, rows, t = [0] * p, [], 0
    while any(ptr[s] < 2 * m for s in range(p)):
        row = [(IDLE, 0)] * p
        for s in range(p):
            if ptr[s] == 2 * m:
                continue
            kind, i = order[s][ptr[s]]
            if kind == FWD:
                ready = s == 0 or done.get((FWD, s - 1, i), t) < t
            else:
                ready = done.get((FWD, s, i), t) < t and (
                    s == p - 1 or done.get((BWD, s + 1, i), t) < t
                )
            if ready:
                row[s] = (kind, i)
        for s, (kind, i) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, i)] = t
                ptr[s] += 1
        rows.append(row)
        t += 1

    # A stage input lives from its arrival (made there, on stage 0) to its backward.
    def arrival(s: int, i: int) -> int:
        return done[(FWD, 0, i)] if s == 0 else done[(FWD, s - 1, i)] + 1

    live = max(
        sum(arrival(s, i) <= t0 <= done[(BWD, s, i)] for i in range(m))
        for s in range(p)
        for t0 in range(len(rows))
    )
    return np.array(rows, dtype=np.int32), live


def bubble_formula(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def ticks(schedule: str, p: int, m: int, v: int) -> int:
    """Ticks of the schedule's loop (forward loop for gpipe/interleaved; the whole
    step for 1f1b, where a tick holds a forward or a backward)."""
    if schedule == "1f1b":
        return len(one_f_one_b(p, m)[0])
    return v * m + p - 1


def handover_share(schedule: str, p: int, m: int) -> float:
    """Share of the tick loop's hand-overs that really happen: 1f1b skips the ticks on
    which no stage sends that way (the ledger, reading the HLO, counts every tick)."""
    if schedule != "1f1b":
        return 1.0
    table, _ = one_f_one_b(p, m)
    fired = (table[:, :-1, 0] == FWD).any(axis=1).sum() + (table[:, 1:, 0] == BWD).any(axis=1).sum()
    return float(fired) / (2 * len(table))


def bubble(schedule: str, p: int, m: int, v: int, loop_ticks: int) -> float:
    """Idle share of a device's ticks, given the loop's trip count."""
    busy = 2 * m if schedule == "1f1b" else v * m
    return 1 - busy / loop_ticks


# --- executors (inside the step's shard_map, manual over data and pipeline) ---------


@dataclass(frozen=True)
class Pipe:
    """Everything an executor needs for one (problem, layout, schedule)."""

    problem: Problem
    layout: Layout
    schedule: str
    microbatches: int
    specs: Any  # params dict of LeafSpecs (pipeline layout)

    @property
    def stack_keys(self) -> tuple[str, ...]:
        return self.problem.parts.stack_keys


def _chunk_specs(specs: dict, keys) -> dict:
    """LeafSpecs of [slots, ...] chunk slices (the `stage` dim removed)."""
    drop = lambda spec: jax.sharding.PartitionSpec(*spec[1:])  # noqa: E731
    return {k: LeafSpecs(*(drop(x) for x in specs[k])) for k in keys}


def _split(params: dict, keys) -> tuple[dict, dict]:
    return {k: v for k, v in params.items() if k in keys}, {
        k: v for k, v in params.items() if k not in keys
    }


def _micro(batch, m: int):
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)


def _take(tree, i):
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _chunk_of(stack: dict, k, slots: int) -> dict:
    return {key: jax.lax.dynamic_slice_in_dim(x[0], k * slots, slots) for key, x in stack.items()}


def circular_loss(pipe: Pipe, params: dict, batch, count: int):
    """gpipe / interleaved: the summed loss of this device's last-chunk micro-batches
    (zero elsewhere); differentiate it for the backward pass."""
    layout, parts, m = pipe.layout, pipe.problem.parts, pipe.microbatches
    p, v, slots = layout.stages, layout.virtual, layout.slots
    stage = jax.lax.axis_index(PIPE)
    stack, _ = _split(params, pipe.stack_keys)
    chunk_specs = _chunk_specs(pipe.specs, pipe.stack_keys)
    active_all = jnp.asarray(layout.slot_layer >= 0)[stage]
    mbs = _micro(batch, m)
    h_shape = jax.eval_shape(lambda: parts.pre(params, _take(mbs, 0), pipe.specs))

    def tick(carry, t):
        recv, loss = carry
        n = t - stage
        valid = (n >= 0) & (n < v * m)
        n = jnp.clip(n, 0, v * m - 1)
        group, rest = n // (v * p), n % (v * p)
        k, i = rest // p, group * p + rest % p
        c = k * p + stage
        mb = _take(mbs, i)
        x = jax.lax.cond(c == 0, lambda: parts.pre(params, mb, pipe.specs), lambda: recv)
        active = jax.lax.dynamic_slice_in_dim(active_all, k * slots, slots) & valid
        y = parts.chunk(_chunk_of(stack, k, slots), x, active, chunk_specs)
        last = valid & (c == p * v - 1)
        loss = loss + jax.lax.cond(
            last,
            lambda: jnp.sum(parts.post(params, y, mb, pipe.specs).astype(jnp.float32)),
            lambda: jnp.zeros((), jnp.float32),
        )
        # Round the ring only when chunks wrap round it (interleaved).
        send = jax.lax.ppermute(y, PIPE, [(s, (s + 1) % p) for s in range(p - (v == 1))])
        return (send, loss), None

    init = (jnp.zeros(h_shape.shape, h_shape.dtype), jnp.zeros((), jnp.float32))
    with jax.named_scope("pipeline_ticks"):
        (_, loss), _ = jax.lax.scan(tick, init, jnp.arange(v * m + p - 1))
    return loss / count


def one_f_one_b_grads(pipe: Pipe, params: dict, batch, count: int, prepare_rest, cast):
    """1f1b: (this device's summed loss / count, gradients of all local parameters)."""
    layout, parts, m = pipe.layout, pipe.problem.parts, pipe.microbatches
    p = layout.stages
    table, slots_n = one_f_one_b(p, m)
    table_j = jnp.asarray(table)
    sends_f = jnp.asarray((table[:, :-1, 0] == FWD).any(axis=1))
    sends_b = jnp.asarray((table[:, 1:, 0] == BWD).any(axis=1))
    stage = jax.lax.axis_index(PIPE)
    stack, rest_storage = _split(params, pipe.stack_keys)
    rest, rest_vjp = jax.vjp(prepare_rest, rest_storage)
    chunk_specs = _chunk_specs(pipe.specs, pipe.stack_keys)
    active = jnp.asarray(layout.slot_layer >= 0)[stage]
    mbs = _micro(batch, m)
    whole = lambda r: {**stack, **r}  # noqa: E731  (pre/post read only `rest`)
    h_shape = jax.eval_shape(lambda: parts.pre(whole(rest), _take(mbs, 0), pipe.specs))
    zeros_h = jnp.zeros(h_shape.shape, h_shape.dtype)

    def run_chunk(local_stack, x):
        chunk = {key: cast(val[0]) for key, val in local_stack.items()}
        return parts.chunk(chunk, x, active, chunk_specs)

    def post_loss(r, y, mb):
        return jnp.sum(parts.post(whole(r), y, mb, pipe.specs).astype(jnp.float32)) / count

    def forward(state, i):
        acts, gins, g_stack, g_rest, loss = state
        mb, slot = _take(mbs, i), i % slots_n
        x = jax.lax.cond(
            stage == 0,
            lambda: parts.pre(whole(rest), mb, pipe.specs),
            lambda: acts[slot],
        )
        acts = acts.at[slot].set(x)
        y = run_chunk(stack, x)

        def last(args):
            gins, g_rest, loss = args
            value, vjp = jax.vjp(post_loss, rest, y, mb)
            d_rest, d_y, _ = vjp(jnp.ones((), jnp.float32))
            g_rest = jax.tree.map(jnp.add, g_rest, d_rest)
            return gins.at[slot].set(d_y.astype(gins.dtype)), g_rest, loss + value

        gins, g_rest, loss = jax.lax.cond(
            stage == p - 1, last, lambda args: args, (gins, g_rest, loss)
        )
        return (acts, gins, g_stack, g_rest, loss), y, zeros_h

    def backward(state, i):
        acts, gins, g_stack, g_rest, loss = state
        mb, slot = _take(mbs, i), i % slots_n
        _, vjp = jax.vjp(run_chunk, stack, acts[slot])
        d_stack, d_x = vjp(gins[slot])
        g_stack = jax.tree.map(jnp.add, g_stack, d_stack)

        def first(g_rest):
            _, vjp_pre = jax.vjp(lambda r: parts.pre(whole(r), mb, pipe.specs), rest)
            return jax.tree.map(jnp.add, g_rest, vjp_pre(d_x)[0])

        g_rest = jax.lax.cond(stage == 0, first, lambda g: g, g_rest)
        return (acts, gins, g_stack, g_rest, loss), zeros_h, d_x

    def idle(state, i):
        return state, zeros_h, zeros_h

    def tick(state, t):
        kind, i = table_j[t, stage, 0], table_j[t, stage, 1]
        state, send_f, send_b = jax.lax.switch(kind, [idle, forward, backward], state, i)
        # Hand over only on ticks where some stage has something to hand over (the
        # condition is the same on every device, so the collective stays matched).
        got_f = jax.lax.cond(
            sends_f[t],
            lambda: jax.lax.ppermute(send_f, PIPE, [(s, s + 1) for s in range(p - 1)]),
            lambda: zeros_h,
        )
        got_b = jax.lax.cond(
            sends_b[t],
            lambda: jax.lax.ppermute(send_b, PIPE, [(s + 1, s) for s in range(p - 1)]),
            lambda: zeros_h,
        )
        acts, gins, g_stack, g_rest, loss = state
        # File what the neighbours handed over, by the table's record of what they ran.
        prev_kind, prev_i = table_j[t, stage - 1, 0], table_j[t, stage - 1, 1]
        slot = prev_i % slots_n
        acts = acts.at[slot].set(jnp.where((stage > 0) & (prev_kind == FWD), got_f, acts[slot]))
        nxt = jnp.minimum(stage + 1, p - 1)
        next_kind, next_i = table_j[t, nxt, 0], table_j[t, nxt, 1]
        slot = next_i % slots_n
        gins = gins.at[slot].set(jnp.where((stage < p - 1) & (next_kind == BWD), got_b, gins[slot]))
        return (acts, gins, g_stack, g_rest, loss), None

    buffers = jnp.zeros((slots_n, *h_shape.shape), h_shape.dtype)
    state = (
        buffers,
        buffers,
        jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), stack),
        jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rest),
        jnp.zeros((), jnp.float32),
    )
    with jax.named_scope("pipeline_ticks"):
        state, _ = jax.lax.scan(tick, state, jnp.arange(len(table)))
    _, _, g_stack, g_rest, loss = state
    (g_rest_storage,) = rest_vjp(jax.tree.map(lambda g, r: g.astype(r.dtype), g_rest, rest))
    return loss, {**g_stack, **g_rest_storage}


def reduce_shared(pipe: Pipe, grads: dict, specs: dict) -> dict:
    """Leaves every stage holds (embedding, head, ...) got gradient on one stage only:
    sum them over `pipeline`."""
    return {
        k: g if k in pipe.stack_keys else collectives.reduce(g, specs[k].compute, axis=PIPE)
        for k, g in grads.items()
    }
