"""The same GPT trained by jaxpar and by plain PyTorch on this machine: tokens/s of each.

    pip install -e '.[compare]'          # torch, CPU build
    python scripts/compare_torch.py      # docs/benchmarks.md's table: two shapes, 1 and 2 ranks

Both train models/gpt.py's decoder (token + position embedding, pre-LN blocks with
causal attention from a fused QKV projection and a tanh-GELU MLP, final LN, output
projection) with the same optimizer: AdamW (betas 0.9, 0.95, weight decay on matrices
only), gradients clipped to global norm 1.0; the same dims, global batch, sequence length
and synthetic tokens (jaxpar.data.tokens). PyTorch's attention is
`F.scaled_dot_product_attention(is_causal=True)`, as a PyTorch user writes it. N ranks
are `parallel.data=N` on N simulated CPU devices for jaxpar, and DDP over gloo with N
processes for PyTorch; each side gets the machine's cores. Tokens/s is the global
batch's tokens over the median step time after warm-up, as jaxpar's summary reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (name, model and batch): the two shapes of the comparison
SHAPES = {
    "small": dict(layers=4, embed=128, heads=8, mlp=512, seq_len=128, batch_size=32),
    "large": dict(layers=4, embed=512, heads=8, mlp=2048, seq_len=128, batch_size=16),
}
VOCAB, LR, WEIGHT_DECAY, CLIP_NORM = 256, 3e-4, 0.1, 1.0


def jaxpar_tokens_per_s(shape: dict, ranks: int, steps: int) -> float:
    """`jaxpar train` on `ranks` simulated devices (data parallel), from its summary."""
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"parallel.data={ranks}",
            "parallel.pipeline=1",
            "parallel.tensor=1",
            "train.log_every=1",
            "data.source=synthetic",
            f"model.vocab={VOCAB}",
            f"train.steps={steps}",
            f"train.lr={LR}",
            f"train.weight_decay={WEIGHT_DECAY}",
            "train.warmup=1",
            f"train.clip_norm={CLIP_NORM}",
            *(f"model.{k}={shape[k]}" for k in ("layers", "embed", "heads", "mlp")),
            *(f"train.{k}={shape[k]}" for k in ("seq_len", "batch_size")),
        ]
        cmd = [sys.executable, "-m", "jaxpar.cli.main", "train", "--config", "gpt-tiny"]
        cmd += ["--cpu-devices", str(ranks), *overrides, "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"jaxpar train failed: {done.stderr.strip().splitlines()[-1]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    tokens = shape["batch_size"] * shape["seq_len"]
    return tokens / statistics.median(r["step_time_s"] for r in rows[len(rows) // 4 :])


def torch_rank(rank: int, ranks: int, shape: dict, steps: int, port: int, out: str) -> None:
    """One PyTorch process: its share of the global batch; DDP over gloo when ranks > 1."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    from jaxpar.data.tokens import batch_at

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    if ranks > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    e, h, s = shape["embed"], shape["heads"], shape["seq_len"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(e), nn.LayerNorm(e)
            self.qkv, self.proj = nn.Linear(e, 3 * e, bias=False), nn.Linear(e, e, bias=False)
            self.up, self.down = nn.Linear(e, shape["mlp"]), nn.Linear(shape["mlp"], e)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, e // h).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, s, e)
            x = x + self.proj(y)
            return x + self.down(nn.functional.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(VOCAB, e), nn.Embedding(s, e)
            self.blocks = nn.Sequential(*(Block() for _ in range(shape["layers"])))
            self.ln_f, self.head = nn.LayerNorm(e), nn.Linear(e, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.tokens(tokens) + self.positions(torch.arange(s))
            return self.head(self.ln_f(self.blocks(x)))

    model = GPT()
    if ranks > 1:
        model = nn.parallel.DistributedDataParallel(model)
    # decay on matrices (embeddings, projections), not on norms and biases: as jaxpar
    params = list(model.parameters())
    groups = [
        dict(params=[p for p in params if p.ndim >= 2], weight_decay=WEIGHT_DECAY),
        dict(params=[p for p in params if p.ndim < 2], weight_decay=0.0),
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))
    rows = slice(rank * shape["batch_size"] // ranks, (rank + 1) * shape["batch_size"] // ranks)
    times = []
    for step in range(steps):
        batch = batch_at(
            None,
            seed=0,
            step=step,
            batch_size=shape["batch_size"],
            seq_len=s,
            vocab=VOCAB,
            rows=rows,
        )
        tokens = torch.from_numpy(batch["tokens"].astype(np.int64))
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    if ranks > 1:
        dist.destroy_process_group()


def torch_tokens_per_s(shape: dict, ranks: int, steps: int) -> float:
    import torch.multiprocessing as mp

    from jaxpar.parallel.distributed import free_port

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = (ranks, shape, steps, free_port(), out.name)
        if ranks == 1:
            torch_rank(0, *args)
        else:
            mp.spawn(torch_rank, args=args, nprocs=ranks)
        times = json.loads(Path(out.name).read_text())
    return shape["batch_size"] * shape["seq_len"] / statistics.median(times[len(times) // 4 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=20, help="steps per run (first quarter warm-up)"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} cores; load average before (1, 5, 15 min): {load}")
    print(f"{'model':<48} {'ranks':>5} {'jaxpar tok/s':>13} {'PyTorch tok/s':>14} {'ratio':>6}")
    for name in args.shapes:
        shape = SHAPES[name]
        label = ", ".join(f"{k} {v}" for k, v in shape.items())
        for ranks in args.ranks:
            ours = jaxpar_tokens_per_s(shape, ranks, args.steps)
            theirs = torch_tokens_per_s(shape, ranks, args.steps)
            print(f"{label:<48} {ranks:>5} {ours:>13,.0f} {theirs:>14,.0f} {ours / theirs:>6.2f}")
            sys.stdout.flush()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average after (1, 5, 15 min): {load}")


if __name__ == "__main__":
    main()
