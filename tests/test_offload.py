"""ZeRO-Offload: optimizer state and fp32 master weights on the host, update on the host."""

import pytest
from helpers import assert_same_training, compile_only, run

MESHES = {
    "dp8-zero1": ("parallel.data=8", "parallel.zero=1"),
    "dp4-tp2-zero3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
}


@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-4), ("bf16", 1e-2)])
@pytest.mark.parametrize("mesh", MESHES)
def test_offload_trains_like_no_offload(devices, mesh, precision, rtol):
    overrides = [*MESHES[mesh], f"train.precision={precision}"]
    assert_same_training(
        run("gpt-tiny", [*overrides, "parallel.offload=optimizer"]),
        run("gpt-tiny", overrides),
        rtol=rtol,
    )


@pytest.mark.parametrize("mesh", MESHES)
def test_optimizer_state_lives_on_the_host(devices, mesh):
    plain = compile_only("gpt-tiny", MESHES[mesh])
    off = compile_only("gpt-tiny", (*MESHES[mesh], "parallel.offload=optimizer"))
    assert off["memory_per_device"]["opt_state"] == 0
    assert off["host_memory_per_device"]["opt_state"] == plain["memory_per_device"]["opt_state"]
    # fp32 master weights on the host, split over data like the optimizer state
    assert off["host_memory_per_device"]["params"] > 0
    assert abs(off["state_bytes"]["ratio"] - 1) <= 0.02


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
        )["memory_per_device"]["params"]

    assert device_params("bf16") * 2 == device_params("fp32")


def test_offload_with_a_pipeline(devices):
    overrides = [
        "parallel.data=2",
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "parallel.zero=1",
        "parallel.microbatches=2",
        "parallel.schedule=1f1b",
    ]
    assert_same_training(
        run("gpt-tiny", [*overrides, "parallel.offload=optimizer"]), run("gpt-tiny", overrides)
    )
