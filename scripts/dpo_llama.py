"""Align a fine-tuned Llama with preference pairs (DPO): the arithmetic chat task's
questions, the correct sum chosen over a wrong one; then `jaxpar generate` answers.

    python scripts/make_tiny_llama.py --out runs/tiny-llama --corpus-out runs/corpus.txt
    python scripts/finetune_llama.py --hf runs/tiny-llama --chat runs/chat --out runs/ft-chat
    python scripts/dpo_llama.py --hf runs/ft-chat/hf --tokenizer runs/tiny-llama \
        --pairs runs/pairs --out runs/dpo

It writes DIR/pairs.jsonl (half as text {"prompt", "chosen", "rejected"}, half as
conversations {"chosen": [messages], "rejected": [messages]}; the wrong answers are long
and the right ones short, or the other way round), prepares them with the checkpoint's
tokenizer (`jaxpar prepare-data --format preference`), trains with train.objective=dpo
(the reference: a frozen copy of the starting weights; --lora: the base with the
adapters off), and prints rewards/accuracies as it rises, the held-out loss and
accuracy, and the model's answer to one question.
"""

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import jaxpar


def write_pairs(path: Path, count: int, seed: int = 0) -> None:
    """`count` JSONL pairs about sums: the correct answer chosen over a wrong one, one of
    the two at least twice the other's length."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            wrong = a + b + rng.choice([-10, -2, -1, 1, 2, 10])
            right, bad = f"{a} plus {b} is {a + b}.", f"{wrong}."
            if i % 4 < 2:
                right, bad = f"{a + b}.", f"I believe that {a} plus {b} is {wrong}."
            if i % 2:
                row = {"prompt": f"{a} + {b} = ", "chosen": right, "rejected": bad}
            else:
                ask = [{"role": "user", "content": f"What is {a} plus {b}?"}]
                row = {
                    "chosen": [*ask, {"role": "assistant", "content": right}],
                    "rejected": [*ask, {"role": "assistant", "content": bad}],
                }
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="a Hugging Face checkpoint")
    parser.add_argument("--tokenizer", type=Path, help="its tokenizer's folder (default: --hf)")
    parser.add_argument("--pairs", type=Path, required=True, help="write and prepare pairs here")
    parser.add_argument("--count", type=int, default=512, help="pairs to write")
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora", action="store_true", help="train adapters, the base frozen")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated, without a GPU")
    args = parser.parse_args()
    tokenizer = args.tokenizer or args.hf
    if not jaxpar.mesh.accelerator_installed() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jaxpar.mesh.use_cpu_devices(args.cpu_devices)

    from jaxpar import recipe
    from jaxpar.config import presets
    from jaxpar.config.sections import AdapterKind
    from jaxpar.data.prepare import prepare
    from jaxpar.models import LlamaConfig
    from jaxpar.training import metrics

    tokens = args.pairs / "tokens"
    if not (tokens / "meta.json").is_file():
        write_pairs(args.pairs / "pairs.jsonl", args.count)
        prepare([args.pairs / "pairs.jsonl"], tokenizer, tokens, fmt="preference")
    meta = json.loads((tokens / "meta.json").read_text())["pairs"]
    print(f"pairs: {meta['pairs']['train']} to train on, {meta['pairs']['val']} held out")
    adapter = jaxpar.Adapter(kind=AdapterKind.LORA if args.lora else AdapterKind.NONE)
    cfg = jaxpar.Config(
        model=LlamaConfig(init=f"hf:{args.hf}"),
        train=jaxpar.Train(
            objective="dpo",
            steps=args.steps,
            batch_size=args.batch_size,
            # one pair a row: both answers with their prompt, rounded up for any layout
            seq_len=-(-meta["longest_pair"] // 16) * 16,
            lr=args.lr,
            warmup=2,
            weight_decay=0.0,
            eval_every=args.steps,
        ),
        dpo=jaxpar.Dpo(beta=args.beta),
        data=jaxpar.Data(source="tokens", path=str(tokens)),
        adapter=adapter,
    )
    result = recipe.train_config(presets.resolve_init(cfg), out_dir=args.out)  # None: done
    rows = result.rows if result else metrics.saved_rows(args.out / "metrics.jsonl")
    accuracy = [row["rewards/accuracies"] for row in rows]
    fifth = max(1, len(accuracy) // 5)
    print(
        "rewards/accuracies, the mean of each fifth of the run: "
        + " -> ".join(
            f"{sum(accuracy[i : i + fifth]) / fifth:.2f}" for i in range(0, len(accuracy), fifth)
        )
    )
    last = rows[-1]
    print(f"held-out: loss {last['eval_loss']:.3f}, accuracy {last['eval_rewards/accuracies']:.2f}")
    question = "What is 12 plus 30?"
    print(f"{question!r} ->", flush=True)
    subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.main", "generate", str(args.out), "--tokenizer",
         str(tokenizer), "--prompt", question, "--chat", "--max-new-tokens", "12"],
        check=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
