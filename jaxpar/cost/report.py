"""The typed report of a run: what summary.json serialises and the console, bench and
tests read by attribute. Figures are per device, bytes unless named otherwise."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxpar.disk import human_bytes  # noqa: F401 (the report's figures are printed with it)


@dataclass(frozen=True)
class DeviceMemory:  # device memory
    params: int  # parameters the device holds between steps (a compute copy when offloaded)
    grads: int  # the fp32 gradient accumulator, as its gradient spec splits it
    opt_state: int
    temp: int  # the compiled step's temporaries (memory_analysis)
    base: int = 0  # of `params`: an adapter run's frozen base, as stored (adapter.base)
    reference: int = 0  # of `params`: DPO's copy of the trained leaves (dpo.reference=copy)


@dataclass(frozen=True)
class HostMemory:  # pinned_host
    params: int
    opt_state: int
    # layer inputs the program sends to the host for the backward pass (remat=offload),
    # counted in the traced step ...
    activations: int
    # ... and the host temporaries of the compiled step, where the compiler placed them
    # (XLA:CPU drops in-step placement: 0 there)
    temp: int


@dataclass(frozen=True)
class StateBytes:
    actual: int  # master parameters and optimizer state, device and host
    formula: float  # the ZeRO paper's figure for the stage
    ratio: float
    arguments: int  # the compiled step's argument bytes (state, step counter, batch rows)


@dataclass(frozen=True)
class KindTotals:
    count: int  # executions per step
    bytes: int  # buffer bytes per step
    wire_bytes: float  # bytes on the wire per device per step (ring factors)
    axes: dict[str, int]  # executions by the mesh axes their groups span


@dataclass(frozen=True)
class AxisComm:
    wire: float
    minimum: float | None  # None: no textbook figure for this axis here
    across_processes: float = 0.0  # of `wire`, what goes between processes (ring hops)


@dataclass(frozen=True)
class Comm:
    wire_bytes_per_device: float
    minimum_bytes_per_device: float  # over `ratio_axes`
    ratio: float | None  # wire over minimum, on the axes that have a minimum
    by_axis: dict[str, AxisComm]
    ratio_axes: list[str]
    busiest_device_bytes: float  # sent plus received by the busiest device
    unknown_trip_counts: int  # loops whose collectives were counted once
    assumes: str = ""  # what the minimum counts, and in which dtypes


@dataclass(frozen=True)
class Pipeline:
    stages: list[list[int]]  # layers each device holds
    schedule: str | None  # None: no pipeline
    bubble: float | None  # idle share of the schedule's tick table (None: table != compiled loop)
    bubble_formula: float
    chunks: list[list[int]] | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    ticks: int | None = None  # trip count of the compiled tick loop
    permute_bytes_per_device: float | None = None
    permute_minimum_per_device: float | None = None
    permute_ratio: float | None = None


@dataclass(frozen=True)
class ReplicaCheck:
    """What train.check_replicas_every costs: its compiled collectives, per device."""

    every: int  # steps between checks
    leaves: int  # parameter leaves held as copies somewhere
    wire_bytes_per_check: float
    collectives_per_check: int
    share_of_step_comm: float | None  # per step, against the step's own wire bytes


@dataclass(frozen=True)
class Report:
    config: dict  # the resolved config
    mesh: dict[str, int]
    devices: int
    strategy: str
    compile_s: float
    zero_unsplit_leaves: list[dict]
    # dims a rule splits only where it divides, left whole here, and why (GQA's kv heads)
    tensor_replicated: list[str]
    model_notes: list[str]  # the model's own notes on its keys (ModelSpec.notes)
    pipeline: Pipeline
    memory_per_device: DeviceMemory
    host_memory_per_device: HostMemory
    state_bytes: StateBytes
    collectives: dict[str, KindTotals]
    collective_counts: dict[str, int]  # executions per step by 'kind@axes'
    comm: Comm
    replica_check: ReplicaCheck | None = None  # (train.check_replicas_every > 0)
    # the XLA flags the step was compiled with (jaxpar.step.xla_flags: on a GPU only)
    xla_flags: dict = dataclasses.field(default_factory=dict)
    # model FLOPs per loss element, forward and backward, and how they were counted
    model_flops_per_token: float | None = None
    # train.optimizer=muon: the trained leaves of each group, {"muon": [...], "adamw": [...]}
    optimizer_groups: dict = dataclasses.field(default_factory=dict)
    # train.optimizer=muon: Newton-Schulz's FLOPs a step and temporaries, per device
    # (jaxpar.cost.newton_schulz), {"flops": ..., "temp_bytes": ..., "wire_bytes": ...}
    newton_schulz: dict = dataclasses.field(default_factory=dict)
    flops_counted: str = ""
    # after training
    checkpoint: str | None = None  # the newest saved state's folder (None: none saved)
    tokens_per_step: int | None = None
    final_loss: float | None = None
    eval_loss: float | None = None  # the last held-out loss (train.eval_every)
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    flops_per_s_per_device: float | None = None  # model FLOPs achieved
    peak_flops_per_device: float | None = None  # the device kind's (None: not known, a CPU)
    mfu: float | None = None  # achieved over peak

    def trained(self, **figures) -> Report:
        return dataclasses.replace(self, **figures)

    def to_json(self) -> dict:
        """summary.json: every field, nested dataclasses as objects."""
        return dataclasses.asdict(self)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])
