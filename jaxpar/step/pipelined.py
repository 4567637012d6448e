"""A Problem through pipeline stages: the executors of the schedules' tick tables
(jaxpar.parallel.schedules), inside the step's shard_map (manual over `data`, `pipeline`
and `context`). `value_and_grad` is the one entry for all of them:
- gpipe / interleaved: a forward loop of v*m + p - 1 ticks in which every device runs
  one chunk on one micro-batch and hands the result to the next device (ppermute);
  autodiff runs the same loop backwards.
- 1f1b: each tick a device runs one forward or one backward of a micro-batch; a backward
  recomputes its chunk from the stage input kept since its forward.
- zb-h1: as 1f1b, with B and W ticks for each backward's two halves
  (jaxpar.step.zero_bubble).
- zbv: zb-h1's ticks on two chunks a device in a V, each op naming its chunk; the
  hand-overs go both ways, and the V turns on the last device with none. Its
  evaluation runs its forward ticks alone (the circular loop assumes round-robin chunks).
- dualpipev: zbv's ticks, and pairs: a forward of one chunk, then the other chunk's R, B
  and W, on one tick; both hand-overs go the same way, the gradient in one of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.sections import Schedule
from jaxpar.nn import scope, sequence
from jaxpar.nn.problem import Problem
from jaxpar.parallel import collectives
from jaxpar.parallel.axes import PIPE
from jaxpar.parallel.pipeline import Layout
from jaxpar.parallel.schedules import (
    BWD,
    FWD,
    IDLE,
    INPUT,
    PAIR,
    RECOMPUTE,
    TICKED,
    TICKS_SCOPE,
    V_SHAPED,
    WEIGHT,
    chunk_of,
    forward_table,
    has_pairs,
    pair_sends,
    sends,
    tick_table,
    ticked_table,
)
from jaxpar.step import qk_clip, zero_bubble


@dataclass(frozen=True)
class Pipe:
    """Everything an executor needs for one (problem, layout, schedule)."""

    problem: Problem  # in pipeline layout
    layout: Layout
    schedule: Schedule
    microbatches: int

    @property
    def stack_keys(self) -> tuple[str, ...]:
        return self.problem.parts.stack_keys

    @property
    def table(self) -> np.ndarray:
        return tick_table(self.schedule, self.layout.stages, self.microbatches, self.layout.virtual)


def value_and_grad(pipe: Pipe, prepare, clip_rules: list | None = None):
    """(stored params, micro-batch, count) -> ((this device's summed loss / count, what
    the model reported (jaxpar.report), its mean over the micro-batches, on every stage),
    local gradients) for any schedule; `prepare` maps stored parameters (any sub-dict) to
    what the forward pass reads (jaxpar.parallel.zero.ZeroPolicy.compute_view).
    `clip_rules` (QK-clip): each stage's forward ticks hand on attention's largest
    logits, reported for every stage's layers (jaxpar.step.qk_clip.staged)."""
    problem = pipe.problem
    if pipe.schedule in TICKED:
        run = lambda params, batch, count: _ticked(pipe, prepare, params, batch, count, clip_rules)  # noqa: E731
    else:

        def run(params, batch, count):  # the frozen leaves are constants: no gradient
            def loss(trained):
                params_ = prepare(problem.joined(params, trained))
                return _circular_loss(pipe, params_, batch, count, clip_rules)

            return jax.value_and_grad(loss, has_aux=True)(problem.trainable(params))

    def staged(params, batch, count):
        (loss, reports), grads = run(params, batch, count)
        # the last stage's alone (the others ran no loss), shared with every stage, as
        # the mean over the micro-batches; the maxima are every stage's already
        m = pipe.microbatches
        shared = {
            k: r if k.startswith(qk_clip.PREFIX) else jax.lax.psum(r, PIPE) / m
            for k, r in reports.items()
        }
        return (loss, shared), grads

    return staged


def forward_loss(pipe: Pipe, prepare, params, batch):
    """(stored params, micro-batch) -> (this device's summed loss, the model's reports
    summed over the micro-batches) (zeros but on the last chunk's device): the forward
    ticks alone, for a gpipe, interleaved or V-shaped `pipe`."""
    if pipe.schedule in V_SHAPED:  # the V's own forward ticks
        loss, reports = _ticked(pipe, prepare, params, batch, 1, grads=False)
    else:
        loss, reports = _circular_loss(pipe, prepare(params), batch, 1)
    return loss, jax.tree.map(lambda r: r / pipe.microbatches, reports)


