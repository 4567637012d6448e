"""Ready for a GPU, checked on a CPU: attention by platform (the CPU keeps the scores; a
step built for CUDA runs cuDNN's fused kernel (bf16) or the query-blocked form (fp32)
and stores no [S, S] buffer), the GPU XLA flags (on a GPU only; the user's XLA_FLAGS
override them), and the `cuda12` extra installing the plugin of the jax it runs."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import custom_partitioning
from jax._src.cudnn import fused_attention_stablehlo

from jaxpar.config import presets
from jaxpar.nn import attention, scope
from jaxpar.recipe import setup
from jaxpar.step import xla_flags
from jaxpar.step.build import build, step_inputs

CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")  # forward, backward
# with a mask (packed documents): the kernels that take it, as a bias
CUDNN_MASKED = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")


def lowered_step(
    preset: str,
    *overrides: str,
    platform: str | None = None,
    devices: int = 8,
    packed: bool = False,
):
    """(the step's lowered StableHLO text for `platform` (default: this machine's), the
    engine's compiler options), data parallel on `devices` devices; `packed`: each row
    two documents (segment ids and positions in the batch)."""
    cfg = presets.load(preset, [f"parallel.data={devices}", "data.source=synthetic", *overrides])
    s = setup(cfg, jax.devices()[:devices])
    batch = s.batches(0)
    if packed:
        rows, width = batch["tokens"].shape
        second = np.arange(width) >= width // 2
        batch["segment_ids"] = np.broadcast_to(second, (rows, width)).astype(np.int32)
        positions = np.arange(width) - second * (width // 2)
        batch["positions"] = np.broadcast_to(positions, (rows, width)).astype(np.int32)
    with scope.building_for(platform) if platform else contextlib.nullcontext():
        engine = build(s.problem, cfg, s.mesh)
        traced = engine.step.trace(*step_inputs(engine, batch))
        lowered = traced.lower(lowering_platforms=(platform,) if platform else None)
    return lowered.as_text(), engine.compiler_options


@pytest.fixture
def cudnn_probe(monkeypatch):
    """This machine has no CUDA: cuDNN's version probe, which jax calls while tracing
    the fused attention, answers as the cuDNN 9.10 that jax[cuda12] installs would."""
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


def sxs(text: str, seq: int) -> list[str]:
    """The tensor types in `text` with two dims of `seq` (an [S, S] buffer)."""
    return [t for t in re.findall(r"tensor<([0-9x]+)x\w+>", text) if t.count(str(seq)) >= 2]


def fused_kernels(text: str) -> list[str]:
    """cuDNN attention calls in a lowered program: the kernels themselves, or (on a
    mesh of many devices) the custom-partitioned calls that become them once XLA's SPMD
    partitioner has run, named by the partitioning function jax registered for each."""
    calls = [c for c in re.findall(r"custom_call @([\w$]+)", text) if c in CUDNN + CUDNN_MASKED]
    for key in re.findall(r'@CustomSPMDPartitioning[^\n]*backend_config = "(\d+)"', text):
        partition = custom_partitioning._sharding_callbacks[key.encode()].partition
        if partition.__module__ == fused_attention_stablehlo.__name__:
            calls.append(partition.__name__)
    return calls


def expected_flags(devices: int) -> dict:
    """The flags NVIDIA's JAX-Toolbox and MaxText set, written out: MaxText's combine
    thresholds, 1 GiB all-reduce, 1 GiB / devices all-gather, half that reduce-scatter."""
    return {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": 2**30,
        "xla_gpu_all_gather_combine_threshold_bytes": 2**30 // devices,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 2**29 // devices,
    }


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_a_cuda_bf16_step_runs_cudnn_attention_with_no_sxs_buffer(devices, cudnn_probe, preset):
    # one device: the kernels themselves are in the program
    text, options = lowered_step(
        preset, "train.seq_len=4096", "train.precision=bf16", platform="cuda", devices=1
    )
    assert sorted(set(fused_kernels(text))) == sorted(CUDNN)  # forward and backward
    assert sxs(text, 4096) == []
    assert options == expected_flags(1)
    # data parallel on 8: the step manual over the whole mesh, each device calls the
    # same kernels on its own rows
    text, options = lowered_step(
        preset, "train.seq_len=4096", "train.precision=bf16", platform="cuda"
    )
    assert sorted(set(fused_kernels(text))) == sorted(CUDNN)
    assert sxs(text, 4096) == []
    assert options == expected_flags(8)
    # heads split over tensor by the compiler: the kernels custom-partitioned
    text, _ = lowered_step(
        preset, "train.seq_len=4096", "train.precision=bf16", "parallel.data=4",
        "parallel.tensor=2", platform="cuda",
    )  # fmt: skip
    assert fused_kernels(text) == [
        "_dot_product_attention_fwd_partition",
        "_dot_product_attention_bwd_partition",
    ]
    assert sxs(text, 4096) == []


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_packed_documents_reach_the_cudnn_kernel_as_its_mask(devices, cudnn_probe, preset):
    """A batch of packed documents runs the cuDNN kernels that take a mask, forward and
    backward, fed from the segment ids: one [rows, 1, S, S] mask shared by the heads,
    never a score buffer per head."""
    seq = 1024
    text, _ = lowered_step(
        preset, f"train.seq_len={seq}", "train.precision=bf16", platform="cuda", devices=1,
        packed=True,
    )  # fmt: skip
    assert sorted(set(fused_kernels(text))) == sorted(CUDNN_MASKED)
    # the mask (a row's: [rows, S, S], as the kernel's bias [rows, 1, S, S]), no scores
    assert set(sxs(text, seq)) == {f"16x{seq}x{seq}", f"16x1x{seq}x{seq}"}


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_context_parallel_attention_reaches_cudnn_with_its_positions_mask(
    devices, cudnn_probe, strategy
):
    """Split over context=2 (tokens reordered for balance), each device's attention is
    cuDNN's masked kernel, forward and backward, on whole local blocks: all_gather its
    S/2 queries against the gathered S keys, Ulysses all S against all S for half the
    heads; the mask is causal by the tokens' original positions ([rows, 1, queries,
    keys], shared by the heads), and no per-head score buffer."""
    seq = 1024
    text, _ = lowered_step(
        "llama-tiny", "parallel.data=1", "parallel.context=2", f"train.seq_len={seq}",
        "train.precision=bf16", f"parallel.context_strategy={strategy}", platform="cuda",
        devices=2,
    )  # fmt: skip
    assert sorted(set(fused_kernels(text))) == sorted(CUDNN_MASKED)
    queries = seq // 2 if strategy == "all_gather" else seq
    masks = {
        t for t in re.findall(r"tensor<([0-9x]+)x\w+>", text) if t.endswith(f"{queries}x{seq}")
    }
    assert masks == {f"16x{queries}x{seq}", f"16x1x{queries}x{seq}"}


def test_the_mask_handed_to_cudnn_is_the_one_the_cpu_applies():
    """jax's reference attention with the mask the cuDNN path receives, and the blocked
    form with segment ids, equal the direct form: each query sees its own document only."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 64, 4, 8))
    segments = jnp.asarray(np.repeat([[0] * 20 + [1] * 30 + [2] * 14], 2, axis=0))
    want = attention._direct(q, k, v, 0, segments)
    mask = attention.same_segment(segments)[:, None]
    got = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "BLOCK", 16)
        np.testing.assert_allclose(
            attention._blocked(q, k, v, segments), want, rtol=1e-5, atol=1e-6
        )
    # a sliding window: each query sees itself and the 4 keys before it, in every form
    window = attention._direct(q, k, v, 0, segments, window=5)
    local = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=(4, 0), implementation="xla"
    )
    np.testing.assert_allclose(window, local, rtol=1e-5, atol=1e-6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "BLOCK", 16)
        blocked = attention._blocked(q, k, v, segments, window=5)
    np.testing.assert_allclose(blocked, local, rtol=1e-5, atol=1e-6)
    # the second document's outputs do not depend on the first document's keys
    changed = attention._direct(q, k.at[:, :20].add(1.0), v, 0, segments)
    np.testing.assert_array_equal(changed[:, 20:], want[:, 20:])


