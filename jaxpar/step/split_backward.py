"""A layer's backward pass in its two halves, for the zero-bubble schedules (Qi et al.,
arXiv 2401.10241): B, the gradient of the layer's input, which the previous stage waits
for, and W, the gradient of its weights, which nobody waits for.

JAX differentiates a function as one program, so we split the program. The layer's
forward and backward are traced as one jaxpr from shapes, nested `jit` calls inlined
(`jnp.einsum` is one), and its equations are partitioned three ways:
- forward: the equations that do not read the output's cotangent `dy`;
- B: the ones the input's cotangent needs;
- W: the rest, that the weights' cotangents need.
W reads what it needs of the forward and of B from `kept`, so it recomputes nothing. An
equation both halves need runs in B: a nested loop, branch or shard_map that makes both
cotangents is one equation, and its weight half runs early.

Two choices keep the slots small. A weight cotangent that no product makes (a norm's
scale or bias) is made in B where W would otherwise keep more to make it. And of the
forward's values B reads, those it can make again from the others by elementwise steps
(an activation's, a norm's) are made again in B instead of kept in R's slot: no product
runs twice, so there is still no third forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jcore

_INLINED = ("jit", "pjit", "closed_call", "core_call")


@dataclass(frozen=True)
class _Op:
    eqn: Any  # the jaxpr equation (primitive, params, context)
    ins: tuple  # an int key per input, or a jax Literal
    outs: tuple[int, ...]


def _flatten(closed, ins: list, ops: list[_Op], consts: dict, next_key) -> list:
    """Append `closed`'s equations to `ops`, nested calls inlined, with its inputs bound
    to the keys (or Literals) `ins`; its outputs' keys or Literals."""
    jaxpr = closed.jaxpr
    env = {}
    for var, value in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = key = next_key()
        consts[key] = value
    env.update(zip(jaxpr.invars, ins, strict=True))
    read = lambda v: v if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr")
        if eqn.primitive.name in _INLINED and isinstance(inner, jcore.ClosedJaxpr):
            env.update(zip(eqn.outvars, _flatten(inner, args, ops, consts, next_key), strict=True))
            continue
        outs = tuple(next_key() for _ in eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
        ops.append(_Op(eqn, tuple(args), outs))
    return [read(v) for v in jaxpr.outvars]


def _keys(atoms) -> set[int]:
    return {a for a in atoms if isinstance(a, int)}


def _needed(ops: list[_Op], wanted: set[int], stop: set[int]) -> list[int]:
    """Indices of the ops (in order) that compute `wanted`, not looking past `stop`."""
    want, picked = set(wanted) - stop, []
    for n in range(len(ops) - 1, -1, -1):
        if want & set(ops[n].outs):
            picked.append(n)
            want |= _keys(ops[n].ins) - stop
    return picked[::-1]


def _run(ops: list[_Op], picked: list[int], env: dict) -> None:
    for n in picked:
        op = ops[n]
        eqn = op.eqn
        args = [a.val if isinstance(a, jcore.Literal) else env[a] for a in op.ins]
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(op.outs, out if eqn.primitive.multiple_results else [out], strict=True))


