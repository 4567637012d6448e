"""Train a GPT with jaxpar from Python: the config in code, our own data, resumed from the
latest checkpoint when there is one.

    python scripts/train_gpt.py --steps 200 --out runs/gpt           # one process
    jaxpar launch --processes 2 -- scripts/train_gpt.py --out runs/gpt  # two, on this machine
    srun python scripts/train_gpt.py --out runs/gpt                   # a SLURM job
"""

import argparse
import os
from pathlib import Path

import numpy as np

import jaxpar


def text_bytes() -> np.ndarray:
    """Our corpus: the source of the jaxpar package itself, as bytes."""
    folder = Path(jaxpar.__file__).parent
    return np.frombuffer(b"".join(p.read_bytes() for p in sorted(folder.glob("*.py"))), np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/gpt"))
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated, without a GPU")
    args = parser.parse_args()
    if not jaxpar.mesh.accelerator_installed() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jaxpar.mesh.use_cpu_devices(args.cpu_devices)
    jaxpar.distributed.initialize()  # alone: nothing; under jaxpar launch or srun: join

    from jaxpar.models import gpt  # the GPT shipped with jaxpar

    seq_len = 64
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(data=-1, tensor=2, zero=1),
        model=jaxpar.Model(name="gpt", layers=4, embed=128, heads=8, mlp=512, vocab=256),
        train=jaxpar.Train(steps=args.steps, batch_size=16, seq_len=seq_len, lr=3e-3, warmup=10),
        checkpoint=jaxpar.Checkpoint(every=50),
    )
    tokens = text_bytes()

    def batches(step: int) -> dict:
        """Batch `step`: 16 random windows of the text, a pure function of the step."""
        starts = np.random.default_rng([1234, step]).integers(0, len(tokens) - seq_len - 1, 16)
        return {"tokens": tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)}

    problem = jaxpar.from_nnx(
        lambda rngs: gpt.GPT(cfg.model, seq_len, rngs),
        gpt.SPEC.loss,
        gpt.SPEC.stages(cfg.model, seq_len),
    )
    result = jaxpar.train(problem, cfg, batches, out_dir=args.out)
    if result.losses:
        print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; {result.checkpoints}")


if __name__ == "__main__":
    main()
