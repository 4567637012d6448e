"""A Hugging Face tokenizer folder read with `tokenizers` alone, as transformers' fast
tokenizer encodes and decodes for lm-eval's `hf` backend: special tokens added as the
tokenizer's post-processor adds them (transformers' default), decoded without them,
with transformers' clean-up of spaces where tokenizer_config.json asks for it."""

from __future__ import annotations

from pathlib import Path

from jaxpar.data import chat
from jaxpar.errors import ConfigError

# transformers' clean-up of decoded text, where tokenizer_config.json asks for it
_CLEAN_UP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


class Text:
    """A Hugging Face tokenizer folder read with `tokenizers`, as transformers' fast
    tokenizer encodes and decodes: its end of text, its BOS, its clean-up setting."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.tok = chat.tokenizer(self.folder)
        self.template = chat.Template(self.folder)
        special = self.template.tokens  # bos_token, eos_token, ... as text
        self.vocab = self.tok.get_vocab_size()
        self.eos = self._id(chat.end_of_text(self.tok, self.template))
        if self.eos is None:
            raise ConfigError(
                f"--tokenizer {self.folder}: no end-of-text token (tokenizer_config.json's "
                "eos_token); lm-eval ends generations and empty contexts with it"
            )
        self.bos = self._id(special.get("bos_token"))
        self.clean_up = chat.settings(self.folder).get("clean_up_tokenization_spaces") is True

    def _id(self, token) -> int | None:
        return None if not isinstance(token, str) else self.tok.token_to_id(token)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids, skip_special: bool = True) -> str:
        text = self.tok.decode(list(ids), skip_special_tokens=skip_special)
        if self.clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def check(self, vocab: int) -> None:
        """The tokenizer against the model's vocabulary."""
        if self.vocab > vocab:
            raise ConfigError(
                f"--tokenizer {self.folder}: {self.vocab} ids, but the model has model.vocab="
                f"{vocab}; give the tokenizer it was trained with"
            )
