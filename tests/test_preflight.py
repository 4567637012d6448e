"""Memory preflight: a step too big for this machine is refused before the first step,
with the compiled figure and the settings that would fit, measured; --force runs it."""

import pytest
from helpers import _shipped, prepared

from jaxpar.cli import main as cli
from jaxpar.compiled import run
from jaxpar.errors import ConfigError
from jaxpar.step import preflight

LAYOUT = ("parallel.data=8", "parallel.zero=1")


def _prepare(*overrides):
    """Compiled now (not cached), so the preflight runs."""
    cfg, mesh, problem, batches = _shipped("gpt-tiny", [*LAYOUT, *overrides])
    return run.prepare(cfg, problem, mesh, batches(0))


def _with_budget(monkeypatch, per_device: int) -> None:
    monkeypatch.setattr(preflight, "host_available", lambda: per_device * 8)


def test_a_step_that_fits_is_not_touched(devices):
    step = prepared("gpt-tiny", LAYOUT).step
    assert preflight.step_bytes(step.executable) < preflight.budget().bytes_per_device


@pytest.mark.slow
def test_too_big_a_step_names_the_settings_that_fit(devices, monkeypatch):
    need = preflight.step_bytes(prepared("gpt-tiny", LAYOUT).step.executable)
    _with_budget(monkeypatch, int(need * 0.8))
    with pytest.raises(ConfigError) as e:
        _prepare()
    message = str(e.value)
    assert message.startswith("memory: the compiled step needs")
    assert "x 8 devices" in message and "available host memory / 8 CPU devices" in message
    assert "Compiled and fits: " in message and "--force" in message
    fits = message.split("Compiled and fits: ")[1].split(";")[0]
    # each alternative was compiled: check the first one's figure against a real compile
    label = fits.split(" (")[0]
    alternative = preflight.step_bytes(prepared("gpt-tiny", (*LAYOUT, label)).step.executable)
    assert alternative <= need * 0.8


def test_state_too_big_is_refused_before_compiling(devices, monkeypatch, tmp_path, capsys):
    _with_budget(monkeypatch, 1024)

    def refuse(*_):
        raise AssertionError("a compile started")

    monkeypatch.setattr(run, "compile_step", refuse)
    argv = ["train", "--config", "gpt-tiny", *LAYOUT, "--out", str(tmp_path / "r")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar: error: memory: the parameters, gradients and Adam state")
    assert "more than the 1.0 KiB of available host memory / 8 CPU devices" in err


@pytest.mark.slow  # compiles and runs a large step
def test_force_runs_it_anyway(devices, monkeypatch, tmp_path, capsys):
    need = preflight.step_bytes(prepared("gpt-tiny", LAYOUT).step.executable)
    _with_budget(monkeypatch, need // 2)
    monkeypatch.setattr(preflight, "SEARCH_S", 0)  # no time to compile alternatives: list them
    argv = ["train", "--config", "gpt-tiny", *LAYOUT, "train.steps=2", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Try train.grad_accum=2, train.batch_size=8, parallel.remat=full" in err
    assert cli.main([*argv, "--force"]) == 0, capsys.readouterr().err
