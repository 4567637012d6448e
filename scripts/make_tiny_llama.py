"""A tiny random Llama saved as a Hugging Face checkpoint, with a BPE tokenizer trained
on the text CPython ships (pydoc topics), with a ChatML chat template, and that text as
a file: everything the fine-tuning walk-through (docs/fine-tuning.md) needs, without a
download. It needs transformers: `pip install -e '.[hf]'`.

    .venv/bin/python scripts/make_tiny_llama.py --out runs/tiny-llama --corpus-out runs/corpus.txt
"""

import argparse
import json
from pathlib import Path

from jaxpar.data.tokens import corpus_bytes

# ChatML, as Qwen writes it: each turn between <|im_start|>ROLE and <|im_end|>
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tokenizer(folder: Path, text: str, vocab: int) -> None:
    """A byte-level BPE trained on `text`, with ChatML's special tokens and template,
    saved as `tokenizers` and `transformers` read it (tokenizer.json and
    tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder")
    parser.add_argument(
        "--corpus-out",
        type=Path,
        required=True,
        help="where to write the text the tokenizer was trained on (a file this writes)",
    )
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument(
        "--seed", type=int, default=0, help="of the random weights: a rerun writes the same base"
    )
    args = parser.parse_args()
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise SystemExit(
            "make_tiny_llama.py needs transformers and torch: .venv/bin/pip install -e '.[hf]'"
        ) from None

    text = corpus_bytes().decode()
    args.corpus_out.parent.mkdir(parents=True, exist_ok=True)
    args.corpus_out.write_text(text)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    import torch

    torch.manual_seed(args.seed)
    LlamaForCausalLM(config).save_pretrained(args.out)
    save_tokenizer(args.out, text, args.vocab)
    made = "LlamaForCausalLM, a tokenizer with a chat template"
    print(f"wrote {args.out} ({made}) and {args.corpus_out}")


if __name__ == "__main__":
    main()
