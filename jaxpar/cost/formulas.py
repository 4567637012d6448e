"""The cost model's formulas, in one place: dtype bytes, the pipeline bubble, the ZeRO
model-state bytes and the textbook minimum of communication. The ledger (what a compiled
step did, against the minimum), the planner (what a layout would do) and the memory
preflight all call these, so they cannot drift.

They read a layout as data: its leaves, each counted once by jaxpar.parallel.leaf_layout
(elements per device under each spec, the axes ZeRO splits it over), never a spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxpar.config.registry import AttentionDims, ExpertDims
from jaxpar.config.sections import (
    ContextStrategy,
    DpSync,
    Offload,
    Optimizer,
    Parallel,
    Precision,
    ReduceDtype,
    Remat,
    Schedule,
    Train,
)
from jaxpar.parallel import context, schedules
from jaxpar.parallel.axes import CONTEXT, DATA, EXPERT, PIPE, REPLICA, TENSOR, data_parallel
from jaxpar.parallel.leaf_layout import Leaf, leaves

DTYPES = {Precision.FP32: jnp.float32, Precision.BF16: jnp.bfloat16}  # train.precision's


def dtype_bytes(precision: Precision) -> int:
    """Bytes of one element in the compute dtype of train.precision."""
    return jnp.dtype(DTYPES[precision]).itemsize


def reduce_precision(train: Train) -> Precision:
    """The precision gradients are summed over `data` in (train.grad_reduce_dtype): fp32,
    or the compute precision."""
    return train.precision if train.grad_reduce_dtype is ReduceDtype.COMPUTE else Precision.FP32


def reduce_bytes(train: Train) -> int:
    """Bytes of one gradient element as it is summed over `data`."""
    return dtype_bytes(reduce_precision(train))


def bubble(p: int, m: int, v: int = 1, schedule: Schedule = Schedule.GPIPE) -> float:
    """The pipeline bubble of p stages running m micro-batches through v chunks each:
    idle compute over all, each op weighed by its forwards of work, the ticks in
    lockstep (each as long as its longest op; jaxpar.parallel.schedules.lockstep):
    - gpipe, interleaved: (p - 1) / (v m + p - 1), every tick one kind of op;
    - 1f1b: 1 - 4m / (6m + 4(p - 1) - 2), a forward (1) beside a backward that
      recomputes its chunk (3) on most ticks, 4m of work per stage;
    - zb-h1: 1 - 4m / (4m + 2(p - 1)), Qi et al.'s (p - 1)(F + B - W) idle with B and its
      recompute 2 (its table idles this, one W waiting at most);
    - zbv: 1 - 8m / (8m + p - 1), two chunks a device of half the layers each, so 8m ops
      of half a forward, and Qi et al.'s (p - 1)(F + B - 2W) idle in those units;
    - dualpipev: its table's (jaxpar.parallel.schedules.dualpipev), in zbv's unit: a
      pair (a forward beside a backward's R, B and W, 4 units) beside single ops idles
      their neighbours in the fill and drain; no idle in the steady state, so its
      length is 8m plus a fill and drain that depends on p alone."""
    if p == 1:
        return 0.0
    if schedule is Schedule.ONE_F_ONE_B:
        return 1 - 4 * m / (6 * m + 4 * (p - 1) - 2)
    if schedule is Schedule.ZB_H1:
        return 1 - 4 * m / (4 * m + 2 * (p - 1))
    if schedule is Schedule.ZBV:
        return 1 - 8 * m / (8 * m + p - 1)
    if schedule is Schedule.DUALPIPEV:
        return schedules.lockstep(schedules.ticked_table(schedule, p, m).table)[1]
    return (p - 1) / (v * m + p - 1)


def paper_state(zero: int, psi: float, n: int) -> float:
    """ZeRO paper, mixed precision: 2 psi (fp16 params) + 2 psi (fp16 grads) + 12 psi."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}.get(
        zero, 16 * psi / n
    )


