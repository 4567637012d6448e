"""A model written here, not in jaxpar's models/: a residual MLP classifier in Flax NNX,
trained with tensor parallelism x ZeRO-3 (data=4 x tensor=2 on 8 devices).

    python scripts/train_custom_model.py --steps 100
    jaxpar launch --processes 2 -- scripts/train_custom_model.py
"""

import argparse
import os

import jax
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar import BATCH, EMBED, MLP, VOCAB

FEATURES, WIDTH, CLASSES, DEPTH = 32, 128, 16, 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.05)
        self.up = jaxpar.param(rngs, init, (WIDTH, 4 * WIDTH), (EMBED, MLP))  # column split
        self.down = jaxpar.param(rngs, init, (4 * WIDTH, WIDTH), (MLP, EMBED))  # row split

    def __call__(self, h):
        u = jaxpar.constrain(jax.nn.gelu(h @ self.up[...]), (BATCH, MLP))
        return h + u @ self.down[...]


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.05)
        self.inp = jaxpar.param(rngs, init, (FEATURES, WIDTH), (VOCAB, EMBED))

        self.blocks = jaxpar.stack(Block, DEPTH, rngs)  # a leading `layers` dim
        self.out = jaxpar.param(rngs, init, (WIDTH, CLASSES), (EMBED, VOCAB))

    def __call__(self, x):
        h = jaxpar.scan_layers(self.blocks, x @ self.inp[...], lambda block, h: block(h))
        return h @ self.out[...]


def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def batches(step: int) -> dict:
    """A learnable task: the class is the index of the largest of the first 16 features."""
    x = np.random.default_rng([7, step]).normal(size=(64, FEATURES)).astype(np.float32)
    return {"x": x, "y": x[:, :CLASSES].argmax(-1).astype(np.int32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated, without a GPU")
    args = parser.parse_args()
    if not jaxpar.mesh.accelerator_installed() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jaxpar.mesh.use_cpu_devices(args.cpu_devices)
    jaxpar.distributed.initialize()
    cfg = jaxpar.Config(
        parallel=jaxpar.Parallel(data=-1, tensor=2, zero=3),
        train=jaxpar.Train(steps=args.steps, batch_size=64, lr=1e-2, warmup=5),
    )
    result = jaxpar.train(jaxpar.from_nnx(Classifier, loss), cfg, batches)
    model = jaxpar.to_nnx(Classifier, result.params)  # back into the module, trained
    accuracy = (model(batches(10**6)["x"]).argmax(-1) == batches(10**6)["y"]).mean()
    if jax.process_index() == 0:
        print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; accuracy {accuracy:.2f}")


if __name__ == "__main__":
    main()
