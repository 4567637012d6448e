"""The `jaxpar` command: train with any mix of parallelism (as one process or many), export
the parameters, or benchmark the strategies.

Nothing here imports jax until the arguments, the config and --out have been checked: a
mistake is refused in well under a second, and --help is instant."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from jaxpar import __version__, disk, evaluation
from jaxpar.config import registry
from jaxpar.config.keys_help import keys_help
from jaxpar.config.presets import load, preset_names, resolve_init
from jaxpar.config.sections import given
from jaxpar.cost.columns import COLUMNS
from jaxpar.data.prepare import MAX_LENGTH, VAL_FRACTION
from jaxpar.errors import ConfigError, Stopped, UserError
from jaxpar.evaluation import BATCH_SIZE
from jaxpar.training import rundir

DEFAULT_CPU_DEVICES = 8
MAX_CPU_DEVICES = 512  # more take minutes and gigabytes to create on one host
DESCRIPTION = """\
Train JAX/Flax models on one device mesh with data, tensor (and sequence), pipeline,
context and expert parallelism, ZeRO 0-3 and ZeRO-Offload, in any mix; on a CPU alone it
simulates the devices.
Models: {models}, or your own
(the Llama family's read from and written for Hugging Face transformers).

  jaxpar train --config gpt-tiny parallel.data=4 parallel.tensor=2 train.steps=50
  jaxpar train --help          every config key, with its default and meaning
"""
TRAIN_EPILOG = f"""\
Config keys (KEY=VALUE overrides, in any order with the flags; numbers as 1e-3, 1_000):
{keys_help()}

Presets are in jaxpar/configs/; a YAML file has the same sections, e.g.
  train: {{steps: 200, lr: 1e-3}}
"""


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one `jaxpar: error:` line (exit 2), like every other mistake."""

    def error(self, message: str):
        # a value argparse quotes is cut short, as the config's messages cut it
        message = re.sub(
            r"'([^']{41,})'", lambda m: f"'{m[1][:16]}...' ({len(m[1])} characters)", message
        )
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def _config_arguments(parser: argparse.ArgumentParser, default: str | None, example: str) -> None:
    """--config and the KEY=VALUE overrides, as every command that reads a config has them."""
    parser.add_argument(
        "--config",
        default=default,
        help=f"preset ({', '.join(preset_names())}) or a YAML file"
        + ("" if default else " (default: the default model's tiny preset)"),
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help=f"dotted overrides, e.g. {example}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jaxpar",
        description=DESCRIPTION.format(models=", ".join(registry.names())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jaxpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_parser, _launch_parser, _plan_parser, _inspect_parser, _export_parser):
        add(sub)
    for add in (_prepare_data_parser, _generate_parser, _eval_parser, _bench_parser):
        add(sub)
    return parser


def _cpu_devices(parser: argparse.ArgumentParser, default: int = DEFAULT_CPU_DEVICES) -> None:
    parser.add_argument(
        "--cpu-devices",
        type=int,
        metavar="N",
        help=f"simulate N devices on the CPU, 1 to {MAX_CPU_DEVICES} (default {default} when "
        "no GPU/TPU plugin is installed)",
    )


def _force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--force",
        action="store_true",
        help="run even where the compiled step's memory looks larger than this machine's",
    )


def _step(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", type=int, help="a run's checkpoint (default: its newest)")


def _train_parser(sub) -> None:
    train = sub.add_parser(
        "train",
        help="train a model with the configured parallelism",
        description="Train a model with the configured parallelism; writes a run directory "
        "(metrics.jsonl, summary.json, loss.png, step.hlo.txt, checkpoints/).",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_arguments(train, "default", "parallel.tensor=2 train.steps=20 (keys below)")
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
    train.add_argument(
        "--peak-tflops",
        type=float,
        help="per device, what MFU divides by (default: the device kind's dense bf16 peak; "
        "none on a CPU)",
    )
    _force(train)
    _cpu_devices(train)


def _launch_parser(sub) -> None:
    launch = sub.add_parser(
        "launch", help="run a command as N local processes of one job (CPU collectives: gloo)"
    )
    launch.add_argument("--processes", type=int, required=True, metavar="N")
    launch.add_argument("--cpu-devices-per-process", type=int, default=4, metavar="M")
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart after a worker dies or hangs, up to N times, on the processes left, in "
        "the layout that fits them (docs/many-hosts.md); 0 = stop and name it",
    )
    launch.add_argument(
        "--min-processes",
        type=int,
        default=1,
        metavar="K",
        help="give up rather than restart on fewer than K processes",
    )
    launch.add_argument(
        "command_args", nargs=argparse.REMAINDER, metavar="-- train ... | -- SCRIPT.py ..."
    )


def _plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="rank every parallel layout of a model on N devices, predicted from shapes",
        description="Enumerate every valid (replica, data, pipeline, tensor, zero, offload, "
        "microbatches, remat, grad_accum) for the model and global batch of --config and "
        "the overrides, predict each one's memory, traffic and step time from shapes alone "
        "(nothing is allocated or compiled), and rank those that fit.",
        epilog=COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_arguments(plan, "default", "model.layers=32 train.batch_size=512")
    plan.add_argument("--devices", type=int, required=True, metavar="N")
    plan.add_argument("--hosts", type=int, default=1, metavar="H")
    plan.add_argument("--device-memory", required=True, metavar="SIZE", help="e.g. 80GB")
    plan.add_argument("--host-memory", default="1TB", metavar="SIZE", help="per host")
    plan.add_argument("--peak-tflops", type=float, default=989.0, help="per device (H100 bf16)")
    plan.add_argument("--mfu", type=float, default=0.4, help="share of the peak reached")
    plan.add_argument("--intra-gbps", type=float, default=450.0, help="GB/s inside a host")
    plan.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s between hosts")
    plan.add_argument("--top", type=int, default=10)
    plan.add_argument("--out", type=Path, help="write the winning config here (YAML)")
    plan.add_argument(
        "--validate",
        action="store_true",
        help="compile the top layouts that fit on this host's (simulated) devices, at "
        "gpt-tiny's dims, and print predicted against compiled figures",
    )
    _cpu_devices(plan)


def _inspect_parser(sub) -> None:
    inspect = sub.add_parser(
        "inspect",
        help="compile a step (no run): every leaf's shardings and bytes, the ledger, a picture",
        description="Compile the configured step without running it; print every parameter "
        "leaf's shape, logical names, storage / compute / gradient / optimizer-state "
        "PartitionSpecs and bytes per device, then the ledger's summary; write "
        "layout.png (the largest leaves and the batch over the mesh) to --out.",
    )
    _config_arguments(inspect, "default", "parallel.data=4 parallel.zero=3")
    inspect.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where layout.png goes (default: a new runs/<time>-<config>-inspect, as a run's)",
    )
    _cpu_devices(inspect)


def _export_parser(sub) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's latest parameters: one safetensors file, or a Hugging Face "
        "checkpoint directory (--format hf)",
    )
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    export.add_argument("--to", type=Path, required=True, metavar="FILE_OR_DIR")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf", "peft"),
        default="safetensors",
        help="safetensors: one file, jaxpar's keys; hf: config.json and model.safetensors "
        "that transformers' from_pretrained loads (an adapter run's adapters merged in); "
        "peft: an adapter run's adapter_model.safetensors and adapter_config.json, as "
        "peft.PeftModel.from_pretrained loads them",
    )
    export.add_argument(
        "--architecture",
        default="",
        metavar="NAME",
        help="--format hf: the release layout to write, e.g. Gemma3ForCausalLM, or "
        "Gemma3ForConditionalGeneration with the vision tower of the run's model.init "
        "carried through (default: the layout model.init was read as)",
    )
    _cpu_devices(export)


