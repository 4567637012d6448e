"""The jitted train step: accumulation, precision, ZeRO reductions, clipping, AdamW.

Forward/backward runs inside a shard_map that is manual over `data` (the other
axes stay with the compiler, which splits the model per the rules), so each device
holds its local gradient and the data-parallel reduction is placed by hand:
ZeRO 0 all-reduces once per step; ZeRO 1 reduce-scatters once per step; ZeRO 2
reduce-scatters each micro-batch into a sharded accumulator; ZeRO 3 gathers
parameters layer by layer and gets reduce-scattered gradients as their transpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import collectives, dp, offload, pipeline
from jaxpar.config import Config, ConfigError
from jaxpar.layers import Placement, placing
from jaxpar.problem import Problem
from jaxpar.sharding import LAYERS, RULES, STAGE, LeafSpecs, named, only_axes, pick, plan, zero_dim

DATA = "data"
PIPE = "pipeline"
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclass(frozen=True)
class Engine:
    """Everything built for one (problem, config, mesh): specs, shardings, jitted functions."""

    mesh: Mesh
    specs: Any  # params pytree of LeafSpecs
    state_shardings: Any
    batch_sharding: Any
    init: Any  # jitted: key -> state, created directly in its sharding
    step: Any  # jitted: (state, batch) -> (state, metrics); state is donated
    schedule: Any  # step -> learning rate
    layout: pipeline.Layout | None  # the pipeline's stage assignment (None: no pipeline)
    problem: Problem  # as trained: with a pipeline, its layer stack in pipeline layout

    def export(self, params):
        """Parameters in the model's own layout (the layer stack unstaged)."""
        if self.layout is None:
            return params
        # on the host: offloaded master weights cannot be indexed on the device
        return pipeline.unstaged(self.problem, self.layout, jax.device_get(params))


def _leaves_map(fn, *trees):
    return jax.tree.map(fn, *trees, is_leaf=lambda x: isinstance(x, LeafSpecs))


