"""Tokenized data: `jaxpar prepare-data` with a tokenizer trained here on the built-in
corpus (no download), then `data.source=tokens`, memory-mapped; bad token files refused."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import one_line_error

from jaxpar.cli import main as cli
from jaxpar.config import presets
from jaxpar.data import tokens as data

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(data.corpus_bytes().decode().split("\n\n"), trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _documents() -> list[str]:
    return [d for d in data.corpus_bytes().decode().split("\n\n") if len(d) > 200]


@pytest.fixture(scope="module")
def prepared(tokenizer, tmp_path_factory) -> Path:
    """The corpus as a text file, a JSONL file and a Parquet file, prepared."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs, root = _documents(), tmp_path_factory.mktemp("inputs")
    third = len(docs) // 3
    (root / "a.txt").write_text("\n\n".join(docs[:third]))
    (root / "b.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs[third : 2 * third])
    )
    pq.write_table(pa.table({"text": docs[2 * third :]}), root / "c.parquet")
    out = root / "prepared"
    inputs = [str(root / n) for n in ("a.txt", "b.jsonl", "c.parquet")]
    assert (
        cli.main(
            [
                "prepare-data",
                *inputs,
                "--tokenizer",
                str(tokenizer),
                "--out",
                str(out),
                "--val-fraction",
                "0.05",
            ]
        )  # fmt: skip
        == 0
    )
    return out


def test_prepare_data_writes_ids_a_held_out_split_and_meta(prepared, tokenizer):
    from tokenizers import Tokenizer

    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["dtype"] == "uint16"
    for split in ("train", "val"):
        assert (prepared / f"{split}.bin").stat().st_size == 2 * meta[f"{split}_tokens"]
    assert (
        meta["val_tokens"] > 0
        and meta["documents"] == 1 + len(_documents()) - len(_documents()) // 3
    )
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    text = {
        split: tok.decode(np.fromfile(prepared / f"{split}.bin", np.uint16).tolist())
        for split in ("train", "val")
    }
    docs = _documents()
    once = [d for d in docs if docs.count(d) == 1 and data.corpus_bytes().decode().count(d) == 1]
    held_out = [d for d in once if d in text["val"]]
    assert len(held_out) > 3 and not [d for d in held_out if d in text["train"]]  # never trained on
    assert sum(d in text["train"] for d in once) > 10 * len(held_out)  # 1 in 20 held out


@pytest.mark.slow
def test_trains_on_prepared_tokens(prepared, tmp_path, devices, capsys):
    argv = ["train", "--config", "gpt-tiny", "data.source=tokens", f"data.path={prepared}",
            f"model.vocab={VOCAB}", "train.steps=3", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    assert f"tokens: {prepared}, memory-mapped" in capsys.readouterr().out
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)


def test_a_batch_is_the_same_from_the_map_and_from_memory(prepared):
    cfg = presets.load(
        "gpt-tiny", ["data.source=tokens", f"data.path={prepared}", f"model.vocab={VOCAB}"]
    )
    mapped = data.load_tokens(cfg.data, cfg.train, cfg.model)
    whole = np.fromfile(prepared / "train.bin", np.uint16)
    kw = dict(seed=3, step=7, batch_size=16, seq_len=64, vocab=VOCAB)
    for rows in (slice(None), slice(4, 8)):
        np.testing.assert_array_equal(
            data.batch_at(mapped, rows=rows, **kw)["tokens"],
            data.batch_at(whole, rows=rows, **kw)["tokens"],
        )


def _bad(tmp: Path, name: str, ids, dtype="<u2", raw: bytes | None = None) -> Path:
    path = tmp / name
    path.write_bytes(raw if raw is not None else np.asarray(ids, dtype).tobytes())
    return path


def _npy(tmp: Path, name: str, array: np.ndarray) -> Path:
    np.save(tmp / name, array)
    return tmp / name


