"""What a run shows beside the loss: model FLOPs and MFU, TensorBoard events, profiles."""

import glob
import gzip
import json
import struct

import pytest
from helpers import one_line_error

from jaxpar import recipe
from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.config import sections as config
from jaxpar.cost import throughput
from jaxpar.nn.problem import registered
from jaxpar.training import trainer
from jaxpar.training.metrics import TENSORBOARD_TAGS


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_flops_per_token_is_the_hand_count(preset):
    """6 per matmul parameter (q, k, v, o; the MLP; the one-hot embedding and the head),
    plus 12 L S E for the scores and their product with V (not halved by the causal
    mask: every score is computed)."""
    cfg = presets.load(preset)
    m, seq = cfg.model, cfg.train.seq_len
    e, layers = m.embed, m.layers
    if preset == "gpt-tiny":  # 4 x 64 wide, mlp 256, vocab 256, 64 tokens
        per_layer = 3 * e * e + e * e + 2 * e * m.mlp
    else:  # 8 heads of 8, 2 key/value heads: k and v are 64 x 16; gate, up, down
        kv = m.kv_heads * (e // m.heads)
        per_layer = e * e + 2 * e * kv + e * e + 3 * e * m.mlp
    hand = 6 * (layers * per_layer + 2 * m.vocab * e) + 12 * layers * seq * e
    assert registered(cfg.model, cfg.train.seq_len).flops_per_token == hand
    assert hand == {"gpt-tiny": 1_572_864, "llama-tiny": 1_228_800}[preset]
    if preset == "llama-tiny":  # a prediction module: a block, eh_proj (2E x E), the head
        with_mtp = presets.load(preset, ["model.mtp_depth=2"]).model
        module = 6 * (per_layer + 2 * e * e + m.vocab * e) + 12 * seq * e
        assert registered(with_mtp, seq).flops_per_token == hand + 2 * module


def test_peak_table_by_device_kind():
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert throughput.peak_flops("NVIDIA H200") == 989e12
    assert throughput.peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert throughput.peak_flops("TPU v5 lite") == 197e12
    assert throughput.peak_flops("cpu") is None
    assert throughput.peak_flops("cpu", override_tflops=2.5) == 2.5e12


def events(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the TFRecord event files in `folder`: {tag: [(step, value)]}."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for path in sorted(glob.glob(f"{folder}/events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            record = data[at + 12 : at + 12 + length]  # after length and its CRC
            at += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


@pytest.fixture(scope="module")
def observed(devices, tmp_path_factory):
    """gpt-tiny, 6 steps, steps 3-4 profiled, a made-up peak of 0.05 TFLOP/s per device."""
    out = tmp_path_factory.mktemp("observed")
    argv = ["train", "--config", "gpt-tiny", "--cpu-devices", "8", "--out", str(out)]
    assert (
        cli.main([*argv, "train.steps=6", "train.profile_steps=3:4", "--peak-tflops", "0.05"]) == 0
    )
    return out


@pytest.mark.slow
def test_mfu_and_throughput_in_rows_and_summary(observed):
    summary = json.loads((observed / "summary.json").read_text())
    assert summary["model_flops_per_token"] == 1_572_864
    assert summary["peak_flops_per_device"] == 0.05e12
    achieved = summary["flops_per_s_per_device"]
    assert achieved == pytest.approx(1_572_864 * 16 * 64 / summary["step_time_s"] / 8)
    assert summary["mfu"] == pytest.approx(achieved / 0.05e12)
    assert summary["tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s"] / 8)
    rows = [json.loads(line) for line in (observed / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] == pytest.approx(r["flops_per_s_per_device"] / 0.05e12) for r in rows)


@pytest.mark.slow
def test_tensorboard_events_hold_every_tag_per_step(observed):
    scalars = events(observed / "tensorboard")
    rows = [json.loads(line) for line in (observed / "metrics.jsonl").read_text().splitlines()]
    for tag in TENSORBOARD_TAGS:
        if tag == "eval_loss":  # (no held-out data asked for)
            continue
        assert [s for s, _ in scalars[tag]] == [r["step"] for r in rows], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([r[tag] for r in rows], rel=1e-6)


@pytest.mark.slow
def test_the_profile_holds_the_asked_steps_only(observed):
    (trace,) = glob.glob(str(observed / "profile/plugins/profile/*/*.trace.json.gz"))
    events = json.load(gzip.open(trace))["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert steps == [3, 4]


@pytest.mark.parametrize(
    "value, needles",
    [
        ("5", ["train.profile_steps='5'", "FIRST:LAST", "base-60"]),
        ("4:2", ["train.profile_steps=4:2", "1 <= FIRST <= LAST <= train.steps (10)"]),
        ("0:1", ["train.profile_steps=0:1", "1 <= FIRST"]),
        ("9:11", ["train.profile_steps=9:11", "<= train.steps (10)"]),
    ],
)
def test_bad_profile_steps_exit_2(capsys, value, needles):
    argv = ["train", "--config", "gpt-tiny", f"train.profile_steps={value}"]
    assert cli.main(argv) == 2
    one_line_error(capsys, *needles)


def test_profile_without_a_run_directory_is_refused(devices):
    cfg = presets.load("gpt-tiny", ["train.profile_steps=1:2"])
    s = recipe.setup(cfg)
    with pytest.raises(config.ConfigError, match="give train\\(..., out_dir=...\\)"):
        trainer.train(s.problem, cfg, s.batches, mesh=s.mesh, quiet=True)
