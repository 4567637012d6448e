"""The suite's profile (`pytest --profile`, as .ci/run runs it): per test and per file,
the wall time, XLA's compile seconds and compiles, the programs read from the session's
cache instead, the training steps run, and how many of a test's programs another test
also compiled (what a shared cached run would save). Every process of the session, the
subprocesses too, records its events (profiling/suite_events.py); the first process reads
them at the end, prints the top tests and the totals, and with `--profile-json PATH`
writes every row (the before/after tables of docs/proofs.md's budget come from it)."""

import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent / "profiling"
sys.path.insert(0, str(HERE))
import suite_events  # noqa: E402

TOP = 30


def pytest_addoption(parser):
    group = parser.getgroup("profile", "the suite's profile")
    group.addoption("--profile", action="store_true", help="print each test's compiles and steps")
    group.addoption("--profile-json", metavar="PATH", help="write the profile's rows to PATH")


def _wanted(config) -> bool:
    return config.getoption("--profile") or bool(config.getoption("--profile-json"))


_profile: dict | None = None  # the first process's: its events' folder, each test's wall time


def pytest_configure(config):
    global _profile
    first = not hasattr(config, "workerinput")
    if first and _wanted(config):
        folder = tempfile.mkdtemp(prefix="jaxpar-profile-")
        _profile = {"dir": folder, "wall": defaultdict(float)}
        path = os.environ.get("PYTHONPATH")
        os.environ.update(  # inherited by the workers and every subprocess they start
            JAXPAR_PROFILE_DIR=folder,
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), path])),
        )
    suite_events.listen()


def pytest_runtest_logreport(report):
    if _profile is not None:  # setup, call and teardown, from every worker
        _profile["wall"][report.nodeid] += report.duration


COUNTS = ("wall", "trace_s", "compile_s", "compiles", "cached", "steps")


def _row(test: str, wall: float = 0.0, **more) -> dict:
    return dict(
        test=test, wall=wall, trace_s=0.0, compile_s=0.0, compiles=0, cached=0, steps=0, **more
    )


def rows(wall: dict, events: list[dict]) -> list[dict]:
    """One row per test: wall, trace_s (tracing and lowering), compile_s, compiles (cache
    misses), cached (hits), steps, shared (its distinct programs that some other test also
    compiled or read)."""
    row = {t: _row(t, wall=w) for t, w in wall.items()}
    users, programs = defaultdict(set), defaultdict(set)
    for e in events:
        r = row.setdefault(e["test"], _row(e["test"]))
        if e["kind"] in ("compile", "trace"):
            r[f"{e['kind']}_s"] += e["s"]
        elif e["kind"] == "step":
            r["steps"] += 1
        elif e["kind"] in ("miss", "hit"):
            r["compiles" if e["kind"] == "miss" else "cached"] += 1
            users[e["key"]].add(e["test"])
            programs[e["test"]].add(e["key"])
    for t, r in row.items():
        r["shared"] = sum(len(users[k]) > 1 for k in programs[t])
    return sorted(row.values(), key=lambda r: -r["wall"])


def by_file(rows_: list[dict]) -> list[dict]:
    files = {}
    for r in rows_:
        name = r["test"].split("::")[0]
        f = files.setdefault(name, _row(name, shared=0, tests=0))
        for k in (*COUNTS, "shared"):
            f[k] += r[k]
        f["tests"] += 1
    return sorted(files.values(), key=lambda r: -r["wall"])


def table(rows_: list[dict], top: int | None = None) -> str:
    lines = [
        f"{'wall s':>8} {'trace s':>7} {'compile s':>9} {'compiles':>8} {'cached':>6} "
        f"{'shared':>6} steps  test"
    ]
    for r in rows_[:top]:
        lines.append(
            f"{r['wall']:8.1f} {r['trace_s']:7.1f} {r['compile_s']:9.1f} {r['compiles']:8d} "
            f"{r['cached']:6d} {r['shared']:6d} {r['steps']:5d}  {r['test']}"
        )
    return "\n".join(lines)


def _events(folder: str) -> list[dict]:
    events = []
    for path in Path(folder).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a process killed mid-line (kill -9 tests)
                continue
    return events


def pytest_terminal_summary(terminalreporter, config):
    profile = _profile
    if profile is None:
        return
    every = rows(profile["wall"], _events(profile["dir"]))
    files = by_file(every)
    total = {k: sum(r[k] for r in every) for k in COUNTS}
    write = terminalreporter.write_line
    write("")
    write(
        f"suite profile: {len(profile['wall'])} tests, {total['wall']:.0f} s of test time, "
        f"{total['trace_s']:.0f} s tracing and lowering, {total['compile_s']:.0f} s compiling "
        f"({total['compiles']} compiles, {total['cached']} read from the cache), "
        f"{total['steps']} training steps"
    )
    write(f"the {TOP} slowest tests:")
    write(table(every, TOP))
    write("by file:")
    write(table(files))
    target = config.getoption("--profile-json")
    if target:
        rows_ = {"total": total, "files": files, "tests": every}
        Path(target).write_text(json.dumps(rows_, indent=1))
