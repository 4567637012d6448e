"""Batches are a pure function of (seed, step), for every source."""

import numpy as np
import pytest

from jaxpar.config import presets
from jaxpar.data import tokens as data


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
def test_batch_is_pure_function_of_seed_and_step(source):
    cfg = presets.load("gpt-tiny", [f"data.source={source}"])
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    kw = dict(batch_size=16, seq_len=64, vocab=256)
    a = data.batch_at(tokens, seed=0, step=3, **kw)["tokens"]
    assert a.shape == (16, 65) and a.dtype == np.int32
    assert (a >= 0).all() and (a < 256).all()
    np.testing.assert_array_equal(a, data.batch_at(tokens, seed=0, step=3, **kw)["tokens"])
    assert not np.array_equal(a, data.batch_at(tokens, seed=0, step=4, **kw)["tokens"])
    assert not np.array_equal(a, data.batch_at(tokens, seed=1, step=3, **kw)["tokens"])


def test_corpus_is_embedded_text():
    text = data.corpus_bytes()
    assert len(text) > 200_000
    assert b"def " in text or b"class " in text


def test_user_text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(200)) * 3)
    cfg = presets.load("gpt-tiny", ["data.source=file", f"data.path={path}"])
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    batch = data.batch_at(tokens, seed=0, step=0, batch_size=4, seq_len=64, vocab=256)
    rows = batch["tokens"]
    # Every row is a contiguous window of the file.
    assert all(((row[1:] - row[:-1]) % 200 == 1).all() for row in rows)


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
def test_a_slice_of_rows_is_those_rows_of_the_batch(source):
    """What each of many processes builds: its own rows, equal to the global batch's."""
    cfg = presets.load("gpt-tiny", [f"data.source={source}"])
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    kw = dict(seed=0, step=5, batch_size=16, seq_len=64, vocab=256)
    whole = data.batch_at(tokens, **kw)["tokens"]
    np.testing.assert_array_equal(
        data.batch_at(tokens, rows=slice(8, 16), **kw)["tokens"], whole[8:]
    )


def test_a_file_of_exactly_one_window_trains_on_it(tmp_path):
    """seq_len + 1 ids are one window: seq_len inputs and the target after them."""
    ids = np.arange(65, dtype="<u2")
    (tmp_path / "one.bin").write_bytes(ids.tobytes())
    cfg = presets.load("gpt-tiny", ["data.source=tokens", f"data.path={tmp_path / 'one.bin'}"])
    tokens = data.load_tokens(cfg.data, cfg.train, cfg.model)
    batch = data.batch_at(tokens, seed=0, step=0, batch_size=4, seq_len=64, vocab=256)
    np.testing.assert_array_equal(batch["tokens"], np.tile(ids, (4, 1)))


def test_every_window_is_drawn_the_last_included():
    tokens = np.arange(64 + 3, dtype=np.uint16)  # 3 windows: starts 0, 1, 2
    starts = {
        int(row[0])
        for step in range(20)
        for row in data.batch_at(tokens, seed=0, step=step, batch_size=4, seq_len=64, vocab=256)[
            "tokens"
        ]
    }
    assert starts == {0, 1, 2}
