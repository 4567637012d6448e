"""`jaxpar train` end to end: the run directory keeps its contract."""

import json

from helpers import jaxpar_command

REQUIRED_ROW = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s"}


def test_train_writes_run_directory(tmp_path):
    out = tmp_path / "run"
    proc = jaxpar_command(
        "train",
        "--config",
        "gpt-tiny",
        "parallel.data=4",
        "parallel.tensor=2",
        "parallel.zero=1",
        "train.steps=4",
        "--cpu-devices",
        "8",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "data=4 x tensor=2, ZeRO-1, fp32" in proc.stdout  # start-up summary
    assert "x the textbook minimum" in proc.stdout and "loss" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(REQUIRED_ROW <= set(r) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"] == {"data": 4, "pipeline": 1, "tensor": 2}
    assert summary["devices"] == 8
    assert summary["config"]["parallel"]["zero"] == 1
    assert summary["final_loss"] == rows[-1]["loss"]
    assert set(summary["memory_per_device"]) == {"params", "grads", "opt_state", "temp"}
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