def optimizer(cfg: Config, names) -> tuple[optax.GradientTransformation, Any]:
    """AdamW with linear warm-up and cosine decay; weight decay on matrices only."""
    t = cfg.train
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        t.lr,
        warmup_steps=t.warmup,
        decay_steps=max(t.steps, t.warmup + 1),
        end_value=t.lr * 0.1,
    )
    # Decay matrices only; the stacking dims (layers, stage) do not make a matrix.
    is_matrix = jax.tree.map(
        lambda n: sum(d not in (LAYERS, STAGE) for d in n) >= 2,
        names,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return optax.adamw(
        schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay, mask=is_matrix
    ), schedule


def _local_grads(problem: Problem, cfg: Config, mesh: Mesh, specs, batch_shape, layout):
    """(params local blocks, batch local rows) -> (global loss, reduced local gradients)."""
    zero, accum = cfg.parallel.zero, cfg.train.grad_accum
    dtype = DTYPES[cfg.train.precision]
    mode = cfg.parallel.dp_collective
    fetch = cfg.parallel.offload == "optimizer+params"  # parameter shards live on the host
    placement = Placement(
        rules=RULES,
        mesh_shape=dict(mesh.shape),
        zero=zero,
        remat=cfg.parallel.remat,
        ring=mode == "ring",
        fetch=fetch,
    )
    per_mb = jax.tree.map(
        lambda s: (s.shape[0] // (mesh.shape[DATA] * accum),) + s.shape[1:], batch_shape
    )

    def prepare(x, s: LeafSpecs, names):
        """Master parameter -> what the forward pass reads (compute dtype, ZeRO-3 gathered)."""
        x = x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        dim = zero_dim(s)
        if problem.per_layer_gather and LAYERS in names:
            return x  # layer stacks are fetched and gathered a layer at a time by scan_layers
        x = jax.device_put(x, jax.memory.Space.Device) if fetch else x
        if zero < 3 or dim is None:
            return x
        return collectives.gather(x, dim, s.compute, ring=mode == "ring")

    def prepared(params):
        return jax.tree.map(
            prepare, params, specs, problem.names, is_leaf=lambda x: isinstance(x, LeafSpecs)
        )

    def losses(params, mb):
        with placing(placement):
            if layout is None:
                return problem.loss(prepared(params), mb, specs)
            p, parts = prepared(params), problem.parts  # the per-example loss shape
            return parts.post(p, parts.pre(p, mb, specs), mb, specs)

    def mb_loss(params, mb, count):
        return jnp.sum(losses(params, mb).astype(jnp.float32)) / count

    pipe = layout and pipeline.Pipe(
        problem, layout, cfg.parallel.schedule, cfg.parallel.microbatches, specs
    )

    def pipelined_loss(params, mb, count):
        with placing(placement):
            return pipeline.circular_loss(pipe, prepared(params), mb, count)

    def one_f_one_b(params, mb, count):
        def prepare_rest(rest):
            return {k: prepare(v, specs[k], problem.names[k]) for k, v in rest.items()}

        def cast(x):
            return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

        with placing(placement):
            return pipeline.one_f_one_b_grads(pipe, params, mb, count, prepare_rest, cast)

    if layout is None:
        grad_fn = jax.value_and_grad(mb_loss)
    elif cfg.parallel.schedule == "1f1b":
        grad_fn = one_f_one_b
    else:
        grad_fn = jax.value_and_grad(pipelined_loss)

    compute = _leaves_map(lambda s: s.compute, specs)
    dims = _leaves_map(zero_dim, specs)

    def reduce(grads, todo):
        return dp.reduce(grads, compute, todo, dims, mode, cfg.parallel.bucket_mb * 2**20)

    # The step's one data-parallel reduction of the accumulated local gradients: ZeRO-0
    # (and leaves ZeRO cannot split) sum; ZeRO-1 accumulated whole gradients and
    # reduce-scatters them now; ZeRO-2/3 slices arrive reduced already.
    final = _leaves_map(
        lambda s: dp.SUM if zero_dim(s) is None else dp.SCATTER if zero == 1 else None, specs
    )
    # ZeRO-2 keeps only a slice of each gradient between micro-batches.
    per_micro_batch = _leaves_map(lambda s: None if zero_dim(s) is None else dp.SCATTER, specs)

    def local(params, batch):
        mbs = jax.tree.map(lambda x, shp: x.reshape((accum,) + shp), batch, per_mb)
        probe = jax.eval_shape(losses, params, jax.tree.map(lambda x: x[0], mbs))
        count = math.prod(probe.shape) * mesh.shape[DATA] * accum  # elements in the global batch

        def body(carry, mb):
            loss, acc = carry
            mb_loss_value, g = grad_fn(params, mb, count)
            if fetch:  # gradients of host-resident shards arrive on the host: accumulate here
                g = jax.device_put(g, jax.memory.Space.Device)
            if zero == 2:
                g = reduce(g, per_micro_batch)
            return (loss + mb_loss_value, jax.tree.map(jnp.add, acc, g)), None

        zeros = jax.tree.map(
            lambda p, s: jnp.zeros(_grad_block_shape(p.shape, s, zero, mesh), jnp.float32),
            params,
            specs,
            is_leaf=lambda x: isinstance(x, LeafSpecs),
        )
        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), mbs)
        if pipe:  # leaves every stage holds got their gradient on one stage
            grads = pipeline.reduce_shared(pipe, grads, specs)
        grads = reduce(grads, final)
        return jax.lax.psum(loss, (DATA, PIPE)), grads

    manual = lambda field: _leaves_map(  # noqa: E731
        lambda s: only_axes(getattr(s, field), (DATA, PIPE)), specs
    )
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(manual("storage"), PartitionSpec(DATA)),
        out_specs=(PartitionSpec(), manual("opt")),
        axis_names={DATA, PIPE},
        check_vma=False,
    )


