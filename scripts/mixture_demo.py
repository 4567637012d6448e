"""A three-source mixture with a late phase, trained: docs/mixture.png and a table.

    python scripts/mixture_demo.py                 # docs/mixture.png, the table
    python scripts/mixture_demo.py --steps 60      # shorter

Three byte-level sources made here without a download, each a folder as `jaxpar
prepare-data` writes one (train.bin, val.bin, meta.json): `prose` (the pydoc topics
CPython ships), `code` (the standard library's own .py files) and `math` (sums written
out, "317+48=365"). The default job's model trains on them at 0.6 / 0.3 / 0.1, then,
from 3/4 of the way, on 0.2 / 0.2 / 0.6: an anneal onto the math, as Llama 3 and OLMo 2
anneal on their best data. Each source's held-out loss is plotted, the phase marked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCES = ("prose", "code", "math")
WEIGHTS, LATE = (0.6, 0.3, 0.1), (0.2, 0.2, 0.6)
BYTES = 2_000_000  # each source's text


def texts() -> dict[str, bytes]:
    from jaxpar.data.tokens import corpus_bytes

    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    code = b"\n\n".join(p.read_bytes() for p in stdlib)
    rng = random.Random(0)
    sums = (
        f"{a}+{b}={a + b}"
        for a, b in ((rng.randrange(1000), rng.randrange(1000)) for _ in iter(int, 1))
    )
    math = "\n".join(next(sums) for _ in range(BYTES // 10)).encode()
    return {"prose": corpus_bytes() * 3, "code": code, "math": math}


def write_folder(folder: Path, text: bytes) -> None:
    """A prepared folder of byte ids: the last 5% held out as val.bin."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    ids = np.frombuffer(text[:BYTES], dtype=np.uint8).astype(np.uint16)
    cut = len(ids) - len(ids) // 20
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    meta = {"vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes"}
    (folder / "meta.json").write_text(json.dumps(meta))


def mixture(root: Path, late_step: int) -> Path:
    def weights(ws):
        return ", ".join(f"{n}: {w}" for n, w in zip(SOURCES, ws, strict=True))

    lines = ["sources:"]
    lines += [f"  {n}: {{path: {n}, weight: {w}}}" for n, w in zip(SOURCES, WEIGHTS, strict=True)]
    lines += ["phases:", f"  - {{from_step: {late_step}, weights: {{{weights(LATE)}}}}}"]
    (root / "mixture.yaml").write_text("\n".join(lines) + "\n")
    return root / "mixture.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("docs/mixture.png"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jaxpar-mixture-"))
    for name, text in texts().items():
        write_folder(root / name, text)
    file = mixture(root, args.steps * 3 // 4)
    print(file.read_text())
    run = [sys.executable, "-m", "jaxpar.cli.main", "train", f"data.mixture={file}"]
    run += [f"train.steps={args.steps}", "train.eval_every=10", "train.eval_batches=2"]
    run += ["model.vocab=256", "--out", str(root / "run")]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    subprocess.run(run, check=True, env=env)
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    plot(rows, args.steps * 3 // 4, args.out)
    table(rows)


def plot(rows: list[dict], late_step: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in SOURCES:
        points = [(r["step"], r[f"eval_loss/{name}"]) for r in rows if f"eval_loss/{name}" in r]
        ax.plot(*zip(*points, strict=True), marker=".", label=f"held-out {name}")
    ax.axvline(
        late_step, color="gray", linestyle="--", label=f"phase: {LATE} from step {late_step}"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def table(rows: list[dict]) -> None:
    """Each source's tokens (and epochs) at every 50th step and the last."""
    fed = [r for r in rows if "tokens" in r]
    print("| step | tokens | " + " | ".join(f"{n}: tokens (epochs)" for n in SOURCES) + " |")
    print("|---|---|" + "---|" * len(SOURCES))
    for r in fed:
        if r["step"] % 50 == 0 or r is fed[-1]:
            each = (f"{r[f'tokens/{n}']:,} ({r[f'epoch/{n}']:.2f})" for n in SOURCES)
            print(f"| {r['step']} | {r['tokens']:,} | " + " | ".join(each) + " |")


if __name__ == "__main__":
    main()
