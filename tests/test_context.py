"""Long sequences: context parallelism (each sequence split over `context`, by all_gather
or Ulysses, causally balanced or not) and Megatron sequence parallelism, proven equal to
one device, at the textbook bytes, with activations falling as 1/C."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_training, compile_only, reference, trained

from jaxpar.config import presets
from jaxpar.config.sections import ContextStrategy
from jaxpar.cost import planner
from jaxpar.nn import attention
from jaxpar.nn.problem import registered
from jaxpar.parallel import context
from jaxpar.parallel.context import Split

CP = "parallel.context"
ULYSSES = "parallel.context_strategy=ulysses"
UNBALANCED = "parallel.context_balance=false"
SP = "parallel.sequence_parallel=true"
WINDOW8 = "model.sliding_window=8"

# (preset, overrides): a covering set: each strategy balanced and not, each degree, each
# model's attention, and every other axis (tensor with sequence parallel, pipeline,
# replica, ZeRO-3, remat, accumulation) at least once with context (test_moe adds Ulysses
# unbalanced, test_documents packed documents)
LAYOUTS = {
    "gpt cp2 dp4": ("gpt-tiny", (f"{CP}=2", "parallel.data=4")),
    "gpt cp8": ("gpt-tiny", (f"{CP}=8", "parallel.data=1")),
    "gpt cp8 ulysses": ("gpt-tiny", (f"{CP}=8", "parallel.data=1", ULYSSES)),
    "gpt cp2 tp2 sp zero3": (
        "gpt-tiny", (f"{CP}=2", "parallel.tensor=2", "parallel.data=2", SP, "parallel.zero=3")
    ),
    "gpt cp2 pp2 dp2": (
        "gpt-tiny", (f"{CP}=2", "parallel.pipeline=2", "parallel.data=2", "parallel.microbatches=2")
    ),
    # GQA: 8 heads over 2 key/value heads; Ulysses at C=4 repeats them to 4
    "llama cp4 ulysses dp2": ("llama-tiny", (f"{CP}=4", "parallel.data=2", ULYSSES)),
    "llama cp4 tp2 sp": ("llama-tiny", (f"{CP}=4", "parallel.tensor=2", "parallel.data=1", SP)),
    "llama cp2 tp2 ulysses zero3 remat accum2": (
        "llama-tiny",
        (f"{CP}=2", "parallel.tensor=2", "parallel.data=2", ULYSSES, "parallel.zero=3",
         "parallel.remat=full", "train.grad_accum=2"),
    ),
    "llama cp2 ulysses pp2 tp2 1f1b": (
        "llama-tiny",
        (f"{CP}=2", ULYSSES, "parallel.pipeline=2", "parallel.tensor=2", "parallel.data=1",
         "parallel.microbatches=4"),
    ),
    "gpt cp2 replica2 dp2 zero2": (
        "gpt-tiny", (f"{CP}=2", "parallel.replica=2", "parallel.data=2", "parallel.zero=2")
    ),
    # local blocks whose window (8) reaches one chunk back: their keys by halo, balanced;
    # and unbalanced with tensor, gemma3's last local block after the stack
    "gemma2 cp4 dp2 window8": ("gemma2-tiny", (f"{CP}=4", "parallel.data=2", WINDOW8)),
    "gemma3 cp2 tp2 dp2 unbalanced": (
        "gemma3-tiny", (f"{CP}=2", "parallel.tensor=2", "parallel.data=2", UNBALANCED)
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_context_layout_trains_as_one_device(name, devices):
    preset, overrides = LAYOUTS[name]
    window = tuple(o for o in overrides if o == WINDOW8)
    assert_same_training(
        trained(preset, list(overrides), steps=4), reference(preset, window, steps=4)
    )


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_balance_evens_the_causal_work(degree):
    """The unmasked [128 x 128] score tiles of each context device's queries: with the
    dual-chunk reorder within 10% of the mean; in order, the last device does most."""
    balanced = context.score_blocks(8192, Split(degree, "all_gather", True), 128)
    assert max(balanced) <= 1.1 * np.mean(balanced) and min(balanced) >= 0.9 * np.mean(balanced)
    in_order = context.score_blocks(8192, Split(degree, "all_gather", False), 128)
    assert max(in_order) > 1.4 * np.mean(in_order)
    assert sum(balanced) == sum(in_order)  # the same work, spread


def test_the_order_keeps_each_chunk_pair_on_its_device():
    where = context.order(16, Split(2, "all_gather", True))
    assert where.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(where) == list(range(16))


@pytest.mark.parametrize("balance", [True, False])
def test_the_positions_mask_is_the_causal_mask_of_the_reordered_tokens(balance):
    """Each device's mask, built from its queries' and all keys' original positions,
    is the causal mask with rows and columns moved as the tokens were."""
    seq, split = 32, Split(4, "all_gather", balance)
    where = context.order(seq, split)
    positions = np.broadcast_to(where, (1, seq))
    part = seq // split.degree
    causal = np.tril(np.ones((seq, seq), bool))
    for device in range(split.degree):
        rows = slice(device * part, (device + 1) * part)
        got = attention.visible_by_positions(positions[:, rows], positions)[0]
        np.testing.assert_array_equal(got, causal[where[rows]][:, where])


FIXED = ("parallel.data=1", "train.batch_size=2", "train.seq_len=1024")


@pytest.mark.slow
def test_activation_memory_falls_as_one_over_context(devices):
    """The compiled step's temporaries at a fixed sequence length, C = 1, 2, 4, 8: each
    device keeps 1/C of every sequence's activations (and scores)."""
    temp = {
        c: compile_only("llama-tiny", (*FIXED, f"{CP}={c}")).memory_per_device.temp
        for c in (1, 2, 4, 8)
    }
    for c in (2, 4, 8):
        assert temp[c] == pytest.approx(temp[1] / c, rel=0.1), temp


