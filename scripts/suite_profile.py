"""The price of a change's proofs: two profiles of the suite (`pytest --profile-json
PATH`, before and after the change, on the same idle machine), compared file by file.

    .venv/bin/python -m pytest -q --profile-json before.json     # on main
    .venv/bin/python -m pytest -q --profile-json after.json      # on the change
    .venv/bin/python scripts/suite_profile.py before.json after.json

Prints each file whose test time moved by a second or more, new files included, and the
total against the budget: a feature's new proofs cost at most 90 s of suite time (the
sum of its tests' wall times, which the two workers share). Exits 1 over the budget."""

import argparse
import json
import sys
from pathlib import Path

BUDGET_S = 90.0
COLUMNS = ("wall", "compile_s", "compiles", "steps")


def files(path: Path) -> dict[str, dict]:
    return {row["test"]: row for row in json.loads(path.read_text())["files"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds (90)")
    args = parser.parse_args()
    before, after = files(args.before), files(args.after)
    zero = dict.fromkeys(COLUMNS, 0)
    moved = []
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, zero), after.get(name, zero)
        delta = {k: a[k] - b[k] for k in COLUMNS}
        if abs(delta["wall"]) >= 1:
            moved.append((delta["wall"], name, delta))
    print(f"{'wall s':>8} {'compile s':>9} {'compiles':>8} {'steps':>6}  file (after - before)")
    for _, name, d in sorted(moved, reverse=True):
        print(
            f"{d['wall']:+8.1f} {d['compile_s']:+9.1f} {d['compiles']:+8d} {d['steps']:+6d}  {name}"
        )
    total = sum(a["wall"] for a in after.values()) - sum(b["wall"] for b in before.values())
    verdict = "within" if total <= args.budget else "OVER"
    print(f"suite time {total:+.0f} s: {verdict} the budget of {args.budget:.0f} s")
    return 0 if total <= args.budget else 1


if __name__ == "__main__":
    sys.exit(main())
