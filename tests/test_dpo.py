"""DPO: preference pairs prepared as TRL prepares them, the loss, gradient and TRL's
metrics equal to TRL's DPOTrainer (sigmoid and IPO), every layout equal to one device
(answers of lengths 2x apart, so that a mean of per-device means would differ), the
reference holding still, and bad input refused in one line."""

import json
import math

import numpy as np
import pytest
from helpers import (
    THREE_D_1F1B,
    assert_same_training,
    compile_only,
    one_line_error,
    pair_keys,
    reference,
    script,
    trained,
)

from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.data import pairs
from jaxpar.data.prepare import prepare

VOCAB = 512  # the chat tokenizer's


def keys(folder, *more):
    return pair_keys(folder, "dpo", "train.lr=0.5", *more)


def test_a_pair_is_one_row_of_two_documents_with_its_answers_masked(folder):
    cfg = presets.load("llama-tiny", list(keys(folder)))
    held = pairs.load(cfg.data, cfg.train, VOCAB)
    meta = json.loads((folder / "meta.json").read_text())["pairs"]
    assert len(held) == meta["pairs"]["train"] == 8 and meta["pairs"]["val"] == 2
    batch = pairs.batch_at(held, seed=0, step=0, batch_size=8, seq_len=96)
    assert sorted(pairs.indices(8, seed=0, step=0, batch_size=8)) == list(range(8))  # an epoch
    for row in range(8):
        segments, positions = batch["segment_ids"][row], batch["positions"][row]
        mask = batch["loss_mask"][row]
        lengths = [int(np.sum(segments == s)) for s in (pairs.CHOSEN, pairs.REJECTED)]
        answers = [int(np.sum(mask[segments == s])) for s in (pairs.CHOSEN, pairs.REJECTED)]
        assert max(answers) >= 2 * min(answers)  # what a mean of means would get wrong
        # each document from position 0, its prompt untrained, its answer trained to its end
        for s, n, a in zip((pairs.CHOSEN, pairs.REJECTED), lengths, answers, strict=True):
            assert list(positions[segments == s]) == list(range(n))
            assert list(mask[segments == s]) == [0] * (n - a) + [1] * a
        assert not mask[segments == pairs.PADDING].any()


@pytest.mark.parametrize("loss, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_each_pair_s_loss_is_its_formula(loss, smoothing):
    """Away from step 1 (where every form is log 2): conservative DPO's smoothing, and
    IPO's log-ratios over each answer's trained tokens (2 and 5 here)."""
    from jaxpar.config.sections import Dpo
    from jaxpar.objectives.dpo import pair_losses

    policy, ref = np.array([[-3.0, -9.0], [-7.0, -4.0]]), np.array([[-4.0, -8.0], [-6.0, -6.0]])
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2]] * 2)  # chosen 3 ids, rejected 6
    mask = np.array([[0, 1, 1, 0, 1, 1, 1, 1, 1, 0]] * 2)  # answers: 2 and 5 targets
    batch = {"tokens": np.zeros((2, 10), np.int32), "segment_ids": segments, "loss_mask": mask}
    got = pair_losses(policy, ref, batch, Dpo(beta=0.5, loss=loss, label_smoothing=smoothing))
    ratios = policy - ref
    if loss == "ipo":
        d = ratios[:, 0] / 2 - ratios[:, 1] / 5
        want = (d - 1 / (2 * 0.5)) ** 2
    else:
        d = 0.5 * (ratios[:, 0] - ratios[:, 1])
        want = (1 - smoothing) * np.log1p(np.exp(-d)) + smoothing * np.log1p(np.exp(d))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


