"""Packed documents and loss masks: a packed window equals its documents run alone (in
jaxpar and in transformers), a masked loss is the same in every layout (and a mean of
means would not be), a chat mask marks exactly the answers, the edges, and bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_training, one_line_error, reference, run, script

from jaxpar import hf
from jaxpar.cli import main as cli
from jaxpar.config import presets, registry
from jaxpar.data import chat
from jaxpar.data import tokens as data
from jaxpar.data.prepare import prepare
from jaxpar.nn.documents import target_weights
from jaxpar.nn.problem import registered

VOCAB = 512  # the chat tokenizer's
SEQ = 32
LENGTHS = (7, 15, 11)  # three documents in one window of SEQ inputs and their targets


@pytest.fixture(scope="module")
def chat_folder(chat_tokenizer, tmp_path_factory):
    """finetune_llama.py's conversations, prepared with --format chat."""
    root = tmp_path_factory.mktemp("chat")
    script("finetune_llama").write_conversations(root / "chat.jsonl", 600)
    prepare([root / "chat.jsonl"], chat_tokenizer, root / "tokens", 0.1, fmt="chat")
    return root / "tokens"


def packed_window(vocab: int) -> tuple[np.ndarray, list[tuple[int, int]], dict]:
    """(ids, each document's [start, end), the one window that holds them all)."""
    ids = np.random.default_rng(0).integers(0, vocab, sum(LENGTHS))
    ends = np.cumsum(LENGTHS)
    spans = [(int(e - n), int(e)) for n, e in zip(LENGTHS, ends, strict=True)]
    marks = data.Marks(starts=np.array([a for a, _ in spans], data.INDEX_DTYPE))
    batch = data.batch_at(ids, seed=0, step=0, batch_size=1, seq_len=SEQ, vocab=vocab, marks=marks)
    return ids, spans, batch


def relative(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


# Gemma's local blocks with a window of 8: documents of 7 ids (within it), 15 and 11
# (beyond it); scores and logits capped; gemma3's last block after the groups
WINDOWED = ("model.sliding_window=8", "model.logit_softcap=3")
PACKED = {
    "gpt-tiny": (),
    "llama-tiny": (),
    "gemma2-tiny": (*WINDOWED, "model.attn_softcap=2"),
    "gemma3-tiny": WINDOWED,
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", PACKED)
def test_a_packed_window_equals_each_document_alone(preset):
    """Each document's per-token losses and the gradients, packed with two others into one
    window, equal those of the document run alone, unpadded (fp32)."""
    cfg = presets.load(preset, list(PACKED[preset]))
    problem = registered(cfg.model, SEQ)
    params = problem.init(jax.random.key(1))
    ids, spans, batch = packed_window(cfg.model.vocab)
    assert batch["segment_ids"][0].tolist() == sum(([i] * n for i, n in enumerate(LENGTHS)), [])
    assert batch["positions"][0].tolist() == sum((list(range(n)) for n in LENGTHS), [])

    def packed(p):
        return problem.loss(p, batch)[0]

    def alone(p, a, b):
        return problem.loss(p, {"tokens": ids[None, a:b]})[0]

    losses, each = jax.jit(lambda p: (packed(p), [alone(p, a, b) for a, b in spans]))(params)
    for (a, b), one in zip(spans, each, strict=True):
        np.testing.assert_allclose(losses[a : b - 1], one, rtol=1e-5, atol=1e-6)
        if b < SEQ:  # the next document's first token is not predicted from this one
            assert losses[b - 1] == 0
    got, want = jax.jit(
        lambda p: (
            jax.grad(lambda p: packed(p).sum())(p),
            jax.grad(lambda p: sum(alone(p, a, b).sum() for a, b in spans))(p),
        )
    )(params)
    for key in want:
        assert relative(got[key], want[key]) < 1e-5, key


@pytest.mark.slow
def test_a_packed_llama_window_equals_transformers_on_each_document(tmp_path):
    """The same, against transformers' LlamaForCausalLM on each document alone."""
    torch = pytest.importorskip("torch", reason="the test extra installs torch on 3.11")
    pytest.importorskip("transformers")
    from test_hf import loaded_config, save_tiny_llama, torch_logits

    directory = save_tiny_llama(tmp_path / "hf")
    cfg = loaded_config(directory)
    problem = registered(cfg.model, SEQ)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device)
               for k, s in problem.shapes.items()}  # fmt: skip
    params = hf.initial_params(registry.get("llama").hf, cfg.model, directory, problem.shapes)(
        targets
    )
    ids, spans, batch = packed_window(cfg.model.vocab)
    losses = np.asarray(problem.loss(params, batch)[0])
    for a, b in spans:
        logits = torch.tensor(torch_logits(directory, ids[None, a : b - 1])[0])
        want = torch.nn.functional.cross_entropy(
            logits, torch.tensor(ids[a + 1 : b]).long(), reduction="none"
        ).numpy()
        np.testing.assert_allclose(losses[a : b - 1], want, rtol=1e-5, atol=1e-5)


