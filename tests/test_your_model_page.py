"""docs/your-model.md's Python examples run as written (in a fresh process, as a user
pastes them)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).parent.parent / "docs" / "your-model.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.mark.slow
def test_your_own_model_examples_run(tmp_path):
    blocks = python_blocks()
    assert len(blocks) == 3  # the model, trained; then pipeline-ready; a shipped model
    after = """
assert result.losses[-1] < result.losses[0], result.losses
model = jaxpar.to_nnx(Model, result.params)
x = batches(0)["x"]
assert model(x).shape == (32, 8)
assert (pathlib.Path("runs/mine") / "metrics.jsonl").exists()
print("PAGE OK")
"""
    first, pipelined, shipped = blocks
    script = f"import pathlib\n{first}\n{after}\n{pipelined}\n{after}\n{shipped}"
    script += "\nassert len(result.losses) == 3 and s.mesh.shape == {**s.mesh.shape, 'data': 4}"
    script += "\nprint('SHIPPED OK')"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("PAGE OK") == 2 and "SHIPPED OK" in done.stdout
