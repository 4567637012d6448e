"""Bad invocations generated from the config schema (wrong types, out of range, huge,
NaN/inf, typos of keys and choices, impossible combinations, bad files, bad --out, bad
flags): each exits 2 with one `jaxpar: error:` line naming what is wrong, no traceback,
no compile started, within seconds. The CLI's main() runs in-process."""

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from helpers import one_line_error

from jaxpar import recipe
from jaxpar.cli import main as cli
from jaxpar.compiled import run
from jaxpar.config import presets, registry
from jaxpar.config import sections as config
from jaxpar.errors import ConfigError

BIG = "9" * 5000  # past Python's 4300-digit limit for int()


KEYS = presets.keys()  # every declared key: its kind, choices and range
# The ranges as reviewed (tests/golden/key_ranges.json): the boundary values below come
# from them, not from the declarations under test, so a range that moves fails here
# until the golden file is regenerated (--update-golden) and its diff reviewed.
GOLDEN_RANGES = Path(__file__).parent / "golden" / "key_ranges.json"


def _declared_ranges() -> dict:
    return {
        key: [decl.range.low, decl.range.high, decl.range.open_low, decl.range.rest]
        for key, decl in KEYS.items()
        if decl.range is not None
    }


RANGES = json.loads(GOLDEN_RANGES.read_text())


def _below(key: str) -> str:
    low, _, open_low, rest = RANGES[key]
    return str(-2 if rest else (low if open_low else low - 1))


