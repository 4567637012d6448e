"""Bad Hugging Face checkpoints and keys: exit 2, one line naming the file or the key,
nothing written to the run directory, nothing compiled. The checkpoints are written by
jaxpar's own exporter from random parameters (no torch needed)."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import one_line_error
from safetensors.numpy import load_file, save_file

from jaxpar import hf, recipe
from jaxpar.cli import main as cli
from jaxpar.config import presets, registry
from jaxpar.nn.problem import registered
from jaxpar.step import build as run


def write_checkpoint(directory: Path, *overrides: str) -> Path:
    cfg = presets.load("llama-tiny", ["model.layers=2", *overrides])
    shapes = registered(cfg.model, cfg.train.seq_len).shapes
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in shapes.items()}
    hf.export(registry.get("llama").hf, cfg.model, 64, params, directory)
    return directory


def _edit_config(d: Path, **changes) -> None:
    path = d / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _truncate(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:999])


def _add_tensor(tensors: dict) -> dict:
    return {**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}


def _edit_tensors(d: Path, fn) -> None:
    path = d / "model.safetensors"
    save_file(fn(load_file(str(path))), str(path))


# name -> (how to spoil a good checkpoint directory, extra overrides, needles)
BAD = {
    "no-config": (lambda d: (d / "config.json").unlink(), [], ["no config.json there"]),
    "config-a-list": (
        lambda d: (d / "config.json").write_text("[1, 2]"),
        [],
        ["config.json holds a JSON list, not a model's settings"],
    ),
    "truncated": (
        _truncate,
        [],
        ["model.safetensors cannot be read"],
    ),
    "wrong-shape": (
        lambda d: _edit_config(d, intermediate_size=256),
        [],
        ["model.layers.0.mlp.gate_proj.weight has shape [128, 64]", "make it [256, 64]"],
    ),
    "architecture": (
        lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
        [],
        ["config.json says GPT2LMHeadModel", "reads LlamaForCausalLM"],
    ),
    "activation": (lambda d: _edit_config(d, hidden_act="gelu"), [], ["hidden_act='gelu'"]),
    "missing-tensor": (
        lambda d: _edit_tensors(d, lambda t: {k: v for k, v in t.items() if "1.mlp.up" not in k}),
        [],
        ["no tensor model.layers.1.mlp.up_proj.weight (1 missing)"],
    ),
    "unexpected-tensor": (
        lambda d: _edit_tensors(d, _add_tensor),
        [],
        ["unexpected tensor model.layers.0.self_attn.q_norm.weight"],
    ),
    "disagrees": (
        lambda d: None,
        ["model.layers=3"],
        ["model.layers=3 disagrees with model.init=hf:", "gives 2; drop model.layers"],
    ),
}  # fmt: skip


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*_):
        raise AssertionError("a compile started")

    monkeypatch.setattr(run, "compile_step", refuse)


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoint_refused(case, tmp_path, capsys, devices, no_compile):
    spoil, overrides, needles = BAD[case]
    directory = write_checkpoint(tmp_path / "ckpt")
    spoil(directory)
    out = tmp_path / "run"
    argv = ["train", "--config", "llama-tiny", f"model.init=hf:{directory}", *overrides]
    assert cli.main([*argv, "--out", str(out)]) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "init, needle",
    [("hf:/no/such/dir", "/no/such/dir is not a directory"), ("weights.bin", "give hf:DIR")],
)
def test_bad_init_key_refused_before_jax(init, needle, capsys, tmp_path):
    assert cli.main(["train", "--config", "llama-tiny", f"model.init={init}"]) == 2
    assert needle in capsys.readouterr().err


def test_an_exported_checkpoint_reads_back_exactly(tmp_path, devices):
    """jaxpar -> HF files -> jaxpar, each device reading its own slices: the same arrays,
    on a mesh that splits every dim the files' layout flattens."""
    cfg = presets.load("llama-tiny", ["model.layers=2", "parallel.data=2", "parallel.tensor=4"])
    directory = write_checkpoint(tmp_path / "ckpt")
    s = recipe.setup(cfg)
    want = {k: np.asarray(v) for k, v in load_file(str(directory / "model.safetensors")).items()}
    read = hf.initial_params(registry.get("llama").hf, cfg.model, directory, s.problem.shapes)
    sharding = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, None, "tensor"))
    target = jax.ShapeDtypeStruct((2, 64, 8, 8), np.float32, sharding=sharding)
    wq = read({"blocks/attn/wq": target})["blocks/attn/wq"]
    for layer in range(2):  # [heads x head_dim, embed] in the file
        np.testing.assert_array_equal(
            np.asarray(wq[layer]).reshape(64, 64).T,
            want[f"model.layers.{layer}.self_attn.q_proj.weight"],
        )
    assert read.reader.bytes_read == 2 * 64 * 64 * 4 * 2  # 8 shards: each read once per data


