"""A sparse mixture of experts in place of a block's MLP (Mixtral's): a router (one
product to `experts` logits, a softmax in fp32, the top k, their weights renormalized
over the k or, Qwen3-MoE's choice, not; or DeepSeek-V3's sigmoid scores, chosen with a
balancing bias among the best groups and scaled: `Rule`, `choose`), SwiGLU experts
stacked as one [experts, ...] parameter per weight, and the Switch / Mixtral
load-balance loss, returned with the output (not collected from the layer's
intermediates, which a layer scan would lose). The balancing bias moves by DeepSeek's
rule through its own gradient (`balanced`).

Dispatch by fixed capacity, a sequence at a time: each expert takes
ceil(capacity_factor x seq x k / experts) of a sequence's tokens, every token's first
choice before any second choice, in sequence order; a token past its expert's capacity
skips that expert (its share of the output is 0, the residual carries it on). A group
of one sequence makes the drops the same in every layout of the batch. The tokens are
gathered into [rows, experts, capacity, embed], the experts applied as one batched
product, and each token's outputs gathered back and weighted. Where the step splits
sequences over context, each layer gathers the sequence's tokens, routes it whole,
runs 1/C of every expert's slots, and sums the outputs back to the tokens' devices
(jaxpar.parallel.context.whole, share, scatter_sum).

Dropless (model.capacity_factor=0, as MaxText's Megablox and torchtitan's grouped
products): each (token, choice) is sorted by its expert and the experts applied by
lax.ragged_dot, a group of rows each; nothing is dropped, and a token's route depends on
it alone, so under context each device routes its own tokens. Under expert parallelism
the tokens and their routes are gathered over `expert`, each device runs its experts'
rows, and the outputs are reduce-scattered back (jaxpar.nn.experts)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.names import BALANCE, BATCH, EMBED, EXPERTS, MLP, ROUTES, SEQ, SEQ_RESIDUAL
from jaxpar.nn import sequence
from jaxpar.nn.experts import (
    all_experts,
    first_expert,
    from_experts,
    gather_tokens,
    scatter_outputs,
    to_experts,
)
from jaxpar.nn.layers import batch_sum, constrain, param
from jaxpar.nn.scope import report
from jaxpar.nn.tensor_parallel import tensor_parallel

from . import LlamaConfig, Router
from .common import Gated, along_last, normal


class Routing(NamedTuple):
    """Where a layer sends each of a sequence's tokens ([rows, seq, k] but `probs`)."""

    experts: jax.Array  # int32: the k experts chosen, most probable first
    weights: jax.Array  # fp32: their probabilities renormalized over the k
    slot: jax.Array  # int32: the token's place among its expert's tokens of the sequence
    keep: jax.Array  # bool: slot < capacity (else dropped)
    probs: jax.Array  # [rows, seq, experts] fp32: the router's softmax


class Load(NamedTuple):
    """A sparse layer's routing of each row, summed over the row's tokens and over the
    layers: what the load-balance loss and the metrics need, small enough to hand on
    from one pipeline stage to the next beside the residual stream."""

    probs: jax.Array  # [rows, experts] fp32: the trained tokens' router probabilities
    trained: jax.Array  # [rows, experts] fp32: the trained tokens' choices of each expert
    chosen: jax.Array  # [rows, experts] fp32: every token's choices of each expert
    kept: jax.Array  # [rows] fp32: every token's choices within capacity

    @staticmethod
    def zeros(rows: int, experts: int) -> Load:
        per_expert = jnp.zeros((rows, experts), jnp.float32)
        return Load(per_expert, per_expert, per_expert, jnp.zeros((rows,), jnp.float32))

    def __add__(self, other: Load) -> Load:
        return Load(*(a + b for a, b in zip(self, other, strict=True)))


def capacity(seq: int, experts: int, k: int, factor: float) -> int:
    """Slots per expert for a sequence of `seq` tokens: ceil(factor seq k / experts), at
    most seq (no token goes to one expert twice; factor >= experts / k is dropless);
    factor 0 (dropless, no slots): seq."""
    return seq if factor == 0 else min(seq, math.ceil(factor * seq * k / experts))


