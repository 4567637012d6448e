"""The docs a user reads: what they tell a user to paste runs (the README's tour and the
fine-tuning walk-through, as written, in a fresh folder), every other command they show
parses, the measured tables are the bench's own (scripts/update_docs.py), the README fits
on a few screens, and the site builds with `mkdocs build --strict` (in .ci/run)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import training_env

from jaxpar.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent


def console_blocks(path: Path) -> list[list[str]]:
    """The ```console blocks of a page: each a list of commands (comments dropped)."""
    blocks = re.findall(r"```console\n(.*?)```", path.read_text(), flags=re.S)
    return [
        [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
        for block in blocks
    ]


def commands(path: Path) -> list[str]:
    return [c for block in console_blocks(path) for c in block]


def test_the_readme_fits_on_a_few_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_command_the_docs_show_parses(capsys):
    """Each `jaxpar ...` a page tells a user to paste is a command the parser takes; each
    script it runs exists and takes the flags given (its --help lists them)."""
    seen = 0
    for page in PAGES:
        for command in commands(page):
            words = shlex.split(command)
            if words[0].endswith("jaxpar"):
                cli._parse(words[1:])  # argparse exits (a failure here) on a bad command
                seen += 1
            elif len(words) > 1 and words[1].startswith("scripts/"):
                script = ROOT / words[1]
                assert script.is_file(), f"{page.name}: {command}"
                shown = subprocess.run(
                    [sys.executable, str(script), "--help"], capture_output=True, text=True
                )
                flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
                assert all(f in shown.stdout for f in flags), (page.name, command, flags)
                seen += 1
    assert seen >= 12
    capsys.readouterr()


def test_the_measured_tables_are_the_benchs():
    """Every table between bench markers is what scripts/update_docs.py renders from
    docs/bench.json: a number typed by hand, or a stale one, fails here."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "update_docs.py"), "--check", "--from",
         str(ROOT / "docs" / "bench.json")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    marked = sum(p.read_text().count("<!-- bench:") for p in PAGES)
    assert marked >= 14


def _paste(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command as a user pastes it at the repository root, run in `cwd`: the venv's
    programs are this interpreter's, scripts/ the checkout's; a fine-tune's tens of
    steps under XLA at -O1 (helpers.training_env)."""
    words = shlex.split(command)
    if words[0].startswith(".venv/bin/"):
        words[0] = str(BIN / words[0].removeprefix(".venv/bin/"))
    words = [str(ROOT / w) if w.startswith("scripts/") else w for w in words]
    env = training_env() if "finetune_llama" in command else None
    return subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_the_walk_through_and_the_tour_run_as_written(tmp_path):
    """The fine-tuning walk-through, then the README's tour, in one fresh folder: every
    command as a user pastes it (the install lines aside: this is the test's venv); then
    the walk-through's base, data and adapter run again, each finding what it made."""
    pasted = [
        *commands(ROOT / "docs" / "fine-tuning.md"),
        *commands(ROOT / "README.md"),
    ]
    said = {}
    for command in pasted:
        if "pip install" in command or "python3 -m venv" in command or " -m pytest" in command:
            continue
        if command in said:  # a page repeating another's command: it ran as written
            continue
        done = _paste(command, tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        said[command] = done.stdout
    runs = tmp_path / "runs"
    assert json.loads((runs / "ft" / "hf" / "config.json").read_text())["num_hidden_layers"] == 4
    # the chat fine-tune: conversations prepared with the template, packed, answers only
    chat = next(out for command, out in said.items() if "--chat runs/chat" in command)
    assert "chat data: " in chat and "of them answers" in chat and "documents packed" in chat
    rows = [json.loads(r) for r in (runs / "ft-chat" / "metrics.jsonl").read_text().splitlines()]
    train = json.loads((runs / "ft-chat" / "summary.json").read_text())["config"]["train"]
    assert 0 < rows[0]["trained_tokens"] < train["batch_size"] * train["seq_len"]
    assert (runs / "ft-chat" / "hf" / "model.safetensors").is_file()
    assert (runs / "ft-lora" / "peft" / "adapter_model.safetensors").is_file()
    assert (runs / "tour" / "model.safetensors").is_file()
    # the walk-through again, as a reader who comes back (or follows a page that repeats
    # it): the base made again is the same (seeded), so the adapter run's fingerprint
    # holds; the data is found prepared, and the finished run says what it has
    again = [c for c in pasted if "make_tiny_llama" in c or "prepare-data" in c or "--lora" in c]
    for command in again[:3]:
        done = _paste(command, tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        said[command] = done.stdout
    assert "prepared already runs/tokens: " in said[again[1]]
    assert "already at step 30" in said[again[2]] and "step 30 exported" in said[again[2]]
