"""Presets parse; every configuration mistake exits 2 with one message naming key and fix."""

import pytest
from helpers import jaxpar_command

from jaxpar.cli import main as cli
from jaxpar.config import presets, registry
from jaxpar.config.sections import given
from jaxpar.parallel import layout_checks
from jaxpar.parallel.mesh import resolve_degrees


@pytest.mark.parametrize("name", presets.preset_names())
def test_presets_parse_and_start_with_their_command(name):
    presets.load(name)  # parses
    text = (presets.resources.files("jaxpar") / "configs" / f"{name}.yaml").read_text()
    first = text.splitlines()[0]
    assert first.startswith("# jaxpar train")
    assert (name == "default") == (first.strip() == "# jaxpar train")
    assert first.removeprefix("# jaxpar train").split() == (
        [] if name == "default" else ["--config", name]
    )


@pytest.mark.parametrize(
    "degrees",
    [
        (8, 1),
        (4, 2),
        (2, 4),
        (1, 8),
    ],
)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_gpt_tiny_valid_for_every_strategy(degrees, zero):
    data, tensor = degrees
    cfg = presets.load(
        "gpt-tiny", [f"parallel.data={data}", f"parallel.tensor={tensor}", f"parallel.zero={zero}"]
    )
    mesh_shape = resolve_degrees(cfg.parallel, 8)
    registry.check_model(cfg.model, mesh_shape)
    given(layout_checks.check, cfg, mesh_shape)
    assert cfg.model.layers >= 4 and cfg.train.batch_size == 16


def test_short_corpus_file(tmp_path, capsys, devices):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    code = cli.main(
        [
            "train",
            "--config",
            "gpt-tiny",
            "data.source=file",
            f"data.path={short}",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "9 bytes" in err and "train.seq_len" in err


def test_bad_preset_and_bad_yaml(tmp_path, capsys):
    assert cli.main(["train", "--config", "nope"]) == 2
    assert "no such preset" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2")
    assert cli.main(["train", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_no_traceback_from_the_installed_command(tmp_path):
    """The real console entry point, in a fresh process: exit 2, one line, no traceback."""
    proc = jaxpar_command(
        "train",
        "--config",
        "gpt-tiny",
        "parallel.data=3",
        "--cpu-devices",
        "8",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "jaxpar: error: parallel degrees: data(3) * pipeline(1) * tensor(1) = 3 != 8 devices; "
        "make the product 8, or set one degree to -1"
    ]


def test_a_run_records_its_paths_absolute(tmp_path, monkeypatch):
    """Relative paths (from the folder a run starts in) are recorded absolute, so that
    export, generate and eval read the run from any folder; absolute ones, empty ones and
    the corpus stay as given."""
    monkeypatch.chdir(tmp_path)
    cfg = presets.load(
        "llama-tiny",
        ["data.source=tokens", "data.path=runs/tokens", "checkpoint.dir=/abs/ck",
         "model.init=hf:runs/tiny-llama", "adapter.init=peft:../peft"],
    )  # fmt: skip
    got = presets.absolute_paths(cfg)
    assert got.data.path == str(tmp_path / "runs" / "tokens")
    assert got.model.init == f"hf:{tmp_path / 'runs' / 'tiny-llama'}"
    assert got.adapter.init == f"peft:{tmp_path / '..' / 'peft'}"
    assert got.checkpoint.dir == "/abs/ck" and got.train == cfg.train
    assert presets.absolute_paths(presets.load("gpt-tiny")) == presets.load("gpt-tiny")
