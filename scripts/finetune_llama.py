"""Fine-tune a Llama from a Hugging Face checkpoint on a tokenized dataset: the layout
chosen by jaxpar's planner for this machine, checkpoints, and the result exported as a
Hugging Face checkpoint that `transformers` loads with from_pretrained.

    python scripts/finetune_llama.py --hf runs/tiny-llama --data runs/tokens --out runs/ft
    jaxpar launch --processes 2 -- scripts/finetune_llama.py --hf ... --data ... --out ...
"""

import argparse
import os
from pathlib import Path

import jaxpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--data", type=Path, required=True, help="a prepare-data folder")
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device-memory", default="2GB", help="per device, for the plan")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated, without a GPU")
    args = parser.parse_args()
    if not jaxpar.mesh.accelerator_installed() and "JAX_NUM_CPU_DEVICES" not in os.environ:
        jaxpar.mesh.use_cpu_devices(args.cpu_devices)
    jaxpar.distributed.initialize()  # alone: nothing; under jaxpar launch or srun: join

    import jax

    from jaxpar import commands, planner, presets
    from jaxpar.export import export_hf
    from jaxpar.models import LlamaConfig
    from jaxpar.problem import registered

    cfg = jaxpar.Config(
        model=LlamaConfig(init=f"hf:{args.hf}"),  # its dims come from config.json
        train=jaxpar.Train(
            steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr
        ),
        data=jaxpar.Data(source="tokens", path=str(args.data)),
        checkpoint=jaxpar.Checkpoint(every=max(1, args.steps // 2)),
    )
    cfg = presets.resolve_init(cfg)
    plan = planner.make_plan(
        cfg,
        registered(cfg.model, cfg.train.seq_len),
        planner.machine(jax.device_count(), args.device_memory),
        planner.of_config(cfg),
    )
    best = plan.ranked[0]
    if jax.process_index() == 0:
        print(f"plan: {best.label()} ({plan.rule()})")
    result = commands.train_config(best.cfg, out_dir=args.out)
    if jax.process_index() == 0:
        steps, tensors = export_hf(args.out, args.out / "hf")
        print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; step {steps} exported")
        print(f"transformers: LlamaForCausalLM.from_pretrained('{args.out / 'hf'}')")


if __name__ == "__main__":
    main()
