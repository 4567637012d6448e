"""A model registered from this file, with a config key of its own, trains, inspects and
plans through the `jaxpar` command with no edit to jaxpar; no model name is tested
outside models/."""

import dataclasses
import json
import re
from pathlib import Path
from typing import Annotated

import jax
import pytest
from flax import nnx

import jaxpar
from jaxpar import BATCH, EMBED, MLP, SEQ, VOCAB
from jaxpar.cli import main as cli
from jaxpar.config import keys_help, presets, registry
from jaxpar.config.options import Range


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedConfig(jaxpar.Model):
    gate: Annotated[float, Range(0, 1, "a share")] = 0.5  # how much of each block is kept


class GatedBlock(nnx.Module):
    def __init__(self, cfg: GatedConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.up = jaxpar.param(rngs, init, (cfg.embed, cfg.mlp), (EMBED, MLP))
        self.down = jaxpar.param(rngs, init, (cfg.mlp, cfg.embed), (MLP, EMBED))
        self.gate = cfg.gate

    def __call__(self, x_BxSxE):
        h_BxSxM = jaxpar.constrain(jax.nn.gelu(x_BxSxE @ self.up[...]), (BATCH, SEQ, MLP))
        return x_BxSxE + self.gate * jaxpar.constrain(h_BxSxM @ self.down[...], (BATCH, SEQ, EMBED))


class Gated(nnx.Module):
    def __init__(self, cfg: GatedConfig, seq_len: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.table = jaxpar.param(rngs, init, (cfg.vocab, cfg.embed), (VOCAB, EMBED))
        self.blocks = jaxpar.stack(lambda r: GatedBlock(cfg, r), cfg.layers, rngs)
        self.head = jaxpar.param(rngs, init, (cfg.embed, cfg.vocab), (EMBED, VOCAB))


def loss(model: Gated, batch):
    tokens = batch["tokens"]
    x = jax.nn.one_hot(tokens[:, :-1], model.table.shape[0]) @ model.table[...]
    x = jaxpar.scan_layers(model.blocks, x, lambda block, h: block(h))
    logits = jaxpar.constrain(x @ model.head[...], (BATCH, SEQ, VOCAB))
    return -jax.nn.log_softmax(logits)[
        jax.numpy.arange(tokens.shape[0])[:, None],
        jax.numpy.arange(tokens.shape[1] - 1)[None],
        tokens[:, 1:],
    ]


SPEC = jaxpar.ModelSpec(
    name="gated",
    build=lambda m, seq_len, rngs: Gated(m, seq_len, rngs),
    loss=loss,
    stages=lambda m, seq_len: None,
    flops_per_token=lambda m, seq_len: 6 * (m.layers * 2 * m.embed * m.mlp + 2 * m.vocab * m.embed),
    activation_bytes=lambda m, seq_len, tensor, scores, context: (
        seq_len / context * (2 * m.embed + 2 * m.mlp / tensor)
    ),
    # each block 1 each way; embedding, head
    tensor_elements=lambda m, rows, seq_len, t: (2 * m.layers + 2) * rows * seq_len * m.embed,
    config=GatedConfig,
    tiny="gpt-tiny",
)


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))  # undone after the test
    jaxpar.register_model(SPEC)


MODEL = ["--config", "gpt-tiny", "model.name=gated", "model.gate=0.25"]


@pytest.mark.slow
def test_a_registered_model_trains_inspects_and_plans(gated, tmp_path, capsys, devices):
    run = ["train", *MODEL, "parallel.data=4", "parallel.tensor=2", "train.steps=3"]
    assert cli.main([*run, "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["model"] == {
        **summary["config"]["model"],
        "name": "gated",
        "gate": 0.25,
    }
    assert 1.0 <= summary["comm"]["ratio"] <= 1.02  # its own Megatron count, in the ledger
    picture = tmp_path / "new" / "folder" / "layout.png"  # a folder that does not exist yet
    assert cli.main(["inspect", *MODEL, "parallel.tensor=2", "--out", str(picture.parent)]) == 0
    assert picture.stat().st_size > 0 and "blocks/up" in capsys.readouterr().out
    plan = ["plan", *MODEL, "--devices", "8", "--device-memory", "1GB"]
    assert cli.main([*plan, "--out", str(tmp_path / "plans" / "winner.yaml")]) == 0
    assert "recommended:" in capsys.readouterr().out
    winner = presets.load(str(tmp_path / "plans" / "winner.yaml"))
    assert isinstance(winner.model, GatedConfig) and winner.model.gate == 0.25


def test_its_own_key_is_declared_checked_and_helped(gated, capsys):
    assert cli.main(["train", *MODEL, "model.gate=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxpar: error: model.gate=2: out of range; it must be >= 0 and <= 1 (a share)"
    )
    with pytest.raises(jaxpar.ConfigError, match="model.gate=-1: out of range"):
        GatedConfig(name="gated", gate=-1)
    with pytest.raises(jaxpar.ConfigError, match=r"build the model section as GatedConfig"):
        jaxpar.Model(name="gated")
    assert "model.gate=0.5" in keys_help.keys_help() and "(GatedConfig)" in keys_help.keys_help()
    assert cli.main(["train", "model.name=gatd"]) == 2
    assert "did you mean gated?" in capsys.readouterr().err


def test_no_model_is_named_outside_models():
    """jaxpar's own code names no model: a model is found through the registry alone."""
    source = Path(jaxpar.__file__).parent
    names = [name for name in registry.names() if name != "mlp"]  # "mlp" is also a dim name
    for path in source.glob("*.py"):
        for name in names:
            found = re.findall(rf"[\"']{name}[\"']", path.read_text())
            assert not found, f"{path.name} names the model {name!r}"


def test_a_family_is_one_record():
    """Each Hugging Face family is its record in models/families.py and nothing else:
    registered as a model with its preset, read and written with its architecture, and
    named by no other file of jaxpar or its models."""
    from jaxpar.models.families import FAMILIES

    root = Path(__file__).resolve().parent.parent
    library = [p for p in (root / "jaxpar").rglob("*.py") if "models" not in p.parts]
    sources = [*library, *(p for p in (root / "models").glob("*.py") if p.name != "families.py")]
    for family in FAMILIES:
        spec = registry.get(family.name)
        assert spec.hf.architecture == family.architecture
        assert registry.tiny_preset(family.name) == family.tiny
        assert family.tiny in presets.preset_names()
        if family.name == "llama":
            continue  # the base model's own name is its module's
        named = [p.name for p in sources if re.search(rf"[\"']{family.name}[\"']", p.read_text())]
        assert named == [], (family.name, named)
