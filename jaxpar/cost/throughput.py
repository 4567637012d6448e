"""Model FLOPs, achieved FLOP/s and model FLOPs utilisation (MFU).

Model FLOPs per token are the model's own count (`ModelSpec.flops_per_token`: 6 per
matmul parameter, forward and backward, plus the attention's scores and their product
with V, 12 L S E), the same count the planner prices a step with. The causal mask does
not halve the attention term: the shipped attention computes every score and masks
the upper half (a fused kernel that skips masked blocks would halve it, as MaxText now
counts). Recomputation (remat) is not model work and is not counted. A problem built in
Python without a count gets 6 x its parameters (no attention term), and says so.

MFU divides the achieved FLOP/s per device by the peak of the device's kind, dense bf16
(below); `--peak-tflops` overrides it. On a CPU there is no peak worth dividing by, so
only the achieved FLOP/s is reported.
"""

from __future__ import annotations

import math

import jax

# Dense bf16 TFLOP/s per chip, by a substring of jax.devices()[0].device_kind (first
# match wins: "H100" also names "NVIDIA H100 80GB HBM3").
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L4", 121.0),
    ("TPU v6", 918.0),  # Trillium (v6e)
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),  # v5e
    ("TPU v5e", 197.0),
    ("TPU v4", 275.0),
    ("TPU v3", 123.0),
)


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the override, else the table's; None if unknown (a CPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    return next((t * 1e12 for name, t in PEAK_TFLOPS if name in device_kind), None)


def flops_per_token(problem) -> tuple[float, str]:
    """(model FLOPs per loss element, forward and backward; how they were counted)."""
    if problem.flops_per_token is not None:
        return problem.flops_per_token, "the model's count"
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(problem.shapes))
    return 6.0 * params, "6 x parameters (no attention term: the model gives no count)"


def figures(flops_per_step: float, tokens_per_step: int, step_s: float, devices: int, peak):
    """Per-step throughput: tokens/s in all and per device, achieved FLOP/s per device,
    and MFU where the peak is known."""
    achieved = flops_per_step / step_s / devices
    return {
        "tokens_per_s": tokens_per_step / step_s,
        "tokens_per_s_per_device": tokens_per_step / step_s / devices,
        "flops_per_s_per_device": achieved,
        "mfu": None if peak is None else achieved / peak,
    }


def shown(achieved: float, mfu: float | None) -> str:
    """'MFU 41.2% (407.5 TFLOP/s per device)', or on a CPU '3.1 GFLOP/s per device'."""
    rate = f"{achieved / 1e12:.1f} TFLOP/s" if achieved >= 1e12 else f"{achieved / 1e9:.1f} GFLOP/s"
    return f"{rate} per device" if mfu is None else f"MFU {mfu:.1%} ({rate} per device)"
