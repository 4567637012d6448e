"""`jaxpar bench --only longest`: the longest sequence one row of which fits, for
context = 1, 2, 4, 8: measured on llama-tiny from the compiled step's temporaries, and
predicted by the planner for llama3-8b on 64 GPUs."""

from __future__ import annotations

import jax

from jaxpar.bench import measure
from jaxpar.compiled.run import prepare
from jaxpar.config import presets
from jaxpar.cost.report import human_bytes, table
from jaxpar.nn.problem import registered
from jaxpar.recipe import setup

LONGEST_BUDGET = 256 * 2**20  # per-device temporaries, llama-tiny on the CPU
# 256, 384, 512, 768, ... 12288: steps of 1.5 and 4/3
LONGEST_LENGTHS = tuple(sorted(n * 2**k for n in (256, 384) for k in range(6)))
LONGEST_GPU = tuple(4096 * 2**k for k in range(9))  # 4k .. 1M (train.seq_len at most)


def longest_sequences(tables: dict) -> dict:
    """The longest sequence (of those listed) one row of which fits a per-device budget, for
    context = 1, 2, 4, 8: measured on llama-tiny from the compiled step's temporaries
    (compiled, not run; the CPU keeps each layer's [S/C, S] scores, so memory grows as
    S^2 / C there), and predicted by the planner for llama3-8b on 64 80 GB GPUs (tensor=8
    inside each host, ZeRO-3, no remat, cuDNN attention keeping no scores: S / C)."""
    from jaxpar.cost import planner

    measured = {}
    for c in (1, 2, 4, 8):
        fits = 0
        for seq in LONGEST_LENGTHS:
            overrides = ["parallel.data=1", f"parallel.context={c}", "train.batch_size=1"]
            cfg = presets.load("llama-tiny", [*overrides, f"train.seq_len={seq}"])
            s = setup(cfg, jax.devices()[:c])
            temp = prepare(cfg, s.problem, s.mesh, s.batches(0), True).report
            if temp.memory_per_device.temp > LONGEST_BUDGET:
                break
            fits = seq
        measured[c] = fits
    predicted, gpus = {}, planner.machine(64, "80GB", hosts=8)
    for c in (1, 2, 4, 8):
        fits = 0
        for seq in LONGEST_GPU:
            data = 8 // c
            layout = [f"parallel.data={data}", f"parallel.context={c}", "parallel.tensor=8"]
            layout += ["parallel.zero=3", f"train.batch_size={data}"]
            cfg = presets.load("llama3-8b", [*layout, f"train.seq_len={seq}"])
            trained = registered(cfg.model, seq)
            mesh = {"replica": 1, "data": data, "pipeline": 1, "context": c, "tensor": 8}
            guess = planner.predict(cfg, mesh, gpus, trained, planner.of_config(cfg))
            if guess.device > gpus.device_memory:
                break
            fits = seq
        predicted[c] = fits
    rows = [
        [str(c), f"{measured[c]:,}", f"{measured[c] / measured[1]:.1f}", f"{predicted[c]:,}",
         f"{predicted[c] / predicted[1]:.1f}"]
        for c in measured
    ]  # fmt: skip
    budget = human_bytes(LONGEST_BUDGET)
    title = (
        f"the longest sequence that fits, one row a device: llama-tiny in {budget} of "
        "temporaries (CPU, measured), llama3-8b in 80 GB (GPU, predicted)"
    )
    header = ["context", "CPU tokens", "x", "8B GPU tokens", "x"]
    measure.show(tables, "longest", title, table(rows, header))
    return {"measured": measured, "predicted": predicted}


def run(base: measure.Base, steps: int, tables: dict, out=None) -> dict:
    return {"longest": longest_sequences(tables)}
