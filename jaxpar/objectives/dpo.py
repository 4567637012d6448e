"""Direct Preference Optimization (Rafailov et al. 2023) as a Problem over preference rows.

A batch row is a pair (jaxpar.data.pairs): the chosen answer's document, then the
rejected one's. The model's own per-token losses (the negative log-probabilities of the
trained targets) are summed over each answer, on every device that holds part of the row
(a sum over `context`), into log pi(chosen) and log pi(rejected). With the reference's
(log pi_ref) they make each pair's loss, as TRL's DPOTrainer computes it:

- sigmoid: -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d), d = (log pi(c) -
  log pi_ref(c)) - (log pi(r) - log pi_ref(r)), e = dpo.label_smoothing (cDPO);
- ipo: (d' - 1 / (2 beta))^2, d' the same difference of each answer's log-ratio divided
  by its trained tokens (TRL's normalization).

The step divides the summed pair losses of the global batch by its pairs (Problem.count),
so the loss is the mean over pairs whatever the layout. The reference is one of:

- copy: the trained leaves at the start, frozen, under `reference/` keys beside them
  (stored like the policy's, in the same placement and ZeRO stage; an adapter run copies
  its adapters only and shares the base);
- adapters-off: an adapter run's base alone, no copy (its adapters left out of the view);
- precompute: the batch's `reference_logps`, computed once before training
  (jaxpar.objectives.precompute).

Its forward pass runs beside the policy's in the same program (through each pipeline
stage too), with no gradient. The step's metrics are TRL's: rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.config.sections import Config, Dpo, DpoLoss, Objective, Reference
from jaxpar.data.pairs import CHOSEN, REFERENCE, REJECTED
from jaxpar.data.tokens import SEGMENT_IDS
from jaxpar.errors import ConfigError
from jaxpar.nn import documents, sequence
from jaxpar.nn.layers import batch_sum
from jaxpar.nn.problem import Parts, Problem
from jaxpar.nn.scope import report
from jaxpar.parallel.axes import CONTEXT

COPY = "reference/"  # the keys of the reference's copy of a trained leaf


def mode(cfg: Config) -> Reference:
    """dpo.reference resolved: auto is adapters-off for fresh adapters, else copy."""
    lora = cfg.adapter.kind == "lora"
    chosen = cfg.dpo.reference
    if chosen is Reference.AUTO:
        return Reference.ADAPTERS_OFF if lora and not cfg.adapter.init else Reference.COPY
    if chosen is Reference.ADAPTERS_OFF and not lora:
        raise ConfigError(
            "dpo.reference=adapters-off: the reference is the base with the adapters off, and "
            "adapter.kind=none trains no adapters; use adapter.kind=lora, or dpo.reference=copy"
        )
    if chosen is Reference.ADAPTERS_OFF and cfg.adapter.init:
        raise ConfigError(
            f"dpo.reference=adapters-off with adapter.init={cfg.adapter.init}: the run starts "
            "from trained adapters, so the base alone is not the model it starts as; use "
            "dpo.reference=copy (a copy of the adapters alone)"
        )
    return chosen


def model_of(cfg: Config):
    """The model.* section a DPO or GRPO run computes with: a mixture's load-balance loss
    left out of the per-token losses its log-probabilities are read from (TRL adds it to
    the loss; here it is reported, moe/balance_loss, and not trained)."""
    scored = cfg.train.objective in (Objective.DPO, Objective.GRPO)
    if scored and getattr(cfg.model, "router_aux_loss", 0):
        return dataclasses.replace(cfg.model, router_aux_loss=0.0)
    return cfg.model


def answer_sums(per_token: jax.Array, batch: dict) -> jax.Array:
    """[rows, 2] each row's per-token values summed over its chosen and its rejected
    answer's trained targets (whole rows: summed over `context` where it splits them)."""
    segment = sequence.local(batch[SEGMENT_IDS][:, 1:])
    sums = jnp.stack(
        [jnp.sum(jnp.where(segment == s, per_token, 0.0), -1) for s in (CHOSEN, REJECTED)], -1
    )
    return jax.lax.psum(sums, CONTEXT) if sequence.active() is not None else sums


def logps(losses: jax.Array, batch: dict) -> jax.Array:
    """[rows, 2] log pi of each row's chosen and rejected answer, from the model's
    per-token losses (zero where a target is not trained)."""
    return -answer_sums(losses.astype(jnp.float32), batch)


def pair_losses(policy: jax.Array, reference: jax.Array, batch: dict, dpo: Dpo) -> jax.Array:
    """[rows] each pair's loss (the module's docstring), TRL's metrics reported."""
    ratios = policy - reference
    if dpo.loss is DpoLoss.IPO:
        trained = documents.target_weights(batch).astype(jnp.float32)
        per_token = ratios / jnp.maximum(answer_sums(trained, batch), 1.0)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * dpo.beta)) ** 2
    else:
        d = dpo.beta * (ratios[:, 0] - ratios[:, 1])
        e = dpo.label_smoothing
        losses = -(1 - e) * jax.nn.log_sigmoid(d) - e * jax.nn.log_sigmoid(-d)
    _report(jax.lax.stop_gradient(policy), jax.lax.stop_gradient(dpo.beta * ratios))
    return losses