# name -> (make the bad path under tmp, or "prepared"; extra overrides; needles)
BAD = {
    "odd-size": (
        lambda t: _bad(t, "odd.bin", None, raw=b"\x01\x00\x02"),
        [],
        ["3 bytes is not a whole number of uint16"],
    ),
    "missing": (lambda t: t / "none.bin", [], ["no such file or folder"]),
    "id-too-big": (
        lambda t: _bad(t, "big.bin", [1, 2, 300] * 100),
        [],
        ["token id 300 at offset 2", "model.vocab=256"],
    ),
    "npy-2d": (lambda t: _npy(t, "x.npy", np.zeros((4, 4), np.uint16)), [], ["shape [4, 4]"]),
    "npy-too-big": (
        lambda t: _npy(t, "y.npy", np.full(500, 999, np.uint32)),
        [],
        ["token id 999 at offset 0"],
    ),
    "vocab-mismatch": (
        "prepared",
        ["model.vocab=256"],
        ["model.vocab=256, but", "meta.json says the tokenizer has 512 ids"],
    ),
    "short": (
        lambda t: _bad(t, "short.bin", [1] * 10),
        [],
        ["has 10 tokens, fewer than train.seq_len+1"],
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_tokens_refused(case, prepared, tmp_path, capsys, devices):
    make, overrides, needles = BAD[case]
    path = prepared if make == "prepared" else make(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--config", "gpt-tiny", "data.source=tokens", f"data.path={path}", *overrides]
    assert cli.main([*argv, "--out", str(out)]) == 2
    one_line_error(capsys, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["nope.txt", "--tokenizer", "{tok}", "--out", "{tmp}/o"], "nope.txt: no such file"),
        (["{tmp}/a.txt", "--tokenizer", "{tmp}", "--out", "{tmp}/o"], "no tokenizer.json there"),
        (["{tmp}/a.txt", "--tokenizer", "{tok}", "--out", "{tmp}/a.txt"], "is a file"),
        (["{tmp}/a.txt", "--tokenizer", "{tok}", "--out", "{tmp}/o", "--val-fraction", "0.6"],
         "--val-fraction 0.6: give a share from 0 (hold nothing out) to 0.5"),
        (["{tmp}/a.txt", "--tokenizer", "{tok}", "--out", "{tmp}/o", "--workers", "0"],
         "--workers 0: give 1 to 1024 processes"),
        (["{tmp}/a.txt", "--tokenizer", "{tok}", "--out", "{tmp}/o", "--workers", "2",
          "--format", "chat"], "--workers 2: --format chat is encoded in one process"),
    ],
)  # fmt: skip
def test_bad_prepare_data_refused(argv, needle, tokenizer, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text\n")
    argv = [a.format(tok=tokenizer, tmp=tmp_path) for a in argv]
    assert cli.main(["prepare-data", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def _prepare(tokenizer: Path, out: Path, *inputs, flags=()) -> dict[str, bytes]:
    argv = ["prepare-data", *map(str, inputs), "--tokenizer", str(tokenizer), "--out", str(out)]
    assert cli.main([*argv, "--val-fraction", "0.1", *flags]) == 0
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def test_workers_1_and_2_write_byte_identical_folders(tokenizer, tmp_path):
    """2,000 paragraphs and 300 JSONL documents (9 chunks of 256 units): two worker
    processes, taking chunks in turn, write what one process does, meta.json included."""
    docs = _documents()
    (tmp_path / "a.txt").write_text("\n\n".join(docs[i % len(docs)][:300] for i in range(2000)))
    (tmp_path / "b.jsonl").write_text(
        "".join(json.dumps({"text": docs[i % len(docs)]}) + "\n" for i in range(300))
    )
    inputs = (tmp_path / "a.txt", tmp_path / "b.jsonl")
    one = _prepare(tokenizer, tmp_path / "one", *inputs, flags=("--workers", "1"))
    two = _prepare(tokenizer, tmp_path / "two", *inputs, flags=("--workers", "2"))
    assert one == two and json.loads(one["meta.json"])["documents"] == 301


def test_a_datasets_folder_reads_as_its_jsonl(tokenizer, tmp_path, capsys):
    """A Dataset `datasets` saved in two Arrow shards prepares to the bytes of the same
    documents as JSONL; a DatasetDict's folder, or one without a text column, exit 2."""
    datasets = pytest.importorskip("datasets")
    docs = _documents()
    saved = datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))})
    saved.save_to_disk(str(tmp_path / "hf"), num_shards=2)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ours = _prepare(tokenizer, tmp_path / "from_hf", tmp_path / "hf")
    theirs = _prepare(tokenizer, tmp_path / "from_jsonl", tmp_path / "docs.jsonl")
    assert {k: v for k, v in ours.items() if k != "meta.json"} == {
        k: v for k, v in theirs.items() if k != "meta.json"
    }
    datasets.DatasetDict({"train": saved, "test": saved}).save_to_disk(str(tmp_path / "dict"))
    saved.rename_column("text", "body").save_to_disk(str(tmp_path / "body"))
    capsys.readouterr()  # datasets' progress bars
    for folder, needle in [
        ("dict", "a DatasetDict (splits train, test); give one split's folder, e.g. "),
        ("body", "no `text` column (it has body, n)"),
    ]:
        argv = ["prepare-data", str(tmp_path / folder), "--tokenizer", str(tokenizer)]
        assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
        one_line_error(capsys, needle)


