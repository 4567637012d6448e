"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath), with DAPO's and
Dr. GRPO's losses, as a Problem over rollout rows (jaxpar.generation.rollouts makes them).

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
- dr_grpo: the sum over tokens / (completions x grpo.max_new_tokens).

The log-probabilities are the model's own (temperature 1); TRL divides the logits by the
sampling temperature first, so the two agree at grpo.temperature=1. The step reports
TRL's kl and clip_ratio/* (token means over the batch).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.sections import AdapterKind, Config, Grpo, GrpoLoss
from jaxpar.nn import documents, sequence
from jaxpar.nn.layers import batch_sum
from jaxpar.nn.problem import Problem
from jaxpar.nn.scope import report
from jaxpar.objectives import dpo
from jaxpar.parallel.axes import CONTEXT

ADVANTAGES, OLD, REF = "advantages", "old_logps", "ref_logps"
PAD_ID = 0
STD_EPSILON = 1e-4  # added to a group's std before dividing by it (TRL's)


def token_losses(logp, old, ref, advantages, g: Grpo):
    """([rows, S] each target's loss, its clip flags (low, high), its k3 KL or None), from
    the policy's, the sampler's and the reference's log-probabilities [rows, S] and each
    row's advantage [rows]."""
    a = advantages[:, None]
    ratio = jnp.exp(logp - old)
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


def copied(problem: Problem, cfg: Config) -> list[str]:
    """The trained leaves the reference keeps a copy of (grpo.beta > 0): all of them, or
    none where it is the base with fresh adapters (their start is zero: adapters off)."""
    fresh = cfg.adapter.kind is AdapterKind.LORA and not cfg.adapter.init
    if not cfg.grpo.beta or fresh:
        return []
    return [k for k in problem.names if k not in problem.frozen]


def objective(problem: Problem, cfg: Config) -> Problem:
    """`problem` (a registered model, adapters on it or not) trained by GRPO on rollout
    rows (the module's docstring). The reference's copy (`copied`) is held beside the
    policy as DPO holds it, under dpo.COPY keys, and read by the rollouts alone."""
    g = cfg.grpo
    copies = copied(problem, cfg)

    def policy(params):
        return {k: v for k, v in params.items() if not k.startswith(dpo.COPY)}

    def finish(losses, batch):
        mask = documents.target_weights(batch).astype(jnp.float32)
        logp = -losses.astype(jnp.float32)
        old = sequence.local(batch[OLD]) if OLD in batch else jax.lax.stop_gradient(logp)
        ref = sequence.local(batch[REF]) if REF in batch else None
        loss, clips, kl = token_losses(logp, old, ref, batch[ADVANTAGES], g)
        _report(mask, clips, kl)
        if g.loss is GrpoLoss.GRPO:  # each completion's tokens weigh 1 / its length
            length = jnp.sum(mask, -1, keepdims=True)
            if sequence.active() is not None:
                length = jax.lax.psum(length, CONTEXT)
            mask = mask / jnp.maximum(length, 1.0)
        return loss * mask

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
            stack_keys=parts.stack_keys
            + tuple(dpo.COPY + k for k in copies if k in parts.stack_keys),
        )
    return dataclasses.replace(
        problem,
        init=dpo.with_copies(problem.init, copies),
        shapes={**problem.shapes, **{dpo.COPY + k: problem.shapes[k] for k in copies}},
        names={**problem.names, **{dpo.COPY + k: problem.names[k] for k in copies}},
        loss=lambda params, batch: finish(problem.loss(policy(params), batch), batch),
        parts=parts,
        module=None,
        count=count,
        frozen=problem.frozen | {dpo.COPY + k for k in copies},
        reference=frozenset(dpo.COPY + k for k in copies),
    )


def _report(mask, clips, kl) -> None:
    """TRL's metrics: token means over the whole batch."""
    tokens = jnp.maximum(batch_sum(jnp.sum(mask)), 1.0)

    def mean(x):
        return batch_sum(jnp.sum(jnp.where(mask > 0, x, 0.0))) / tokens

    low, high = (c.astype(jnp.float32) for c in clips)
    report("clip_ratio/low_mean", mean(low))
    report("clip_ratio/high_mean", mean(high))
    report("clip_ratio/region_mean", mean(jnp.maximum(low, high)))
    if kl is not None:
        report("kl", mean(jax.lax.stop_gradient(kl)))


def advantages(rewards_PxG: np.ndarray, scaled: bool) -> np.ndarray:
    """[P x G] each completion's reward less its group's mean, over the group's std
    (TRL's: Bessel-corrected, + 1e-4) where `scaled`; flattened prompt-major."""
    r = np.asarray(rewards_PxG, np.float64)
    out = r - r.mean(axis=1, keepdims=True)
    if scaled:
        out = out / (r.std(axis=1, ddof=1, keepdims=True) + STD_EPSILON)
    return out.reshape(-1).astype(np.float32)


def rows_of(prompts: list[list[int]], completions: list[list[int]], seq_len: int) -> dict:
    """`tokens` [rows, seq_len + 1] (each prompt, its completion, padding) and `loss_mask`
    (1 at each completion id), one row per (prompt, completion)."""
    n = len(prompts)
    tokens = np.full((n, seq_len + 1), PAD_ID, np.int32)
    mask = np.zeros((n, seq_len + 1), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p) + len(c)] = p + c
        mask[i, len(p) : len(p) + len(c)] = 1
    return {"tokens": tokens, "loss_mask": mask}