def _prepare_data_parser(sub) -> None:
    prep = sub.add_parser(
        "prepare-data",
        help="tokenize text, JSONL, Parquet, datasets or chat files into train.bin, val.bin, "
        "meta.json",
        description="Tokenize INPUT files, quoted globs or folders, in sorted order (text; "
        "JSONL with a `text` field per line; Parquet with a `text` column; a Hugging Face "
        "`datasets` folder "
        "save_to_disk wrote, with a `text` column; with --format chat, JSONL conversations; "
        "with --format preference, JSONL pairs of a chosen and a rejected answer) with a local "
        "Hugging Face tokenizer into --out: train.bin and val.bin (token ids, uint16 or "
        "uint32), train.idx and val.idx (where each document starts), with --format chat "
        "train.mask and val.mask (1 per trained id), and meta.json, for `jaxpar train "
        "data.source=tokens data.path=OUT`. Every 1/val-fraction-th document is held out.",
    )
    prep.add_argument("inputs", nargs="+", type=Path, metavar="INPUT")
    prep.add_argument("--tokenizer", type=Path, required=True, metavar="DIR")
    prep.add_argument("--out", type=Path, required=True, metavar="DIR")
    prep.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="processes that encode --format text, each on a core; the output is the same "
        "bytes at any N (default: this machine's cores)",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        metavar="F",
        help="the share of documents held out for the validation split, 0 for none (default: "
        + ", ".join(f"{share} with --format {f}" for f, share in VAL_FRACTION.items())
        + ")",
    )
    prep.add_argument(
        "--format",
        choices=("text", "chat", "preference", "prompts"),
        default="text",
        help="text: documents (text files, JSONL `text`, Parquet `text`); chat: JSONL "
        'conversations, {"messages": [{"role", "content"}, ...]} rendered with the '
        'tokenizer\'s chat template, or {"prompt", "completion"}; writes a loss mask that '
        'trains on the answers only; preference: JSONL pairs as TRL reads them, {"prompt", '
        '"chosen", "rejected"} as text or {"chosen": [messages], "rejected": [messages]}, for '
        'train.objective=dpo; prompts: JSONL prompts for train.objective=grpo, {"prompt": text} '
        'or {"messages": [...]} (rendered with the chat template\'s generation prompt); every '
        'other field (e.g. "answer") is kept for the reward functions',
    )
    prep.add_argument(
        "--max-length",
        type=int,
        default=MAX_LENGTH,
        metavar="N",
        help="--format preference: ids of a prompt and its answer at most; a longer answer "
        f"loses its end, as TRL's max_length (default {MAX_LENGTH})",
    )