LAYOUTS = {  # data (ZeRO-3 over all 8), micro-batches, accumulation, context both ways
    "3d-micro4": ("parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2",
                  "parallel.microbatches=4"),
    "zbv-micro2": ("parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=2",
                   "parallel.schedule=zbv"),
    "dualpipev-micro4": ("parallel.data=2", "parallel.pipeline=2", "parallel.microbatches=4",
                         "parallel.schedule=dualpipev"),
    "accum4": ("parallel.data=1", "train.grad_accum=4"),
    "zero3": ("parallel.data=8", "parallel.zero=3"),
    # each sequence split over context: documents' ids and positions gathered with K/V
    "context4": ("parallel.data=2", "parallel.context=4"),
    "context2-ulysses-sp": ("parallel.data=2", "parallel.context=2", "parallel.tensor=2",
                            "parallel.context_strategy=ulysses", "parallel.sequence_parallel=true"),
}  # fmt: skip


def chat_run(folder) -> tuple[str, ...]:
    return ("data.source=tokens", f"data.path={folder}", f"model.vocab={VOCAB}")


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_masked_loss_is_the_same_in_every_layout(name, chat_folder, devices):
    """Trained on chat data (answers only, their share differing row by row), every layout
    gives one device's losses and parameters."""
    assert_same_training(
        run("gpt-tiny", [*chat_run(chat_folder), *LAYOUTS[name]]),
        reference("gpt-tiny", chat_run(chat_folder)),
    )


@pytest.mark.slow
def test_packed_documents_through_gemmas_windows_over_context(chat_folder, devices):
    """gemma3-tiny on chat data (documents shorter and longer than its window of 8),
    each sequence over context=2 with tensor=2: the local layers' halos carry their
    documents' ids and positions. One device's losses and parameters."""
    model = (*chat_run(chat_folder), "model.sliding_window=8")
    layout = ("parallel.data=2", "parallel.context=2", "parallel.tensor=2")
    assert_same_training(run("gemma3-tiny", [*model, *layout]), reference("gemma3-tiny", model))


@pytest.mark.slow
def test_a_masked_mixture_is_the_same_over_experts_and_context(chat_folder, devices):
    """A mixture of experts on chat data (its balance loss over the trained tokens only),
    its experts split over expert=2 and each packed sequence over context=2: one
    device's losses and parameters."""
    layout = ("parallel.data=2", "parallel.expert=2", "parallel.context=2")
    assert_same_training(
        run("mixtral-tiny", [*chat_run(chat_folder), *layout]),
        reference("mixtral-tiny", chat_run(chat_folder)),
    )