def minimum_bytes(
    layout,
    *,
    zero: int,
    mesh_shape: dict,
    compute_bytes: int,
    accum: int,
    tensor_elements: int | None,
    reduce_bytes: int = 4,
    sync_every: int | None = None,
) -> dict[str, float | None]:
    """Textbook wire bytes per device per step, by axis (what `assumes` says in words).

    The data-parallel axes, leaf by leaf (`layout`: a tree of leaf_layout.Leaf). A leaf
    ZeRO splits (Leaf.over: over
    `data`, and `expert` but for the experts' own weights), over each of its axes in
    turn, a (n-1)/n share of what the axes before it leave (the whole leaf, then its
    1/data slice): ZeRO-1/2 a reduce-scatter of the gradient (ZeRO-2: every
    micro-batch) and an all-gather of the updated fp32 parameters; ZeRO-3 per
    micro-batch, the leaf gathered Leaf.gathers times in the compute dtype (a layer
    stack's leaves twice, for forward and again for backward, one layer whole at a
    time; a leaf outside the stack once, kept whole until its backward) and its
    gradient reduce-scattered. A leaf ZeRO leaves whole (ZeRO-0, or no dim to split)
    pays a ring all-reduce, 2(n-1)/n, of its gradient over `data` and over `expert`
    (but the experts' own). Gradients are summed in `reduce_bytes` per element
    (train.grad_reduce_dtype). replica: once per step, a ring all-reduce 2(R-1)/R of
    each device's part of the gradient (its ZeRO slice). tensor: Megatron's
    all-reduces of activations, 2(T-1)/T of `tensor_elements` (per micro-batch) each,
    in the compute dtype. Parameter averaging (`sync_every`): data, a ring all-reduce
    of the fp32 parameters once every `sync_every` steps. `expert` here is its gradient
    part only (cost.minimum adds the mixture's all-to-alls).
    """
    t, r = mesh_shape.get(TENSOR, 1), mesh_shape.get(REPLICA, 1)
    out = dict.fromkeys((REPLICA, DATA, EXPERT), 0.0)
    for leaf in leaves(layout):
        local = part = leaf.compute
        if zero == 0 or not leaf.over:
            for axis in leaf.synced:
                n = mesh_shape[axis]
                out[axis] += 2 * (n - 1) / n * reduce_bytes * local
        else:
            if zero in (1, 2):
                per_elem = reduce_bytes * (accum if zero == 2 else 1) + 4
            else:
                per_elem = (leaf.gathers * compute_bytes + reduce_bytes) * accum
            for axis in leaf.over:
                n = mesh_shape[axis]
                out[axis] += (n - 1) / n * part * per_elem
                part /= n
        out[REPLICA] += 2 * (r - 1) / r * reduce_bytes * part
    if sync_every:
        n = mesh_shape.get(DATA, 1)
        out[DATA] = 2 * (n - 1) / n * 4 * params_per_device(layout) / sync_every
    tensor = (
        None
        if tensor_elements is None
        else 2 * (t - 1) / t * tensor_elements * compute_bytes * accum
    )
    return {**out, TENSOR: tensor}


def params_per_device(layout) -> float:
    """Parameters one device computes with (split by the rules, not by ZeRO): ZeRO's Psi."""
    return sum(leaf.compute for leaf in leaves(layout))


def grad_bytes(layout) -> int:
    """Per-device bytes of the fp32 gradient accumulator, as its gradient spec splits it."""
    return int(sum(4 * leaf.grad for leaf in leaves(layout)))


def optimizer_bytes(train: Train, leaf: Leaf | None = None) -> int:
    """Optimizer state bytes per parameter of `leaf` (the ZeRO paper's K): AdamW's m and v
    in fp32, 8; plain SGD, none; Muon, its one momentum (4) on a hidden matrix and AdamW's
    8 elsewhere (`leaf` None: a hidden matrix's)."""
    if train.optimizer is Optimizer.SGD:
        return 0
    if train.optimizer is Optimizer.MUON and (leaf is None or leaf.matrix):
        return 4
    return 8


def state_formula(
    zero: int, params_per_device: float, n: int, offload: bool = False, k: int = 8
) -> float:
    """ZeRO paper's model-state bytes per device for fp32 parameters (4 bytes) and an
    optimizer of K bytes per parameter (AdamW: m and v, K=8): stage 0 (4+K)Psi, 1 and 2
    4Psi + K Psi/N, 3 (4+K)Psi/N. Offloaded, the fp32 master parameters are split like
    the optimizer state: (4+K)Psi/N from stage 1."""
    psi = params_per_device
    if offload and zero or zero == 3:
        return (4 + k) * psi / n
    return 4 * psi + k * psi / (n if zero else 1)


