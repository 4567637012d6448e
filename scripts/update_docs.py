"""The docs' measured numbers, regenerated: `jaxpar bench` into docs/bench.json, then every
table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in README.md and docs/*.md
rewritten from it. Never retype a measured number: run this.

    .venv/bin/python scripts/update_docs.py                          # measure, then rewrite
    .venv/bin/python scripts/update_docs.py --from docs/bench.json   # rewrite only
    .venv/bin/python scripts/update_docs.py --from docs/bench.json --check   # exit 1 if stale

It also writes docs/proofs.md, the ledger of claims, from tests/claims.py (no bench needed).

NAME is a section of the bench (strategies, schedules, dp, hosts, offload, remat, context,
experts, checkpoint, longest, compile, plan, generate, generate-peer, optimizers,
speculative), shown as its printed table, or
`proven`: the README's table of what is proven, with each strategy's measured figure, or
`ticks-SCHEDULE`: a pipeline schedule's tick table, drawn from the table the executor runs.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "docs" / "bench.json"
BLOCK = re.compile(r"(<!-- bench:([\w-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)

# The README's table of what is proven: (what, the test file that proves it equal to one
# device, the bench section and row whose figure it shows, which figure)
PROVEN = (
    ("data parallel, ZeRO-0", "equivalence", "strategies", "dp8-zero0", "comm"),
    ("ZeRO-1: optimizer state split", "equivalence", "strategies", "dp8-zero1", "state"),
    ("ZeRO-2: gradients reduce-scattered", "equivalence", "strategies", "dp8-zero2", "comm"),
    ("ZeRO-3: parameters gathered by layer", "equivalence", "strategies", "dp8-zero3", "state"),
    ("Megatron tensor parallel", "equivalence", "strategies", "tp8", "comm"),
    ("data x tensor x ZeRO-3", "equivalence", "strategies", "dp4-tp2-zero3", "comm"),
    ("pipeline, GPipe", "pipeline", "schedules", "gpipe", "bubble"),
    ("pipeline, 1F1B", "pipeline", "schedules", "1f1b", "bubble"),
    ("pipeline, zero-bubble ZB-H1", "pipeline", "schedules", "zb-h1", "bubble"),
    ("pipeline, zero-bubble ZBV (a V)", "pipeline", "schedules", "zbv", "bubble"),
    ("pipeline, DualPipeV (pairs in a V)", "pipeline", "schedules", "dualpipev", "bubble"),
    ("pipeline, interleaved", "pipeline", "schedules", "interleaved-v2", "bubble"),
    ("ring all-reduce, hand-written", "dp", "dp", "ring", "comm"),
    ("gradient server", "dp", "dp", "server", "comm"),
    ("ZeRO groups across hosts (replica)", "replica", "hosts", "replica2 zero1", "comm"),
    ("ZeRO-Offload", "offload", "offload", "zero1 fp32 optimizer", "state"),
    ("context parallel, all_gather", "context", "context", "S=1024 context=8 all_gather", "comm"),
    ("context parallel, Ulysses", "context", "context", "S=1024 context=8 ulysses", "comm"),
    ("expert parallel", "moe", "experts", "expert=4", "comm"),
)


def figure(row: dict, kind: str) -> str:
    report = row["report"]
    if kind == "comm":
        comm = report["comm"]
        return f"{comm['ratio']:.3f} x the textbook bytes ({' + '.join(comm['ratio_axes'])})"
    if kind == "state":
        return f"{report['state_bytes']['ratio']:.3f} x the ZeRO formula's state"
    pipe = report["pipeline"]
    return f"bubble {pipe['bubble']:.3f} (formula {pipe['bubble_formula']:.3f})"


def proven(bench: dict) -> str:
    lines = [
        "| strategy | equal to one device | measured by `jaxpar bench` |",
        "| --- | --- | --- |",
    ]
    for what, test, section, name, kind in PROVEN:
        row = bench.get(section, {}).get(name)
        shown = figure(row, kind) if row and "report" in row else "not measured"
        lines.append(f"| {what} | `tests/test_{test}.py` | {shown} |")
    return "\n".join(lines)


def ticks(schedule: str, p: int = 4, m: int = 8) -> str:
    """A schedule's tick table, as the executor runs it, drawn: a row per stage, a column
    per tick; F forward, R recompute, B input gradient, W weight gradient, X all three
    (1F1B's backward, and a DualPipeV pair's backward beside its forward), each
    micro-batch in its own colour; a V's second chunk in lower case."""
    from jaxpar.config.sections import Schedule
    from jaxpar.parallel import schedules

    table = schedules.tick_table(Schedule(schedule), p, m, 1)
    letters = {
        schedules.FWD: "F",
        schedules.BWD: "X",
        schedules.RECOMPUTE: "R",
        schedules.INPUT: "B",
        schedules.WEIGHT: "W",
    }
    light = {
        schedules.FWD: 82,
        schedules.BWD: 58,
        schedules.RECOMPUTE: 88,
        schedules.INPUT: 64,
        schedules.WEIGHT: 74,
    }

    def cell(kind, i, k):
        colour = f"hsl({int(i) * 360 // m},70%,{light[int(kind)]}%)"
        letter = letters[int(kind)].lower() if k else letters[int(kind)]
        return f'<span style="background:{colour}">{letter}{i:<2}</span>'

    wide = [int(w) for w in (table[..., 0] == schedules.PAIR).any(axis=1)]  # a pair: 2 cells
    rows = []
    for s in range(p):
        cells = []
        for t, (kind, i, k, *pair) in enumerate(table[:, s]):
            if kind == schedules.PAIR:  # chunk k's forward beside the other's backward
                cells.append(cell(schedules.FWD, i, k) + cell(schedules.BWD, pair[0], 1 - k))
            elif kind == schedules.IDLE:
                cells.append(" . " + "   " * wide[t])
            else:
                cells.append(cell(kind, i, k) + "   " * wide[t])
        rows.append(f"stage {s}  " + "".join(cells))
    units, idle = schedules.lockstep(table)
    unit = "half a stage's forward" if Schedule(schedule) in schedules.V_SHAPED else "a forward"
    pairs = ", a pair of F and X 4" if any(wide) else ""
    head = (
        f"{schedule}, p={p}, m={m}: {len(table)} ticks, {units} units of time "
        f"(F, R, B and W 1, X 3{pairs}, a unit {unit}; a tick as long as its longest op), "
        f"idle {idle:.3f}"
    )
    return f"{head}:\n\n<pre>\n" + "\n".join(rows) + "\n</pre>\n"