def _generate_parser(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="continue prompts with a trained model (a run directory or hf:DIR), KV-cached",
        description="Continue prompts with a run's newest checkpoint (or --step) or a Hugging "
        "Face checkpoint (hf:DIR): the prompts prefilled in one pass, then one token a step "
        "through a KV cache, compiled once per bucket of prompt and total lengths; greedy at "
        "--temperature 0, else sampled (--top-k, --top-p, --seed). One prompt is printed as "
        'it is generated; --prompts FILE.jsonl ({"prompt": ...}, or {"messages": [...]} '
        "with --chat) writes JSONL. Layout: tensor = the most devices that divide the "
        "model's heads, key/value heads, MLP width and vocab (heads and MLP split as in "
        "training, the cache by key/value head); the other devices split the prompts over "
        "data. KEY=VALUE overrides (parallel.data, parallel.tensor) may come anywhere.",
    )
    gen.add_argument("source", metavar="RUN_DIR|hf:DIR")
    gen.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="default: hf:DIR's own, else the one the run's data was prepared with; a run "
        "trained on bytes (data.source=corpus or file) decodes bytes",
    )
    asks = gen.add_mutually_exclusive_group(required=True)
    asks.add_argument("--prompt", nargs="+", metavar="TEXT", help="one or more prompts")
    asks.add_argument("--prompts", type=Path, metavar="FILE.jsonl", help="a prompt per line")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0, metavar="K", help="0: no cut")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P")
    gen.add_argument("--seed", type=int, default=0, metavar="S")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument(
        "--speculate",
        choices=("mtp",),
        help="greedy decoding drafted by the model's multi-token prediction module "
        "(model.mtp_depth) and verified by the model in one forward: the same tokens",
    )
    gen.add_argument(
        "--draft-tokens", type=int, default=1, metavar="K", help="--speculate: drafts a step"
    )
    gen.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. parallel.tensor=2")
    _step(gen)
    _cpu_devices(gen, default=1)


