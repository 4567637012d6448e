"""Teach the fine-tuned chat Llama to add by reward (GRPO): it samples answers to sums,
the exact answers earn 1, and the policy moves toward its own best answers.

    python scripts/make_tiny_llama.py --out runs/tiny-llama --corpus-out runs/corpus.txt
    python scripts/finetune_llama.py --hf runs/tiny-llama --chat runs/chat --out runs/ft-chat
    python scripts/grpo_llama.py --hf runs/ft-chat/hf --tokenizer runs/tiny-llama \
        --prompts runs/prompts --out runs/grpo

It writes DIR/prompts.jsonl (questions about sums of two numbers up to --largest, as
conversations {"messages": [...], "answer": S}; every tenth as text {"prompt": "A + B = ",
"answer": S}: the chat fine-tune writes the form of an answer, seldom the right sum, and
small sums give the reward something to find),
prepares them with the checkpoint's tokenizer (`jaxpar prepare-data --format prompts`),
and trains with train.objective=grpo and the shipped exact-answer reward
(grpo.reward=jaxpar.objectives.rewards:exact_answer): each step samples --group answers
to each of --batch-size / --group questions in the generation layout, scores them, and
takes an update in the training layout. It prints the mean reward of each fifth of the
run; the run directory's loss.png draws it beside the loss, and rollouts.jsonl holds
every answer the policy wrote.

With --env calculator the questions are products of a number up to 999 and a digit, and
each completion is an episode with the shipped calculator
(grpo.env=jaxpar.objectives.episodes:Calculator): the policy may write `calc: A * B`, is
told `= P`, and answers; the answer's last number earns 1 where it is the product. Start
from a fine-tune that knows the call (`finetune_llama.py --chat DIR --calculator`). It
prints the share of episodes that called the calculator beside the reward.
"""

import argparse
import json
import os
import random
from pathlib import Path

import jaxpar


def write_prompts(path: Path, count: int, largest: int = 4, seed: int = 0) -> None:
    """`count` JSONL questions about sums of two numbers up to `largest`, with their
    `answer`."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randint(1, largest), rng.randint(1, largest)
            if i % 10 == 9:
                row = {"prompt": f"{a} + {b} = ", "answer": a + b}
            else:
                ask = [{"role": "user", "content": f"What is {a} plus {b}?"}]
                row = {"messages": ask, "answer": a + b}
            f.write(json.dumps(row) + "\n")


def write_products(path: Path, count: int, seed: int = 1) -> None:
    """`count` JSONL questions about the product of a number up to 999 and a digit, as
    conversations with their `answer` (the calculator walk-through's)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(count):
            a, b = rng.randint(2, 999), rng.randint(2, 9)
            ask = [{"role": "user", "content": f"What is {a} times {b}?"}]
            f.write(json.dumps({"messages": ask, "answer": a * b}) + "\n")


def called(rollouts: Path, steps: int) -> list[float]:
    """Each step's share of episodes whose first turn called the tool (was answered)."""
    calls, episodes = [0] * steps, [0] * steps
    for line in rollouts.read_text().splitlines():
        row = json.loads(line)
        episodes[row["step"] - 1] += 1
        calls[row["step"] - 1] += row["turns"][0]["observation"] is not None
    return [c / max(n, 1) for c, n in zip(calls, episodes, strict=True)]


def fifths(values: list) -> str:
    """The mean of each fifth of `values`, as 'a -> b -> ...'."""
    fifth = max(1, len(values) // 5)
    means = [sum(values[i : i + fifth]) / len(values[i : i + fifth])
             for i in range(0, len(values), fifth)]  # fmt: skip
    return " -> ".join(f"{m:.2f}" for m in means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="a Hugging Face checkpoint")
    parser.add_argument("--tokenizer", type=Path, help="its tokenizer's folder (default: --hf)")
    parser.add_argument("--prompts", type=Path, required=True, help="write and prepare here")
    parser.add_argument("--count", type=int, default=2000, help="questions to write")
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=64, help="completions a step")
    parser.add_argument("--group", type=int, default=8, help="completions a question")
    parser.add_argument("--largest", type=int, default=4, help="the largest number summed")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--beta", type=float, default=0.0, help="the KL penalty's weight")
    parser.add_argument(
        "--reward",
        default="exact_answer",
        help="shipped reward functions (jaxpar.objectives.rewards) or model:RUN (a reward "
        "model's run), comma-separated",
    )
    parser.add_argument(
        "--rollout-devices", type=int, default=0,
        help="generate on this many devices of their own, train on the rest (0: on the same)",
    )  # fmt: skip
    parser.add_argument(
        "--staleness", type=int, default=0,
        help="train on rollouts of the policy this many steps back, made beside the steps",
    )  # fmt: skip
    parser.add_argument(
        "--env", choices=("calculator",),
        help="episodes with the shipped calculator, on questions about products",
    )  # fmt: skip
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

    prepared = args.prompts / "tokens"
    if not (prepared / "meta.json").is_file():
        if args.env:
            write_products(args.prompts / "prompts.jsonl", args.count)
        else:
            write_prompts(args.prompts / "prompts.jsonl", args.count, args.largest)
        prepare([args.prompts / "prompts.jsonl"], tokenizer, prepared, fmt="prompts")
    meta = json.loads((prepared / "meta.json").read_text())["prompts"]
    new = 16  # "A plus B is S." (or "calc: A * B") and the end of the turn
    turns = 3 if args.env else 1  # a call, the answer, one more if it calls again
    cfg = jaxpar.Config(
        model=LlamaConfig(init=f"hf:{args.hf}"),
        train=jaxpar.Train(
            objective="grpo",
            steps=args.steps,
            batch_size=args.batch_size,
            # a row: the longest question and its turns (each tool turn's template 12
            # ids at most), rounded up for any layout
            seq_len=-(-(meta["longest_prompt"] + turns * new + (turns - 1) * 12) // 16) * 16,
            lr=args.lr,
            warmup=0,
            weight_decay=0.0,
            log_every=1,
        ),
        grpo=jaxpar.Grpo(
            reward=""  # the calculator's own reward alone
            if args.env
            else ",".join(
                r if r.startswith("model:") else f"jaxpar.objectives.rewards:{r}"
                for r in args.reward.split(",")
            ),
            **(
                {"env": "jaxpar.objectives.episodes:Calculator", "max_turns": turns}
                if args.env
                else {}
            ),
            group=args.group,
            max_new_tokens=new,
            temperature=args.temperature,
            beta=args.beta,
            rollout_devices=args.rollout_devices,
            staleness=args.staleness,
        ),
        data=jaxpar.Data(source="tokens", path=str(prepared)),
    )
    result = recipe.train_config(presets.resolve_init(cfg), out_dir=args.out)  # None: done
    rows = result.rows if result else metrics.saved_rows(args.out / "metrics.jsonl")
    rolled = [row for row in rows if "reward" in row]
    for name in ["reward", *(k for k in rolled[0] if k.startswith("rewards/"))]:
        print(f"{name}, the mean of each fifth of the run: "
              + fifths([row[name] for row in rolled]))  # fmt: skip
    if args.env:
        calls = called(args.out / "rollouts.jsonl", len(rolled))
        print(f"episodes that called the calculator, each fifth: {fifths(calls)}")
    print(f"the curve: {args.out / 'loss.png'}; every answer: {args.out / 'rollouts.jsonl'}")


if __name__ == "__main__":
    main()