def _reported_post(parts, params, y, mb):
    """(the summed losses of a micro-batch, what the model reported computing them)."""
    with scope.reporting() as reports:
        losses = sequence.per_token(parts.post(params, y, mb))
    return jnp.sum(losses.astype(jnp.float32)), dict(reports)


def _no_reports(parts, params, y_shape, mb) -> dict:
    """Zeros in the shape of what `_reported_post` reports (for the ticks that run none)."""
    shapes = jax.eval_shape(lambda y: _reported_post(parts, params, y, mb)[1], y_shape)
    return _zeros(shapes)


def _split(params: dict, keys) -> tuple[dict, dict]:
    return {k: v for k, v in params.items() if k in keys}, {
        k: v for k, v in params.items() if k not in keys
    }


def _micro(batch, m: int):
    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)


def _take(tree, i):
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _zeros(shapes, lead: tuple[int, ...] = ()):
    """Zeros of an activation's ShapeDtypeStructs, with `lead` dims before each leaf's."""
    return jax.tree.map(lambda s: jnp.zeros(lead + s.shape, s.dtype), shapes)


def _put(buffers, slot, value):
    """buffers[slot] = value, leaf by leaf (in the buffers' dtypes): an update in place
    (`.at[slot].set` is a scatter, whose bounds check selects over the whole buffer)."""
    return jax.tree.map(
        lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), slot, 0),
        buffers,
        value,
    )


def _select(which, a, b):
    return jax.tree.map(lambda x, y: jnp.where(which, x, y), a, b)


def _chunk_of(stack: dict, k, slots: int) -> dict:
    return {key: jax.lax.dynamic_slice_in_dim(x[0], k * slots, slots) for key, x in stack.items()}


def _circular_loss(pipe: Pipe, params: dict, batch, count: int, clip_rules=None):
    """gpipe / interleaved: (the summed loss of this device's last-chunk micro-batches
    (zero elsewhere), their reports summed); differentiate it for the backward pass."""
    layout, parts, m = pipe.layout, pipe.problem.parts, pipe.microbatches
    p, v, slots = layout.stages, layout.virtual, layout.slots
    table = jnp.asarray(pipe.table)
    stage = jax.lax.axis_index(PIPE)
    stack, _ = _split(params, pipe.stack_keys)
    active_all = jnp.asarray(layout.slot_layer >= 0)[stage]
    mbs = _micro(batch, m)
    h_shape = jax.eval_shape(lambda: parts.pre(params, _take(mbs, 0)))
    chunk = qk_clip.watching_chunk(parts.chunk, clip_rules)
    first = (_chunk_of(stack, 0, slots), _zeros(h_shape), active_all[:slots], _take(mbs, 0))
    maxima = _lowest_maxima(clip_rules, lambda: chunk(*first), parts, params, first[-1], v)
    none = _no_reports(parts, params, h_shape, _take(mbs, 0))

    def tick(carry, t):
        recv, loss, reports, maxima = carry
        valid, i, k = table[t, stage, 0] == FWD, table[t, stage, 1], table[t, stage, 2]
        c = k * p + stage
        mb = _take(mbs, i)
        x = jax.lax.cond(c == 0, lambda: parts.pre(params, mb), lambda: recv)
        active = jax.lax.dynamic_slice_in_dim(active_all, k * slots, slots) & valid
        y, seen = chunk(_chunk_of(stack, k, slots), x, active, mb)
        maxima = qk_clip.raised(maxima, seen, k * slots)
        last = valid & (c == p * v - 1)
        value, more = jax.lax.cond(
            last,
            lambda: _reported_post(parts, params, y, mb),
            lambda: (jnp.zeros((), jnp.float32), none),
        )
        loss, reports = loss + value, jax.tree.map(jnp.add, reports, more)
        # Round the ring only when chunks wrap round it (interleaved).
        send = jax.lax.ppermute(y, PIPE, [(s, (s + 1) % p) for s in range(p - (v == 1))])
        return (send, loss, reports, maxima), None

    init = (_zeros(h_shape), jnp.zeros((), jnp.float32), none, maxima)
    with jax.named_scope(TICKS_SCOPE):
        (_, loss, reports, maxima), _ = jax.lax.scan(tick, init, jnp.arange(len(pipe.table)))
    return loss / count, _with_maxima(reports, maxima, clip_rules)


