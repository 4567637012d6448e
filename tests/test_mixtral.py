"""Mixtral and Qwen3-MoE (the Llama model with a mixture of experts) against
`transformers` itself: the first step's loss with the load-balance loss on both, on one
device and with the experts split over `expert`; logits after training and exporting;
greedy continuations token for token; a checkpoint that is not the model set, refused."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")

from helpers import changed_config, family_logits, save_drawn  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar import hf, recipe  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.generation import decoding  # noqa: E402
from jaxpar.parallel.axes import AXES  # noqa: E402

pytestmark = pytest.mark.slow  # trains, and runs transformers

BALANCE = 0.02  # router_aux_loss_coef, on in both


COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=8,
              num_key_value_heads=2, rms_norm_eps=1e-5, output_router_logits=False,
              router_aux_loss_coef=BALANCE, max_position_embeddings=512,
              tie_word_embeddings=False)  # fmt: skip
FAMILIES = {  # 4 experts, top-2, GQA
    "mixtral": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(
            **COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
        ),
    ),
    # a mixture in every second block, the k weights not renormalized, its own head size
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=4,
            head_dim=16,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=False,
        ),  # fmt: skip
    ),
}


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(family, a random tiny checkpoint of it saved by transformers), as the family's own
    are: without output_router_logits (transformers then trains without the balance)."""
    model_class, config = FAMILIES[request.param]
    torch.manual_seed(0)  # the router drawn too: its choices far from uniform
    directory = tmp_path_factory.mktemp(request.param) / "hf"
    return request.param, save_drawn(model_class(config), directory)


def theirs(directory, tokens: np.ndarray):
    """transformers' (logits, load-balance loss; 0 for a model without one) of `tokens`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    aux = getattr(out, "aux_loss", None)
    return out.logits.numpy(), float(aux) if aux is not None else 0.0


DROPLESS = "model.capacity_factor=2"  # experts / k: transformers drops nothing
ON = f"model.router_aux_loss={BALANCE}"  # a training key: taken over config.json's


def test_the_balance_is_off_as_in_transformers_unless_asked_for(checkpoint):
    family, directory = checkpoint

    def loaded(*overrides):  # as the command line gives them
        cfg = presets.load(f"{family}-tiny", [f"model.init=hf:{directory}", *overrides])
        return presets.resolve_init(
            cfg, {o.split("=")[0].removeprefix("model.") for o in overrides}
        ).model

    assert (loaded().experts, loaded().router_aux_loss) == (4, 0.0)
    assert loaded(ON).router_aux_loss == BALANCE


EXPERT_DATA_TENSOR = ("parallel.expert=2", "parallel.data=2", "parallel.tensor=2")


@pytest.mark.parametrize(
    "checkpoint, layout",
    # (data=8 equals one device with the balance on: test_moe.py)
    [
        ("mixtral", ("parallel.data=1",)),
        ("mixtral", ("parallel.data=2", "parallel.expert=4")),
        ("mixtral", EXPERT_DATA_TENSOR),
        ("qwen3_moe", ("parallel.data=1",)),
        ("qwen3_moe", EXPERT_DATA_TENSOR),
    ],
    indirect=["checkpoint"],
)
def test_first_step_loss_is_transformers_loss(checkpoint, layout, devices):
    family, directory = checkpoint
    cfg = presets.load(
        f"{family}-tiny",
        [f"model.init=hf:{directory}", DROPLESS, ON, *layout, "train.steps=1", "train.lr=1e-12"],
    )
    cfg = presets.resolve_init(cfg, {"router_aux_loss"})
    assert (cfg.model.experts, cfg.model.router_aux_loss) == (4, BALANCE)
    n = math.prod(max(getattr(cfg.parallel, a), 1) for a in AXES)
    s = recipe.setup(cfg, devices[:n])
    params = hf.initial_params(registry.get(family).hf, cfg.model, directory, s.problem.shapes)
    result = jaxpar.train(s.problem, cfg, s.batches, mesh=s.mesh, params=params, quiet=True)
    tokens = s.batches(0)["tokens"]
    logits, balance = theirs(directory, tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        torch.tensor(logits).reshape(-1, 256), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()
    assert result.losses[0] == pytest.approx(loss + BALANCE * balance, rel=1e-5)
    assert BALANCE * balance > 1e-5 * loss  # the balance loss is seen, not lost in rounding


def test_trained_and_exported_logits_are_transformers_logits(checkpoint, tmp_path, devices):
    """Three steps (data=4 x tensor=2, ZeRO-3), `jaxpar export --format hf`, loaded back
    by transformers: its logits within 1e-4 of their scale of jaxpar's."""
    family, directory = checkpoint
    run = tmp_path / "run"
    argv = ["train", "--config", f"{family}-tiny", f"model.init=hf:{directory}", DROPLESS, ON,
            "parallel.data=4", "parallel.tensor=2", "parallel.zero=3", "train.steps=3",
            "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "out"), "--format", "hf"]) == 0
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    # the architecture, the experts, the sparse blocks, the balance's weight: as read
    read = FAMILIES[family][1].to_dict() | {"output_router_logits": True}
    kept = ["architectures", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
            "output_router_logits", "decoder_sparse_step", "norm_topk_prob"]  # fmt: skip
    assert {k: exported.get(k) for k in kept} == {k: read.get(k) for k in kept}
    params, meta = jaxpar.training.checkpoint.saved_params(run / "checkpoints")
    cfg = presets.from_dict(meta["config"])
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40))
    want, _ = theirs(tmp_path / "out", tokens)
    err = np.abs(family_logits(cfg, params, tokens) - want).max() / np.abs(want).max()
    assert err < 1e-4, err