@dataclass(frozen=True)
class Split:
    """`fn(w, x, aux) -> y`'s backward in its halves (built by `split`). `w` is
    differentiated and `x` is; `aux` (the micro-batch, frozen leaves) is read only."""

    ops: list[_Op]
    consts: dict  # key -> value of the traced program's constants
    inputs: tuple[list, list, list, list]  # keys of w's, x's, aux's and dy's leaves
    outputs: tuple[list, list, list]  # keys or Literals of y's, dw's and dx's leaves
    trees: tuple  # treedefs of y, dw, dx
    forward_ops: list[int]
    input_ops: list[int]
    weight_ops: list[int]
    residuals: list[int]  # what B (and through it W) reads of the forward and of x
    kept: list[int]  # what W reads of the forward, of x, of dy and of B
    avals: dict  # key -> its abstract value

    def _env(self, w, aux) -> dict:
        env = dict(self.consts)
        env.update(zip(self.inputs[0], jax.tree.leaves(w), strict=True))
        env.update(zip(self.inputs[2], jax.tree.leaves(aux), strict=True))
        return env

    def _out(self, n: int, env: dict):
        vals = [a.val if isinstance(a, jcore.Literal) else env[a] for a in self.outputs[n]]
        return jax.tree.unflatten(self.trees[n], vals)

    def forward(self, w, x, aux):
        """(y, residuals): the forward, keeping what the backward reads of it."""
        env = self._env(w, aux)
        env.update(zip(self.inputs[1], jax.tree.leaves(x), strict=True))
        _run(self.ops, self.forward_ops, env)
        return self._out(0, env), [env[k] for k in self.residuals]

    def input_grad(self, residuals, w, aux, dy):
        """(dx, kept): B, from the forward's residuals and the output's cotangent."""
        env = self._env(w, aux)
        env.update(zip(self.residuals, residuals, strict=True))
        env.update(zip(self.inputs[3], jax.tree.leaves(dy), strict=True))
        _run(self.ops, self.input_ops, env)
        return self._out(2, env), [env[k] for k in self.kept]

    def weight_grad(self, kept, w, aux):
        """dw: W, from what B kept."""
        env = self._env(w, aux)
        env.update(zip(self.kept, kept, strict=True))
        _run(self.ops, self.weight_ops, env)
        return self._out(1, env)

    def shapes(self, keys: list[int]) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(self.avals[k].shape, self.avals[k].dtype) for k in keys]


_PRODUCTS = ("dot_general", "conv_general_dilated")  # the ops W is there to move off B
# elementwise and shape ops B may run again from R's residuals rather than keep each
# result (an activation's or a norm's steps: a slot's worth of bytes each, no FLOPs to
# speak of)
_CHEAP = frozenset(
    "abs add broadcast_in_dim convert_element_type copy div erf exp expand_dims "
    "integer_pow log log1p logistic max min mul neg pow reshape rsqrt select_n "
    "sharding_constraint sign sqrt square squeeze sub tanh".split()
)


@dataclass(frozen=True)
class _Halves:
    """B's ops, W's ops and what W reads of the others, chosen from `ops`."""

    ops: list[_Op]
    before: set[int]  # made before the backward: weights, constants, the micro-batch
    ready: set[int]  # and the forward's values and dy
    dw: set[int]  # the weights' cotangents
    avals: dict

    def of(self, in_b: set[int]) -> tuple[list[int], list[int], list[int]]:
        """(B's ops, W's ops, W's slot) where B makes `in_b`."""
        input_ops = _needed(self.ops, in_b, self.ready)
        by_b = {k for n in input_ops for k in self.ops[n].outs}
        weight_ops = _needed(self.ops, self.dw, self.ready | by_b)
        reads = set().union(*(_keys(self.ops[n].ins) for n in weight_ops)) | self.dw
        made_by_w = {k for n in weight_ops for k in self.ops[n].outs}
        return input_ops, weight_ops, sorted(reads - made_by_w - self.before)

    def least_kept(self, dx: set[int]) -> tuple[list[int], list[int], list[int]]:
        """of(dx), but with each weight cotangent that no product makes (a norm's scale,
        a bias) made in B instead where that keeps fewer bytes for W: its reductions
        are cheap, and what they read (a norm's normalized input and its output's
        gradient) would take a W slot each."""
        best, in_b, moved = self.of(dx), set(dx), True
        while moved:  # again, till none moves: a value two of them read frees with both
            moved = False
            for k in sorted(self.dw - in_b):
                by_b = {out for n in best[0] for out in self.ops[n].outs}
                picked = _needed(self.ops, {k}, self.ready | by_b)  # what B would add
                if any(self.ops[n].eqn.primitive.name in _PRODUCTS for n in picked):
                    continue
                tried = self.of(in_b | {k})
                if self._bytes(tried[2]) < self._bytes(best[2]):
                    best, in_b, moved = tried, in_b | {k}, True
        return best

    def fewest_residuals(self, wanted: set[int]) -> tuple[list[int], list[int]]:
        """(what R keeps for B, the forward's ops B makes the rest with): of the forward's
        values B and W read (`wanted`), those B can make again from the others by cheap
        elementwise ops (a norm's or an activation's steps, each a slot's worth) are
        dropped, largest first, wherever that keeps fewer bytes. B then runs those ops:
        no product, so still no third forward."""
        keep = set(wanted)
        for r in sorted(wanted, key=lambda k: -self._bytes([k])):
            rest = keep - {r}
            picked = _needed(self.ops, {r}, rest | self.before)
            if not picked or any(self.ops[n].eqn.primitive.name not in _CHEAP for n in picked):
                continue
            reads = set().union(*(_keys(self.ops[n].ins) for n in picked))
            reads -= {k for n in picked for k in self.ops[n].outs} | self.before
            if self._bytes(rest | reads) < self._bytes(keep):
                keep = rest | reads
        redone = _needed(self.ops, set(wanted) - keep, keep | self.before)
        return sorted(keep), redone

    def _bytes(self, keys) -> int:
        return sum(self.avals[k].size * self.avals[k].dtype.itemsize for k in keys)


