"""What a model's blocks cost, from the dims the model declares (ModelSpec.dims, a
ModelDims): the bytes a layer keeps for its backward pass (the planner's activations) and
the elements Megatron's tensor parallelism all-reduces (the ledger's tensor minimum).
Models declare what they are; the formulas, and all they know of tensor and context
parallelism, are here. A model that declares no dims gives its own figures
(ModelSpec.activation_bytes, .tensor_elements), which win.
"""

from __future__ import annotations

import math

from jaxpar.config.registry import BlockKind, ModelDims, ModelSpec
from jaxpar.errors import ConfigError
from jaxpar.names import LORA_A, LORA_B, LORA_RANK
from jaxpar.parallel.sharding import over_tensor


def kept_bytes(d: ModelDims, tensor: int, scores: bool = True, context: int = 1) -> float:
    """Bytes one layer keeps for its backward pass per sequence, 16-bit, on a device
    holding 1/context of the sequence's tokens and 1/tensor of the split dims; `scores`:
    whether its attention keeps the [S, S] scores (else their fp32 softmax statistics)."""
    s = d.seq_len
    if d.block is BlockKind.GPT:
        # Korthikanti et al.: 34 s h + 5 a s^2 in 16-bit, the tensor-split parts divided
        # by the degree; a fused or blocked attention keeps 4 a s bytes of statistics
        kept = 5 * d.heads * s * s if scores else 4 * d.heads * s
        return (s * d.embed * (10 + 24 / tensor) + kept / tensor) / context
    if d.block is BlockKind.MLP:
        # per position: the layer's input, LayerNorm's output and the hidden activation
        return s * (4 * d.embed + 3 * d.mlp / tensor) / context
    return _llama(d, tensor, scores, context)


def _llama(d: ModelDims, tensor: int, scores: bool, context: int) -> float:
    """The input and both norms' outputs, q/k/v before and after rotation, the repeated
    k/v, the scores against every key and probabilities (`scores`; else their fp32
    softmax statistics, 2 16-bit units a head), the attention output; gate, up,
    silu(gate) and the product (with experts: of each slot the device runs, 1/context of
    the capacity, and each slot's input, the router's logits and probabilities; split
    over context, of the whole sequence, gathered, and the output's part; dropless, of
    each of a token's k choices)."""
    tokens = d.seq_len / context
    kv = d.kv_heads * d.head_dim
    kv_split = tensor if d.kv_heads % tensor == 0 else 1
    mlp = 4 * d.mlp / tensor
    if d.experts:  # the mean block's: n - 1 dense, one sparse
        x, every = d.experts, d.layers // d.experts.layers
        if x.dropless:  # each token's k (token, choice) rows; routed where they are
            sparse = x.per_token * (d.embed + mlp) + 2 * x.experts
        else:
            sparse = x.experts * x.held(context) / tokens * (d.embed + mlp)
            sparse += 2 * x.experts * context + (2 * d.embed * context if context > 1 else 0)
        mlp = ((every - 1) * mlp + sparse) / every
    per_token = 3 * d.embed + 6 * d.embed / tensor + mlp + 4 * kv / kv_split
    attention = 2 * d.heads * (d.seq_len if scores else 1) / tensor
    return 2 * tokens * (per_token + attention)


def megatron_elements(d: ModelDims, rows: int, tensor: int, frozen: bool = False) -> float:
    """Elements Megatron all-reduces over `tensor` per micro-batch of `rows` sequences:
    per block its row-split outputs (forward) and its column-split inputs (backward): o
    and down, the fused q/k/v and gate/up for an attention block, one MLP's each way
    for an MLP block; the vocab-split embedding (forward) and head (backward); and,
    unless the weights are `frozen` (an adapter run's base), the gradients of the k and
    v weights of key/value heads that `tensor` does not divide."""
    per_block = 2 if d.block is BlockKind.MLP else 4
    acts = (per_block * d.layers + 2) * rows * d.seq_len * d.embed
    if d.block is not BlockKind.LLAMA or frozen or d.kv_heads % tensor == 0:
        return acts
    return acts + d.layers * 2 * kv_summed(d.embed * d.kv_heads * d.head_dim, d.kv_heads, tensor)


