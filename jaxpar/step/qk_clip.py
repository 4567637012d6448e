"""QK-clip (muon.qk_clip=tau; Kimi K2's MuonClip): after each update, every attention
head whose largest logit in the step's forward pass passed tau has the weights that
scale its logits multiplied by (tau / that logit)^power, the powers of a head's weights
summing to one (q and k each by the square root; q alone where heads share their keys),
so that the same weights on the same batch would give it tau. Heads at or below tau are
untouched, exactly.

The logits come out of the forward pass that computes the loss (jaxpar.nn.logits), a
report per attention ("max/logits/i": [layers, heads]) that the step combines by its
maximum over micro-batches and devices; the step reports their overall maximum as
"attn/max_logit".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.names import HEAD_DIM, HEADS, KV_HEADS, QKV
from jaxpar.nn import logits, scope
from jaxpar.nn.logits import Scaled
from jaxpar.parallel.axes import PIPE

PREFIX = f"{scope.MAXIMUM}logits/"
MAX_LOGIT = "attn/max_logit"  # the step's report: the largest over every head


def watched(on: bool):
    """While a loss computes: (with `on`) collect attention's largest logits, the list
    that `reported` takes (None without)."""
    return logits.watching() if on else contextlib.nullcontext()


def reported(seen: list | None, rules: list) -> dict:
    """The reports of what attention handed on (`seen`), each head's maximum over the
    devices sharing the batch; `rules` keeps the weights of each (static: the same for
    every trace)."""
    if seen is None:
        return {}
    rules[:] = [s.scaled for s in seen]
    ctx = scope.current()
    axes = ctx.batch_axes if ctx else ()
    top = (lambda x: jax.lax.pmax(x, axes)) if axes else (lambda x: x)
    return {f"{PREFIX}{i}": top(s.max_H) for i, s in enumerate(seen)}


def watching_chunk(chunk, rules: list | None):
    """A pipeline's `chunk` as (its output, each attention's largest logits per head,
    [its layers, heads] each) while QK-clip watches (`rules` filled as it is traced),
    else (its output, [])."""
    if rules is None:
        return lambda *args: (chunk(*args), [])

    def run(*args):
        with logits.watching() as seen:
            y = chunk(*args)
        rules[:] = [s.scaled for s in seen]
        return y, [s.max_H for s in seen]

    return run


def raised(maxima: list, new: list, start) -> list:
    """`maxima` ([layers, heads] each) with the rows from `start` on raised to `new`'s
    where these are higher (a chunk's layers among a device's)."""

    def one(m, n):
        old = jax.lax.dynamic_slice_in_dim(m, start, n.shape[0])
        return jax.lax.dynamic_update_slice_in_dim(m, jnp.maximum(old, n), start, 0)

    return [one(m, n) for m, n in zip(maxima, new, strict=True)]


def lowest(shapes: list, rows: int) -> list:
    """Maxima of nothing yet: -inf in `rows` layers of each attention's `shapes`."""
    return [jnp.full((rows, *x.shape[1:]), -jnp.inf, x.dtype) for x in shapes]


def staged(maxima: list, rules: list) -> dict:
    """A pipeline device's maxima (its stage's layers) as `reported`'s: the batch's over
    the devices sharing it, then every stage's gathered over `pipeline`, [stages,
    layers, heads] as the staged weights hold their layers."""
    seen = [logits.Seen(m, r) for m, r in zip(maxima, rules, strict=True)]
    return {k: jax.lax.all_gather(v, PIPE) for k, v in reported(seen, rules).items()}


def outside_stack(parts, params, mb) -> None:
    """Refuse a pipelined model whose attention runs outside its layer stack (in Stages'
    pre or post): its logits would go unwatched, its heads unclipped."""
    with logits.watching() as seen:
        y = jax.eval_shape(lambda: parts.pre(params, mb))
        jax.eval_shape(lambda y: parts.post(params, y, mb), y)
    if seen:
        keys = sorted({x.key for one in seen for x in one.scaled})
        raise ConfigError(
            f"muon.qk_clip with a pipeline: attention outside the staged layer stack "
            f"({', '.join(keys)}) would go unclipped; move it into the Stages' stack, or "
            "drop muon.qk_clip"
        )


