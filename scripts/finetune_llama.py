"""Fine-tune a Llama from a Hugging Face checkpoint on a tokenized dataset: the layout
chosen by jaxpar's planner for this machine, checkpoints, and the result exported as a
Hugging Face checkpoint that `transformers` loads with from_pretrained.

    python scripts/finetune_llama.py --hf runs/tiny-llama --data runs/tokens --out runs/ft
    jaxpar launch --processes 2 -- scripts/finetune_llama.py --hf ... --data ... --out ...

With --chat DIR instead of --data, it fine-tunes on conversations, trained on the
answers only: it writes DIR/chat.jsonl (small arithmetic conversations, some with a
system turn, some of two rounds, some as prompt/completion pairs), prepares it with the
checkpoint's tokenizer and chat template (`jaxpar prepare-data --format chat`) into
DIR/tokens, and trains on that. With --calculator as well, the conversations are about
products, and one in four calls a calculator (`calc: A * B`, answered `= P` in a tool
turn) before it answers: the start of docs/grpo.md's calculator walk-through.

With --lora it trains low-rank adapters on every projection instead of all the weights
(the base frozen; --base nf4 holds it in 4 bits, QLoRA) and exports them both ways: merged
into a Hugging Face checkpoint (OUT/hf), and as a PEFT adapter (OUT/peft) that
`peft.PeftModel.from_pretrained` loads on the base.
"""

import argparse
import json
import os
import random
from pathlib import Path

import jaxpar


def write_conversations(path: Path, count: int, seed: int = 0) -> None:
    """`count` JSONL conversations about sums: the answers follow from the questions."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99)
            if i % 5 == 4:
                row = {"prompt": f"{a} + {b} = ", "completion": f"{a + b}"}
            else:
                messages = [{"role": "system", "content": "You add numbers."}] if i % 3 else []
                messages += [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
                if i % 4 == 0:
                    messages += [
                        {"role": "user", "content": f"And plus {c}?"},
                        {"role": "assistant", "content": f"{a + b} plus {c} is {a + b + c}."},
                    ]
                row = {"messages": messages}
            f.write(json.dumps(row) + "\n")


def write_calculator_conversations(path: Path, count: int, seed: int = 0) -> None:
    """`count` JSONL conversations about the product of a number up to 999 and a digit:
    one in four calls the calculator (`calc: A * B`, told `= P` in a tool turn, then
    "It is P."), the rest answer outright ("A times B is P."), so the model learns the
    call, to copy the tool's answer, and that it may answer without it."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            a, b = rng.randint(2, 999), rng.randint(2, 9)
            messages = [{"role": "user", "content": f"What is {a} times {b}?"}]
            if i % 4:
                messages.append({"role": "assistant", "content": f"{a} times {b} is {a * b}."})
            else:
                messages += [
                    {"role": "assistant", "content": f"calc: {a} * {b}"},
                    {"role": "tool", "content": f"= {a * b}"},
                    {"role": "assistant", "content": f"It is {a * b}."},
                ]
            f.write(json.dumps({"messages": messages}) + "\n")


def chat_data(hf: Path, folder: Path, count: int, calculator: bool = False) -> None:
    """Conversations written to `folder`/chat.jsonl and prepared into `folder`/tokens
    (once: a folder prepared already is kept)."""
    from jaxpar.data.prepare import prepare

    if (folder / "tokens" / "meta.json").is_file():
        return
    write = write_calculator_conversations if calculator else write_conversations
    write(folder / "chat.jsonl", count)
    meta = prepare([folder / "chat.jsonl"], hf, folder / "tokens", fmt="chat")
    trained = meta["loss_mask"]["trained_tokens"]["train"]
    print(f"chat data: {meta['train_tokens']:,} tokens, {trained:,} of them answers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="a Hugging Face checkpoint folder")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", type=Path, help="a prepare-data folder")
    data.add_argument("--chat", type=Path, metavar="DIR", help="write and prepare chat data here")
    parser.add_argument("--conversations", type=int, default=2000, help="with --chat")
    parser.add_argument(
        "--calculator", action="store_true",
        help="with --chat: products, a quarter of them calling a calculator",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lora", action="store_true", help="train adapters, the base frozen")
    parser.add_argument("--rank", type=int, default=8, help="with --lora")
    parser.add_argument("--base", default="same", help="with --lora: same, bf16, int8 or nf4")
    parser.add_argument("--device-memory", default="2GB", help="per device, for the plan")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated, without a GPU")
    args = parser.parse_args()
    if not jaxpar.mesh.accelerator_installed() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jaxpar.mesh.use_cpu_devices(args.cpu_devices)
    jaxpar.distributed.initialize()  # alone: nothing; under jaxpar launch or srun: join

    import jax
    from jax.experimental import multihost_utils

    if args.chat:  # written by one process, read by all
        if jax.process_index() == 0:
            chat_data(args.hf, args.chat, args.conversations, args.calculator)
        multihost_utils.sync_global_devices("chat data")
        args.data = args.chat / "tokens"

    from jaxpar import recipe
    from jaxpar.config import presets
    from jaxpar.config.sections import AdapterKind, BaseStorage
    from jaxpar.cost import planner
    from jaxpar.models import LlamaConfig
    from jaxpar.nn.problem import registered
    from jaxpar.training import metrics
    from jaxpar.training.export import export_hf, export_peft

    adapter = jaxpar.Adapter()
    if args.lora:
        targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
        adapter = jaxpar.Adapter(
            kind=AdapterKind.LORA, rank=args.rank, targets=targets, base=BaseStorage(args.base)
        )

    cfg = jaxpar.Config(
        model=LlamaConfig(init=f"hf:{args.hf}"),  # its dims come from config.json
        train=jaxpar.Train(
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
            eval_every=args.steps if (args.data / "val.bin").is_file() else 0,
        ),
        data=jaxpar.Data(source="tokens", path=str(args.data)),
        checkpoint=jaxpar.Checkpoint(every=max(1, args.steps // 2)),
        adapter=adapter,
    )
    cfg = presets.resolve_init(cfg)
    plan = planner.make_plan(
        cfg,
        recipe.with_adapters(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model),
        planner.machine(jax.device_count(), args.device_memory),
        planner.of_config(cfg),
    )
    best = plan.ranked[0]
    if jax.process_index() == 0:
        print(f"plan: {best.label()} ({plan.rule()})")
    result = recipe.train_config(best.cfg, out_dir=args.out)  # None: trained already
    if jax.process_index() == 0:
        steps, tensors = export_hf(args.out, args.out / "hf")
        rows = result.rows if result else metrics.saved_rows(args.out / "metrics.jsonl")
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        held_out = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
        held_out = f", held-out {held_out[-1]:.3f}" if held_out else ""
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{held_out}; step {steps} exported")
        print(f"transformers: LlamaForCausalLM.from_pretrained('{args.out / 'hf'}')")
        if args.lora:
            export_peft(args.out, args.out / "peft")
            print(f"peft: PeftModel.from_pretrained(base, '{args.out / 'peft'}')")


if __name__ == "__main__":
    main()