def kv_summed(whole: float, kv_heads: int, t: int) -> float:
    """A gradient of `whole` elements over key/value heads that `t` does not divide, in
    all-reduce elements (2(t-1)/t each on the wire). Such heads are whole on every device,
    each using its query heads' share, so the gradient is summed over `tensor`: where t
    is a multiple of kv_heads, each head's among the t / kv_heads devices that hold its
    query heads, then gathered; else over all t."""
    if t % kv_heads:
        return whole
    g = t // kv_heads
    wire = 2 * (g - 1) / g * whole / kv_heads + (kv_heads - 1) / kv_heads * whole
    return wire / (2 * (t - 1) / t)


def activation_bytes(
    spec: ModelSpec, model, seq_len: int, tensor: int, scores: bool, context: int
) -> float:
    """A registered model's bytes kept per layer and sequence (kept_bytes), or its own
    figure where it gives one."""
    if spec.activation_bytes is not None:
        return spec.activation_bytes(model, seq_len, tensor, scores, context)
    if spec.dims is None:
        raise ConfigError(
            f"model.name={spec.name}: its ModelSpec declares neither `dims` nor "
            "`activation_bytes`; the planner needs one of them to count its activations"
        )
    return kept_bytes(spec.dims(model, seq_len), tensor, scores, context)


def tensor_elements(problem, rows: int, tensor: int) -> float | None:
    """What `problem`'s model all-reduces over `tensor` per micro-batch of `rows`
    sequences: its own count, or megatron_elements of its dims (with LoRA adapters, of
    its frozen base, and the adapters' own: lora_elements); None where neither is known
    (a model given in Python)."""
    if problem.tensor_elements is not None:
        return problem.tensor_elements(rows, tensor)
    if problem.dims is None:
        return None
    adapters = lora_elements(problem, rows, tensor)
    if adapters is None:
        return megatron_elements(problem.dims, rows, tensor)
    return megatron_elements(problem.dims, rows, tensor, frozen=True) + adapters


def lora_elements(problem, rows: int, t: int) -> float | None:
    """What LoRA adapters (jaxpar.adapters.lora: A [*stacked, *in, r] and B [*stacked, r,
    *out], named after their W's dims) add to the tensor all-reduces of a micro-batch of
    `rows` sequences: their gradients that are partial over `tensor`; None without any.
    A of a column-split W (its outputs split, its inputs whole) is whole on every device
    and used by each device's share, so its gradient is summed; fewest elements: the
    gradient, or the tokens' [tokens, r] product's, whichever is smaller. A and B of a W
    that stays whole because `tensor` does not divide its key/value heads are both summed
    (B as the heads' weights are: kv_summed). A row-split W's adapters add nothing: x A is
    partial, summed with W's own output."""
    names, shapes = problem.names, problem.shapes
    pairs = [k[: -len(LORA_A)] for k in names if k.endswith(f"/{LORA_A}")]
    if not pairs:
        return None
    total = 0.0
    for w in pairs:
        a, b = shapes[w + LORA_A].shape, shapes[w + LORA_B].shape
        b_names = names[w + LORA_B]
        stacked = b_names.index(LORA_RANK)
        cut, rank = len(a) - 1, a[-1]
        split_in, _ = over_tensor(names[w + LORA_A][stacked:cut], a[stacked:cut], t)
        split_out, whole = over_tensor(b_names[stacked + 1 :], b[stacked + 1 :], t)
        if split_in or not (split_out or whole):
            continue
        layers = math.prod(a[:stacked])
        total += min(math.prod(a), layers * rows * problem.dims.seq_len * rank)
        if whole and not split_out:
            total += kv_summed(math.prod(b), problem.dims.kv_heads, t)
    return total