WORKER = """
import sys
import jax
from jaxpar import hf
from jaxpar import recipe
from jaxpar.parallel import distributed
from jaxpar.config import presets
from jaxpar.config import registry
from jaxpar.parallel import mesh
if "JAX_NUM_CPU_DEVICES" not in __import__("os").environ:
    mesh.use_cpu_devices(8)
distributed.initialize()
cfg = presets.load("llama-tiny", ["model.layers=2", "parallel.data=2", "parallel.tensor=4"])
s = recipe.setup(cfg)
read = hf.initial_params(registry.get("llama").hf, cfg.model, sys.argv[1], s.problem.shapes)
from jaxpar.training.checkpoint import layout
from jaxpar.step.build import build
engine = build(s.problem, cfg, s.mesh)
params = read(
    layout(s.problem, engine, s.mesh, cfg.parallel.zero, cfg.train.precision).target["params"]
)
jax.block_until_ready(params)
print("BYTES", jax.process_index(), read.reader.bytes_read, flush=True)
"""


@pytest.mark.slow
def test_each_process_reads_only_its_own_devices_slices(tmp_path):
    """Two processes of 4 devices (data=2 x tensor=4, a process per data row) each read
    their own devices' shards and nothing else (jax asks once per process for a leaf
    every device holds whole)."""
    import subprocess
    import sys

    directory = write_checkpoint(tmp_path / "ckpt")
    script = tmp_path / "read_hf.py"
    script.write_text(WORKER)
    one = subprocess.run(
        [sys.executable, str(script), str(directory)], capture_output=True, text=True
    )
    assert one.returncode == 0, one.stderr[-2000:]
    alone = int(one.stdout.split("BYTES 0 ")[1].split()[0])
    two = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.main", "launch", "--processes", "2", "--", str(script),
         str(directory)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    logs = [(tmp_path / f"process-{i}.log").read_text() for i in range(2)]
    each = [int(log.split(f"BYTES {i} ")[1].split()[0]) for i, log in enumerate(logs)]
    # what every device needs whole (kv heads replicated over tensor=4, the norms) each
    # process reads once; the split leaves, its own devices' half of what one process reads
    whole = sum(
        v.nbytes
        for k, v in load_file(str(directory / "model.safetensors")).items()
        if any(part in k for part in ("k_proj", "v_proj", "norm"))
    )
    assert each[0] == each[1] == (alone - whole) // 2 + whole


IMPORT = """
import sys, time
from jaxpar import hf
from jaxpar import recipe
from jaxpar.parallel import mesh
from jaxpar.config import presets
from jaxpar.config import registry
mesh.use_cpu_devices(8)
import jax
from jaxpar.training.checkpoint import layout
from jaxpar.step.build import build
cfg = presets.load("llama-tiny", sys.argv[2:])
s = recipe.setup(cfg)
engine = build(s.problem, cfg, s.mesh)
targets = layout(s.problem, engine, s.mesh, cfg.parallel.zero, cfg.train.precision).target["params"]
def hwm():
    line = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    return int(line.split()[1]) * 1024
before, start = hwm(), time.perf_counter()
read = hf.initial_params(registry.get("llama").hf, cfg.model, sys.argv[1], s.problem.shapes)
jax.block_until_ready(read(targets))
print("IMPORT", before, hwm(), time.perf_counter() - start)
"""
BIG = ["model.layers=4", "model.embed=1024", "model.heads=16", "model.kv_heads=4",
       "model.mlp=4096", "model.vocab=8192"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.tensor=8",), ("parallel.data=8", "parallel.zero=3")])
def test_an_import_peaks_near_the_model_size(layout, tmp_path):
    """Host memory (on the CPU, the devices' too) grows by about the model's own size
    while a 330 MB checkpoint loads: no whole-file copy, no host copy before the shards."""
    import subprocess
    import sys

    cfg = presets.load("llama-tiny", BIG)
    shapes = registered(cfg.model, cfg.train.seq_len).shapes
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(v.shape, np.float32) for k, v in shapes.items()}
    directory = tmp_path / "ckpt"
    hf.export(registry.get("llama").hf, cfg.model, 64, params, directory)
    size = (directory / "model.safetensors").stat().st_size
    del params
    script = tmp_path / "import.py"
    script.write_text(IMPORT)
    done = subprocess.run(
        [sys.executable, str(script), str(directory), *BIG, *layout],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, peak, seconds = (float(x) for x in done.stdout.split("IMPORT ")[1].split())
    ratio = (peak - before) / size
    print(f"import of {size / 2**20:.0f} MiB in {seconds:.1f} s: peak +{ratio:.2f} x the model")
    assert ratio < 1.5, ratio
