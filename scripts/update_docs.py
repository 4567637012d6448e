"""The docs' measured numbers, regenerated: `jaxpar bench` into docs/bench.json, then every
table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in README.md and docs/*.md
rewritten from it. Never retype a measured number: run this.

    .venv/bin/python scripts/update_docs.py                          # measure, then rewrite
    .venv/bin/python scripts/update_docs.py --from docs/bench.json   # rewrite only
    .venv/bin/python scripts/update_docs.py --from docs/bench.json --check   # exit 1 if stale

NAME is a section of the bench (strategies, schedules, dp, hosts, offload, remat, context,
experts, checkpoint, longest, compile, plan, generate, generate-peer), shown as its
printed table, or
`proven`: the README's table of what is proven, with each strategy's measured figure.
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


def render(name: str, bench: dict) -> str:
    if name == "proven":
        return proven(bench) + "\n"
    table = bench.get("tables", {}).get(name)
    if table is None:
        raise SystemExit(f"the bench JSON has no `{name}` table; measure it (no --from)")
    return f"{table['title']}:\n\n```\n{table['table']}\n```\n"


def rewritten(text: str, bench: dict) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), bench) + m.group(4), text)


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
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run scripts/update_docs.py --from {source}")
        return 1
    print(f"{'stale' if args.check else 'rewrote'}: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