def render(name: str, bench: dict) -> str:
    if name == "proven":
        return proven(bench) + "\n"
    if name.startswith("ticks-"):
        return ticks(name.removeprefix("ticks-"))
    table = bench.get("tables", {}).get(name)
    if table is None:
        raise SystemExit(f"the bench JSON has no `{name}` table; measure it (no --from)")
    return f"{table['title']}:\n\n```\n{table['table']}\n```\n"


def rewritten(text: str, bench: dict) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), bench) + m.group(4), text)


PROOFS = ROOT / "docs" / "proofs.md"
PROOFS_HEAD = """# What is proven

Each claim that the README and these pages make, on the page that makes it, with the
tests that prove it: {claims} claims, {tests} tests. Generated by `scripts/update_docs.py`
from `tests/claims.py`; `tests/test_proofs.py` fails when a claim has no test, when a test
named here is gone, or when a page names a test file that no claim lists.

## The price of a proof

`pytest --profile` (as `.ci/run` runs the suite) prints, per test and per file, the wall
time, the seconds jax spent tracing and lowering, XLA's compile seconds and compiles, the
programs read from the session's compile cache instead, the training steps run, and how
many of a test's programs another test also compiled. A new feature's proofs cost at most
90 s of suite time on 2 cores: profile the suite before and after the change on the same
idle machine (`--profile-json PATH`) and `scripts/suite_profile.py BEFORE AFTER` prints
the files that moved and the total against the budget (exit 1 over it). A proof must fail
on a wrong implementation: `scripts/mutation_check.py` breaks five claims on purpose
(ZeRO-2's reduce-scatter made a mean, DPO without its reference, packed documents'
positions run on, a device's expert dropping its tokens, a pipeline skipping a
micro-batch) and shows the cheaper proofs of each still fail.

The levers that keep a proof cheap:

- one training run per (model, layout), cached for the session (`helpers.trained`), feeds
  every check on it, its compiled step's report too (`compile_only` reads it);
- a layout matrix is a covering set: every pair of its factors (axis, degree, schedule,
  ZeRO stage, feature) meets at least once, not the full product; each matrix says what
  its entries cover (`tests/test_moe.py`, `test_context.py`, `test_pipeline.py`,
  `test_llama.py`);
- the fewest steps and devices that make a wrong implementation fail;
- XLA:CPU at -O0 (`tests/conftest.py`), where compiling costs more than the few steps a
  proof runs; a subprocess that trains tens of steps takes -O1 instead
  (`helpers.training_env`: the walk-through's fine-tunes, 131 s to 95 s);
- one interpreter for many cases where the claim is not about the process itself;
- Python's byte code written once, by the first process that imports each module:
  `.ci/run` unsets `PYTHONDONTWRITEBYTECODE` where the environment sets it (without .pyc
  files every process parses jax, torch and transformers anew: jax's import 3.7 s
  instead of 1.0 s) and installs without byte-compiling every package (torch's whole
  tree was 29 s of the first install's 78);
- Python's cyclic collector run less often in the suite's processes (`conftest.py`):
  tracing a step makes hundreds of thousands of short-lived objects (tracing and
  lowering 12-17% sooner);
- the product's own fixed costs, cut where the profile finds them: a one-process save
  writes a replicated array whole (orbax's replica-parallel slices compiled 3,159 of the
  suite's 5,437 programs), evaluation's offline mode reaches the hub libraries a
  process imported before (a refusal waited 23 s on retries), and a small model's
  step-0 state is made by one program on one device for every layout
  (`jaxpar.step.initial`: each layout compiled its own before, 0.4 s of gpt-tiny's 1 s),
  and the step's shard_map is manual over every axis of degree 1 too
  (`jaxpar.parallel.mesh.by_hand`: a partly manual body has jax constrain every op's
  result, 2,631 of gemma3-tiny's 9,764 lines at data=8, a fifth of its compile).
"""