def test_a_cuda_fp32_step_runs_blocked_attention_with_no_sxs_buffer(devices):
    text, _ = lowered_step("gpt-tiny", "train.seq_len=4096", platform="cuda")
    assert fused_kernels(text) == []
    assert sxs(text, 4096) == []
    # the blocks' scores: [rows, heads, BLOCK, S]
    assert f"2x8x{attention.BLOCK}x4096xf32" in text


def test_the_cpu_step_keeps_the_scores_and_sets_no_xla_flags(devices):
    text, options = lowered_step("gpt-tiny", "train.seq_len=256", "train.precision=bf16")
    assert fused_kernels(text) == []
    assert sxs(text, 256)  # the direct form: [rows, heads, S, S] scores
    assert options == {}


def test_blocked_attention_equals_the_direct_form(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 16)
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 64, 4, 8))
    out = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    direct = lambda q, k, v: attention._direct(q, k, v, 0)  # noqa: E731
    want, want_grads = jax.value_and_grad(out(direct), argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(out(attention._blocked), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # causal: the last query's change moves no earlier output
    changed = q.at[:, -1].add(1.0)
    np.testing.assert_array_equal(
        attention._blocked(changed, k, v)[:, :-1], attention._blocked(q, k, v)[:, :-1]
    )


def _numpy_attention(q, k, v, segments, window, scale, cap, sinks=None):
    """softmax(cap x tanh(q k^T x scale / cap) + mask) v, in float64; `sinks` (one a
    head): a column of their own in the softmax, dropped after it (as transformers'
    GPT-OSS writes it)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bshd,bthd->bhst", q, k) * scale
    s = cap * np.tanh(s / cap)
    back = np.arange(q.shape[1])[:, None] - np.arange(k.shape[1])[None]
    seg = np.asarray(segments)
    visible = (back >= 0) & (back < window) & (seg[:, :, None] == seg[:, None, :])
    s = np.where(visible[:, None], s, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(
            np.asarray(sinks, np.float64)[None, :, None, None], (*s.shape[:3], 1)
        )
        s = np.concatenate([s, column], -1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhst,bthd->bshd", p[..., : k.shape[1]], v)


def test_capped_scores_are_the_same_in_every_form(monkeypatch):
    """Gemma 2's soft cap (cap x tanh(score / cap)) with a scale of its own: the direct
    form equals a float64 transcription; the blocked form and the positioned forms
    (context parallelism's) equal it, values and gradients. cuDNN's kernel, as jax
    reaches it, has no cap: a capped step on CUDA runs the blocked form."""
    monkeypatch.setattr(attention, "BLOCK", 16)
    q, k, v = jax.random.normal(jax.random.key(1), (3, 2, 64, 4, 8)) * 2
    segments = jnp.asarray(np.repeat([[0] * 20 + [1] * 30 + [2] * 14], 2, axis=0))
    scores = attention.Scores(0.3, 2.0)
    want = _numpy_attention(q, k, v, segments, 5, 0.3, 2.0)
    direct = attention._direct(q, k, v, 0, segments, 5, scores)
    np.testing.assert_allclose(direct, want, rtol=1e-5, atol=1e-6)
    uncapped = attention._direct(q, k, v, 0, segments, 5, attention.Scores(0.3))
    assert np.abs(np.asarray(uncapped) - want).max() > 0.1  # the cap bites
    pos = jnp.broadcast_to(jnp.arange(64), (2, 64))

    def forms(form):
        if form == "blocked":
            return lambda q, k, v: attention._blocked(q, k, v, segments, 5, scores)
        if form == "direct":
            return lambda q, k, v: attention._direct(q, k, v, 0, segments, 5, scores)
        chosen = attention.Form.BLOCKED if form == "positioned blocked" else attention.Form.DIRECT
        return lambda q, k, v: attention._positioned(
            chosen, q, k, v, pos, pos, segments, segments, 5, scores
        )

    out = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    base, base_grads = jax.value_and_grad(out(forms("direct")), argnums=(0, 1, 2))(q, k, v)
    for form in ("blocked", "positioned", "positioned blocked"):
        np.testing.assert_allclose(forms(form)(q, k, v), want, rtol=1e-5, atol=1e-6)
        got, grads = jax.value_and_grad(out(forms(form)), argnums=(0, 1, 2))(q, k, v)
        np.testing.assert_allclose(got, base, rtol=1e-6)
        for g, w in zip(grads, base_grads, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert attention.form("cuda", jnp.bfloat16, 64, softcap=50.0) is attention.Form.BLOCKED


@pytest.mark.slow  # 1.5 s: the capped scores' case keeps the forms in the fast tier
def test_sinks_are_the_same_in_every_form(monkeypatch):
    """GPT-OSS's attention sinks (a logit per head in the softmax's denominator, no value
    to it), in a window, over documents: causal_attention's direct and blocked forms
    and the positioned ones (context parallelism's) equal a float64 transcription of
    transformers' (a column appended, then dropped), values and gradients alike; the
    sinks' own gradient too. cuDNN's kernel has none: such a step runs the blocked form."""
    monkeypatch.setattr(attention, "BLOCK", 16)
    q, k, v = jax.random.normal(jax.random.key(3), (3, 2, 64, 4, 8)) * 2
    sinks = jnp.asarray([-1.0, 0.5, 2.0, 4.0])
    segments = jnp.asarray(np.repeat([[0] * 20 + [1] * 30 + [2] * 14], 2, axis=0))
    want = _numpy_attention(q, k, v, segments, 5, 0.3, 1e9, sinks)
    scores = attention.Scores(0.3, sinks=True)
    pos = jnp.broadcast_to(jnp.arange(64), (2, 64))

    def forms(form):
        def run(q, k, v, sinks):
            q = attention._with_sinks(q, sinks)
            if form == "direct":
                return attention._direct(q, k, v, 0, segments, 5, scores)
            if form == "blocked":
                return attention._blocked(q, k, v, segments, 5, scores)
            chosen = (
                attention.Form.BLOCKED if form == "positioned blocked" else attention.Form.DIRECT
            )
            return attention._positioned(chosen, q, k, v, pos, pos, segments, segments, 5, scores)

        return run

    plain = attention.causal_attention(q, k, v, segments, 5, scale=0.3)
    assert np.abs(np.asarray(plain) - want).max() > 0.1  # the sinks bite
    got = attention.causal_attention(q, k, v, segments, 5, scale=0.3, sinks_H=sinks)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    out = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))  # noqa: E731
    args = (q, k, v, sinks)
    base, base_grads = jax.value_and_grad(out(forms("direct")), argnums=(0, 1, 2, 3))(*args)
    assert np.abs(np.asarray(base_grads[3])).min() > 1e-3  # every sink learns
    for form in ("blocked", "positioned", "positioned blocked"):
        np.testing.assert_allclose(forms(form)(*args), want, rtol=1e-5, atol=1e-6)
        got, grads = jax.value_and_grad(out(forms(form)), argnums=(0, 1, 2, 3))(*args)
        np.testing.assert_allclose(got, base, rtol=1e-6)
        for g, w in zip(grads, base_grads, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert attention.form("cuda", jnp.bfloat16, 64, sinks=True) is attention.Form.BLOCKED


@pytest.mark.slow  # 3 s: out of the fast tier
def test_a_ring_cache_of_the_window_equals_the_direct_form():
    """A windowed layer's cache holds the window's 5 slots, a ring: a prompt of 9 tokens
    (longer than the ring), a chunk of 3, then 8 tokens one at a time, each sees what
    the direct form shows it; capped and scaled scores too, and sinks (GPT-OSS's), a row
    left-padded by 2."""
    q, k, v = jax.random.normal(jax.random.key(2), (3, 2, 20, 4, 8)) * 2
    scores, window, sinks = attention.Scores(0.3, 2.0), 5, jnp.asarray([-1.0, 0.5, 2.0, 4.0])
    pad = jnp.asarray([0, 2])
    segments = jnp.asarray([[1] * 20, [0] * 2 + [1] * 18])  # the padding: its own segment
    sunk = dataclasses.replace(scores, sinks=True)
    want = attention._direct(attention._with_sinks(q, sinks), k, v, 0, segments, window, sunk)
    want = np.asarray(want)
    cache = (jnp.zeros((2, 4, 8, window)), jnp.zeros((2, 4, window, 8)))
    outs, slot = [], 0
    for t in (9, 3, *[1] * 8):
        part = slice(slot, slot + t)
        out, cache = attention.cached_attention(
            q[:, part], k[:, part], v[:, part], cache, slot, pad, window, scores, sinks
        )
        outs.append(np.asarray(out))
        slot += t
    got = np.concatenate(outs, 1)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1, 2:], want[1, 2:], rtol=1e-5, atol=1e-6)


def test_the_form_follows_platform_dtype_and_head_dim():
    assert attention.form("cpu", jnp.bfloat16, 64) is attention.Form.DIRECT
    assert attention.form("cuda", jnp.bfloat16, 64) is attention.Form.CUDNN
    assert attention.form("cuda", jnp.float16, 128) is attention.Form.CUDNN
    assert attention.form("cuda", jnp.float32, 64) is attention.Form.BLOCKED
    assert attention.form("cuda", jnp.bfloat16, 60) is attention.Form.BLOCKED  # not 8k
    assert attention.form("cuda", jnp.bfloat16, 256) is attention.Form.BLOCKED
    assert attention.form("rocm", jnp.bfloat16, 64) is attention.Form.BLOCKED
    assert attention.stores_scores("cpu", jnp.float32, 64)
    assert not attention.stores_scores("cuda", jnp.float32, 64)


def test_the_users_xla_flags_override_jaxpars():
    theirs = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    options = xla_flags.for_step("cuda", 8, theirs)
    assert "xla_gpu_enable_latency_hiding_scheduler" not in options
    assert options == {
        k: v for k, v in expected_flags(8).items() if k != "xla_gpu_enable_latency_hiding_scheduler"
    }
    assert xla_flags.for_step("cpu", 8, "") == {}
    assert xla_flags.for_step("rocm", 8, "") == expected_flags(8)
    assert expected_flags(8)["xla_gpu_all_gather_combine_threshold_bytes"] == 2**27


def test_this_xla_knows_every_gpu_flag():
    """A misspelt or retired flag fails the compile: XLA parses compiler options into
    its DebugOptions, which hold the GPU flags on every backend."""
    jax.jit(lambda x: x + 1, compiler_options=xla_flags.gpu_flags(8)).lower(1.0).compile()
    with pytest.raises(Exception, match="xla_gpu_no_such_flag"):
        jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_no_such_flag": True}).lower(
            1.0
        ).compile()


def test_a_flag_this_xla_retired_is_left_out(monkeypatch):
    """jaxlib 0.11 retired xla_gpu_enable_pipelined_*: a step built for a GPU then
    compiles without them (seen on an H200), rather than failing."""
    retired = {"xla_gpu_retired_flag": True, "xla_gpu_another_retired_flag": 7}
    monkeypatch.setattr(xla_flags, "gpu_flags", lambda n: expected_flags(n) | retired)
    xla_flags.unknown.cache_clear()
    try:
        assert xla_flags.unknown() == set(retired)
        assert xla_flags.for_step("cuda", 8, "") == expected_flags(8)
    finally:
        xla_flags.unknown.cache_clear()


def test_the_cuda12_extra_installs_the_plugin_of_the_jax_it_runs():
    """`pip install '.[cuda12]'` asks for jax[cuda12] in the range jaxpar itself takes,
    and that jax's `cuda12` extra pins its CUDA plugin and jaxlib to its own version."""
    import tomllib
    from importlib.metadata import requires, version
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    [jax_dep] = [d for d in project["project"]["dependencies"] if d.startswith("jax>")]
    assert project["project"]["optional-dependencies"]["cuda12"] == [
        jax_dep.replace("jax", "jax[cuda12]", 1)
    ]
    v = version("jax")
    pinned = {r.split(";")[0].replace(" ", "") for r in requires("jax") if 'extra == "cuda12"' in r}
    assert pinned == {f"jaxlib<={v},>={v}", f"jax-cuda12-plugin[with-cuda]<={v},>={v}"}


def test_a_gpu_budget_names_the_share_jax_takes(monkeypatch):
    """On an H200 a step of 115.4 GiB was refused against 104.9 GiB: JAX's 75% of the
    card. The message names the variable that raises it."""
    from jaxpar.step import preflight

    class H200:
        platform, device_kind = "gpu", "NVIDIA H200"

        def memory_stats(self):
            return {"bytes_limit": 112_640_000_000}

    monkeypatch.setattr(preflight.jax, "local_devices", lambda: [H200()])
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    have = preflight.budget()
    assert (have.bytes_per_device, have.devices) == (112_640_000_000, 1)
    assert have.what == (
        "NVIDIA H200 memory JAX takes (XLA_PYTHON_CLIENT_MEM_FRACTION=.75 of it; .95 leaves room)"
    )
