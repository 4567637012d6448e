"""Bad input to `jaxpar generate` and `jaxpar prepare-data`: every numeric flag their
parsers declare, given values out of any range (generated from the parsers, as
test_bad_input.py generates the config keys'), and the files they read made wrong. Each
exits 2 with one line naming the flag or file, before any model is read; prepare-data
leaves nothing behind, and its retry works."""

import json
from pathlib import Path

import pytest
from helpers import script

from jaxpar.cli import main as cli
from jaxpar.data import tokens as data

BAD_NUMBERS = ("abc", "nan", "-inf", "inf", "-5", "1e30", str(2**70), "9" * 5000)


def numeric_flags(command: str) -> list[str]:
    """The flags of `command` that take a number, as its parser declares them."""
    (sub,) = [a for a in cli._parser()._actions if getattr(a, "choices", None)]
    actions = sub.choices[command]._actions
    return [a.option_strings[0] for a in actions if a.type in (int, float) and a.option_strings]


def refused(argv: list[str], capsys, *needles: str) -> str:
    """The one error line `argv` ends with (after prepare-data's progress bar, where it
    had started), holding each needle."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    progress, _, line = capsys.readouterr().err.rpartition("jaxpar: error: ")
    err = "jaxpar: error: " + line
    assert not progress or progress.startswith("\rprepare-data:"), progress
    assert "Traceback" not in progress and err.count("\n") == 1, err
    assert "Traceback" not in err and len(err) < 1200, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    script("make_tiny_llama").save_tokenizer(folder, data.corpus_bytes().decode()[:20000], 300)
    return folder


GENERATE = [(flag, value) for flag in numeric_flags("generate") for value in BAD_NUMBERS]


@pytest.mark.parametrize(("flag", "value"), GENERATE)
def test_every_numeric_flag_of_generate_has_a_range(flag, value, tokenizer, capsys):
    argv = ["generate", "hf:/no/model", "--tokenizer", str(tokenizer), "--prompt", "hi"]
    refused([*argv, flag, value], capsys, flag)


PREPARE = [(flag, value) for flag in numeric_flags("prepare-data") for value in BAD_NUMBERS]


@pytest.mark.parametrize(("flag", "value"), PREPARE)
def test_every_numeric_flag_of_prepare_data_has_a_range(flag, value, tokenizer, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("some text\n")
    argv = ["prepare-data", str(tmp_path / "in.txt"), "--tokenizer", str(tokenizer)]
    refused([*argv, "--out", str(tmp_path / "out"), flag, value], capsys, flag)
    assert not (tmp_path / "out").exists()


def _broken_tokenizer(tokenizer: Path, tmp: Path, what: str) -> Path:
    """A copy of `tokenizer` with one file made wrong."""
    folder = tmp / f"tokenizer-{what}"
    folder.mkdir()
    for f in tokenizer.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if what == "not-a-tokenizer":
        (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')
    elif what == "config-a-list":
        (folder / "tokenizer_config.json").write_text('["a", "list"]')
    elif what == "template-raises":
        config["chat_template"] = "{{ raise_exception('this template refuses') }}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    elif what == "template-a-number":
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": 5}))
    return folder


# name -> (tokenizer made wrong, or none; the file given, by its bytes; needles)
GENERATE_FILES = {
    "not-a-tokenizer": ("not-a-tokenizer", None, ["tokenizer.json is not a tokenizer"]),
    "config-a-list": ("config-a-list", None, ["tokenizer_config.json holds a JSON list"]),
    "template-raises": ("template-raises", None, ["chat template raised", "this template"]),
    "template-a-number": ("template-a-number", None, ["chat_template is a JSON int"]),
    "binary-prompts": (None, b"\x80\x81\xfe\xff\n", ["--prompts", "not UTF-8 text"]),
    "prompts-not-json": (None, b'{"prompt": "a"\n', ["--prompts", "not JSON"]),
    "prompts-not-objects": (None, b'["a"]\n', ["--prompts", "a JSON object per line"]),
    "prompts-empty": (None, b"\n\n", ["--prompts", "no prompts in it"]),
    "prompts-a-folder": (None, "folder", ["--prompts", "a folder, not a file"]),
}


@pytest.mark.parametrize("case", GENERATE_FILES)
def test_bad_files_to_generate_are_named(case, tokenizer, tmp_path, capsys):
    broken, prompts, needles = GENERATE_FILES[case]
    tok = _broken_tokenizer(tokenizer, tmp_path, broken) if broken else tokenizer
    argv = ["generate", "hf:/no/model", "--tokenizer", str(tok), "--chat"]
    if prompts is None:
        argv += ["--prompt", "What is 1 plus 1?"]
    else:
        path = tmp_path / "prompts.jsonl"
        path.mkdir() if prompts == "folder" else path.write_bytes(prompts)
        argv += ["--prompts", str(path)]
    err = refused(argv, capsys, *needles)
    assert "prepare-data" not in err  # each refusal names the command or flag it is of


def _parquet(path: Path, **columns) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


CHAT = b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
# name -> (tokenizer made wrong, or none; the input's name; what to write there; needles);
# .jsonl is read as chat, the others as text
PREPARE_FILES = {
    "not-a-tokenizer": ("not-a-tokenizer", "in.jsonl", b"", ["tokenizer.json is not a tokenizer"]),
    "binary-chat": (None, "in.jsonl", b"\x80\x81\xfe\xff\n", ["prepare-data", "not UTF-8 text"]),
    "empty-chat": (None, "in.jsonl", b"\n", ["no conversation with an assistant turn"]),
    "no-answer": (
        None, "in.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\n', ["assistant"],
    ),
    "template-raises": (
        "template-raises", "in.jsonl", CHAT, ["chat template raised", "this template refuses"],
    ),
    "template-a-number": ("template-a-number", "in.jsonl", CHAT, ["chat_template is a JSON int"]),
    "empty-text": (None, "in.txt", b"", ["in.txt: no text in it"]),
    "blank-text": (None, "in.txt", b"\n  \n\n", ["in.txt: no text in it"]),
    "binary-text": (None, "in.txt", b"text, then\n\x00\x9f\x92\n", ["in.txt:2: not UTF-8 text"]),
    "a-folder": (None, "in.txt", "folder", ["in.txt: a folder, not a file"]),
    "parquet-garbage": (None, "in.parquet", b"PAR", ["not a Parquet file pyarrow reads"]),
    "parquet-no-text": (
        None, "in.parquet", lambda p: _parquet(p, body=["a"]), ["no `text` column (it has body)"],
    ),
    "parquet-numbers": (
        None, "in.parquet", lambda p: _parquet(p, text=[1, 2]), ["`text` column holds int64"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", PREPARE_FILES)
def test_a_refused_prepare_data_leaves_nothing_and_its_retry_works(
    case, tokenizer, tmp_path, capsys
):
    """Refused at any point, before writing or half way: no --out (nor a partial one)
    is left, and the same command with the cause fixed prepares the data."""
    broken, name, contents, needles = PREPARE_FILES[case]
    tok = _broken_tokenizer(tokenizer, tmp_path, broken) if broken else tokenizer
    source, out, chat = tmp_path / name, tmp_path / "out", name.endswith(".jsonl")
    if contents == "folder":
        source.mkdir()
    elif callable(contents):
        contents(source)
    else:
        source.write_bytes(contents)
    argv = ["prepare-data", str(source), "--out", str(out), *(["--format", "chat"] * chat)]
    refused([*argv, "--tokenizer", str(tok)], capsys, *needles)
    assert sorted(p.name for p in tmp_path.iterdir() if "out" in p.name) == []
    if source.is_dir():
        source.rmdir()
    if source.suffix == ".parquet":
        _parquet(source, text=["some text"])
    else:
        source.write_bytes(CHAT if chat else b"some text\n")
    assert cli.main([*argv, "--tokenizer", str(tokenizer)]) == 0
    assert (out / data.META).is_file()


def test_a_killed_prepare_data_leaves_no_out_and_an_incomplete_one_is_named(
    tokenizer, tmp_path, capsys
):
    """A kill -9 half way leaves the partial folder beside --out, never --out: the next
    run clears it and prepares; the same command again finds it, and another request is
    refused. A folder holding ids but no meta.json (as an older jaxpar left one) is named
    incomplete, not a prepared dataset."""
    (tmp_path / "in.txt").write_text("some text to prepare\n\nand a second paragraph\n")
    out = tmp_path / "out"
    partial = tmp_path / ".out.partial"
    partial.mkdir()
    (partial / "train.bin").write_bytes(b"\0\0")  # what a killed run left
    argv = ["prepare-data", str(tmp_path / "in.txt"), "--tokenizer", str(tokenizer)]
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert (out / data.META).is_file() and not partial.exists()
    capsys.readouterr()  # the same request again finds its dataset: said, exit 0
    assert cli.main([*argv, "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"prepared already {out}: ")
    refused([*argv, "--out", str(out), "--val-fraction", "0.5"], capsys, "from other inputs")
    old = tmp_path / "old"
    old.mkdir()
    (old / "train.bin").write_bytes(b"\0\0")
    refused([*argv, "--out", str(old)], capsys, "holds no complete dataset", "incomplete")


def test_overrides_after_prompt_are_overrides(capsys):
    """Flags and overrides in any order, for generate too: a word after --prompt that sets
    a declared key is an override; any other word is a prompt; overrides alone are not."""
    argv = ["generate", "hf:x", "--tokenizer", "t", "--prompt", "hi", "parallel.tensor=3"]
    args = cli._parse([*argv, "a=b", "--max-new-tokens", "4"])
    assert args.prompt == ["hi", "a=b"] and "parallel.tensor=3" in args.overrides
    refused(["generate", "hf:x", "--tokenizer", "t", "--prompt", "parallel.data=2"], capsys,
            "--prompt: only KEY=VALUE overrides")  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["parallel.tensor=16"], "parallel.tensor=16: generate runs on 8 devices"),
        (["parallel.tensor=-1", "parallel.data=-1"], "both -1"),
        (["parallel.data=0"], "parallel.data=0"),
    ],
)
def test_generate_names_the_degrees_given(overrides, needle):
    """A degree decoding cannot take is named as given (not as the other degree it
    would leave)."""
    from jaxpar.config import presets
    from jaxpar.errors import ConfigError
    from jaxpar.generation import decoding

    with pytest.raises(ConfigError, match=needle):
        decoding.degrees(presets.load("llama-tiny").model, 8, overrides)


def test_a_name_both_a_preset_and_a_file_or_folder_takes_the_preset_and_says_so(
    tmp_path, monkeypatch, capsys
):
    """A run directory called `default` in the working folder: --config default is the
    preset (a folder is never a config); a folder that is no preset is named a folder.
    A file called `gpt-tiny`: the bare name is the preset, ./gpt-tiny the file; each
    time both exist, a note says which was taken."""
    from jaxpar.config import presets
    from jaxpar.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    preset = presets.load("default")
    (tmp_path / "default").mkdir()
    assert presets.load("default") == preset
    assert "--config default is the preset; a folder of that name" in capsys.readouterr().err
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match="--config mine: a directory, not a YAML file"):
        presets.load("mine")
    (tmp_path / "gpt-tiny").write_text("train: {steps: 7}\n")
    assert presets.load("gpt-tiny").train.steps != 7
    note = capsys.readouterr().err
    assert "--config gpt-tiny is the preset; a file of that name is here too" in note
    assert "give ./gpt-tiny to read the file" in note
    assert presets.load("./gpt-tiny").train.steps == 7
    assert capsys.readouterr().err == ""
