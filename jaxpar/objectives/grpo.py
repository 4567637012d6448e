"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath), with DAPO's and
Dr. GRPO's losses, as a Problem over rollout rows (jaxpar.objectives.rollouts makes them).

A row is one completion: its prompt's ids, then the completion's (up to and with its stop
id), then padding; the loss mask marks the completion's ids. Beside the ids a row carries
its advantage (`advantages` [rows]: its reward less its group's mean, over the group's
std where grpo.scale_rewards says), and per target where they are needed the log-
probabilities of the policy that sampled it (`old_logps` [rows, seq_len], with
grpo.iterations > 1) and of the reference (`ref_logps`, with grpo.beta > 0). Per trained
target, as TRL's GRPOTrainer computes it:

    ratio = exp(logp - old)                      (old = logp, held still, at 1 iteration)
    loss  = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A)
          + beta (exp(ref - logp) - (ref - logp) - 1)          (the k3 estimator of KL)
                 x ratio                          (with grpo.kl_correction: TRL's default)

summed over the global batch and divided by its count (Problem.count), so that the loss
is, whatever the layout:

- grpo: each completion's mean over its tokens, then the mean over completions (each
  target weighed 1 / its completion's length; the count: completions);
- dapo: the mean over every completion token of the batch (the count: those tokens);
- dr_grpo: the sum over tokens / (completions x grpo.max_new_tokens);
- gspo (Zheng et al. 2025, Qwen3's GSPO; TRL's importance_sampling_level="sequence"):
  one ratio a completion, exp(the mean of its targets' logp - old), clipped and KL-
  corrected as above in place of each target's, then grpo's mean. Its clip ratios are
  means over completions, as TRL reports them.

The log-probabilities are the model's own (temperature 1); TRL divides the logits by the
sampling temperature first, so the two agree at grpo.temperature=1. The step reports
TRL's kl and clip_ratio/* (token means over the batch).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpar.config.sections import Adapter, Checkpoint, Config, Grpo, GrpoLoss, OnSpike, Train
from jaxpar.errors import ConfigError
from jaxpar.nn import documents, sequence
from jaxpar.nn.layers import batch_sum
from jaxpar.nn.problem import Problem
from jaxpar.nn.scope import report
from jaxpar.objectives import reference
from jaxpar.objectives.rollouts import ADVANTAGES, OLD, REF, Rollouts
from jaxpar.parallel.axes import CONTEXT


def token_losses(log_ratio, logp, ref, advantages, g: Grpo):
    """([rows, S] each target's loss, its clip flags (low, high), its k3 KL or None), from
    the log importance ratio against the sampler (per target [rows, S], or per completion
    [rows, 1] with GSPO), the policy's and the reference's log-probabilities [rows, S],
    and each row's advantage [rows]."""
    a = advantages[:, None]
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - g.epsilon, 1 + g.clip_high)
    loss = -jnp.minimum(ratio * a, clipped * a)
    low = (ratio < 1 - g.epsilon) & (a < 0)
    high = (ratio > 1 + g.clip_high) & (a > 0)
    kl = None
    if g.beta:
        kl = jnp.exp(ref - logp) - (ref - logp) - 1
        kl = kl * ratio if g.kl_correction else kl
        loss = loss + g.beta * kl
    return loss, (low, high), kl


def copied(problem: Problem, g: Grpo, adapter: Adapter) -> list[str]:
    """The trained leaves the reference keeps a copy of (grpo.beta > 0): all of them, or
    none where it is the base with fresh adapters (their start is zero: adapters off)."""
    if not g.beta or reference.fresh_adapters(adapter):
        return []
    return reference.trained_keys(problem)


def objective(problem: Problem, g: Grpo, adapter: Adapter) -> Problem:
    """`problem` (a registered model, adapters on it or not) trained by GRPO on rollout
    rows (the module's docstring). The reference's copy (`copied`) is held beside the
    policy as DPO holds it (jaxpar.objectives.reference), and read by the rollouts alone."""
    copies = copied(problem, g, adapter)
    policy = reference.policy

    def finish(losses, batch):
        mask = documents.target_weights(batch).astype(jnp.float32)
        logp = -losses.astype(jnp.float32)
        old = sequence.local(batch[OLD]) if OLD in batch else jax.lax.stop_gradient(logp)
        ref = sequence.local(batch[REF]) if REF in batch else None
        log_ratio, weights = logp - old, mask
        if g.loss in (GrpoLoss.GRPO, GrpoLoss.GSPO):  # a completion's targets weigh 1 / its length
            weights = mask / jnp.maximum(_row_sum(mask), 1.0)
        if g.loss is GrpoLoss.GSPO:  # one ratio a completion: its targets' mean log-ratio
            log_ratio = _row_sum(log_ratio * weights)
        loss, clips, kl = token_losses(log_ratio, logp, ref, batch[ADVANTAGES], g)
        # TRL's clip ratios: token means, or with GSPO completion means
        _report(mask, weights if g.loss is GrpoLoss.GSPO else mask, clips, kl)
        return loss * weights

    def count(batch):
        rows = jnp.float32(batch["tokens"].shape[0])
        if g.loss is GrpoLoss.DAPO:
            return documents.trained_targets(batch)
        return rows * g.max_new_tokens if g.loss is GrpoLoss.DR_GRPO else rows

    parts = problem.parts
    if parts is not None:
        inner = parts.post
        parts = dataclasses.replace(
            parts,
            post=lambda params, h, batch: finish(inner(params, h, batch), batch),
            stack_keys=reference.stack_keys(parts, copies),
        )
    return reference.with_copy(
        problem,
        copies,
        loss=lambda params, batch: finish(problem.loss(policy(params), batch), batch),
        parts=parts,
        count=count,
    )


def _row_sum(x):
    """[rows, 1]: each row's sum over its targets (all of its context shards')."""
    total = jnp.sum(x, -1, keepdims=True)
    return total if sequence.active() is None else jax.lax.psum(total, CONTEXT)


def _report(mask, clip_weights, clips, kl) -> None:
    """TRL's metrics over the whole batch: the KL's token mean, the clip ratios' mean
    weighed by `clip_weights` (the mask: over tokens; 1 / length: over completions)."""

    def mean(x, weights):
        total = jnp.maximum(batch_sum(jnp.sum(weights)), 1e-30)
        return batch_sum(jnp.sum(jnp.where(weights > 0, x * weights, 0.0))) / total

    low, high = (c.astype(jnp.float32) for c in clips)
    report("clip_ratio/low_mean", mean(low, clip_weights))
    report("clip_ratio/high_mean", mean(high, clip_weights))
    report("clip_ratio/region_mean", mean(jnp.maximum(low, high), clip_weights))
    if kl is not None:
        report("kl", mean(jax.lax.stop_gradient(kl), mask))


# -- the plug-in (jaxpar.objectives) ----------------------------------------------------


def check(grpo: Grpo, train: Train, checkpoint: Checkpoint) -> None:
    g, every = grpo, checkpoint.every
    if train.eval_every:
        raise ConfigError(
            f"train.eval_every={train.eval_every}: train.objective=grpo has no held-out "
            "loss (its measure is the rollouts' reward, in metrics.jsonl); give "
            "train.eval_every=0"
        )
    if train.on_spike is OnSpike.ROLLBACK:
        raise ConfigError(
            "train.on_spike=rollback: a GRPO step's rollouts came from the policy a rollback "
            "would return from, so train.objective=grpo cannot roll back; use "
            "train.on_spike=skip (the spiking update is not applied)"
        )
    if g.staleness and g.iterations > 1:
        raise ConfigError(
            f"grpo.staleness={g.staleness}: a stale rollout's ratio is taken against its "
            f"sampler's log-probabilities, which grpo.iterations={g.iterations} also stores for "
            "its own steps; give grpo.iterations=1 with staleness, or grpo.staleness=0"
        )
    if g.staleness >= train.steps:
        raise ConfigError(
            f"grpo.staleness={g.staleness}: a run of train.steps={train.steps} would train "
            "on the start's rollouts alone; give grpo.staleness < train.steps"
        )
    if every % g.iterations:
        raise ConfigError(
            f"checkpoint.every={every}: a GRPO run saves between rollouts, each grpo.iterations="
            f"{g.iterations} steps, so that a resume samples them again; give a multiple of "
            f"{g.iterations}"
        )


def problem(own: Problem, grpo: Grpo, adapter: Adapter) -> Problem:
    return objective(own, grpo, adapter)


def trained_on(devices: list, grpo: Grpo) -> list:
    """The devices the trainer's mesh takes: all but grpo.rollout_devices' first N."""
    n = grpo.rollout_devices
    if n and n >= len(devices):
        raise ConfigError(
            f"grpo.rollout_devices={n}: the run has {len(devices)} devices and the trainer "
            f"needs some; give 1 to {len(devices) - 1}, or 0 to roll out on the trainer's"
        )
    return devices[n:]


def batches(own: Problem, split: str, mesh_shape, devices=None, *, config: Config):
    """The rollouts: each its rows, made before their steps (a hook too); no held-out
    split (check refuses train.eval_every). With grpo.rollout_devices they are made on
    the first N of `devices` (default: all), the trainer's mesh on the rest."""
    if split != "train":
        return None
    n = config.grpo.rollout_devices
    generators = list(jax.devices() if devices is None else devices)[:n] if n else None
    return Rollouts(config, own, n or math.prod(mesh_shape.values()), generators)


def hooks(batches) -> tuple:
    return (batches,)