def _grad_block_shape(shape, s: LeafSpecs, zero: int, mesh: Mesh) -> tuple[int, ...]:
    """A leaf's local gradient accumulator inside the data-manual region: ZeRO-2 keeps
    its slice of the full leaf (ZeRO-3 params, and so their gradients, are slices already)."""
    dim = zero_dim(s)
    if zero != 2 or dim is None:
        return shape
    return tuple(n // mesh.shape[DATA] if d == dim else n for d, n in enumerate(shape))


def build(problem: Problem, cfg: Config, mesh: Mesh) -> Engine:
    layout = None
    if mesh.shape[PIPE] > 1:
        if problem.parts is None:
            raise ConfigError(
                f"parallel.pipeline={mesh.shape[PIPE]}: this model has no pipeline stages; "
                "build it with jaxpar.from_nnx(..., stages=jaxpar.Stages(...)), or use "
                "parallel.pipeline=1"
            )
        layers = problem.shapes[problem.parts.stack_keys[0]].shape[0]
        layout = pipeline.assign(
            layers, mesh.shape[PIPE], cfg.parallel.virtual_stages, problem.parts.costs
        )
        problem = pipeline.staged(problem, layout)
    specs = plan(
        problem.names,
        jax.tree.map(lambda s: s.shape, problem.shapes),
        zero=cfg.parallel.zero,
        mesh_shape=dict(mesh.shape),
    )
    tx, schedule = optimizer(cfg, problem.names)
    param_sh = named(mesh, pick(specs, "storage"))
    opt_sh_of_params = named(mesh, pick(specs, "opt"))
    opt_shapes = jax.eval_shape(tx.init, problem.shapes)
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, sh: sh,
        opt_shapes,
        opt_sh_of_params,
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sh = NamedSharding(mesh, PartitionSpec(DATA))
    dtype = DTYPES[cfg.train.precision]
    offloaded = cfg.parallel.offload != "none"

    def clipped(grads):
        """Global-norm clipping (on sharded gradients: the norm sums over all shards)."""
        # (not optax.tree.norm: its sum starts from a device constant, which the host
        # update of an offloaded optimizer cannot add to)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        if cfg.train.clip_norm > 0:
            scale = jnp.minimum(1.0, cfg.train.clip_norm / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        return grads, grad_norm

    if offloaded:  # master weights and optimizer state on the host, split as ZeRO says
        compute_sh = param_sh if cfg.parallel.offload == "optimizer" else offload.on_host(param_sh)
        state_sh = {
            "step": replicated,
            "params": offload.on_host(opt_sh_of_params),
            "compute": compute_sh,
            "opt": offload.on_host(opt_sh),
        }
        host_update = offload.host_update(tx, dtype, clipped)
    else:
        state_sh = {"step": replicated, "params": param_sh, "opt": opt_sh}

    def init(key):
        params = problem.init(key)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": tx.init(params)}
        if offloaded:  # what the device computes with
            state["compute"] = jax.tree.map(lambda p: p.astype(dtype), params)
        return state

    def train_step(state, batch):
        params = state["compute" if offloaded else "params"]
        grads_fn = _local_grads(
            problem,
            cfg,
            mesh,
            specs,
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch),
            layout,
        )
        loss, grads = grads_fn(params, batch)
        metrics = {"loss": loss, "lr": schedule(state["step"])}
        if offloaded:
            grads = jax.device_put(grads, offload.on_host(opt_sh_of_params))
            master, opt, compute, grad_norm = host_update(grads, state["opt"], state["params"])
            new = {"params": master, "opt": opt, "compute": jax.device_put(compute, compute_sh)}
            metrics["grad_norm"] = jax.device_put(grad_norm, replicated)
            return {"step": state["step"] + 1, **new}, metrics
        grads, metrics["grad_norm"] = clipped(grads)
        params_opt = jax.lax.with_sharding_constraint(params, opt_sh_of_params)
        updates, opt = tx.update(grads, state["opt"], params_opt)
        new_params = jax.lax.with_sharding_constraint(
            optax.apply_updates(params_opt, updates), param_sh
        )
        return {"step": state["step"] + 1, "params": new_params, "opt": opt}, metrics

    return Engine(
        mesh=mesh,
        specs=specs,
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        init=jax.jit(init, out_shardings=state_sh),
        step=jax.jit(
            train_step,
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        ),
        schedule=schedule,
        layout=layout,
        problem=problem,
    )