@dataclass(frozen=True)
class Rule:
    """How a router turns its logits into each token's k experts and their weights."""

    k: int
    renormalize: bool  # the k weights over their sum (Mixtral; Qwen's norm_topk_prob)
    sigmoid: bool = False  # each expert's score a sigmoid (DeepSeek-V3), not a softmax
    groups: int = 1  # group-limited top-k: the experts in this many groups ...
    top_groups: int = 1  # ... the k chosen within these, best by their top-2 sums
    scaling: float = 1.0  # the weights times this (routed_scaling_factor)

    @staticmethod
    def of(cfg: LlamaConfig) -> Rule:
        return Rule(
            cfg.experts_per_token,
            cfg.router_renormalize,
            cfg.router is Router.SIGMOID,
            cfg.router_groups,
            cfg.router_top_groups,
            cfg.routed_scaling,
        )


def choose(logits_BxSxX: jax.Array, rule: Rule, bias_X: jax.Array | None = None):
    """(each expert's share of the token (the softmax; the sigmoids over their sum), each
    token's k experts, their weights): the k best of the scores plus the balancing
    `bias_X` (which chooses, but weighs nothing), among the `rule.top_groups` best
    groups; weighted by their scores, renormalized over the k or not, times the scaling."""
    logits = logits_BxSxX.astype(jnp.float32)
    if rule.sigmoid:
        scores_BxSxX = jax.nn.sigmoid(logits)
        share_BxSxX = scores_BxSxX / jnp.sum(scores_BxSxX, -1, keepdims=True)
    else:
        scores_BxSxX = share_BxSxX = jax.nn.softmax(logits, axis=-1)
    choice_BxSxX = scores_BxSxX
    if bias_X is not None:
        choice_BxSxX = scores_BxSxX + bias_X.reshape((1,) * (scores_BxSxX.ndim - 1) + (-1,))
    if rule.groups > 1:
        *lead, n = choice_BxSxX.shape
        grouped_BxSxGxY = choice_BxSxX.reshape(*lead, rule.groups, n // rule.groups)
        best_BxSxG = jnp.sum(jax.lax.top_k(grouped_BxSxGxY, 2)[0], -1)
        _, groups_BxSxT = jax.lax.top_k(best_BxSxG, rule.top_groups)
        kept_BxSxG = jnp.sum(jax.nn.one_hot(groups_BxSxT, rule.groups, dtype=bool), -2)
        kept_BxSxX = jnp.repeat(kept_BxSxG, n // rule.groups, axis=-1)
        choice_BxSxX = jnp.where(kept_BxSxX, choice_BxSxX, -jnp.inf)
    _, experts_BxSxK = jax.lax.top_k(choice_BxSxX, rule.k)
    weights_BxSxK = jnp.take_along_axis(scores_BxSxX, experts_BxSxK, -1)
    if rule.renormalize:
        tiny = 1e-20 if rule.sigmoid else 0.0  # DeepSeek's guard of a sum of sigmoids
        weights_BxSxK = weights_BxSxK / (jnp.sum(weights_BxSxK, -1, keepdims=True) + tiny)
    return share_BxSxX, experts_BxSxK, weights_BxSxK * rule.scaling


def route(logits_BxSxX: jax.Array, rule: Rule, slots: int, bias_X=None) -> Routing:
    """Top-k routing of each sequence's tokens into `slots` places per expert (choose)."""
    probs_BxSxX, experts_BxSxK, weights_BxSxK = choose(logits_BxSxX, rule, bias_X)
    rows, seq, n = probs_BxSxX.shape
    k = rule.k
    # claims in priority order: every token's first choice, then every second choice
    claims_BxKSxX = jax.nn.one_hot(
        experts_BxSxK.transpose(0, 2, 1).reshape(rows, k * seq), n, dtype=jnp.int32
    )
    earlier_BxKSxX = jnp.cumsum(claims_BxKSxX, axis=1) - claims_BxKSxX
    slot_BxKxS = jnp.sum(earlier_BxKSxX * claims_BxKSxX, -1).reshape(rows, k, seq)
    slot_BxSxK = slot_BxKxS.transpose(0, 2, 1)
    return Routing(experts_BxSxK, weights_BxSxK, slot_BxSxK, slot_BxSxK < slots, probs_BxSxX)


class MoE(nnx.Module):
    """The mixture's feed-forward: [rows, seq, embed] -> (the same, its Load)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, m, n = cfg.embed, cfg.expert_mlp or cfg.mlp, cfg.experts
        self.router = param(rngs, normal(0.02), (e, n), (EMBED, ROUTES))
        if cfg.router is Router.SIGMOID:  # DeepSeek's balancing bias (e_score_correction_bias)
            self.bias = param(rngs, nnx.initializers.zeros, (n,), (BALANCE,))
        self.w_gate = param(rngs, normal(0.02), (n, e, m), (EXPERTS, EMBED, MLP))
        self.w_up = param(rngs, normal(0.02), (n, e, m), (EXPERTS, EMBED, MLP))
        out_std = 0.02 / (2 * cfg.layers) ** 0.5
        self.w_down = param(rngs, normal(out_std), (n, m, e), (EXPERTS, MLP, EMBED))
        if cfg.expert_bias:  # GPT-OSS: on the router's logits and each expert's products
            zeros = nnx.initializers.zeros
            self.router_bias = param(rngs, zeros, (n,), (ROUTES,))
            self.b_gate = param(rngs, zeros, (n, m), (EXPERTS, MLP))
            self.b_up = param(rngs, zeros, (n, m), (EXPERTS, MLP))
            self.b_down = param(rngs, zeros, (n, e), (EXPERTS, EMBED))
        self.gated = Gated.of(cfg)
        self.rule = Rule.of(cfg)
        self.capacity_factor = cfg.capacity_factor

    def __call__(
        self, x_BxSxE: jax.Array, trained_BxS: jax.Array | None = None, dropless: bool = False
    ) -> tuple[jax.Array, Load]:
        """(the output, the Load of its routing); `trained_BxS` weighs each token in the
        balance loss (its target is trained; None: all are)."""
        n = self.router.shape[-1]
        few = dropless and x_BxSxE.shape[0] * x_BxSxE.shape[1] * self.rule.k <= n
        if self.capacity_factor == 0 or few:
            return self.dropless(x_BxSxE, trained_BxS, picked if few else grouped)
        dt = x_BxSxE.dtype
        # split over context: every device routes the whole sequence (its tokens gathered)
        # as one device would, and runs its share of each expert's slots
        whole_BxSxE = sequence.whole(x_BxSxE)
        seq = whole_BxSxE.shape[1]
        slots = seq if dropless else capacity(seq, n, self.rule.k, self.capacity_factor)
        r = route(self._logits(whole_BxSxE), self.rule, slots, self._bias())
        first, held = sequence.share(slots)
        slot_BxSxK = r.slot - first
        mine_BxSxK = r.keep & (slot_BxSxK >= 0) & (slot_BxSxK < held)
        experts, names = self._experts(dt)
        # each expert's hidden dims split over `tensor`: one sum of the combined output
        routed = Routing(r.experts, r.weights, slot_BxSxK, mine_BxSxK, None)
        mixed = functools.partial(mix, held, n, self.gated)
        part_BxSxE = tensor_parallel(mixed, whole_BxSxE, routed, experts, names)
        y_BxSxE = sequence.scatter_sum(part_BxSxE)  # each token's outputs, summed
        kept_weights = sequence.local(jnp.where(r.keep, r.weights, 0.0))
        y_BxSxE = y_BxSxE + self._down_bias(sequence.local(r.experts), kept_weights, dt)
        # this device's tokens' routing
        probs_BxSxX = sequence.local(r.probs)
        chosen_BxSxX = jax.nn.one_hot(sequence.local(r.experts), n, dtype=jnp.float32).sum(2)
        kept_B = jnp.sum(sequence.local(r.keep), (1, 2)).astype(jnp.float32)
        load = _load(probs_BxSxX, chosen_BxSxX, kept_B, trained_BxS)
        return self._balanced(y_BxSxE, load), load

    def dropless(self, x_BxSxE: jax.Array, trained_BxS: jax.Array | None, apply=None):
        """__call__ with no capacity: every token to its k experts (this device's
        tokens; the module's docstring), by `apply` (default grouped; decoding no more
        (token, choice) pairs than experts, picked)."""
        dt = x_BxSxE.dtype
        n = self.router.shape[-1]
        logits_BxSxX = self._logits(x_BxSxE)
        probs_BxSxX, experts_BxSxK, weights_BxSxK = choose(logits_BxSxX, self.rule, self._bias())
        experts, names = self._experts(dt)
        routed = (experts_BxSxK, weights_BxSxK)
        applied = functools.partial(apply or grouped, self.gated)
        y_BxSxE = tensor_parallel(applied, x_BxSxE, routed, experts, names)
        y_BxSxE = y_BxSxE + self._down_bias(experts_BxSxK, weights_BxSxK, dt)
        chosen_BxSxX = jax.nn.one_hot(experts_BxSxK, n, dtype=jnp.float32).sum(2)
        kept_B = jnp.full(x_BxSxE.shape[:1], self.rule.k * x_BxSxE.shape[1], jnp.float32)
        load = _load(probs_BxSxX, chosen_BxSxX, kept_B, trained_BxS)
        return self._balanced(y_BxSxE, load), load

    def _logits(self, x_BxSxE: jax.Array) -> jax.Array:
        dt = x_BxSxE.dtype
        logits_BxSxX = jnp.einsum("bse,ex->bsx", x_BxSxE, self.router[...].astype(dt))
        if hasattr(self, "router_bias"):
            logits_BxSxX = logits_BxSxX + along_last(self.router_bias, logits_BxSxX)
        return constrain(logits_BxSxX, (BATCH, SEQ, ROUTES))

    def _experts(self, dt) -> tuple[tuple, tuple]:
        """(the experts' gate, up and down weights, and their gate and up biases if
        any, in `dt`; their logical names)."""
        weights = [self.w_gate, self.w_up, self.w_down]
        names = [(EXPERTS, EMBED, MLP), (EXPERTS, EMBED, MLP), (EXPERTS, MLP, EMBED)]
        if hasattr(self, "b_gate"):
            weights += [self.b_gate, self.b_up]
            names += [(EXPERTS, MLP), (EXPERTS, MLP)]
        return tuple(w[...].astype(dt) for w in weights), tuple(names)

    def _down_bias(self, experts_BxSxK, weights_BxSxK, dt) -> jax.Array | float:
        """The experts' down biases, weighted by each token's routing: added once, after
        the partial sums over `tensor` (each expert device holds every expert's)."""
        if not hasattr(self, "b_down"):
            return 0.0
        b_XxE = all_experts(self.b_down[...].astype(dt))
        return jnp.einsum("bske,bsk->bse", b_XxE[experts_BxSxK], weights_BxSxK.astype(dt))

    def _bias(self) -> jax.Array | None:
        """The balancing bias, which chooses experts and takes no gradient of the loss."""
        return jax.lax.stop_gradient(self.bias[...]) if hasattr(self, "bias") else None

    def _balanced(self, y_BxSxE: jax.Array, load: Load) -> jax.Array:
        """The output, placed; with a balancing bias, tied to it (balanced)."""
        y_BxSxE = constrain(y_BxSxE, (BATCH, SEQ_RESIDUAL, EMBED))
        if not hasattr(self, "bias"):
            return y_BxSxE
        return balanced(y_BxSxE, self.bias[...], jnp.sum(load.trained, 0))


@jax.custom_vjp
def balanced(y_BxSxE: jax.Array, bias_X: jax.Array, counts_X: jax.Array) -> jax.Array:
    """`y` itself; its backward pass gives the balancing bias, for a gradient, the
    layer's trained choices of each expert less their mean (`counts_X`, this device's
    tokens): summed over the batch by the gradient's own reduction, the optimizer moves
    each bias by a fixed step against its sign (jaxpar.step.optimizer: DeepSeek's rule:
    up for an expert below the mean load, down above it). The loss's cotangent does not
    scale it; a pass whose output takes none (a pipeline's idle slot) gives none."""
    del bias_X, counts_X
    return y_BxSxE


def _balanced_fwd(y_BxSxE, bias_X, counts_X):
    return y_BxSxE, counts_X


def _balanced_bwd(counts_X, g_BxSxE):
    live = jnp.any(g_BxSxE != 0).astype(counts_X.dtype)
    return g_BxSxE, live * (counts_X - jnp.mean(counts_X)), jnp.zeros_like(counts_X)


balanced.defvjp(_balanced_fwd, _balanced_bwd)


def _load(probs_BxSxX, chosen_BxSxX, kept_B, trained_BxS) -> Load:
    """This device's tokens' Load; `trained_BxS` weighs each in the balance loss."""
    w_BxS = jnp.ones(probs_BxSxX.shape[:2], jnp.float32)
    if trained_BxS is not None:
        w_BxS = trained_BxS.astype(jnp.float32)
    return Load(
        probs=jnp.einsum("bsx,bs->bx", probs_BxSxX, w_BxS),
        trained=jnp.einsum("bsx,bs->bx", chosen_BxSxX, w_BxS),
        chosen=jnp.sum(chosen_BxSxX, 1),
        kept=kept_B,
    )


def grouped(gated, x_BxSxE, routed, gate_LxExM, up_LxExM, down_LxMxE, *biases):
    """Each token's k experts' outputs, weighted and summed, none dropped: every (token,
    choice) of the expert devices' tokens (gather_tokens) sorted by expert, this
    device's L experts applied to their rows by lax.ragged_dot (the others' rows sorted
    last, outside every group: zeros), the outputs weighted, added to their tokens, and
    summed back to the tokens' devices (scatter_outputs). `gated`: the hidden of gate and
    up; `biases`: the gate's and up's ([L, M] each), if any."""
    experts_BxSxK, weights_BxSxK = routed
    x_TxE = gather_tokens(x_BxSxE)
    rows, seq, embed = x_TxE.shape
    x_TxE = x_TxE.reshape(rows * seq, embed)
    experts_A = gather_tokens(experts_BxSxK).reshape(-1)  # A: (token, choice) pairs
    weights_A = gather_tokens(weights_BxSxK).reshape(-1)
    k = experts_BxSxK.shape[-1]
    local = gate_LxExM.shape[0]
    mine_A = experts_A - first_expert(local)
    group_A = jnp.where((mine_A >= 0) & (mine_A < local), mine_A, local)
    order_A = jnp.argsort(group_A, stable=True)
    sizes_L = jnp.bincount(group_A, length=local + 1)[:local].astype(jnp.int32)
    token_A = order_A // k
    in_AxE = x_TxE[token_A]
    gate_AxM = jax.lax.ragged_dot(in_AxE, gate_LxExM, sizes_L)
    up_AxM = jax.lax.ragged_dot(in_AxE, up_LxExM, sizes_L)
    if biases:  # each row's expert's (the others' rows: any, their products are zeros)
        expert_A = jnp.minimum(group_A[order_A], local - 1)
        gate_AxM, up_AxM = gate_AxM + biases[0][expert_A], up_AxM + biases[1][expert_A]
    out_AxE = jax.lax.ragged_dot(gated(gate_AxM, up_AxM), down_LxMxE, sizes_L)
    out_AxE = out_AxE * weights_A[order_A][:, None].astype(out_AxE.dtype)
    y_TxE = jnp.zeros_like(x_TxE).at[token_A].add(out_AxE)
    return scatter_outputs(y_TxE.reshape(rows, seq, embed))


def picked(gated, x_BxSxE, routed, gate_XxExM, up_XxExM, down_XxMxE, *biases):
    """grouped's outputs for a decoding step's few tokens, all experts here (decoding's
    layouts split none over `expert`): each (token, choice)'s expert weights gathered
    and applied to that token alone, nothing sorted. For no more pairs than experts, it
    reads no more weights than grouped does, in a few ops instead of a sort and three
    ragged products (on one CPU device, a step of two tokens a row then costs what one
    does)."""
    experts_BxSxK, weights_BxSxK = routed
    gate_BxSxKxM = jnp.einsum("bsf,bskfm->bskm", x_BxSxE, gate_XxExM[experts_BxSxK])
    up_BxSxKxM = jnp.einsum("bsf,bskfm->bskm", x_BxSxE, up_XxExM[experts_BxSxK])
    if biases:
        gate_BxSxKxM = gate_BxSxKxM + biases[0][experts_BxSxK]
        up_BxSxKxM = up_BxSxKxM + biases[1][experts_BxSxK]
    hidden_BxSxKxM = gated(gate_BxSxKxM, up_BxSxKxM)
    out_BxSxKxE = jnp.einsum("bskm,bskmf->bskf", hidden_BxSxKxM, down_XxMxE[experts_BxSxK])
    return jnp.einsum("bskf,bsk->bsf", out_BxSxKxE, weights_BxSxK.astype(out_BxSxKxE.dtype))


def mix(slots: int, n: int, gated, x_BxSxE, r: Routing, gate_LxExM, up_LxExM, down_LxMxE,
        *biases):  # fmt: skip
    """Each token's k experts' outputs, weighted and summed: the tokens gathered into
    their n experts' `slots` slots (a choice not `r.keep`, or out of them: skipped),
    sent to the devices of their experts (the L here: n, or n / X under expert
    parallelism), the experts applied as one batched product (`gated`, with the gate's and
    up's `biases` if any), the outputs sent back and gathered to their tokens."""
    rows, seq, _ = x_BxSxE.shape
    # each expert's slots: the token in it (seq: none, a row of zeros); out of capacity,
    # the write is dropped
    row = jnp.arange(rows)[:, None, None]
    token = jnp.broadcast_to(jnp.arange(seq)[None, :, None], r.slot.shape)
    empty_BxXxC = jnp.full((rows, n, slots), seq, jnp.int32)
    slot_BxSxK = jnp.where(r.keep, r.slot, slots)
    token_BxXxC = empty_BxXxC.at[row, r.experts, slot_BxSxK].set(token, mode="drop")
    padded_BxSxE = jnp.concatenate([x_BxSxE, jnp.zeros_like(x_BxSxE[:, :1])], axis=1)
    in_BxXxCxE = jax.vmap(lambda x, t: x[t])(padded_BxSxE, token_BxXxC)
    in_GxLxCxE = to_experts(in_BxXxCxE)  # G: the rows of every device sending here
    gate_GxLxCxM = jnp.einsum("glce,lem->glcm", in_GxLxCxE, gate_LxExM)
    up_GxLxCxM = jnp.einsum("glce,lem->glcm", in_GxLxCxE, up_LxExM)
    if biases:
        gate_GxLxCxM = gate_GxLxCxM + biases[0][None, :, None]
        up_GxLxCxM = up_GxLxCxM + biases[1][None, :, None]
    h_GxLxCxM = gated(gate_GxLxCxM, up_GxLxCxM)
    out_BxXxCxE = from_experts(jnp.einsum("glcm,lme->glce", h_GxLxCxM, down_LxMxE))
    # each token's k outputs, weighted (a dropped one: weight 0)
    flat_BxXCxE = out_BxXxCxE.reshape(rows, n * slots, -1)
    where_BxSxK = r.experts * slots + jnp.clip(r.slot, 0, slots - 1)
    picked_BxSxKxE = jax.vmap(lambda o, i: o[i])(flat_BxXCxE, where_BxSxK)
    weights_BxSxK = jnp.where(r.keep, r.weights, 0.0).astype(x_BxSxE.dtype)
    return jnp.einsum("bske,bsk->bse", picked_BxSxKxE, weights_BxSxK)


def balance_loss(load: Load, k: int, layers: int) -> jax.Array:
    """[rows] each row's part of the summed load-balance loss, experts x sum_i f_i P_i
    (Mixtral's, as `transformers` computes it over all layers at once): f_i the share of
    the batch's trained tokens' choices (of all `layers`, k a token) that went to expert
    i, P_i its router probability's mean over them. f counts the whole batch, on every
    device (batch_sum), and is a constant; P_i is a mean over tokens and layers, so a
    row's part is experts x sum_i f_i (the row's summed probabilities) / layers, and the
    engine's division by the batch's trained tokens makes the mean."""
    n = load.probs.shape[-1]
    counts_X = batch_sum(jnp.sum(load.trained, 0))
    tokens_x_layers = jnp.sum(counts_X) / k
    share_X = counts_X / jnp.maximum(tokens_x_layers, 1.0)
    return n * jnp.einsum("bx,x->b", load.probs, share_X) / layers


def report_load(load: Load, balance_B: jax.Array, k: int, layers: int) -> None:
    """The step's metrics of a mixture, over the whole batch (jaxpar.report): its
    load-balance loss (unweighted), the share of the k choices of every token and layer
    dropped for capacity, and the busiest expert's share of the choices over the mean
    expert's (1: even; all layers together)."""
    tokens = jnp.maximum(batch_sum(jnp.sum(load.trained)) / (k * layers), 1.0)
    report("moe/balance_loss", batch_sum(jnp.sum(balance_B)) / tokens)
    choices = batch_sum(jnp.sum(load.chosen))  # k a token and layer
    report("moe/dropped", 1.0 - batch_sum(jnp.sum(load.kept)) / choices)
    per_expert_X = batch_sum(jnp.sum(load.chosen, 0))
    report("moe/load_max_over_mean", jnp.max(per_expert_X) / jnp.mean(per_expert_X))
