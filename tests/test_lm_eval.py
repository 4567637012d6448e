"""jaxpar eval: lm-eval's requests answered on the sharded model as lm-eval's own
Hugging Face backend answers them, in length buckets, in every decoding layout; the
command, the shipped local tasks, train.eval_tasks, and bad input."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import jax_durations, one_line_error

pytest.importorskip("lm_eval", reason="the test extra installs lm-eval")

from lm_eval.api.instance import Instance  # noqa: E402

from jaxpar import hf  # noqa: E402
from jaxpar.cli import main as cli  # noqa: E402
from jaxpar.config import presets, registry  # noqa: E402
from jaxpar.evaluation import report, tasks  # noqa: E402
from jaxpar.evaluation.harness import JaxparLM  # noqa: E402
from jaxpar.nn.problem import registered  # noqa: E402

SHIPPED = ["jaxpar_arithmetic_mc", "jaxpar_arithmetic_gen"]
LAYOUTS = {
    "one device": (["parallel.data=1", "parallel.tensor=1"], 1),
    "tensor=2": (["parallel.data=1", "parallel.tensor=2"], 2),
    "data=2 x tensor=2": (["parallel.data=2", "parallel.tensor=2"], 4),
}
LONG = "Question: What is 1 plus 2?\nAnswer: 3\n" * 12  # past the model's 64 positions


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, chat_tokenizer):
    """hf:DIR of a Llama (GQA, 64 positions, the chat tokenizer's 512 ids) with weights
    drawn far from the init (norm scales near 1), so that its choices are sharp and a
    wrong id shows; written by jaxpar's own export (no torch needed)."""
    cfg = presets.load("llama-tiny", ["model.vocab=512", "model.layers=2"])
    problem = registered(cfg.model, cfg.train.seq_len)
    rng = np.random.default_rng(0)
    params = {
        k: (1.0 if "norm" in k else 0.0) + 0.1 * rng.standard_normal(s.shape).astype(np.float32)
        for k, s in problem.shapes.items()
    }
    folder = tmp_path_factory.mktemp("lm-eval") / "llama"
    fmt = registry.hf_format(cfg.model.name, "--format hf")
    hf.export(fmt, cfg.model, cfg.train.seq_len, params, folder)
    for f in chat_tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 64  # contexts past it are cut
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def requests(checkpoint):
    """lm-eval's requests of the shipped tasks (their first 12 documents), and the edges:
    a context past the model's length (cut from the left), an empty context (the prefix
    id), a text of several windows, a generation from a long context."""
    chosen = tasks.resolve(SHIPPED)
    out: dict[str, list] = {}
    for task in chosen.objects:
        task.build_all_requests(limit=12, rank=0, world_size=1)
        for inst in task.instances:
            out.setdefault(inst.request_type, []).append(inst)
    out["loglikelihood"] += [
        Instance("loglikelihood", {}, (LONG, " 3"), 0),
        Instance("loglikelihood", {}, ("", "What is 4 plus 4?"), 0),
    ]
    out["loglikelihood_rolling"] = [
        Instance("loglikelihood_rolling", {}, (text,), 0) for text in (LONG, "Short text.")
    ]
    out["generate_until"].append(
        Instance("generate_until", {}, (LONG, {"until": ["\n"], "max_gen_toks": 16}), 0)
    )
    return out


@pytest.fixture(scope="module")
def hf_answers(checkpoint, requests):
    """lm-eval's own `hf` backend's answers (transformers on torch, fp32)."""
    pytest.importorskip("torch", reason="the test extra installs torch on 3.11")
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(checkpoint), batch_size=4, dtype="float32", device="cpu")
    answers = {kind: getattr(model, kind)(rs) for kind, rs in requests.items()}
    return answers, [model.apply_chat_template(h, g) for h, g in CHATS]


CHATS = [  # (a conversation lm-eval renders, whether a generation prompt follows)
    ([{"role": "user", "content": "What is 7 plus 7?"}], True),
    ([{"role": "system", "content": "Add."}, {"role": "user", "content": "1 plus 2?"},
      {"role": "assistant", "content": "3"}, {"role": "user", "content": "2 plus 2?"}], True),
    ([{"role": "user", "content": "What is 1 plus 1?"}, {"role": "assistant", "content": "2"}],
     False),
]  # fmt: skip


