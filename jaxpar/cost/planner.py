"""`jaxpar plan`: every parallel layout of a model on N devices, predicted from shapes.

Nothing is allocated or compiled: the model's parameters come from `jax.eval_shape`,
each candidate's state from the real placement plan (`jaxpar.parallel.sharding.plan`) of that
model, its traffic from the ledger's minimum, its compute from the model FLOPs at a
stated share of the device peak, and its activations from Korthikanti et al.'s count
for a transformer layer. Candidates that do not fit are dropped and counted; the rest
are ranked by predicted step time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax

from jaxpar.config import registry
from jaxpar.config.sections import (
    Config,
    ContextStrategy,
    Offload,
    Optimizer,
    Parallel,
    Remat,
    Schedule,
    Train,
)
from jaxpar.cost import blocks, newton_schulz
from jaxpar.cost import formulas as cost
from jaxpar.cost.report import human_bytes, table
from jaxpar.errors import ConfigError
from jaxpar.names import LAYERS
from jaxpar.nn import attention, staging
from jaxpar.nn.problem import loss_elements, registered
from jaxpar.parallel import layout_checks, leaf_layout, pipeline
from jaxpar.parallel.axes import CONTEXT, DATA, EXPERT, PIPE, REPLICA, TENSOR
from jaxpar.parallel.batches import batch_split
from jaxpar.parallel.schedules import SPLIT, TICKED, V_SHAPED
from jaxpar.parallel.sharding import check_tensor_split, tensor_dims
from jaxpar.parallel.sharding import plan as placement

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """'80GB', '80 GiB', '1TB' -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise ConfigError(
            f"{flag} {text}: give a size with a unit, e.g. 80GB or 80GiB (units: "
            f"{', '.join(sorted({u.replace('IB', 'iB') for u in UNITS}))})"
        )
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Machine:
    devices: int
    hosts: int
    device_memory: int
    host_memory: int  # per host
    peak_flops: float  # per device, in the compute dtype
    mfu: float  # the share of peak the model FLOPs reach
    intra_bytes_s: float  # link bandwidth inside a host, per device
    inter_bytes_s: float  # between hosts, per device
    host_bytes_s: float = 25e9  # between a device and its host's memory (offload)

    @property
    def per_host(self) -> int:
        return self.devices // self.hosts

    def overshoot(self, c: Candidate) -> float:
        """How far `c` is from fitting: its device or host bytes over the memory there,
        whichever is the larger share."""
        return max(c.device / self.device_memory, c.host / self.host_memory)


