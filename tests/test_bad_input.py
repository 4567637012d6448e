"""Bad invocations generated from the config schema (wrong types, out of range, huge,
NaN/inf, typos of keys and choices, impossible combinations, bad files, bad --out, bad
flags): each exits 2 with one `jaxpar: error:` line naming what is wrong, no traceback,
no compile started, within seconds. The CLI's main() runs in-process."""

import dataclasses
import subprocess
import sys
import time
import typing

import pytest

from jaxpar import cli, config, run

BIG = "9" * 5000  # past Python's 4300-digit limit for int()


def _below(key: str) -> str:
    r = config.RANGES[key]
    low = r.low if r.open_low else r.low - 1
    return str(-2 if key in config.DEGREES else low)


def _numeric_cases():
    for key in config.RANGES:
        yield f"{key}-type", [f"{key}=abc"], [key, "expected"]
        yield f"{key}-nan", [f"{key}=nan"], [key, "not a finite number"]
        yield f"{key}-inf", [f"{key}=-inf"], [key, "not a finite number"]
        yield f"{key}-huge", [f"{key}=1e12"], [key, "out of range"]
        yield f"{key}-5000-digits", [f"{key}={BIG}"], [key, "out of range", "5000"]
        yield f"{key}-below", [f"{key}={_below(key)}"], [key, "out of range"]


def _key_cases():
    for section, cls in typing.get_type_hints(config.Config).items():
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            yield f"{key}-typo", [f"{key}x=1"], [f"{key}x: unknown key", f"did you mean {key}"]
            if key in config.CHOICES:
                yield f"{key}-choice", [f"{key}=nonesuch"], [key, "choose one of"]


COMBINATIONS = {
    "degrees": (["parallel.data=3"], ["parallel degrees", "!= 8 devices"]),
    "microbatches": (["parallel.microbatches=2"], ["parallel.microbatches=2", "pipeline > 1"]),
    "virtual": (["parallel.virtual_stages=2"], ["parallel.virtual_stages=2", "pipeline > 1"]),
    "interleaved": (["parallel.schedule=interleaved"], ["schedule=interleaved", "pipeline > 1"]),
    "path-no-file": (["data.path=a.txt"], ["data.path='a.txt'", "data.source=file"]),
    "file-no-path": (["data.source=file"], ["data.path=''", "no such file"]),
    "server-zero": (["parallel.dp_collective=server", "parallel.zero=2"], ["server"]),
    "heads": (["model.embed=60"], ["model.embed=60", "model.heads=8"]),
    "batch": (["train.batch_size=12"], ["train.batch_size=12", "data(8)"]),
    "tensor-vocab": (["parallel.tensor=8", "model.vocab=260"], ["model.vocab=260"]),
    "stages": (["parallel.pipeline=8"], ["parallel.pipeline=8", "layers"]),
    "two-rest": (["parallel.tensor=-1"], ["parallel.data", "parallel.tensor", "-1"]),
    "empty-key": ([".=1"], ["'.=1'", "empty part"]),
    "no-section": (["steps=1"], ["'steps=1'", "SECTION.KEY=VALUE"]),
    "section-value": (["train=1"], ["'train=1'", "SECTION.KEY=VALUE"]),
    "not-a-section": (["train.steps.x=1"], ["train.steps: is a key, not a section"]),
    "stray-dot": (["paralel.tensor=2"], ["did you mean parallel?"]),
}

# name -> (file bytes, needles); the file is passed as --config
FILES = {
    "not-utf8": (bytes(range(128, 256)), ["{path}: not UTF-8 text", "byte 0x80 at offset 0"]),
    "utf16": ("train: {steps: 2}\n".encode("utf-16"), ["{path}: not UTF-8 text", "byte 0xff"]),
    "elf": (b"\x7fELF\x02\x01\x01\x00", ["{path}: not valid YAML at character 0", "#x007f"]),
    "nul": (b"train: {steps: 2}\x00\n", ["{path}: not valid YAML at character 17"]),
    "unclosed": (b"train: [1, 2\n", ["{path}: not valid YAML at line 2, column 1"]),
    "tab-indent": (b"train:\n\tsteps: 2\n", ["{path}: not valid YAML at line 2"]),
    "list": (b"- 1\n- 2\n", ["{path}: expected a mapping of sections", "[1, 2]"]),
    "scalar-section": (b"train: 3\n", ["train: expected a mapping of keys"]),
    "unknown-key": (b"train: {stepz: 3}\n", ["train.stepz: unknown key"]),
    "big-int": (f"train: {{seed: {BIG}}}\n".encode(), ["{path}", "Exceeds the limit"]),
    "lr-nan": (b"train: {lr: .nan}\n", ["train.lr=nan", "not a finite number"]),
    "lr-string": (b"train: {lr: fast}\n", ["train.lr='fast'", "expected float"]),
}


