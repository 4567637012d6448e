"""scripts/: the training scripts a user would write run, as one process (the fine-tuning
scripts run as the walk-through writes them: tests/test_docs.py)."""

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
def test_compare_torch_prints_the_table_with_the_load():
    """scripts/compare_torch.py as docs/benchmarks.md runs it, at one shape and rank, few steps:
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


@pytest.mark.slow
def test_grpo_llama_script_rolls_out_and_draws_the_reward(tmp_path):
    """scripts/grpo_llama.py as docs/grpo.md runs it, on a random tiny Llama, few steps."""
    pytest.importorskip("transformers")
    run_script("make_tiny_llama.py", "--out", str(tmp_path / "hf"), "--corpus-out",
               str(tmp_path / "corpus.txt"))  # fmt: skip
    out = run_script("grpo_llama.py", "--hf", str(tmp_path / "hf"), "--prompts",
                     str(tmp_path / "prompts"), "--out", str(tmp_path / "run"), "--steps", "2",
                     "--count", "40", "--batch-size", "16", "--group", "4",
                     "--reward", "exact_answer,format_reward", whole=True)  # fmt: skip
    assert "reward, the mean of each fifth of the run:" in out
    assert "rewards/format_reward/mean" in out
    rows = (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 16 and (tmp_path / "run" / "loss.png").is_file()