def _eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="benchmark scores with lm-evaluation-harness (a run directory or hf:DIR)",
        description="Score a run's newest checkpoint (or --step) or a Hugging Face checkpoint "
        "(hf:DIR) on lm-eval tasks: lm-eval's names, jaxpar's local arithmetic tasks "
        "(jaxpar_arithmetic_mc, jaxpar_arithmetic_gen), a task YAML or a folder of them (their "
        "data files read beside them). Requests run in length buckets, one compile each, on "
        "the layout `jaxpar generate` picks (parallel.data / parallel.tensor override). "
        "Writes lm-eval's results JSON to RUN/eval/ (or --out) and prints its table.",
    )
    ev.add_argument("source", metavar="RUN_DIR|hf:DIR")
    ev.add_argument("--tasks", nargs="+", required=True, metavar="NAME_OR_YAML")
    ev.add_argument("--num-fewshot", type=int, metavar="K", help="default: each task's own")
    ev.add_argument(
        "--limit",
        type=float,
        metavar="N",
        help="the first N documents of each task (or a share < 1)",
    )
    ev.add_argument(
        "--batch-size",
        type=int,
        default=BATCH_SIZE,
        metavar="B",
        help=f"requests a batch (default {BATCH_SIZE})",
    )
    ev.add_argument("--out", type=Path, metavar="DIR", help="default: SOURCE/eval")
    ev.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="default: hf:DIR's own, or the one the run's data was prepared with",
    )
    ev.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="each prompt through the tokenizer's chat template (few-shot examples as turns)",
    )
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. parallel.tensor=2")
    _step(ev)
    _cpu_devices(ev, default=1)


def _bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="compare strategies on a model: time, memory, communication",
        description="Measure every strategy on one model (default gpt-tiny) in one run. "
        "--config and KEY=VALUE overrides set the model and batch; each strategy then sets "
        "its own parallel.* keys on top.",
    )
    _config_arguments(bench, None, "model.embed=128 train.seq_len=256")
    bench.add_argument("--steps", type=int, default=10, help="timed steps per strategy")
    bench.add_argument(
        "--out",
        type=Path,
        help="also write the tables as JSON here, and the strategies' picture beside it "
        "(.png; default bench-strategies.png in the current folder)",
    )
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="SECTION",
        help="measure only these sections: strategies schedules dp hosts offload remat "
        "context experts checkpoint longest compile plan generate grpo optimizers (default: all)",
    )
    _force(bench)
    _cpu_devices(bench)


def _check_cpu_devices(n: int | None, flag: str = "--cpu-devices") -> None:
    if n is not None and not 1 <= n <= MAX_CPU_DEVICES:
        raise ConfigError(
            f"{flag} {n}: simulate 1 to {MAX_CPU_DEVICES} devices (each one is a "
            "thread pool and buffers on this host; more take minutes to create)"
        )


def _setup_devices(n: int | None, default: int = DEFAULT_CPU_DEVICES) -> None:
    """n simulated CPU devices, or those jaxpar launch set, or `default` where no
    accelerator is installed (and jax has not started: in a process that has, a default
    leaves its devices as they are)."""
    from jaxpar.parallel.mesh import accelerator_installed, jax_started, use_cpu_devices

    if n is None and os.environ.get("JAX_NUM_CPU_DEVICES"):  # set by jaxpar launch
        n = int(os.environ["JAX_NUM_CPU_DEVICES"])
    if n is None and not accelerator_installed() and not jax_started():
        n = default
    if n is not None:
        _check_cpu_devices(n)
        use_cpu_devices(n)