def split(fn, w, x, aux) -> Split:
    """Trace fn's forward and backward at the shapes of (w, x, aux) and partition them
    (see the module's doc)."""

    def both(w, x, aux, dy):
        y, vjp = jax.vjp(lambda w, x: fn(w, x, aux), w, x)
        dw, dx = vjp(dy)
        return y, dw, dx

    y_shape = jax.eval_shape(fn, w, x, aux)
    closed = jax.make_jaxpr(both)(w, x, aux, y_shape)
    trees = tuple(jax.tree.structure(t) for t in jax.eval_shape(both, w, x, aux, y_shape))
    counter = iter(range(1 << 62))
    next_key = lambda: next(counter)  # noqa: E731
    ins = [next_key() for _ in closed.jaxpr.invars]
    ops: list[_Op] = []
    consts: dict = {}
    outs = _flatten(closed, ins, ops, consts, next_key)
    sizes = [len(jax.tree.leaves(t)) for t in (w, x, aux, y_shape)]
    bounds = [sum(sizes[:n]) for n in range(5)]
    w_in, x_in, aux_in, dy_in = (ins[bounds[n] : bounds[n + 1]] for n in range(4))
    n_y, n_w = trees[0].num_leaves, trees[1].num_leaves
    y_out, dw_out, dx_out = outs[:n_y], outs[n_y : n_y + n_w], outs[n_y + n_w :]

    # the ops downstream of dy are backward; the others forward
    late = set(dy_in)
    for op in ops:
        if _keys(op.ins) & late:
            late |= set(op.outs)
    made_before = set(consts) | set(w_in) | set(aux_in)
    forward_made = {k for op in ops if not set(op.outs) & late for k in op.outs} | set(x_in)
    avals = {k: v.aval for op in ops for k, v in zip(op.outs, op.eqn.outvars, strict=True)}
    avals.update(zip(ins, (v.aval for v in closed.jaxpr.invars), strict=True))
    ready = made_before | forward_made | set(dy_in)
    halves = _Halves(ops, made_before, ready, _keys(dw_out), avals)
    input_ops, weight_ops, kept = halves.least_kept(_keys(dx_out))
    by_b = {k for n in input_ops for k in ops[n].outs}
    read_by = lambda picked: set().union(*(_keys(ops[n].ins) for n in picked))  # noqa: E731
    b_reads = read_by(input_ops) | _keys(dx_out) | (set(kept) - by_b - set(dy_in))
    residuals, redone = halves.fewest_residuals(b_reads & forward_made)
    input_ops = redone + input_ops
    forward_ops = _needed(ops, _keys(y_out) | set(residuals), made_before | set(x_in) | late)
    return Split(
        ops=ops,
        consts=consts,
        inputs=(w_in, x_in, aux_in, dy_in),
        outputs=(y_out, dw_out, dx_out),
        trees=trees,
        forward_ops=forward_ops,
        input_ops=input_ops,
        weight_ops=weight_ops,
        residuals=residuals,
        kept=kept,
        avals=avals,
    )