@dataclass(frozen=True)
class Candidate:
    cfg: Config
    mesh: dict
    state: float  # master params + grads + optimizer state on the device, bytes
    model_state: float  # fp32 master params and Adam state, device and host (the ZeRO formula's)
    formula_state: float  # the ZeRO formula's (the ledger's `state_bytes.formula`)
    paper_state: float  # the ZeRO paper's mixed-precision accounting of the same
    minimum: dict  # the textbook minimum by axis (the ledger's `comm.by_axis.*.minimum`)
    activations: float
    gather_temp: float  # ZeRO-3's gathered layer (two in flight)
    # Muon's Newton-Schulz per step: FLOPs and temporaries (after the backward pass, so
    # in place of the activations), per device; zero for another optimizer
    ns: newton_schulz.NewtonSchulz
    device: float  # all of it
    base: float  # of `state`: the frozen leaves (an adapter run's base, DPO's reference copy)
    opt: float  # of `state`: the optimizer state on the device
    host: float  # offloaded state, per host
    comm: dict  # wire bytes per axis per step
    comm_s: float
    compute_s: float
    bubble: float
    step_s: float

    def label(self) -> str:
        p, t = self.cfg.parallel, self.cfg.train
        parts = [f"dp{self.mesh[DATA]}", f"pp{self.mesh[PIPE]}", f"tp{self.mesh[TENSOR]}"]
        if self.mesh.get(EXPERT, 1) > 1:
            parts.insert(1, f"ep{self.mesh[EXPERT]}")
        if self.mesh.get(REPLICA, 1) > 1:
            parts.insert(0, f"r{self.mesh[REPLICA]}")
        if self.mesh.get(CONTEXT, 1) > 1:
            parts.insert(-1, f"cp{self.mesh[CONTEXT]} {p.context_strategy}")
        parts += [f"zero{p.zero}"]
        if p.offload is not Offload.NONE:
            parts.append(f"offload={p.offload}")
        if self.mesh[PIPE] > 1:
            parts.append(f"m{p.microbatches}")
            if p.schedule is not Schedule.ONE_F_ONE_B:
                parts.append(str(p.schedule))
        if p.remat is not Remat.NONE:
            parts.append(f"remat={p.remat}")
        if t.grad_accum > 1:
            parts.append(f"accum{t.grad_accum}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What the planner needs of a model beyond its parameters' shapes, per batch row:
    from a registered model's own counts (`of_config`), or measured from the abstract
    program of a model given in Python (`of_problem`)."""

    layers: int  # in the stack a pipeline cuts
    flops_per_row: float  # forward and backward, without recomputation
    # (tensor degree) -> elements one layer keeps for its backward pass per row
    layer_elements: Callable[[int, int], float]  # (tensor, context) -> a device's, a layer
    boundary_elements: float  # the activation between two layers, per row
    check: Callable[[dict], None]  # the model's dims against a mesh shape (ConfigError)
    attention: cost.AttentionDims | None = None  # what context parallelism moves
    experts: cost.ExpertDims | None = None  # what expert parallelism moves


def of_config(cfg: Config, platform: str = "cuda") -> Workload:
    """A registered model's workload on `platform`, from its spec's own counts (the
    attention's [S, S] scores kept only where jaxpar.nn.attention keeps them there)."""
    spec, m, s = registry.get(cfg.model.name), cfg.model, cfg.train.seq_len
    scores = attention.stores_scores(platform, cost.DTYPES[cfg.train.precision], m.embed // m.heads)
    shapes = registered(m, s)
    dims = tensor_dims(shapes.names, shapes.shapes)
    # the units a pipeline cuts: the layer stack's (a group of blocks is one); DeepSeek's
    # prediction modules (model.mtp_depth) keep a block's activations each, spread here
    units = _stacked(shapes)
    blocks_kept = m.layers + getattr(m, "mtp_depth", 0)

    def check(mesh: dict) -> None:
        registry.check_model(m, mesh)
        check_tensor_split(dims, mesh[TENSOR])

    return Workload(
        layers=units,
        flops_per_row=spec.flops_per_token(m, s) * s,
        layer_elements=lambda t, c: (
            blocks.activation_bytes(spec, m, s, t, scores, c) / 2 * blocks_kept / units
        ),
        boundary_elements=s * m.embed,
        check=check,
        attention=spec.attention_dims(m) if spec.attention_dims else None,
        experts=spec.expert_dims(m, s) if spec.expert_dims else None,
    )


def _stacked(problem) -> int:
    """The layers of the problem's longest stack (the one a pipeline cuts)."""
    names = jax.tree.leaves(problem.names, is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(problem.shapes)
    stacked = [s.shape[0] for s, n in zip(shapes, names, strict=True) if n[:1] == (LAYERS,)]
    return max(stacked, default=1)


def of_problem(problem, batch) -> Workload:
    """A model given in Python, measured from shapes alone: 6 FLOPs per parameter and
    loss element; as kept activations, every value its forward pass computes (an upper
    bound: no value is assumed recomputed or freed), shared evenly by the layers and
    split by the tensor degree; the boundary is the layer scan's carry."""
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype), batch)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(problem.shapes))
    layers = _stacked(problem)
    values, carry = _forward_elements(
        jax.make_jaxpr(problem.loss)(problem.shapes, one).jaxpr, layers
    )
    return Workload(
        layers=layers,
        flops_per_row=6 * params * loss_elements(problem, one),
        layer_elements=lambda tensor, context: values / layers / tensor / context,
        boundary_elements=carry,
        check=lambda mesh: None,
    )


def _forward_elements(jaxpr, layers: int) -> tuple[float, float]:
    """(elements of every value `jaxpr` computes, a scan's body once per iteration and a
    cond's largest branch; elements of the carry of a scan over `layers`)."""
    total, carry = 0.0, 0.0
    for eqn in jaxpr.eqns:
        subs = [v.jaxpr if hasattr(v, "jaxpr") else v for v in eqn.params.values()]
        subs = [j for j in subs if hasattr(j, "eqns")]
        branches = [b.jaxpr for b in eqn.params.get("branches", ())]
        if eqn.primitive.name == "scan":
            body, inner_carry = _forward_elements(subs[0], layers)
            total += body * eqn.params["length"]
            if eqn.params["length"] == layers and not carry:
                kept = eqn.outvars[: eqn.params["num_carry"]]
                carry = sum(math.prod(v.aval.shape) for v in kept)
            carry = carry or inner_carry
        elif branches:
            total += max(_forward_elements(b, layers)[0] for b in branches)
        elif subs:
            for sub in subs:
                inner, inner_carry = _forward_elements(sub, layers)
                total, carry = total + inner, carry or inner_carry
        else:
            total += sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    return total, carry


def candidates(base: Config, machine: Machine, work: Workload, pipelines: bool = True):
    """Every valid layout of base's model and batch (parallel.* and train.grad_accum);
    pipelines only for a model that can be cut into stages."""
    n = machine.devices
    trains = {a: dataclasses.replace(base.train, grad_accum=a) for a in (1, 2, 4, 8)}
    for t, c, strategy in _inside_host(machine.per_host, work.attention is not None):
        deepest = min(work.layers, n // (t * c)) if pipelines else 1
        for p in (x for x in range(1, deepest + 1) if (n // (t * c)) % x == 0):
            dp = n // (t * p * c)
            # replica: 1, or one ZeRO group per host (hybrid sharding across hosts)
            replicas = (
                (1, machine.hosts) if 1 < machine.hosts < dp and dp % machine.hosts == 0 else (1,)
            )
            # expert: its degrees dividing the data-parallel devices and the experts
            experts = work.experts.experts if work.experts else 1
            for x, r in itertools.product(
                [x for x in range(1, dp + 1) if dp % x == 0 and experts % x == 0], replicas
            ):
                if dp % (r * x):
                    continue
                mesh = {REPLICA: r, DATA: dp // (r * x), EXPERT: x, PIPE: p, CONTEXT: c, TENSOR: t}
                try:
                    work.check(mesh)  # the model's dims against the mesh: once a mesh
                except ConfigError:
                    continue
                for par, train in _layouts(base.parallel, mesh, strategy, trains, work.layers):
                    try:  # the batch's arithmetic first: most fail it
                        batch_split(train, par, mesh)
                        layout_checks.check(mesh, parallel=par, train=train, model=base.model,
                                    adapter=base.adapter, muon=base.muon)  # fmt: skip
                    except ConfigError:
                        continue
                    yield dataclasses.replace(base, parallel=par, train=train), mesh


def _layouts(parallel: Parallel, mesh: dict, strategy, trains: dict, layers: int):
    """The (parallel, train) sections of one mesh's configs, `parallel` with its degrees
    and ZeRO stage (where there are data-parallel copies to split over), offload,
    micro-batches, recomputation and schedule set, and each of `trains` (the base's
    train by grad_accum), for a model of `layers` layers."""
    p, r = mesh[PIPE], mesh[REPLICA]
    copies = r * mesh[DATA] * mesh[EXPERT]
    for zero, offload, micro, remat, schedule in itertools.product(
        (0, 1, 2, 3) if copies > 1 else (0,),
        tuple(Offload),
        (p, 2 * p, 4 * p, 8 * p) if p > 1 else (1,),
        (Remat.NONE, Remat.FULL),
        TICKED if p > 1 else TICKED[:1],  # 1f1b, zb-h1, zbv, dualpipev
    ):
        if (
            (offload is Offload.OPTIMIZER and zero == 0)
            # the zero-bubble R is their recompute: remat=full would add nothing
            or (schedule in SPLIT and remat is not Remat.NONE)
            # a V cuts the layers in 2p chunks
            or (schedule in V_SHAPED and 2 * p > layers)
            # DualPipeV fills its V from both chunks: 2p micro-batches or more
            or (schedule is Schedule.DUALPIPEV and micro < 2 * p)
            # replicas of ZeRO-0 groups split one all-reduce in two: never better
            or (r > 1 and zero == 0)
            # ZeRO-3 in a pipeline gathers a stage's layers every tick, which is not
            # modelled here (6.6x the per-micro-batch gathers measured on gpt-tiny dp4
            # pp2): left out rather than ranked wrongly
            or (zero == 3 and p > 1)
        ):
            continue
        par = dataclasses.replace(
            parallel,
            replica=r,
            data=mesh[DATA],
            expert=mesh[EXPERT],
            pipeline=p,
            context=mesh[CONTEXT],
            context_strategy=strategy,
            tensor=mesh[TENSOR],
            zero=zero,
            offload=offload,
            microbatches=micro,
            remat=remat,
            schedule=schedule,
            virtual_stages=1,
        )
        for train in trains.values():
            yield par, train


def _inside_host(per_host: int, attention: bool):
    """(tensor, context, strategy) degrees that fit inside a host together (both move
    activations every layer: the fast links): context only for a model with attention,
    with each strategy."""
    for t in (x for x in range(1, per_host + 1) if per_host % x == 0):
        yield t, 1, ContextStrategy.ALL_GATHER
        if not attention:
            continue
        for c in (x for x in range(2, per_host // t + 1) if (per_host // t) % x == 0):
            for strategy in ContextStrategy:
                yield t, c, strategy


def predict(
    cfg: Config, mesh: dict, machine: Machine, trained, work: Workload, leaves=None
) -> Candidate:
    """One layout's memory, traffic and step time, per device; `trained` is the problem
    in the layout of its pipeline (pipeline.in_stages), `leaves` its placement on `mesh`
    at the config's ZeRO stage where already made (placed_on)."""
    par, train = cfg.parallel, cfg.train
    leaves = leaves or placed_on(trained, mesh, par.zero)
    placed = cost.placed_state(par, train, leaves, trained, mesh)
    acts, gather = _activations_and_gathers(par, train, mesh, work, leaves)
    state = placed.device
    # the model's own count of Megatron all-reduces, per micro-batch (a stage's share)
    t, p = mesh[TENSOR], mesh[PIPE]
    per_micro = blocks.tensor_elements(trained, batch_split(train, par, mesh).micro, t)
    tensor_elements = None if per_micro is None else per_micro * par.microbatches / p
    minimum = cost.minimum(
        par,
        train,
        leaves,
        trained,
        mesh,
        tensor_elements if t > 1 else 0,
        experts=work.experts,
    )
    comm = _traffic(par, train, mesh, trained, work, leaves, minimum)
    comm_s = _comm_seconds(comm, mesh, machine)
    if par.offload is not Offload.NONE:  # fp32 gradients to the host, compute-dtype parameters back
        compute_bytes = cost.dtype_bytes(train.precision)
        moved = (4 + compute_bytes) * placed.opt_elements * train.grad_accum ** (par.zero == 3)
        comm["host"] = moved
        comm_s += moved / machine.host_bytes_s
    bubble = cost.bubble(p, par.microbatches, 1, par.schedule)
    ns = newton_schulz.NewtonSchulz(0.0, 0.0)
    if train.optimizer is Optimizer.MUON:
        trainable = trained.trainable(leaves), trained.trainable(trained.names)
        ns = newton_schulz.cost(*trainable, cfg.muon.ns_steps)
    compute_s = _compute_seconds(par, train, mesh, machine, trained, work)
    compute_s += ns.flops / (machine.peak_flops * machine.mfu)
    return Candidate(
        cfg=cfg,
        mesh=mesh,
        state=state,
        model_state=placed.model,
        formula_state=cost.problem_state(par, train, leaves, trained, mesh),
        paper_state=sum(
            cost.paper_state(par.zero, psi, n)
            for n, psi in cost.params_by_zero_degree(leaves, mesh).items()
        ),
        minimum=minimum,
        activations=acts,
        gather_temp=gather,
        ns=ns,
        device=state + max(acts + gather, ns.temp_bytes),
        base=placed.frozen,
        opt=placed.opt,
        host=placed.host * machine.per_host,
        comm=comm,
        comm_s=comm_s,
        compute_s=compute_s,
        bubble=bubble,
        step_s=compute_s / (1 - bubble) + comm_s,
    )


def slots(schedule: Schedule, p: int, m: int) -> tuple[int, int]:
    """(chunk inputs, W slots) a zero-bubble table holds at once on a device, in closed
    form (jaxpar.parallel.schedules.Ticked counts them from the table, which at p = 64
    takes seconds to build: tested equal)."""
    if schedule is Schedule.ZB_H1:
        return min(p, m), 1
    if schedule is Schedule.ZBV:
        return min(2 * p - 1, m), min(p, m)
    return min(2 * p, m), -(-p // 2)  # dualpipev


def _activations_and_gathers(par: Parallel, train: Train, mesh: dict, work: Workload, leaves):
    """(the activations a device keeps for its backward pass, the bytes of ZeRO-3's
    gathered layers in flight), per device."""
    d, p, t, c = mesh[DATA], mesh[PIPE], mesh[TENSOR], mesh.get(CONTEXT, 1)
    compute_bytes = cost.dtype_bytes(train.precision)
    split = batch_split(train, par, mesh)
    alive = min(par.microbatches, p) if p > 1 else 1
    layers = math.ceil(work.layers / p)
    # kept for the backward pass: each layer's input (recomputed) or all it computes, of
    # this device's 1/C of the tokens
    if par.remat is not Remat.NONE:
        kept = work.boundary_elements / c
    else:
        kept = work.layer_elements(t, c)
    acts = alive * layers * split.micro * kept * compute_bytes
    if p > 1 and par.schedule in SPLIT:
        # the table's slots: its chunk inputs, one slot of recomputed residuals (R to B)
        # and its slots of what B keeps for W, each at most what a layer saves for its
        # backward (ZB-H1: p inputs and one W slot; a V: up to 2p - 1 inputs a chunk,
        # DualPipeV's 2p, and p or p / 2 W slots, each chunk half the device's layers)
        inputs, weights = slots(par.schedule, p, par.microbatches)
        whole = work.layer_elements(t, c) * compute_bytes
        acts = inputs * work.boundary_elements / c * compute_bytes
        acts = (acts + (1 + weights) * whole) * layers * split.micro
    if par.zero != 3 or d * mesh.get(EXPERT, 1) == 1:
        return acts, 0.0
    one_layer = sum(leaf.layer for leaf in leaf_layout.leaves(leaves))
    # ZeRO-3 gathers a layer whole before it runs: this one and the next in flight
    return acts, 2 * one_layer * compute_bytes


def _traffic(
    par: Parallel, train: Train, mesh: dict, trained, work: Workload, leaves, minimum: dict
) -> dict:
    """Bytes per device per step over each axis: the minimum's, the experts' exchange,
    context's, and the pipeline's hand-overs."""
    p, c = mesh[PIPE], mesh.get(CONTEXT, 1)
    split = batch_split(train, par, mesh)
    # a device hands one activation (forward) or its gradient (backward) per micro-batch
    hand_over = split.micro * work.boundary_elements / c * cost.dtype_bytes(train.precision)
    hand_over *= 2 if par.schedule in V_SHAPED else 1  # a V: each chunk's, both ways
    return {
        REPLICA: minimum[REPLICA],
        DATA: minimum[DATA],
        EXPERT: cost.expert_bytes(par, train, leaves, trained, mesh, work.experts),
        CONTEXT: cost.context_bytes(
            par,
            train,
            leaves,
            mesh,
            work.attention,
            False,
            work.experts,
            cost.extra_forwards(trained),
        ),
        TENSOR: minimum[TENSOR] or 0.0,
        PIPE: par.microbatches * train.grad_accum * hand_over if p > 1 else 0.0,
    }


def _comm_seconds(comm: dict, mesh: dict, machine: Machine) -> float:
    """The traffic's seconds, each axis at the inter-host rate where it spans hosts."""
    d, p, t, c = mesh[DATA], mesh[PIPE], mesh[TENSOR], mesh.get(CONTEXT, 1)
    inside = machine.per_host
    # replicas are hosts apart; a ZeRO group (data x pipeline x tensor) spans hosts
    # where it holds more devices than one host has
    spans = {
        TENSOR: t > inside,
        CONTEXT: c * t > inside,
        PIPE: p * c * t > inside,
        EXPERT: mesh.get(EXPERT, 1) * p * c * t > inside,
        DATA: d * mesh.get(EXPERT, 1) * p * c * t > inside,
        REPLICA: mesh.get(REPLICA, 1) > 1,
    }
    return sum(
        b / (machine.inter_bytes_s if spans[a] else machine.intra_bytes_s) for a, b in comm.items()
    )


def _compute_seconds(
    par: Parallel, train: Train, mesh: dict, machine: Machine, trained, work: Workload
):
    """The busiest device's compute time at the machine's MFU."""
    p, c = mesh[PIPE], mesh.get(CONTEXT, 1)
    flops = work.flops_per_row
    if work.experts:  # the experts run on every slot they hold, empty ones too
        flops += work.experts.idle_flops(train.seq_len, c)
    # the ticked schedules recompute each chunk in its backward, whatever parallel.remat says
    recomputes = par.remat is not Remat.NONE or (p > 1 and par.schedule in TICKED)
    flops *= train.batch_size * (4 / 3 if recomputes else 1)
    # a pipeline runs at its slowest device's pace (the bubble stretches that below)
    share = slowest_stage_share(trained, work.layers, p)
    per_stage = math.prod(mesh.values()) // p  # devices sharing each stage's work
    return flops * share / per_stage / (machine.peak_flops * machine.mfu)


def slowest_stage_share(trained, layers: int, p: int) -> float:
    """The share of a step's compute that the busiest pipeline device runs (1 without a
    pipeline): from the stage assignment training uses (jaxpar.parallel.pipeline.assign: balanced
    contiguous chunks, the embedding counted on the first and the head on the last), not
    an even 1/p: 36 layers on 32 stages put 2 layers on some device."""
    if p == 1 or trained.parts is None:
        return 1.0
    pre, layer, post = trained.parts.costs
    chunks = pipeline.assign(layers, p, 1, trained.parts.costs).chunks
    costs = [
        len(c) * layer + (pre if i == 0 else 0) + (post if i == len(chunks) - 1 else 0)
        for i, c in enumerate(chunks)
    ]
    return max(costs) / sum(costs)


def _unsplit_fits(c: Candidate, ranked: list[Candidate]) -> bool:
    """Whether the winner's layout also fits without ZeRO (ranked: the plan's fits)."""
    return any(o.mesh == c.mesh and o.cfg.parallel.zero == 0 for o in ranked)


RULES = (  # (test on the winner, the machine and the plan's fits, the rule), most specific first
    (
        lambda c, m, r: c.mesh.get(CONTEXT, 1) > 1,
        "long sequences: split over context inside the host, each device keeps the "
        "activations of 1/context of every sequence, for fewer bytes than the other splits "
        "would move",
    ),
    (
        lambda c, m, r: c.mesh.get(EXPERT, 1) > 1,
        "a mixture of experts: split the experts over expert, each device keeping "
        "experts / expert of them and receiving its tokens by all-to-all, for fewer bytes "
        "than gathering every expert's weights (ZeRO) and less state than copies of them",
    ),
    (
        lambda c, m, r: c.mesh[PIPE] > 1 and m.hosts > 1,
        "many hosts with slow links between them: pipeline parallel across hosts, data "
        "parallel outermost",
    ),
    (
        lambda c, m, r: c.mesh[PIPE] > 1,
        "the hand-overs between stages move less than the data-parallel reduction would: "
        "pipeline parallel, data parallel outermost",
    ),
    (
        lambda c, m, r: c.mesh.get(REPLICA, 1) > 1,
        "many hosts with slow links between them: a ZeRO group inside each host, "
        "replicated across hosts (only 1/data of the gradients crosses them)",
    ),
    (
        lambda c, m, r: c.mesh[TENSOR] > 1,
        "a layer does not fit, or the fast links are inside a host: tensor parallel inside "
        "the host",
    ),
    (
        lambda c, m, r: c.cfg.parallel.offload is not Offload.NONE,
        "the parameters and optimizer state do not fit on few devices: offload them to the host",
    ),
    (
        lambda c, m, r: c.cfg.parallel.zero > 0 and _unsplit_fits(c, r),
        "plain data parallelism fits too, but ZeRO's split moves no more bytes (a "
        "reduce-scatter and gathers instead of the all-reduce) and stores less",
    ),
    (lambda c, m, r: c.cfg.parallel.zero == 3, "the parameters do not fit: ZeRO-3"),
    (lambda c, m, r: c.cfg.parallel.zero in (1, 2), "the optimizer state does not fit: ZeRO-1/2"),
    (lambda c, m, r: True, "it fits on one device: data parallel"),
)


@dataclass(frozen=True)
class Plan:
    ranked: list[Candidate]  # those that fit, fastest first
    considered: int
    dropped: int  # did not fit
    closest: Candidate | None  # of those that did not fit, the nearest (Machine.overshoot)
    machine: Machine

    def rule(self) -> str:
        return next(text for test, text in RULES if test(self.ranked[0], self.machine, self.ranked))

    def __str__(self) -> str:
        return report(self) if self.ranked else f"none of {self.considered} layouts fits"


def machine(
    devices: int,
    device_memory: str,
    *,
    hosts: int = 1,
    host_memory: str = "1TB",
    peak_tflops: float = 989.0,
    mfu: float = 0.4,
    intra_gbps: float = 450.0,
    inter_gbps: float = 50.0,
) -> Machine:
    """The machine to plan for (defaults: H100s, bf16 peak), each number checked."""
    if devices < 1 or hosts < 1 or devices % hosts:
        raise ConfigError(
            f"--devices {devices} --hosts {hosts}: the devices must split evenly over the "
            "hosts; give a multiple of --hosts"
        )
    for flag, value, low, high in (
        ("--mfu", mfu, 0, 1),
        ("--peak-tflops", peak_tflops, 0, 1e7),
        ("--intra-gbps", intra_gbps, 0, 1e6),
        ("--inter-gbps", inter_gbps, 0, 1e6),
    ):
        if not low < value <= high:  # (NaN fails too)
            raise ConfigError(f"{flag} {value}: give a number > {low} and <= {high:g}")
    return Machine(
        devices=devices,
        hosts=hosts,
        device_memory=parse_bytes(device_memory, "--device-memory"),
        host_memory=parse_bytes(host_memory, "--host-memory"),
        peak_flops=peak_tflops * 1e12,
        mfu=mfu,
        intra_bytes_s=intra_gbps * 1e9,
        inter_bytes_s=inter_gbps * 1e9,
    )


def plan(problem, batch, *, devices: int, device_memory: str, cfg: Config | None = None, **kw):
    """Every layout of a model given in Python (a jaxpar.Problem) on `devices`, predicted
    from its abstract shapes and one global batch's, as `jaxpar plan` does for a
    registered model; `cfg` gives the training settings (default: jaxpar.Config() with
    the batch's rows). `kw`: the rest of `machine`'s arguments. print() the result."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    cfg = cfg or Config(train=Train(batch_size=rows))
    if cfg.train.batch_size != rows:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size}, but the batch has {rows} rows; "
            "give the global batch of one step"
        )
    return make_plan(
        cfg, problem, machine(devices, device_memory, **kw), of_problem(problem, batch)
    )


def placed_on(trained, mesh: dict, zero: int) -> dict:
    """`trained`'s leaves as its placement plan on `mesh` at ZeRO stage `zero` lays them out
    (jaxpar.parallel.sharding), counted (jaxpar.parallel.leaf_layout)."""
    shapes = jax.tree.map(lambda s: s.shape, trained.shapes)
    specs = placement(trained.names, shapes, zero=zero, mesh_shape=mesh)
    return leaf_layout.leaf_layout(specs, trained.shapes, trained.names, mesh, trained.scans_layers)


def make_plan(base: Config, problem, machine: Machine, work: Workload) -> Plan:
    """Every candidate predicted; those that fit ranked by step time."""
    staged, placed = {}, {}  # each pipeline's staging, and each mesh's placement, made once
    fit, dropped, closest, considered = [], 0, None, 0
    for cfg, mesh in candidates(base, machine, work, pipelines=problem.parts is not None):
        p = mesh[PIPE]
        if p not in staged:
            staged[p] = staging.in_stages(problem, p)
        at = (tuple(sorted(mesh.items())), cfg.parallel.zero)
        if at not in placed:
            placed[at] = placed_on(staged[p], mesh, cfg.parallel.zero)
        c = predict(cfg, mesh, machine, staged[p], work, placed[at])
        considered += 1
        if c.device <= machine.device_memory and c.host <= machine.host_memory:
            fit.append(c)
        else:
            dropped += 1
            if closest is None or machine.overshoot(c) < machine.overshoot(closest):
                closest = c
    # equal times: the simpler layout first (no offload, lower ZeRO, no recompute)
    fit.sort(
        key=lambda c: (
            round(c.step_s, 9),
            c.cfg.parallel.offload is not Offload.NONE,
            c.cfg.parallel.zero,
            c.cfg.parallel.remat is not Remat.NONE,
            c.cfg.train.grad_accum,
            c.device,
        )
    )
    return Plan(fit, considered, dropped, closest, machine)


def report(plan: Plan, top: int = 10) -> str:
    machine = plan.machine
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    frozen = any(c.base for c in plan.ranked)  # the state as its three parts

    def state(c: Candidate) -> list[str]:
        if frozen:
            mib = (c.state - c.base - c.opt, c.opt)
            return [gib(c.base), *(f"{b / 2**20:,.0f}" for b in mib)]
        return [gib(c.state), gib(c.paper_state)]

    rows = [
        [
            str(i + 1),
            c.label(),
            gib(c.device),
            *state(c),
            gib(c.activations),
            gib(c.host),
            human_bytes(sum(c.comm.values())),
            f"{c.comm_s * 1e3:,.1f}",
            f"{c.compute_s * 1e3:,.1f}",
            f"{c.bubble:.2f}",
            f"{c.step_s * 1e3:,.1f}",
        ]
        for i, c in enumerate(plan.ranked[:top])
    ]
    header = [
        "#",
        "layout",
        "device GiB",
        *(["frozen", "trained MiB", "opt state MiB"] if frozen else ["state", "paper state"]),
        "activations",
        "host GiB",
        "comm/step",
        "comm ms",
        "compute ms",
        "bubble",
        "step ms",
    ]
    return "\n".join(
        [
            f"{plan.considered} layouts considered, {plan.dropped} do not fit in "
            f"{machine.device_memory / 1e9:.0f} GB per device; the {min(top, len(plan.ranked))} "
            "fastest predicted:",
            "",
            table(rows, header),
            "",
            f"recommended: {plan.ranked[0].label()} ({plan.rule()})",
        ]
    )
