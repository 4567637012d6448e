"""Adapters out to Hugging Face: a LoRA run on a Hugging Face Llama, exported with
--format peft, gives jaxpar's logits through `peft.PeftModel`; with --format hf, merged,
through transformers alone."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers import one_line_error  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_hf import jaxpar_logits, loaded_config, save_tiny_llama, torch_logits  # noqa: E402

from jaxpar import recipe  # noqa: E402
from jaxpar.adapters import lora  # noqa: E402
from jaxpar.adapters import peft as peft_io  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets  # noqa: E402
from jaxpar.nn.problem import registered  # noqa: E402
from jaxpar.training import export  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # trains, and runs transformers and PEFT
    # PEFT 0.21 asks transformers 5 a question it has renamed
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def test_peft_loads_the_exported_adapters_with_jaxpar_s_logits(tmp_path, devices, capsys):
    source = save_tiny_llama(tmp_path / "source")
    run = tmp_path / "run"
    lora_keys = ["adapter.kind=lora", "adapter.rank=4", f"adapter.targets={TARGETS}"]
    # fmt: off
    argv = ["train", "--config", "llama-tiny", f"model.init=hf:{source}", *lora_keys,
            "parallel.data=4", "parallel.tensor=2", "train.steps=3", "--out", str(run)]
    # fmt: on
    assert cli.main(argv) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "peft"), "--format", "peft"]) == 0
    assert cli.main(["export", str(run), "--to", str(tmp_path / "hf"), "--format", "hf"]) == 0
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], written["peft_type"]) == (4, 16.0, "LORA")

    cfg = loaded_config(source, *lora_keys)
    params, _ = export.run_params(run)
    merged = lora.merged(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model, params)
    tokens = recipe.setup(cfg, devices[:1]).batches(0)["tokens"][:, :-1]
    ours = jaxpar_logits(cfg, {k: np.asarray(v) for k, v in merged.items()}, tokens)
    base = transformers.LlamaForCausalLM.from_pretrained(source).eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() / scale < 1e-5
    assert np.abs(theirs - torch_logits(source, tokens)).max() / scale > 1e-3  # it trained
    assert np.abs(torch_logits(tmp_path / "hf", tokens) - theirs).max() / scale < 1e-5

    # the checkpoint holds the adapters and a reference to the base: a base whose files
    # changed since is named, not merged
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name] * 1.001
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # transformers' progress bars
    assert cli.main(["export", str(run), "--to", str(tmp_path / "hf2"), "--format", "hf"]) == 2
    one_line_error(capsys, f"hf:{source}", "fingerprint", "changed")


def test_an_adapter_peft_made_trains_on_from_peft_s_loss(tmp_path, devices, capsys):
    """adapter.init=peft:DIR reads an adapter PEFT saved (A and B both random, so that
    each counts), its rank, alpha and targets from adapter_config.json: the first loss,
    data=4 x tensor=2, is PEFT's forward's cross-entropy."""
    source = save_tiny_llama(tmp_path / "source")
    targets = ["q_proj", "v_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    base = transformers.LlamaForCausalLM.from_pretrained(source)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(tmp_path / "made")
    cfg = loaded_config(source, "adapter.kind=lora", f"adapter.init=peft:{tmp_path / 'made'}")
    cfg = peft_io.resolve(cfg, set())
    assert (cfg.adapter.rank, cfg.adapter.alpha, cfg.adapter.targets) == (
        4,
        8.0,
        "down_proj,q_proj,v_proj",
    )
    keys = ["parallel.data=4", "parallel.tensor=2", "train.steps=1"]
    result = recipe.train_config(presets.from_dict(presets.to_dict(cfg), keys), quiet=True)
    tokens = recipe.setup(cfg, devices[:1]).batches(0)["tokens"]
    with torch.no_grad():
        logits = model(torch.tensor(tokens[:, :-1], dtype=torch.long)).logits
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(tokens[:, 1:].reshape(-1)).long()
    ).item()
    assert result.losses[0] == pytest.approx(want, rel=1e-5)
    assert abs(torch_logits(source, tokens[:, :-1]) - logits.numpy()).max() > 1e-2  # it counts

    # another rank, or an adapter of another base's shape: one line each
    made = ["train", "--config", "llama-tiny", f"model.init=hf:{source}", "adapter.kind=lora"]
    argv = [*made, f"adapter.init=peft:{tmp_path / 'made'}", "adapter.rank=8"]
    capsys.readouterr()  # transformers' progress bars
    assert cli.main([*argv, "--out", str(tmp_path / "r")]) == 2
    one_line_error(capsys, "adapter.rank=8", "gives 4")
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_config.json").write_text(
        (tmp_path / "made" / "adapter_config.json").read_text()
    )
    tensors = load_file(tmp_path / "made" / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors[name] = tensors[name][:, :96].contiguous()
    save_file(tensors, other / "adapter_model.safetensors")
    assert cli.main([*made, f"adapter.init=peft:{other}", "--out", str(tmp_path / "s")]) == 2
    one_line_error(capsys, name, "[4, 96]", "[4, 128]")