@pytest.mark.slow
def test_a_mean_of_means_would_differ_by_the_layout(chat_folder, devices):
    """The loss the layouts agree on is the global batch's sum over its trained targets by
    their global count. A mean of the 8 devices' means (data=8), or of 4 micro-batches'
    means (grad_accum=4), has another gradient on this data, farther from it than any
    test tolerance: an implementation computing one would fail the test above."""
    cfg = presets.load("gpt-tiny", [*chat_run(chat_folder), "parallel.data=1"])
    problem = registered(cfg.model, cfg.train.seq_len)
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    marks = data.load_marks(cfg.data, cfg.train, tokens)
    batch = data.batch_at(tokens, seed=0, step=0, batch_size=16, seq_len=cfg.train.seq_len,
                          vocab=VOCAB, marks=marks)  # fmt: skip
    counts = np.asarray(target_weights(batch)).sum(axis=1)
    assert counts.min() < counts.max() / 2, counts  # the rows' densities differ
    params = problem.init(jax.random.key(cfg.train.seed))

    def mean_of_means(p, parts):
        return sum(
            jnp.sum(problem.loss(p, part)) / problem.count(part) / parts
            for part in (
                jax.tree.map(lambda x, r=r: x[r], batch) for r in np.split(np.arange(16), parts)
            )
        )

    right = jax.jit(jax.grad(lambda p: jnp.sum(problem.loss(p, batch)) / problem.count(batch)))(
        params
    )
    for parts in (8, 4):
        wrong = jax.jit(jax.grad(mean_of_means), static_argnums=1)(params, parts)
        error = max(relative(wrong[k], right[k]) for k in right)
        assert error > 100 * 1e-4, (parts, error)  # assert_same_training's rtol is 1e-4


