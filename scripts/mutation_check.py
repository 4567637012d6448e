"""Break the implementation on purpose, one claim at a time, and show that the suite's
proofs of that claim fail: each mutation is applied to a fresh worktree of HEAD, and the
claim's tests (as tests/claims.py names them) run there, stopping at the first failure.

    .venv/bin/python scripts/mutation_check.py                 # every mutation
    .venv/bin/python scripts/mutation_check.py dpo-no-reference

Prints one line a mutation: caught (a test failed, named) or MISSED; exits 1 if any was
missed. A mutation whose text no longer matches the source is reported as stale."""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (file, the text, the broken text, the claim's tests)
MUTATIONS = {
    # ZeRO-2's (and ZeRO-1's) reduce-scatter of the gradients divides by the data degree: a
    # mean, where the loss already divides by the global count
    "zero2-scatter-mean": (
        "jaxpar/parallel/collectives.py",
        "    return blockwise(fn, x, spec)\n",
        "    return blockwise(fn, x, spec) / jax.lax.axis_size(axis)\n",
        ["tests/test_equivalence.py::test_strategy_equals_one_device[dp8-zero2]"],
    ),
    # DPO without its reference term: the policy's log-ratio alone
    "dpo-no-reference": (
        "jaxpar/objectives/dpo.py",
        "    ratios = policy - reference\n",
        "    ratios = policy + 0 * reference\n",
        ["tests/test_dpo.py::test_dpo_equals_trl"],
    ),
    # packed documents: positions run on across the row instead of restarting per document
    "packed-positions-run-on": (
        "jaxpar/nn/documents.py",
        "        sequence.local(batch[POSITIONS][:, :-1]),\n",
        "        sequence.positions(*batch['tokens'][:, :-1].shape),\n",
        ["tests/test_documents.py::test_a_packed_window_equals_each_document_alone"],
    ),
    # expert parallelism loses the tokens of each device's first expert
    "expert-drops-tokens": (
        "jaxpar/nn/experts.py",
        "    return jax.lax.all_to_all(x, EXPERT, split_axis=1, concat_axis=0, tiled=True)\n",
        "    return jax.lax.all_to_all(x, EXPERT, split_axis=1, concat_axis=0, tiled=True)"
        ".at[:, 0].set(0)\n",
        ["tests/test_moe.py::test_a_mixture_trains_in_every_layout_as_on_one_device"],
    ),
    # a pipeline trains its first micro-batch twice and its last never
    "pipeline-skips-a-microbatch": (
        "jaxpar/step/pipelined.py",
        "    return jax.tree.map(lambda x: x.reshape((m, x.shape[0] // m) + x.shape[1:]), batch)\n",
        "    return jax.tree.map(lambda x: (lambda y: y.at[-1].set(y[0]))("
        "x.reshape((m, x.shape[0] // m) + x.shape[1:])), batch)\n",
        ["tests/test_pipeline.py::test_schedule_equals_one_device"],
    ),
    # DualPipeV's pair: the V's turn files its backward's gradient for the wrong chunk
    "dualpipev-pair-gradient-misfiled": (
        "jaxpar/step/pipelined.py",
        "        (table[t, stage], d_x, stage == p - 1, 0, 0),  # the turn\n",
        "        (table[t, stage], d_x, stage == p - 1, 0, 1),  # the turn\n",
        ["tests/test_pipeline.py::test_schedule_equals_one_device[dualpipev-p2-m4]"],
    ),
}


def git(*worktree: str) -> None:
    subprocess.run(["git", "worktree", *worktree], cwd=ROOT, check=True)


def check(name: str) -> bool:
    file, text, broken, tests = MUTATIONS[name]
    source = (ROOT / file).read_text()
    if source.count(text) != 1:
        print(f"{name}: stale (the text to break is not in {file} once)")
        return False
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        git("add", "-q", "--detach", str(tree))
        try:
            (tree / file).write_text(source.replace(text, broken))
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                cwd=tree, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": str(tree)},  # the broken tree's jaxpar
            )  # fmt: skip
            seconds = time.perf_counter() - start
        finally:
            git("remove", "--force", str(tree))
    lines = done.stdout.splitlines()
    failed = [line.split(" - ")[0] for line in lines if line.startswith("FAILED")]
    why = next((line[1:].strip() for line in lines if line.startswith("E ")), "")
    if failed:  # a test failed (-x under xdist exits 2: interrupted after the first)
        print(f"{name}: caught by {failed[0].removeprefix('FAILED ')} ({seconds:.0f} s)\n  {why}")
    else:
        print(f"{name}: MISSED ({done.returncode}): {lines[-1:]} ({seconds:.0f} s)")
    return bool(failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"of {', '.join(MUTATIONS)} (default: all)")
    names = parser.parse_args().names or list(MUTATIONS)
    unknown = sorted(set(names) - set(MUTATIONS))
    if unknown:
        parser.error(f"no mutation {', '.join(unknown)}; the mutations: {', '.join(MUTATIONS)}")
    return 0 if all([check(n) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main())
