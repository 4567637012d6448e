"""scripts/: the training scripts a user would write run, as one process."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent.parent / "scripts"


def run_script(name: str, *args: str, whole: bool = False) -> str:
    """The script's last line of output (`whole`: all of it)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() if whole else done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_train_gpt_script_runs_and_resumes(tmp_path):
    assert run_script("train_gpt.py", "--steps", "3", "--out", str(tmp_path)).startswith("loss ")
    assert (tmp_path / "checkpoints" / "3").is_dir()
    # again, with more steps: it resumes from step 3
    assert run_script("train_gpt.py", "--steps", "5", "--out", str(tmp_path)).startswith("loss ")
    assert (tmp_path / "checkpoints" / "5").is_dir()


@pytest.mark.slow
def test_train_custom_model_script_runs():
    assert "accuracy" in run_script("train_custom_model.py", "--steps", "5")


@pytest.mark.slow
def test_finetune_llama_script_plans_trains_and_exports(tmp_path):
    import json

    import numpy as np
    from test_hf_input import write_checkpoint

    source = write_checkpoint(tmp_path / "hf")
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(tokens / "train.bin")
    (tokens / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16"}))
    out = tmp_path / "run"
    args = ["--hf", str(source), "--data", str(tokens), "--out", str(out), "--steps", "2"]
    assert "from_pretrained" in run_script("finetune_llama.py", *args)
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["num_hidden_layers"] == 2 and (out / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_finetune_llama_script_fine_tunes_on_chat_answers(tmp_path):
    """--chat: conversations written, prepared with the checkpoint's chat template,
    packed, trained on the answers only, exported."""
    import json

    from helpers import script
    from test_hf_input import write_checkpoint

    from jaxpar.data.tokens import corpus_bytes

    source = write_checkpoint(tmp_path / "hf", "model.vocab=512")
    script("make_tiny_llama").save_tokenizer(source, corpus_bytes().decode(), 512)
    out = tmp_path / "run"
    args = ["--hf", str(source), "--chat", str(tmp_path / "chat"), "--out", str(out),
            "--steps", "2", "--conversations", "200"]  # fmt: skip
    printed = run_script("finetune_llama.py", *args, whole=True)
    assert "chat data: " in printed and "of them answers" in printed
    assert "documents packed" in printed and "trained on the loss mask's targets only" in printed
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[0]["trained_tokens"] < 16 * 64  # answers only
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_compare_torch_prints_the_table_with_the_load():
    """scripts/compare_torch.py as the README runs it, at one shape and rank, few steps:
    both sides train and the ratio is theirs."""
    pytest.importorskip("torch")
    out = run_script(
        "compare_torch.py", "--steps", "4", "--shapes", "small", "--ranks", "1", whole=True
    )
    lines = out.splitlines()
    assert "cores; load average before" in lines[0]
    assert "jaxpar tok/s" in lines[1] and "PyTorch tok/s" in lines[1]
    *_, ours, theirs, ratio = lines[2].replace(",", "").split()
    assert float(ratio) == pytest.approx(float(ours) / float(theirs), abs=0.006)
    assert lines[-1].startswith("load average after")