def _check_arguments(args: argparse.Namespace) -> None:
    """Each subcommand's paths and numbers, before jax starts or a process does."""
    peak = getattr(args, "peak_tflops", None)
    if args.command == "train" and peak is not None and not 0 < peak <= 1e7:  # (NaN too)
        raise ConfigError(f"--peak-tflops {peak}: give a number > 0 and <= 1e+07 TFLOP/s")

    _check_cpu_devices(getattr(args, "cpu_devices", None))
    step = getattr(args, "step", None)
    if step is not None and not 0 <= step < 2**63:
        raise ConfigError(f"--step {step}: give a step the run saved, or none for its newest")
    if args.command == "launch":
        from jaxpar.parallel.distributed import check_launch

        restarts = (args.max_restarts, args.min_processes)
        check_launch(args.processes, MAX_CPU_DEVICES, *restarts, args.command_args)
        _check_cpu_devices(args.cpu_devices_per_process, "--cpu-devices-per-process")
        if not args.command_args[0].endswith(".py"):
            inner = _parse(args.command_args)  # the workers' command, checked once here
            _check_arguments(inner)
            _check_config(inner)
    elif args.command == "bench":
        if not 1 <= args.steps <= 10**6:
            raise ConfigError(f"--steps {args.steps}: give 1 to 1000000 timed steps")
        if args.out:
            rundir.check_file_target(args.out, "--out")
    elif args.command == "plan" and args.out:
        rundir.check_file_target(args.out, "--out")
    elif args.command == "prepare-data":
        from jaxpar.data.prepare import check, expand

        rundir.check_writable(args.out)
        args.inputs = expand(args.inputs)
        check(
            args.inputs,
            args.tokenizer,
            args.out,
            args.val_fraction,
            args.format,
            args.max_length,
            args.workers,
        )
    elif args.command == "export":
        if not args.run_dir.is_dir():
            raise ConfigError(f"export: {args.run_dir}: no such run directory")
        if args.format in ("hf", "peft"):
            rundir.check_writable(args.to, "--to")
        else:
            rundir.check_file_target(args.to, "--to")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags and KEY=VALUE overrides in any order: argparse takes the overrides only up to
    the first flag, so the ones after it come back unparsed and join them here."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    takes_overrides = args.command in ("train", "bench", "inspect", "plan", "generate", "eval")
    stray = [a for a in rest if a.startswith("-") or "=" not in a or not takes_overrides]
    if args.command == "launch":
        args.command_args = [a for a in args.command_args if a != "--"] + rest
        stray = []
    if stray:
        raise ConfigError(
            f"unrecognized arguments: {' '.join(stray)} (see `jaxpar {args.command} --help`)"
        )
    if rest:
        args.overrides = [*args.overrides, *rest]
    if args.command == "generate" and args.prompt:
        args.prompt = _overrides_among(args, args.prompt, "--prompt", "the prompt text")
    if args.command == "eval":
        args.tasks = _overrides_among(args, args.tasks, "--tasks", "a task")
    return args


def _overrides_among(args: argparse.Namespace, words: list[str], flag: str, what: str):
    """`--prompt hi parallel.tensor=2`: argparse gives every word after a flag of many
    values to it; the words that set a declared config key are overrides, in any order
    as elsewhere. The flag's own words are returned."""
    from jaxpar.config.presets import keys

    declared = keys()

    def sets_a_key(word: str) -> bool:
        key, is_set, _ = word.partition("=")
        return bool(is_set) and key in declared

    args.overrides = [*args.overrides, *(w for w in words if sets_a_key(w))]
    kept = [w for w in words if not sets_a_key(w)]
    if not kept:
        raise ConfigError(f"{flag}: only KEY=VALUE overrides after it; give {what}")
    return kept