def test_greedy_continuations_are_transformers_generate(checkpoint, devices):
    from test_generate import PROMPTS, transformers_greedy

    _, directory = checkpoint
    model = decoding.load(f"hf:{directory}", ["parallel.data=1"], devices=devices[:2])
    done = decoding.generate(decoding.Decoder(model), PROMPTS, 32, decoding.Sampling(), set())
    assert done.completions == transformers_greedy(directory, PROMPTS, 32)


REFUSED = {
    "other experts than set": (
        "mixtral",
        {"model.experts=8"},
        ["model.experts=8 disagrees with model.init=hf:", "config.json gives 4"],
    ),
    # Mixtral's files have a mixture in every block: moe_every=2 reads none (nor writes)
    "a mixture in every second block": (
        "mixtral",
        {"model.moe_every=2"},
        ["model.moe_every=2: Mixtral's checkpoints have a mixture in every block"],
    ),
    "Mixtral's weights not renormalized": (
        "mixtral",
        {"model.router_renormalize=false"},
        ["model.router_renormalize=false: Mixtral always renormalizes"],
    ),
    # a dense block of another hidden size than the experts': jaxpar has one model.mlp
    "dense blocks wider than the experts": (
        "qwen3_moe",
        {"intermediate_size": 128},
        ["decoder_sparse_step=2 with intermediate_size=128 and moe_intermediate_size=64"],
    ),
    "dense-only layers by list": (
        "qwen3_moe",
        {"mlp_only_layers": [0]},
        ["mlp_only_layers=[0] is not supported", "model.moe_every"],
    ),
}


@pytest.mark.parametrize(
    "checkpoint, case",
    [(family, case) for case, (family, *_) in REFUSED.items()],
    indirect=["checkpoint"],
)
def test_a_checkpoint_that_is_not_the_model_set_is_refused(case, checkpoint, capsys, tmp_path):
    """Keys set against the checkpoint (a set), or a checkpoint jaxpar cannot express (its
    config.json changed: a dict)."""
    family, directory = checkpoint
    _, change, needles = REFUSED[case]
    overrides = sorted(change) if isinstance(change, set) else []
    if isinstance(change, dict):
        directory = changed_config(directory, change, tmp_path / "hf")
    argv = ["train", "--config", f"{family}-tiny", f"model.init=hf:{directory}", *overrides,
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(n in err for n in needles), err