def test_the_ranges_are_the_reviewed_ones(update_golden):
    declared = _declared_ranges()
    if update_golden:
        GOLDEN_RANGES.write_text(json.dumps(declared, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"rewrote {GOLDEN_RANGES}")
    assert declared == RANGES, f"{GOLDEN_RANGES} differs; rerun with --update-golden, review"


def _on(decl) -> list[str]:
    """A model's own key is given with that model."""
    return [f"model.name={decl.model}"] if decl.model else []


def _numeric_cases():
    for key, decl in KEYS.items():
        if decl.range is None:
            continue
        on = _on(decl)
        yield f"{key}-type", [*on, f"{key}=abc"], [key, "expected", "it must be"]
        yield f"{key}-nan", [*on, f"{key}=nan"], [key, "not a finite number"]
        yield f"{key}-inf", [*on, f"{key}=-inf"], [key, "not a finite number"]
        yield f"{key}-huge", [*on, f"{key}=1e12"], [key, "out of range"]
        yield f"{key}-5000-digits", [*on, f"{key}={BIG}"], [key, "out of range", "5000"]
        yield f"{key}-below", [*on, f"{key}={_below(key)}"], [key, "out of range"]


def _key_cases():
    for key, decl in KEYS.items():
        on = _on(decl)
        yield f"{key}-typo", [*on, f"{key}x=1"], [f"{key}x: unknown key", f"did you mean {key}"]
        if decl.choices is not None:
            yield f"{key}-choice", [*on, f"{key}=nonesuch"], [key, "choose one of"]
            # a near miss in capitals (TRUE and FALSE are YAML's booleans: a choice named
            # true or false takes them)
            near = str(decl.choices[-1]).upper()
            if isinstance(decl.choices[0], str) and near not in ("TRUE", "FALSE"):
                yield f"{key}-case", [*on, f"{key}={near}"], [f"did you mean {decl.choices[-1]}?"]


TIERED = ("checkpoint.every=1", "checkpoint.shared_every=2")  # two tiers' saves, as asked
COMBINATIONS = {  # every key is checked in Python too: test_python_twin
    "other-models-key": (
        ["model.tie_embeddings=true"],
        ["model.tie_embeddings: unknown key", "model.name=llama's"],
    ),
    "degrees": (["parallel.data=3"], ["parallel degrees", "!= 8 devices"]),
    # the checkpoint tiers (checkpoint.local_dir): one line each
    "local-tier-never-saved": (
        ["checkpoint.local_dir=/tmp/fast"],
        ["checkpoint.local_dir=/tmp/fast with checkpoint.every=0", "give checkpoint.every=N"],
    ),
    "shared-every-one-tier": (
        ["checkpoint.shared_every=4"],
        ["checkpoint.shared_every=4 without checkpoint.local_dir", "checkpoint.local_dir=PATH"],
    ),
    "shared-every-between-saves": (
        ["checkpoint.local_dir=/tmp/fast", "checkpoint.every=2", "checkpoint.shared_every=5"],
        ["checkpoint.shared_every=5", "multiple of 2", "checkpoint.shared_every=4"],
    ),
    "local-tier-is-the-shared": (
        ["checkpoint.local_dir=/tmp/fast", "checkpoint.dir=/tmp/fast", *TIERED],
        ["checkpoint.local_dir=/tmp/fast is checkpoint.dir", "folders of their own"],
    ),
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
    "context-seq": (
        ["parallel.context=8", "parallel.data=1", "train.seq_len=72"],
        ["train.seq_len=72", "2 x parallel.context = 16 chunks", "multiple of 16"],
    ),
    "context-seq-unbalanced": (
        [
            "parallel.context=8",
            "parallel.data=1",
            "train.seq_len=60",
            "parallel.context_balance=false",
        ],
        ["train.seq_len=60", "parallel.context=8 parts"],
    ),
    "ulysses-heads": (
        [
            "parallel.context=4",
            "parallel.tensor=2",
            "parallel.data=1",
            "model.heads=4",
            "parallel.context_strategy=ulysses",
        ],
        ["context_strategy=ulysses", "model.heads=4", "context=4 x parallel.tensor=2 = 8"],
    ),
    "sp-without-tensor": (
        ["parallel.sequence_parallel=true"],
        ["sequence_parallel=true", "parallel.tensor=1"],
    ),
    "context-strategy": (["parallel.context_strategy=ring"], ["parallel.context_strategy", "ring"]),
    "context-product": (
        ["parallel.context=3", "parallel.data=2"],
        ["context(3)", "= 6 != 8 devices"],
    ),
    "context-local-sgd": (
        ["parallel.context=2", "parallel.dp_sync=params"],
        ["dp_sync=params", "parallel.context=2"],
    ),
    "experts-k": (
        ["model.name=mixtral", "model.experts=4", "model.experts_per_token=5"],
        ["model.experts_per_token=5 > model.experts=4", "choose k <= 4"],
    ),
    "moe-every-out-of-range": (
        ["model.name=mixtral", "model.experts=4", "model.layers=4", "model.moe_every=3"],
        ["model.moe_every=3 with model.layers=4", "choose n among [1, 2, 4]"],
    ),
    "moe-every-dense": (
        ["model.name=llama", "model.moe_every=2"],
        ["model.moe_every=2 is a key of a mixture of experts", "model.experts=0 has none"],
    ),
    "moe-every-zero": (
        ["model.name=mixtral", "model.experts=4", "model.moe_every=0"],
        ["model.moe_every"],
    ),
    "experts-dense-llama": (
        ["model.name=llama", "model.experts=4"],
        ["model.experts=4 is mixtral's, not llama's; set model.name=mixtral"],
    ),
    "mixtral-without-experts": (
        ["model.name=mixtral"],
        ["model.name=mixtral is a mixture of experts", "set model.experts"],
    ),
    "qwen3-moe-without-experts": (
        ["model.name=qwen3_moe", "model.qk_norm=true"],
        ["model.name=qwen3_moe is a mixture of experts", "Qwen3-30B-A3B: 128"],
    ),
    "expert-dense": (
        ["parallel.expert=2", "parallel.data=4"],
        ["parallel.expert=2 splits a mixture's experts", "model.name=gpt has none"],
    ),
    "expert-divides": (
        ["model.name=mixtral", "model.experts=6", "parallel.expert=4", "parallel.data=2"],
        ["model.experts=6 is not divisible by parallel.expert=4"],
    ),
    "expert-local-sgd": (
        ["model.name=mixtral", "model.experts=4", "parallel.expert=2", "parallel.data=4"]
        + ["parallel.dp_sync=params"],
        ["parallel.expert", "every expert of its own"],
    ),
    "balance-without-experts": (
        ["model.name=llama", "model.router_aux_loss=0.01"],
        ["model.router_aux_loss=0.01", "model.experts=0 has none"],
    ),
    "empty-key": ([".=1"], ["'.=1'", "empty part"]),
    "no-section": (["steps=1"], ["'steps=1'", "SECTION.KEY=VALUE"]),
    "section-value": (["train=1"], ["'train=1'", "SECTION.KEY=VALUE"]),
    "not-a-section": (["train.steps.x=1"], ["train.steps: is a key, not a section"]),
    "stray-dot": (["paralel.tensor=2"], ["did you mean parallel?"]),
    "product": (["parallel.data=3"], ["data(3) * pipeline(1) * tensor(1) = 3 != 8"]),
    "two-rest-preset": (["parallel.data=-1", "parallel.tensor=-1"], ["parallel.data", "-1"]),
    "rest-indivisible": (["parallel.tensor=3"], ["parallel.data=-1", "3 does not divide 8"]),
    "heads-preset": (
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
    "batch-preset": (
        ["parallel.data=8", "train.batch_size=12"],
        ["train.batch_size=12", "data(8)"],
    ),
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
    "microbatches-preset": (
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
    "dualpipev-m": (
        [
            "parallel.data=4",
            "parallel.pipeline=2",
            "parallel.schedule=dualpipev",
            "parallel.microbatches=2",
        ],
        ["parallel.microbatches=2", "dualpipev", "4 micro-batches or more", "schedule=zbv"],
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
    "server-zero-preset": (
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
    "stray-dot-preset": (
        ["paralel.tensor=2"],
        ["paralel: unknown section; did you mean parallel?"],
    ),
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


@pytest.fixture
def no_compile(monkeypatch):
    """Any compile fails the test: every one of these must be refused before."""

    def refuse(*_):
        raise AssertionError("a compile started")

    monkeypatch.setattr(run, "compile_step", refuse)


def _refused(argv: list[str], needles: list[str], capsys) -> str:
    """The one line `argv` is refused with (checked), without its prefix."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("jaxpar: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and len(err) < 1200, err
    for needle in needles:
        assert needle in err, err
    return err.removeprefix("jaxpar: error: ").strip()


@pytest.mark.parametrize("case", CASES)
def test_override_refused(case, capsys, tmp_path, devices, no_compile):
    """Each generated mistake, once: `jaxpar train` refuses it with one line; and built in
    Python instead (jaxpar.Train(...), jaxpar.Config(...)) it is the same one line (a key
    Python does not know is Python's own TypeError, naming it)."""
    argv, needles = CASES[case]
    said = _refused(
        ["train", "--config", "gpt-tiny", *argv, "--out", str(tmp_path / "run")], needles, capsys
    )
    assert not (tmp_path / "run").exists()
    if case not in TWINS:
        return
    if "unknown" in said:
        with pytest.raises(TypeError, match=said.split(":")[0].split(".")[-1]):
            _built_in_python(argv)
        return
    with pytest.raises(ConfigError) as refused:
        _built_in_python(argv)
    assert str(refused.value) == said


# Every other subcommand that reads a config checks it with the same checker, before it
# compiles: one mistake of each kind (a range, a key, a choice, a model's own key) is
# refused by each with train's very line (the combinations need a mesh: train's and
# inspect's).
SUBCOMMANDS = {
    "inspect": lambda tmp: ["inspect", "--out", str(tmp / "run")],
    "bench": lambda tmp: ["bench", "--steps", "1", "--out", str(tmp / "run" / "b.json")],
    "plan": lambda tmp: ["plan", "--devices", "8", "--device-memory", "1GB"],
}
EACH_KIND = (
    "train.lr-below",
    "parallel.zero-typo",
    "parallel.schedule-choice",
    "model.kv_heads-nan",
)


@pytest.mark.parametrize("command", SUBCOMMANDS)
@pytest.mark.parametrize("case", EACH_KIND)
def test_every_subcommand_uses_the_same_checker(command, case, capsys, tmp_path, no_compile):
    argv, needles = CASES[case]
    train = _refused(
        ["train", "--config", "gpt-tiny", *argv, "--out", str(tmp_path / "t")], needles, capsys
    )
    head = SUBCOMMANDS[command](tmp_path)
    assert _refused([*head, "--config", "gpt-tiny", *argv], needles, capsys) == train
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["combination-" + n for n in COMBINATIONS])
def test_combination_refused_by_inspect(case, capsys, tmp_path, devices, no_compile):
    argv, needles = CASES[case]
    _refused(
        ["inspect", "--config", "gpt-tiny", *argv, "--out", str(tmp_path / "run")], needles, capsys
    )
    assert not (tmp_path / "run").exists()


OTHER_FLAGS = {
    "plan-out-under-a-file": (
        lambda t: ["plan", "--devices", "8", "--device-memory", "1GB", "--out", f"{t}/f/p.yaml"],
        ["--out", "its folder", "is a file, not a directory"],
    ),
    "plan-out-a-directory": (
        lambda t: ["plan", "--devices", "8", "--device-memory", "1GB", "--out", str(t)],
        ["--out", "is a directory; give a file name"],
    ),
    "bench-out-under-a-file": (
        lambda t: ["bench", "--out", f"{t}/f/b.json"],
        ["its folder", "is a file, not a directory"],
    ),
    "bench-steps": (lambda t: ["bench", "--steps", "0"], ["--steps 0: give 1 to"]),
    "inspect-out-a-file": (
        lambda t: ["inspect", "--out", f"{t}/f"],
        ["is a file, not a directory"],
    ),
    "launch-zero": (lambda t: ["launch", "--processes", "0", "--", "train"], ["--processes 0"]),
    "launch-nothing": (lambda t: ["launch", "--processes", "2"], ["launch: no command to run"]),
    "launch-what": (lambda t: ["launch", "--processes", "2", "--", "fly"], ["'fly' is neither"]),
    "launch-script": (lambda t: ["launch", "--processes", "2", "--", "no.py"], ["no.py: no such"]),
    "launch-bad-inner": (
        lambda t: ["launch", "--processes", "2", "--", "train", "train.lr=-1"],
        ["train.lr=-1: out of range"],
    ),
    "launch-devices": (
        lambda t: ["launch", "--processes", "2", "--cpu-devices-per-process", "0", "--", "train"],
        ["--cpu-devices-per-process 0"],
    ),
    "export-no-run": (lambda t: ["export", f"{t}/none", "--to", f"{t}/m.st"], ["no such run"]),
    "export-to-dir": (lambda t: ["export", str(t), "--to", str(t)], ["--to", "is a directory"]),
    "prepare-no-input": (
        lambda t: ["prepare-data", f"{t}/none.txt", "--tokenizer", str(t), "--out", f"{t}/o"],
        ["none.txt: no such file"],
    ),
}


@pytest.mark.parametrize("case", OTHER_FLAGS)
def test_subcommand_paths_and_numbers_refused(case, capsys, tmp_path, no_compile):
    (tmp_path / "f").write_text("a file")
    make, needles = OTHER_FLAGS[case]
    _refused(make(tmp_path), needles, capsys)


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
    "preset-typo": (["train", "--config", "gpt-tny"], ["did you mean gpt-tiny?"]),
    "missing-yaml": (["train", "--config", "no.yaml"], ["--config no.yaml", "no such file"]),
    "directory": (["train", "--config", "/tmp"], ["--config /tmp", "a directory, not a YAML"]),
    "launch": (["launch", "--", "train"], ["--processes"]),
    "bench-override": (["bench", "model.embedd=3"], ["model.embedd: unknown key"]),
    "export-to": (["export", "runs/x"], ["--to"]),
}


@pytest.mark.parametrize("case", FLAGS)
def test_bad_flags_refused(case, capsys, no_compile):
    argv, needles = FLAGS[case]
    _refused(argv, needles, capsys)


def test_refused_by_the_installed_command_before_jax_starts(tmp_path):
    """A fresh process: nothing imports jax before the config and --out are checked."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.main", "train", "train.lr=inf", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("jaxpar: error: train.lr=inf")
    check = "import sys, jaxpar.cli.main; assert 'jax' not in sys.modules, 'jax imported'"
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0


def _built_in_python(argv: list[str]) -> None:
    """The settings of `argv` built as a Python user builds them (jaxpar.Train(...),
    jaxpar.Config(...)), then set up and prepared as jaxpar.train does."""
    tree = presets._merge(presets._read_preset("gpt-tiny"), presets.parse_overrides(argv))
    sections = typing.get_type_hints(config.Config)
    cfg = config.Config(
        **{
            name: (
                registry.config_class(values.get("name", "gpt")) or sections[name]
                if name == "model" and values.get("name", "gpt") in registry.names()
                else sections[name]
            )(**values)
            if name in sections
            else values
            for name, values in tree.items()
        }
    )
    s = recipe.setup(cfg)
    run.prepare(cfg, s.problem, s.mesh, s.batches(0))


TWINS = {
    name: case
    for name, case in CASES.items()
    if not any(needle.startswith(("'", ".")) or "empty part" in needle for needle in case[1])
}


def test_python_refuses_the_measured_three():
    """The three that ran silently before: a schedule in capitals, a negative rate, a
    remat in capitals."""
    import jaxpar

    for build, needle in (
        (lambda: jaxpar.Parallel(schedule="1F1B"), "did you mean 1f1b?"),
        (lambda: jaxpar.Train(lr=-5.0), "train.lr=-5: out of range"),
        (lambda: jaxpar.Parallel(remat="Full"), "did you mean full?"),
    ):
        with pytest.raises(ConfigError, match=needle) as e:
            build()
        assert "\n" not in str(e.value)
    assert jaxpar.Parallel(schedule="gpipe").schedule is config.Schedule.GPIPE


# a preset's model with one key changed against it: refused by the model's checks
PRESET_KEYS = {
    "router-groups-indivisible": (
        ["--config", "deepseek-tiny", "model.router_groups=3"],
        ["model.router_groups=3 with model.experts=8", "choose among [1, 2, 4]"],
    ),
    "router-top-groups-too-few": (
        ["--config", "deepseek-tiny", "model.router_top_groups=1", "model.experts_per_token=4"],
        ["model.router_top_groups=1 of model.router_groups=4", "top_groups x 2 >= 4"],
    ),
    "bias-update-softmax": (
        ["--config", "qwen2_moe-tiny", "model.router_bias_update=0.001"],
        ["model.router_bias_update=0.001 moves a sigmoid router's", "model.router=softmax"],
    ),
    "latent-kv-heads": (
        ["--config", "deepseek-tiny", "model.kv_heads=2"],
        ["model.kv_heads=2 with model.kv_rank=32", "set model.kv_heads=8"],
    ),
    "latent-without-rope": (
        ["--config", "deepseek-tiny", "model.rope_dim=0"],
        ["model.rope_dim=0 with model.kv_rank=32", "even model.rope_dim > 0"],
    ),
    "dense-first-all": (
        ["--config", "deepseek-tiny", "model.dense_first=4"],
        ["model.dense_first=4 with model.layers=4", "choose at most 3"],
    ),
    "shared-gate-without-shared": (
        ["--config", "qwen2_moe-tiny", "model.shared_mlp=0"],
        ["model.shared_gate=true gates a shared expert", "model.shared_mlp=0 has none"],
    ),
    "global-every-without-window": (
        ["--config", "gemma2-tiny", "model.sliding_window=0"],
        ["model.global_every=2 with model.sliding_window=0", "set model.sliding_window"],
    ),
    "global-every-one": (
        ["--config", "gemma3-tiny", "model.global_every=1"],
        ["model.global_every=1 with model.sliding_window=16", "n >= 2"],
    ),
    "local-theta-without-groups": (
        ["--config", "gemma3-tiny", "model.global_every=0"],
        [
            "model.rope_local_theta=10000.0 is a key of local and global attention",
            "model.global_every=0 has none",
        ],
    ),  # fmt: skip
    "attention-cap-on-gemma3": (
        ["--config", "gemma3-tiny", "model.attn_softcap=50"],
        ["model.attn_softcap=50.0 is gemma2's, not gemma3's", "set model.name=gemma2"],
    ),
    "gemma-without-its-norms": (
        ["--config", "gemma2-tiny", "model.norm_offset=false"],
        ["model.name=gemma2 has model.norm_offset=true"],
    ),
}


@pytest.mark.parametrize("case", PRESET_KEYS)
def test_a_key_against_its_preset_s_model_is_refused(case, capsys, tmp_path):
    argv, needles = PRESET_KEYS[case]
    assert cli.main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    one_line_error(capsys, *needles)