def backend(checkpoint, overrides, devices=1) -> JaxparLM:
    model = report.model(f"hf:{checkpoint}", None, list(overrides), batch_size=8)
    assert dict(model.m.mesh.shape)["data"] * dict(model.m.mesh.shape)["tensor"] == devices
    return model


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("one device", marks=pytest.mark.slow),  # 3.6 s: the full suite's
        pytest.param("tensor=2", marks=pytest.mark.slow),
        pytest.param("data=2 x tensor=2", marks=pytest.mark.slow),
    ],
)
def test_every_request_equals_lm_evals_hf_backend(layout, checkpoint, requests, hf_answers):
    """Each log-likelihood within 1e-4 (relative) of the hf backend's, the same greedy
    flags, the same rolling sums, the same generated text: so the same scores; and the
    same prompts through the chat template (--apply-chat-template)."""
    overrides, devices = LAYOUTS[layout]
    model = backend(checkpoint, overrides, devices)
    answers, chats = hf_answers
    assert [model.apply_chat_template(h, g) for h, g in CHATS] == chats  # lm-eval's chat form
    for kind, asked in requests.items():
        ours, theirs = getattr(model, kind)(asked), answers[kind]
        if kind == "generate_until":
            assert ours == theirs
            assert any(ours), "the random model writes something before a stop"
        elif kind == "loglikelihood":
            np.testing.assert_allclose([x[0] for x in ours], [x[0] for x in theirs], rtol=1e-4)
            assert [x[1] for x in ours] == [x[1] for x in theirs]
        else:
            np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    windows = len(model.tok_encode(LONG)) // model.max_length + 1
    assert windows >= 4 and model.max_length == 64


def test_one_compile_a_length_bucket_however_many_requests(checkpoint, requests):
    """The count of compiled scoring programs is the count of length buckets: counted by
    jax's own compile events, and none again for the same buckets; requests that differ
    in their last id alone run as one row."""
    model = backend(checkpoint, LAYOUTS["one device"][0])
    asked = [model._encode_pair(*i.args) for i in requests["loglikelihood"] if i.args[0]]
    asked += [model._encode_pair("2 + 2 =", f" {n}") for n in range(6)]  # the 16 bucket
    with jax_durations("/jax/core/compile/backend_compile_duration") as compiles:
        model._loglikelihood_tokens([(None, c, x) for c, x in asked])
        buckets = model.buckets(asked)
        assert len(compiles) == len(buckets) == len(model.scorer.compiled) == 3  # 16, 32, 64
        assert len(asked) == 55
        # a question's choices that differ in their last id share a row (as hf's logits cache)
        shared = {tuple((c + x)[:-1]) for c, x in asked}
        assert model.scorer.rows_scored == len(shared) < len(asked) - 5
        model._loglikelihood_tokens([(None, c, x) for c, x in asked[::-1]])
    assert len(compiles) == 3


@pytest.mark.slow
def test_the_docs_offline_lm_eval_command_runs_as_written(checkpoint):
    """docs/evaluation.md's `lm_eval --model jaxpar` on the shipped arithmetic task, with
    the hub and datasets offline, from the folder its first line goes to (the venv's
    programs this interpreter's, the page's model this test's)."""
    page = (Path(__file__).parents[1] / "docs" / "evaluation.md").read_text()
    block = page.split("Offline, on the arithmetic tasks", 1)[1].split("```")[1]
    command = block.replace("\\\n", " ").replace("hf:/tmp/tl/base", f"hf:{checkpoint}")
    bin_ = Path(sys.executable).parent
    command = command.replace(".venv/bin/", f"{bin_}/").replace("lm_eval ", f"{bin_}/lm_eval ")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "|jaxpar_arithmetic_mc|" in done.stdout and "limit: 10.0" in done.stdout


@pytest.mark.smoke
def test_lm_evals_own_entry_point_finds_the_jaxpar_model(checkpoint):
    """`lm_eval --model jaxpar`: a fresh interpreter's lm-eval registry holds jaxpar's
    backend (the .pth the install puts beside jaxpar), and lm-eval builds it from a
    --model_args string with overrides."""
    probe = "from lm_eval.api.registry import get_model; print(get_model('jaxpar').__module__)"
    said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert said.stdout.strip() == "jaxpar.evaluation.harness", said.stderr[-2000:]
    from lm_eval.api.registry import get_model

    args = f"source=hf:{checkpoint},parallel.tensor=2,parallel.data=1"
    model = get_model("jaxpar").create_from_arg_string(args, {"batch_size": 4})
    assert dict(model.m.mesh.shape)["tensor"] == 2 and model.rows == 4


