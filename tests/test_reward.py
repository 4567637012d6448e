"""Reward models (train.objective=reward): Bradley-Terry on preference pairs, the loss,
its gradient and the accuracy equal to TRL's RewardTrainer at step 1 and step 2, every
layout equal to one device, the exported classifier scoring as jaxpar does in
transformers, as GRPO's reward (grpo.reward=model:RUN) scoring as transformers does, and
bad runs refused in one line."""

import json
import math
import runpy
import sys

import numpy as np
import pytest
from helpers import (
    THREE_D_1F1B,
    assert_same_training,
    one_line_error,
    pair_keys,
    reference,
    trained,
)

from jaxpar.cli import main as cli
from jaxpar.config import presets

VOCAB = 512  # the chat tokenizer's


def keys(folder, *more):
    return pair_keys(folder, "reward", "train.lr=0.1", *more)


LAYOUTS = {  # (a row's rewards summed over its context shards in the third)
    "data8": ("parallel.data=8",),
    "3d-1f1b": tuple(THREE_D_1F1B),
    "context2-tensor2-zero3": (
        "parallel.data=2",
        "parallel.context=2",
        "parallel.tensor=2",
        "parallel.zero=3",
    ),  # fmt: skip
}


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=pytest.mark.slow) for k in LAYOUTS],  # 6-20 s each
)
def test_a_reward_model_trains_in_every_layout_as_on_one_device(layout, folder):
    got = trained("llama-tiny", keys(folder, *LAYOUTS[layout]))
    want = reference("llama-tiny", keys(folder))
    assert want.losses[0] == pytest.approx(math.log(2), abs=0.05)  # scores near 0 at first
    assert want.losses[-1] < want.losses[0] - 0.01  # it learns
    assert_same_training(got, want)


@pytest.mark.parametrize(
    "preset, more, needle",
    [
        ("mixtral-tiny", (), "model.experts=8"),
        ("llama-tiny", ("adapter.kind=lora",), "adapter.kind=lora"),
        ("llama-tiny", ("train.seq_len=60",), "set train.seq_len=83"),
        ("llama-tiny", ("data.source=corpus", "model.vocab=256"), "objective=reward: data.path"),
    ],
)
def test_bad_reward_runs_are_refused(preset, more, needle, folder, tmp_path, capsys):
    argv = ["train", "--config", preset, *keys(folder, *more), "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)


torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")


def answers(folder, split="train") -> list[dict]:
    """Each prepared pair's chosen and rejected ids (prompt and answer), in order."""
    from jaxpar.config.sections import Data, Train
    from jaxpar.data import pairs

    held = pairs.load(Data(source="tokens", path=str(folder)), Train(seq_len=96), VOCAB, split)
    rows = pairs.rows_of(held, np.arange(len(held)), 96)
    out = []
    for ids, segments in zip(rows["tokens"], rows["segment_ids"], strict=True):
        out.append({k: ids[segments == s].tolist() for k, s in
                    (("chosen_ids", pairs.CHOSEN), ("rejected_ids", pairs.REJECTED))})  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                            "ignore::UserWarning")  # fmt: skip
def test_the_loss_gradient_and_accuracy_equal_trls_reward_trainer(folder, chat_tokenizer, tmp_path):
    """TRL's RewardTrainer on a random Hugging Face LlamaForSequenceClassification, the
    same 8 pairs (their ids as prepare-data wrote them), plain SGD at a constant rate:
    the gradient's norm, loss and accuracy at step 1, and loss, accuracy and margin at
    step 2. Both score each answer at its last id before the end of text (TRL pads with
    it), in fp32."""
    import jax
    from datasets import Dataset

    from jaxpar.objectives import reward
    from jaxpar.recipe import train_config

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5, num_labels=1)  # fmt: skip
    lm = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for key, p in lm.named_parameters():
            p.normal_(1.0 if "norm" in key else 0.0, 0.1)
    lm.save_pretrained(tmp_path / "hf")
    over = [f"model.init=hf:{tmp_path / 'hf'}", *keys(folder, "train.steps=2", "train.lr=0.05",
            "parallel.data=8")]  # fmt: skip
    cfg = presets.resolve_init(presets.load("llama-tiny", over))
    ours = train_config(cfg, quiet=True).rows

    model = transformers.LlamaForSequenceClassification(config)
    model.model.load_state_dict(lm.model.state_dict())
    head = np.asarray(reward.start(jax.random.key(cfg.train.seed), 64))  # jaxpar's start
    with torch.no_grad():
        model.score.weight.copy_(torch.tensor(head.T))
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=2,
        learning_rate=0.05, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="sgd", max_grad_norm=1e9, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False,
    )  # fmt: skip
    trainer = trl.RewardTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(answers(folder)),
        processing_class=transformers.AutoTokenizer.from_pretrained(chat_tokenizer),
    )  # fmt: skip
    trainer.train()
    theirs = trainer.state.log_history[:2]
    assert len(answers(folder)) == 8 and ours[0]["loss"] != ours[1]["loss"]
    assert math.isclose(ours[0]["grad_norm"], theirs[0]["grad_norm"], rel_tol=1e-4)
    every = ("loss", "accuracy", "margin", "mean_reward")
    for step, names in ((0, ("loss", "accuracy")), (1, every)):
        for name in names:
            assert math.isclose(ours[step][name], theirs[step][name], rel_tol=1e-4, abs_tol=1e-6), (
                step, name, ours[step][name], theirs[step][name])  # fmt: skip


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                            "ignore::UserWarning")  # fmt: skip
def test_the_walk_through_exports_a_classifier_that_scores_as_jaxpar(
    chat_tokenizer, tmp_path, capsys, monkeypatch
):
    """scripts/reward_llama.py as docs/grpo.md runs it (a random tiny Llama, few steps):
    its `jaxpar export --format hf` is a LlamaForSequenceClassification (no lm_head, one
    label, the tokenizer's pad id) that transformers loads and that scores every answer
    of a batch of pairs as jaxpar's model does; `jaxpar generate` refuses the run."""
    from test_scripts import SCRIPTS

    from jaxpar.config.sections import given
    from jaxpar.objectives import reward
    from jaxpar.recipe import trained_model
    from jaxpar.training.export import run_params

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, rms_norm_eps=1e-5)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    out = tmp_path / "run"
    argv = ["reward_llama.py", "--hf", str(tmp_path / "hf"), "--tokenizer", str(chat_tokenizer),
            "--pairs", str(tmp_path / "pairs"), "--out", str(out), "--steps", "4", "--count",
            "64", "--batch-size", "8"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # (this process's devices, made already)
    runpy.run_path(str(SCRIPTS / "reward_llama.py"), run_name="__main__")
    said = capsys.readouterr().out
    assert "pair accuracy, the mean of each fifth" in said and "2 + 3 = '5.': reward" in said
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForSequenceClassification"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()

    params, meta = run_params(out)
    cfg = presets.from_dict(meta["config"])
    batch = given(reward.batches, cfg, None, "train", {"data": 1})(0)
    ours = np.asarray(reward.scores(trained_model(cfg.model, cfg.adapter, cfg.train), params,
                                    batch))  # fmt: skip
    docs = [row[seg == s] for row, seg in zip(batch["tokens"], batch["segment_ids"], strict=True)
            for s in (0, 1)]  # fmt: skip
    ids = np.full((len(docs), max(map(len, docs))), exported["pad_token_id"])
    for i, d in enumerate(docs):
        ids[i, : len(d)] = d
    with torch.no_grad():
        theirs = model(
            input_ids=torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids))
        ).logits
    np.testing.assert_allclose(ours.reshape(-1), theirs.numpy()[:, 0], rtol=1e-4, atol=1e-5)
    assert np.ptp(ours) > 1e-3  # the answers score apart
    capsys.readouterr()
    assert cli.main(["generate", str(out), "--prompt", "Hi"]) == 2  # it does not decode
    one_line_error(capsys, "train.objective=reward", "holds score and no head")
    _grpo_scores_with_the_run(out, model, chat_tokenizer, tmp_path, capsys)


