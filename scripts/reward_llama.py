"""Train a reward model on the arithmetic chat task's preference pairs (the correct sum
chosen over a wrong one), export it as a Hugging Face classifier, and score two answers.

    python scripts/make_tiny_llama.py --out runs/tiny-llama --corpus-out runs/corpus.txt
    python scripts/finetune_llama.py --hf runs/tiny-llama --chat runs/chat --out runs/ft-chat
    python scripts/reward_llama.py --hf runs/ft-chat/hf --tokenizer runs/tiny-llama \
        --pairs runs/pairs --out runs/rm

It writes pairs about sums (the right one chosen over one off by 1 or 2, in one form)
and prepares them (`jaxpar prepare-data --format preference`) unless DIR holds them,
trains with train.objective=reward (a scalar head on each answer's last id,
Bradley-Terry's loss), prints the pair accuracy of each fifth of the
run and the held-out accuracy (runs/rm/loss.png draws it beside the loss), exports
runs/rm/hf (`jaxpar export --format hf`: a LlamaForSequenceClassification), and scores a
right and a wrong answer with it in transformers where it is installed.
"""

import argparse
import json
import os
import random
from pathlib import Path

import jaxpar


def write_pairs(path: Path, count: int, largest: int, seed: int = 0) -> None:
    """`count` JSONL pairs about sums of two numbers up to `largest`: the right sum chosen
    over one off by 1 or 2, both in one form (dpo_llama.py's pairs differ in form too,
    which a reward model learns first, and no sums)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(count):
            a, b = rng.randint(0, largest), rng.randint(0, largest)
            wrong = a + b + rng.choice([-2, -1, 1, 2])
            row = {"prompt": f"{a} + {b} = ", "chosen": f"{a + b}.", "rejected": f"{wrong}."}
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="a Hugging Face checkpoint")
    parser.add_argument("--tokenizer", type=Path, help="its tokenizer's folder (default: --hf)")
    parser.add_argument("--pairs", type=Path, required=True, help="write and prepare pairs here")
    parser.add_argument("--count", type=int, default=2000, help="pairs to write")
    parser.add_argument("--largest", type=int, default=4, help="the largest number summed")
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated, without a GPU")
    args = parser.parse_args()
    tokenizer = args.tokenizer or args.hf
    if not jaxpar.mesh.accelerator_installed() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jaxpar.mesh.use_cpu_devices(args.cpu_devices)

    from jaxpar import recipe
    from jaxpar.config import presets
    from jaxpar.data.prepare import prepare
    from jaxpar.models import LlamaConfig
    from jaxpar.training import metrics
    from jaxpar.training.export import export_hf

    tokens = args.pairs / "tokens"
    if not (tokens / "meta.json").is_file():
        write_pairs(args.pairs / "pairs.jsonl", args.count, args.largest)
        prepare([args.pairs / "pairs.jsonl"], tokenizer, tokens, fmt="preference")
    meta = json.loads((tokens / "meta.json").read_text())["pairs"]
    print(f"pairs: {meta['pairs']['train']} to train on, {meta['pairs']['val']} held out")
    cfg = jaxpar.Config(
        model=LlamaConfig(init=f"hf:{args.hf}"),
        train=jaxpar.Train(
            objective="reward",
            steps=args.steps,
            batch_size=args.batch_size,
            # one pair a row, each answer's last id an input: rounded up for any layout
            seq_len=-(-meta["longest_pair"] // 16) * 16,
            lr=args.lr,
            warmup=2,
            weight_decay=0.0,
            eval_every=max(1, args.steps // 10),
        ),
        data=jaxpar.Data(source="tokens", path=str(tokens)),
    )
    result = recipe.train_config(presets.resolve_init(cfg), out_dir=args.out)  # None: done
    rows = result.rows if result else metrics.saved_rows(args.out / "metrics.jsonl")
    accuracy = [row["accuracy"] for row in rows]
    fifth = max(1, len(accuracy) // 5)
    print(
        "pair accuracy, the mean of each fifth of the run: "
        + " -> ".join(
            f"{sum(accuracy[i : i + fifth]) / fifth:.2f}" for i in range(0, len(accuracy), fifth)
        )
    )
    held = [row for row in rows if "eval_loss" in row][-1]
    print(
        f"held-out at step {held['step']}: loss {held['eval_loss']:.3f}, "
        f"accuracy {held['eval_accuracy']:.2f}"
    )
    step, tensors = export_hf(args.out, args.out / "hf")  # jaxpar export --format hf
    print(f"wrote {tensors} tensors of step {step} to {args.out / 'hf'} (Hugging Face)")
    score(args.out / "hf", tokenizer)


def score(folder: Path, tokenizer: Path) -> None:
    """A right and a wrong answer to one question, scored by the exported classifier."""
    try:
        import torch
        import transformers
    except ImportError:
        print("(install the hf extra to score with transformers)")
        return
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    for answer in ("5.", "6."):
        ids = tok("2 + 3 = " + answer + tok.eos_token, return_tensors="pt")
        with torch.no_grad():
            print(f"2 + 3 = {answer!r}: reward {model(**ids).logits[0, 0]:.3f}")


if __name__ == "__main__":
    main()