def _lowest_maxima(clip_rules, traced, parts, params, mb, chunks: int) -> list:
    """QK-clip's maxima of a device's `chunks` chunks before its first tick (-inf; []
    where it does not watch: None `clip_rules`), `traced` running one (watching_chunk's),
    where the model's attention all runs in the stack."""
    if clip_rules is None:
        return []
    qk_clip.outside_stack(parts, params, mb)
    shapes = jax.eval_shape(traced)[1]
    return qk_clip.lowest(shapes, chunks * shapes[0].shape[0]) if shapes else []


class _Slots(NamedTuple):
    """What a 1F1B device carries from tick to tick."""

    acts: object  # [chunks x slots, *activation] a leaf: chunk inputs kept for the backward
    gins: object  # [chunks x slots, *activation] a leaf: output gradients handed back
    g_stack: dict  # gradient of this device's layers so far (fp32)
    g_rest: dict  # gradient of the rest (embedding, head, ...) so far (fp32)
    held: list  # [chunks x weight slots, layers, ...] each: what B kept for W (zero-bubble)
    recomputed: list  # [layers, ...] each: what R kept for B (one slot a device)
    loss: jax.Array  # this device's summed loss so far
    reports: dict  # what the model reported, summed so far (jaxpar.report)
    maxima: list  # [layers, heads] each: QK-clip's largest logits so far (qk_clip.raised)


class _Ticks(NamedTuple):
    """A schedule's table as this device reads it inside the step."""

    # [ticks, stages, 4]: what each stage runs, (kind, micro-batch, chunk k, a pair's
    # backward micro-batch)
    table: jax.Array
    sends_r: jax.Array  # [ticks]: some device hands the next one something at the tick
    sends_l: jax.Array  # [ticks]: some device hands the previous one something
    pairs: tuple | None  # ([ticks], [ticks]): pairs' gradients sent each way (None: no pair)
    slots: int  # buffer slots a chunk: the micro-batches it holds at once
    stage: jax.Array  # this device's stage
    stages: int
    vee: bool  # two chunks a device, in a V

    def slot(self, k, i, slots: int | None = None):
        """The buffer slot of micro-batch i of the device's chunk k."""
        n = self.slots if slots is None else slots
        return i % n if not self.vee else k * n + i % n

    def is_chunk(self, k, c):
        """Whether the device's k-th chunk is chunk c of the pipeline (-1: the last)."""
        p = self.stages
        return chunk_of(self.stage, k, p, self.vee) == c % (2 * p if self.vee else p)


def _ticks(table: np.ndarray, slots: int, vee: bool) -> _Ticks:
    right, left = (jnp.asarray(x) for x in sends(table))
    pairs = tuple(jnp.asarray(x) for x in pair_sends(table)) if has_pairs(table) else None
    stage = jax.lax.axis_index(PIPE)
    wide = np.zeros(table.shape[:2] + (4,), np.int32)  # no pair's micro-batch: 0
    wide[..., : table.shape[-1]] = table
    return _Ticks(jnp.asarray(wide), right, left, pairs, slots, stage, table.shape[1], vee)


