"""The Llama model under every layout gpt trains under: equal to one device, and at the
textbook minimum of communication (its own Megatron count, GQA included)."""

import pytest
from helpers import THREE_D_1F1B, assert_same_training, compile_only, trained
from helpers import reference as shared_reference
from layouts import STRATEGIES

# A covering set, not gpt's whole table: each ZeRO stage, tensor 2/4/8 (kv_heads=2:
# split, then whole), each schedule, offload and remat once with Llama's blocks (gpt-tiny
# proves every strategy alone in test_equivalence)
LAYOUTS = {
    **{n: STRATEGIES[n] for n in ("dp4-tp2-zero0", "dp4-tp2-zero3", "dp2-tp4-zero2", "tp8")},
    "3d-1f1b": tuple(THREE_D_1F1B),
    "pp2-gpipe-m4": (
        "parallel.data=4", "parallel.pipeline=2", "parallel.microbatches=4",
        "parallel.schedule=gpipe",
    ),
    "dp8-zero1-offload": ("parallel.data=8", "parallel.zero=1", "parallel.offload=optimizer"),
    "dp4-tp2-zero3-remat": (
        "parallel.data=4", "parallel.tensor=2", "parallel.zero=3", "parallel.remat=full"
    ),
}  # fmt: skip
SINGLE = ("parallel.data=1", "parallel.tensor=1")


STEPS = 4  # optimizer steps of each run, as gpt's: past Adam's first (sign-like) step


@pytest.fixture(scope="module")
def reference(devices):
    return shared_reference("llama-tiny", steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_llama_layout_equals_one_device(name, reference):
    assert_same_training(trained("llama-tiny", list(LAYOUTS[name]), steps=STEPS), reference)


@pytest.mark.slow
def test_tied_embeddings_equal_one_device(devices):
    tied = ["model.tie_embeddings=true"]
    one = trained("llama-tiny", [*SINGLE, *tied], steps=4)
    assert_same_training(trained("llama-tiny", [*LAYOUTS["dp4-tp2-zero3"], *tied], steps=4), one)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n in ("dp4-tp2-zero0", "dp2-tp4-zero2") else pytest.mark.slow)
        for n in LAYOUTS
        # recomputed layers repeat their forward all-reduces, which the minimum does
        # not count (gpt-tiny alike: 1.12 with remat=full over tensor=2)
        if "remat" not in n
    ],
)
def test_llama_comm_at_the_textbook_minimum(name, devices):
    comm = compile_only("llama-tiny", LAYOUTS[name]).comm
    assert 1.0 <= comm.ratio <= 1.02, comm


def test_kv_heads_left_whole_say_why(devices):
    report = compile_only("llama-tiny", LAYOUTS["dp2-tp4-zero2"])
    assert report.tensor_replicated == [
        "kv_heads (2) replicated over tensor=4: it does not divide; every tensor device "
        "computes all 2"
    ]
    assert compile_only("llama-tiny", LAYOUTS["dp4-tp2-zero0"]).tensor_replicated == []