LAYOUTS = {
    "data8": ("parallel.data=8",),
    "3d-1f1b": tuple(THREE_D_1F1B),
    "tensor4-zero3-accum2": (
        "parallel.data=2",
        "parallel.tensor=4",
        "parallel.zero=3",
        "train.grad_accum=2",
    ),  # fmt: skip
    "context2": ("parallel.data=4", "parallel.context=2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpo_in_every_layout_equals_one_device(layout, folder):
    got = trained("llama-tiny", keys(folder, *LAYOUTS[layout]))
    assert_same_training(got, reference("llama-tiny", keys(folder)))


@pytest.mark.slow
def test_dpo_with_muon_over_tensor_and_zero3_equals_one_device(folder):
    """train.optimizer=muon on the policy: its matrices orthogonalized as in any run, the
    reference's copy frozen (no state, no update: the loss would drift from the formula's
    otherwise)."""
    muon = ("train.optimizer=muon", "train.lr=0.02")
    layout = ("parallel.data=2", "parallel.tensor=4", "parallel.zero=3")
    got = trained("llama-tiny", keys(folder, *muon, *layout))
    assert_same_training(got, reference("llama-tiny", keys(folder, *muon)))
    assert got.losses[-1] < got.losses[0]
    # the compiled step's groups (the program just run): Muon's, not a fallback to AdamW
    groups = compile_only("llama-tiny", keys(folder, *muon, *layout)).optimizer_groups
    assert {"blocks/attn/wq", "blocks/mlp/w_up"} <= set(groups["muon"])
    assert not any(k.startswith("reference/") for group in groups.values() for k in group)


@pytest.mark.slow
def test_a_precomputed_reference_equals_the_held_copy(folder):
    """dpo.reference=precompute scores every pair once, in a serving layout, into the
    data folder; then context=2 x tensor=2 with ZeRO-3 holds no reference, and trains as
    one device holding a copy."""
    more = ("parallel.data=2", "parallel.context=2", "parallel.tensor=2", "parallel.zero=3",
            "dpo.reference=precompute")  # fmt: skip
    got = trained("llama-tiny", keys(folder, *more))
    assert_same_training(got, reference("llama-tiny", keys(folder)))
    assert len(list((folder / "reference").glob("*.train.npy"))) == 1


@pytest.mark.slow
def test_dpo_on_adapters_in_3d_equals_one_device(folder):
    """The reference is the base with the adapters off: no copy."""
    lora = ("adapter.kind=lora", "train.lr=5")
    got = trained("llama-tiny", keys(folder, *lora, *THREE_D_1F1B))
    assert_same_training(got, reference("llama-tiny", keys(folder, *lora)))


@pytest.mark.slow
def test_the_step_is_log_2_at_first_and_the_reference_holds_still(folder, tmp_path):
    """Each step's batch is all 8 pairs, so the reference's mean log-probabilities
    (logps - rewards / beta) are the same at every step, while the policy's move."""
    argv = ["train", "--config", "llama-tiny", *keys(folder, "parallel.data=8"), "train.steps=3",
            "train.eval_every=3", "train.eval_batches=1", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert math.isclose(rows[0]["loss"], math.log(2), rel_tol=1e-6)
    for side in ("chosen", "rejected"):
        ref = [r[f"logps/{side}"] - r[f"rewards/{side}"] / 0.1 for r in rows]
        np.testing.assert_allclose(ref, ref[0], rtol=1e-5)
        assert abs(rows[-1][f"logps/{side}"] - rows[0][f"logps/{side}"]) > 1e-2
    assert rows[-1]["rewards/accuracies"] > 0.5 and rows[-1]["rewards/margins"] > 0
    assert {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"} <= set(rows[-1])
    summary = json.loads((tmp_path / "summary.json").read_text())
    params = summary["memory_per_device"]["params"]
    assert summary["memory_per_device"]["reference"] == params / 2  # a copy, as the policy


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, more",
    [
        ("llama-tiny", ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3")),
        ("llama-tiny", ("parallel.data=4", "parallel.context=2", "adapter.kind=lora")),
        ("mixtral-tiny", ("parallel.data=4", "parallel.expert=2")),
    ],
)
def test_the_reference_s_forward_pass_moves_the_textbook_bytes(preset, more, folder):
    """Compiled, not run: the reference's forward pass (its copy gathered once under
    ZeRO-3; Megatron's forward all-reduces once more; context's keys and values; a
    mixture's all-to-alls) at the ledger's minimum, and its copy's bytes apart."""
    report = compile_only(preset, keys(folder, *more))
    assert 0.99 < report.comm.ratio < 1.01, report.comm.by_axis
    memory = report.memory_per_device
    lora = "adapter.kind=lora" in more
    assert memory.reference == (0 if lora else memory.params / 2)  # adapters-off: no copy
    assert (memory.base > 0) == lora


@pytest.mark.parametrize(
    "line, max_length, needle",
    [
        ({"prompt": "a", "chosen": "b"}, 64, "no `rejected`"),
        ({"prompt": "1 + 1 = " * 20, "chosen": "2", "rejected": "3"}, 16, "no room"),
        (
            {"prompt": "a", "chosen": "b", "rejected": [{"role": "user", "content": "c"}]},
            64,
            "every field as text",
        ),  # fmt: skip
        ({"chosen": "b", "rejected": "c"}, 64, '"prompt"'),
        ("", 64, "no pair"),
    ],
)
def test_bad_pairs_are_refused_before_anything_is_written(
    line, max_length, needle, chat_tokenizer, tmp_path, capsys
):
    good = json.dumps({"prompt": "x", "chosen": "y", "rejected": "z"}) + "\n"
    (tmp_path / "p.jsonl").write_text(good + json.dumps(line) + "\n" if line else "\n")
    argv = ["prepare-data", str(tmp_path / "p.jsonl"), "--tokenizer", str(chat_tokenizer),
            "--out", str(tmp_path / "out"), "--format", "preference",
            "--max-length", str(max_length)]  # fmt: skip
    assert cli.main(argv) == 2
    one_line_error(capsys, "p.jsonl" + (":2" if line else ""), needle)
    assert not (tmp_path / "out").exists()  # nothing left that blocks the retry


def test_a_damaged_preference_folder_is_named(folder, tmp_path, capsys):
    import shutil

    damaged = tmp_path / "tokens"
    shutil.copytree(folder, damaged)
    meta = json.loads((damaged / "meta.json").read_text())
    del meta["pairs"]["longest_pair"]
    (damaged / "meta.json").write_text(json.dumps(meta))
    argv = ["train", "--config", "llama-tiny", *keys(damaged), "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    one_line_error(capsys, "meta.json", "prepare the pairs again")


@pytest.mark.parametrize(
    "more, needle",
    [
        (("dpo.beta=0",), "dpo.beta=0"),
        (("data.source=corpus", "model.vocab=256"), "holds no preference pairs"),
        (("train.seq_len=32",), "train.seq_len=32"),
        (("train.objective=lm",), "train.objective=dpo"),
        (("dpo.reference=adapters-off",), "adapter.kind=lora"),
    ],
)
def test_bad_dpo_runs_are_refused(more, needle, folder, tmp_path, capsys):
    argv = ["train", "--config", "llama-tiny", *keys(folder, *more), "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)


torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                            "ignore::UserWarning")  # fmt: skip
@pytest.mark.parametrize("loss, layout, max_length", [("sigmoid", "text", 64),
                                                      ("ipo", "conversations", 40)])  # fmt: skip
def test_dpo_equals_trl(loss, layout, max_length, chat_tokenizer, tmp_path):
    """TRL's DPOTrainer on a random Hugging Face Llama, eight pairs, beta 0.1, plain SGD
    at a constant rate: at step 1 (policy = reference, any DPO loss is log 2) the
    gradient's norm; at step 2, after one step, the loss, rewards and margins; and the
    pairs tokenized and truncated alike (IPO's at --max-length 40 loses answers' ends); both in
    fp32 (TRL's default is bf16 autocast)."""
    from datasets import Dataset

    from jaxpar.recipe import train_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.normal_(1.0 if "norm" in key else 0.0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    script("dpo_llama").write_pairs(tmp_path / "all.jsonl", 16)
    rows = [json.loads(x) for x in (tmp_path / "all.jsonl").read_text().splitlines()]
    rows = [r for r in rows if ("prompt" in r) == (layout == "text")][:8]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare([tmp_path / "pairs.jsonl"], chat_tokenizer, tmp_path / "data", 0.01,
                   "preference", max_length)["pairs"]  # fmt: skip
    assert meta["pairs"]["train"] == 8 and (meta["truncated"] > 0) == (max_length == 40)

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=2,
        learning_rate=0.05, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="sgd", max_grad_norm=1e9, logging_steps=1, beta=0.1, loss_type=[loss],
        max_length=max_length, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf"), args=args,
        processing_class=transformers.AutoTokenizer.from_pretrained(chat_tokenizer),
        train_dataset=Dataset.from_list(rows),
    )  # fmt: skip
    trainer.train()
    theirs = trainer.state.log_history[:2]

    # fmt: off
    over = [f"model.init=hf:{tmp_path / 'hf'}", "data.source=tokens",
            f"data.path={tmp_path / 'data'}", "train.objective=dpo", f"dpo.loss={loss}",
            f"train.seq_len={meta['longest_pair'] - 1}", "train.batch_size=8",
            "train.optimizer=sgd", "train.lr=0.05", "train.warmup=0", "train.clip_norm=0",
            "train.weight_decay=0", "train.steps=2", "parallel.data=8"]
    # fmt: on
    ours = train_config(presets.resolve_init(presets.load("llama-tiny", over)), quiet=True).rows
    assert math.isclose(ours[0]["grad_norm"], theirs[0]["grad_norm"], rel_tol=1e-4)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
                "logps/chosen", "logps/rejected"):  # fmt: skip
        assert math.isclose(ours[1][key], theirs[1][key], rel_tol=1e-4), key
    assert ours[1]["rewards/accuracies"] == theirs[1]["rewards/accuracies"]
