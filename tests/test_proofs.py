"""The ledger of claims (tests/claims.py, rendered as docs/proofs.md) holds: every claim has
a test, every test it names exists, and every test file the README and the docs cite is
listed under a claim of that page."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import conftest
from claims import CLAIMS

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CITED = re.compile(r"tests/(test_\w+\.py)")


def _functions(file: str) -> set[str]:
    tree = ast.parse((TESTS / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def _collected(files: set[str]) -> set[str]:
    """The node ids of `files` (relative to tests/): this session's, where it collected
    them all (the whole suite); else collected now, in a fresh pytest."""
    if all(any(c.startswith(f"{f}::") for c in conftest.COLLECTED) for f in files):
        return conftest.COLLECTED
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
         *sorted(files)],
        cwd=TESTS, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return {line.split("tests/", 1)[-1] for line in done.stdout.splitlines() if "::" in line}


def test_every_claim_has_a_test_that_exists():
    assert len(CLAIMS) >= 87, "the ledger must not lose claims"
    for claim in CLAIMS:
        assert claim.tests, f"{claim.page}: '{claim.says}' names no test"
        assert (ROOT / claim.page).exists(), claim.page
    named = {t for c in CLAIMS for t in c.tests}
    missing = []
    for test in named:
        file, function = test.split("::")
        if not (TESTS / file).exists() or function.split("[")[0] not in _functions(file):
            missing.append(test)
    assert not missing, f"the ledger names tests that are gone: {sorted(missing)}"
    cases = {t for t in named if "[" in t}
    collected = _collected({t.split("::")[0] for t in cases})
    gone = sorted(cases - collected)
    assert not gone, f"the ledger names cases that are gone: {gone}"


def test_every_test_file_a_page_cites_is_under_one_of_its_claims():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unlisted = []
    for page in pages:
        name = str(page.relative_to(ROOT))
        if name == "docs/proofs.md":
            continue
        listed = {t.split("::")[0] for c in CLAIMS if c.page == name for t in c.tests}
        unlisted += [f"{name}: {f}" for f in set(CITED.findall(page.read_text())) - listed]
    assert not unlisted, f"cited without a claim in tests/claims.py: {sorted(unlisted)}"