@pytest.mark.slow
def test_a_row_with_nothing_trained_adds_nothing_and_no_nan():
    cfg = presets.load("gpt-tiny", [])
    problem = registered(cfg.model, SEQ)
    params = problem.init(jax.random.key(0))
    ids = np.random.default_rng(1).integers(0, 256, (2, SEQ + 1)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0] = 0
    losses = jax.jit(problem.loss)(params, {"tokens": ids, "loss_mask": mask})
    assert np.all(losses[0] == 0) and np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses[1], problem.loss(params, {"tokens": ids[1:]})[0], rtol=1e-6)
    assert float(problem.count({"tokens": ids, "loss_mask": mask})) == SEQ
    nothing = {"tokens": ids, "loss_mask": np.zeros_like(ids)}
    assert float(problem.count(nothing)) == 0
    grads = jax.jit(jax.grad(lambda p: jnp.sum(problem.loss(p, nothing))))(params)
    assert all(np.all(g == 0) for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_a_step_with_nothing_trained_is_zero_not_nan(chat_folder, devices):
    from jaxpar.recipe import setup
    from jaxpar.step.build import build

    cfg = presets.load("gpt-tiny", [*chat_run(chat_folder), "parallel.data=2"])
    s = setup(cfg, devices[:2])
    engine = build(s.problem, cfg, s.mesh)
    state = engine.init(jax.random.key(0))
    batch = {**s.batches(0), "loss_mask": np.zeros((16, 65), np.int32)}
    state, metrics = engine.step(state, jax.device_put(batch, engine.batch_sharding))
    assert (float(metrics.loss), float(metrics.grad_norm), float(metrics.targets)) == (0, 0, 0)


def brute_force_marks(starts: np.ndarray, window: range) -> tuple[list, list]:
    """Segment ids and positions of one window, the slow way: a new segment at each
    document start, and at the window's first id."""
    segments, positions, segment, position = [], [], 0, 0
    for n, i in enumerate(window):
        if n and i in starts:
            segment, position = segment + 1, 0
        segments.append(segment)
        positions.append(position)
        position += 1
    return segments, positions


def test_every_window_is_drawn_with_its_documents_cut_at_the_window(tmp_path):
    """Windows over the stream, the last one included; a document longer than a window,
    or begun before it, is a segment from position 0 where the window starts."""
    lengths = [3, 40, 1, 5, 90, 2, 7]  # a document longer than the window, and tiny ones
    starts = np.cumsum([0, *lengths[:-1]]).astype(data.INDEX_DTYPE)
    ids = np.arange(sum(lengths))
    seen = set()
    for step in range(200):
        batch = data.batch_at(ids, seed=0, step=step, batch_size=8, seq_len=16, vocab=1 << 16,
                              marks=data.Marks(starts=starts))  # fmt: skip
        for row in range(8):
            window = range(batch["tokens"][row, 0], batch["tokens"][row, 0] + 17)
            segments, positions = brute_force_marks(set(starts.tolist()), window)
            assert batch["segment_ids"][row].tolist() == segments
            assert batch["positions"][row].tolist() == positions
            seen.add(window.start)
    assert seen == set(range(len(ids) - 16))  # every window, the last one too


def test_the_chat_mask_marks_exactly_the_answers(chat_tokenizer):
    """The masked-in tokens of a rendered conversation decode to the assistant turns' text
    and the template's end-of-turn token; the rendering is transformers' own."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_tokenizer / "tokenizer.json"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is in a name?"},
        {"role": "assistant", "content": "A rose, by any other word."},
        {"role": "user", "content": "And <|im_end|> inside?"},  # special text in a prompt
        {"role": "assistant", "content": "Still sweet.\n\nTwo lines."},
    ]
    template = chat.Template(chat_tokenizer)
    one = chat.example(tok, template, {"messages": messages}, "messages", 0, "here")
    ids, mask = np.asarray(one.ids), one.mask.astype(bool)
    edges = np.flatnonzero(np.diff(mask.astype(int))) + 1
    runs = zip(np.split(ids, edges), np.split(mask, edges), strict=True)
    trained = [tok.decode(r.tolist(), skip_special_tokens=False) for r, m in runs if m[0]]
    assert trained == [
        "A rose, by any other word.<|im_end|>",
        "Still sweet.\n\nTwo lines.<|im_end|>",
    ]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    assert template.render(messages) == theirs.apply_chat_template(messages, tokenize=False)
    # a prompt/completion pair: the completion and the end of text
    pair = chat.example(tok, template, {"prompt": "2 + 2 = ", "completion": "4"}, "prompt", 0, "")
    trained = np.asarray(pair.ids)[pair.mask == 1].tolist()
    assert tok.decode(trained, skip_special_tokens=False) == "4<|endoftext|>"


def test_prepare_data_chat_writes_ids_mask_and_index(chat_folder):
    meta = json.loads((chat_folder / "meta.json").read_text())
    for split in ("train", "val"):
        ids = np.fromfile(chat_folder / f"{split}.bin", meta["dtype"])
        mask = np.fromfile(chat_folder / f"{split}.mask", np.uint8)
        index = np.fromfile(chat_folder / f"{split}.idx", np.int64)
        assert len(mask) == len(ids) == meta[f"{split}_tokens"] and index[0] == 0
        assert mask.sum() == meta["loss_mask"]["trained_tokens"][split]
        assert 0.1 < mask.mean() < 0.6  # answers, not prompts
    assert meta["documents"] == 600 and meta["format"] == "chat"


@pytest.mark.parametrize(
    ("lines", "template", "needle"),
    [
        ([{"text": "hi"}], True, "chat.jsonl:1: no `messages` list, nor string `prompt`"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], True, "chat.jsonl:1: message 0 "
         "has role 'robot'; roles are system, user, assistant, tool"),
        ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
         False, "chat.jsonl:1: a conversation of `messages`, but the tokenizer has no chat "
         "template"),
        (["not json"], True, "chat.jsonl:1: not JSON"),
    ],
)  # fmt: skip
def test_bad_chat_data_is_refused(lines, template, needle, chat_tokenizer, tmp_path, capsys):
    tokenizer = chat_tokenizer
    if not template:
        tokenizer = tmp_path / "plain"
        tokenizer.mkdir()
        (tokenizer / "tokenizer.json").write_bytes((chat_tokenizer / "tokenizer.json").read_bytes())
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    argv = ["prepare-data", str(path), "--tokenizer", str(tokenizer), "--out",
            str(tmp_path / "o"), "--format", "chat"]  # fmt: skip
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)


def test_conversations_without_an_answer_are_skipped_and_counted(chat_tokenizer, tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hello?"}]},
            {"prompt": "1 + 1 = ", "completion": "2"}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["prepare-data", str(path), "--tokenizer", str(chat_tokenizer), "--out",
            str(tmp_path / "o"), "--format", "chat"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "skipped 1 conversation(s) with no assistant turn" in capsys.readouterr().out
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert (meta["documents"], meta["skipped_without_answer"]) == (1, 1)


def _copy(folder, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize(
    ("change", "overrides", "needle"),
    [
        ("truncate the mask", (), "train.mask holds 99 loss-mask entries for"),
        ("drop the index", ("data.packing=documents",), "data.packing=documents: data.path="),
        ("drop the mask", ("train.loss_mask=true",), "train.loss_mask=true: data.path="),
        ("nothing", ("data.source=corpus", "data.packing=documents"),
         "data.packing=documents: data.source=corpus has no document index"),
    ],
)  # fmt: skip
def test_bad_marks_are_refused(change, overrides, needle, chat_folder, tmp_path, capsys, devices):
    folder = _copy(chat_folder, tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    if change == "truncate the mask":
        (folder / "train.mask").write_bytes((folder / "train.mask").read_bytes()[:99])
    elif change == "drop the index":
        meta.pop("index")
    elif change == "drop the mask":
        meta.pop("loss_mask")
    (folder / "meta.json").write_text(json.dumps(meta))
    source = () if "data.source=corpus" in overrides else chat_run(folder)
    argv = ["train", "--config", "gpt-tiny", *source, "train.steps=1", *overrides,
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert cli.main(argv) == 2
    one_line_error(capsys, needle)


def test_held_out_batches_carry_the_same_marks(chat_folder):
    """eval_loss is over the held-out answers, packed as in training."""
    from jaxpar import recipe

    cfg = presets.load("gpt-tiny", [*chat_run(chat_folder), "train.eval_every=5"])
    held_out = recipe.held_out_batches(cfg)(0)
    assert set(held_out) == {"tokens", "segment_ids", "positions", "loss_mask"}
    val = np.fromfile(chat_folder / "val.mask", np.uint8)
    first = held_out["tokens"][0]
    ids = np.fromfile(chat_folder / "val.bin", np.uint16)
    start = next(i for i in range(len(ids)) if np.array_equal(ids[i : i + 65], first))
    assert held_out["loss_mask"][0].tolist() == val[start : start + 65].tolist()


def test_an_old_folder_without_an_index_trains_as_a_stream(chat_folder, tmp_path):
    folder = _copy(chat_folder, tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    for key in ("index", "loss_mask"):
        meta.pop(key)
    (folder / "meta.json").write_text(json.dumps(meta))
    cfg = presets.load("gpt-tiny", list(chat_run(folder)))
    assert data.uses(cfg.data, cfg.train) == (False, False)
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    batch = data.batch_at(tokens, seed=0, step=0, batch_size=2, seq_len=8, vocab=VOCAB,
                          marks=data.load_marks(cfg.data, cfg.train, tokens))  # fmt: skip
    assert set(batch) == {"tokens"}


@pytest.mark.slow
def test_resume_after_kill_9_reads_the_same_batches_masks_and_documents(chat_folder, tmp_path):
    base = [sys.executable, "-m", "jaxpar.cli.main", "train", "--config", "gpt-tiny",
            *chat_run(chat_folder), "parallel.data=8", "train.steps=8",
            "checkpoint.every=1"]  # fmt: skip
    straight = subprocess.run(
        [*base, "--out", str(tmp_path / "straight")], capture_output=True, text=True
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = subprocess.Popen(
        [*base, "--out", str(tmp_path / "killed")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        assert killed.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = subprocess.run(
        [*base, "--out", str(tmp_path / "killed")], capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def rows(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: (r["loss"], r["trained_tokens"]) for r in map(json.loads, lines)}

    assert rows("killed") == rows("straight")
    assert len({t for _, t in rows("straight").values()}) > 1  # the counts differ by step
