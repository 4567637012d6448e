"""Every strategy trains gpt-tiny to the single-device losses and parameters (fp32)."""

import pytest
from helpers import assert_same_training, trained
from helpers import reference as shared_reference
from layouts import STRATEGIES as LAYOUTS

# every strategy, and ZeRO-3 with recomputed layers
STRATEGIES = {
    **LAYOUTS,
    "dp4-tp2-zero3-remat": (
        "parallel.data=4",
        "parallel.tensor=2",
        "parallel.zero=3",
        "parallel.remat=full",
    ),
    # two layers per scan iteration (train.unroll), with ZeRO-3's per-layer gathers
    "dp8-zero3-unroll2": ("parallel.data=8", "parallel.zero=3", "train.unroll=2"),
}

pytestmark = pytest.mark.slow  # every test here trains


@pytest.fixture(scope="module")
def reference(devices):
    return shared_reference("gpt-tiny")


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_equals_one_device(name, reference):
    assert_same_training(trained("gpt-tiny", STRATEGIES[name]), reference)


def test_loss_falls(reference):
    assert reference.losses[-1] < reference.losses[0] - 0.5


def test_grad_accum_equals_one_big_batch(devices):
    """grad_accum=4 on the same global batch, with ZeRO-0 and ZeRO-2 (sliced accumulator)."""
    base = trained("gpt-tiny", ["parallel.data=2", "parallel.zero=0", "train.grad_accum=1"])
    for zero in (0, 2):
        accum = trained(
            "gpt-tiny", ["parallel.data=2", f"parallel.zero={zero}", "train.grad_accum=4"]
        )
        assert_same_training(accum, base)


def test_mlp_model_with_tensor_and_zero3(devices):
    ref = shared_reference("mlp-tiny")
    assert_same_training(
        trained("mlp-tiny", ["parallel.data=4", "parallel.tensor=2", "parallel.zero=3"]), ref
    )


def test_bf16_close_to_fp32(reference):
    """bf16 compute keeps fp32 master weights: the loss curve stays close."""
    bf16 = trained(
        "gpt-tiny",
        ["parallel.data=4", "parallel.tensor=2", "parallel.zero=3", "train.precision=bf16"],
    )
    for got, want in zip(bf16.losses, reference.losses, strict=True):
        assert abs(got - want) / want < 1e-2


def test_default_job_equals_one_device(devices):
    """The preset `jaxpar train` runs with no arguments (data=2 x pipeline=2 x tensor=2,
    ZeRO-1, 1F1B over 4 micro-batches), a few steps, against one device."""
    steps = ["train.steps=3"]
    one = ["parallel.data=1", "parallel.pipeline=1", "parallel.tensor=1"]
    reference = trained("default", [*steps, *one, "parallel.microbatches=1"], steps=3)
    assert_same_training(trained("default", steps, steps=3), reference)