def _hand_over(ticks: _Ticks, t, state: _Slots, y, d_x, zeros_h) -> _Slots:
    """Tick t's hand-overs (`y`: what the tick's forward made, `d_x`: its backward's
    input gradient), each filed in the slot of the micro-batch and chunk the neighbour
    ran: one way, activations of first chunks and gradients of second ones (a V's), the
    other way the rest; in a V, the last device also hands its own first chunk's output
    to its second chunk, and that one's input gradient back. A pair's gradient goes in
    a hand-over of its own (`_pair_hand_over`)."""
    table, stage, p = ticks.table, ticks.stage, ticks.stages
    send_r, send_l = y, d_x
    if ticks.vee:  # a V's chunks send both ways: the one made, where a tick makes one
        made = jax.tree.map(jnp.add, y, d_x)
        if ticks.pairs is not None:  # a pair sends its forward's here
            made = _select(table[t, stage, 0] == PAIR, y, made)
        send_r = send_l = made
    # Hand over only on ticks where some stage has something to hand over (the
    # condition is the same on every device, so the collective stays matched).
    got_r = jax.lax.cond(
        ticks.sends_r[t],
        lambda: jax.lax.ppermute(send_r, PIPE, [(s, s + 1) for s in range(p - 1)]),
        lambda: zeros_h,
    )
    got_l = jax.lax.cond(
        ticks.sends_l[t],
        lambda: jax.lax.ppermute(send_l, PIPE, [(s + 1, s) for s in range(p - 1)]),
        lambda: zeros_h,
    )
    # what each chunk k sends this way: (an activation, a gradient); None: nothing
    vee = ticks.vee
    state = _file(ticks, state, table[t, stage - 1], got_r, stage > 0, (0, 1 if vee else None))
    nxt = table[t, jnp.minimum(stage + 1, p - 1)]
    state = _file(ticks, state, nxt, got_l, stage < p - 1, (1 if vee else None, 0))
    if vee:  # the turn of the V, on the last device: its own output, handed to itself
        own = table[t, stage]
        turned = jnp.stack([own[0], own[1], 1 - own[2], own[3]])  # filed for its other chunk
        state = _file(ticks, state, turned, send_r, stage == p - 1, (1, 0))
    if ticks.pairs is not None:
        state = _pair_hand_over(ticks, t, state, d_x, zeros_h)
    return state


def _pair_hand_over(ticks: _Ticks, t, state: _Slots, d_x, zeros_h) -> _Slots:
    """Tick t's pairs' input gradients: a pair whose forward is its first chunk's sends
    it to the next device (its second chunk's backward hands back that way), one whose
    forward is its second chunk's to the previous; on the last device the first kind's
    turns the V, filed for its own first chunk."""
    table, stage, p = ticks.table, ticks.stage, ticks.stages
    right, left = (x[t] for x in ticks.pairs)
    got_r = jax.lax.cond(
        right,
        lambda: jax.lax.ppermute(d_x, PIPE, [(s, s + 1) for s in range(p - 1)]),
        lambda: zeros_h,
    )
    got_l = jax.lax.cond(
        left,
        lambda: jax.lax.ppermute(d_x, PIPE, [(s + 1, s) for s in range(p - 1)]),
        lambda: zeros_h,
    )
    nxt = table[t, jnp.minimum(stage + 1, p - 1)]
    for op, got, ok, k, into in (
        (table[t, stage - 1], got_r, stage > 0, 0, 1),
        (nxt, got_l, stage < p - 1, 1, 0),
        (table[t, stage], d_x, stage == p - 1, 0, 0),  # the turn
    ):
        slot = ticks.slot(into, op[3])
        came = ok & (op[0] == PAIR) & (op[2] == k)
        state = state._replace(
            gins=_put(state.gins, slot, _select(came, got, _take(state.gins, slot)))
        )
    return state


def _file(ticks: _Ticks, state: _Slots, op, got, ok, ways: tuple) -> _Slots:
    """`got`, what a device ran as `op` (kind, micro-batch, chunk k) handed over, filed
    in chunk k's slot of that micro-batch: an activation where its forward of chunk
    `ways[0]` sends this way, a gradient where its backward of chunk `ways[1]` does."""
    kind, i, k = op[0], op[1], op[2]
    slot, new = ticks.slot(k, i), {}
    acts_k, gins_k = ways
    if acts_k is not None:
        came = ok & ((kind == FWD) | (kind == PAIR)) & (k == acts_k)
        new["acts"] = _put(state.acts, slot, _select(came, got, _take(state.acts, slot)))
    if gins_k is not None:
        came = ok & ((kind == BWD) | (kind == INPUT)) & (k == gins_k)
        new["gins"] = _put(state.gins, slot, _select(came, got, _take(state.gins, slot)))
    return state._replace(**new)


def _empty_slots(
    h_shape, slots: int, stack: dict, rest: dict, reports: dict, kept, maxima: list
) -> _Slots:
    """Nothing run yet: empty buffers, fp32 gradients and loss at zero; `kept`: (held,
    recomputed), the zero-bubble slots; `maxima`: QK-clip's, at -inf."""
    buffers = _zeros(h_shape, (slots,))
    return _Slots(
        acts=buffers,
        gins=buffers,
        g_stack=jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), stack),
        g_rest=jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rest),
        loss=jnp.zeros((), jnp.float32),
        reports=reports,
        held=kept[0],
        recomputed=kept[1],
        maxima=maxima,
    )


