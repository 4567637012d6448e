"""The releases people download, read as they are released (tests/golden/released/: a
config.json each, no weights): `jaxpar plan` reads each as model.init=hf:DIR and counts
the parameters it is published with, within 0.5%. A release that leaves keys out reads
them at transformers' defaults."""

import re
from pathlib import Path

import pytest

from jaxpar.cli import main as cli

RELEASED = Path(__file__).parent / "golden" / "released"

# folder -> (the preset whose run keys plan it, published parameters): the README there
# says where each config and figure is from
RELEASES = {
    "deepseek-v3": ("deepseek-v3", 671e9),
    "kimi-k2": ("deepseek-v3", 1.03e12),
    "qwen3-8b-yarn": ("qwen3-tiny", 8.2e9),
    "llama-3.1-8b": ("llama-tiny", 8.03e9),
    "llama-3.1-70b": ("llama-tiny", 70.6e9),
    "gemma-3-27b": ("gemma3-12b", 27.016e9),
    "gpt-oss-20b": ("gpt_oss-tiny", 20.91e9),
    "gpt-oss-120b": ("gpt_oss-tiny", 116.83e9),
}


@pytest.mark.slow  # 20 s: the planner ranks 1,000-12,000 layouts a release
@pytest.mark.parametrize("release", RELEASES)
def test_plan_reads_the_release_and_counts_its_parameters(release, capsys):
    preset, published = RELEASES[release]
    argv = ["plan", "--config", preset, f"model.init=hf:{RELEASED / release}",
            "train.batch_size=64", "train.seq_len=4096", "--devices", "256", "--hosts", "32",
            "--device-memory", "80GB", "--top", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    counted = int(re.search(r"model\.name=\w+: ([\d,]+) parameters", out)[1].replace(",", ""))
    assert counted == pytest.approx(published, rel=0.005), (release, counted)


@pytest.mark.slow  # 2 s, transformers' import: the fast tier keeps its budget
def test_a_text_config_left_out_reads_as_transformers_defaults():
    """Gemma 3's multimodal releases give a few text keys (gemma-3-27b/config.json): a
    text config with none reads as transformers' Gemma3TextConfig() does."""
    transformers = pytest.importorskip("transformers")
    from jaxpar import hf
    from jaxpar.config import registry

    fmt = registry.get("gemma3").hf
    empty = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}
    theirs = transformers.Gemma3TextConfig().to_dict()
    assert fmt.config_from_hf(hf.model_config(fmt, empty)) == fmt.config_from_hf(theirs)
