"""The reference a preference or RL objective scores the policy against, in one home for
DPO, GRPO, GRPO's rollouts and the run's start:

- a copy: the trained leaves at the start, frozen, under COPY keys beside them (stored
  like the policy's, in the same placement and ZeRO stage; an adapter run copies its
  adapters only and shares the base);
- adapters off: a run of fresh adapters (they start at zero) has its base as its
  reference, with no copy;
- precomputed: log-probabilities read from the batch (jaxpar.objectives.precompute).

A Problem with a copy (`with_copy`) lists the copy's keys as its `reference` (frozen,
never trained, and left out of the trained model's parameters)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.config.sections import Adapter, AdapterKind
from jaxpar.nn.problem import Problem

COPY = "reference/"  # the keys of the reference's copy of a trained leaf


def fresh_adapters(adapter: Adapter) -> bool:
    """An adapter run from fresh adapters: its start is its base with the adapters off."""
    return adapter.kind is AdapterKind.LORA and not adapter.init


def trained_keys(problem: Problem) -> list[str]:
    """The leaves a copy holds: every trained one."""
    return [k for k in problem.names if k not in problem.frozen]


def policy(params: dict) -> dict:
    """The policy's leaves of `params` (any part of them), without the reference's copy."""
    return {k: v for k, v in params.items() if not k.startswith(COPY)}


def held(problem: Problem, copied: list[str]):
    """params -> the reference's leaves (of any part of the params: a stage's stack): the
    frozen ones, and the copy of each trained one (no gradient)."""

    def leaves(params: dict) -> dict:
        out = {k: v for k, v in params.items() if k in problem.frozen}
        out.update({k: params[COPY + k] for k in copied if COPY + k in params})
        return jax.lax.stop_gradient(out)

    return leaves


def read(params: dict, keys) -> dict:
    """The copy held in `params` of each of `keys` (by the policy's keys)."""
    return {k: params[COPY + k] for k in keys if COPY + k in params}


def with_copy(problem: Problem, copied: list[str], **changed) -> Problem:
    """`problem` holding a copy of `copied` at the start, frozen, beside the policy's
    leaves; `changed`: the objective's own fields (its loss, parts, count, ...)."""

    def init(key):
        params = problem.init(key)
        return {**params, **{COPY + k: params[k] for k in copied}}

    return dataclasses.replace(
        problem,
        init=init,
        shapes={**problem.shapes, **{COPY + k: problem.shapes[k] for k in copied}},
        names={**problem.names, **{COPY + k: problem.names[k] for k in copied}},
        module=None,
        frozen=problem.frozen | {COPY + k for k in copied},
        reference=frozenset(COPY + k for k in copied),
        **changed,
    )


def stack_keys(parts, copied: list[str]) -> tuple[str, ...]:
    """A pipeline's layer-stack keys, the copies of stacked leaves among them."""
    return parts.stack_keys + tuple(COPY + k for k in copied if k in parts.stack_keys)


def copies(params, copied_keys):
    """`params` (targets -> arrays, as jaxpar.train takes them) with the reference's
    copies of `copied_keys` made beside the policy's leaves."""

    def made(targets):
        own = params({k: v for k, v in targets.items() if not k.startswith(COPY)})
        placed = {COPY + k: targets[COPY + k].sharding for k in copied_keys}
        copy = jax.jit(lambda x: {COPY + k: jnp.copy(x[k]) for k in copied_keys},
                       out_shardings=placed)  # fmt: skip
        return {**own, **copy(own)}

    return made