@dataclass(frozen=True)
class Factors:
    """Each clipped attention's factor per head, [layers, heads], and the weights it
    scales (each by its power of it)."""

    etas: list
    scaled: list

    @property
    def keys(self) -> set[str]:
        return {s.key for scaled in self.scaled for s in scaled}

    def each(self, shapes: dict, names: dict) -> list[tuple[str, jax.Array]]:
        """(key, its factor, broadcast against the leaf) for each scaling, in order."""
        return [
            (s.key, _factor(shapes[s.key].shape, eta_LxH**s.power, names[s.key], s))
            for eta_LxH, scaled in zip(self.etas, self.scaled, strict=True)
            for s in scaled
        ]

    def applied(self, params: dict, names: dict, each: list | None = None) -> dict:
        """`params` (those of `keys`, at least) with each head's weights scaled; `each`
        in place of the factors' own (the same, placed elsewhere: the host)."""
        params = dict(params)
        for key, factor in self.each(params, names) if each is None else each:
            params[key] = (params[key] * factor).astype(params[key].dtype)
        return params


def clip(params: dict, reports: dict, rules: list, tau: float, names: dict, trained: set):
    """(params with each head over tau scaled back to it, the reports without the
    per-head maxima but with their overall "attn/max_logit")."""
    factors, rest = factors_of(reports, rules, tau, trained)
    return factors.applied(params, names), rest


def factors_of(reports: dict, rules: list, tau: float, trained: set) -> tuple[Factors, dict]:
    """(each head's factor, tau over its largest logit where that passed tau, the reports
    without the per-head maxima but with their overall "attn/max_logit"). Only attention
    whose weights are all `trained` is clipped and counted: a frozen copy's (DPO's
    reference) is not."""
    maxima = [reports[f"{PREFIX}{i}"] for i in range(len(rules))]
    rest = {k: v for k, v in reports.items() if not k.startswith(PREFIX)}
    pairs = [(m, r) for m, r in zip(maxima, rules, strict=True) if {s.key for s in r} <= trained]
    if not pairs:
        raise ConfigError(
            f"muon.qk_clip={tau:g}: the model hands on no trained attention logits to clip "
            "(QK-clip scales the query and key weights of multi-head, grouped-query and "
            "latent attention; model.qk_norm's are not built for it); drop muon.qk_clip"
        )
    rest[MAX_LOGIT] = jnp.max(jnp.stack([jnp.max(m) for m, _ in pairs]))
    # NaN (a step that is skipped as not finite) is not over tau: untouched
    etas = [jnp.where(max_LxH > tau, tau / max_LxH, 1.0) for max_LxH, _ in pairs]
    return Factors(etas, [scaled for _, scaled in pairs]), rest


def _factor(shape: tuple, f_LxH, names: tuple[str, ...], s: Scaled):
    """Each head's factor, broadcast against a leaf of `shape`: f's leading dims are the
    leaf's (the layer stack's), its last is the leaf's heads dim; for a fused leaf, on its
    qkv part `s.part` alone; with a span, on those of the head's dims alone."""
    head = next(i for i, n in enumerate(names) if n in (HEADS, KV_HEADS))
    dims = [1] * len(shape)
    for i in range(f_LxH.ndim - 1):
        dims[i] = f_LxH.shape[i]
    dims[head] = f_LxH.shape[-1]
    factor = f_LxH.reshape(dims)
    along = lambda dim, keep: keep(jnp.arange(shape[dim])).reshape(  # noqa: E731
        [-1 if i == dim else 1 for i in range(len(shape))]
    )
    if s.part is not None:
        factor = jnp.where(along(names.index(QKV), lambda i: i == s.part), factor, 1.0)
    if s.span is not None:
        start, stop = s.span
        mine = along(names.index(HEAD_DIM), lambda i: (i >= start) & (i < stop))
        factor = jnp.where(mine, factor, 1.0)
    return factor