@pytest.mark.smoke
def test_eval_command_writes_lm_evals_results_and_prints_its_table(
    checkpoint, tmp_path, capsys, devices
):
    out = tmp_path / "results"
    argv = ["eval", f"hf:{checkpoint}", "--tasks", *SHIPPED, "parallel.tensor=2", "--limit", "8"]
    assert cli.main([*argv, "--out", str(out)]) == 0  # an override among the tasks: taken
    printed, err = capsys.readouterr()
    (written,) = out.glob("results_*.json")
    results = json.loads(written.read_text())
    assert set(results["results"]) == set(SHIPPED)
    assert results["n-samples"]["jaxpar_arithmetic_mc"]["effective"] == 8
    assert "|jaxpar_arithmetic_mc |" in printed and "exact_match" in printed
    assert "tokens/s" in err and "x tensor=2" in err
    # every bar is named: lm-eval's over the documents, and jaxpar's over the requests
    bars = [line for line in err.replace("\r", "\n").splitlines() if "|" in line and "%" in line]
    assert bars and [b for b in bars if not re.match(r"\s*[a-z][a-z_ ]+:", b)] == []
    assert any(bar.lstrip().startswith("building prompts:") for bar in bars)


def test_a_local_task_folder_reads_its_files_beside_it(tmp_path, monkeypatch):
    """A copy of the shipped task elsewhere, run from a third folder: its relative
    data_files are read beside its YAML."""
    folder = tmp_path / "mine"
    shutil.copytree(tasks.SHIPPED / "arithmetic", folder)
    yaml = folder / "jaxpar_arithmetic_mc.yaml"
    yaml.write_text(yaml.read_text().replace("task: jaxpar_arithmetic_mc", "task: my_sums"))
    (folder / "jaxpar_arithmetic_gen.yaml").unlink()
    monkeypatch.chdir(tmp_path)
    for spec in (str(yaml), str(folder)):
        chosen = tasks.resolve([spec])
        assert chosen.names == ["my_sums"]
        assert len(chosen.objects[0].eval_docs) == 40


@pytest.mark.parametrize(
    "make, needle",
    [
        pytest.param(  # builds lm-eval's whole index (6 s): out of the fast tier
            lambda d: ["--tasks", "jaxpar_arithmetic_m"],
            "close ones: jaxpar_arithmetic_mc",
            marks=pytest.mark.slow,
        ),
        (lambda d: ["--tasks", _yaml(d, "task: x\noutput_type: [1\n")], "lm-eval refuses it"),
        (
            lambda d: ["--tasks", _yaml(d, "task: x\ndataset_path: json\noutput_type: guess\n")],
            "lm-eval refuses it",
        ),
        (
            lambda d: ["--tasks", _yaml(d, "task: x\ndataset_path: someone/sums\n")],
            "needs a download from the Hugging Face hub",
        ),
        (lambda d: ["--tasks", "jaxpar_arithmetic_mc", "--tokenizer", _big(d)], "600 ids"),
        (lambda d: ["--tasks", str(d / "none.yaml")], "no such file"),
        (lambda d: ["--tasks", _task(d, None)], "Unable to find"),
        (lambda d: ["--tasks", _task(d, '{"question": "What is 1 plus 1?"\n')], "lm-eval refuses"),
        (lambda d: ["--tasks", "jaxpar_arithmetic_mc", "--limit", "0"], "--limit 0"),
        (lambda d: ["--tasks", "jaxpar_arithmetic_mc", "--tokenizer", str(d)], "no tokenizer.json"),
    ],
    ids=[
        "unknown",
        "yaml",
        "refused",
        "hub",
        "tokenizer",
        "missing",
        "no data",
        "bad data",
        "limit",
        "no tokenizer",
    ],
)
def test_bad_eval_input_is_one_line(
    make, needle, checkpoint, tmp_path, capsys, monkeypatch, devices
):
    """Each said in one line before the model is read; nothing written."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine with no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv = ["eval", f"hf:{checkpoint}", *make(tmp_path), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)
    assert not (tmp_path / "out").exists()


def test_offline_reaches_the_hub_libraries_imported_before(monkeypatch):
    """huggingface_hub and datasets read HF_HUB_OFFLINE once, at import: imported before
    (by TRL, a notebook), their flags follow it, or each hub request is retried with
    back-off (23 s here) before it fails."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    assert tasks.go_offline_without_network()
    assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE


def _yaml(folder, text: str) -> str:
    path = folder / "task.yaml"
    path.write_text(text)
    return str(path)


def _task(folder, data: str | None) -> str:
    """The shipped multiple-choice task beside a data file that is missing (None) or
    holds `data`."""
    text = (tasks.SHIPPED / "arithmetic" / "jaxpar_arithmetic_mc.yaml").read_text()
    if data is not None:
        (folder / "arithmetic.jsonl").write_text(data)
    return _yaml(folder, text)


