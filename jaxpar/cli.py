"""The `jaxpar` command: train with any mix of parallelism (as one process or many), export
the parameters, or benchmark the strategies."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from jaxpar.config import load, preset_names
from jaxpar.errors import ConfigError, NonFinite

DEFAULT_CPU_DEVICES = 8


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model with the configured parallelism")
    train.add_argument(
        "--config", default="default", help=f"preset ({', '.join(preset_names())}) or a YAML file"
    )
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. parallel.tensor=2 train.steps=20",
    )
    train.add_argument(
        "--out",
        type=Path,
        help="run directory (default: runs/<time>-<config>); with checkpoints there, resume",
    )
    train.add_argument(
        "--restart",
        action="store_true",
        help="set aside the run and checkpoints already in --out, and start fresh",
    )
    for flag, kind, text in (
        ("--coordinator", str, "HOST:PORT of process 0 (many processes; default: the cluster's)"),
        ("--num-processes", int, "processes in the job"),
        ("--process-id", int, "this process's id, 0 .. num-processes - 1"),
    ):
        train.add_argument(flag, type=kind, help=text)
    launch = sub.add_parser(
        "launch", help="run a command as N local processes of one job (CPU collectives: gloo)"
    )
    launch.add_argument("--processes", type=int, required=True, metavar="N")
    launch.add_argument("--cpu-devices-per-process", type=int, default=4, metavar="M")
    launch.add_argument(
        "command_args", nargs=argparse.REMAINDER, metavar="-- train ... | -- SCRIPT.py ..."
    )
    export = sub.add_parser(
        "export", help="write a run's latest parameters to one safetensors file"
    )
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    export.add_argument("--to", type=Path, required=True, metavar="FILE")
    bench = sub.add_parser("bench", help="compare strategies on gpt-tiny: time, memory, comm")
    bench.add_argument("--steps", type=int, default=10, help="timed steps per strategy")
    bench.add_argument("--out", type=Path, help="also write the table as JSON here")
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="SECTION",
        help="measure only these sections: strategies schedules dp offload remat checkpoint "
        "(default: all)",
    )
    for p in (train, bench, export):
        p.add_argument(
            "--cpu-devices",
            type=int,
            metavar="N",
            help=f"simulate N devices on the CPU (default {DEFAULT_CPU_DEVICES} when "
            "no GPU/TPU plugin is installed)",
        )
    return parser


def _setup_devices(n: int | None) -> None:
    from jaxpar.mesh import accelerator_installed, use_cpu_devices

    if n is None and os.environ.get("JAX_NUM_CPU_DEVICES"):  # set by jaxpar launch
        n = int(os.environ["JAX_NUM_CPU_DEVICES"])
    if n is None and not accelerator_installed():
        n = DEFAULT_CPU_DEVICES
    if n is not None:
        if n < 1:
            raise ConfigError(f"--cpu-devices {n}: must be 1 or more")
        use_cpu_devices(n)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags and KEY=VALUE overrides in any order: argparse takes the overrides only up to
    the first flag, so the ones after it come back unparsed and join them here."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    stray = [a for a in rest if a.startswith("-") or "=" not in a or args.command != "train"]
    if args.command == "launch":
        args.command_args = [a for a in args.command_args if a != "--"] + rest
        stray = []
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.command == "launch":
            from jaxpar.distributed import launch

            rest = args.command_args
            out = Path(rest[rest.index("--out") + 1]) if "--out" in rest[:-1] else Path(".")
            return launch(args.processes, args.cpu_devices_per_process, rest, out)
        cfg = load(args.config, args.overrides) if args.command == "train" else None
        _setup_devices(args.cpu_devices)
        if args.command == "train":
            from jaxpar.distributed import initialize
            from models import train_config

            initialize(
                args.coordinator, args.num_processes, args.process_id, cfg.distributed.timeout_s
            )
            name = Path(args.config).stem
            out = args.out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
            result = train_config(cfg, out, restart=args.restart)
            print(f"\nrun directory: {out}  (metrics.jsonl, summary.json, loss.png, step.hlo.txt)")
            if result.checkpoints:
                print(f"checkpoints:   {result.checkpoints}")
        elif args.command == "export":
            from jaxpar.export import export

            step, tensors = export(args.run_dir, args.to)
            print(f"wrote {tensors} parameters of step {step} to {args.to} (safetensors)")
        else:
            from jaxpar.bench import run_bench

            run_bench(steps=args.steps, out=args.out, only=args.only)
    except ConfigError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    except NonFinite as e:
        print(f"jaxpar: stopped: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