COMM = {
    "all_gather": (f"{CP}=4", "parallel.data=2"),
    "all_gather remat": (f"{CP}=2", "parallel.data=4", "parallel.remat=full", "parallel.zero=1"),
    "ulysses": (f"{CP}=4", "parallel.data=2", ULYSSES),
    "ulysses tensor": (f"{CP}=2", "parallel.tensor=2", "parallel.data=2", ULYSSES),
    "all_gather zero3 accum": (
        f"{CP}=2", "parallel.data=4", "parallel.zero=3", "train.grad_accum=2"
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", COMM)
def test_context_bytes_are_the_textbook_minimum(name, devices):
    """comm.by_axis.context: K/V gathers (forward, and again where recomputed) and their
    reduce-scatters, or Ulysses' four all-to-alls a pass, and the gradients once a
    step, each (C-1)/C; GQA moves the distinct key/value heads only."""
    comm = compile_only("llama-tiny", COMM[name]).comm
    context = comm.by_axis["context"]
    assert context.wire == pytest.approx(context.minimum, rel=0.02)
    assert "context" in comm.ratio_axes


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("documents", [False, True])
def test_a_windowed_layers_halo_is_the_direct_form(balance, documents, devices):
    """A window of 8 over context=4 (chunks of 8 or 16 tokens): each device's queries,
    attending to its own keys and the halo of the 7 before each chunk, see what the
    direct form over the whole row shows them (packed documents: their own alone)."""
    c, s, w = 4, 64, 8
    split = Split(c, ContextStrategy.ALL_GATHER, balance)
    mesh = jax.make_mesh((c, 1), ("context", "tensor"), devices=devices[:c])
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, s, 4, 8))
    segments = None
    if documents:  # documents of 5, 13, 20 and 26 tokens: within and beyond the window
        segments = jnp.asarray([np.repeat(np.arange(4), [5, 13, 20, 26])] * 2)
    want = attention._direct(q, k, v, 0, segments, w)
    slots = context.order(s, split)
    positions = np.broadcast_to(slots, (2, s))
    if documents:
        starts = np.asarray([0] * 5 + [5] * 13 + [18] * 20 + [38] * 26)
        positions = positions - starts[slots]

    def attend(q, k, v, q_pos, k_pos, q_seg, k_seg):
        scores = attention.Scores(8**-0.5)
        chosen = attention.Form.DIRECT
        return attention._positioned(chosen, q, k, v, q_pos, k_pos, q_seg, k_seg, w, scores)

    def local(q, k, v, seg, pos):
        return context.attention(split, q, k, v, seg, pos, w, 1, attend)

    spec = jax.sharding.PartitionSpec(None, "context")
    run = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"context"})
    seg = None if segments is None else segments[:, slots]
    got = jax.jit(run)(q[:, slots], k[:, slots], v[:, slots], seg, jnp.asarray(positions))
    np.testing.assert_allclose(np.asarray(got)[:, np.argsort(slots)], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_local_layer_moves_only_its_windows_keys(devices):
    """gemma2-tiny over context=4 (chunks of 8 tokens): with a window of 8, each local
    layer receives the 7 keys and values before each of its 2 chunks (a halo), at the
    minimum that counts them; with a window of 16 (reaching two chunks back) it gathers
    them all, at that minimum, and moves more."""
    wire = {}
    for window in (8, 16):
        layout = (f"{CP}=4", "parallel.data=2", f"model.sliding_window={window}")
        context = compile_only("gemma2-tiny", layout).comm.by_axis["context"]
        assert context.wire == pytest.approx(context.minimum, rel=1e-5)
        wire[window] = context.wire
    # 2 local layers, forward and backward, 3/4 of the devices sending, 8 rows a
    # device: K and V (2 kv heads x 32 dims, fp32) of 2 chunks x 7 tokens, not 64
    assert wire[16] - wire[8] == 2 * 2 * 3 / 4 * 8 * (64 - 2 * 7) * 2 * 2 * 32 * 4


@pytest.mark.slow  # 3.2 s: the full suite's (the fast tier's budget, issue 59)
def test_sequence_parallel_moves_what_tensor_parallel_moves_in_less_memory(devices):
    """Megatron sequence parallelism: norms and residual adds split by sequence over
    tensor. Its tensor bytes are tensor parallelism's, and its activations are fewer."""
    tp = compile_only("llama-tiny", ("parallel.data=4", "parallel.tensor=2"))
    sp = compile_only("llama-tiny", ("parallel.data=4", "parallel.tensor=2", SP))
    assert sp.comm.by_axis["tensor"].minimum == tp.comm.by_axis["tensor"].minimum
    assert sp.comm.by_axis["tensor"].wire == pytest.approx(tp.comm.by_axis["tensor"].wire, rel=0.02)
    assert sp.memory_per_device.temp < tp.memory_per_device.temp


@pytest.mark.slow
def test_the_plan_for_an_8b_llama_at_32k_on_64_gpus_splits_the_context():
    """docs/long-sequences.md's plan: Llama-3.1-8B's dims at 32k tokens on 8 hosts of 8 80 GB GPUs.
    The fastest layout that fits splits the sequence; whole sequences need their
    activations recomputed, or offloaded state, and are slower."""
    cfg = presets.load("llama3-8b")
    work = planner.of_config(cfg)
    plan = planner.make_plan(
        cfg, registered(cfg.model, cfg.train.seq_len), planner.machine(64, "80GB", hosts=8), work
    )
    best = plan.ranked[0]
    assert cfg.train.seq_len == 32768 and best.mesh["context"] > 1
    assert "split over context" in plan.rule()
    whole = [c for c in plan.ranked if c.mesh["context"] == 1]
    assert whole and whole[0].step_s > best.step_s
    assert whole[0].activations > best.activations