def _cases():
    yield from _numeric_cases()
    yield from _key_cases()
    yield from ((f"combination-{n}", *c) for n, c in COMBINATIONS.items())


CASES = {name: (argv, needles) for name, argv, needles in _cases()}


def test_at_least_a_hundred_cases():
    assert len(CASES) + len(FILES) + len(OUT) + len(FLAGS) >= 100


@pytest.fixture
def no_compile(monkeypatch):
    """Any compile fails the test: every one of these must be refused before."""

    def refuse(*_):
        raise AssertionError("a compile started")

    monkeypatch.setattr(run, "compile_step", refuse)


def _refused(argv: list[str], needles: list[str], capsys) -> None:
    start = time.perf_counter()
    code = cli.main(argv)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and len(err) < 1200, err
    for needle in needles:
        assert needle in err, err
    assert seconds < 10, f"refused after {seconds:.1f} s"


@pytest.mark.parametrize("case", CASES)
def test_override_refused(case, capsys, tmp_path, devices, no_compile):
    argv, needles = CASES[case]
    _refused(
        ["train", "--config", "gpt-tiny", *argv, "--out", str(tmp_path / "run")], needles, capsys
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", FILES)
def test_config_file_refused(case, capsys, tmp_path, no_compile):
    raw, needles = FILES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(raw)
    needles = [n.replace("{path}", f"--config {path}") for n in needles]
    _refused(["train", "--config", str(path), "--out", str(tmp_path / "run")], needles, capsys)


# name -> (how to make the bad --out under tmp, needles)
OUT = {
    "a-file": (
        lambda tmp: (tmp / "f").write_text("x") and tmp / "f",
        ["is a file, not a directory"],
    ),
    "under-a-file": (
        lambda tmp: (tmp / "f").write_text("x") and tmp / "f" / "run",
        ["is a file, so no directory can be made under it"],
    ),
    "proc": (lambda tmp: "/proc/jaxpar-run", ["cannot write in /proc"]),
    "checkpoint-dir": (lambda tmp: (tmp / "f").write_text("x") and tmp / "f", ["checkpoint.dir"]),
}


@pytest.mark.parametrize("case", OUT)
def test_bad_out_refused_before_jax(case, capsys, tmp_path, no_compile):
    make, needles = OUT[case]
    bad = str(make(tmp_path))
    argv = (
        ["--out", str(tmp_path / "run"), f"checkpoint.dir={bad}"]
        if case == "checkpoint-dir"
        else ["--out", bad]
    )
    _refused(["train", "--config", "gpt-tiny", *argv], needles, capsys)


FLAGS = {
    "many-devices": (["train", "--cpu-devices", "10000"], ["--cpu-devices 10000", "1 to 512"]),
    "no-devices": (["train", "--cpu-devices", "0"], ["--cpu-devices 0"]),
    "devices-type": (["train", "--cpu-devices", "x"], ["--cpu-devices", "invalid int value"]),
    "flag": (["train", "--warp", "9"], ["unrecognized arguments: --warp", "jaxpar train --help"]),
    "command": (["trian"], ["invalid choice: 'trian'"]),
    "no-command": ([], ["required: COMMAND"]),
    "preset": (["train", "--config", "gpt-huge"], ["--config gpt-huge", "no such preset"]),
    "missing-yaml": (["train", "--config", "no.yaml"], ["--config no.yaml", "no such file"]),
    "directory": (["train", "--config", "/tmp"], ["--config /tmp", "no such file"]),
    "launch": (["launch", "--", "train"], ["--processes"]),
    "bench-override": (["bench", "model.embedd=3"], ["model.embedd: unknown key"]),
    "export-to": (["export", "runs/x"], ["--to"]),
}


@pytest.mark.parametrize("case", FLAGS)
def test_bad_flags_refused(case, capsys, no_compile):
    argv, needles = FLAGS[case]
    _refused(argv, needles, capsys)


def test_refused_by_the_installed_command_before_jax_starts(tmp_path):
    """A fresh process: the refusal takes well under the ~2 s jax needs to start, as
    nothing imports it before the config and --out are checked."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "train", "train.lr=inf", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("jaxpar: error: train.lr=inf")
    check = "import sys, jaxpar.cli; assert 'jax' not in sys.modules, 'jax imported'"
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0
    assert time.perf_counter() - start < 10
