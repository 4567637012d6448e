"""Elastic restarts (`jaxpar launch --max-restarts N`, whose launcher,
jaxpar.parallel.distributed, finds the workers lost): the layout a `jaxpar train` run
shrinks to on the processes left, and the restarts' table.

The rule, on the devices of the processes left (each keeps its devices):
- tensor, pipeline, context and expert keep their degrees: they split the model, and a
  checkpoint restores into any of them, but their groups sit inside a host;
- the data-parallel copies (replica x data) take the devices left; replica keeps the
  largest degree, at most its own, that divides them, and data takes the rest;
- train.batch_size is kept: train.grad_accum rises until the rows a device takes per
  accumulation step are no more than before (its memory holds), and the batch divides;
- where no layout fits every process left (the batch or a ZeRO split does not divide),
  one process fewer is tried, down to --min-processes; the processes left out idle.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax

from jaxpar.config import registry
from jaxpar.config.sections import Adapter, Model, Muon, Parallel, Train
from jaxpar.cost import report
from jaxpar.errors import ConfigError
from jaxpar.nn import staging
from jaxpar.nn.problem import registered
from jaxpar.parallel import layout_checks
from jaxpar.parallel.axes import AXES, CONTEXT, DATA, EXPERT, PIPE, REPLICA, TENSOR
from jaxpar.parallel.mesh import resolve_degrees
from jaxpar.parallel.sharding import plan

KEPT = (EXPERT, PIPE, CONTEXT, TENSOR)


@dataclass(frozen=True)
class Shrunk:
    processes: int
    overrides: tuple[str, ...]  # for the train command, in place of its own
    layout: str  # the degrees on them, in words
    said: str  # the layout before and after, in words


def degrees_of(mesh: dict) -> str:
    shown = [f"{a}={mesh[a]}" for a in AXES if mesh[a] > 1]
    return " x ".join(shown) or "one device"


def shrink(
    before: int,
    left: int,
    per_process: int,
    least: int,
    *,
    parallel: Parallel,
    train: Train,
    model: Model,
    adapter: Adapter,
    muon: Muon,
) -> Shrunk:
    """The layout of a run's `parallel` (run on `before` processes of `per_process` devices
    each) on `left` processes, or on the most of fewer, down to `least`, that it fits (the
    rule above; its other sections as the run has them).
    ConfigError naming why none fits."""
    old = resolve_degrees(parallel, before * per_process)
    kept = math.prod(old[a] for a in KEPT)
    micro = train.batch_size // (old[REPLICA] * old[DATA] * train.grad_accum)
    why = []
    for processes in range(left, least - 1, -1):
        devices = processes * per_process
        if devices % kept:
            why.append(f"{processes} processes: {kept} does not divide {devices} devices")
            continue
        copies = devices // kept
        replica = max(r for r in range(1, old[REPLICA] + 1) if copies % r == 0)
        mesh = {**old, REPLICA: replica, DATA: copies // replica}
        accum = _accumulation(train, copies, micro)
        if accum is None:
            why.append(
                f"{degrees_of(mesh)}: train.batch_size={train.batch_size} is not a "
                f"multiple of {copies}"
            )
            continue
        par = dataclasses.replace(parallel, replica=replica, data=copies // replica)
        try:
            fits(mesh, parallel=par, train=dataclasses.replace(train, grad_accum=accum),
                 model=model, adapter=adapter, muon=muon)  # fmt: skip
        except ConfigError as e:
            why.append(f"{degrees_of(mesh)}: {_gist(str(e))}")
            continue
        said = (
            f"{degrees_of(old)} -> {degrees_of(mesh)} on {processes} of the {left} processes "
            f"left; train.batch_size={train.batch_size} kept with train.grad_accum "
            f"{train.grad_accum} -> {accum}"
        )
        if why:
            said += f" (not {why[0]})"
        overrides = (f"parallel.replica={replica}", f"parallel.data={copies // replica}",
                     f"train.grad_accum={accum}")  # fmt: skip
        return Shrunk(processes, overrides, degrees_of(mesh), said)
    raise ConfigError(
        f"elastic restart: no layout of {degrees_of(old)} fits on {least} to {left} "
        f"processes of {per_process} devices: {'; '.join(why)}. Lower --min-processes, or "
        "choose a train.batch_size with more divisors"
    )


def _gist(message: str) -> str:
    """An error's first sentence without its parenthesised detail."""
    while (shorter := re.sub(r"\s*\([^()]*\)", "", message)) != message:
        message = shorter
    return message.split(". ")[0]


def _accumulation(train, copies: int, micro: int) -> int | None:
    """The least train.grad_accum (at least the run's) that splits the batch over
    `copies` in accumulation steps of at most `micro` rows per copy; None if none does."""
    for accum in range(train.grad_accum, train.batch_size + 1):
        rows, left = divmod(train.batch_size, copies * accum)
        if not left and rows <= micro:
            return accum
    return None


def fits(
    mesh: dict, *, parallel: Parallel, train: Train, model: Model, adapter: Adapter, muon: Muon
) -> None:
    """The checks a worker makes of a layout before it compiles anything: the model's,
    the batch's and ZeRO's split (ConfigError)."""
    registry.check_model(model, mesh)
    layout_checks.check(
        mesh, parallel=parallel, train=train, model=model, adapter=adapter, muon=muon
    )
    if parallel.zero:
        problem = staging.in_stages(registered(model, train.seq_len), mesh[PIPE])
        shapes = jax.tree.map(lambda s: s.shape, problem.shapes)
        plan(problem.names, shapes, zero=parallel.zero, mesh_shape=mesh)


def replaced(argv: list[str], overrides: tuple[str, ...]) -> list[str]:
    """The train command with `overrides` in place of its own settings of those keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [w for w in argv if w.split("=", 1)[0] not in keys] + list(overrides)


@dataclass(frozen=True)
class Restarts:
    """`jaxpar launch --max-restarts most --min-processes least`, as the launcher
    (jaxpar.parallel.distributed) asks it: `shrink(before, left)` the layout on the
    processes left (None: a script or a command it cannot change, restarted as it was)."""

    most: int
    least: int
    shrink: Callable[[int, int], Shrunk] | None

    def next(self, before: int, left: int, argv: list[str]) -> tuple[Shrunk, list[str]]:
        """The layout after losing processes, and the command that trains in it."""
        if left < self.least:
            raise ConfigError(f"{left} processes left, fewer than --min-processes {self.least}")
        if self.shrink is None:
            said = f"the command as it was, on {left} processes"
            return Shrunk(left, (), "as it was", said), argv
        shrunk = self.shrink(before, left)
        return shrunk, replaced(argv, shrunk.overrides)

    @staticmethod
    def table(restarts: list, startup_s: float | None) -> str:
        """The launch's restarts: each one's cause, layout and recovery time (death to the
        first step after it) against the run's own start-up (launch to its first step)."""
        start = "-" if startup_s is None else f"{startup_s:.1f}"
        rows = [
            [
                str(k),
                r.cause,
                f"{r.before} -> {r.processes}",
                r.layout,
                r.resumed,
                "-" if r.recovered_at is None else f"{r.recovered_at - r.died_at:.1f}",
                start,
            ]
            for k, r in enumerate(restarts, 1)
        ]
        header = ["restart", "cause", "processes", "layout", "resumed", "recovery s", "start-up s"]
        return report.table(rows, header)