def main(argv: list[str] | None = None) -> int:
    command = None
    try:
        args = _parse(argv)
        command = args.command
        _check_arguments(args)
        return HANDLERS[command](args)
    except UserError as e:
        print(f"jaxpar: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"jaxpar: stopped: {e}", file=sys.stderr)
        return 3
    except Exception as e:  # a full disk met by any write: one line, whatever wrote
        if not disk.is_full(e):
            raise
        then = "free space, then run the same command again"
        if command == "train":
            then += ": it resumes from the newest whole checkpoint"
        print(f"jaxpar: stopped: {disk.from_error(e, then)}", file=sys.stderr)
        return 3


def _decoding_keys(command: str, overrides: list[str]) -> None:
    """The overrides' keys and values checked, and each one that decoding reads: the
    layout (parallel.*) and the model (model.*, an hf:DIR's dims); a training key would
    be taken and ignored."""
    load(overrides=overrides)
    for override in overrides:
        key = override.partition("=")[0]
        if not key.startswith(("parallel.", "model.")):
            raise ConfigError(
                f"{command}: {override}: {key} does not apply to decoding, which takes "
                "parallel.* (its layout) and model.* (an hf:DIR's dims); drop it"
            )


def _generate(args: argparse.Namespace) -> int:
    from jaxpar.evaluation import sources
    from jaxpar.generation import prompts
    from jaxpar.generation.decoding import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if not 1 <= args.max_new_tokens <= 1 << 20:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give 1 to {1 << 20}")
    if not 1 <= args.draft_tokens <= 16:
        raise ConfigError(f"--draft-tokens {args.draft_tokens}: give 1 to 16 drafts a step")
    if not args.source.startswith("hf:"):  # (an hf:DIR is read after the prompts' files)
        sources.check(args.source, "generate")
    # the prompts checked before jax starts; through the tokenizer too where it is given
    request = prompts.read(args, args.tokenizer) if args.tokenizer else None
    if request is None:
        prompts.rows_of(args)
    _decoding_keys("generate", args.overrides)
    # one CPU device unless asked for more: simulated devices share the cores, and a
    # process of 8 decodes 1.4x slower a step on one of them (docs/generation.md)
    _setup_devices(args.cpu_devices, default=1)
    prompts.answer(args, request, sampling, sources.tokenizer_of)
    return 0


def _eval(args: argparse.Namespace) -> int:
    evaluation.check_installed("jaxpar eval")
    from jaxpar.evaluation import report, sources, tasks

    if args.num_fewshot is not None and not 0 <= args.num_fewshot <= 1000:
        raise ConfigError(f"--num-fewshot {args.num_fewshot}: give 0 to 1000 examples")
    if args.limit is not None and not 0 < args.limit <= 1e9:
        raise ConfigError(
            f"--limit {args.limit:g}: give a count of documents, or a share in (0, 1)"
        )
    if not 1 <= args.batch_size <= 1 << 16:
        raise ConfigError(f"--batch-size {args.batch_size}: give 1 to {1 << 16} requests")
    sources.check(args.source)
    out = args.out or sources.results_folder(args.source)
    rundir.check_writable(out, "--out" if args.out else "eval: results folder")
    _decoding_keys("eval", args.overrides)
    chosen = tasks.resolve(args.tasks)
    _setup_devices(args.cpu_devices, default=1)  # one device unless asked, as generate
    lm = report.model(args.source, args.tokenizer, args.overrides, args.step, args.batch_size)
    if args.apply_chat_template:
        lm.check_chat_template()  # a tokenizer without one: said before anything is scored
    results = report.evaluate(lm, chosen, args.num_fewshot, args.limit, args.apply_chat_template)
    path = report.write(results, out)
    print(report.table(results))
    print(f"results: {path}", file=sys.stderr)
    print(report.speeds(lm), file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from jaxpar.cost import planner
    from jaxpar.planning import plan_config

    cfg, _ = _check_config(args)
    if not 0 < args.top <= 10**6:
        raise ConfigError(f"--top {args.top}: give a number > 0 and <= 1e+06")
    machine = planner.machine(
        args.devices,
        args.device_memory,
        hosts=args.hosts,
        host_memory=args.host_memory,
        peak_tflops=args.peak_tflops,
        mfu=args.mfu,
        intra_gbps=args.intra_gbps,
        inter_gbps=args.inter_gbps,
    )
    if args.validate:
        _setup_devices(args.cpu_devices)
    print(plan_config(cfg, machine, args.top, args.out, args.validate))
    return 0


def _check_config(args: argparse.Namespace):
    """(the resolved config or None, the run directory or None), both checked."""

    if args.command not in ("train", "bench", "inspect", "plan"):
        return None, None
    if args.config is None:  # bench: the default model's tiny preset
        args.config = registry.tiny_preset(registry.default_name())
    cfg, out = load(args.config, args.overrides), None
    typed = {o.split("=", 1)[0] for o in args.overrides}
    if cfg.model.init:  # config.json into model.*: the keys set here must agree with it
        cfg = resolve_init(cfg, {k.removeprefix("model.") for k in typed} - typed)
    if cfg.adapter.init:  # adapter_config.json into adapter.*, as config.json
        from jaxpar.adapters import peft

        cfg = peft.resolve(cfg, {k.removeprefix("adapter.") for k in typed} - typed)
    if args.command in ("train", "inspect"):
        name = Path(args.config).stem + ("-inspect" if args.command == "inspect" else "")
        out = args.out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
        rundir.check_writable(out)
        if cfg.train.eval_tasks.strip():
            evaluation.check_installed(f"train.eval_tasks={cfg.train.eval_tasks}")
        if cfg.checkpoint.dir:
            rundir.check_writable(Path(cfg.checkpoint.dir), "checkpoint.dir")
    return cfg, out


def _launch(args: argparse.Namespace) -> int:
    from jaxpar.parallel.distributed import launch
    from jaxpar.training import elastic

    rest, out, ckpt, local = args.command_args, Path("."), None, None
    if not rest[0].endswith(".py"):
        inner = _parse(rest)
        cfg, run_dir = _check_config(inner)
        if run_dir is not None:  # one run directory for all workers
            out, rest = run_dir, rest if inner.out else [*rest, "--out", str(run_dir)]
            ckpt = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
            local = Path(cfg.checkpoint.local_dir) if cfg.checkpoint.local_dir else None
        elif getattr(inner, "out", None):
            out = inner.out.parent
    restarts = None
    if args.max_restarts:
        shrink, per = None, args.cpu_devices_per_process
        if rest[0] == "train":  # (bench, inspect and scripts: restarted as they were)
            shrink = lambda *counts: given(elastic.shrink, cfg, *counts, per, args.min_processes)  # noqa: E731
        restarts = elastic.Restarts(args.max_restarts, args.min_processes, shrink)
    return launch(args.processes, args.cpu_devices_per_process, rest, out, ckpt, restarts, local)


def _prepare_data(args: argparse.Namespace) -> int:
    from jaxpar.data.prepare import prepare, prepared, said

    request = (args.inputs, args.tokenizer, args.out, args.val_fraction, args.format)
    wrote = "prepared already" if prepared(*request, args.max_length) else "wrote"
    try:
        meta = prepare(*request, args.max_length, args.workers)
    except KeyboardInterrupt:  # the partial folder is gone already (prepare)
        print(
            f"jaxpar: stopped: prepare-data interrupted; nothing was written to --out "
            f"{args.out} (run the same command again to start over)",
            file=sys.stderr,
        )
        return 130
    print(said(meta, args.out, wrote))
    return 0


def _train(args: argparse.Namespace) -> int:
    from jaxpar import objectives
    from jaxpar.parallel.distributed import initialize
    from jaxpar.recipe import train_config
    from jaxpar.training.console import next_steps

    cfg, out = _check_config(args)
    _setup_devices(args.cpu_devices)
    initialize(args.coordinator, args.num_processes, args.process_id, cfg.distributed.timeout_s)
    result = train_config(
        cfg, out, restart=args.restart, force=args.force, peak_tflops=args.peak_tflops
    )
    if result is None:  # done already
        return 0
    written = [name for name in rundir.RUN_FILES if (out / name).exists()]
    print(f"\nrun directory: {out}  ({', '.join(written)})")
    if result.checkpoints:
        print(f"checkpoints:   {result.checkpoints}")
        decodes = getattr(objectives.of(cfg.train.objective), "DECODES", True)
        steps = next_steps(out, cfg.model.name, cfg.adapter, cfg.data, decodes)
        print("next:          " + "\n               ".join(steps))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from jaxpar.inspection import inspect_config

    cfg, out = _check_config(args)
    _setup_devices(args.cpu_devices)
    print(inspect_config(cfg, out / "layout.png"))
    return 0


def _export(args: argparse.Namespace) -> int:
    from jaxpar.training.export import export, export_hf, export_peft

    _setup_devices(args.cpu_devices)
    if args.architecture and args.format != "hf":
        raise ConfigError(
            f"--architecture {args.architecture}: a Hugging Face layout; add --format hf"
        )
    if args.format == "hf":
        step, tensors = export_hf(args.run_dir, args.to, args.architecture)
        print(f"wrote {tensors} tensors of step {step} to {args.to} (Hugging Face)")
    elif args.format == "peft":
        step, tensors = export_peft(args.run_dir, args.to)
        print(f"wrote {tensors} adapter tensors of step {step} to {args.to} (PEFT)")
    else:
        step, tensors = export(args.run_dir, args.to)
        print(f"wrote {tensors} parameters of step {step} to {args.to} (safetensors)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from jaxpar.bench.measure import Base
    from jaxpar.bench.run import run_bench

    _check_config(args)  # the default model's tiny preset, where no --config is given
    _setup_devices(args.cpu_devices)
    base = Base(args.config, tuple(args.overrides), args.force)
    run_bench(base, steps=args.steps, out=args.out, only=args.only)
    return 0


# each subcommand's handler: args -> exit status
HANDLERS = {
    "train": _train,
    "launch": _launch,
    "plan": _plan,
    "inspect": _inspect,
    "export": _export,
    "prepare-data": _prepare_data,
    "generate": _generate,
    "eval": _eval,
    "bench": _bench,
}


if __name__ == "__main__":
    sys.exit(main())
