"""The suite's profile adds up what every process recorded, and the price of a change is
read against the 90 s budget (scripts/suite_profile.py)."""

import json
import subprocess
import sys
from pathlib import Path

import suite_profile

ROOT = Path(__file__).resolve().parent.parent


def test_rows_sum_each_tests_events_and_count_programs_another_test_used():
    events = [
        {"test": "a.py::x", "kind": "compile", "s": 1.5, "program": "jit_step"},
        {"test": "a.py::x", "kind": "trace", "s": 0.5, "program": "jit_step"},
        {"test": "a.py::x", "kind": "miss", "key": "k1", "program": "jit_step"},
        {"test": "a.py::x", "kind": "miss", "key": "k2", "program": "jit_init"},
        {"test": "a.py::x", "kind": "step"},
        {"test": "a.py::x", "kind": "step"},
        {"test": "b.py::y", "kind": "hit", "key": "k1", "program": "jit_step"},  # x's program
        {"test": "b.py::y", "kind": "compile", "s": 0.25, "program": "jit_step"},
    ]
    rows = {r["test"]: r for r in suite_profile.rows({"a.py::x": 3.0, "b.py::y": 1.0}, events)}
    assert rows["a.py::x"] == {
        "test": "a.py::x", "wall": 3.0, "trace_s": 0.5, "compile_s": 1.5, "compiles": 2,
        "cached": 0, "steps": 2, "shared": 1,
    }  # fmt: skip
    assert (rows["b.py::y"]["cached"], rows["b.py::y"]["shared"]) == (1, 1)
    files = suite_profile.by_file(list(rows.values()))
    assert [f["test"] for f in files] == ["a.py", "b.py"] and files[0]["tests"] == 1


def test_the_price_of_a_change_is_read_against_the_budget(tmp_path):
    def profile(name, walls):
        rows = [{"test": f, "wall": w, "compile_s": 0, "compiles": 0, "steps": 0} for f, w in walls]
        (tmp_path / name).write_text(json.dumps({"files": rows}))
        return str(tmp_path / name)

    before = profile("before.json", [("tests/test_a.py", 100.0)])
    cheap = profile("cheap.json", [("tests/test_a.py", 120.0), ("tests/test_new.py", 50.0)])
    dear = profile("dear.json", [("tests/test_a.py", 100.0), ("tests/test_new.py", 95.0)])
    script = [sys.executable, str(ROOT / "scripts" / "suite_profile.py"), before]
    within = subprocess.run([*script, cheap], capture_output=True, text=True)
    assert within.returncode == 0 and "+70 s: within the budget of 90 s" in within.stdout
    assert "tests/test_new.py" in within.stdout
    over = subprocess.run([*script, dear], capture_output=True, text=True)
    assert over.returncode == 1 and "+95 s: OVER" in over.stdout
