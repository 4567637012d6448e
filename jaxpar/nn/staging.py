"""What is trained, as a pipeline holds it: the stage assignment of a Problem's layer
stack (jaxpar.parallel.pipeline.assign), and the Problem with that stack in pipeline
layout ([stage, slots, ...], logical names `stage`, `layers`) and back."""

from __future__ import annotations

from dataclasses import replace

import jax

from jaxpar.config.sections import Schedule
from jaxpar.errors import ConfigError
from jaxpar.names import LAYERS, STAGE
from jaxpar.nn.problem import Problem
from jaxpar.parallel.pipeline import Layout, assign, from_stages, to_stages
from jaxpar.parallel.schedules import SPLIT, V_SHAPED


def layout_for(
    problem: Problem, stages: int, virtual: int, schedule: Schedule | None = None
) -> Layout | None:
    """The stage assignment of `problem`'s layer stack (None without a pipeline), for
    `schedule` (None: any that needs no more than the stack)."""
    if stages == 1:
        return None
    if problem.parts is None:
        raise ConfigError(
            f"parallel.pipeline={stages}: this model has no pipeline stages; build it with "
            "jaxpar.from_nnx(..., stages=jaxpar.Stages(...)), or use parallel.pipeline=1"
        )
    if schedule in SPLIT and problem.parts.layer is None:
        raise ConfigError(
            f"parallel.schedule={schedule} with parallel.pipeline={stages}: this model's "
            "Parts has no `layer` (one layer's function), which the split backward "
            "differentiates a layer at a time; build it with jaxpar.from_nnx, give "
            "Parts(layer=...), or use parallel.schedule=1f1b"
        )
    layers = problem.shapes[problem.parts.stack_keys[0]].shape[0]
    vee = schedule in V_SHAPED  # two chunks a device, in a V
    if vee and 2 * stages > layers:
        raise ConfigError(
            f"parallel.schedule={schedule} with parallel.pipeline={stages} cuts the layers "
            f"in {2 * stages} chunks (two a device, in a V) but the model has {layers}; use "
            f"parallel.pipeline={max(1, layers // 2)} or less, or parallel.schedule=zb-h1"
        )
    return assign(layers, stages, 2 if vee else virtual, problem.parts.costs, vee)


def in_stages(problem: Problem, stages: int, virtual: int = 1) -> Problem:
    """The problem as a `stages`-device pipeline trains it (itself for one stage)."""
    layout = layout_for(problem, stages, virtual)
    return staged(problem, layout) if layout else problem


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
