"""Presets parse; every configuration mistake exits 2 with one message naming key and fix."""

import pytest
from helpers import jaxpar_command

from jaxpar import cli, config
from jaxpar.mesh import resolve_degrees


@pytest.mark.parametrize("name", config.preset_names())
def test_presets_parse_and_start_with_their_command(name):
    config.load(name)  # parses
    text = (config.resources.files("jaxpar") / "configs" / f"{name}.yaml").read_text()
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
    cfg = config.load(
        "gpt-tiny", [f"parallel.data={data}", f"parallel.tensor={tensor}", f"parallel.zero={zero}"]
    )
    mesh_shape = resolve_degrees(cfg.parallel, 8)
    config.check_model(cfg.model, mesh_shape)
    config.check_train(cfg, mesh_shape)
    assert cfg.model.layers >= 4 and cfg.train.batch_size == 16


BAD = {
    "product": (["parallel.data=3"], ["data(3) * pipeline(1) * tensor(1) = 3 != 8"]),
    "two-rest": (["parallel.data=-1", "parallel.tensor=-1"], ["parallel.data", "-1"]),
    "rest-indivisible": (["parallel.tensor=3"], ["parallel.data=-1", "3 does not divide 8"]),
    "heads": (
        ["parallel.data=2", "parallel.tensor=4", "model.heads=6", "model.embed=96"],
        ["model.heads=6", "parallel.tensor=4"],
    ),
    "mlp": (
        ["parallel.data=1", "parallel.tensor=8", "model.mlp=100"],
        ["model.mlp=100", "parallel.tensor=8"],
    ),
    "vocab": (
        ["parallel.data=1", "parallel.tensor=8", "model.vocab=260"],
        ["model.vocab=260", "parallel.tensor=8"],
    ),
    "batch": (["parallel.data=8", "train.batch_size=12"], ["train.batch_size=12", "data(8)"]),
    "accum": (["parallel.data=8", "train.grad_accum=3"], ["train.grad_accum(3)", "24"]),
    "unknown-key": (["train.stepz=3"], ["train.stepz", "did you mean train.steps"]),
    "unknown-section": (["trainer.steps=3"], ["trainer: unknown section", "did you mean train?"]),
    "type": (["train.steps=abc"], ["train.steps='abc'", "expected int"]),
    "negative": (["train.lr=-1"], ["train.lr=-1", "out of range", "> 0"]),
    "zero-steps": (["train.steps=0"], ["train.steps=0", ">= 1"]),
    "choice": (["parallel.zero=4"], ["parallel.zero=4", "[0, 1, 2, 3]"]),
    "missing-file": (
        ["data.source=file", "data.path=/no/such.txt"],
        ["data.path='/no/such.txt'", "no such file"],
    ),
    "embed-heads": (["model.embed=100"], ["model.embed=100", "model.heads=8"]),
    "vocab-text": (["model.vocab=128"], ["model.vocab=128", "256"]),
    "no-equals": (["train.steps"], ["'train.steps'", "KEY=VALUE"]),
    "microbatches": (
        ["parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2", "parallel.microbatches=3"],
        ["parallel.microbatches(3)", "train.batch_size=16"],
    ),
    "stages-layers": (
        ["parallel.data=1", "parallel.pipeline=8"],
        ["parallel.pipeline=8", "8 chunks", "4 layers"],
    ),
    "virtual-fit": (
        [
            "parallel.data=2",
            "parallel.pipeline=4",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "parallel.microbatches=4",
        ],
        ["virtual_stages=2 = 8 chunks", "4 layers"],
    ),
    "virtual-schedule": (
        ["parallel.data=4", "parallel.pipeline=2", "parallel.virtual_stages=2"],
        ["parallel.schedule=1f1b", "virtual_stages=2"],
    ),
    "interleaved-m": (
        [
            "parallel.data=2",
            "parallel.pipeline=4",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "parallel.microbatches=2",
            "model.layers=8",
        ],
        ["parallel.microbatches=2", "multiple of parallel.pipeline=4"],
    ),
    "schedule-name": (["parallel.schedule=zigzag"], ["parallel.schedule='zigzag'", "gpipe"]),
    "microbatches-no-pipe": (["parallel.microbatches=2"], ["needs parallel.pipeline > 1"]),
    "dp-mode": (["parallel.dp_collective=tree"], ["parallel.dp_collective='tree'", "ring"]),
    "bucket": (["parallel.bucket_mb=0"], ["parallel.bucket_mb=0", "> 0"]),
    "offload": (["parallel.offload=disk"], ["parallel.offload='disk'", "optimizer"]),
    "offload-params": (
        ["parallel.offload=optimizer+params", "parallel.zero=1"],
        ["parallel.offload=optimizer+params", "parallel.zero=1", "ZeRO-3"],
    ),
    "remat-offload-1f1b": (
        ["parallel.remat=offload", "parallel.pipeline=2", "parallel.schedule=1f1b"],
        ["parallel.remat=offload", "schedule=1f1b", "schedule=gpipe"],
    ),
    "offload-params-pipeline": (
        ["parallel.offload=optimizer+params", "parallel.zero=3", "parallel.pipeline=2"],
        ["parallel.offload=optimizer+params", "parallel.pipeline=2", "offload=optimizer"],
    ),
    "server-zero": (
        ["parallel.dp_collective=server", "parallel.zero=1"],
        ["dp_collective=server", "parallel.zero=1", "ZeRO"],
    ),
    "zero-degree": (["parallel.tensor=0"], ["parallel.tensor=0", "(or -1)"]),
    "virtual-no-pipeline": (
        ["parallel.schedule=interleaved", "parallel.virtual_stages=2"],
        ["parallel.virtual_stages=2", "needs parallel.pipeline > 1"],
    ),
    "path-without-file-source": (
        ["data.path=notes.txt"],
        ["data.path='notes.txt'", "data.source=corpus", "add data.source=file"],
    ),
    "empty-key": ([".=1"], ["'.=1'", "empty part"]),
    "stray-dot": (["paralel.tensor=2"], ["paralel: unknown section; did you mean parallel?"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_exits_2_with_one_message(case, capsys, devices, tmp_path):
    overrides, needles = BAD[case]
    code = cli.main(
        [
            "train",
            "--config",
            "gpt-tiny",
            "--cpu-devices",
            "8",
            *overrides,
            "--out",
            str(tmp_path / "never-written"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert not (tmp_path / "never-written").exists()


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
