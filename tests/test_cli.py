"""`jaxpar train` end to end: the run directory keeps its contract."""

import dataclasses
import json
import subprocess
import sys

import pytest
from helpers import compile_only, jaxpar_command

import jaxpar
from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.cost import throughput
from jaxpar.step import build, xla_flags
from jaxpar.training import console, rundir

REQUIRED_ROW = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}


@pytest.mark.slow
def test_train_writes_run_directory(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    # flags and overrides mixed, as people type them
    proc = jaxpar_command(
        "train",
        "--cpu-devices",
        "8",
        "parallel.data=4",
        "--config",
        "gpt-tiny",
        "parallel.tensor=2",
        "--out",
        str(out),
        "parallel.zero=1",
        "train.steps=4",
    )
    assert proc.returncode == 0, proc.stderr
    assert "data=4 x tensor=2, ZeRO-1, fp32" in proc.stdout  # start-up summary
    assert "x the textbook minimum" in proc.stdout and "loss" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(REQUIRED_ROW <= set(r) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"] == {
        "replica": 1,
        "data": 4,
        "expert": 1,
        "pipeline": 1,
        "context": 1,
        "tensor": 2,
    }
    assert summary["devices"] == 8
    assert summary["config"]["parallel"]["zero"] == 1
    assert summary["final_loss"] == rows[-1]["loss"]
    # DESIGN's four, and the frozen base of an adapter run (none here)
    memory = summary["memory_per_device"]
    assert set(memory) == {"params", "grads", "opt_state", "temp", "base", "reference"}
    assert memory["base"] == memory["reference"] == 0
    assert set(summary["host_memory_per_device"]) == {
        "params",
        "opt_state",
        "activations",
        "temp",
    }
    assert {"all-reduce", "all-gather", "reduce-scatter"} <= set(summary["collectives"])
    assert summary["comm"]["ratio"] <= 1.05
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "HloModule" in (out / "step.hlo.txt").read_text()[:200]
    # no checkpoint key set: the final state is kept all the same, and said where
    assert summary["checkpoint"] == str(out / "checkpoints" / "4")
    assert f"weights: {out / 'checkpoints' / '4'}" in proc.stdout
    assert f"jaxpar export {out} --to {out / 'model.safetensors'}" in proc.stdout
    exported = jaxpar_command("export", str(out), "--to", str(out / "model.safetensors"))
    assert exported.returncode == 0, exported.stderr
    assert jaxpar.load_exported(out / "model.safetensors")
    # the same command again: done already, said at once, nothing compiled
    monkeypatch.setattr(build, "compile_step", lambda *_: pytest.fail("compiled"))
    argv = ["train", "--config", "gpt-tiny", "parallel.data=4", "parallel.tensor=2"]
    assert cli.main([*argv, "parallel.zero=1", "train.steps=4", "--out", str(out)]) == 0
    assert "already at step 4 of train.steps=4: nothing to train" in capsys.readouterr().out


def test_a_second_writer_is_refused_and_a_killed_one_leaves_no_lock(tmp_path, capsys):
    """Two `jaxpar train` into one --out: the second exits 2 naming the first's process;
    once the first is killed (-9: no cleanup) the directory is free again."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jaxpar.training import rundir; "
         "held = rundir.lock(__import__('pathlib').Path(sys.argv[1])); print('held', flush=True); "
         "time.sleep(600)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["train", "--config", "mlp-tiny", "train.steps=1", "--out", str(out)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: another jaxpar run (process {holder.pid}) is writing there" in err
        assert err.count("\n") == 1 and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    rundir.lock(out).close()  # free: the kernel dropped the dead process's lock


def test_the_help_names_every_model_and_axis(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = capsys.readouterr().out
    assert "context and expert parallelism" in shown
    assert all(name in shown for name in ("llama", "mistral", "qwen3_moe", "mixtral"))


@pytest.mark.slow
def test_checkpoint_final_false_keeps_no_weights(tmp_path):
    argv = ["train", "--config", "mlp-tiny", "train.steps=2", "checkpoint.final=false"]
    assert cli.main([*argv, "--out", str(tmp_path / "run")]) == 0
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert cli.main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "w")]) == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "gpt-tiny", "--cpu-devices", "8", "parallel.data=4", "train.steps=5"],
        ["--cpu-devices", "8", "--config", "gpt-tiny", "parallel.data=4", "train.steps=5"],
        ["parallel.data=4", "--cpu-devices", "8", "train.steps=5", "--config", "gpt-tiny"],
        ["--out", "d", "parallel.data=4", "--config", "gpt-tiny", "train.steps=5", "--out", "d"],
    ],
)
def test_overrides_and_flags_in_any_order(argv):
    args = cli._parse(["train", *argv])
    assert args.config == "gpt-tiny"
    assert sorted(args.overrides) == ["parallel.data=4", "train.steps=5"]


def test_a_stray_argument_is_refused(capsys):
    assert cli.main(["train", "--config", "gpt-tiny", "parallel.data=4", "--warp", "9"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("jaxpar: error: unrecognized arguments: --warp 9") and err.count("\n") == 1
    )
    assert "jaxpar train --help" in err


def test_help_lists_every_config_key_and_version():
    top = jaxpar_command("--help")
    assert top.returncode == 0 and "jaxpar train --help" in top.stdout
    assert "dispatch" not in top.stdout  # no developer notes
    helped = jaxpar_command("train", "--help").stdout
    for key in presets.keys():
        assert f"  {key}=" in helped, key
    assert "--force" in helped and "numbers as 1e-3" in helped
    assert jaxpar_command("--version").stdout.strip() == f"jaxpar {jaxpar.__version__}"


@pytest.mark.slow
def test_console_counts_and_qualifiers(devices):
    report = compile_only("gpt-tiny", ("parallel.data=1",))
    header = console.startup(report, 1536, "cpu", "synthetic", 1536)
    assert "gpt, 1,536 parameters" in header and "(1 cpu device)" in header
    assert "train.objective=lm; trainable params: 1,536 || all params: 1,536 ||" in header
    assert console.count(12_345_678) == "12.3 M" and console.count(999) == "999"
    report = compile_only("gpt-tiny", ("parallel.data=8",))
    speed = throughput.figures(1.5e6 * 1024, 1024, 0.1, 8, None)
    done = report.trained(tokens_per_step=1024, final_loss=1.0, step_time_s=0.1, **speed)
    closing = console.closing(done, [2.0, 1.0])
    assert "2.0000 -> 1.0000" in closing
    assert "resumed part" not in closing
    # resumed at step 11 of 12: the run's first loss, and the resumed part's, labelled
    earlier = [{"step": 1, "loss": 5.5}, {"step": 10, "loss": 3.0}, {"step": 11, "loss": 2.0}]
    resumed = console.closing(done, [2.0, 1.0], earlier, first=11)
    assert "5.5000 (step 1) -> 1.0000 (step 12)" in resumed
    assert "resumed part" in resumed and "2.0000 -> 1.0000 (steps 11-12)" in resumed
    assert "1.9 GFLOP/s per device" in closing and "(1280 per device)" in closing
    assert "x minimum (data))" in closing  # the axes the minimum is over, as in the header
    assert "x the textbook minimum (data)" in console.startup(report, 1, "cpu", "corpus")
    # a CPU step has no XLA flags of jaxpar's; a GPU step lists them, XLA_FLAGS-spelt
    assert "xla " not in console.startup(report, 1, "cpu", "corpus")
    gpu = dataclasses.replace(report, xla_flags=xla_flags.gpu_flags(8))
    header = console.startup(gpu, 1, "gpu", "corpus")
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in header
    assert "--xla_gpu_all_gather_combine_threshold_bytes=134217728" in header
