"""ZeRO-Offload: optimizer state and fp32 master weights on the host, update on the host;
layer inputs kept for the backward pass in host memory (parallel.remat=offload)."""

import re

import pytest
from helpers import THREE_D_1F1B, assert_same_training, compile_only, trained

from jaxpar.config import presets
from jaxpar.recipe import setup
from jaxpar.step.build import build, step_inputs

MESHES = {
    "dp8-zero1": ("parallel.data=8", "parallel.zero=1"),
    "dp4-tp2-zero3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
}


@pytest.mark.slow
# each mesh and each precision once (the host update is the same code in either pair)
@pytest.mark.parametrize(
    "mesh,precision,rtol", [("dp8-zero1", "fp32", 1e-4), ("dp4-tp2-zero3", "bf16", 1e-2)]
)
def test_offload_trains_like_no_offload(devices, mesh, precision, rtol):
    """In bf16 the host's and the device's AdamW differ in fp32's last bits, which the
    bf16 compute copy rounds into whole bf16 steps that Adam amplifies on near-zero
    gradients: measured on dp4-tp2-zero3, the worst leaf's error grows from 1.0e-3 at
    step 5 to 2.5e-2 at step 10 (a LayerNorm bias) while the losses agree within 6e-4.
    So bf16 compares the whole parameter vector (assert_same_training's form for float
    reassociation), fp32 each leaf."""
    overrides = [*MESHES[mesh], f"train.precision={precision}"]
    assert_same_training(
        trained("gpt-tiny", [*overrides, "parallel.offload=optimizer"]),
        trained("gpt-tiny", overrides),
        rtol=rtol,
        per_leaf=precision == "fp32",
    )


@pytest.mark.parametrize(  # the fast tier takes dp8-zero1's (3 s each)
    "mesh", [m if m == "dp8-zero1" else pytest.param(m, marks=pytest.mark.slow) for m in MESHES]
)
def test_optimizer_state_lives_on_the_host(devices, mesh):
    plain = compile_only("gpt-tiny", MESHES[mesh])
    off = compile_only("gpt-tiny", (*MESHES[mesh], "parallel.offload=optimizer"))
    assert off.memory_per_device.opt_state == 0
    assert off.host_memory_per_device.opt_state == plain.memory_per_device.opt_state
    # fp32 master weights on the host, split over data like the optimizer state
    assert off.host_memory_per_device.params > 0
    assert abs(off.state_bytes.ratio - 1) <= 0.02


@pytest.mark.slow  # two compiles
def test_bf16_device_parameters_are_half_of_fp32(devices):
    def device_params(precision):
        return compile_only(
            "gpt-tiny",
            (
                "parallel.data=8",
                "parallel.zero=1",
                "parallel.offload=optimizer",
                f"train.precision={precision}",
            ),
        ).memory_per_device.params

    assert device_params("bf16") * 2 == device_params("fp32")


@pytest.mark.slow
def test_offload_with_a_pipeline(devices):
    overrides = THREE_D_1F1B
    assert_same_training(
        trained("gpt-tiny", [*overrides, "parallel.offload=optimizer"]),
        trained("gpt-tiny", overrides),
    )


REMAT_MESHES = {
    # everything offloaded at once: optimizer, parameter shards, layer inputs
    "dp4-tp2-zero3-all": (*MESHES["dp4-tp2-zero3"], "parallel.offload=optimizer+params"),
    "gpipe": (
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "parallel.zero=1",
        "parallel.microbatches=2",
        "parallel.schedule=gpipe",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", REMAT_MESHES)
def test_remat_offload_trains_like_keeping_activations(devices, mesh):
    overrides = list(REMAT_MESHES[mesh])
    plain = [o for o in overrides if not o.startswith("parallel.offload")]
    assert_same_training(
        trained("gpt-tiny", [*overrides, "parallel.remat=offload"]), trained("gpt-tiny", plain)
    )


@pytest.mark.slow  # compiles four steps
def test_remat_offload_sends_each_layer_input_to_the_host(devices):
    # gpt-tiny: 4 layers, batch 16, seq 64, embed 64; fp32
    layer_input = 16 // 8 * 64 * 64 * 4
    host = lambda *o: compile_only("gpt-tiny", ("parallel.data=8", *o))  # noqa: E731
    assert host("parallel.remat=offload").host_memory_per_device.activations == (4 * layer_input)
    for remat in ("none", "full"):
        assert host(f"parallel.remat={remat}").host_memory_per_device.activations == 0
    # bf16 compute: the layer inputs are half the bytes
    bf16 = host("parallel.remat=offload", "train.precision=bf16")
    assert bf16.host_memory_per_device.activations == 4 * layer_input // 2


@pytest.mark.slow  # a pipeline with activation offload: the costliest compile here
def test_remat_offload_in_a_pipeline_keeps_every_tick(devices):
    # gpipe on 2 stages with 2 micro-batches runs 3 ticks; each tick every stage runs its
    # 2 layers on a micro-batch of 16 / (2 data * 2 micro-batches) = 4 rows
    summary = compile_only("gpt-tiny", (*REMAT_MESHES["gpipe"], "parallel.remat=offload"))
    assert summary.pipeline.ticks == 3
    assert summary.host_memory_per_device.activations == 3 * 2 * 4 * 64 * 64 * 4


def test_layer_inputs_are_placed_in_pinned_host_when_lowered_for_gpu(devices):
    """XLA:CPU lowers in-step memory placement to nothing (so the compiled step here
    keeps the layer inputs on the device); lowered for CUDA, the same step annotates
    each layer's saved input for pinned_host, which XLA's host offloader acts on."""
    placements = lowered_placements("parallel.remat=offload")
    # the per-layer input, [rows, seq, embed], and nothing else
    assert placements["pinned_host"] == ["tensor<2x64x64xf32>"]
    assert "pinned_host" not in lowered_placements("parallel.remat=full")


def lowered_placements(*overrides: str) -> dict[str, list[str]]:
    cfg = presets.load("gpt-tiny", ["parallel.data=8", *overrides])
    s = setup(cfg)
    engine = build(s.problem, cfg, s.mesh)
    lowered = engine.step.trace(*step_inputs(engine, s.batches(0))).lower(
        lowering_platforms=("cuda",)
    )
    found = {}
    for kind, operand in re.findall(
        r'annotate_device_placement.*_xla_buffer_placement = "(\w+)".*\(([^)]*)\) ->',
        lowered.as_text(),
    ):
        found.setdefault(kind, []).append(operand)
    return found