def _big(folder) -> str:
    from helpers import script

    from jaxpar.data.tokens import corpus_bytes

    script("make_tiny_llama").save_tokenizer(folder / "tok", corpus_bytes().decode()[:30000], 600)
    return str(folder / "tok")


@pytest.mark.slow
def test_training_scores_tasks_beside_the_loss_and_eval_scores_the_run(
    tmp_path, chat_tokenizer, capsys
):
    """train.eval_tasks in a 3D run (data x pipeline x tensor): scores at each
    train.eval_tasks_every and the last step, in metrics.jsonl and TensorBoard; then
    `jaxpar eval` on the run (its tokenizer from the prepared data) gives the last step's
    scores again, and writes them in the run directory."""
    from test_observe import events

    from jaxpar.data.prepare import prepare
    from jaxpar.data.tokens import corpus_bytes

    (tmp_path / "corpus.txt").write_text(corpus_bytes().decode()[:60000])
    prepare([tmp_path / "corpus.txt"], chat_tokenizer, tmp_path / "tokens")
    run = tmp_path / "run"
    argv = ["train", "--config", "llama-tiny", "model.vocab=512", "model.layers=2",
            "train.steps=3", "data.source=tokens", f"data.path={tmp_path / 'tokens'}",
            "train.eval_tasks=jaxpar_arithmetic_mc", "train.eval_tasks_every=2",
            "train.eval_tasks_limit=6", "parallel.data=2", "parallel.pipeline=2",
            "parallel.tensor=2", "--out", str(run)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    acc = "eval/jaxpar_arithmetic_mc/acc"
    assert [r["step"] for r in rows if acc in r] == [2, 3]
    assert [step for step, _ in events(run / "tensorboard")[acc]] == [2, 3]
    assert "eval/jaxpar_arithmetic_mc/acc_norm" in rows[-1]
    capsys.readouterr()
    argv = ["eval", str(run), "--tasks", "jaxpar_arithmetic_mc", "--limit", "6"]
    assert cli.main(argv) == 0
    (written,) = (run / "eval").glob("results_*.json")
    scored = json.loads(written.read_text())["results"]["jaxpar_arithmetic_mc"]
    assert scored["acc,none"] == rows[-1][acc]
    assert scored["acc_norm,none"] == rows[-1]["eval/jaxpar_arithmetic_mc/acc_norm"]


@pytest.mark.parametrize(
    "preset",
    [
        "llama-tiny",
        pytest.param("mistral-tiny", marks=pytest.mark.slow),  # 2 s: out of the fast tier
        pytest.param("gemma3-tiny", marks=pytest.mark.slow),
        pytest.param("mixtral-tiny", marks=pytest.mark.slow),  # 3.5 s: out of the fast tier
        pytest.param("qwen3_moe-tiny", marks=pytest.mark.slow),
        pytest.param("deepseek-tiny", marks=pytest.mark.slow),
    ],
)
def test_scores_are_the_training_forward_in_every_family(preset, devices):
    """Every decoding family's bucketed, left-padded scores equal its training forward
    (the loss, dropless): windows shorter than a bucket (Mistral, Gemma 3's ring caches),
    experts, latent attention."""
    from jaxpar.evaluation.scoring import Scorer
    from jaxpar.generation import decoding

    experts = preset in ("mixtral-tiny", "qwen3_moe-tiny", "deepseek-tiny")
    dropless = ["model.capacity_factor=0", "model.router_aux_loss=0"] if experts else []
    loaded = decoding.random(preset, dropless, devices=devices[:2])
    seq = loaded.cfg.train.seq_len
    rng = np.random.default_rng(1)
    lengths = [5, 20, 40, seq + 1, seq + 1]  # buckets 16, 32, 64, 64 (a window is 16)
    rows = [rng.integers(0, loaded.cfg.model.vocab, n).tolist() for n in lengths]
    scorer = Scorer(decoding.Decoder(loaded), batch_size=2, max_length=seq)
    ours = [s.logprob for s in scorer([(r[:1], r[1:]) for r in rows])]
    tokens = np.zeros((len(rows), seq + 1), np.int32)
    mask = np.zeros((len(rows), seq + 1), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, 1 : len(r)] = r, 1
    loss = jax.jit(lambda p, b: loaded.problem.loss(decoding.restacked(p), b))
    losses = loss(loaded.params, {"tokens": tokens, "loss_mask": mask})
    np.testing.assert_allclose(ours, -np.asarray(losses).sum(-1), rtol=2e-5)
    assert sorted(scorer.compiled) == [16, 32, 64]