def proofs_page() -> str:
    """docs/proofs.md: tests/claims.py's claims by page, each with its tests."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("claims", ROOT / "tests" / "claims.py")
    claims = importlib.util.module_from_spec(spec)
    sys.modules["claims"] = claims  # its dataclass looks itself up there
    spec.loader.exec_module(claims)
    tests = {t for c in claims.CLAIMS for t in c.tests}
    out = [PROOFS_HEAD.format(claims=len(claims.CLAIMS), tests=len(tests))]
    for page in dict.fromkeys(c.page for c in claims.CLAIMS):
        title = page if page == "README.md" else f"[{page}]({page.removeprefix('docs/')})"
        out += [f"## {title}", ""]
        out += ["| claim | proven by |", "| --- | --- |"]
        for c in claims.CLAIMS:
            if c.page == page:
                out.append(f"| {c.says} | {'<br>'.join(f'`tests/{t}`' for t in c.tests)} |")
        out.append("")
    return "\n".join(out)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, help="a bench JSON: no new run")
    parser.add_argument("--check", action="store_true", help="exit 1 where a doc is stale")
    args = parser.parse_args()
    source = args.source or BENCH
    if args.source is None:
        jaxpar = Path(sys.executable).with_name("jaxpar")
        subprocess.run([str(jaxpar), "bench", "--out", str(BENCH)], check=True)
    bench = json.loads(source.read_text())
    stale = []
    for path in documents():
        text = path.read_text()
        new = rewritten(text, bench)
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    proofs = proofs_page()
    if not PROOFS.exists() or PROOFS.read_text() != proofs:
        stale.append(str(PROOFS.relative_to(ROOT)))
        if not args.check:
            PROOFS.write_text(proofs)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run scripts/update_docs.py --from {source}")
        return 1
    print(f"{'stale' if args.check else 'rewrote'}: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