def _grpo_scores_with_the_run(run, model, chat_tokenizer, tmp_path, capsys):
    """grpo.reward=model:RUN beside a function, weighted: each completion's reward is the
    exported classifier's score in transformers of the conversation as TRL's GRPOTrainer
    renders it for a reward model (chat template, then the tokenizer)."""
    from helpers import script

    from jaxpar.data.prepare import prepare

    script("grpo_llama").write_prompts(tmp_path / "prompts.jsonl", 8)
    prepare([tmp_path / "prompts.jsonl"], chat_tokenizer, tmp_path / "prompts", 0.1, "prompts")
    rewards = f"grpo.reward=model:{run},jaxpar.objectives.rewards:format_reward"
    argv = [
        "train",
        "--config",
        "llama-tiny",
        "model.vocab=512",
        "data.source=tokens",
        f"data.path={tmp_path / 'prompts'}",
        "train.objective=grpo",
        rewards,
        "grpo.reward_weights=1,0.5",
        "train.seq_len=64",
        "train.batch_size=8",
        "grpo.group=4",
        "grpo.max_new_tokens=12",
        "train.log_every=1",
        "train.steps=1",
        "parallel.data=4",
        "parallel.tensor=2",
        "parallel.zero=3",
        "--out",
        str(tmp_path / "grpo"),
    ]  # fmt: skip (test_grpo's zero3-tensor2 programs)
    assert cli.main(argv) == 0
    assert f"reward    model:{run} (llama) in " in capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "rollouts.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    texts = [
        tok.apply_chat_template([*r["prompt"], {"role": "assistant", "content": r["completion"]}],
                                tokenize=False)
        if isinstance(r["prompt"], list) else r["prompt"] + r["completion"] + tok.eos_token
        for r in rows
    ]  # fmt: skip
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    pad = model.config.pad_token_id
    padded = torch.tensor([i + [pad] * (max(map(len, ids)) - len(i)) for i in ids])
    with torch.no_grad():
        theirs = model(input_ids=padded, attention_mask=torch.ones_like(padded)).logits[:, 0]
    ours = np.array([r["rewards"][run.name] for r in rows])
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-4, atol=1e-5)
    formats = np.array([r["rewards"]["format_reward"] for r in rows])
    np.testing.assert_allclose([r["reward"] for r in rows], ours + 0.5 * formats, rtol=1e-6)
    summary = json.loads((tmp_path / "grpo" / "summary.json").read_text())
    assert summary["grpo"]["reward_models"][0]["bytes_per_device"] > 0
    # refused in one line: no run, a run of another objective, ids of another tokenizer
    script("make_tiny_llama").save_tokenizer(tmp_path / "other", "2 + 3 = 5. " * 50, 300)
    prepare([tmp_path / "prompts.jsonl"], tmp_path / "other", tmp_path / "theirs", 0.1, "prompts")
    for source, more, needle in (
        (tmp_path / "nowhere", (), "no such run directory"),
        (tmp_path / "grpo", (), "trained train.objective=grpo, not a reward model"),
        (run, (f"data.path={tmp_path / 'theirs'}", "model.vocab=300"), "another tokenizer"),
    ):
        bad = [a.replace(str(run), str(source)) for a in argv[:-1]]
        assert cli.main([*bad, str(tmp_path / "bad"), *more]) == 2
        one_line_error(capsys, f"grpo.reward=model:{source}", needle)
