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
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.config.sections import Adapter, Data, Dpo, DpoLoss, Model, Reference, Train
from jaxpar.data import pairs
from jaxpar.data.pairs import REFERENCE
from jaxpar.errors import ConfigError
from jaxpar.nn import documents, sequence
from jaxpar.nn.layers import batch_sum
from jaxpar.nn.problem import Parts, Problem
from jaxpar.nn.scope import report
from jaxpar.objectives import precompute, reference
from jaxpar.objectives.answers import answer_sums, logps


def mode(dpo: Dpo, adapter: Adapter) -> Reference:
    """dpo.reference resolved: auto is adapters-off for fresh adapters, else copy."""
    lora = adapter.kind == "lora"
    chosen = dpo.reference
    if chosen is Reference.AUTO:
        return Reference.ADAPTERS_OFF if reference.fresh_adapters(adapter) else Reference.COPY
    if chosen is Reference.ADAPTERS_OFF and not lora:
        raise ConfigError(
            "dpo.reference=adapters-off: the reference is the base with the adapters off, and "
            "adapter.kind=none trains no adapters; use adapter.kind=lora, or dpo.reference=copy"
        )
    if chosen is Reference.ADAPTERS_OFF and adapter.init:
        raise ConfigError(
            f"dpo.reference=adapters-off with adapter.init={adapter.init}: the run starts "
            "from trained adapters, so the base alone is not the model it starts as; use "
            "dpo.reference=copy (a copy of the adapters alone)"
        )
    return chosen


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
    count = batch_sum(jnp.float32(policy.shape[0]))

    def mean(x):
        return batch_sum(jnp.sum(x)) / count

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


def objective(problem: Problem, dpo: Dpo, adapter: Adapter) -> Problem:
    """`problem` (a registered model, adapters on it or not) trained by DPO on pairs, with
    its reference as dpo.reference says."""
    how = mode(dpo, adapter)
    copied = reference.trained_keys(problem) if how is Reference.COPY else []
    policy, held = reference.policy, reference.held(problem, copied)
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
    return reference.with_copy(
        problem,
        copied,
        loss=loss,
        parts=parts,
        count=lambda batch: jnp.float32(batch["tokens"].shape[0]),
        # the reference's forward pass: a third of a trained token's
        flops_per_token=None if flops is None or precomputed else flops * 4 / 3,
        reference_forward=not precomputed,
    )


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

    def layer(params, h, batch):
        mine, ref = h
        ref = jax.lax.stop_gradient(inner.layer(held(params), ref, batch))
        return inner.layer(policy(params), mine, batch), ref

    stack = reference.stack_keys(inner, copied)
    return Parts(
        stack_keys=stack,
        pre=pre,
        chunk=chunk,
        post=post,
        costs=inner.costs,
        layer=inner.layer and layer,
    )


# -- the plug-in (jaxpar.objectives) ----------------------------------------------------


def check(dpo: Dpo, adapter: Adapter) -> None:
    mode(dpo, adapter)  # a reference the run cannot have is refused


def problem(own: Problem, dpo: Dpo, adapter: Adapter) -> Problem:
    return objective(own, dpo, adapter)


def batches(
    own: Problem,
    split: str,
    mesh_shape,
    devices=None,
    *,
    dpo: Dpo,
    adapter: Adapter,
    model: Model,
    train: Train,
    data: Data,
) -> Callable:
    """(i, rows=slice(None)) -> batch i of `split`'s preference pairs, with the
    reference's log-probabilities where dpo.reference=precompute (`own`: the model
    before the objective, scored once)."""
    t = train
    held = pairs.load(data, t, model.vocab, split)
    reference = None
    if mode(dpo, adapter) is Reference.PRECOMPUTE:
        reference = precompute.reference_logps(model, adapter, train, data, own, split, devices)

    def batches(i: int, rows: slice = slice(None)) -> dict:
        return pairs.batch_at(
            held,
            seed=t.seed,
            step=i,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            rows=rows,
            reference=reference,
        )

    return batches


def hooks(batches) -> tuple:
    return ()