class _Chunks(NamedTuple):
    """A device's chunks of its stack ([1, chunks x slots, ...] a leaf)."""

    slots: int  # layer slots a chunk
    vee: bool  # two chunks (a V), else one: the whole stack

    @property
    def count(self) -> int:
        return 2 if self.vee else 1

    def first(self, k):
        """The device's layer slot where its k-th chunk starts."""
        return k * self.slots if self.vee else 0

    def active(self, active, k):
        """The k-th chunk's part of the device's [slots] mask of real layers."""
        return (
            jax.lax.dynamic_slice_in_dim(active, k * self.slots, self.slots) if self.vee else active
        )

    def of(self, tree: dict, k) -> dict:
        """The device's k-th chunk of a stacked tree."""
        if not self.vee:
            return tree
        n = self.slots
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, k * n, n, axis=1), tree)

    def add(self, total: dict, part: dict, k) -> dict:
        """`total` with chunk k's gradient `part` ([1, slots, ...] a leaf) added."""
        if not self.vee:
            return jax.tree.map(lambda g, d: g + d.astype(g.dtype), total, part)
        n = self.slots

        def one(g, d):
            old = jax.lax.dynamic_slice_in_dim(g, k * n, n, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(g, old + d.astype(g.dtype), k * n, 1)

        return jax.tree.map(one, total, part)


def _ticked(pipe: Pipe, prepare, params: dict, batch, count: int, clip_rules=None, grads=True):
    """1f1b and the zero-bubble schedules: ((this device's summed loss / count, its
    reports summed), gradients of all local parameters); `grads=False`: the forward
    ticks alone, (.., None)."""
    layout, parts, m, p = pipe.layout, pipe.problem.parts, pipe.microbatches, pipe.layout.stages
    vee = pipe.schedule in V_SHAPED
    ticked = ticked_table(pipe.schedule, p, m) if grads else forward_table(p, m, vee)
    ticks, slots_n = _ticks(ticked.table, ticked.inputs, vee), ticked.inputs
    table_j, stage, chunks = ticks.table, ticks.stage, _Chunks(layout.slots, vee)
    every_stack, rest_storage = _split(params, pipe.stack_keys)
    # gradients of the trained leaves alone; the frozen ones are constants
    trained = pipe.problem.trainable
    stack = trained(every_stack)
    frozen_stack = {k: v for k, v in every_stack.items() if k not in stack}
    # the rest (embedding, head, ...) made ready once per step, its gradient transposed once
    rest, rest_vjp = jax.vjp(prepare, trained(rest_storage))
    frozen_rest = prepare({k: v for k, v in rest_storage.items() if k not in rest})
    active = jnp.asarray(layout.slot_layer >= 0)[stage]
    mbs = _micro(batch, m)
    whole = lambda r: {**every_stack, **frozen_rest, **r}  # noqa: E731  (pre/post read `rest`)
    mb0 = _take(mbs, 0)
    h_shape = jax.eval_shape(lambda: parts.pre(whole(rest), mb0))
    zeros_h = _zeros(h_shape)

    padded = (layout.slot_layer < 0).any()
    every_slot = np.ones(layout.slots, bool)  # no slot pads: a constant, no branch a layer

    def run_chunk(local_stack, x, mb, k=0):
        local = {**chunks.of(frozen_stack, k), **local_stack}
        local = prepare({key: val[0] for key, val in local.items()})
        return parts.chunk(local, x, chunks.active(active, k) if padded else every_slot, mb)

    watched = qk_clip.watching_chunk(run_chunk, clip_rules)

    def post_loss(r, y, mb):
        value, reports = _reported_post(parts, whole(r), y, mb)
        return value / count, reports

    model = (parts, whole, rest, zeros_h)
    forward = _forward(ticks, chunks, stack, mbs, watched, post_loss, model, grads)
    into_pre = _into_pre(parts, whole, rest, ticks)
    backward = _fused_backward(run_chunk, stack, mbs, slots_n, into_pre, zeros_h)
    branches = {FWD: forward, BWD: backward}
    kept = [], []
    if ticked.weights:
        pads = active if padded else None
        halves = zero_bubble.halves(
            parts.layer, prepare, stack, frozen_stack, pads, h_shape, mb0, layout.slots
        )
        kept = (
            halves.kept_shapes((chunks.count * ticked.weights,)),
            halves.residual_shapes(),
        )
        branches.update(_split_backward(halves, mbs, ticked, into_pre, ticks, chunks, zeros_h))
        branches[PAIR] = _pair(branches)
    run_op = _by_kind(branches, ticked.table, zeros_h)

    def tick(state, t):
        state, y, d_x = run_op(table_j[t, stage], state)
        return _hand_over(ticks, t, state, y, d_x, zeros_h), None

    reports = _no_reports(parts, whole(rest), h_shape, mb0)
    one = (chunks.of(stack, 0), zeros_h, mb0)  # QK-clip's maxima's shapes from a tick's forward
    maxima = _lowest_maxima(
        clip_rules, lambda: watched(*one), parts, whole(rest), mb0, chunks.count
    )
    state = _empty_slots(h_shape, chunks.count * slots_n, stack, rest, reports, kept, maxima)
    with jax.named_scope(TICKS_SCOPE):
        state, _ = jax.lax.scan(tick, state, jnp.arange(table_j.shape[0]))
    reports = _with_maxima(state.reports, state.maxima, clip_rules)
    if not grads:
        return state.loss, reports
    grads_ = jax.tree.map(lambda g, r: g.astype(r.dtype), state.g_rest, rest)
    (g_rest_storage,) = rest_vjp(grads_)
    return (state.loss, reports), {**state.g_stack, **g_rest_storage}


def _forward(ticks: _Ticks, chunks: _Chunks, stack, mbs, watched, post_loss, model, grads):
    """The forward tick of micro-batch i on the device's chunk k: the pipeline's first
    chunk embeds it; its last takes the loss and, with `grads`, its gradient, filed
    for the chunk's backward."""
    parts, whole, rest, zeros_h = model

    def forward(state: _Slots, i, k):
        mb, slot = _take(mbs, i), ticks.slot(k, i)
        x = jax.lax.cond(
            ticks.is_chunk(k, 0),
            lambda: parts.pre(whole(rest), mb),
            lambda: _take(state.acts, slot),
        )
        acts = _put(state.acts, slot, x)
        y, seen = watched(chunks.of(stack, k), x, mb, k)
        maxima = qk_clip.raised(state.maxima, seen, chunks.first(k))

        def last(args):
            gins, g_rest, loss, reports = args
            if not grads:
                value, more = post_loss(rest, y, mb)
            else:
                value, vjp, more = jax.vjp(post_loss, rest, y, mb, has_aux=True)
                d_rest, d_y, _ = vjp(jnp.ones((), jnp.float32))
                g_rest = jax.tree.map(jnp.add, g_rest, d_rest)
                gins = _put(gins, slot, d_y)
            return gins, g_rest, loss + value, jax.tree.map(jnp.add, reports, more)

        carried = (state.gins, state.g_rest, state.loss, state.reports)
        gins, g_rest, loss, reports = jax.lax.cond(
            ticks.is_chunk(k, -1), last, lambda a: a, carried
        )
        state = state._replace(
            acts=acts, gins=gins, g_rest=g_rest, loss=loss, reports=reports, maxima=maxima
        )
        return state, y, zeros_h

    return forward


def _into_pre(parts, whole, rest: dict, ticks: _Ticks):
    """(state, the chunk input's gradient, micro-batch, chunk k) -> the rest's gradient
    with the embedding's part added on the pipeline's first chunk (others unchanged)."""

    def into_pre(state: _Slots, d_x, mb, k) -> dict:
        def first(g_rest):
            _, vjp_pre = jax.vjp(lambda r: parts.pre(whole(r), mb), rest)
            return jax.tree.map(jnp.add, g_rest, vjp_pre(d_x)[0])

        return jax.lax.cond(ticks.is_chunk(k, 0), first, lambda g: g, state.g_rest)

    return into_pre


def _with_maxima(reports: dict, maxima: list, clip_rules: list | None) -> dict:
    """`reports` and, where QK-clip watches, every stage's maxima (qk_clip.staged)."""
    return reports if clip_rules is None else {**reports, **qk_clip.staged(maxima, clip_rules)}


def _fused_backward(run_chunk, stack, mbs, slots_n: int, into_pre, zeros_h):
    """1f1b's backward tick: the chunk recomputed from its stage input, then both
    gradients at once."""

    def backward(state: _Slots, i, k):
        mb, slot = _take(mbs, i), i % slots_n
        _, vjp = jax.vjp(lambda s, x: run_chunk(s, x, mb), stack, _take(state.acts, slot))
        d_stack, d_x = vjp(_take(state.gins, slot))
        g_stack = jax.tree.map(jnp.add, state.g_stack, d_stack)
        g_rest = into_pre(state, d_x, mb, k)
        return state._replace(g_stack=g_stack, g_rest=g_rest), zeros_h, d_x

    return backward


def _by_kind(branches: dict, table: np.ndarray, zeros_h):
    """(op (kind, micro-batch, chunk k, a pair's backward micro-batch), state) -> (state,
    what its forward made, its backward's input gradient): the branch of that kind,
    run. A branch returns (state, its output, its input's gradient), zeros where it
    makes none.

    One two-way `cond` a kind the table holds (1f1b's program has no R, B or W), one
    after the other, not one switch over them all: XLA:CPU copies every buffer a switch
    carries whose branches write different ones (each slot buffer of the zero-bubble
    ticks, in and out, every tick), where a chain of conds updates each in place."""
    kinds = sorted({int(k) for k in np.unique(table[..., 0])} - {IDLE})

    def run(op, state):
        kind, i, k, j = op[0], op[1], op[2], op[3]
        out = state, zeros_h, zeros_h
        for c in kinds:
            more = (j,) if c == PAIR else ()
            out = jax.lax.cond(
                kind == c,
                lambda o, c=c, more=more: branches[c](o[0], i, k, *more),
                lambda o: o,
                out,
            )
        return out

    return run


def _pair(branches: dict):
    """dualpipev's pair: chunk k's forward of micro-batch i, then the other chunk's R, B
    and W of micro-batch j, on one tick; (state, the forward's output, the backward's
    input gradient)."""

    def pair(state: _Slots, i, k, j):
        state, y, _ = branches[FWD](state, i, k)
        state, _, _ = branches[RECOMPUTE](state, j, 1 - k)
        state, _, d_x = branches[INPUT](state, j, 1 - k)
        state, _, _ = branches[WEIGHT](state, j, 1 - k)
        return state, y, d_x

    return pair


def _split_backward(halves, mbs, ticked, into_pre, ticks: _Ticks, chunks: _Chunks, zeros_h):
    """The zero-bubble ticks: R files the chunk's residuals for B; B hands the input's
    gradient back and files what W reads; W adds the weights' gradients."""

    if ticked.residuals != 1:  # the residuals' one slot, whichever chunk R ran
        raise ValueError(f"a zero-bubble table holding {ticked.residuals} R's before their B")

    def recompute(state: _Slots, i, k):
        x = _take(state.acts, ticks.slot(k, i))
        recomputed = halves.recompute(x, _take(mbs, i), chunks.first(k), state.recomputed)
        return state._replace(recomputed=recomputed), zeros_h, zeros_h

    def input_grad(state: _Slots, i, k):
        mb, gin = _take(mbs, i), _take(state.gins, ticks.slot(k, i))
        slot, first = ticks.slot(k, i, ticked.weights), chunks.first(k)
        d_x, held = halves.input_grad(state.recomputed, gin, mb, first, state.held, slot)
        g_rest = into_pre(state, d_x, mb, k)
        return state._replace(held=held, g_rest=g_rest), zeros_h, d_x

    def weight_grad(state: _Slots, i, k):
        slot = ticks.slot(k, i, ticked.weights)
        grads = halves.weight_grad(state.held, slot, _take(mbs, i), chunks.first(k))
        g_stack = chunks.add(state.g_stack, {key: g[None] for key, g in grads.items()}, k)
        return state._replace(g_stack=g_stack), zeros_h, zeros_h

    return {RECOMPUTE: recompute, INPUT: input_grad, WEIGHT: weight_grad}


def reduce_shared(pipe: Pipe, grads: dict, specs: dict) -> dict:
    """Leaves every stage holds (embedding, head, ...) got gradient on one stage only:
    sum them over `pipeline`."""
    return {
        k: g if k in pipe.stack_keys else collectives.reduce(g, specs[k].compute, axis=PIPE)
        for k, g in grads.items()
    }