def expert_bytes(
    par: Parallel, train: Train, layout, trained, mesh_shape: dict, experts: ExpertDims | None
) -> float:
    """Textbook wire bytes per device per step on `expert`: the other leaves' gradient
    sync over it (minimum_bytes) and the mixture's all-to-alls (dispatch_bytes)."""
    synced = _minimum(par, train, layout, trained, mesh_shape, None)[EXPERT]
    return synced + dispatch_bytes(par, train, mesh_shape, experts, extra_forwards(trained))


def extra_forwards(trained) -> int:
    """Forward passes a step runs without a backward: a DPO reference's (Problem.
    reference_forward), 1; else 0."""
    return int(trained.reference_forward)


def dispatch_bytes(
    par: Parallel, train: Train, mesh_shape: dict, experts: ExpertDims | None, extra: int = 0
) -> float:
    """A mixture's all-to-all bytes per device per step on `expert`
    (jaxpar.models.moe): per sparse layer, each forward pass (`forward_passes`) sends
    the dispatched slots of this device's rows, [rows, experts, slots, embed], to the
    experts' devices and their outputs back (two all-to-alls), and the backward pass
    the same two again: (X-1)/X of them each; a pipeline stage holds 1/pipeline of the
    layers. `extra`: forward passes without a backward (a DPO reference's).

    Dropless (ExpertDims.dropless): per sparse layer and forward pass, this device's
    tokens [rows, S / C, embed] and their routes (k int32 experts, k fp32 weights) all-
    gathered, (X-1) x this device's part each, and the outputs reduce-scattered (but in a
    recomputed forward, whose output is not needed); the backward pass reduce-scatters
    the tokens' and the weights' gradients and all-gathers the outputs'."""
    x = mesh_shape.get(EXPERT, 1)
    if x == 1 or experts is None:
        return 0.0
    rows = train.batch_size // data_parallel(mesh_shape)
    layers = experts.layers / mesh_shape.get(PIPE, 1)
    if experts.dropless:
        tokens = rows * train.seq_len / mesh_shape.get(CONTEXT, 1)
        width, route = experts.embed * dtype_bytes(train.precision), experts.per_token * 4
        gathers = (forward_passes(par) + extra) * (width + 2 * route)
        passes = gathers + (1 + extra) * width + 2 * width + route
        return layers * passes * (x - 1) * tokens
    held = experts.held(mesh_shape.get(CONTEXT, 1))
    slots = rows * experts.experts * held * experts.embed
    passes = 2 * (forward_passes(par) + extra) + 2
    return layers * passes * (x - 1) / x * slots * dtype_bytes(train.precision)


def forward_passes(par: Parallel) -> int:
    """How often a layer's forward runs per micro-batch: twice where its backward
    recomputes it (parallel.remat, ZeRO-3's re-gathered layers)."""
    return 2 if par.remat is not Remat.NONE or par.zero >= 3 else 1


