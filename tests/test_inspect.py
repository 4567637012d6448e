"""`jaxpar inspect`: every leaf's shardings and bytes, from a compiled step never run."""

from pathlib import Path

from helpers import THREE_D_1F1B, prepared

from jaxpar import inspection
from jaxpar.cli import main as cli


def test_leaf_bytes_add_up_to_the_compiled_state(devices):
    run = prepared("gpt-tiny", (*THREE_D_1F1B[:3], "parallel.zero=3", *THREE_D_1F1B[4:]))
    rows = inspection.leaves(run)
    assert sum(r["bytes"] for r in rows) == run.report.memory_per_device.params
    wqkv = next(r for r in rows if r["path"] == "blocks/attn/wqkv")
    assert wqkv["names"][:2] == ("stage", "layers")  # the pipeline's staged stack
    assert tuple(wqkv["storage"])[0] == "pipeline" and "data" in tuple(wqkv["storage"])


def test_the_command_prints_leaves_and_the_ledger_and_draws(tmp_path, capsys, devices, monkeypatch):
    argv = ["inspect", "--config", "gpt-tiny", "parallel.data=4", "parallel.tensor=2"]
    assert cli.main([*argv, "parallel.zero=3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "blocks/mlp/w_in" in out and "(-, data, tensor)" in out  # storage: ZeRO + Megatron
    assert "x the textbook minimum" in out
    assert (tmp_path / "layout.png").read_bytes()[:4] == b"\x89PNG"
    # without --out the picture goes where a run's files go, never into the working folder
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.main([*argv, "parallel.zero=3"]) == 0
    assert [p.name for p in Path().iterdir()] == ["runs"]
    (drawn,) = Path("runs").glob("*-gpt-tiny-inspect/layout.png")
    assert capsys.readouterr().out.endswith(f"layout picture: {drawn}\n")


def test_the_picture_names_each_column_on_every_inner_axis():
    """An expert layout's columns are (expert, pipeline, context, tensor) coordinates, not
    pipeline alone: expert=4 x tensor=2 has 8 distinct column names."""

    class Mesh:
        shape = {"expert": 4, "pipeline": 1, "context": 1, "tensor": 2}

    columns = [inspection._column(Mesh, k) for k in range(8)]
    assert columns[:3] == ["e0 p0 t0", "e0 p0 t1", "e1 p0 t0"] and columns[-1] == "e3 p0 t1"
    Mesh.shape = {"expert": 1, "pipeline": 2, "context": 2, "tensor": 2}
    assert inspection._column(Mesh, 7) == "p1 c1 t1"
