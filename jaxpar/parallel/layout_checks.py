"""The rules across sections and against the mesh that every run must meet, whatever
the model (its own dims against the mesh are its registry entry's `check`): checked
before a step is compiled, by `jaxpar train` and the Python API alike, and by the
planner for each layout it considers."""

from __future__ import annotations

import dataclasses
import warnings

from jaxpar.config.options import default_of
from jaxpar.config.sections import (
    Adapter,
    AdapterKind,
    Config,
    DpCollective,
    DpSync,
    Model,
    Muon,
    Offload,
    Optimizer,
    Parallel,
    Remat,
    Schedule,
    Train,
    given,
)
from jaxpar.errors import ConfigError
from jaxpar.parallel import context
from jaxpar.parallel.axes import CONTEXT, EXPERT, PIPE, REPLICA
from jaxpar.parallel.batches import batch_split
from jaxpar.parallel.schedules import TICKED


def _check_adapter(adapter: Adapter, par: Parallel) -> None:
    if adapter.kind is AdapterKind.NONE:
        default = Adapter()
        changed = [
            f"adapter.{f.name}={getattr(adapter, f.name)}"
            for f in dataclasses.fields(Adapter)
            if getattr(adapter, f.name) != getattr(default, f.name)
        ]
        if changed:
            raise ConfigError(
                f"{changed[0]} shapes adapters, and adapter.kind=none trains every weight: "
                "set adapter.kind=lora, or drop the key"
            )
        return
    if adapter.dropout:
        raise ConfigError(
            f"adapter.dropout={adapter.dropout:g}: jaxpar adds each adapter into its weight "
            "as the layer is made ready (so that every layout runs it), where dropout on an "
            "adapter's input has no place; use adapter.dropout=0"
        )
    if par.dp_sync is DpSync.PARAMS:
        raise ConfigError(
            "adapter.kind=lora with parallel.dp_sync=params: averaging copies of the "
            "parameters is not built for adapters; use parallel.dp_sync=grads"
        )


def _check_muon(train: Train, muon: Muon) -> None:
    """muon.* keys tune Muon only: set for another optimizer, they are refused."""
    default = Muon()
    if train.optimizer is Optimizer.MUON or muon == default:
        return
    changed = [
        f"muon.{f.name}={getattr(muon, f.name)}"
        for f in dataclasses.fields(muon)
        if getattr(muon, f.name) != getattr(default, f.name)
    ]
    if changed:
        raise ConfigError(
            f"{', '.join(changed)} with train.optimizer={train.optimizer}: the muon.* keys "
            "tune Muon only; set train.optimizer=muon, or drop them"
        )


def _check_qk_clip(muon: Muon, adapter: AdapterKind) -> None:
    """muon.qk_clip where it has weights to scale: not with adapters, which leave the
    query and key weights frozen."""
    if muon.qk_clip and adapter is not AdapterKind.NONE:
        raise ConfigError(
            f"muon.qk_clip={muon.qk_clip:g} with adapter.kind={adapter}: QK-clip scales the "
            "query and key weights, which the adapters leave frozen; use adapter.kind=none, "
            "or drop muon.qk_clip"
        )


def check_train(cfg: Config, mesh_shape: dict) -> None:
    """The last release's form of `check` (jaxpar.mesh_rules.check_train), which took the
    whole config; it goes in jaxpar 0.3.0."""
    warnings.warn(
        "check_train(cfg, mesh_shape) is now check(mesh_shape, parallel=..., train=..., "
        "model=..., adapter=..., muon=...), the sections it reads; "
        "jaxpar.config.sections.given(check, cfg, mesh_shape) hands them (check_train goes "
        "in jaxpar 0.3.0)",
        DeprecationWarning,
        stacklevel=2,
    )
    given(check, cfg, mesh_shape)