def context_bytes(
    par: Parallel,
    train: Train,
    layout,
    mesh_shape: dict,
    attention: AttentionDims | None,
    documents: bool,
    experts: ExpertDims | None = None,
    extra: int = 0,
) -> float:
    """Textbook wire bytes per device per step on `context` (jaxpar.parallel.context): per
    attention layer and pass (each forward, `forward_passes` and `extra` ones without a
    backward, and the backward),
    all_gather moves K and V, (C-1)/C of their gathered [rows, S, kv heads moved, D]
    each (forward a gather, backward a reduce-scatter) (latent attention: its latent
    and rotated key, [rows, S, latent]); a windowed layer whose window reaches one chunk
    back, the W - 1 tokens before each chunk (1 or 2 a device), from the (C-1)/C of the
    devices that send them (a collective-permute each way); plus with documents their int32
    segment ids and positions (forward only, once for the batch); Ulysses four
    all-to-alls, (C-1)/C of q, k, v and the output on the device; per sparse layer, a
    mixture's input gathered each pass and its output reduce-scattered forward and
    backward (jaxpar.models.moe),
    (C-1)/C of [rows, S, embed] each; and once a step the gradients, as `data` leaves
    them (ZeRO>=1: the optimizer's split), all-reduced: 2(C-1)/C."""
    c = mesh_shape.get(CONTEXT, 1)
    if c == 1:
        return 0.0
    share = (c - 1) / c
    grads = sum(leaf.opt for leaf in leaves(layout))
    total = 2 * share * grads * reduce_bytes(train)
    if attention is None:
        return total
    split = context.Split(c, par.context_strategy, par.context_balance)
    t = mesh_shape.get(TENSOR, 1)
    tokens = train.batch_size // data_parallel(mesh_shape)
    tokens *= train.seq_len  # this device's rows, whole, over the step
    local = attention.heads // t
    moved = context.kv_heads_moved(local, attention.heads // attention.kv_heads, split)
    layers = attention.layers
    f = forward_passes(par) + extra
    cb = dtype_bytes(train.precision)
    if experts and not experts.dropless:  # a recomputed forward's output: scattered once
        total += experts.layers * (f + 3 + extra) * share * tokens * experts.embed * cb
    # the documents' ids and positions: once per forward of the same batch (a reference's
    # forward reads the policy's)
    ids = (f - extra) * documents * 2 * 4
    if par.context_strategy is ContextStrategy.ALL_GATHER:
        per_token = 2 * moved * attention.head_dim * cb
        if attention.latent:  # latent attention: its latent, whole on each tensor device
            per_token = attention.latent * cb
        # each layer's keys from the others: all of them, or a windowed layer's W - 1
        # before each of the device's chunks (jaxpar.parallel.context's halo)
        part, rows = train.seq_len // c, tokens // train.seq_len
        parts = 2 if split.balance else 1
        moved_tokens = sum(
            share * rows * parts * (w - 1) if context.halo_reach(split, w, part) else share * tokens
            for w in attention.windows or (0,) * layers
        )
        return total + moved_tokens * ((f + 1) * per_token + ids)
    per_pass = share * tokens / c * attention.head_dim * cb * (2 * local + 2 * moved)
    return total + layers * ((f + 1) * per_pass + ids * share * tokens)


def minimum(
    par: Parallel,
    train: Train,
    layout,
    trained,
    mesh_shape: dict,
    tensor_elements,
    attention: AttentionDims | None = None,
    documents: bool = False,
    experts: ExpertDims | None = None,
) -> dict:
    """The textbook minimum by axis for the layout (`par`, `train`) of `trained` (the problem as the
    engine lays it out: pipeline-staged where there is a pipeline): what the ledger
    reports for a run and the planner predicts for a candidate. With a pipeline, the
    attention's context collectives and a mixture's all-to-alls run in every tick of the
    schedule's loop, idle ones too: no per-micro-batch figure (as for `tensor`)."""
    staged = mesh_shape.get(PIPE, 1) > 1
    c = mesh_shape.get(CONTEXT, 1)
    if tensor_elements:  # each device holds 1/C of the tokens
        tensor_elements = tensor_elements / c
        if trained.reference_forward:  # Megatron's forward half once more
            tensor_elements *= 1.5
    base = _minimum(par, train, layout, trained, mesh_shape, tensor_elements)
    return {
        **base,
        CONTEXT: None
        if c > 1 and staged
        else context_bytes(
            par,
            train,
            trained.trainable(layout),
            mesh_shape,
            attention,
            documents,
            experts,
            extra_forwards(trained),
        ),
        EXPERT: None
        if experts and staged and mesh_shape.get(EXPERT, 1) > 1
        else base[EXPERT]
        + dispatch_bytes(par, train, mesh_shape, experts, extra_forwards(trained)),
    }


def _minimum(
    par: Parallel, train: Train, layout, trained, mesh_shape: dict, tensor_elements
) -> dict:
    """minimum_bytes of the trained leaves, and ZeRO-3's gathers of the frozen ones (an
    adapter run's base: gathered as the trained are, never reduced; once more for a
    reference's forward pass with the adapters off; a reference's copy (DPO) once, for
    its forward pass alone)."""
    own = trained.trainable
    out = minimum_bytes(
        own(layout),
        zero=par.zero,
        mesh_shape=mesh_shape,
        compute_bytes=dtype_bytes(train.precision),
        accum=train.grad_accum,
        tensor_elements=tensor_elements,
        reduce_bytes=reduce_bytes(train),
        sync_every=par.sync_every if par.dp_sync is DpSync.PARAMS else None,
    )
    if par.zero == 3:
        for k in trained.frozen:
            leaf = layout[k]
            times = leaf.gathers
            if k in trained.reference:
                times = 1
            elif trained.reference_forward and times == 2:  # a stack's, not kept whole
                times = 3
            moved = dtype_bytes(train.precision) if leaf.floating else 1
            part = leaf.compute
            for axis in leaf.over:
                n = mesh_shape[axis]
                out[axis] += (n - 1) / n * part * times * moved * train.grad_accum
                part /= n
    return out


def frozen_bytes(layout, trained) -> float:
    """Per-device bytes of the frozen leaves (an adapter run's base) as stored: no
    gradient, no optimizer state."""
    return sum(layout[k].dtype.itemsize * layout[k].storage for k in trained.frozen)


def problem_state(par: Parallel, train: Train, layout, trained, mesh_shape: dict) -> float:
    """model_state of the trained leaves, plus the frozen ones as stored."""
    own = trained.trainable(layout)
    return model_state(par, train, own, mesh_shape) + frozen_bytes(layout, trained)


@dataclass(frozen=True)
class PlacedState:
    """Model state per device as the placement plan lays it out, leaf by leaf (leaves
    ZeRO cannot split counted whole), bytes."""

    device: float  # on the device: master (or compute copy), gradients, optimizer state
    host: float  # offloaded: fp32 master weights and optimizer state in host memory
    model: float  # fp32 master parameters and optimizer state, device and host
    opt_elements: float  # parameter elements in the optimizer's split
    frozen: float = 0.0  # of `device`: the frozen leaves as stored (an adapter run's base)
    opt: float = 0.0  # of `device`: the optimizer state


def placed_state(par: Parallel, train: Train, layout, trained, mesh_shape: dict) -> PlacedState:
    """The planner's state bytes for the layout of `trained` (a Problem; what the ledger
    measures as `state_bytes.actual` once compiled): its frozen leaves as stored."""
    frozen = frozen_bytes(layout, trained)
    own = trained.trainable(layout)
    local = {f: sum(getattr(leaf, f) for leaf in leaves(own)) for f in ("storage", "grad", "opt")}
    adam = sum(optimizer_bytes(train, leaf) * leaf.opt for leaf in leaves(own))
    master, grads = 4 * local["storage"], 4 * local["grad"]
    model = master + adam if par.offload is Offload.NONE else 4 * local["opt"] + adam
    if par.dp_sync is DpSync.PARAMS:  # the global parameters, each device's copy, its state
        model = model_state(par, train, own, mesh_shape)
        master = model - adam
    host = 0.0
    if par.offload is not Offload.NONE:  # fp32 master weights and Adam state on the host
        host = 4 * local["opt"] + adam
        master, adam = dtype_bytes(train.precision) * local["storage"], 0  # compute copy
        if par.offload is Offload.OPTIMIZER_PARAMS:
            host, master = host + master, 0
    return PlacedState(
        master + grads + adam + frozen, host, model + frozen, local["opt"], frozen, adam
    )


def model_state(par: Parallel, train: Train, layout, mesh_shape: dict) -> float:
    """The ZeRO formula's model-state bytes per device for the layout."""
    if par.dp_sync is DpSync.PARAMS:  # global params, a copy, its optimizer, the momentum
        momentum = 4 * (par.outer_momentum > 0)
        return sum((8 + optimizer_bytes(train, x) + momentum) * x.compute for x in leaves(layout))
    offload = par.offload is not Offload.NONE
    return sum(
        state_formula(par.zero, x.compute, x.degree(mesh_shape), offload, optimizer_bytes(train, x))
        for x in leaves(layout)
    )


def params_by_zero_degree(layout, mesh_shape: dict) -> dict[int, float]:
    """Psi, per device, by the number of ways ZeRO splits it (the experts' own weights:
    `data`; the rest: `data` x `expert`)."""
    out: dict[int, float] = {}
    for leaf in leaves(layout):
        n = leaf.degree(mesh_shape)
        out[n] = out.get(n, 0.0) + leaf.compute
    return out
