"""Adapters out to Hugging Face: a LoRA run on a Hugging Face Llama, exported with
--format peft, gives jaxpar's logits through `peft.PeftModel`; with --format hf, merged,
through transformers alone."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the test extra installs torch (CPU) on 3.11")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf import jaxpar_logits, loaded_config, save_tiny_llama, torch_logits  # noqa: E402

from jaxpar.adapters import lora  # noqa: E402
from jaxpar.cli import commands  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.nn.problem import registered  # noqa: E402
from jaxpar.training import checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # trains, and runs transformers and PEFT
    # PEFT 0.21 asks transformers 5 a question it has renamed
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def test_peft_loads_the_exported_adapters_with_jaxpar_s_logits(tmp_path, devices):
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
    params, _ = checkpoint.saved_params(run / "checkpoints")
    merged = lora.merged(registered(cfg.model, cfg.train.seq_len), cfg.adapter, cfg.model, params)
    tokens = commands.setup(cfg, devices[:1]).batches(0)["tokens"][:, :-1]
    ours = jaxpar_logits(cfg, {k: np.asarray(v) for k, v in merged.items()}, tokens)
    base = transformers.LlamaForCausalLM.from_pretrained(source).eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() / scale < 1e-5
    assert np.abs(theirs - torch_logits(source, tokens)).max() / scale > 1e-3  # it trained
    assert np.abs(torch_logits(tmp_path / "hf", tokens) - theirs).max() / scale < 1e-5
