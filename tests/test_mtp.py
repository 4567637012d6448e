"""DeepSeek-V3's multi-token prediction (models/mtp.py) against a torch reference of its
formula on the same weights: a random DeepSeek-V3 drawn by transformers with two more
layers, which become the prediction modules' blocks as DeepSeek's checkpoints lay them out
(layers num_hidden_layers.., with their norms, projection and copies of the embedding and
head); its loss at depths 1 and 2, its layout read and written back bitwise, and its
training equal to one device in every kind of layout."""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import save_drawn  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_deepseek import FAMILIES  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.parallel.axes import AXES  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers

LAYERS, DEPTH, WEIGHT = 3, 2, 0.3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(a DeepSeek-V3 checkpoint with DEPTH prediction layers, the transformers model
    whose last DEPTH layers are their blocks)."""
    config = FAMILIES["deepseek_v3"][1].to_dict() | {"num_hidden_layers": LAYERS + DEPTH}
    torch.manual_seed(2)
    full = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    folder = tmp_path_factory.mktemp("mtp")
    save_drawn(full, folder / "full")
    tensors = load_file(folder / "full" / "model.safetensors")
    rng = np.random.default_rng(0)
    e = config["hidden_size"]
    for layer in range(LAYERS, LAYERS + DEPTH):
        at = f"model.layers.{layer}."
        tensors |= {
            at + "enorm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
            at + "hnorm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
            at + "shared_head.norm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
            at + "eh_proj.weight": (0.1 * rng.standard_normal((e, 2 * e))).astype(np.float32),
            at + "embed_tokens.weight": tensors["model.embed_tokens.weight"],
            at + "shared_head.head.weight": tensors["lm_head.weight"],
        }
    directory = folder / "hf"
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((folder / "full" / "config.json").read_text())
    written = saved | {"num_hidden_layers": LAYERS, "num_nextn_predict_layers": DEPTH}
    (directory / "config.json").write_text(json.dumps(written))
    return directory, full.eval()


def deepseeks_formula(directory, full, tokens: np.ndarray, depth: int):
    """(the main cross-entropy + WEIGHT / depth x sum_k L_k, the mean of the L_k), in
    torch: the main model as transformers reads the checkpoint; module k: eh_proj of
    [enorm(embedding of token i + k); hnorm(the previous hidden state)] (the main model's
    normed output first), the layer's block, shared_head.norm, the head; L_k the
    cross-entropy of token i + k + 1 summed over the rows' positions, over the main
    loss's count (DeepSeek's 1 / T)."""
    weights = load_file(directory / "model.safetensors")
    main = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor(tokens, dtype=torch.long)
    inputs, (rows, seq) = ids[:, :-1], ids[:, :-1].shape
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        h = main.model(inputs).last_hidden_state
        loss = ce(main.lm_head(h).reshape(-1, 256), ids[:, 1:].reshape(-1)).item()
        positions = torch.arange(seq)[None]
        causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        per_depth = []
        for k in range(1, depth + 1):
            at = f"model.layers.{LAYERS + k - 1}."
            norm = lambda x, name: full.model.norm.__class__(x.shape[-1], 1e-5)  # noqa: E731
            enorm, hnorm, out_norm = (norm(h, n) for n in ("enorm", "hnorm", "shared_head.norm"))
            for module, name in (
                (enorm, "enorm"),
                (hnorm, "hnorm"),
                (out_norm, "shared_head.norm"),
            ):
                module.weight.copy_(torch.tensor(weights[at + name + ".weight"]))
            ahead = torch.nn.functional.pad(ids[:, k:], (0, k - 1))[:, :seq]
            both = torch.cat([enorm(main.model.embed_tokens(ahead)), hnorm(h)], -1)
            x = both @ torch.tensor(weights[at + "eh_proj.weight"]).T
            rope = main.model.rotary_emb(x, positions)
            block = full.model.layers[LAYERS + k - 1]
            h = block(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
            logits = main.lm_head(out_norm(h))[:, : seq - k]
            summed = ce(logits.reshape(-1, 256), ids[:, k + 1 :].reshape(-1), reduction="sum")
            per_depth.append(summed.item() / (rows * seq))
    return loss + WEIGHT / depth * sum(per_depth), float(np.mean(per_depth))


@pytest.mark.parametrize("depth", [1, 2])
def test_the_loss_is_deepseeks_formula(checkpoint, depth, devices):
    """The first step's loss (lr 1e-12, one device, dropless), and the reported
    mtp_loss, equal the reference within 1e-5."""
    directory, full = checkpoint
    cfg = presets.load("deepseek-tiny", [
        f"model.init=hf:{directory}", f"model.mtp_depth={depth}", f"model.mtp_weight={WEIGHT}",
        "model.capacity_factor=0", "parallel.data=1", "train.steps=1", "train.lr=1e-12",
    ])  # fmt: skip
    cfg = presets.resolve_init(cfg, {"mtp_depth", "mtp_weight", "capacity_factor"})
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = recipe.setup(cfg, devices[:n])
    fmt = registry.get("deepseek_v3").hf
    params = hf.initial_params(fmt, cfg.model, directory, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    want, mtp_loss = deepseeks_formula(directory, full, s.batches(0)["tokens"], depth)
    assert result.losses[0] == pytest.approx(want, rel=1e-5)
    assert result.rows[0]["mtp_loss"] == pytest.approx(mtp_loss, rel=1e-5)


def test_the_modules_layers_read_and_write_back_bitwise(checkpoint, tmp_path):
    """Read with model.mtp_depth=2 and exported at once: every tensor of the file, the
    modules' layers and their copies of the embedding and head among them, bitwise; and
    num_nextn_predict_layers as read."""
    import jax

    directory, _ = checkpoint
    cfg = presets.load("deepseek-tiny", [f"model.init=hf:{directory}", f"model.mtp_depth={DEPTH}"])
    cfg = presets.resolve_init(cfg, {"mtp_depth"})
    fmt = registry.get("deepseek_v3").hf
    problem = jaxpar.nn.problem.registered(cfg.model, cfg.train.seq_len)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one) for k, s in problem.shapes.items()
    }
    params = {
        k: np.asarray(v)
        for k, v in hf.initial_params(fmt, cfg.model, directory, problem.shapes)(targets).items()
    }
    assert any(k.startswith("mtp/") for k in params)
    hf.export(fmt, cfg.model, cfg.train.seq_len, params, tmp_path / "out")
    read, wrote = (load_file(d / "model.safetensors") for d in (directory, tmp_path / "out"))
    assert read.keys() == wrote.keys()
    assert all(np.array_equal(read[k], wrote[k]) for k in read)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (LAYERS, DEPTH)


# deepseek-tiny with two modules (each a sparse block with its balancing bias), dropless:
# data x tensor x ZeRO-3, and a pipeline (the modules on its last stage) with experts
# over 4 on each stage
MTP = ("model.mtp_depth=2", "model.mtp_weight=0.3", "model.capacity_factor=0")
MTP_LAYOUTS = {
    "dp2-tp2-zero3": ("parallel.data=2", "parallel.tensor=2", "parallel.zero=3"),
    "pp2-expert4-m2": (
        "parallel.data=1", "parallel.pipeline=2", "parallel.expert=4", "parallel.microbatches=2",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", MTP_LAYOUTS)
def test_the_modules_train_in_every_layout_as_on_one_device(name):
    from helpers import assert_same_training, reference, trained

    got = trained("deepseek-tiny", (*MTP, *MTP_LAYOUTS[name]))
    assert_same_training(got, reference("deepseek-tiny", MTP))
    assert any(k.startswith("mtp/") for k in got.params)