def check(
    mesh_shape: dict,
    *,
    parallel: Parallel,
    train: Train,
    model: Model,
    adapter: Adapter,
    muon: Muon,
) -> None:
    """The rules every run's layout meets, whatever the model: the batch's arithmetic, and
    the axes' and the sections' rules against each other."""
    batch_split(train, parallel, mesh_shape)
    context.check(parallel, mesh_shape, train.seq_len, model.heads)
    if parallel.offload is Offload.OPTIMIZER_PARAMS and parallel.zero != 3:
        raise ConfigError(
            f"parallel.offload=optimizer+params with parallel.zero={parallel.zero}: only "
            "ZeRO-3 stores parameter shards that a layer can fetch when it runs; below "
            "stage 3 every device needs all parameters. Use parallel.zero=3, or "
            "parallel.offload=optimizer"
        )
    pipelined = mesh_shape[PIPE] > 1
    _check_adapter(adapter, parallel)
    _check_muon(train, muon)
    _check_qk_clip(muon, adapter.kind)
    _check_dp_sync(parallel, mesh_shape)
    _check_expert(model, mesh_shape)
    if pipelined and parallel.offload is Offload.OPTIMIZER_PARAMS:
        raise ConfigError(
            f"parallel.offload=optimizer+params with parallel.pipeline={mesh_shape[PIPE]}: "
            "not supported; JAX refuses the gradient of host-resident stage parameters "
            "inside the pipeline loop (float32<host> expected, float32 got). Use "
            "parallel.offload=optimizer with a pipeline, or parallel.pipeline=1"
        )
    if parallel.microbatches > 1 and not pipelined:
        raise ConfigError(
            f"parallel.microbatches={parallel.microbatches} needs parallel.pipeline > 1; "
            "to accumulate gradients over micro-batches without a pipeline use train.grad_accum"
        )
    ticked = parallel.schedule in TICKED
    if pipelined and ticked and parallel.remat is Remat.OFFLOAD:
        raise ConfigError(
            f"parallel.remat=offload with parallel.schedule={parallel.schedule}: it "
            "already keeps only each stage's input per micro-batch and recomputes the "
            "layers in the backward pass, so there are no saved layer inputs to send to "
            "the host; use schedule=gpipe or interleaved with remat=offload, or remat=none "
            f"with {parallel.schedule}"
        )
    interleaved = parallel.schedule is Schedule.INTERLEAVED
    if (parallel.virtual_stages > 1 or interleaved) and not pipelined:
        raise ConfigError(
            f"parallel.schedule={parallel.schedule} with parallel.virtual_stages="
            f"{parallel.virtual_stages} needs parallel.pipeline > 1 (it is "
            f"{mesh_shape[PIPE]}): virtual stages are chunks of a pipeline's layers; set "
            "parallel.pipeline, or drop the schedule and virtual stages"
        )
    if (parallel.virtual_stages > 1) != interleaved and pipelined:
        raise ConfigError(
            f"parallel.schedule={parallel.schedule} with parallel.virtual_stages="
            f"{parallel.virtual_stages}: virtual stages (2 or more) go with "
            "schedule=interleaved, and only with it"
        )
    p, m = mesh_shape[PIPE], parallel.microbatches
    if pipelined and interleaved and m % p:
        raise ConfigError(
            f"parallel.microbatches={m} is not a multiple of parallel.pipeline={p}: the "
            "interleaved schedule sends micro-batches round the stages in groups of "
            f"{p}; use {p * max(1, m // p)} or {p * (m // p + 1)}"
        )
    if pipelined and parallel.schedule is Schedule.DUALPIPEV and m < 2 * p:
        raise ConfigError(
            f"parallel.microbatches={m} with parallel.schedule=dualpipev and "
            f"parallel.pipeline={p}: DualPipeV fills its V from both chunks and needs "
            f"2 x pipeline = {2 * p} micro-batches or more; use parallel.microbatches="
            f"{2 * p}, or parallel.schedule=zbv"
        )


def _check_expert(model: Model, mesh_shape: dict) -> None:
    """The `expert` axis splits a mixture's experts (model.experts), evenly."""
    x, experts = mesh_shape.get(EXPERT, 1), getattr(model, "experts", 0)
    if x == 1:
        return
    if not experts:
        raise ConfigError(
            f"parallel.expert={x} splits a mixture's experts; model.name={model.name} has "
            "none (model.experts=0): put those devices on parallel.data, or train a mixture "
            "(model.name=mixtral with model.experts)"
        )
    if experts % x:
        raise ConfigError(
            f"model.experts={experts} is not divisible by parallel.expert={x}: each expert "
            f"device holds an equal share of the experts; choose a degree dividing {experts}"
        )


def _check_dp_sync(parallel: Parallel, mesh_shape: dict) -> None:
    """Parameter averaging runs a whole model and optimizer per data-parallel device; a
    gradient server sums on one device, which ZeRO would split."""
    if parallel.dp_collective is DpCollective.SERVER and parallel.zero:
        raise ConfigError(
            f"parallel.dp_collective=server with parallel.zero={parallel.zero}: a gradient "
            "server sums everything on one device, which is what ZeRO avoids (it splits the "
            "optimizer state and the reduction over all devices); use parallel.zero=0 with "
            "server, or dp_collective=ring or xla with ZeRO"
        )
    if parallel.dp_sync is DpSync.GRADS:
        for key in ("sync_every", "outer_lr", "outer_momentum"):
            value, default = getattr(parallel, key), default_of(Parallel.__dataclass_fields__[key])
            if value != default:
                raise ConfigError(
                    f"parallel.{key}={value:g} has an effect only with parallel.dp_sync=params "
                    f"(it is grads); set parallel.dp_sync=params, or drop parallel.{key}"
                )
        return
    why = {
        "parallel.zero": (
            parallel.zero != 0,
            "ZeRO splits the optimizer state (and more) over data, but each device's local "
            "steps need a whole model and optimizer state of its own; use parallel.zero=0",
        ),
        "parallel.pipeline": (
            mesh_shape[PIPE] > 1,
            "a pipeline's stages step together on one model, not as copies of it; use "
            "parallel.pipeline=1 (tensor parallelism is fine)",
        ),
        "parallel.expert": (
            mesh_shape.get(EXPERT, 1) > 1,
            "each device's local steps need every expert of its own; use parallel.expert=1",
        ),
        "parallel.context": (
            mesh_shape.get(CONTEXT, 1) > 1,
            "each device's local steps need whole sequences of its own; use parallel.context=1",
        ),
        "parallel.replica": (
            mesh_shape.get(REPLICA, 1) > 1,
            "replicas split ZeRO groups, and averaging has none: it averages over every "
            "data-parallel device; put them all on parallel.data",
        ),
        "parallel.offload": (
            parallel.offload is not Offload.NONE,
            "each device's own optimizer state stays on the device; use parallel.offload=none",
        ),
        "parallel.dp_collective": (
            parallel.dp_collective is not DpCollective.XLA,
            "the average is one compiler-placed all-reduce; ring and server reduce "
            "gradients; use parallel.dp_collective=xla",
        ),
    }
    for key, (bad, reason) in why.items():
        if bad:
            value = mesh_shape.get(key.split(".")[1], getattr(parallel, key.split(".")[1]))
            raise ConfigError(f"parallel.dp_sync=params with {key}={value}: {reason}")
