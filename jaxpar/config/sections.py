"""The configuration: frozen, keyword-only sections (parallel, model, adapter, train, muon,
dpo, grpo, data, checkpoint, distributed), each key declared on its field
(jaxpar.config.options) and checked when the section is built. Presets and KEY=VALUE
overrides are read by jaxpar.config.presets; checks across sections and against the mesh
are jaxpar.parallel.layout_checks'.
"""

from __future__ import annotations

import enum
import inspect
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from jaxpar.config import registry
from jaxpar.config.options import Range, Section, declared, key, near, shown
from jaxpar.errors import ConfigError


class Schedule(enum.StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


class Remat(enum.StrEnum):
    NONE = "none"
    FULL = "full"
    OFFLOAD = "offload"


class DpCollective(enum.StrEnum):
    XLA = "xla"
    RING = "ring"
    SERVER = "server"


class ContextStrategy(enum.StrEnum):
    ALL_GATHER = "all_gather"
    ULYSSES = "ulysses"


class DpSync(enum.StrEnum):
    GRADS = "grads"
    PARAMS = "params"


class Offload(enum.StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_PARAMS = "optimizer+params"


class Precision(enum.StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"


class ReduceDtype(enum.StrEnum):
    FP32 = "fp32"
    COMPUTE = "compute"


class Source(enum.StrEnum):
    CORPUS = "corpus"
    FILE = "file"
    SYNTHETIC = "synthetic"
    TOKENS = "tokens"


class TokenDtype(enum.StrEnum):
    UINT16 = "uint16"
    UINT32 = "uint32"


class Optimizer(enum.StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"
    MUON = "muon"


class Packing(enum.StrEnum):
    AUTO = "auto"
    DOCUMENTS = "documents"
    STREAM = "stream"


class Order(enum.StrEnum):
    EPOCHS = "epochs"
    RANDOM = "random"


class LossMask(enum.StrEnum):
    AUTO = "auto"
    TRUE = "true"
    FALSE = "false"


class AdapterKind(enum.StrEnum):
    NONE = "none"
    LORA = "lora"


class BaseStorage(enum.StrEnum):
    SAME = "same"
    BF16 = "bf16"
    INT8 = "int8"
    NF4 = "nf4"


class Objective(enum.StrEnum):
    LM = "lm"
    DPO = "dpo"
    GRPO = "grpo"
    REWARD = "reward"


class GrpoLoss(enum.StrEnum):
    GRPO = "grpo"
    DAPO = "dapo"
    DR_GRPO = "dr_grpo"
    GSPO = "gspo"


class ScaleRewards(enum.StrEnum):
    AUTO = "auto"
    GROUP = "group"
    NONE = "none"


class DpoLoss(enum.StrEnum):
    SIGMOID = "sigmoid"
    IPO = "ipo"


class Reference(enum.StrEnum):
    AUTO = "auto"
    COPY = "copy"
    ADAPTERS_OFF = "adapters-off"
    PRECOMPUTE = "precompute"


class OnNonfinite(enum.StrEnum):
    STOP = "stop"
    SKIP = "skip"


class OnSpike(enum.StrEnum):
    OFF = "off"
    SKIP = "skip"
    ROLLBACK = "rollback"


Degree = Annotated[
    int, Range(1, 65536, "a degree is a count of devices; -1 takes the rest", rest=True)
]
Steps = Annotated[int, Range(1, 10**9, "a count of steps")]


@dataclass(frozen=True, kw_only=True)
class Parallel(Section):
    SECTION: ClassVar[str] = "parallel"
    replica: Degree = key(
        1,
        (
            "degree of the `replica` axis (outermost: across hosts): copies of a ZeRO group; data "
            "parallelism is replica x data, ZeRO splits state over `data` only"
        ),
    )
    data: Degree = key(-1, "degree of the `data` axis; -1 = all devices left over")
    expert: Degree = key(
        1,
        (
            "degree of the `expert` axis: a mixture's experts split over it, tokens sent to "
            "them by all-to-all (expert parallelism); a data axis for everything else"
        ),
    )
    pipeline: Degree = key(1, "degree of the `pipeline` axis: stages of the layer stack")
    context: Degree = key(
        1, "degree of the `context` axis: each sequence split over it (context parallelism)"
    )
    tensor: Degree = key(1, "degree of the `tensor` axis (Megatron column/row splits)")
    context_strategy: ContextStrategy = key(
        ContextStrategy.ALL_GATHER,
        (
            "how attention sees the whole sequence under context parallelism: all_gather (keys "
            "and values gathered over context each layer) | ulysses (all-to-all from sequence "
            "to heads and back)"
        ),
    )
    context_balance: bool = key(
        True,
        (
            "reorder each sequence into 2 x context chunks, device i holding chunks i and "
            "2C-1-i, so that causal attention's work is even over context"
        ),
    )
    sequence_parallel: bool = key(
        False,
        (
            "Megatron sequence parallelism (needs tensor > 1): norms and residual adds split "
            "by sequence over tensor; each tensor all-reduce becomes reduce-scatter + all-gather"
        ),
    )
    zero: Literal[0, 1, 2, 3] = key(
        0, "ZeRO stage over `data`: 0 none, 1 optimizer state, 2 +gradients, 3 +parameters"
    )
    microbatches: Annotated[int, Range(1, 65536, "micro-batches per data shard")] = key(
        1, "pipeline micro-batches each data shard's batch is split into"
    )
    schedule: Schedule = key(
        Schedule.ONE_F_ONE_B,
        "pipeline schedule: gpipe | 1f1b | interleaved | zb-h1 | zbv | dualpipev",
    )
    virtual_stages: Annotated[int, Range(1, 1024, "layer chunks per pipeline device")] = key(
        1, "chunks of layers per device (schedule=interleaved)"
    )
    remat: Remat = key(
        Remat.NONE,
        (
            "activation checkpointing of each layer: none | full (keep its input, recompute the "
            "rest) | offload (full, with the kept inputs in host memory)"
        ),
    )
    dp_collective: DpCollective = key(
        DpCollective.XLA, "how gradients are reduced over data: xla | ring | server"
    )
    bucket_mb: Annotated[float, Range(0, 65536, "a bucket in MiB, at most 64 GiB", True)] = key(
        25.0, "ring/server: fuse gradient leaves into buckets of this size"
    )
    offload: Offload = key(
        Offload.NONE,
        (
            "none | optimizer (Adam state + fp32 master weights on the host, update there) | "
            "optimizer+params (ZeRO-3 only: also the stored parameter shards, fetched per layer)"
        ),
    )
    dp_sync: DpSync = key(
        DpSync.GRADS,
        (
            "what data parallelism keeps in sync: grads (all-reduced every step) | params (each "
            "device takes sync_every local AdamW steps on its own rows, then the parameters are "
            "averaged over data: local SGD; with an outer optimizer, DiLoCo)"
        ),
    )
    sync_every: Annotated[int, Range(1, 10**6, "local steps between averages")] = key(
        8, "dp_sync=params: local steps between averages (MaxText's DiLoCo uses 36)"
    )
    outer_lr: Annotated[float, Range(0, 10, "an outer rate; 1 = plain averaging", True)] = key(
        1.0,
        (
            "dp_sync=params: the outer (Nesterov SGD) learning rate on the averaged change of the "
            "parameters; 1 with no momentum is plain averaging (DiLoCo: 0.7, MaxText 0.3)"
        ),
    )
    outer_momentum: Annotated[float, Range(0, 0.999, "a momentum below 1")] = key(
        0.0, "dp_sync=params: the outer Nesterov momentum; 0 = none (DiLoCo and MaxText: 0.9)"
    )


@dataclass(frozen=True, kw_only=True)
class Model(Section):
    """The shipped models' dims; a model with keys of its own declares a subclass and
    names it in its registry entry (jaxpar.config.registry)."""

    SECTION: ClassVar[str] = "model"
    name: str = field(
        default_factory=lambda: registry.default_name(),
        metadata={"help": "the model: {models}, or one of yours (jaxpar.register_model)"},
    )
    layers: Annotated[int, Range(1, 10_000, "blocks in the stack")] = key(
        4, "number of scanned blocks"
    )
    embed: Annotated[int, Range(1, 2**20, "the residual width; the largest models use ~25k")] = key(
        64, "width of the residual stream"
    )
    heads: Annotated[int, Range(1, 2**14, "attention heads")] = key(8, "attention heads (gpt)")
    mlp: Annotated[int, Range(1, 2**22, "the feed-forward width")] = key(
        256, "hidden width of the feed-forward layer"
    )
    vocab: Annotated[int, Range(1, 2**24, "output classes")] = key(
        256, "output classes; byte-level text needs 256"
    )
    init: str = key(
        "",
        (
            "where the parameters start: empty = random (train.seed); hf:DIR = a Hugging Face "
            "checkpoint directory (config.json, *.safetensors), its config.json read into model.*"
        ),
    )

    def __post_init__(self):
        if self.name not in registry.names():
            raise ConfigError(
                f"model.name={shown(self.name)}: no such model; choose one of "
                f"{registry.names()}{near(self.name, registry.names())}, or register yours "
                "(jaxpar.register_model)"
            )
        wanted = registry.config_class(self.name) or Model
        if not isinstance(self, wanted):
            raise ConfigError(
                f"model.name={self.name}: its keys are declared by {wanted.__qualname__}; "
                f"build the model section as {wanted.__qualname__}(...), not "
                f"{type(self).__qualname__}(...)"
            )
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class Adapter(Section):
    """Low-rank adapters (LoRA): W + (alpha/rank) B A on the `targets`, the base frozen
    (jaxpar.adapters)."""

    SECTION: ClassVar[str] = "adapter"
    kind: AdapterKind = key(
        AdapterKind.NONE, "none (train every weight) | lora (train low-rank adapters, base frozen)"
    )
    rank: Annotated[int, Range(1, 65536, "an adapter's rank, e.g. 8 to 64")] = key(
        8, "the adapters' rank r"
    )
    alpha: Annotated[float, Range(0, 1e6, "a scale numerator, e.g. 16", True)] = key(
        16.0, "the adapters' scale is alpha / rank, as PEFT's lora_alpha"
    )
    dropout: Annotated[float, Range(0, 0.999, "a probability below 1")] = key(
        0.0, "dropout on an adapter's input (PEFT's lora_dropout)"
    )
    targets: str = key(
        "",
        (
            "comma-separated projections that carry an adapter, in PEFT's names (q_proj, k_proj, "
            "v_proj, o_proj, gate_proj, up_proj, down_proj; a mixture's experts by their own; "
            "latent attention's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj), or the "
            "dotted end of a path (shared_experts.gate_proj: the shared expert's alone); "
            "empty = PEFT's default for the family (q_proj,v_proj)"
        ),
    )
    base: BaseStorage = key(
        BaseStorage.SAME,
        (
            "the frozen base's storage: same (as train.precision stores weights: fp32) | bf16 | "
            "int8 (a scale per output channel) | nf4 (4-bit NormalFloat, a scale per block of "
            "64: QLoRA)"
        ),
    )
    init: str = key(
        "", "where the adapters start: empty = A random, B zero; peft:DIR = an adapter PEFT wrote"
    )


@dataclass(frozen=True, kw_only=True)
class Train(Section):
    SECTION: ClassVar[str] = "train"
    steps: Steps = key(10, "optimizer steps")
    batch_size: Annotated[int, Range(1, 2**24, "sequences per optimizer step")] = key(
        16, "global sequences per optimizer step (all shards, all micro-batches)"
    )
    seq_len: Annotated[int, Range(1, 2**20, "tokens per sequence")] = key(64, "tokens per sequence")
    optimizer: Optimizer = key(
        Optimizer.ADAMW,
        (
            "adamw (b1 0.9, b2 0.95) | sgd (plain, no momentum); both decay matrices only | muon "
            "(each hidden matrix's momentum orthogonalized, AdamW for the rest; the muon.* keys)"
        ),
    )
    lr: Annotated[float, Range(0, 10, "usual AdamW rates are 1e-5 to 1e-2", True)] = key(
        3e-3, "peak learning rate of the warm-up + cosine schedule"
    )
    warmup: Annotated[int, Range(0, 10**9, "warm-up steps")] = key(
        2, "warm-up steps (linear from 0 to lr)"
    )
    weight_decay: Annotated[float, Range(0, 10, "the AdamW decay per unit of learning rate")] = key(
        0.1, "AdamW decay, applied to matrices only"
    )
    seed: Annotated[int, Range(0, 2**32 - 1, "seeds are 32-bit unsigned integers")] = key(
        0, "seeds parameters and data"
    )
    grad_accum: Annotated[int, Range(1, 65536, "micro-batches accumulated per step")] = key(
        1, "micro-batches accumulated per optimizer step"
    )
    precision: Precision = key(
        Precision.FP32, "fp32 | bf16 (bf16 compute; fp32 master parameters and Adam state)"
    )
    grad_reduce_dtype: ReduceDtype = key(
        ReduceDtype.FP32,
        (
            "the dtype gradients are summed over `data` in: fp32 | compute (train.precision's: "
            "half the bytes in bf16, at bf16's rounding of each device's gradient and the sum)"
        ),
    )
    clip_norm: Annotated[float, Range(0, 1e9, "a gradient norm; 0 disables clipping")] = key(
        1.0, "global gradient-norm clip; 0 disables it"
    )
    log_every: Steps = key(1, "write a metrics row every N steps")
    eval_every: Annotated[int, Range(0, 10**9, "steps between evaluations; 0 = off")] = key(
        0,
        (
            "every N steps, the mean loss over eval_batches held-out batches (never trained on: "
            "the corpus's or a text file's last tenth, a prepared folder's val.bin); 0 = never"
        ),
    )
    eval_batches: Annotated[int, Range(1, 10**6, "held-out batches per evaluation")] = key(
        4, "batches of train.batch_size rows in each evaluation"
    )
    eval_tasks: str = key(
        "",
        (
            "comma-separated lm-eval tasks scored during training (lm-eval's names, jaxpar's "
            "jaxpar_arithmetic_mc / jaxpar_arithmetic_gen, task YAML files or folders; `jaxpar "
            "eval` runs them after), with the tokenizer data.path was prepared with; their "
            "metrics go in metrics.jsonl and TensorBoard as eval/TASK/METRIC; empty = none"
        ),
    )
    eval_tasks_every: Annotated[
        int, Range(0, 10**9, "steps between task scores; 0 = the last step only")
    ] = key(0, "score train.eval_tasks every N steps (and at the last); 0 = at the last step")
    eval_tasks_limit: Annotated[int, Range(0, 10**9, "documents per task; 0 = all")] = key(
        0, "score the first N documents of each of train.eval_tasks; 0 = all of them"
    )
    loss_mask: LossMask = key(
        LossMask.AUTO,
        (
            "auto (true where the data has a loss mask: a `jaxpar prepare-data --format chat` "
            "folder) | true (train only the targets the mask marks: answers, not prompts) | "
            "false (train every target)"
        ),
    )
    objective: Objective = key(
        Objective.LM,
        (
            "lm (next-token loss) | dpo (Direct Preference Optimization on pairs from `jaxpar "
            "prepare-data --format preference`; the dpo.* keys) | grpo (Group Relative Policy "
            "Optimization on the policy's own completions to prompts from `jaxpar prepare-data "
            "--format prompts`, scored by grpo.reward; the grpo.* keys) | reward (a reward "
            "model: a scalar head on each answer's last id, Bradley-Terry's loss on the pairs "
            "of `jaxpar prepare-data --format preference`)"
        ),
    )
    on_nonfinite: OnNonfinite = key(
        OnNonfinite.STOP,
        (
            "a step whose loss or gradients are not finite: stop (save the last good state, exit "
            "3) | skip (leave the state as it was, count it in the metrics' `skipped`)"
        ),
    )
    on_spike: OnSpike = key(
        OnSpike.OFF,
        (
            "a step whose loss spikes (over the mean of the last spike_window applied steps' "
            "losses by more than spike_sigmas standard deviations): off | skip (leave the state "
            "as it was, the batch consumed) | rollback (return to the newest checkpoint before "
            "it and skip the batches since, the spiking one included)"
        ),
    )
    spike_sigmas: Annotated[float, Range(0.1, 1e6, "standard deviations over the mean")] = key(
        6.0, "how many standard deviations over the window's mean loss a spike is (train.on_spike)"
    )
    spike_window: Annotated[int, Range(2, 100_000, "applied steps")] = key(
        128,
        "the applied steps whose losses a spike is judged against; judged from half full on",
    )
    hang_timeout_s: Annotated[float, Range(0, 7 * 86400, "seconds; 0 = off")] = key(
        0.0,
        (
            "a step (its collectives, save, evaluation and hooks) that makes no progress for "
            "this long ends the process with its stacks in its log (exit 4), which `jaxpar "
            "launch --max-restarts` restarts from; 0 = wait for ever"
        ),
    )
    check_replicas_every: Annotated[int, Range(0, 10**9, "steps between checks; 0 = off")] = key(
        0,
        (
            "every N steps, check that every copy of each parameter leaf (over replica and data, "
            "and tensor/pipeline where not split) is bit-identical; on a difference save and stop "
            "(exit 3), naming the leaf and the devices. 0 = never"
        ),
    )
    unroll: Annotated[int, Range(1, 10_000, "layers per iteration of the layer scan")] = key(
        1,
        (
            "layers per iteration of the layer scan (lax.scan's unroll): fewer, longer loop "
            "iterations, at a compile time that grows with it (docs/benchmarks.md, "
            '"Speed against PyTorch")'
        ),
    )
    profile_steps: str = key(
        "",
        (
            "A:B = profile steps A to B (1-based, both included) with jax.profiler into <run "
            "directory>/profile, for TensorBoard or Perfetto; empty = never"
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        profile_range(self)


@dataclass(frozen=True, kw_only=True)
class Muon(Section):
    """Muon (train.optimizer=muon; jaxpar.step.muon): defaults as optax.contrib.muon's,
    but for the update's scale (Moonlight's, so that AdamW's learning rate carries over)."""

    SECTION: ClassVar[str] = "muon"
    momentum: Annotated[float, Range(0, 0.9999, "a decay below 1")] = key(
        0.95, "the momentum's decay (optax's beta)"
    )
    nesterov: bool = key(True, "orthogonalize the Nesterov look-ahead of the momentum")
    ns_steps: Annotated[int, Range(1, 100, "Newton-Schulz iterations, usually 5")] = key(
        5, "Newton-Schulz iterations per step"
    )
    ns_coeffs: str = key(
        "3.4445,-4.7750,2.0315",
        "a, b, c of the quintic Newton-Schulz step aX + b(XX')X + c(XX')^2X",
    )
    weight_decay: Annotated[float, Range(0, 10, "a decay per unit of learning rate")] = key(
        0.0, "decay of the Muon matrices (decoupled, times the learning rate)"
    )
    scale: Annotated[float, Range(0, 10, "an RMS; 0.2 matches AdamW's")] = key(
        0.2,
        (
            "the update's RMS: scale x sqrt(max(fan-in, fan-out)) (Moonlight: 0.2 makes it "
            "AdamW's, so train.lr carries over); 0 = Keller Jordan's sqrt(max(1, fan-out/fan-in))"
        ),
    )
    adam_lr: Annotated[float, Range(0, 10, "a learning rate; 0 = train.lr")] = key(
        0.0, "peak learning rate of the AdamW group (embeddings, head, norms, biases); 0 = train.lr"
    )
    qk_clip: Annotated[float, Range(0, 1e6, "a logit, e.g. 100 (Kimi K2's); 0 = off")] = key(
        0.0,
        (
            "MuonClip: after each step, scale the query/key weights of every attention head "
            "whose largest logit passed this back to it (Kimi K2's QK-clip); 0 = off"
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        ns_coeffs(self.ns_coeffs)

    @property
    def coeffs(self) -> tuple[float, float, float]:
        return ns_coeffs(self.ns_coeffs)


def ns_coeffs(text: str) -> tuple[float, float, float]:
    """muon.ns_coeffs's three numbers, or one line saying what it must be."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(
            f"muon.ns_coeffs={text!r}: it must be three numbers a,b,c (the Newton-Schulz step "
            "aX + b(XX')X + c(XX')^2X), e.g. muon.ns_coeffs=3.4445,-4.7750,2.0315 (the default)"
        )
    return values


@dataclass(frozen=True, kw_only=True)
class Dpo(Section):
    """Direct Preference Optimization (train.objective=dpo; jaxpar.objectives.dpo)."""

    SECTION: ClassVar[str] = "dpo"
    beta: Annotated[float, Range(0, 1e6, "a positive strength, e.g. 0.1", True)] = key(
        0.1, "how far the policy may move from the reference (TRL's beta; IPO's tau)"
    )
    loss: DpoLoss = key(
        DpoLoss.SIGMOID,
        "sigmoid (DPO: -log sigmoid(beta x margin)) | ipo (IPO: (margin per token - 1/(2 beta))^2)",
    )
    label_smoothing: Annotated[float, Range(0, 0.499, "a flip probability below 0.5")] = key(
        0.0, "conservative DPO (cDPO): the chance that a pair's preference is flipped"
    )
    reference: Reference = key(
        Reference.AUTO,
        (
            "the model the policy is held to: auto (adapters-off for fresh adapters, else copy) | "
            "copy (a frozen copy of the trained weights at the start) | adapters-off (the base, "
            "adapter.kind=lora) | precompute (its log-probabilities computed once before "
            "training and stored beside the data: no reference held)"
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.label_smoothing and self.loss is DpoLoss.IPO:
            raise ConfigError(
                f"dpo.label_smoothing={self.label_smoothing} with dpo.loss=ipo: label smoothing "
                "is conservative DPO's (dpo.loss=sigmoid); drop it, or use dpo.loss=sigmoid"
            )


@dataclass(frozen=True, kw_only=True)
class Grpo(Section):
    """Group Relative Policy Optimization (train.objective=grpo; jaxpar.objectives.grpo).
    train.batch_size counts completions: batch_size / group prompts a rollout."""

    SECTION: ClassVar[str] = "grpo"
    reward: str = key(
        "",
        (
            "the reward functions, comma-separated: PATH.py:FUNCTION or MODULE:FUNCTION, each "
            "called as TRL calls one, f(prompts, completions, **fields) -> a float per "
            "completion (fields: the prompt file's other keys); shipped: "
            "jaxpar.objectives.rewards:exact_answer and jaxpar.objectives.rewards:format_reward"
        ),
    )
    reward_weights: str = key(
        "", "a weight per reward function, comma-separated (empty: 1 each); the reward: their sum"
    )
    group: Annotated[
        int, Range(2, 4096, "completions per prompt; a group of 1 has no baseline")
    ] = key(4, "completions sampled for each prompt (TRL's num_generations)")
    max_new_tokens: Annotated[int, Range(1, 1 << 20, "ids a completion holds at most")] = key(
        32, "the longest completion, in ids (TRL's max_completion_length)"
    )
    temperature: Annotated[float, Range(0, 100, "a sampling temperature", True)] = key(
        1.0, "sampling temperature of the rollouts"
    )
    top_p: Annotated[float, Range(0, 1, "a share of the probability mass", True)] = key(
        1.0, "nucleus sampling: draw from the smallest set of ids holding this much mass"
    )
    epsilon: Annotated[float, Range(0, 10, "a clip range, e.g. 0.2", True)] = key(
        0.2, "the ratio's clip range below 1 (and above it, unless grpo.epsilon_high)"
    )
    epsilon_high: Annotated[float, Range(0, 10, "a clip range, e.g. 0.28; 0 = grpo.epsilon")] = key(
        0.0, "the ratio's clip range above 1 (DAPO's clip-higher); 0 = grpo.epsilon"
    )
    beta: Annotated[float, Range(0, 1e6, "a KL coefficient, >= 0")] = key(
        0.0,
        (
            "the k3 KL penalty's weight against the reference (the model at the start: a copy, "
            "or with adapters the base with the start's adapters); 0 holds no reference"
        ),
    )
    kl_correction: bool = key(
        True,
        (
            "multiply each token's KL by its importance ratio, which makes the KL's gradient "
            "unbiased off-policy (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default)"
        ),
    )
    iterations: Annotated[int, Range(1, 1024, "optimizer steps per rollout")] = key(
        1, "policy updates on each batch of rollouts (TRL's num_iterations, mu)"
    )
    loss: GrpoLoss = key(
        GrpoLoss.DAPO,
        (
            "grpo (each completion's token mean, then the mean over completions) | dapo (the "
            "mean over every completion token of the batch) | dr_grpo (the sum over tokens / "
            "(completions x grpo.max_new_tokens)) | gspo (Qwen3's GSPO: one importance ratio "
            "a completion, its tokens' mean log-ratio, clipped, then grpo's mean; the paper "
            "clips at grpo.epsilon=3e-4 grpo.epsilon_high=4e-4)"
        ),
    )
    scale_rewards: ScaleRewards = key(
        ScaleRewards.AUTO,
        (
            "advantages: group (reward - group mean, over the group's std) | none (reward - "
            "group mean) | auto (none for grpo.loss=dr_grpo, else group)"
        ),
    )
    generate_layout: str = key(
        "auto",
        (
            "the rollouts' layout on the same devices: auto (tensor as `jaxpar generate` "
            "chooses it, the prompts over the rest) | tensor=T | data=D,tensor=T"
        ),
    )
    staleness: Annotated[int, Range(0, 1024, "policy updates a rollout may lag")] = key(
        0,
        (
            "bounded staleness: the rollouts step t trains on are sampled by the policy of "
            "step t - k (the first k by the start's), while the steps between run; the ratio "
            "is taken against the sampler's stored log-probabilities; 0 = on-policy"
        ),
    )
    rollout_devices: Annotated[int, Range(0, 65536, "a count of devices")] = key(
        0,
        (
            "disaggregated rollouts: the first N devices generate, the rest train "
            "(parallel.* lays out the rest), the weights sent to them after each update; "
            "with grpo.staleness >= 1 the two run at once; 0 = rollouts on the trainer's devices"
        ),
    )
    env: str = key(
        "",
        (
            "multi-turn episodes: PATH.py:CLASS or MODULE:CLASS, an environment with "
            "reset(prompt) and step(text) -> (observation, reward, done), its observations "
            "the chat template's tool turns (never trained on), its rewards summed into the "
            "episode's beside grpo.reward's; shipped: jaxpar.objectives.episodes:Calculator; "
            "empty = one turn"
        ),
    )
    max_turns: Annotated[int, Range(1, 64, "policy turns an episode")] = key(
        4, "grpo.env: the policy's turns an episode holds at most"
    )

    @property
    def clip_high(self) -> float:
        return self.epsilon_high or self.epsilon

    @property
    def scaled(self) -> bool:
        """Whether advantages are divided by their group's std."""
        if self.scale_rewards is ScaleRewards.AUTO:
            return self.loss is not GrpoLoss.DR_GRPO
        return self.scale_rewards is ScaleRewards.GROUP


@dataclass(frozen=True, kw_only=True)
class Data(Section):
    SECTION: ClassVar[str] = "data"
    source: Source = key(
        Source.CORPUS,
        (
            "corpus (embedded stdlib text) | file (a text file, as bytes) | synthetic | tokens "
            "(token ids on disk, memory-mapped: a `jaxpar prepare-data` folder, a flat binary file "
            "or a .npy)"
        ),
    )
    path: str = key("", "the text file (source=file) or the tokens (source=tokens)")
    dtype: TokenDtype = key(
        TokenDtype.UINT16,
        "source=tokens, a flat binary file: the dtype of its ids (nanoGPT writes uint16)",
    )
    packing: Packing = key(
        Packing.AUTO,
        (
            "auto (documents where a prepared folder has a document index, else stream) | "
            "documents (each document in a window attends only to itself, its positions from 0, "
            "its first token not predicted from the one before) | stream (one stream of "
            "tokens, as nanoGPT)"
        ),
    )
    order: Order = key(
        Order.EPOCHS,
        (
            "epochs (each epoch visits every window of seq_len + 1 ids once, in an order of "
            "the seed and the epoch) | random (windows at random starts, with replacement: "
            "the batches of earlier releases, reproduced)"
        ),
    )
    mixture: str = key(
        "",
        (
            "a YAML file of prepared folders with weights, and phases that change them from a "
            "step on (docs: data.md); read in epochs, with data.source=tokens implied"
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Section):
    SECTION: ClassVar[str] = "checkpoint"
    every: Annotated[int, Range(0, 10**9, "steps between checkpoints; 0 = at the end only")] = key(
        0, "save every N steps (asynchronously); 0 = only at the end (checkpoint.final)"
    )
    final: bool = key(
        True,
        (
            "save the final state when a run reaches its last step, so that it can be exported "
            "or resumed; false keeps none then unless checkpoint.every asks (a stop by a "
            "signal still saves, to resume from)"
        ),
    )
    keep: Annotated[int, Range(1, 10_000, "checkpoints kept")] = key(
        3, "how many of the newest checkpoints to keep"
    )
    dir: str = key("", "where; empty = <run directory>/checkpoints")
    compress: bool = key(
        False,
        (
            "zstd the saved arrays: trained float weights shrink by under a tenth, for about "
            "4x a save's CPU time (which the steps beside an asynchronous save share)"
        ),
    )
    local_dir: str = key(
        "",
        (
            "a fast local tier (e.g. /dev/shm/<run> or a local SSD) for the frequent saves: "
            "every checkpoint.every steps go there, every checkpoint.shared_every steps and "
            "the last to checkpoint.dir; a run resumes from the newer of the two; empty = "
            "one tier"
        ),
    )
    shared_every: Annotated[int, Range(0, 10**9, "steps between shared saves")] = key(
        0,
        (
            "with checkpoint.local_dir: steps between the saves that go to the shared tier "
            "(checkpoint.dir), a multiple of checkpoint.every"
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        tiers(self)


@dataclass(frozen=True, kw_only=True)
class Distributed(Section):
    SECTION: ClassVar[str] = "distributed"
    timeout_s: Annotated[float, Range(0, 7 * 86400, "seconds, at most a week", True)] = key(
        300.0, "how long processes wait for each other to arrive"
    )


@dataclass(frozen=True, kw_only=True)
class Config:
    parallel: Parallel = field(default_factory=Parallel)
    model: Model = field(default_factory=Model)
    adapter: Adapter = field(default_factory=Adapter)
    train: Train = field(default_factory=Train)
    muon: Muon = field(default_factory=Muon)
    dpo: Dpo = field(default_factory=Dpo)
    grpo: Grpo = field(default_factory=Grpo)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    distributed: Distributed = field(default_factory=Distributed)

    def __post_init__(self):
        for section, cls in declared(Config).items():
            if not isinstance(getattr(self, section), cls):
                raise ConfigError(
                    f"{section}: expected a jaxpar.{cls.__name__}(...), got "
                    f"{type(getattr(self, section)).__name__}"
                )


def given(fn, cfg: Config, *args, **named):
    """fn(*args, **named), each further parameter of fn that names a section of `cfg`
    (`parallel`, `train`, ...) handed that section, and one named `config` the whole of
    it: what a function reads, said by its own signature."""
    wanted = inspect.signature(fn).parameters.keys() - named.keys()
    sections = {n: getattr(cfg, n) for n in wanted & declared(Config).keys()}
    whole = {"config": cfg} if "config" in wanted else {}
    return fn(*args, **named, **sections, **whole)


def computed_model(model: Model, objective: Objective) -> Model:
    """The model.* section a run computes with: for a DPO or GRPO run, a mixture's
    load-balance loss left out of the per-token losses its log-probabilities are read
    from (TRL adds it to the loss; here it is reported, moe/balance_loss, not trained)."""
    scored = objective in (Objective.DPO, Objective.GRPO)
    if scored and getattr(model, "router_aux_loss", 0):
        return replace(model, router_aux_loss=0.0)
    return model


def tiers(ckpt: Checkpoint) -> None:
    """checkpoint.local_dir and shared_every, together and against checkpoint.every."""
    every, shared = ckpt.every, ckpt.shared_every
    if shared and not ckpt.local_dir:
        raise ConfigError(
            f"checkpoint.shared_every={shared} without checkpoint.local_dir: with one tier "
            "every save is shared; give checkpoint.local_dir=PATH (a fast local folder), or "
            "drop checkpoint.shared_every"
        )
    if not ckpt.local_dir:
        return
    if not every:
        raise ConfigError(
            f"checkpoint.local_dir={ckpt.local_dir} with checkpoint.every=0: the local tier "
            "holds the frequent saves; give checkpoint.every=N (e.g. 1), or drop "
            "checkpoint.local_dir"
        )
    if not shared or shared % every:
        near = every * max(1, round(shared / every)) if shared else 10 * every
        raise ConfigError(
            f"checkpoint.shared_every={shared} with checkpoint.local_dir: the saves that go "
            f"to the shared tier are some of the checkpoint.every={every} saves; give a "
            f"multiple of {every}, e.g. checkpoint.shared_every={near}"
        )
    if ckpt.dir and Path(ckpt.local_dir).absolute() == Path(ckpt.dir).absolute():
        raise ConfigError(
            f"checkpoint.local_dir={ckpt.local_dir} is checkpoint.dir: the two tiers need "
            "folders of their own; give the local tier a fast local folder"
        )


def profile_range(train: Train) -> tuple[int, int] | None:
    """train.profile_steps as (first, last) step, both included; None when empty."""
    if not train.profile_steps:
        return None
    first, sep, last = train.profile_steps.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        yaml_number = " (unquoted in YAML, 5:7 reads as the base-60 number 307: quote it)"
        raise ConfigError(
            f"train.profile_steps={shown(train.profile_steps)}: write FIRST:LAST, the steps "
            "to profile (1-based, both included), e.g. 5:7"
            + (yaml_number if train.profile_steps.isdigit() else "")
        )
    first, last = int(first), int(last)
    if not 1 <= first <= last <= train.steps:
        raise ConfigError(
            f"train.profile_steps={first}:{last}: give 1 <= FIRST <= LAST <= train.steps "
            f"({train.steps}); e.g. {min(5, train.steps)}:{min(7, train.steps)}"
        )
    return first, last