def test_val_fraction_0_holds_nothing_out(tokenizer, tmp_path, capsys, devices):
    """--val-fraction 0: every paragraph is trained on and val.bin is empty; a run that
    evaluates is refused naming the fix, one that does not reads the whole set."""
    from jaxpar.recipe import setup

    (tmp_path / "a.txt").write_text("\n\n".join(_documents()[:60]))
    out = tmp_path / "o"
    argv = [str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer), "--out", str(out)]
    assert cli.main(["prepare-data", *argv, "--val-fraction", "0"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["val_tokens"] == 0 == (out / "val.bin").stat().st_size
    assert meta["train_tokens"] * 2 == (out / "train.bin").stat().st_size > 0
    run = ["train", "--config", "gpt-tiny", "data.source=tokens", f"data.path={out}",
           f"model.vocab={VOCAB}", "--out", str(tmp_path / "run")]  # fmt: skip
    assert cli.main([*run, "train.eval_every=5"]) == 2
    one_line_error(capsys, "train.eval_every=5 with data.path=", "its val.bin is empty "
                   "(prepared with --val-fraction 0", "set train.eval_every=0")  # fmt: skip
    cfg = presets.load("gpt-tiny", [*run[3:6], "train.eval_every=0"])
    assert len(data.load_tokens(cfg.data, cfg.train, cfg.model)) == meta["train_tokens"]
    s = setup(cfg)
    assert s.eval_batches is None and s.batches(0)["tokens"].shape == (16, 65)


def test_a_second_prepare_into_the_same_folder_is_refused(prepared, tokenizer, capsys):
    argv = [
        "prepare-data",
        str(prepared / "meta.json"),
        "--tokenizer",
        str(tokenizer),
        "--out",
        str(prepared),
    ]
    assert cli.main(argv) == 2
    assert "holds a dataset prepared from other inputs" in capsys.readouterr().err


def _peak_train(
    tmp_path: Path, path: Path, steps: int
) -> tuple[subprocess.CompletedProcess, float]:
    code = (
        "import sys; from jaxpar.cli.main import main; rc = main(sys.argv[1:]); "
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
        "print('PEAK_MB', int(hwm.split()[1]) / 1024); sys.exit(rc)"
    )
    argv = ["train", "--config", "gpt-tiny", "data.source=tokens", f"data.path={path}",
            f"train.steps={steps}", "parallel.data=8", "--out", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    return done, float(
        done.stdout.split("PEAK_MB ")[1].split()[0]
    ) if "PEAK_MB" in done.stdout else -1


@pytest.mark.slow
def test_a_file_larger_than_the_run_could_hold_is_only_mapped(tmp_path):
    """A 2 GB sparse file of valid ids trains with the process's peak memory far below it."""
    big = tmp_path / "big.bin"
    with big.open("wb") as f:
        f.truncate(2 * 2**30)
    done, peak_mb = _peak_train(tmp_path, big, steps=3)
    assert done.returncode == 0, done.stderr[-2000:]
    print(f"2048 MiB of tokens: peak {peak_mb:.0f} MiB")
    assert 0 < peak_mb < 1024, peak_mb  # of a 2048 MiB file


def test_one_tokenizer_ends_text_pairs_and_eval_requests_with_one_token(tmp_path):
    """A vocabulary holding two end-of-text tokens, tokenizer_config.json naming the
    second: pretraining text, preference answers and eval requests all end with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxpar.data import prepare
    from jaxpar.evaluation.text import Text

    words = ["<|endoftext|>", "</s>", *"abcdefghijklmnopqrstuvwxyz ?"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(words[:2])
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    eos = tok.token_to_id("</s>")
    (tmp_path / "a.txt").write_text("one document\n\nanother one\n")
    argv = ["prepare-data", str(tmp_path / "a.txt"), "--tokenizer", str(folder)]
    assert cli.main([*argv, "--out", str(tmp_path / "text")]) == 0
    assert json.loads((tmp_path / "text" / data.META).read_text())["end_of_text_id"] == eos
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "ab", "chosen": "cd", "rejected": "ef"}) + "\n")
    [(pair, _)] = list(prepare._pair_rows([pairs], folder, 64))
    assert [ids[-1] for ids in (pair.chosen, pair.rejected)] == [eos, eos]
    assert Text(folder).eos == eos