def _report(policy: jax.Array, rewards: jax.Array) -> None:
    """The means over the batch's pairs (every device's rows; on each context device alike)."""
    pairs = batch_sum(jnp.float32(policy.shape[0]))

    def mean(x):
        return batch_sum(jnp.sum(x)) / pairs

    report("rewards/chosen", mean(rewards[:, 0]))
    report("rewards/rejected", mean(rewards[:, 1]))
    report("rewards/margins", mean(rewards[:, 0] - rewards[:, 1]))
    report("rewards/accuracies", mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)))
    report("logps/chosen", mean(policy[:, 0]))
    report("logps/rejected", mean(policy[:, 1]))


def as_tokens(losses: jax.Array, like: jax.Array) -> jax.Array:
    """[rows, S] a row's loss at its first target (shared among context devices), zeros
    elsewhere: the per-token form the step sums."""
    split = sequence.active()
    share = losses / (split.degree if split is not None else 1)
    return jnp.zeros(like.shape, jnp.float32).at[:, 0].set(share)


def objective(problem: Problem, cfg: Config) -> Problem:
    """`problem` (a registered model, adapters on it or not) trained by DPO on pairs, with
    its reference as dpo.reference says."""
    dpo, how = cfg.dpo, mode(cfg)
    trained = [k for k in problem.names if k not in problem.frozen]
    copied = trained if how is Reference.COPY else []

    def policy(params):
        return {k: v for k, v in params.items() if not k.startswith(COPY)}

    def held(params):
        """The reference's leaves (of any part of the params: a stage's stack)."""
        out = {k: v for k, v in params.items() if k in problem.frozen}
        out.update({k: params[COPY + k] for k in copied if COPY + k in params})
        return jax.lax.stop_gradient(out)

    precomputed = how is Reference.PRECOMPUTE

    def finish(policy_losses, reference_losses, batch):
        reference = batch[REFERENCE] if precomputed else logps(reference_losses, batch)
        losses = pair_losses(logps(policy_losses, batch), jax.lax.stop_gradient(reference),
                             batch, dpo)  # fmt: skip
        return as_tokens(losses, policy_losses)

    def loss(params, batch):
        # the reference first: the policy's reports (a mixture's) are the ones kept
        ref = None if precomputed else problem.loss(held(params), batch)
        return finish(problem.loss(policy(params), batch), ref, batch)

    parts = None
    if problem.parts is not None:
        parts = _parts(problem.parts, policy, held, finish, copied, precomputed)
    flops = problem.flops_per_token
    return dataclasses.replace(
        problem,
        init=with_copies(problem.init, copied),
        shapes={**problem.shapes, **{COPY + k: problem.shapes[k] for k in copied}},
        names={**problem.names, **{COPY + k: problem.names[k] for k in copied}},
        loss=loss,
        parts=parts,
        module=None,
        count=lambda batch: jnp.float32(batch["tokens"].shape[0]),
        # the reference's forward pass: a third of a trained token's
        flops_per_token=None if flops is None or precomputed else flops * 4 / 3,
        frozen=problem.frozen | {COPY + k for k in copied},
        reference=frozenset(COPY + k for k in copied),
        reference_forward=not precomputed,
    )


def with_copies(init, copied):
    def made(key):
        params = init(key)
        return {**params, **{COPY + k: params[k] for k in copied}}

    return made


def copies(params, copied_keys) -> callable:
    """`params` (targets -> arrays, as jaxpar.train takes them) with the reference's
    copies of `copied_keys` made beside the policy's leaves."""

    def made(targets):
        own = params({k: v for k, v in targets.items() if not k.startswith(COPY)})
        placed = {COPY + k: targets[COPY + k].sharding for k in copied_keys}
        copy = jax.jit(lambda x: {COPY + k: jnp.copy(x[k]) for k in copied_keys},
                       out_shardings=placed)  # fmt: skip
        return {**own, **copy(own)}

    return made


def _parts(inner: Parts, policy, held, finish, copied, precomputed: bool) -> Parts:
    if precomputed:  # the policy's own pieces, the loss from the batch's reference
        return dataclasses.replace(
            inner, post=lambda params, h, batch: finish(inner.post(params, h, batch), None, batch)
        )

    def pre(params, batch):
        return inner.pre(policy(params), batch), inner.pre(held(params), batch)

    def chunk(params, h, active, batch):
        mine, ref = h
        ref = jax.lax.stop_gradient(inner.chunk(held(params), ref, active, batch))
        return inner.chunk(policy(params), mine, active, batch), ref

    def post(params, h, batch):
        ref = inner.post(held(params), h[1], batch)
        return finish(inner.post(policy(params), h[0], batch), ref, batch)

    stack = inner.stack_keys + tuple(COPY + k for k in copied if k in inner.stack_keys)
    return Parts(stack_keys=stack, pre=pre, chunk=chunk, post=post, costs=inner.costs)
